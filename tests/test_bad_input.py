"""Bad input: a clear error naming the argument, or a counted drop — never a silent wrong answer.

One test per case of the bad-input review (the numbers in the test names), then a property test
over random mixes of valid and invalid weights (host and traced) and non-finite gradients (real
and complex), for every optimizer of the equivalence suite: either an error that names `weight`,
or exactly the large batch of the valid micro-batches with `num_skipped` counting the others.
"""

from __future__ import annotations

import functools
import math

import _reference as ref
import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

# Weights of 3.5e38 and 1e39 are here to overflow float32: that warning is the point.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

SGD = optax.sgd(1.0)


def _tree(seed: int, dtype=np.float32) -> dict:
  rng = np.random.default_rng(seed)
  tree = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
  if np.issubdtype(dtype, np.complexfloating):
    tree = {n: x + 1j * rng.standard_normal(x.shape) for n, x in tree.items()}
  return {n: x.astype(dtype) for n, x in tree.items()}


def _window(tx, grads, weights, params, *, jit=True):
  """Feeds one window of micro-batch gradients (weights traced when `jit`); returns the last
  updates and the state."""
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  for g, w in zip(grads, weights, strict=True):
    updates, state = update(g, state, params, weight=w)
  return updates, state


def _weighted_mean(grads, weights):
  """The large batch's gradient: Σ wᵢ gᵢ / Σ wᵢ over the given micro-batches, in float64."""
  total = sum(weights)
  return jax.tree.map(
    lambda *g: (
      sum(w * np.asarray(x, np.complex128) for w, x in zip(weights, g, strict=True)) / total
    ),
    *grads,
  )


# ----------------------------------------------------------------------------------------------
# 1-2. Weights.


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf])
def test_1_traced_invalid_weight_drops_its_micro_batch_and_counts_it(bad):
  """Under jit a weight is a traced value: it cannot raise, so it drops like a NaN gradient."""
  grads = [_tree(i) for i in range(4)]
  weights = [1.0, bad, 2.0, 3.0]
  updates, state = _window(optax_accum.accumulate(SGD, 4), grads, weights, _tree(9))
  want = _weighted_mean([grads[i] for i in (0, 2, 3)], [1.0, 2.0, 3.0])
  chex.assert_trees_all_close(updates, jax.tree.map(lambda x: -x.real, want), rtol=1e-6)
  assert int(state.num_skipped) == 1 and int(state.gradient_step) == 1


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_1_traced_invalid_weight_drops_whatever_skip_nonfinite_says(skip_nonfinite):
  tx = optax_accum.accumulate(SGD, 2, skip_nonfinite=skip_nonfinite)
  grads = [_tree(0), _tree(1)]
  updates, state = _window(tx, grads, [math.nan, 2.0], _tree(9))
  chex.assert_trees_all_close(updates, jax.tree.map(lambda x: -x, grads[1]), rtol=1e-6)
  assert int(state.num_skipped) == 1


def test_1_train_step_checks_host_weights_before_dispatch_and_drops_device_ones():
  loss = lambda p, x: jnp.sum(p["w"] * x)
  step = optax_accum.TrainStep(loss, SGD, 2)
  params = {"w": np.zeros(3, np.float32)}
  state = step.init(params)
  with pytest.raises(ValueError, match="TrainStep: weight must be non-negative and finite"):
    step(params, state, np.ones(3, np.float32), weight=-1.0)
  xs = [np.full(3, 1.0, np.float32), np.full(3, 5.0, np.float32)]
  params, state, _ = step(params, state, xs[0], weight=jnp.asarray(-1.0))  # a device value
  assert int(state.gradient_step) == 0  # the rejected call took no place in the window
  params, state, _ = step(params, state, xs[1], weight=np.float32(2.0))
  np.testing.assert_allclose(params["w"], -xs[1])  # only the valid micro-batch counts
  assert int(state.num_skipped) == 1 and int(state.gradient_step) == 1


@pytest.mark.parametrize("bad", [3.5e38, 1e39, np.float64(1e300)])
def test_2_host_weight_must_be_representable_in_float32(bad):
  tx = optax_accum.accumulate(SGD, 2)
  params = _tree(0)
  with pytest.raises(ValueError, match=r"weight=.* is not representable in float32"):
    tx.update(_tree(1), tx.init(params), params, weight=bad)
  with pytest.raises(ValueError, match=r"weight=.* is not representable in float32"):
    jax.jit(lambda g, s: tx.update(g, s, params, weight=bad))(_tree(1), tx.init(params))


@pytest.mark.parametrize(
  "weights",
  [(-1.0, 2.0), (1.0, -3.0), (2.0, math.nan), (math.inf, 1.0)],
  ids=["negative-positive-total", "negative-total", "nan", "inf"],
)
def test_3_microbatch_invalid_weights_give_nan_means(weights):
  """A negative, NaN or infinite weight: the weighted outputs are NaN (loud), never the finite
  unnormalised sum the loop holds. "sum" is the weighted sum Σwᵢfᵢ (as in `accumulate`), so it
  is NaN too."""
  x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  w = np.asarray(weights, np.float32)
  fun = lambda x, w: (jnp.mean(x), jnp.sum(x))
  step = optax_accum.microbatch(
    fun, 2, batch_argnums=(0, 1), reduction=("mean", "sum"), weight_fn=lambda x, w: w[0],
    split="contiguous",
  )  # fmt: skip
  mean, total = jax.jit(step)(x, np.repeat(w, 2))  # micro-batch i: rows 2i, 2i+1, weight w[i]
  assert np.isnan(mean)
  assert np.isnan(total)


def test_3_microbatch_all_zero_weights_give_zeros():
  """A fully padded batch (every weight 0): zeros, as documented, not NaN."""
  step = optax_accum.microbatch(
    lambda x, w: jnp.mean(x), 2, batch_argnums=(0, 1), weight_fn=lambda x, w: w[0]
  )
  assert float(jax.jit(step)(np.ones((4, 2), np.float32), np.zeros(4, np.float32))) == 0.0


# ----------------------------------------------------------------------------------------------
# 4-8. Dtypes.


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_4_complex_gradients_keep_their_imaginary_part(dtype):
  with jax.enable_x64(dtype == np.complex128):
    grads = [_tree(i, dtype) for i in range(3)]
    updates, state = _window(
      optax_accum.accumulate(SGD, 3), grads, [1.0, 2.0, 0.5], _tree(9, dtype)
    )
    assert jax.tree.leaves(state.grad_sum)[0].dtype == dtype
    want = jax.tree.map(np.negative, _weighted_mean(grads, [1.0, 2.0, 0.5]))
    chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("value", [complex(np.nan, 0), complex(0, np.nan), complex(0, np.inf)])
def test_4_skip_nonfinite_reads_the_imaginary_part(value):
  grads = [_tree(i, np.complex64) for i in range(2)]
  grads[0]["w"][1, 2] = value
  updates, state = _window(
    optax_accum.accumulate(SGD, 2), grads, [1.0, 1.0], _tree(9, np.complex64)
  )
  chex.assert_trees_all_close(updates, jax.tree.map(np.negative, grads[1]), rtol=1e-6)
  assert int(state.num_skipped) == 1


def test_4_microbatch_complex_means_keep_their_imaginary_part():
  x = (np.arange(8.0) + 1j * np.arange(8.0)[::-1]).astype(np.complex64).reshape(4, 2)
  got = optax_accum.microbatch(lambda x: jnp.mean(x), 2, batch_argnums=0)(x)
  np.testing.assert_allclose(got, np.mean(x), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, np.int8, "int64"])
def test_5_integer_or_bool_accum_dtype_is_rejected_at_construction(dtype):
  match = "accum_dtype must be a floating .*truncate every gradient"
  with pytest.raises(TypeError, match=match):
    optax_accum.accumulate(SGD, 2, accum_dtype=dtype)
  with pytest.raises(TypeError, match=match):
    optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), SGD, 2, accum_dtype=dtype)
  with pytest.raises(TypeError, match=match):
    optax_accum.microbatch(lambda x: x, 2, accum_dtype=dtype)


def test_6_accum_dtype_none_never_narrows_a_wider_gradient():
  """None means the parameters' dtype at init (the gradients' own dtype is known only later):
  bfloat16 parameters with float32 gradients would lose 8 bits per add, so it raises."""
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(0))
  tx = optax_accum.accumulate(SGD, 2, accum_dtype=None)
  with pytest.raises(
    TypeError, match=r"(?s)accum_dtype=None .*\['w'\]: gradient float32, accumulator bfloat16"
  ):
    tx.update(_tree(1), tx.init(params), params)
  # Same dtypes: fine, and accumulated in the gradients' (= parameters') dtype.
  _, state = tx.update(params, tx.init(params), params)
  assert jax.tree.leaves(state.grad_sum)[0].dtype == jnp.bfloat16


def test_7_integer_mean_outputs_are_weighted_exactly():
  """Counts averaged with fractional weights: 0.4·2 + 0.6·5 (not 0·2 + 0·5)."""
  counts = np.array([2, 2, 5, 5], np.int32)
  w = np.array([0.4, 0.4, 0.6, 0.6], np.float32)
  step = optax_accum.microbatch(
    lambda c, w: jnp.sum(c) // 2, 2, batch_argnums=(0, 1), split="contiguous",
    weight_fn=lambda c, w: w[0],
  )  # fmt: skip
  got = jax.jit(step)(counts, w)
  np.testing.assert_allclose(got, 0.4 * 2 + 0.6 * 5, rtol=1e-6)


def test_8_float64_gradients_accumulate_in_float64_and_large_values_are_finite():
  with jax.enable_x64(True):
    grads = [_tree(i, np.float64) for i in range(3)]
    grads[1]["b"][0] = 1e300  # finite in float64: kept
    tx = optax_accum.accumulate(optax.sgd(1.0), 3)  # default accum_dtype=float32
    updates, state = _window(tx, grads, [1.0, 1.0, 1.0], _tree(9, np.float64))
    assert jax.tree.leaves(state.grad_sum)[0].dtype == np.float64
    assert int(state.num_skipped) == 0
    want = jax.tree.map(lambda *g: -np.mean(g, axis=0), *grads)
    chex.assert_trees_all_close(updates, want, rtol=1e-12)


# ----------------------------------------------------------------------------------------------
# 9. Unclear crashes.


def test_9_plan_microbatches_with_an_empty_batch():
  f = jax.value_and_grad(lambda w, x: jnp.mean(x @ w))
  with pytest.raises(ValueError, match="plan_microbatches: the batch arguments are empty"):
    optax_accum.plan_microbatches(f, jnp.ones(3), jnp.ones((0, 3)), memory_limit=1e9)


def test_9_python_float_gradient_leaves_work_like_plain_optax():
  params = {"a": 1.0, "b": np.ones(2, np.float32)}
  grads = [
    {"a": 0.5, "b": np.full(2, 2.0, np.float32)},
    {"a": 1.5, "b": np.full(2, 4.0, np.float32)},
  ]
  updates, state = _window(optax_accum.accumulate(SGD, 2), grads, [1.0, 1.0], params, jit=False)
  chex.assert_trees_all_close(updates, {"a": -1.0, "b": np.full(2, -3.0)})


def test_9_microbatch_output_with_a_python_constant():
  step = optax_accum.microbatch(lambda x: (jnp.mean(x), 2.0, 3), 2, batch_argnums=0)
  mean, two, three = step(np.arange(4.0, dtype=np.float32))
  assert float(mean) == 1.5 and float(two) == 2.0 and float(three) == 3.0


def test_9_init_with_an_axis_name_outside_the_map():
  tx = optax_accum.accumulate(SGD, 2, axis_name="data")
  with pytest.raises(ValueError, match="accumulate.init: axis_name='data' is not bound here"):
    tx.init(_tree(0))


def test_9_a_state_made_for_every_k_1_in_a_window_of_4():
  loss = lambda p, x: jnp.sum(p * x)
  params = np.ones(3, np.float32)
  state = optax_accum.accumulate(SGD, 1).init(params)
  step = optax_accum.TrainStep(loss, SGD, 4)
  with pytest.raises(ValueError, match="made with every_k=1 .* this TrainStep has every_k=4"):
    step(params, state, np.ones(3, np.float32))
  tx = optax_accum.accumulate(SGD, 1)
  with pytest.raises(ValueError, match="made with every_k > 1 .* updated with every_k=1"):
    tx.update(params, optax_accum.accumulate(SGD, 4).init(params), params)


# ----------------------------------------------------------------------------------------------
# 10. Arguments.


@pytest.mark.parametrize("every_k", [np.int64(2), np.int32(2), np.uint8(2)])
def test_10_numpy_integers_are_accepted_everywhere(every_k):
  params = _tree(0)
  tx = optax_accum.accumulate(SGD, every_k)
  updates, state = _window(tx, [_tree(1), _tree(2)], [None, None], params)
  assert int(state.gradient_step) == 1
  optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), SGD, every_k)
  optax_accum.microbatch(lambda x: x, every_k)


@pytest.mark.parametrize("every_k", [2**31, 2**40])
def test_10_every_k_beyond_int32_is_rejected_at_construction(every_k):
  with pytest.raises(ValueError, match=r"every_k must be at most 2147483647 .*got"):
    optax_accum.accumulate(SGD, every_k)
  with pytest.raises(ValueError, match=r"every_k must be at most 2147483647"):
    optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), SGD, every_k)


def test_10_every_k_1_checks_the_gradient_tree_too():
  tx = optax_accum.accumulate(SGD, 1)
  params = _tree(0)
  with pytest.raises(ValueError, match="grads do not match the tree of the parameters"):
    tx.update({"w": params["w"]}, tx.init(params), params)
  with pytest.raises(ValueError, match=r"grads have other shapes than the params:\n  \['b'\]"):
    tx.update({"w": params["w"], "b": np.ones(5, np.float32)}, tx.init(params), params)


@pytest.mark.parametrize("bad", ["False", 1.0, np.ones(2, bool), None])
def test_10_force_emit_must_be_a_bool(bad):
  tx = optax_accum.accumulate(SGD, 2)
  params = _tree(0)
  with pytest.raises(TypeError, match="force_emit must be a bool or a boolean scalar array"):
    tx.update(_tree(1), tx.init(params), params, force_emit=bad)


def test_10_a_schedule_returning_zero_or_less_means_windows_of_one():
  """Documented: a traced length cannot raise; 0 and negative lengths are clamped to 1."""
  grads = [_tree(i) for i in range(3)]
  for length in (0, -3):
    tx = optax_accum.accumulate(SGD, lambda step, n=length: jnp.asarray(n, jnp.int32))
    state = tx.init(_tree(9))
    for g in grads:
      updates, state = jax.jit(tx.update)(g, state, _tree(9))
      chex.assert_trees_all_close(updates, jax.tree.map(np.negative, g))
    assert int(state.gradient_step) == 3


def test_10_lookahead_inside_accumulate_matches_the_large_batch():
  """`optax.lookahead` takes LookaheadParams(fast, slow) but gradients of the fast weights: the
  accumulator follows the gradients, and sync_period counts updates (windows)."""
  inner = optax.lookahead(optax.sgd(0.5), sync_period=2, slow_step_size=0.5)
  params = optax.LookaheadParams.init_synced(_tree(0))
  big = [[_tree(10 * w + i) for i in range(3)] for w in range(4)]
  tx = optax_accum.accumulate(inner, 3)
  p_acc, s_acc = params, tx.init(params)
  p_ref, s_ref = params, inner.init(params)
  for window in big:
    for g in window:
      u, s_acc = tx.update(g, s_acc, p_acc)
      p_acc = optax.apply_updates(p_acc, u)
    mean = jax.tree.map(lambda *g: np.mean(g, axis=0), *window)
    u, s_ref = inner.update(mean, s_ref, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
  chex.assert_trees_all_close(p_acc, p_ref, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# The property: a named error, or the large batch of exactly the valid micro-batches.

K = 3
BAD_WEIGHTS = [-1.0, -1e-30, math.nan, math.inf, -math.inf, 3.5e38]
BAD_GRADS = [math.nan, math.inf, -math.inf]


def _device_float(w: float) -> float:
  """A weight as the device sees it: float32, with subnormals flushed to zero (XLA's CPU and GPU
  arithmetic treats values below float32's smallest normal, 1.2e-38, as 0)."""
  w = float(np.float32(w))
  return 0.0 if abs(w) < np.finfo(np.float32).tiny else w


@functools.cache
def _updates(name: str):
  """The accumulating update under test and the plain inner update, jitted once per optimizer."""
  inner = SGD if name == "sgd_complex" else ref.OPTIMIZERS[name]
  tx = optax_accum.accumulate(inner, K)
  return tx, jax.jit(tx.update), jax.jit(inner.update)


def _poisoned(seed: int, poison) -> dict:
  grads = _tree(seed)
  if poison is not None:
    leaf, index, value = poison
    grads[leaf].reshape(-1)[index % grads[leaf].size] = value
  return grads


@hypothesis.settings(
  max_examples=300,
  deadline=None,
  derandomize=True,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
@hypothesis.given(
  name=st.sampled_from(sorted(ref.OPTIMIZERS)),
  weights=st.lists(
    st.one_of(st.floats(0.0, 10.0), st.sampled_from(BAD_WEIGHTS)), min_size=K, max_size=K
  ),
  host=st.lists(st.booleans(), min_size=K, max_size=K),
  poison=st.lists(
    st.one_of(
      st.none(),
      st.tuples(st.sampled_from(["w", "b"]), st.integers(0, 11), st.sampled_from(BAD_GRADS)),
    ),
    min_size=K,
    max_size=K,
  ),
)
def test_bad_input_property_error_or_the_large_batch_of_the_valid_micro_batches(
  name, weights, host, poison
):
  tx, update, inner_update = _updates(name)
  params = _tree(99)
  grads = [_poisoned(i, p) for i, p in enumerate(poison)]
  state = tx.init(params)
  for g, w, on_host in zip(grads, weights, host, strict=True):
    invalid = not (0 <= w < float("inf")) or not np.isfinite(np.float32(w))
    if on_host and invalid:  # a Python number: checked before anything runs
      with pytest.raises(ValueError, match=r"accumulate.update: weight"):
        tx.update(g, state, params, weight=w)
      return
    updates, state = update(g, state, params, weight=np.float32(w))  # traced
  valid = [
    i
    for i, (w, p) in enumerate(zip(weights, poison, strict=True))
    if p is None and w >= 0 and np.isfinite(np.float32(w))
  ]
  assert int(state.num_skipped) == K - len(valid)
  weight = {i: _device_float(weights[i]) for i in valid}
  total = sum(weight.values())
  if total == 0:  # nothing to apply: zero updates, the inner optimizer untouched
    chex.assert_trees_all_equal(updates, jax.tree.map(np.zeros_like, params))
    assert int(state.gradient_step) == 0
    return
  mean = _weighted_mean([grads[i] for i in valid], [weight[i] for i in valid])
  mean = jax.tree.map(lambda x: x.real.astype(np.float32), mean)
  want, _ = inner_update(mean, ref.OPTIMIZERS[name].init(params), params)
  # float32 sums in another order than the float64 reference: a few ulp of the mean; sign-based
  # optimizers (lion) are exact unless a component is within rounding of 0 (not drawn here).
  chex.assert_trees_all_close(updates, want, rtol=2e-5, atol=1e-6)
  assert int(state.gradient_step) == 1


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(
  weights=st.lists(
    st.one_of(st.floats(0.1, 10.0), st.sampled_from(BAD_WEIGHTS)), min_size=K, max_size=K
  ),  # fmt: skip
  poison=st.lists(
    st.one_of(
      st.none(), st.sampled_from([complex(np.nan, 0), complex(0, np.inf), complex(0, -np.nan)])
    ),
    min_size=K,
    max_size=K,
  ),
)
def test_bad_input_property_complex_gradients(weights, poison):
  tx, update, _ = _updates("sgd_complex")
  params = _tree(99, np.complex64)
  grads = [_tree(i, np.complex64) for i in range(K)]
  for g, p in zip(grads, poison, strict=True):
    if p is not None:
      g["w"][2, 1] = p
  state = tx.init(params)
  for g, w in zip(grads, weights, strict=True):
    updates, state = update(g, state, params, weight=np.float32(w))
  valid = [
    i
    for i in range(K)
    if poison[i] is None and weights[i] >= 0 and np.isfinite(np.float32(weights[i]))
  ]
  assert int(state.num_skipped) == K - len(valid)
  if not valid:
    chex.assert_trees_all_equal(updates, jax.tree.map(np.zeros_like, params))
    return
  want = _weighted_mean([grads[i] for i in valid], [float(np.float32(weights[i])) for i in valid])
  chex.assert_trees_all_close(updates, jax.tree.map(np.negative, want), rtol=1e-5, atol=1e-6)
