"""`microbatch(..., num_real_microbatches=n)`: only the first n micro-batches run.

The reference is always computed directly on exactly the real examples (the rows of the first n
micro-batches: ``i + j·k`` for ``i < n`` with the strided split, the first ``n·b`` rows with the
contiguous one), never by another run of `microbatch`.
"""

import re

import _reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import microbatch
from optax_accum.core import _hlo

TOL = ref.TOL
K, B = 4, 32
PARAMS = ref.mlp_params(0)
_VG = jax.value_and_grad(ref.mlp_loss)
_VG_JIT = jax.jit(_VG)


def _data(batch=B, seed=0):
  return ref.regression_data(seed, batch)


def _real_rows(n, split, k=K, batch=B):
  """The rows of micro-batches 0..n-1, in the order `microbatch` documents."""
  b = batch // k
  if split == "strided":
    return np.array(sorted(i + j * k for i in range(n) for j in range(b)), dtype=np.int64)
  return np.arange(n * b)


def _rows(batch, rows):
  return jax.tree.map(lambda x: x[rows], batch)


def _want(params, batch, n, split):
  """The loss and gradient of exactly the real examples (zeros when there are none)."""
  rows = _real_rows(n, split)
  if not len(rows):
    return jnp.float32(0.0), jax.tree.map(jnp.zeros_like, params)
  return _VG_JIT(params, _rows(batch, rows))


# ----------------------------------------------------------------------------------------------
# Against the real examples, every way of passing the count.


@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("n", [0, 1, 3, K])
def test_microbatch_num_real_python_int_matches_real_examples(n, split):
  batch = _data()
  step = microbatch(_VG, K, num_real_microbatches=n, split=split)
  want = _want(PARAMS, batch, n, split)
  chex.assert_trees_all_close(jax.jit(step)(PARAMS, batch), want, **TOL)
  chex.assert_trees_all_close(step(PARAMS, batch), want, **TOL)  # not jitted


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_traced_num_real_compiles_once_for_every_count(split):
  batch = _data()
  traces = []

  @jax.jit
  def step(params, batch, n):
    traces.append(n)  # runs once per trace, i.e. once per compilation
    return microbatch(_VG, K, num_real_microbatches=n, split=split)(params, batch)

  for n in range(K + 1):
    chex.assert_trees_all_close(step(PARAMS, batch, n), _want(PARAMS, batch, n, split), **TOL)
  # Out of range: clamped into [0, K], as documented.
  chex.assert_trees_all_close(step(PARAMS, batch, -3), _want(PARAMS, batch, 0, split), **TOL)
  chex.assert_trees_all_close(step(PARAMS, batch, K + 5), _want(PARAMS, batch, K, split), **TOL)
  assert len(traces) == 1, f"compiled {len(traces)} times for 7 counts"


def test_microbatch_num_real_device_array_without_jit():
  batch = _data()
  for n in (0, 2):
    step = microbatch(_VG, K, split="strided", num_real_microbatches=jnp.int32(n))
    chex.assert_trees_all_close(step(PARAMS, batch), _want(PARAMS, batch, n, "strided"), **TOL)


def test_microbatch_num_real_with_microbatch_size():
  batch = _data()
  step = jax.jit(
    lambda p, b, n: microbatch(
      _VG, microbatch_size=B // K, split="strided", num_real_microbatches=n
    )(p, b)
  )
  chex.assert_trees_all_close(step(PARAMS, batch, 3), _want(PARAMS, batch, 3, "strided"), **TOL)


# ----------------------------------------------------------------------------------------------
# With weights, keys, state; "concat" and "last".


def test_microbatch_num_real_with_weight_fn_is_token_mean_of_real_examples():
  lengths = np.random.default_rng(3).integers(1, 6, size=B)
  batch, params = ref.token_data(3, lengths, tokens=5), ref.mlp_params(0, (3, 8, 1))

  @jax.jit
  def step(params, batch, n):
    weight_fn = lambda p, b: ref.token_count(b)  # noqa: E731
    step = microbatch(_VG, K, weight_fn=weight_fn, split="strided", num_real_microbatches=n)
    return step(params, batch)

  for n in (1, 3):
    want = _VG_JIT(params, _rows(batch, _real_rows(n, "strided")))
    chex.assert_trees_all_close(step(params, batch, n), want, **TOL)


def test_microbatch_num_real_keys_are_those_of_the_first_micro_batches():
  def fun(x, key):
    data = jax.random.key_data(key)
    return jnp.broadcast_to(data, (x.shape[0], data.shape[-1])), jnp.sum(x)

  x, key = jnp.ones((B, 2)), jax.random.key(0)
  run = jax.jit(
    lambda x, key, n: microbatch(
      fun,
      K,
      batch_argnums=0,
      rng_argnums=1,
      reduction=("concat", "stack"),
      split="strided",
      num_real_microbatches=n,
    )(x, key)
  )
  keys, sums = run(x, key, 2)
  b = B // K
  for i in range(K):  # strided: micro-batch i holds rows i, i+K, ...
    want = np.asarray(jax.random.key_data(jax.random.fold_in(key, i))) if i < 2 else np.zeros(2)
    np.testing.assert_array_equal(np.asarray(keys)[i::K], np.broadcast_to(want, (b, 2)))
  np.testing.assert_array_equal(sums, [2.0 * b, 2.0 * b, 0.0, 0.0])  # one scalar per micro-batch


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_num_real_state_and_last_come_from_the_last_real_micro_batch(split):
  x = np.arange(B, dtype=np.float32) + 1

  def fun(x, s):
    return {"state": s + jnp.sum(x), "first": x[0], "rows": x * 10}

  f = jax.jit(
    lambda x, s, n: microbatch(
      fun,
      K,
      batch_argnums=0,
      state_argnums=1,
      state_out=lambda out: out["state"],
      reduction={"state": "mean", "first": "last", "rows": "concat"},
      split=split,
      num_real_microbatches=n,
    )(x, s)
  )
  b = B // K
  micro = [x[i::K] if split == "strided" else x[i * b : (i + 1) * b] for i in range(K)]
  for n in (0, 1, 3):
    got = f(x, jnp.float32(5.0), n)
    state = 5.0 + sum(float(m.sum()) for m in micro[:n])  # n sequential steps by hand
    rows = np.zeros(B, np.float32)
    rows[_real_rows(n, split)] = x[_real_rows(n, split)] * 10
    chex.assert_trees_all_equal(
      got,
      {"state": np.float32(state), "first": micro[n - 1][0] if n else np.float32(0), "rows": rows},
    )


def test_microbatch_num_real_concat_rows_not_run_are_zeros():
  # As optax.microbatching documents: 12 rows, 4 per micro-batch, 2 real -> 6 non-zero rows.
  x = jnp.arange(12.0) + 1
  got = microbatch(
    lambda x: x,
    microbatch_size=3,
    batch_argnums=0,
    reduction="concat",
    split="strided",
    num_real_microbatches=2,
  )(x)
  want = np.where(np.arange(12) % 4 < 2, np.asarray(x), 0.0)  # strided: rows i + 4j, i < 2
  chex.assert_trees_all_equal(got, want)
  assert int(jnp.sum(got != 0)) == 6


def test_microbatch_num_real_zero_gives_zero_means_and_sums():
  x = jnp.ones((8, 2), jnp.int32)
  got = microbatch(
    lambda x: (jnp.mean(x), jnp.sum(x)), 4, batch_argnums=0, reduction=("mean", "sum")
  )
  got0 = microbatch(
    lambda x: (jnp.mean(x), jnp.sum(x)),
    4,
    batch_argnums=0,
    reduction=("mean", "sum"),
    split="strided",
    num_real_microbatches=0,
  )
  assert got(x) == (1.0, 16)
  mean, total = got0(x)
  assert mean == 0.0 and total == 0 and total.dtype == jnp.int32


# ----------------------------------------------------------------------------------------------
# Across devices: the same count on every device, or one count per device.


def _mesh(devices=8):
  return jax.make_mesh((devices,), ("d",), axis_types=(AxisType.Auto,))


@pytest.mark.parametrize("per_device", [False, True], ids=["same", "per_device"])
def test_microbatch_num_real_with_axis_name(per_device):
  mesh = _mesh()
  batch = _data(batch=8 * B)
  counts = np.array([0, 1, 2, 3, 4, 4, 2, 1]) if per_device else np.full(8, 3)

  def step(params, batch, n):
    step = microbatch(_VG, K, split="strided", num_real_microbatches=n[0], axis_name="d")
    return step(params, batch)

  # The count is replicated (one value, P()) or sharded (one value per device).
  spec = P("d") if per_device else P()
  n = jax.device_put(
    (counts if per_device else counts[:1]).astype(np.int32), NamedSharding(mesh, spec)
  )
  mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), spec), out_specs=P()))
  args = (PARAMS, jax.device_put(batch, NamedSharding(mesh, P("d"))), n)
  got = mapped(*args)
  # Device d holds rows d·B ... (d+1)·B - 1 and runs its first counts[d] micro-batches.
  rows = np.concatenate([d * B + _real_rows(c, "strided") for d, c in enumerate(counts)])
  chex.assert_trees_all_close(got, _VG_JIT(PARAMS, _rows(batch, rows)), **TOL)
  stats = _hlo.hlo_stats(mapped.lower(*args).compile().as_text())
  assert stats.collective_where.get("loop", 0) == 0, stats.collective_where  # reduced after
  assert stats.whiles == 1


def _rows_and_stats(x):
  """Per-example rows, one entry per micro-batch (the same on every device), and the mean."""
  return x * 10, jax.lax.pmax(jnp.max(x), "d"), jnp.mean(x)


@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_microbatch_num_real_contiguous_bound_axis_selects_the_same_rows_regression_issue_17(
  split, explicit
):
  # Issue 17: with the axis bound by microbatch itself under plain jit, each device split its
  # own rows: 16 rows, k=2, 2 devices, n=1 averaged rows 0-3 and 8-11 (5.5) instead of the
  # unbound call's rows 0-7 (3.5). Now every split gives the unbound call's result.
  x = np.arange(16, dtype=np.float32)
  kw = dict(batch_argnums=0, split=split, num_real_microbatches=1)
  unbound = jax.jit(microbatch(jnp.mean, 2, **kw))(x)
  np.testing.assert_allclose(unbound, np.mean(x[_real_rows(1, split, 2, 16)]), **TOL)
  mesh = _mesh(2)
  if explicit:
    mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    assert jax.jit(microbatch(jnp.mean, 2, axis_name="d", **kw))(x) == unbound
    # Per-example rows come back in batch order; a per-micro-batch entry in micro-batch order.
    reduction = ("concat", "stack", "mean")
    f = microbatch(_rows_and_stats, 4, batch_argnums=0, split=split, reduction=reduction,
                   axis_name="d")  # fmt: skip
    rows, maxima, mean = jax.jit(f)(x)
  micro = ref.split(x, 4, strided=split == "strided")
  np.testing.assert_array_equal(rows, x * 10)
  np.testing.assert_array_equal(maxima, [np.max(m) for m in micro])
  np.testing.assert_allclose(mean, np.mean(x), **TOL)


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_bound_axis_every_output_is_the_unbound_calls(split):
  # k=2 on 2 devices: each device runs its piece of micro-batch 0 and 1, and every output is the
  # one of the same call without the axis, for both splits.
  batch, mesh = _data(), _mesh(2)
  reduction = (("mean", "mean"), "concat", "stack")

  def fun(params, batch):
    loss = jax.value_and_grad(ref.mlp_loss)(params, batch)
    return loss, ref.mlp_apply(params, batch["x"]), jax.lax.pmax(jnp.max(batch["y"]), "d")

  def plain(params, batch):  # the same function without an axis
    loss = jax.value_and_grad(ref.mlp_loss)(params, batch)
    return loss, ref.mlp_apply(params, batch["x"]), jnp.max(batch["y"])

  kw = dict(split=split, reduction=reduction, num_real_microbatches=1)
  want = jax.jit(microbatch(plain, 2, **kw))(PARAMS, batch)
  with jax.set_mesh(mesh):
    got = jax.jit(microbatch(fun, 2, axis_name="d", **kw))(PARAMS, batch)
  chex.assert_trees_all_close(got, want, **TOL)


def test_microbatch_contiguous_num_real_inside_a_map_raises():
  mesh = _mesh(2)
  f = microbatch(jnp.mean, 2, batch_argnums=0, split="contiguous", num_real_microbatches=1,
                 axis_name="d")  # fmt: skip
  mapped = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))
  with pytest.raises(ValueError, match=r"split='contiguous' with num_real_microbatches inside a"):
    mapped(np.arange(16, dtype=np.float32))


# ----------------------------------------------------------------------------------------------
# Structure: the loop stops early (program size flat in k: test_microbatch.py).


def _while_lines(compiled_text):
  return [line for line in compiled_text.splitlines() if re.search(r"\bwhile\(", line)]


@pytest.mark.structure
def test_microbatch_traced_num_real_is_a_loop_with_data_dependent_trip_count():
  batch = _data()
  static = jax.jit(microbatch(_VG, K, split="strided", num_real_microbatches=3))
  traced = jax.jit(
    lambda p, b, n: microbatch(_VG, K, split="strided", num_real_microbatches=n)(p, b)
  )
  # The traced program: a while loop (no scan), whose trip count XLA cannot know.
  jaxpr = str(jax.make_jaxpr(traced)(PARAMS, batch, 2))
  assert "while[" in jaxpr and "scan[" not in jaxpr
  (line,) = _while_lines(traced.lower(PARAMS, batch, 2).compile().as_text())
  assert "known_trip_count" not in line, line
  # A Python count: one scan of 3 iterations, a loop of known trip count.
  assert "scan[" in str(jax.make_jaxpr(static)(PARAMS, batch))
  (line,) = _while_lines(static.lower(PARAMS, batch).compile().as_text())
  assert re.search(r'"known_trip_count":\{"n":"3"\}', line), line


# ----------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
  "n, error, match",
  [
    (-1, ValueError, r"num_real_microbatches must be in \[0, num_microbatches=4\], got -1"),
    (5, ValueError, r"num_real_microbatches must be in \[0, num_microbatches=4\], got 5"),
    (np.int64(7), ValueError, r"must be in \[0, num_microbatches=4\], got 7"),
    (2.0, TypeError, r"must be None, an int, or an integer scalar array .* got 2.0 of type float"),
    (True, TypeError, r"got True of type bool"),
    ("2", TypeError, r"got '2' of type str"),
    (jnp.float32(2), TypeError, r"got float32\[\] of type"),
    (jnp.arange(2), TypeError, r"got int32\[2\] of type"),
  ],
)
def test_microbatch_rejects_bad_num_real(n, error, match):
  with pytest.raises(error, match=match):
    microbatch(_VG, K, num_real_microbatches=n)


def test_microbatch_rejects_num_real_above_k_from_microbatch_size():
  f = microbatch(
    lambda x: jnp.sum(x), microbatch_size=4, batch_argnums=0, split="strided",
    num_real_microbatches=3,
  )  # fmt: skip
  assert f(jnp.ones(12)) == 4.0  # k = 3: fine
  with pytest.raises(ValueError, match=r"num_real_microbatches=3 is more than the 2 micro-batches"):
    f(jnp.ones(8))
  with pytest.raises(ValueError, match=r"must be in \[0, num_microbatches\], got -1"):
    microbatch(lambda x: x, microbatch_size=4, num_real_microbatches=-1)
