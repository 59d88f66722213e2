"""The gradient noise scale (`optax_accum.batch_size._noise`), against the math.

The per-micro-batch gradients are made by hand here, so these tests do not depend on how a
front end feeds them in: exactness against the formulas computed independently in float64
NumPy, unbiasedness against a problem whose gradient covariance is known, and the window-length
policy `FollowNoiseScale` on a problem whose critical batch is known.
"""

from __future__ import annotations

import collections
import functools

import _stats as stats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

# ----------------------------------------------------------------------------------------------
from optax_accum.batch_size import _noise
from optax_accum.core import _core

# ----------------------------------------------------------------------------------------------
# Helpers.


def _window(grads, weights, keep=None, ns=None, decay=_noise.DEFAULT_DECAY):
  """One window of hand-made micro-batch gradients through add → partials → close.

  The window's weighted mean is taken as an accumulator would (``Σ wᵢgᵢ / W`` of the kept
  micro-batches, in float32); returns the closed `NoiseState`.
  """
  ns = _noise.init() if ns is None else ns
  keep = [True] * len(grads) if keep is None else keep
  sums = jax.tree.map(jnp.zeros_like, grads[0])
  total = jnp.zeros((), jnp.float32)
  for i, (g, w, kept) in enumerate(zip(grads, weights, keep, strict=True)):
    ns = _noise.add(ns, g, w, kept, restart=jnp.asarray(i == 0))
    if kept:
      sums = jax.tree.map(lambda s, x, w=w: s + w * x, sums, g)
      total = total + w
  mean_sq = _noise.sq_norm(sums) / total**2
  return _noise.close(ns, mean_sq, *_noise.partials(ns), decay=decay)


def _reference(grads, weights):
  """T and Q in float64 NumPy, straight from the formulas."""
  flat = [
    np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)]) for g in grads
  ]
  g = np.stack(flat)
  w = np.asarray(weights, np.float64)
  big_w = w.sum()
  mean = (w[:, None] * g).sum(0) / big_w
  trace = ((w * (g**2).sum(1)).sum() - big_w * (mean**2).sum()) / (len(w) - 1)
  return trace, (mean**2).sum() - trace / big_w


def _grads(seed, k, mean=1.0, spread=0.5):
  rng = np.random.default_rng(seed)
  return [
    {
      "a": jnp.asarray(mean + spread * rng.normal(size=(5, 3)), jnp.float32),
      "b": jnp.asarray(mean + spread * rng.normal(size=(7,)), jnp.float32),
    }
    for _ in range(k)
  ]


# ----------------------------------------------------------------------------------------------
# Exactness.


@pytest.mark.parametrize(
  "weights", [[1.0] * 5, [0.5, 2.0, 1.0, 3.0, 0.25]], ids=["equal", "unequal"]
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_close_matches_float64_formulas(weights, jit):
  grads = _grads(0, len(weights))
  window = jax.jit(_window, static_argnames="keep") if jit else _window
  ns = window(grads, [jnp.float32(w) for w in weights])
  trace, grad_sq = _reference(grads, weights)
  np.testing.assert_allclose(ns.window_trace_cov, trace, rtol=1e-5)
  np.testing.assert_allclose(ns.window_grad_sq, grad_sq, rtol=1e-5)
  # the first window's bias-corrected EMAs are that window's estimates
  got = _noise.scale(ns)
  np.testing.assert_allclose(got.trace_cov, trace, rtol=1e-5)
  np.testing.assert_allclose(got.grad_sq, grad_sq, rtol=1e-5)
  np.testing.assert_allclose(got.b_simple, trace / grad_sq, rtol=1e-5)


def test_close_two_devices_equal_one_device_with_twice_the_micro_batches():
  # Devices are more pieces of one window: each device's partials, summed (what the
  # all-reduce does), with the global total and mean, give the statistics of one window of 2k.
  k = 4
  grads, weights = _grads(1, 2 * k), [1.0, 2.0, 0.5, 1.5, 3.0, 1.0, 0.25, 2.0]
  one = _window(grads, weights)
  devices = [_noise.init(), _noise.init()]
  for d in range(2):
    for i in range(k):
      j = d * k + i
      devices[d] = _noise.add(devices[d], grads[j], weights[j], True, restart=jnp.asarray(i == 0))
  sq_sum, count, weight = (sum(p) for p in zip(*map(_noise.partials, devices), strict=True))
  total = sum(weights)
  np.testing.assert_allclose(weight, total, rtol=1e-7)
  sums = jax.tree.map(lambda *g: sum(w * x for w, x in zip(weights, g, strict=True)), *grads)
  two = _noise.close(devices[0], _noise.sq_norm(sums) / total**2, sq_sum, count, total)
  assert float(count) == 2 * k
  np.testing.assert_allclose(two.window_trace_cov, one.window_trace_cov, rtol=1e-6)
  np.testing.assert_allclose(two.window_grad_sq, one.window_grad_sq, rtol=1e-6)
  trace, grad_sq = _reference(grads, weights)
  np.testing.assert_allclose(two.window_trace_cov, trace, rtol=1e-5)
  np.testing.assert_allclose(two.window_grad_sq, grad_sq, rtol=1e-5)


def test_close_ema_is_bias_corrected():
  decay = 0.9
  first, second = _grads(2, 3), _grads(3, 4)
  ns = _window(first, [1.0] * 3, decay=decay)
  ns = _window(second, [1.0] * 4, ns=ns, decay=decay)
  (t1, q1), (t2, q2) = _reference(first, [1.0] * 3), _reference(second, [1.0] * 4)
  # (1 − β)(β·x₁ + x₂) / ((1 − β)(β + 1)): a weighted mean, no pull towards the zero start
  got = _noise.scale(ns)
  np.testing.assert_allclose(got.trace_cov, (decay * t1 + t2) / (decay + 1), rtol=1e-5)
  np.testing.assert_allclose(got.grad_sq, (decay * q1 + q2) / (decay + 1), rtol=1e-5)
  np.testing.assert_allclose(got.b_simple, (decay * t1 + t2) / (decay * q1 + q2), rtol=1e-5)
  np.testing.assert_allclose(got.window_trace_cov, t2, rtol=1e-5)


def test_add_restart_opens_a_new_window():
  grads = _grads(4, 3)
  ns = _window(grads, [1.0] * 3)
  # a stale window (sq_sum, count from the closed one) is ignored by restart=True ...
  fresh = _noise.add(ns, grads[0], 2.0, True, restart=jnp.asarray(True))
  np.testing.assert_allclose(fresh.sq_sum, 2.0 * _noise.sq_norm(grads[0]), rtol=1e-6)
  assert float(fresh.count) == 1
  # ... and kept by restart=False
  more = _noise.add(ns, grads[0], 2.0, True, restart=jnp.asarray(False))
  assert float(more.count) == 4


def test_add_dropped_micro_batch_changes_nothing():
  ns = _noise.add(_noise.init(), {"w": jnp.array([1.0, 2.0])}, 1.0, True)
  for g, w, keep in [
    ({"w": jnp.array([jnp.nan, 1.0])}, 1.0, False),  # non-finite: dropped by the accumulator
    ({"w": jnp.array([jnp.inf, 1.0])}, 1.0, False),
    ({"w": jnp.array([1.0, 1.0])}, jnp.nan, False),  # an invalid traced weight
    ({"w": jnp.array([1.0, 1.0])}, 0.0, True),  # a zero weight carries no information
  ]:
    after = _noise.add(ns, g, w, keep)
    assert float(after.sq_sum) == 5.0 and float(after.count) == 1.0


@pytest.mark.parametrize("kept", [0, 1])
def test_close_nan_until_a_window_with_two_kept_micro_batches(kept):
  grads = _grads(5, 3)
  ns = _window(grads, [1.0] * 3, keep=[i < kept for i in range(3)])
  assert all(np.isnan(np.asarray(x)) for x in _noise.scale(ns))
  assert float(ns.ema_norm) == 0.0
  # and such a window leaves earlier statistics alone
  good = _window(grads, [1.0] * 3)
  again = _window(grads, [1.0] * 3, keep=[i < kept for i in range(3)], ns=good)
  for a, b in zip(_noise.scale(again), _noise.scale(good), strict=True):
    np.testing.assert_array_equal(a, b)


def test_window_stats_nan_where_nothing_to_estimate():
  t, q = _noise.window_stats(
    jnp.array([10.0, 10.0, 10.0]), jnp.array([1.0, 2.0, 2.0]), jnp.array([2.0, 2.0, 0.0]), 4.0
  )
  np.testing.assert_array_equal(np.isnan(t), [True, False, True])
  np.testing.assert_array_equal(np.isnan(q), [True, False, True])


def test_close_bad_decay():
  ns = _noise.init()
  with pytest.raises(ValueError, match=r"decay must be in \[0, 1\), got 1.0"):
    _noise.close(ns, 1.0, 3.0, 2.0, 2.0, decay=1.0)
  with pytest.raises(TypeError, match="decay must be a float in"):
    _noise.close(ns, 1.0, 3.0, 2.0, 2.0, decay="0.9")


# ----------------------------------------------------------------------------------------------
# sq_norm.


def test_sq_norm_dtypes_against_float64():
  rng = np.random.default_rng(6)
  tree = {
    "f32": jnp.asarray(rng.normal(size=(64, 33)), jnp.float32),
    "bf16": jnp.asarray(rng.normal(size=(1000,)), jnp.bfloat16),
    "c64": jnp.asarray(rng.normal(size=(9,)) + 1j * rng.normal(size=(9,)), jnp.complex64),
    "int": jnp.arange(5),  # not a gradient: left out
    "none": None,
  }
  want = sum(
    float(
      np.sum(
        np.abs(
          np.asarray(
            x.astype(jnp.complex64 if x.dtype == jnp.complex64 else jnp.float32), np.complex128
          )
        )
        ** 2
      )
    )
    for k, x in tree.items()
    if k in ("f32", "bf16", "c64")
  )
  got = _noise.sq_norm(tree)
  assert got.dtype == jnp.float32 and got.shape == ()
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(_noise.sq_norm)(tree), want, rtol=1e-6)
  assert float(_noise.sq_norm({"n": jnp.arange(3)})) == 0.0


@pytest.mark.parametrize("rows_first", [True, False])
@pytest.mark.parametrize("shape", [(96, 40), (3, 3, 8, 16), (1, 70), (70, 1), (0, 4)])
def test_sq_norm_matrix_leaves_against_float64(shape, rows_first, monkeypatch):
  # On CPU a matrix leaf is summed over its rows first (every axis but the last: `_noise._sum`),
  # elsewhere in one reduction (the control, SUM_ROWS_FIRST off): both give the float64 sum
  # to float32 rounding, eagerly and under jit.
  monkeypatch.setattr(_noise, "SUM_ROWS_FIRST", rows_first)
  x = np.random.default_rng(7).normal(size=shape).astype(np.float32)
  want = float(np.sum(np.asarray(x, np.float64) ** 2))
  for f in (_noise.sq_norm, jax.jit(_noise.sq_norm)):
    np.testing.assert_allclose(f({"w": jnp.asarray(x), "b": jnp.ones(3)}), want + 3, rtol=1e-6)


def test_sq_norm_bf16_does_not_round_in_bf16():
  # 4096 squares of 1 + 2⁻⁷: summed or squared in bfloat16 this would lose the fraction
  x = jnp.full((4096,), 1 + 2.0**-7, jnp.bfloat16)
  np.testing.assert_allclose(_noise.sq_norm(x), 4096 * (1 + 2.0**-7) ** 2, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# State size and dtypes.


def test_noise_state_bytes():
  ns = _noise.init()
  nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(ns))
  assert nbytes <= 256, nbytes
  assert all(x.dtype == jnp.float32 and x.shape == () for x in jax.tree.leaves(ns))


def test_noise_state_dtypes_fixed_under_scan_with_bf16_grads():
  grads = jnp.asarray(np.random.default_rng(7).normal(size=(6, 10)), jnp.bfloat16)

  def body(ns, ig):
    i, g = ig
    ns = _noise.add(ns, {"w": g}, jnp.float32(2.0), jnp.asarray(True), restart=i % 3 == 0)
    closed = _noise.close(ns, _noise.sq_norm(g), *_noise.partials(ns))
    return jax.tree.map(lambda a, b: jnp.where(i % 3 == 2, a, b), closed, ns), None

  ns, _ = lax.scan(body, _noise.init(), (jnp.arange(6), grads))
  assert jax.tree.map(lambda x: (x.dtype, x.shape), ns) == jax.tree.map(
    lambda x: (x.dtype, x.shape), _noise.init()
  )
  assert float(ns.ema_norm) > 0


# ----------------------------------------------------------------------------------------------
# noise_scale(state): finding the statistics.

Holder = collections.namedtuple("Holder", ["count", "noise", "inner_state"])


def test_noise_scale_finds_the_statistics_in_a_chain_state():
  ns = _window(_grads(8, 3), [1.0] * 3)
  want = _noise.scale(ns)
  for state in [ns, Holder(1, ns, ()), ((), Holder(1, ns, ()), {"x": 3})]:
    got = _noise.noise_scale(state)
    assert isinstance(got, _noise.NoiseScale)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_array_equal(a, b)


def test_noise_scale_unwraps_nnx_variables():
  nnx = pytest.importorskip("flax.nnx")
  ns = _window(_grads(9, 3), [1.0] * 3)

  def init(params):
    del params
    return Holder(jnp.zeros((), jnp.int32), ns, ())

  tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for state in (opt.opt_state, opt):
    got = _noise.noise_scale(state)
    assert all(isinstance(x, jax.Array) for x in got)
    np.testing.assert_array_equal(got.b_simple, _noise.scale(ns).b_simple)


def test_noise_scale_errors():
  with pytest.raises(ValueError, match="found no noise statistics in a dict"):
    _noise.noise_scale({"a": jnp.zeros(3)})
  with pytest.raises(
    ValueError, match=r"the Holder in this tuple keeps no noise statistics .*noise_scale=True"
  ):
    _noise.noise_scale((Holder(1, None, ()),))
  with pytest.raises(ValueError, match="exactly one NoiseState, found 2 in a tuple"):
    _noise.noise_scale((_noise.init(), Holder(1, _noise.init(), ())))


# ----------------------------------------------------------------------------------------------
# next_k.


def _measured(b_simple, grad_sq=1.0):
  """A NoiseState whose smoothed figures give `b_simple`."""
  return _noise.init()._replace(
    grad_sq_ema=jnp.float32(grad_sq),
    trace_ema=jnp.float32(b_simple * grad_sq),
    ema_norm=jnp.float32(1.0),
  )


def test_next_k_clips_rounds_and_ramps():
  policy = _noise.FollowNoiseScale(min_k=2, max_k=16, max_growth=float("inf"))
  for b, current, want in [
    (5.4, 2, 5),  # rounds
    (5.6, 2, 6),
    (0.3, 2, 2),  # clipped to min_k
    (1000.0, 2, 16),  # clipped to max_k
    (3.0, 8, 8),  # never shrinks ...
  ]:
    assert int(_noise.next_k(policy, _measured(b), current)) == want, (b, current)
  shrink = policy._replace(shrink=True)
  assert int(_noise.next_k(shrink, _measured(3.0), 8)) == 3  # ... unless asked
  # units: with 4 examples per micro-batch, B_simple = 22 examples is 6 micro-batches (5.5)
  examples = _noise.FollowNoiseScale(
    min_k=1, max_k=16, micro_batch_weight=4, max_growth=float("inf")
  )
  assert int(_noise.next_k(examples, _measured(22.0), 1)) == 6
  # the ramp: at most ceil(k · max_growth), and always at least one more
  ramp = _noise.FollowNoiseScale(min_k=1, max_k=64)
  assert [int(_noise.next_k(ramp, _measured(50.0), k)) for k in (1, 2, 4, 10)] == [2, 3, 5, 13]
  assert (
    jax.jit(_noise.next_k, static_argnums=0)(ramp, _measured(50.0), jnp.int32(10)).dtype
    == jnp.int32
  )


def test_next_k_keeps_k_without_a_usable_estimate():
  policy = _noise.FollowNoiseScale(min_k=2, max_k=16, shrink=True)
  for ns in (
    _noise.init(),  # nothing measured: NaN
    _measured(-3.0),  # smoothed |G|² < 0: noise swamps the gradient at this window size
    _measured(3.0, grad_sq=0.0),  # ±inf
  ):
    assert int(_noise.next_k(policy, ns, 7)) == 7
  # ... but stays within [min_k, max_k] whatever k came in
  assert int(_noise.next_k(policy, _noise.init(), 40)) == 16
  assert int(_noise.next_k(policy, _noise.init(), 1)) == 2


def test_follow_noise_scale_bad_arguments():
  cases = [
    (dict(min_k=0), ValueError, "FollowNoiseScale: min_k must be a positive int, got 0"),
    (dict(min_k=2.0), TypeError, "min_k must be a positive int, got 2.0"),
    (dict(min_k=4, max_k=2), ValueError, "max_k must be >= min_k, got max_k=2 < min_k=4"),
    (dict(max_k="8"), TypeError, "max_k must be a positive int or None"),
    (
      dict(micro_batch_weight=0),
      ValueError,
      "micro_batch_weight must be positive and finite, got 0",
    ),
    (dict(micro_batch_weight=True), TypeError, "micro_batch_weight must be a number"),
    (dict(shrink=1), TypeError, "shrink must be a bool, got 1"),
    (dict(max_growth=1.0), ValueError, r"max_growth must be > 1 \(inf: no limit\), got 1.0"),
  ]
  for kwargs, error, match in cases:
    with pytest.raises(error, match=match):
      _noise.FollowNoiseScale(**kwargs)
  with pytest.raises(TypeError, match="policy must be a FollowNoiseScale, got tuple"):
    _noise.next_k((1, 2), _noise.init(), 1)


def test_follow_noise_scale_is_a_hashable_named_tuple():
  policy = _noise.FollowNoiseScale(min_k=2, max_k=32)
  assert (
    policy.min_k == 2
    and policy.max_k == 32
    and policy._fields[:4]
    == (
      "min_k",
      "max_k",
      "micro_batch_weight",
      "shrink",
    )
  )
  assert hash(policy) == hash(_noise.FollowNoiseScale(min_k=2, max_k=32))


# ----------------------------------------------------------------------------------------------
# Unbiasedness against a known truth.
#
# The quadratic loss ½|w − x|² with x ~ N(μ, s²I) in D dimensions: the per-example gradient is
# w − x, so G = w − μ and the per-example covariance is s²I, tr Σ = D·s². A micro-batch of b
# examples has mean gradient ~ N(G, s²I / b). At w = 0, G = −μ.

D, S2, G2 = 256, 1.0, 8.0  # tr Σ = 256 per example, |G|² = 8: B_simple = 32 examples
K, MAX_B, WINDOWS = 8, 8, 400


@jax.jit
def _simulate(key, sizes, weights, poison):
  """`WINDOWS` windows of K micro-batches; micro-batch j of window n has sizes[n, j] examples,
  weight weights[n, j], and a NaN gradient where poison[n, j]. Feeds them as an accumulator
  would (`_core.add` with the finite check, the same `restart`) into two `NoiseState`s: one
  with the default decay, one with a slow one (0.995). Returns each window's (T, Q), the
  default-decay b_simple after each window, and both final states."""
  mu = jnp.full((D,), np.sqrt(G2 / D), jnp.float32)
  x = mu + np.sqrt(S2) * jax.random.normal(key, (WINDOWS, K, MAX_B, D))
  rows = jnp.arange(MAX_B) < sizes[..., None]
  grads = -jnp.sum(jnp.where(rows[..., None], x, 0), axis=2) / sizes[..., None]  # mean of w − x
  grads = jnp.where(poison[..., None], jnp.nan, grads)

  def micro_step(carry, inputs):
    ns, slow, sums, total = carry
    i, g, w = inputs
    restart = i == 0
    sums, total, dropped = _core.add(sums, total, g, w, skip_nonfinite=True, restart=restart)
    ns = _noise.add(ns, g, w, ~dropped, restart=restart)
    slow = _noise.add(slow, g, w, ~dropped, restart=restart)
    return (ns, slow, sums, total), None

  def window(carry, inputs):
    g, w = inputs
    carry, _ = lax.scan(micro_step, carry, (jnp.arange(K), g, w))
    ns, slow, sums, total = carry
    mean_sq = _noise.sq_norm(sums) / total**2
    stats = _noise.window_stats(*_noise.partials(ns), mean_sq)
    ns = _noise.close(ns, mean_sq, *_noise.partials(ns))
    slow = _noise.close(slow, mean_sq, *_noise.partials(slow), decay=SLOW)
    return (ns, slow, sums, total), (stats, _noise.scale(ns).b_simple)

  zero = jnp.zeros((), jnp.float32)
  init = (_noise.init(), _noise.init(), jnp.zeros((D,), jnp.float32), zero)
  (ns, slow, _, _), ((trace, grad_sq), b_simple) = lax.scan(window, init, (grads, weights))
  return trace, grad_sq, b_simple, ns, slow


SLOW = 0.995


def _ratio_standard_error(trace, grad_sq, n_eff):
  """The delta-method relative standard error of mean(T)/mean(Q) over n_eff windows."""
  c = np.cov(trace, grad_sq) / np.outer(
    [trace.mean(), grad_sq.mean()], [trace.mean(), grad_sq.mean()]
  )
  return np.sqrt(c[0, 0] + c[1, 1] - 2 * c[0, 1]) / np.sqrt(n_eff)


@pytest.mark.parametrize(
  "case",
  ["equal_weight_one", "equal_weight_examples", "unequal_weight_examples", "unequal_with_drops"],
)
def test_estimates_unbiased_on_quadratic_with_known_covariance(case):
  rng = np.random.default_rng(10)
  if case.startswith("equal"):
    sizes = np.full((WINDOWS, K), 4)
  else:  # micro-batches of 1 to 8 examples
    sizes = rng.integers(1, MAX_B + 1, size=(WINDOWS, K))
  poison = rng.random((WINDOWS, K)) < (0.2 if case.endswith("drops") else 0.0)
  if case == "equal_weight_one":
    # weight 1 per micro-batch: T estimates the covariance of one micro-batch, tr Σ / b, and
    # B_simple is counted in micro-batches (32 examples = 8 micro-batches of 4)
    weights, true_trace = np.ones((WINDOWS, K)), D * S2 / 4
  else:  # weight = examples: tr Σ per example, B_simple in examples
    weights, true_trace = sizes, D * S2
  trace, grad_sq, b_simple, ns, slow = _simulate(
    jax.random.key(11), jnp.asarray(sizes), jnp.asarray(weights, jnp.float32), jnp.asarray(poison)
  )
  trace, grad_sq, b_simple = map(np.asarray, (trace, grad_sq, b_simple))
  measured = np.isfinite(trace)
  # A window measures iff >= 2 micro-batches were kept; with 20 % dropped that is nearly all.
  np.testing.assert_array_equal(measured, (~poison).sum(1) >= 2)
  trace, grad_sq = trace[measured], grad_sq[measured]
  n = measured.sum()

  # Standard errors. Equal weights, b = 4, k = 8: one window's T is σ²·χ²(D(k−1))/(k−1) with
  # σ² = s²/b per coordinate, relative SD √(2/(D(k−1))) = 3.3 %, so over 400 windows 0.17 %;
  # its Q has relative variance 4B/(Dk) + 2B²/(Dk(k−1)) = 0.025 with B = 8 micro-batches,
  # SD 16 %, so 0.8 % over 400 windows; unequal sizes are of the same order. The slow EMA
  # (β = 0.995 over 400 windows) averages n_eff = (Σβᵗ)²/Σβ²ᵗ ≈ 300 windows. Each figure is
  # held to 3 of its standard errors (computed from the samples), and the same check on it
  # mis-scaled must fail (the control: 2 % low and high for T, 6.5 SE where the sample cannot
  # see 2 %, i.e. Q and the ratio): a wrong estimator fails, e.g. dividing T by k instead of
  # k − 1 is a 12.5 % bias, forgetting the T/W correction in Q one of 100 %.
  for name, got, want in [("T", trace, true_trace), ("Q", grad_sq, G2)]:
    se = got.std(ddof=1) / np.sqrt(n)
    stats.check(got.mean(), want, se, f"{case}: mean {name}", stats.controls(se / want))
  betas = SLOW ** np.arange(n)
  n_eff = betas.sum() ** 2 / (betas**2).sum()
  want = true_trace / G2
  se = _ratio_standard_error(trace, grad_sq, n_eff) * want
  got = float(_noise.scale(slow).b_simple)
  stats.check(got, want, se, f"{case}: B_simple", stats.controls(se / want))
  # dropped micro-batches poison nothing: every reading is finite
  assert np.all(np.isfinite(b_simple)) and all(np.isfinite(np.asarray(x)) for x in _noise.scale(ns))


# ----------------------------------------------------------------------------------------------
# FollowNoiseScale converges near the critical batch.

B_CRIT, FOLLOW_D, FOLLOW_MAX_K = 12.0, 1024, 32  # B_simple = 12 micro-batches


@functools.partial(jax.jit, static_argnums=(1, 2))
def _follow(key, policy, windows):
  """`windows` windows whose length `policy` sets from the measured noise scale after each one.

  Micro-batch gradients ~ N(G, σ²I) in FOLLOW_D dimensions with |G|² = 1 and D·σ² = B_CRIT (the
  mean of b examples of the quadratic problem above, in micro-batch units): B_simple = B_CRIT
  micro-batches. Each window draws FOLLOW_MAX_K gradients and keeps the first k. Returns each
  window's k."""
  sigma = np.sqrt(B_CRIT / FOLLOW_D)
  mean = jnp.full((FOLLOW_D,), np.sqrt(1.0 / FOLLOW_D), jnp.float32)

  def window(carry, key):
    ns, k = carry
    g = mean + sigma * jax.random.normal(key, (FOLLOW_MAX_K, FOLLOW_D))

    def micro_step(carry, i):
      ns, sums = carry
      keep = i < k
      ns = _noise.add(ns, g[i], None, keep, restart=i == 0)
      return (ns, sums + jnp.where(keep, g[i], 0)), None

    (ns, sums), _ = lax.scan(micro_step, (ns, jnp.zeros((FOLLOW_D,))), jnp.arange(FOLLOW_MAX_K))
    total = k.astype(jnp.float32)
    ns = _noise.close(ns, _noise.sq_norm(sums) / total**2, *_noise.partials(ns))
    return (ns, _noise.next_k(policy, ns, k)), k

  start = (_noise.init(), jnp.int32(policy.min_k))
  _, ks = lax.scan(window, start, jax.random.split(key, windows))
  return ks


@pytest.mark.parametrize("max_k", [FOLLOW_MAX_K, 8])
def test_follow_noise_scale_converges_near_the_critical_batch(max_k):
  policy = _noise.FollowNoiseScale(min_k=2, max_k=max_k)
  ks = np.asarray(_follow(jax.random.key(12), policy, 200))
  assert ks[0] == 2 and ks.max() <= max_k
  assert np.all(np.diff(ks) >= 0)  # no shrink
  assert np.all(ks[1:] <= np.maximum(np.ceil(ks[:-1] * 1.25), ks[:-1] + 1))  # the ramp
  # Within ±25 % of B_CRIT (or at max_k below it). Once k is near 12, one window's Q has
  # relative variance 4B/(Dk) + 2B²/(Dk(k−1)) = 0.0054 (SD 7 %), the EMA's ~39 windows bring
  # the estimate to 1.2 %, 0.15 micro-batches, so even the running maximum that no-shrink keeps
  # stays within about one micro-batch of B_CRIT. The risk is the first, short windows (at
  # k = 2 one window's Q has SD 41 %): the growth limit keeps k from outrunning the EMA. Over
  # 200 seeds (outside this test) the final k was 12 to 15, within ±25 % for every seed; with
  # D = 256 instead (estimates twice as noisy) 5 % of seeds ended above 15.
  want = min(B_CRIT, max_k)
  assert abs(ks[-1] - want) <= 0.25 * want, ks
  assert abs(np.median(ks[100:]) - want) <= 0.25 * want
