"""Tests for `microbatch`: every result is compared with the large batch computed directly.

The problem (the MLP, its loss, the regression and token data) and the tolerance are the shared
kit's (`_reference`); the references are direct `jax.value_and_grad` calls on the whole batch.
"""

import re

import _reference as ref
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

TOL = ref.TOL
PARAMS = ref.mlp_params(0)
_VG = jax.value_and_grad(ref.mlp_loss)
_VG_JIT = jax.jit(_VG)  # the reference, compiled once


def _data(n=32, seed=1):
  return ref.regression_data(seed, n)


# ----------------------------------------------------------------------------------------------
# Equivalence with the large batch.


@pytest.mark.parametrize(
  "k, split, jit",
  [(k, s, True) for k in (1, 2, 4, 8, 16) for s in ("strided", "contiguous")]
  + [(4, "strided", False), (8, "contiguous", False)],
)
def test_microbatch_value_and_grad_matches_large_batch(k, split, jit):
  batch = _data()
  want = _VG_JIT(PARAMS, batch)
  step = microbatch(_VG, k, split=split)
  got = (jax.jit(step) if jit else step)(PARAMS, batch)
  chex.assert_trees_all_close(got, want, **TOL)


# Rows 0-3, 4, 8, 12 are long (7 real tokens), the rest short (1 token): for k=4 both splits give
# micro-batches of 28, 10, 10, 10 tokens whose token means differ.
_ROWS = np.arange(16)
_LENGTHS = np.where((_ROWS % 4 == 0) | (_ROWS < 4), 7, 1)
TOKEN_PARAMS = ref.mlp_params(0, (3, 8, 1))


def _tokens(seed=3, lengths=_LENGTHS):
  return ref.token_data(seed, lengths, tokens=7)


def _token_weight(params, batch):
  return ref.token_count(batch)


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_weight_fn_gives_global_token_mean(split):
  batch = _tokens()
  want = _VG_JIT(TOKEN_PARAMS, batch)
  weighted = microbatch(_VG, 4, split=split, weight_fn=_token_weight)
  chex.assert_trees_all_close(jax.jit(weighted)(TOKEN_PARAMS, batch), want, **TOL)
  # Without weights each micro-batch's token mean counts the same: a mean of means, which is
  # not the large batch's token mean when micro-batches hold different numbers of tokens.
  plain = microbatch(_VG, 4, split=split)(TOKEN_PARAMS, batch)
  assert abs(plain[0] - want[0]) > 0.03 * abs(want[0])
  assert ref.max_abs_diff(plain[1], want[1]) > 0.05


def _token_share(params, batch):
  """A micro-batch's share of the batch's 16 · 7 token positions: weights below 1 whose total
  (58/112 here) is below 1 too."""
  return ref.token_count(batch) / 112.0


def _check_token_share_mean():
  batch = _tokens()
  got = jax.jit(microbatch(_VG, 4, weight_fn=_token_share))(TOKEN_PARAMS, batch)
  chex.assert_trees_all_close(got, _VG_JIT(TOKEN_PARAMS, batch), **TOL)


def test_microbatch_weights_below_one_give_the_global_token_mean():
  # The weighted mean does not depend on the weights' scale: shares of the batch give the
  # global token mean too, dividing by a total below 1.
  _check_token_share_mean()


def test_microbatch_weights_below_one_mutation_control(monkeypatch):
  # Issue 42: `maximum(total, 1)` for the core's `total > 0` guard passed this file's other
  # tests; the check above must fail on it.
  normalise = optax_accum.core._core.normalise
  monkeypatch.setattr(
    optax_accum.core._core,
    "normalise",
    lambda sums, total, like, r: normalise(sums, jnp.maximum(total, 1.0), like, r),
  )
  with pytest.raises(AssertionError):
    _check_token_share_mean()


def _stats(params, batch):
  """A loss, and two counts of the micro-batch: real tokens (float) and long rows (int)."""
  return ref.mlp_loss(params, batch), ref.token_count(batch), jnp.sum(batch["mask"][:, 1] > 0)


def test_microbatch_sum_is_weighted_like_accumulate_regression_issue_17():
  # Issue 17: "sum" was Σ fᵢ in microbatch and Σ wᵢ fᵢ in accumulate. Now Σ wᵢ fᵢ in both.
  batch = _tokens()
  reduction = ("mean", "sum", "sum")
  f = microbatch(_stats, 4, reduction=reduction, weight_fn=_token_weight)
  loss, tokens, long_rows = jax.jit(f)(TOKEN_PARAMS, batch)
  micro = ref.split(batch, 4, strided=True)
  w = np.array([np.sum(m["mask"]) for m in micro], np.float64)
  parts = [_stats(TOKEN_PARAMS, m) for m in micro]
  np.testing.assert_allclose(loss, ref.mlp_loss(TOKEN_PARAMS, batch), **TOL)
  np.testing.assert_allclose(tokens, np.sum(w * [float(p[1]) for p in parts]), **TOL)
  np.testing.assert_allclose(long_rows, np.sum(w * [int(p[2]) for p in parts]), **TOL)
  assert long_rows.dtype == jnp.float32  # a weighted sum of counts is not an integer
  # With the default weights 1 it is the plain sum, and an integer count stays an integer.
  _, tokens, long_rows = jax.jit(microbatch(_stats, 4, reduction=reduction))(TOKEN_PARAMS, batch)
  assert tokens == np.sum(batch["mask"]) and long_rows == np.sum(batch["mask"][:, 1] > 0)
  assert long_rows.dtype == jnp.int32


# ----------------------------------------------------------------------------------------------
# k = 1 is the general path: the same contract as k >= 2.


def _k_patterns(x):
  """One output per reduction, an integer mean among them."""
  return {
    "mean": jnp.mean(x),
    "int_mean": jnp.sum(x > 3),
    "sum": jnp.sum(x),
    "rows": 2 * x,
    "per_mb": jnp.mean(x),
    "last": x[0],
  }


_K_REDUCTION = {
  "mean": "mean",
  "int_mean": "mean",
  "sum": "sum",
  "rows": "concat",
  "per_mb": "stack",
  "last": "last",
}


@pytest.mark.parametrize("k", [1, 2])
def test_microbatch_k1_same_contract_as_k2_regression_issue_17(k):
  # Issue 17: k=1 called fun directly: weight_fn never ran (a traced weight -2.5 gave a finite
  # result, a host -1 passed, zero weights gave the value instead of 0), a per-micro-batch
  # scalar came back with shape () instead of (1,), an integer mean stayed int32.
  x = np.arange(8, dtype=np.float32)
  f = jax.jit(microbatch(_k_patterns, k, batch_argnums=0, reduction=_K_REDUCTION))
  out = f(x)
  micro = ref.split(x, k, strided=True)
  assert out["per_mb"].shape == (k,) and out["rows"].shape == (8,)
  assert out["int_mean"].dtype == jnp.float32
  np.testing.assert_allclose(out["int_mean"], np.mean([np.sum(m > 3) for m in micro]), **TOL)
  np.testing.assert_array_equal(out["per_mb"], [np.mean(m) for m in micro])

  def weighted(w):
    return microbatch(jnp.mean, k, batch_argnums=0, weight_fn=lambda x: w + 0 * x[0])

  assert np.isnan(jax.jit(weighted(-2.5))(x))  # a traced invalid weight: NaN, never finite
  assert jax.jit(weighted(0.0))(x) == 0.0  # all-zero weights: zeros, as an empty window
  with pytest.raises(ValueError, match=r"microbatch: weight_fn returned -1.0: weight must be non"):
    microbatch(jnp.mean, k, batch_argnums=0, weight_fn=lambda x: -1.0)(x)


def test_microbatch_k1_matches_fun_and_keeps_shapes_for_size_equal_to_batch():
  batch = _data()
  want = _VG_JIT(PARAMS, batch)
  for step in (microbatch(_VG, 1), microbatch(_VG, microbatch_size=32)):
    chex.assert_trees_all_equal(jax.jit(step)(PARAMS, batch), want)
  by_size = microbatch(_k_patterns, microbatch_size=8, batch_argnums=0, reduction=_K_REDUCTION)
  by_k = microbatch(_k_patterns, 1, batch_argnums=0, reduction=_K_REDUCTION)
  x = np.arange(8, dtype=np.float32)
  chex.assert_trees_all_equal_shapes_and_dtypes(by_size(x), by_k(x))


# ----------------------------------------------------------------------------------------------
# Reductions and order.


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_concat_keeps_original_order(split):
  x = np.arange(24.0, dtype=np.float32).reshape(12, 2)

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
  assert got["total"] == np.sum(x)
  last_row = x[-1] if split == "contiguous" else x[(12 // 3 - 1) * 3 + 2]  # rows 2, 5, 8, 11
  np.testing.assert_array_equal(got["end"], last_row)


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_stack_gives_one_entry_per_microbatch_in_order(split):
  # 12 rows, k=3 (b=4): a scalar and a 2-row summary per micro-batch stacked on a new leading
  # axis in micro-batch order, while the per-example output keeps the original example order.
  k, x = 3, np.arange(24.0, dtype=np.float32).reshape(12, 2)

  def fun(x):
    return {"total": jnp.sum(x), "ends": jnp.stack([x[0], x[-1]]), "rows": 2 * x}

  reduction = {"total": "stack", "ends": "stack", "rows": "concat"}
  got = jax.jit(microbatch(fun, k, batch_argnums=0, split=split, reduction=reduction))(x)
  micro = ref.split(x, k, strided=split == "strided")
  chex.assert_trees_all_equal(
    got,
    {
      "total": np.array([m.sum() for m in micro], np.float32),
      "ends": np.stack([np.stack([m[0], m[-1]]) for m in micro]),
      "rows": 2 * x,
    },
  )


def test_microbatch_stack_never_reorders_regression_issue_17():
  # Issue 17: "concat" guessed per-example vs per-micro-batch from the leading size; a
  # per-micro-batch vector whose length equalled b by coincidence came back scrambled,
  # [2 4 3 5] for [2 3 4 5]. "stack" is asked for by name and keeps micro-batch order.
  x = np.array([2.0, 4.0, 3.0, 5.0], np.float32)  # strided, k=2: micro-batches [2, 3], [4, 5]
  f = microbatch(lambda x: x + 0, 2, batch_argnums=0, reduction="stack")
  np.testing.assert_array_equal(jax.jit(f)(x).reshape(-1), [2.0, 3.0, 4.0, 5.0])
  # "concat" means per-example rows: they come back where the examples were.
  g = microbatch(lambda x: x + 0, 2, batch_argnums=0, reduction="concat")
  np.testing.assert_array_equal(jax.jit(g)(x), x)


@pytest.mark.parametrize(
  "fun, match",
  [
    (jnp.sum, r"output has reduction 'concat' .* leading size of 4 .* but it has shape \(\)"),
    (
      lambda x: x[:2],
      r"leading size of 4 .* shape \(2,\). For one entry per micro-batch .*'stack'",
    ),
  ],
)
def test_microbatch_concat_without_example_rows_raises(fun, match):
  with pytest.raises(ValueError, match=match):
    microbatch(fun, 3, batch_argnums=0, reduction="concat")(np.ones(12, np.float32))


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


# ----------------------------------------------------------------------------------------------
# Non-finite micro-batches.


def _poisoned(micro_index, k=4, n=32):
  """Regression data whose micro-batch `micro_index` (strided) has a NaN target."""
  batch = _data(n)
  batch["y"] = batch["y"].copy()
  batch["y"][micro_index] = np.nan  # row micro_index is in micro-batch micro_index
  return batch


def test_microbatch_skip_nonfinite_drops_and_counts():
  batch = _poisoned(2)
  kept = ref.concat([m for i, m in enumerate(ref.split(batch, 4, strided=True)) if i != 2])
  step = jax.jit(microbatch(_VG, 4, return_info=True))
  (value, grad), info = step(PARAMS, batch)
  chex.assert_trees_all_close((value, grad), _VG_JIT(PARAMS, kept), **TOL)
  assert info.num_skipped == 1 and info.total_weight == 3.0
  # Off: the NaN enters the sums, as `accumulate(..., skip_nonfinite=False)` would.
  value, grad = jax.jit(microbatch(_VG, 4, skip_nonfinite=False))(PARAMS, batch)
  assert np.isnan(value) and np.isnan(grad["w0"]).any()


def test_microbatch_skip_nonfinite_weighted_drops_the_weight_too():
  batch = _tokens()
  batch["y"] = batch["y"].copy()
  batch["y"][1, 0] = np.inf  # a real token of row 1: micro-batch 1 (strided)
  step = jax.jit(microbatch(_VG, 4, weight_fn=_token_weight, return_info=True))
  got, info = step(TOKEN_PARAMS, batch)
  kept = ref.concat([m for i, m in enumerate(ref.split(batch, 4, strided=True)) if i != 1])
  chex.assert_trees_all_close(got, _VG_JIT(TOKEN_PARAMS, kept), **TOL)
  assert info.num_skipped == 1 and info.total_weight == np.sum(kept["mask"])


# ----------------------------------------------------------------------------------------------
# PRNG keys.


def _key_rows(scale, x, key):
  """Per example: the raw data of the key this micro-batch received; and a dropout output."""
  data = key if key.dtype == jnp.uint32 else jax.random.key_data(key)
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.broadcast_to(data, (x.shape[0], data.shape[-1])), jnp.sum(x * keep) * scale


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
@pytest.mark.parametrize("split", ["strided", "contiguous"])
@pytest.mark.parametrize("k", [1, 8])
def test_microbatch_each_microbatch_gets_its_own_key(make_key, split, k):
  x = jnp.ones((32, 5))
  key = make_key(0)
  f = jax.jit(microbatch(_key_rows, k, rng_argnums=2, split=split, reduction=("concat", "sum")))
  keys, dropped = f(1.0, x, key)
  per_mb = keys.reshape(-1, k, keys.shape[-1])[0] if split == "strided" else keys[:: 32 // k]
  given = key if key.dtype == jnp.uint32 else jax.random.key_data(key)
  distinct = {tuple(np.asarray(r)) for r in per_mb}
  assert len(distinct) == k  # no two micro-batches share a key ...
  assert tuple(np.asarray(given)) not in distinct  # ... and none is the given key (k=1 too)
  # Deterministic for a given key, different for another.
  keys2, dropped2 = f(1.0, x, key)
  np.testing.assert_array_equal(keys, keys2)
  assert dropped == dropped2
  assert f(1.0, x, make_key(1))[1] != dropped


def _dropout_loss(params, batch, key):
  keep = jax.random.bernoulli(key, 0.7, batch["y"].shape)
  return jnp.mean((ref.mlp_apply(params, batch["x"]) - batch["y"]) ** 2 * keep / 0.7)


def test_microbatch_dropout_grads_deterministic_per_key():
  batch = _data()
  step = jax.jit(microbatch(jax.value_and_grad(_dropout_loss), 4, rng_argnums=2))
  a, b = step(PARAMS, batch, jax.random.key(7)), step(PARAMS, batch, jax.random.key(7))
  chex.assert_trees_all_equal(a, b)  # the same key: the same masks, bit for bit
  other = step(PARAMS, batch, jax.random.key(8))  # another key: other masks
  assert ref.max_abs_diff(a, other) > 1e-3


# ----------------------------------------------------------------------------------------------
# Threaded state (Flax-style batch_stats).


def _bn_loss(w, batch, stats):
  """A batch-norm-like layer: normalise by the batch's statistics, update running ones."""
  h = batch["x"] @ w
  mean, var = jnp.mean(h, 0), jnp.var(h, 0)
  out = (h - mean) / jnp.sqrt(var + 1e-5)
  new = {"mean": 0.9 * stats["mean"] + 0.1 * mean, "var": 0.9 * stats["var"] + 0.1 * var}
  return jnp.mean(out**2 + out), new


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_state_threads_like_sequential_small_steps(split):
  k, w, batch = 4, PARAMS["w0"], _data()
  stats = {"mean": jnp.zeros(8), "var": jnp.ones(8)}
  vg = jax.jit(jax.value_and_grad(_bn_loss, has_aux=True))
  step = microbatch(vg, k, state_argnums=2, state_out=lambda out: out[0][1], split=split)
  (loss, new_stats), grad = jax.jit(step)(w, batch, stats)

  # k sequential small steps, each seeing the state the previous one left.
  state, losses, grads = stats, [], []
  for mb in ref.split(batch, k, strided=split == "strided"):
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

  model, x = Model(), _data()["x"]
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
  for mb in ref.split(x, 4, strided=True):  # 4 sequential small forward passes
    (v, state), g = vg(variables["params"], mb, state)
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
  for mb in ref.split(x, k, strided=True):  # k sequential small steps, by hand
    losses.append(np.sum(mb))
    want_state += np.sum(mb)
  assert state == want_state == 28.0
  assert loss == np.mean(losses)


@pytest.mark.parametrize(
  "state_out, match",
  [
    (lambda out: out[1] * 2, r"it returned .* at state_out\(out\), not a marker"),
    (lambda out: out[1] + 1, r"it returned .* at state_out\(out\), not a marker"),
    (lambda out: jnp.asarray(out[1], jnp.float32), r"it returned .* not a marker"),
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
# Program size and memory (structure guards: a jaxlib bump that trips them is a performance
# question, not a correctness one).


def _deep_loss(w, x):
  h = x
  for _ in range(6):
    h = jnp.tanh(h @ w)
  return jnp.mean(h**2)


@pytest.mark.structure
def test_microbatch_traced_count_program_size_independent_of_k():
  # A traced num_real_microbatches makes the loop a while loop; its program must not grow with
  # k either (the scan's case: test_structure.py's test_microbatch_body_compiled_once_whatever_k).
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  x = jax.ShapeDtypeStruct((256, 32), jnp.float32)
  n = jax.ShapeDtypeStruct((), jnp.int32)

  def text(k):
    vg = jax.value_and_grad(_deep_loss)
    f = jax.jit(lambda w, x, n: microbatch(vg, k, split="strided", num_real_microbatches=n)(w, x))
    return f.lower(w, x, n).as_text()

  def ops(t):
    return len(re.findall(r"^\s*%\S+ = ", t, flags=re.M))

  t2, t64 = text(2), text(64)
  assert len(t64) <= 1.02 * len(t2)  # one loop body: only shapes/constants differ
  assert ops(t64) <= ops(t2) + 2


@pytest.mark.structure
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


@pytest.mark.structure
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
  batch = _data(32)
  tx = optax_accum.accumulate(optax.sgd(0.5), every_k=2)
  step = microbatch(jax.value_and_grad(jax.checkpoint(ref.mlp_loss)), 4)

  @jax.jit
  def train_step(params, state, batch):
    _, grads = step(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  p, state = PARAMS, tx.init(PARAMS)
  for half in ref.split(batch, 2):  # a window of 2 steps of 16 examples, 4 micro-batches each
    p, state = train_step(p, state, half)
  want, _ = ref.run_steps(optax.sgd(0.5), PARAMS, ref.mlp_loss, [batch])
  chex.assert_trees_all_close(p, want, **TOL)


# ----------------------------------------------------------------------------------------------
# Across devices (light; the distributed tests live in test_distributed.py).


def test_microbatch_axis_name_matches_single_device_large_batch():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  batch = _tokens(3, np.tile(_LENGTHS, 2))  # 32 rows: 4 per device, 2 per micro-batch
  want = _VG_JIT(TOKEN_PARAMS, batch)
  step = microbatch(_VG, 2, weight_fn=_token_weight, axis_name="d")
  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
  data = jax.device_put(batch, NamedSharding(mesh, P("d")))
  chex.assert_trees_all_close(sharded(TOKEN_PARAMS, data), want, **TOL)
  # The reduction runs once, after the loop: no collective inside the scan body.
  jaxpr = jax.make_jaxpr(sharded)(TOKEN_PARAMS, data).jaxpr
  (scan,) = _find(jaxpr, "scan")
  assert not _find(scan.params["jaxpr"].jaxpr, "psum") and _find(jaxpr, "psum")


def test_microbatch_psummed_sum_under_axis_not_multiplied_regression_issue_17():
  # Issue 17: a "sum" output that fun had already psum'd over the axis (the same on every
  # device) came back multiplied by the device count (1984 for 496 on 4 devices), silently.
  mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
  x = np.arange(32, dtype=np.float32)

  def total(x):
    return jax.lax.psum(jnp.sum(x), "d")

  f = microbatch(total, 2, batch_argnums=0, reduction="sum", axis_name="d")
  sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P()))
  with pytest.warns(UserWarning, match=r"microbatch: axis_name='d': these gradients are already"):
    got = sharded(jax.device_put(x, NamedSharding(mesh, P("d"))))
  assert got == np.sum(x) == 496.0
  # Per-device weights cannot be applied to an already reduced value: an error, not a guess.
  g = microbatch(total, 2, batch_argnums=0, reduction="sum", weight_fn=jnp.sum, axis_name="d")
  with pytest.raises(ValueError, match=r"microbatch: `weight` differs per device"):
    jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("d"), out_specs=P()))(x)


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_microbatch_explicit_sharding_matches_large_batch_and_keeps_shardings(split):
  # A mesh of Explicit axes: the loop carry's types include shardings (the weights sharded over
  # "m", the batch over "data"), and every reduction must keep them consistent.
  mesh = jax.make_mesh((4, 2), ("data", "m"), axis_types=(AxisType.Explicit,) * 2)
  w, x = ref.mlp_params(4, (6, 16))["w0"], ref.regression_data(4, 32, d_in=6)["x"]

  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)

  def fun(w, x):
    h = jnp.tanh(x @ w)
    return jax.value_and_grad(loss)(w, x), h, jnp.sum(h, 0), jnp.max(h, 0)

  k = 4
  f = microbatch(fun, k, split=split, reduction=("mean", "concat", "stack", "last"))
  with jax.set_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "m")))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    (value, grad), rows, sums, last = jax.jit(f)(ws, xs)
  micro = ref.split(x, k, strided=split == "strided")
  h = np.tanh(x @ w)
  chex.assert_trees_all_close((value, grad), jax.value_and_grad(loss)(w, x), **TOL)
  chex.assert_trees_all_close(rows, h, **TOL)
  chex.assert_trees_all_close(sums, np.stack([np.tanh(m @ w).sum(0) for m in micro]), **TOL)
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
  with pytest.raises(TypeError, match="batch_argnums must be an int or a sequence of ints"):
    microbatch(_sum, 2, batch_argnums=True)
  with pytest.raises(ValueError, match="batch_argnums has repeated positions"):
    microbatch(_sum, 2, batch_argnums=(1, 1))
  with pytest.raises(ValueError, match="argument 1 is in both batch_argnums and rng_argnums"):
    microbatch(_sum, 2, rng_argnums=1)(1.0, jnp.ones(4))


def test_microbatch_unnamed_batch_argument_error_names_it():
  # Issue 17: a batch argument left out of batch_argnums gave a raw broadcasting error.
  def loss(w, x, y):
    return jnp.mean((x * w - y) ** 2)

  f = microbatch(jax.value_and_grad(loss), 4)  # y (argument 2) is batch data too
  with pytest.raises(
    ValueError,
    match=r"fun failed on one micro-batch \(2 of the batch's 8 rows; batch arguments: "
    r"batch_argnums=\(1,\)\)(.|\n)*Argument 2 is passed whole to every micro-batch(.|\n)*"
    r"batch_argnums=\(1, 2\)",
  ):
    f(1.0, jnp.ones(8), jnp.ones(8))
  # An output with the whole batch's rows under "concat" says the same.
  g = microbatch(lambda w, x, y: y * w, 4, reduction="concat")
  with pytest.raises(ValueError, match=r"Its 8 rows are the whole batch's.*batch_argnums=\(1,\)"):
    g(1.0, jnp.ones(8), jnp.ones(8))


@pytest.mark.parametrize(
  "weight_fn, error, match",
  [
    (lambda w, x: -1.0, ValueError, r"microbatch: weight_fn returned -1.0: weight must be non"),
    (lambda w, x: np.inf, ValueError, r"weight_fn returned inf: weight must be non-negative"),
    (lambda w, x: x, ValueError, r"weight_fn returned float32\[2\]: weight must be a scalar"),
    (lambda w, x: "a", TypeError, r"microbatch: weight_fn returned 'a'"),
  ],
)
def test_microbatch_weight_fn_errors_name_weight_fn(weight_fn, error, match):
  with pytest.raises(error, match=match):
    microbatch(_sum, 2, weight_fn=weight_fn)(1.0, jnp.ones(4))


@pytest.mark.parametrize(
  "reduction, match",
  [
    ("avg", r"reduction = 'avg'. Maybe you meant 'mean'"),
    ("MEAN", r"must be one of \('mean', 'sum', 'concat', 'stack', 'last'\)"),
    (("mean", "stacked"), r"reduction\[1\] = 'stacked'. Maybe you meant 'stack'"),
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


def test_microbatch_rejects_other_bad_options():
  with pytest.raises(ValueError, match="split must be one of"):
    microbatch(_sum, 2, split="interleaved")
  with pytest.raises(TypeError, match="weight_fn must be callable"):
    microbatch(_sum, 2, weight_fn=3.0)
  with pytest.raises(TypeError, match="fun must be callable"):
    microbatch(None, 2)
  with pytest.raises(TypeError, match="skip_nonfinite must be a bool, got 'yes'"):
    microbatch(_sum, 2, skip_nonfinite="yes")
  with pytest.raises(TypeError, match=r"argument 2.* is not a single PRNG key.*float32\[3\]"):
    microbatch(_sum, 2, rng_argnums=2)(1.0, jnp.ones(4), jnp.ones(3))
  with pytest.raises(ValueError, match="state_out is given but state_argnums is empty"):
    microbatch(_sum, 2, state_out=lambda o: o)


# ----------------------------------------------------------------------------------------------
# The gradient noise scale of one step's micro-batches (noise_scale).


def _window_formulas(grads, weights):
  """T and Q of micro-batch gradients `grads` (flat float64 vectors) with `weights`, float64."""
  g, w = np.asarray(grads, np.float64), np.asarray(weights, np.float64)
  total = w.sum()
  mean = (w[:, None] * g).sum(0) / total
  trace = ((w * (g**2).sum(1)).sum() - total * (mean**2).sum()) / (len(g) - 1)
  return trace, (mean**2).sum() - trace / total


def _flat_grad(params, batch):
  grad = jax.jit(jax.grad(ref.mlp_loss))(params, batch)
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(grad)])


@pytest.mark.parametrize("selector", [1, lambda out: out[1]], ids=["int", "selector"])
def test_microbatch_noise_scale_matches_float64_formulas(selector):
  k, batch = 8, _data(32)
  (value, grad), info = jax.jit(microbatch(_VG, k, noise_scale=selector))(PARAMS, batch)
  chex.assert_trees_all_close((value, grad), _VG_JIT(PARAMS, batch), **TOL)  # unchanged
  grads = [_flat_grad(PARAMS, m) for m in ref.split(batch, k, strided=True)]
  trace, grad_sq = _window_formulas(grads, np.ones(k))
  noise = info.noise
  np.testing.assert_allclose(noise.window_trace_cov, trace, rtol=1e-5)
  np.testing.assert_allclose(noise.window_grad_sq, grad_sq, rtol=1e-5)
  np.testing.assert_allclose(noise.b_simple, trace / grad_sq, rtol=1e-5)
  assert noise.trace_cov == noise.window_trace_cov and noise.grad_sq == noise.window_grad_sq


def test_microbatch_noise_scale_weighted_and_dropped_micro_batches():
  batch = _tokens()
  batch["y"] = batch["y"].copy()
  batch["y"][1, 0] = np.nan  # a real token of micro-batch 1 (strided): dropped, not counted
  f = microbatch(_VG, 4, weight_fn=_token_weight, noise_scale=1)
  _, info = jax.jit(f)(TOKEN_PARAMS, batch)
  kept = [m for i, m in enumerate(ref.split(batch, 4, strided=True)) if i != 1]
  grads = [_flat_grad(TOKEN_PARAMS, m) for m in kept]
  trace, grad_sq = _window_formulas(grads, [np.sum(m["mask"]) for m in kept])
  np.testing.assert_allclose(info.noise.window_trace_cov, trace, rtol=1e-5)
  np.testing.assert_allclose(info.noise.window_grad_sq, grad_sq, rtol=1e-5)
  assert info.num_skipped == 1
  # One kept micro-batch estimates no variance: NaN, as documented.
  _, one = jax.jit(microbatch(_VG, 1, noise_scale=1))(PARAMS, _data())
  assert np.isnan(one.noise.b_simple) and np.isnan(one.noise.window_trace_cov)


def test_microbatch_noise_scale_devices_are_more_pieces_of_the_window():
  # 2 devices × k micro-batches give the statistics of 1 device × 2k with the same micro-batches:
  # under shard_map (device d holds micro-batches 4d..4d+3, contiguous) and under plain jit
  # (bound here: device d holds its piece, rows 4d..4d+3, of each 8-row micro-batch). The unit
  # of the default weight is one global micro-batch (issue 22): a device's piece is half of
  # one, so the one-device run weighs each of its micro-batches 1/2 for the same figures.
  batch, mesh = _data(32), jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,))
  one = jax.jit(microbatch(_VG, 8, split="contiguous", noise_scale=1))
  (want, _) = one(PARAMS, batch)
  halves = microbatch(_VG, 8, split="contiguous", noise_scale=1, weight_fn=lambda p, b: 0.5)
  (_, want_info) = jax.jit(halves)(PARAMS, batch)
  f = microbatch(_VG, 4, split="contiguous", noise_scale=1, axis_name="d")
  mapped = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
  in_map = mapped(PARAMS, jax.device_put(batch, NamedSharding(mesh, P("d"))))
  with jax.set_mesh(mesh):
    bound = jax.jit(f)(PARAMS, batch)
  for got, info in (in_map, bound):
    chex.assert_trees_all_close(got, want, **TOL)
    chex.assert_trees_all_close(info.noise, want_info.noise, rtol=1e-5, atol=0)
    assert info.total_weight == 8.0
  text = mapped.lower(PARAMS, jax.device_put(batch, NamedSharding(mesh, P("d")))).compile()
  # The two scalars ride on the one all-reduce after the loop: no other collective.
  assert optax_accum.count_collectives(text.as_text()) == 1


def test_microbatch_rejects_bad_noise_scale():
  with pytest.raises(TypeError, match=r"noise_scale must be None, an int .* got 'grad'"):
    microbatch(_VG, 2, noise_scale="grad")
  g = microbatch(_VG, 2, noise_scale=1, reduction=("mean", "sum"))
  with pytest.raises(ValueError, match=r"noise_scale must select the gradient among the outputs"):
    g(PARAMS, _data())


@pytest.mark.structure
def test_microbatch_noise_scale_adds_no_parameter_sized_memory():
  # A 1 MiB weight: the statistics are two scalars in the loop, never a copy of the gradient.
  w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  x = jax.ShapeDtypeStruct((64, 512), jnp.float32)

  def temp(**kw):
    f = jax.jit(microbatch(jax.value_and_grad(_deep_loss), 4, **kw))
    return f.lower(w, x).compile().memory_analysis().temp_size_in_bytes

  assert temp(noise_scale=1) - temp(return_info=True) < 512 * 512 * 4 // 4
