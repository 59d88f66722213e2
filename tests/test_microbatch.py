"""Tests for `microbatch`: every result is compared with the large batch computed directly."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import microbatch

# float32 sums of 16-64 terms in another order: a few ulps.
TOL = dict(rtol=1e-5, atol=1e-6)


# Test data come from numpy: eager jax.random calls compile one program each, which is slow.
def _mlp_params(seed=0, sizes=(6, 16, 3)):
  rng = np.random.default_rng(seed)
  return [
    {"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32), "b": jnp.full((b,), 0.1)}
    for a, b in zip(sizes[:-1], sizes[1:], strict=True)
  ]


def _mlp_loss(params, x, y):
  h = x
  for layer in params[:-1]:
    h = jnp.tanh(h @ layer["w"] + layer["b"])
  logits = h @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


_mlp_value_and_grad = jax.jit(jax.value_and_grad(_mlp_loss))  # the reference, compiled once


def _data(batch=32, dim=6, classes=3, seed=1):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
  return x, jnp.asarray(rng.integers(0, classes, size=batch), jnp.int32)


# ----------------------------------------------------------------------------------------------
# Equivalence with the large batch.


@pytest.mark.parametrize(
  "k, split, jit",
  [(k, s, True) for k in (1, 2, 4, 8, 16) for s in ("strided", "contiguous")]
  + [(4, "strided", False), (8, "contiguous", False)],
)
def test_microbatch_value_and_grad_matches_large_batch(k, split, jit):
  params = _mlp_params()
  x, y = _data()
  want = _mlp_value_and_grad(params, x, y)
  step = microbatch(jax.value_and_grad(_mlp_loss), k, batch_argnums=(1, 2), split=split)
  got = (jax.jit(step) if jit else step)(params, x, y)
  chex.assert_trees_all_close(got, want, **TOL)


def _token_loss(w, x, mask):
  """Mean squared error over the real (mask == 1) tokens of the batch."""
  per_token = jnp.sum((x @ w) ** 2, axis=-1)  # (batch, tokens)
  return jnp.sum(per_token * mask) / jnp.sum(mask)


def _token_data(batch=16, tokens=7, dim=4):
  rng = np.random.default_rng(3)
  rows = np.arange(batch)
  # Rows 0-3, 4, 8, 12 are long (7 real tokens, small values), the rest short (1 token, large
  # values): for k=4 both splits give micro-batches of 28, 10, 10, 10 tokens whose means differ.
  long = (rows % 4 == 0) | (rows < 4)
  lengths = np.where(long, tokens, 1)
  x = rng.normal(size=(batch, tokens, dim)) * np.where(long, 0.2, 3.0)[:, None, None]
  w = rng.normal(size=(dim, 2))
  mask = np.arange(tokens)[None, :] < lengths[:, None]
  return jnp.asarray(w, jnp.float32), jnp.asarray(x, jnp.float32), jnp.asarray(mask, jnp.float32)


_token_value_and_grad = jax.jit(jax.value_and_grad(_token_loss))


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_weight_fn_gives_global_token_mean(split):
  w, x, mask = _token_data()
  want = _token_value_and_grad(w, x, mask)
  vg = jax.value_and_grad(_token_loss)
  weighted = microbatch(
    vg, 4, batch_argnums=(1, 2), split=split, weight_fn=lambda w, x, m: jnp.sum(m)
  )
  chex.assert_trees_all_close(jax.jit(weighted)(w, x, mask), want, **TOL)
  # Without weights each micro-batch's token mean counts the same: a mean of means, which is
  # not the large batch's token mean when micro-batches hold different numbers of tokens.
  plain = microbatch(vg, 4, batch_argnums=(1, 2), split=split)(w, x, mask)
  assert abs(plain[0] - want[0]) > 0.05 * abs(want[0])
  assert not np.allclose(plain[1], want[1], rtol=0.05)


def test_microbatch_sum_is_unweighted_and_mean_is_weighted():
  w, x, mask = _token_data()

  def stats(w, x, mask):
    return _token_loss(w, x, mask), jnp.sum(mask), jnp.sum(x[:, 0, 0] > 0)

  f = microbatch(
    stats,
    4,
    batch_argnums=(1, 2),
    reduction=("mean", "sum", "sum"),
    weight_fn=lambda w, x, m: jnp.sum(m),
  )
  loss, tokens, positives = jax.jit(f)(w, x, mask)
  want = stats(w, x, mask)
  np.testing.assert_allclose(loss, want[0], **TOL)
  assert tokens == want[1] and positives == want[2]
  assert positives.dtype == want[2].dtype  # an int count stays an int


# ----------------------------------------------------------------------------------------------
# Reductions and order.


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_concat_keeps_original_order(split):
  x = jnp.arange(24.0).reshape(12, 2)

  def fun(scale, x):
    return {"rows": x * scale, "first": x[:, 0], "total": jnp.sum(x), "end": x[-1]}

  f = microbatch(
    fun,
    3,
    split=split,
    reduction={"rows": "concat", "first": "concat", "total": "sum", "end": "last"},
  )
  got = jax.jit(f)(2.0, x)
  np.testing.assert_array_equal(got["rows"], x * 2.0)
  np.testing.assert_array_equal(got["first"], x[:, 0])
  assert got["total"] == jnp.sum(x)
  last_row = x[-1] if split == "contiguous" else x[(12 // 3 - 1) * 3 + 2]  # rows 2, 5, 8, 11
  np.testing.assert_array_equal(got["end"], last_row)


@pytest.mark.parametrize("split, last", [("strided", [3, 7]), ("contiguous", [6, 7])])
def test_microbatch_split_takes_documented_rows(split, last):
  # 8 rows, k=4: strided micro-batch i holds rows i and i+4; contiguous holds 2i and 2i+1.
  f = microbatch(lambda x: x, 4, batch_argnums=0, split=split, reduction="last")
  np.testing.assert_array_equal(f(jnp.arange(8)), last)


@pytest.mark.parametrize("accum_dtype", [jnp.float32, None])
def test_microbatch_low_precision_outputs_accumulate_in_accum_dtype(accum_dtype):
  x = (jnp.arange(64, dtype=jnp.float32) / 7.0 + 0.3).astype(jnp.bfloat16)
  f = microbatch(
    lambda x: jnp.mean(x), 16, batch_argnums=0, split="contiguous", accum_dtype=accum_dtype
  )
  got = jax.jit(f)(x)
  assert got.dtype == jnp.bfloat16
  acc_dtype = jnp.float32 if accum_dtype is not None else jnp.bfloat16
  acc = jnp.zeros((), acc_dtype)
  for i in range(16):  # the sequential sum, in the accumulator dtype, divided once
    acc = acc + jnp.mean(x[4 * i : 4 * i + 4]).astype(acc_dtype)
  assert got == (acc / jnp.asarray(16.0, acc_dtype)).astype(jnp.bfloat16)


def test_microbatch_k1_calls_fun_directly():
  params = _mlp_params()
  x, y = _data()
  step = microbatch(jax.value_and_grad(_mlp_loss), 1, batch_argnums=(1, 2))
  jaxpr = str(jax.make_jaxpr(step)(params, x, y))
  assert "scan" not in jaxpr and "while" not in jaxpr
  want = _mlp_value_and_grad(params, x, y)
  chex.assert_trees_all_equal(jax.jit(step)(params, x, y), want)


# ----------------------------------------------------------------------------------------------
# PRNG keys.


def _key_rows(scale, x, key):
  """Per example: the raw data of the key this micro-batch received; and a dropout output."""
  data = key if key.dtype == jnp.uint32 else jax.random.key_data(key)
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.broadcast_to(data, (x.shape[0], data.shape[-1])), jnp.sum(x * keep) * scale


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_each_microbatch_gets_its_own_key(make_key, split):
  k, x = 8, jnp.ones((32, 5))
  key = make_key(0)
  f = jax.jit(microbatch(_key_rows, k, rng_argnums=2, split=split, reduction=("concat", "sum")))
  keys, dropped = f(1.0, x, key)
  per_mb = keys.reshape(-1, k, keys.shape[-1])[0] if split == "strided" else keys[:: 32 // k]
  given = key if key.dtype == jnp.uint32 else jax.random.key_data(key)
  distinct = {tuple(np.asarray(r)) for r in per_mb}
  assert len(distinct) == k  # no two micro-batches share a key ...
  assert tuple(np.asarray(given)) not in distinct  # ... and none is the given key itself
  # Deterministic for a given key, different for another.
  keys2, dropped2 = f(1.0, x, key)
  np.testing.assert_array_equal(keys, keys2)
  assert dropped == dropped2
  assert f(1.0, x, make_key(1))[1] != dropped


def test_microbatch_dropout_grads_deterministic():
  def loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.7, (x.shape[0], w.shape[1]))
    return jnp.mean((jnp.tanh(x @ w) * keep / 0.7) ** 2)

  w, x = _mlp_params(5, (6, 4))[0]["w"], _data()[0]
  step = jax.jit(microbatch(jax.value_and_grad(loss), 4, rng_argnums=2))
  a, b = step(w, x, jax.random.key(7)), step(w, x, jax.random.key(7))
  chex.assert_trees_all_equal(a, b)


# ----------------------------------------------------------------------------------------------
# Threaded state (Flax-style batch_stats).


def _bn_loss(w, x, stats):
  """A batch-norm-like layer: normalise by the batch's statistics, update running ones."""
  h = x @ w
  mean, var = jnp.mean(h, 0), jnp.var(h, 0)
  out = (h - mean) / jnp.sqrt(var + 1e-5)
  new = {"mean": 0.9 * stats["mean"] + 0.1 * mean, "var": 0.9 * stats["var"] + 0.1 * var}
  return jnp.mean(out**2 + out), new


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_state_threads_like_sequential_small_steps(split):
  k = 4
  w, (x, _) = _mlp_params(2, (6, 3))[0]["w"], _data()
  stats = {"mean": jnp.zeros(3), "var": jnp.ones(3)}
  vg = jax.jit(jax.value_and_grad(_bn_loss, has_aux=True))
  step = microbatch(vg, k, state_argnums=2, state_out=lambda out: out[0][1], split=split)
  (loss, new_stats), grad = jax.jit(step)(w, x, stats)

  # k sequential small steps, each seeing the state the previous one left.
  state, losses, grads = stats, [], []
  for i in range(k):
    mb = x[i::k] if split == "strided" else x[i * 8 : (i + 1) * 8]
    (value, state), g = vg(w, mb, state)
    losses.append(value)
    grads.append(g)
  np.testing.assert_allclose(loss, np.mean(losses), **TOL)
  np.testing.assert_allclose(grad, np.mean(grads, axis=0), **TOL)
  chex.assert_trees_all_close(new_stats, state, **TOL)


def test_microbatch_threads_flax_batch_stats():
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False, momentum=0.8)(nn.Dense(4)(x))
      return jnp.sum(x**2, axis=-1)

  model, (x, _) = Model(), _data()
  variables = jax.jit(model.init)(jax.random.key(0), x)

  def loss(params, x, batch_stats):
    y, updates = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
    )
    return jnp.mean(y), updates["batch_stats"]

  vg = jax.jit(jax.value_and_grad(loss, has_aux=True))
  step = microbatch(vg, 4, state_argnums=2, state_out=lambda out: out[0][1])
  (value, stats), grads = jax.jit(step)(variables["params"], x, variables["batch_stats"])

  state, values, all_grads = variables["batch_stats"], [], []
  for i in range(4):  # 4 sequential small forward passes, strided rows
    (v, state), g = vg(variables["params"], x[i::4], state)
    values.append(v)
    all_grads.append(g)
  np.testing.assert_allclose(value, np.mean(values), **TOL)
  chex.assert_trees_all_close(
    grads, jax.tree.map(lambda *g: jnp.mean(jnp.stack(g), 0), *all_grads), **TOL
  )
  chex.assert_trees_all_close(stats, state, **TOL)
  assert not np.allclose(
    stats["BatchNorm_0"]["mean"], variables["batch_stats"]["BatchNorm_0"]["mean"]
  )


def _running_sum(w, x, s):
  """A loss and a state that adds up the micro-batch's rows: order-sensitive, easy by hand."""
  return jnp.sum(x * w), s + jnp.sum(x)


@pytest.mark.parametrize(
  "state_out",
  [lambda out: out[1], lambda out: jax.lax.stop_gradient(out[1])],
  ids=["select", "stop_gradient"],
)
def test_microbatch_state_found_by_position_regression_issue_9(state_out):
  # Issue 9: outputs were matched to the state by Python identity, so `stop_gradient(out[1])`
  # (a new object) was not recognised and the state leaf came back as the "mean" of the
  # intermediate states (15.0) instead of the final state (28.0).
  k, x = 4, np.arange(8.0, dtype=np.float32)
  f = microbatch(_running_sum, k, state_argnums=2, state_out=state_out)
  loss, state = jax.jit(f)(1.0, jnp.asarray(x), jnp.float32(0.0))
  want_state, losses = 0.0, []
  for i in range(k):  # k sequential small steps on the strided rows, by hand
    losses.append(np.sum(x[i::k]))
    want_state += np.sum(x[i::k])
  assert state == want_state == 28.0
  assert loss == np.mean(losses)


@pytest.mark.parametrize(
  "state_out, match",
  [
    (lambda out: out[1] * 2, r"it returned .* at state 2, not a marker"),
    (lambda out: out[1] + 1, r"it returned .* at state 2, not a marker"),
    (lambda out: jnp.asarray(out[1], jnp.float32), r"it returned .* at state 2, not a marker"),
    (lambda out: out[1].astype(jnp.float32), r"it raised AttributeError"),
    (lambda out: out["state"], r"it raised TypeError"),
  ],
)
def test_microbatch_rejects_state_out_that_computes(state_out, match):
  f = microbatch(_running_sum, 2, state_argnums=2, state_out=state_out)
  with pytest.raises(ValueError, match=r"state_out must \*select\* the new state(.|\n)*" + match):
    f(1.0, jnp.ones(4), jnp.float32(0.0))


def test_microbatch_rejects_state_out_of_wrong_count_or_tree():
  f = microbatch(_running_sum, 2, state_argnums=(2,), state_out=lambda out: (out[1], out[1]))
  with pytest.raises(ValueError, match=r"state_out returned 2 states for state_argnums=\(2,\)"):
    f(1.0, jnp.ones(4), jnp.float32(0.0))
  f = microbatch(_running_sum, 2, state_argnums=2, state_out=lambda out: out)
  with pytest.raises(ValueError, match="new state for argument 2 has another tree"):
    f(1.0, jnp.ones(4), jnp.float32(0.0))


def test_microbatch_rejects_state_out_of_other_shape():
  f = microbatch(
    lambda w, x, s: (jnp.sum(x), s[:1]), 2, state_argnums=2, state_out=lambda out: out[1]
  )
  with pytest.raises(ValueError, match=r"new state changes shapes:\n  argument 2: new \(1,\)"):
    f(1.0, jnp.ones(4), jnp.ones(3))


def test_microbatch_state_argnums_needs_state_out():
  with pytest.raises(ValueError, match="state_argnums=2 needs `state_out`"):
    microbatch(jax.value_and_grad(_bn_loss, has_aux=True), 2, state_argnums=2)


# ----------------------------------------------------------------------------------------------
# Program size and memory.


def _deep_loss(w, x):
  h = x
  for _ in range(6):
    h = jnp.tanh(h @ w)
  return jnp.mean(h**2)


def test_microbatch_program_size_independent_of_k():
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  x = jax.ShapeDtypeStruct((256, 32), jnp.float32)

  def text(k):
    return jax.jit(microbatch(jax.value_and_grad(_deep_loss), k)).lower(w, x).as_text()

  def ops(t):
    return len(re.findall(r"^\s*%\S+ = ", t, flags=re.M))

  t2, t64 = text(2), text(64)
  assert len(t64) <= 1.02 * len(t2)  # one loop body: only shapes/constants differ
  assert ops(t64) <= ops(t2) + 2


def test_microbatch_temp_memory_falls_as_one_over_k():
  # Activation-dominated: 2048 examples × 6 layers of width 128 vs a 128×128 weight.
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((2048, 128), jnp.float32)

  def temp(k):
    compiled = jax.jit(microbatch(jax.value_and_grad(_deep_loss), k)).lower(w, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  full = temp(1)
  for k in (2, 4, 8):
    assert temp(k) <= 2 * full / k, (k, temp(k), full)


def test_microbatch_no_copy_of_the_batch():
  """Strided split reads micro-batches in place: no full-batch-sized temporary."""
  w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
  x = jax.ShapeDtypeStruct((4096, 16), jnp.float32)  # 256 KiB; activations per mb: 32 KiB
  for split in ("strided", "contiguous"):
    f = jax.jit(microbatch(jax.value_and_grad(_deep_loss), 64, split=split))
    assert f.lower(w, x).compile().memory_analysis().temp_size_in_bytes < 4096 * 16 * 4


# ----------------------------------------------------------------------------------------------
# Composition: jax.checkpoint inside the loss, and an outer `accumulate` window.


def test_microbatch_composes_with_checkpoint_and_accumulate():
  params = _mlp_params()
  x, y = _data(batch=32)

  def loss(params, x, y):
    return jax.checkpoint(_mlp_loss)(params, x, y)

  tx = optax_accum.accumulate(optax.sgd(0.5), every_k=2)
  step = microbatch(jax.value_and_grad(loss), 4, batch_argnums=(1, 2))

  @jax.jit
  def train_step(params, state, x, y):
    _, grads = step(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  p, state = params, tx.init(params)
  for j in range(2):  # a window of 2 steps of 16 examples, each as 4 micro-batches of 4
    p, state = train_step(p, state, x[16 * j : 16 * (j + 1)], y[16 * j : 16 * (j + 1)])
  want = optax.apply_updates(
    params, jax.tree.map(lambda g: -0.5 * g, jax.jit(jax.grad(_mlp_loss))(params, x, y))
  )
  chex.assert_trees_all_close(p, want, **TOL)


# ----------------------------------------------------------------------------------------------
# Across devices (light; the distributed tests live in test_distributed.py).


def test_microbatch_axis_name_matches_single_device_large_batch():
  mesh = jax.make_mesh((8,), ("d",))
  w, x, mask = _token_data(batch=32)
  want = _token_value_and_grad(w, x, mask)
  step = microbatch(
    jax.value_and_grad(_token_loss),
    2,
    batch_argnums=(1, 2),
    weight_fn=lambda w, x, m: jnp.sum(m),
    axis_name="d",
  )
  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P()))
  data = jax.device_put((x, mask), NamedSharding(mesh, P("d")))
  chex.assert_trees_all_close(sharded(w, *data), want, **TOL)
  # The reduction runs once, after the loop: no collective inside the scan body.
  jaxpr = jax.make_jaxpr(sharded)(w, *data).jaxpr
  (scan,) = _find(jaxpr, "scan")
  assert not _find(scan.params["jaxpr"].jaxpr, "psum") and _find(jaxpr, "psum")


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_explicit_sharding_matches_large_batch_and_keeps_shardings(split):
  # A mesh of Explicit axes: the loop carry's types include shardings (the weights sharded over
  # "m", the batch over "data"), and every reduction must keep them consistent.
  mesh = jax.make_mesh((4, 2), ("data", "m"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(4)
  w = rng.normal(size=(6, 16)).astype(np.float32)
  x = rng.normal(size=(32, 6)).astype(np.float32)

  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  def fun(w, x):
    h = jnp.tanh(x @ w)
    return jax.value_and_grad(loss)(w, x), h, jnp.sum(h, 0), jnp.max(h, 0)

  k = 4
  f = microbatch(fun, k, split=split, reduction=("mean", "concat", "concat", "last"))
  with jax.set_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "m")))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    (value, grad), rows, sums, last = jax.jit(f)(ws, xs)
  micro = [x[i::k] if split == "strided" else x[8 * i : 8 * (i + 1)] for i in range(k)]
  h = np.tanh(x @ w)
  chex.assert_trees_all_close(
    (value, grad), jax.value_and_grad(lambda w: fun(w, x)[0][0])(w), **TOL
  )
  chex.assert_trees_all_close(rows, h, **TOL)
  chex.assert_trees_all_close(sums, np.concatenate([np.tanh(m @ w).sum(0) for m in micro]), **TOL)
  chex.assert_trees_all_close(last, np.tanh(micro[-1] @ w).max(0), **TOL)
  assert grad.sharding.spec == P(None, "m")  # the gradient keeps the weights' sharding
  if split == "strided":
    assert rows.sharding.spec == P("data", "m")  # per-example rows keep the batch's sharding


def _find(jaxpr, name):
  """Every equation of primitive `name` in `jaxpr`, nested jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith(name):
      found.append(eqn)
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", param)
      if hasattr(sub, "eqns"):
        found += _find(sub, name)
  return found


# ----------------------------------------------------------------------------------------------
# Bad input.


def _sum(w, x):
  return jnp.sum(x * w)


@pytest.mark.parametrize(
  "k, error, match",
  [
    (0, ValueError, "num_microbatches must be a positive int, got 0"),
    (-2, ValueError, "num_microbatches must be a positive int, got -2"),
    (1.5, TypeError, "num_microbatches must be a positive int, got 1.5 of type float"),
    (True, TypeError, "num_microbatches must be a positive int, got True of type bool"),
    ("4", TypeError, "got '4' of type str"),
  ],
)
def test_microbatch_rejects_bad_k(k, error, match):
  with pytest.raises(error, match=match):
    microbatch(_sum, k)


def test_microbatch_rejects_indivisible_batch():
  f = microbatch(_sum, 4)
  with pytest.raises(
    ValueError, match=r"argument 1 has leading size 10, which is not divisible by num_micro"
  ):
    f(1.0, jnp.ones((10, 2)))


def test_microbatch_rejects_disagreeing_batch_sizes():
  f = microbatch(lambda w, x, y: jnp.sum(x) + jnp.sum(y), 2, batch_argnums=(1, 2))
  with pytest.raises(ValueError, match=r"disagree on the batch size(.|\n)*argument 2: 6"):
    f(1.0, jnp.ones((8, 2)), jnp.ones(6))
  with pytest.raises(ValueError, match=r"argument 1\['b'\]: 4"):
    f(1.0, {"a": jnp.ones(8), "b": jnp.ones(4)}, jnp.ones(8))


def test_microbatch_rejects_scalar_batch_leaf():
  with pytest.raises(ValueError, match=r"needs a batch axis; these are scalars: argument 1"):
    microbatch(_sum, 2)(1.0, jnp.float32(3.0))


@pytest.mark.parametrize("argnums", [2, -3, (1, 5)])
def test_microbatch_rejects_argnums_out_of_range(argnums):
  f = microbatch(_sum, 2, batch_argnums=argnums)
  with pytest.raises(ValueError, match=r"batch_argnums contains -?\d, but the function was called"):
    f(1.0, jnp.ones(4))


def test_microbatch_rejects_bad_argnums_types():
  with pytest.raises(TypeError, match="batch_argnums must be an int or a sequence of ints"):
    microbatch(_sum, 2, batch_argnums="x")
  with pytest.raises(ValueError, match="batch_argnums has repeated positions"):
    microbatch(_sum, 2, batch_argnums=(1, 1))
  with pytest.raises(ValueError, match="argument 1 is in both batch_argnums and rng_argnums"):
    microbatch(_sum, 2, rng_argnums=1)(1.0, jnp.ones(4))


@pytest.mark.parametrize(
  "reduction, match",
  [
    ("avg", r"reduction = 'avg'. Maybe you meant 'mean'"),
    ("MEAN", r"must be one of \('mean', 'sum', 'concat', 'last'\)"),
    (("mean", "stack"), r"reduction\[1\] = 'stack'. Maybe you meant 'concat'"),
    (("mean", 3), r"reduction\[1\] = 3"),
    ((), r"got \(\)"),
  ],
)
def test_microbatch_rejects_bad_reduction_strings(reduction, match):
  with pytest.raises(ValueError, match=match):
    microbatch(_sum, 2, reduction=reduction)


@pytest.mark.parametrize("reduction", [("mean", "sum"), ["mean", "sum", "sum"], {"loss": "mean"}])
def test_microbatch_rejects_reduction_tree_not_matching_output(reduction):
  f = microbatch(lambda w, x: (jnp.sum(x), x, jnp.max(x)), 2, reduction=reduction)
  with pytest.raises(ValueError, match="reduction is not a pytree prefix of fun's output"):
    f(1.0, jnp.ones(4))


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_concat_without_example_rows_joins_in_microbatch_order(split):
  # 12 rows, k=3 (b=4): a scalar and a 2-row summary per micro-batch have no row per example;
  # they are joined in micro-batch order (a scalar becomes a (k,) vector), while the per-example
  # output keeps the original example order.
  k, x = 3, np.arange(24.0, dtype=np.float32).reshape(12, 2)

  def fun(x):
    return {"total": jnp.sum(x), "ends": jnp.stack([x[0], x[-1]]), "rows": 2 * x}

  got = jax.jit(microbatch(fun, k, batch_argnums=0, split=split, reduction="concat"))(x)
  micro = [x[i::k] if split == "strided" else x[4 * i : 4 * (i + 1)] for i in range(k)]
  chex.assert_trees_all_equal(
    got,
    {
      "total": np.array([m.sum() for m in micro], np.float32),
      "ends": np.concatenate([np.stack([m[0], m[-1]]) for m in micro]),
      "rows": 2 * x,
    },
  )


def test_microbatch_rejects_other_bad_options():
  with pytest.raises(ValueError, match="split must be one of"):
    microbatch(_sum, 2, split="interleaved")
  with pytest.raises(TypeError, match="weight_fn must be callable"):
    microbatch(_sum, 2, weight_fn=3.0)
  with pytest.raises(TypeError, match="fun must be callable"):
    microbatch(None, 2)
  with pytest.raises(ValueError, match="weight must be a scalar"):
    microbatch(_sum, 2, weight_fn=lambda w, x: x)(1.0, jnp.ones(4))
  with pytest.raises(TypeError, match=r"argument 2.* is not a single PRNG key.*float32\[3\]"):
    microbatch(_sum, 2, rng_argnums=2)(1.0, jnp.ones(4), jnp.ones(3))
  with pytest.raises(ValueError, match="state_out is given but state_argnums is empty"):
    microbatch(_sum, 2, state_out=lambda o: o)
