"""`microbatch(..., num_real_microbatches=n)`: only the first n micro-batches run.

The reference is always computed directly on exactly the real examples (the rows of the first n
micro-batches: ``i + j·k`` for ``i < n`` with the strided split, the first ``n·b`` rows with the
contiguous one), never by another run of `microbatch`.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _hlo, microbatch

# float32 sums of up to 32 terms in another order: a few ulps.
TOL = dict(rtol=1e-5, atol=1e-6)
K, B = 4, 32


def _data(batch=B, dim=6, classes=3, seed=0):
  rng = np.random.default_rng(seed)
  w = (rng.normal(size=(dim, classes)) / np.sqrt(dim)).astype(np.float32)
  x = rng.normal(size=(batch, dim)).astype(np.float32)
  y = rng.integers(0, classes, size=batch).astype(np.int32)
  return w, x, y


def _loss(w, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(x @ w) * 3, y).mean()


_VG = jax.value_and_grad(_loss)
_VG_JIT = jax.jit(_VG)


def _real_rows(n, split, k=K, batch=B):
  """The rows of micro-batches 0..n-1, in the order `microbatch` documents."""
  b = batch // k
  if split == "strided":
    return np.array(sorted(i + j * k for i in range(n) for j in range(b)), dtype=np.int64)
  return np.arange(n * b)


def _want(w, x, y, n, split):
  """The loss and gradient of exactly the real examples (zeros when there are none)."""
  rows = _real_rows(n, split)
  if not len(rows):
    return jnp.float32(0.0), jnp.zeros_like(jnp.asarray(w))
  return _VG_JIT(w, x[rows], y[rows])


# ----------------------------------------------------------------------------------------------
# Against the real examples, every way of passing the count.


@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("n", [0, 1, 3, K])
def test_microbatch_num_real_python_int_matches_real_examples(n, split):
  w, x, y = _data()
  step = microbatch(_VG, K, batch_argnums=(1, 2), num_real_microbatches=n, split=split)
  want = _want(w, x, y, n, split)
  chex.assert_trees_all_close(jax.jit(step)(w, x, y), want, **TOL)
  chex.assert_trees_all_close(step(w, x, y), want, **TOL)  # not jitted


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_traced_num_real_compiles_once_for_every_count(split):
  w, x, y = _data()
  traces = []

  @jax.jit
  def step(w, x, y, n):
    traces.append(n)  # runs once per trace, i.e. once per compilation
    return microbatch(_VG, K, batch_argnums=(1, 2), num_real_microbatches=n, split=split)(w, x, y)

  for n in range(K + 1):
    chex.assert_trees_all_close(step(w, x, y, n), _want(w, x, y, n, split), **TOL)
  # Out of range: clamped into [0, K], as documented.
  chex.assert_trees_all_close(step(w, x, y, -3), _want(w, x, y, 0, split), **TOL)
  chex.assert_trees_all_close(step(w, x, y, K + 5), _want(w, x, y, K, split), **TOL)
  assert len(traces) == 1, f"compiled {len(traces)} times for 7 counts"


def test_microbatch_num_real_device_array_without_jit():
  w, x, y = _data()
  for n in (0, 2):
    step = microbatch(_VG, K, batch_argnums=(1, 2), num_real_microbatches=jnp.int32(n))
    chex.assert_trees_all_close(step(w, x, y), _want(w, x, y, n, "strided"), **TOL)


def test_microbatch_num_real_with_microbatch_size():
  w, x, y = _data()
  step = jax.jit(
    lambda w, x, y, n: microbatch(
      _VG, microbatch_size=B // K, batch_argnums=(1, 2), num_real_microbatches=n
    )(w, x, y)
  )
  chex.assert_trees_all_close(step(w, x, y, 3), _want(w, x, y, 3, "strided"), **TOL)


# ----------------------------------------------------------------------------------------------
# With weights, keys, state; "concat" and "last".


def test_microbatch_num_real_with_weight_fn_is_token_mean_of_real_examples():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(B, 5, 4)).astype(np.float32)
  lengths = rng.integers(1, 6, size=B)
  mask = (np.arange(5)[None, :] < lengths[:, None]).astype(np.float32)
  w = rng.normal(size=(4, 2)).astype(np.float32)

  def loss(w, x, mask):
    per_token = jnp.sum((x @ w) ** 2, axis=-1)
    return jnp.sum(per_token * mask) / jnp.sum(mask)

  @jax.jit
  def step(w, x, mask, n):
    f = microbatch(
      jax.value_and_grad(loss),
      K,
      batch_argnums=(1, 2),
      weight_fn=lambda w, x, m: jnp.sum(m),
      num_real_microbatches=n,
    )
    return f(w, x, mask)

  for n in (1, 3):
    rows = _real_rows(n, "strided")
    want = jax.value_and_grad(loss)(w, x[rows], mask[rows])
    chex.assert_trees_all_close(step(w, x, mask, n), want, **TOL)


def test_microbatch_num_real_keys_are_those_of_the_first_micro_batches():
  def fun(x, key):
    data = jax.random.key_data(key)
    return jnp.broadcast_to(data, (x.shape[0], data.shape[-1])), jnp.sum(x)

  x, key = jnp.ones((B, 2)), jax.random.key(0)
  run = jax.jit(
    lambda x, key, n: microbatch(
      fun, K, batch_argnums=0, rng_argnums=1, reduction="concat", num_real_microbatches=n
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
    lambda x: x, microbatch_size=3, batch_argnums=0, reduction="concat", num_real_microbatches=2
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
    num_real_microbatches=0,
  )
  assert got(x) == (1.0, 16)
  mean, total = got0(x)
  assert mean == 0.0 and total == 0 and total.dtype == jnp.int32


# ----------------------------------------------------------------------------------------------
# Across devices: the same count on every device, or one count per device.


def _mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS for 8 host devices)")
  return jax.make_mesh((8,), ("d",))


@pytest.mark.parametrize("per_device", [False, True], ids=["same", "per_device"])
def test_microbatch_num_real_with_axis_name(per_device):
  mesh = _mesh()
  w, x, y = _data(batch=8 * B)
  counts = np.array([0, 1, 2, 3, 4, 4, 2, 1]) if per_device else np.full(8, 3)

  def step(w, x, y, n):
    f = microbatch(_VG, K, batch_argnums=(1, 2), num_real_microbatches=n[0], axis_name="d")
    return f(w, x, y)

  # The count is replicated (one value, P()) or sharded (one value per device).
  spec = P("d") if per_device else P()
  n = jax.device_put(
    (counts if per_device else counts[:1]).astype(np.int32), NamedSharding(mesh, spec)
  )
  mapped = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d"), spec), out_specs=P())
  )
  args = (w, *jax.device_put((x, y), NamedSharding(mesh, P("d"))), n)
  got = mapped(*args)
  # Device d holds rows d·B ... (d+1)·B - 1 and runs its first counts[d] micro-batches.
  rows = np.concatenate([d * B + _real_rows(c, "strided") for d, c in enumerate(counts)])
  chex.assert_trees_all_close(got, _VG_JIT(w, x[rows], y[rows]), **TOL)
  stats = _hlo.hlo_stats(mapped.lower(*args).compile().as_text())
  assert stats.collective_where.get("loop", 0) == 0, stats.collective_where  # reduced after
  assert stats.whiles == 1


# ----------------------------------------------------------------------------------------------
# Structure: the loop stops early, and the program does not grow with k.


def _while_lines(compiled_text):
  return [line for line in compiled_text.splitlines() if re.search(r"\bwhile\(", line)]


def test_microbatch_traced_num_real_is_a_loop_with_data_dependent_trip_count():
  w, x, y = _data()
  static = jax.jit(microbatch(_VG, K, batch_argnums=(1, 2), num_real_microbatches=3))
  traced = jax.jit(
    lambda w, x, y, n: microbatch(_VG, K, batch_argnums=(1, 2), num_real_microbatches=n)(w, x, y)
  )
  # The traced program: a while loop (no scan), whose trip count XLA cannot know.
  jaxpr = str(jax.make_jaxpr(traced)(w, x, y, 2))
  assert "while[" in jaxpr and "scan[" not in jaxpr
  (line,) = _while_lines(traced.lower(w, x, y, 2).compile().as_text())
  assert "known_trip_count" not in line, line
  # A Python count: one scan of 3 iterations, a loop of known trip count.
  assert "scan[" in str(jax.make_jaxpr(static)(w, x, y))
  (line,) = _while_lines(static.lower(w, x, y).compile().as_text())
  assert re.search(r'"known_trip_count":\{"n":"3"\}', line), line


def test_microbatch_traced_num_real_program_size_independent_of_k():
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  x = jax.ShapeDtypeStruct((256, 32), jnp.float32)
  n = jax.ShapeDtypeStruct((), jnp.int32)

  def loss(w, x):
    h = x
    for _ in range(6):
      h = jnp.tanh(h @ w)
    return jnp.mean(h**2)

  def text(k):
    f = jax.jit(
      lambda w, x, n: microbatch(jax.value_and_grad(loss), k, num_real_microbatches=n)(w, x)
    )
    return f.lower(w, x, n).as_text()

  def ops(t):
    return len(re.findall(r"^\s*%\S+ = ", t, flags=re.M))

  t2, t64 = text(2), text(64)
  assert len(t64) <= 1.02 * len(t2)  # one loop body: only shapes and constants differ
  assert ops(t64) <= ops(t2) + 2


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
  f = microbatch(lambda x: jnp.sum(x), microbatch_size=4, batch_argnums=0, num_real_microbatches=3)
  assert f(jnp.ones(12)) == 4.0  # k = 3: fine
  with pytest.raises(ValueError, match=r"num_real_microbatches=3 is more than the 2 micro-batches"):
    f(jnp.ones(8))
  with pytest.raises(ValueError, match=r"must be in \[0, num_microbatches\], got -1"):
    microbatch(lambda x: x, microbatch_size=4, num_real_microbatches=-1)
