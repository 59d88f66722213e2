"""`scale_by_gain` and `progress` (issue 22): the AdaScale gain against float64, τ, schedules on
τ, devices, checkpoints and bad input.

The float64 side recomputes everything from the very gradients the library sees: each window's
T and Q, their bias-corrected EMAs (decay 0.95), the gain ``r = (T/W0 + Q)/(T/W + Q)`` clipped
to [1, S], the learning rate at τ, the update ``−r·lr(τ)·ḡ`` (or ``−√r·lr(τ)·ḡ``) and
``τ += r``. Tolerance 1e-5 relative: float32 sums of a few dozen squares, with T and Q kept
away from zero (gradients of mean norm 2 and noise of norm ~2), so no cancellation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import FollowNoiseScale, accumulate, progress, scale_by_gain
from optax_accum.batch_size._gain import GainState, gain
from optax_accum.batch_size._noise import DEFAULT_DECAY

AX = "data"
DIM = 6
RTOL = 1e-5


def _grads(seed: int, n: int, noise: float = 2.0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  mean = rng.standard_normal(DIM)
  mean *= 2 / np.linalg.norm(mean)
  return (mean + noise * rng.standard_normal((n, DIM)) / np.sqrt(DIM)).astype(np.float32)


def _reference(grads, weights, k, base_weight, lr_fn, rule):
  """Float64: per update, (r, update, τ after it), from windows of k micro-batches."""
  ema_t = ema_q = norm = tau = 0.0
  out = []
  for start in range(0, len(grads), k):
    g = grads[start : start + k].astype(np.float64)
    w = weights[start : start + k].astype(np.float64)
    kept = np.isfinite(g).all(1)
    g, w = g[kept], w[kept]
    big_w = w.sum()
    mean = (w[:, None] * g).sum(0) / big_w
    if len(g) >= 2:
      t = ((w * (g**2).sum(1)).sum() - big_w * (mean**2).sum()) / (len(g) - 1)
      q = (mean**2).sum() - t / big_w
      ema_t = DEFAULT_DECAY * ema_t + (1 - DEFAULT_DECAY) * t
      ema_q = DEFAULT_DECAY * ema_q + (1 - DEFAULT_DECAY) * q
      norm = DEFAULT_DECAY * norm + (1 - DEFAULT_DECAY)
    s = big_w / base_weight
    r = 1.0
    if norm > 0:
      t, q = ema_t / norm, ema_q / norm
      r = s if q <= 0 else (t / base_weight + q) / (t / big_w + q)
      r = float(np.clip(r, min(1, s), max(1, s)))
    factor = r if rule == "linear" else np.sqrt(r)
    out.append((r, -factor * lr_fn(tau) * mean, tau + r))
    tau += r
  return out


def _run(tx, grads, weights):
  """Feeds the micro-batches to `tx` (jitted); per update, (r, update, τ)."""
  params = np.zeros(DIM, np.float32)
  state, update = tx.init(params), jax.jit(tx.update)
  out = []
  for g, w in zip(grads, weights, strict=True):
    u, state = update(g, state, params, weight=w)
    if bool(optax_accum.has_updated(state)):
      gs = _gain_state(state) or GainState(np.nan, np.nan)
      out.append((float(gs.gain), np.asarray(u), float(gs.progress)))
  return out, state


def _gain_state(state) -> GainState:
  is_gain = lambda x: isinstance(x, GainState)  # noqa: E731
  return next((x for x in jax.tree.leaves(state, is_leaf=is_gain) if is_gain(x)), None)


def _compare(got, want):
  assert len(got) == len(want)
  for i, ((r, u, tau), (r0, u0, tau0)) in enumerate(zip(got, want, strict=True)):
    np.testing.assert_allclose(r, r0, rtol=RTOL, err_msg=f"r of update {i}")
    np.testing.assert_allclose(u, u0, rtol=RTOL, atol=1e-7, err_msg=f"update {i}")
    np.testing.assert_allclose(tau, tau0, rtol=RTOL, err_msg=f"tau after update {i}")


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_gain_matches_float64_both_rules(rule):
  """Weights count examples; one micro-batch of the second window is NaN (dropped, so that
  window is lighter); a cosine schedule is evaluated at τ."""
  k, n_windows = 4, 5
  grads = _grads(0, k * n_windows)
  grads[5, 2] = np.nan
  weights = np.random.default_rng(1).integers(2, 9, size=len(grads)).astype(np.float32)
  base_weight = 8.0
  sched = optax.cosine_decay_schedule(0.5, 20)
  tx = accumulate(scale_by_gain(sched, base_weight=base_weight, rule=rule), k, noise_scale=True)
  got, state = _run(tx, grads, weights)

  def lr_fn(t):
    return 0.5 * 0.5 * (1 + np.cos(np.pi * min(t, 20) / 20))

  want = _reference(grads, weights, k, base_weight, lr_fn, rule)
  _compare(got, want)
  rs = np.array([r for r, _, _ in got])
  assert rs[0] > 1 and np.all(rs >= 1)  # measured from the first window on: r moved
  np.testing.assert_allclose(float(progress(state)), rs.astype(np.float64).sum(), rtol=1e-6)


def test_gain_is_one_at_s_one_and_before_the_first_estimate():
  k = 4
  grads = _grads(2, 3 * k)
  ones = np.ones(len(grads), np.float32)
  tx = accumulate(scale_by_gain(0.1, base_weight=k), k, noise_scale=True)  # S = 1
  got, state = _run(tx, grads, ones)
  assert [r for r, _, _ in got] == [1.0, 1.0, 1.0]
  assert float(progress(state)) == 3.0
  # at S = 1 the run is exactly the plain optimizer's
  plain, _ = _run(accumulate(optax.sgd(0.1), k, noise_scale=True), grads, ones)
  for (_, u, _), (_, u0, _) in zip(got, plain, strict=True):
    np.testing.assert_array_equal(u, u0)
  # No estimate yet: a first window with one kept micro-batch (the other is NaN), then k = 1
  # windows on one device, which never measure: r = 1 though S = 2.
  early = _grads(3, 2)
  early[0, 0] = np.nan
  tx = accumulate(scale_by_gain(0.1, base_weight=0.5), 2, noise_scale=True)
  got, _ = _run(tx, early, np.ones(2, np.float32))
  assert got[0][0] == 1.0
  tx = accumulate(scale_by_gain(0.1, base_weight=0.5), 1, noise_scale=True)
  got, _ = _run(tx, _grads(4, 3), np.ones(3, np.float32))
  assert [r for r, _, _ in got] == [1.0, 1.0, 1.0]


def test_gain_bounds_against_float64():
  rng = np.random.default_rng(5)
  t = rng.uniform(0.01, 10, 200)
  q = rng.uniform(-1, 10, 200)
  w = rng.uniform(0.5, 40, 200)
  w0 = 4.0
  got = np.asarray(jax.vmap(lambda a, b, c: gain(a, b, c, w0))(t, q, w), np.float64)
  s = w / w0
  want = np.where(q <= 0, s, (t / w0 + q) / (t / w + q))
  want = np.clip(want, np.minimum(s, 1), np.maximum(s, 1))
  np.testing.assert_allclose(got, want, rtol=RTOL)
  assert np.all(got >= np.minimum(s, 1) * (1 - 1e-6)) and np.all(
    got <= np.maximum(s, 1) * (1 + 1e-6)
  )
  assert float(gain(jnp.nan, 1.0, 8.0, w0)) == 1.0 and float(gain(1.0, 0.0, 8.0, w0)) == 2.0


def test_gain_schedule_sees_progress_not_the_update_count():
  """A piecewise schedule that drops at 2: the second update (update count 1) already runs at
  the low rate, only because τ, the first update's gain (≈ S = 4, noise-dominated), passed 2."""
  k = 4
  grads = _grads(6, 3 * k, noise=20.0)
  sched = optax.piecewise_constant_schedule(1.0, {2: 0.1})
  tx = accumulate(scale_by_gain(sched, base_weight=1), k, noise_scale=True)
  got, _ = _run(tx, grads, np.ones(len(grads), np.float32))
  (r1, u1, tau1), (r2, u2, _) = got[0], got[1]
  assert tau1 > 2 and float(sched(1)) == 1.0  # by the update count, still the high rate
  mean = [grads[i * k : (i + 1) * k].astype(np.float64).mean(0) for i in range(2)]
  np.testing.assert_allclose(u1, -1.0 * r1 * mean[0], rtol=RTOL)
  np.testing.assert_allclose(u2, -0.1 * r2 * mean[1], rtol=RTOL)


def _sharded_updates(inner, grads, n, k, weight):
  """Params after feeding grads (steps, n, DIM) to accumulate on n devices, and the emitting
  program's text."""
  mesh = jax.make_mesh((n,), (AX,), devices=jax.devices()[:n])
  tx = accumulate(inner, k, axis_name=AX, noise_scale=True)
  specs = optax_accum.state_partition_specs(tx, P(), AX)

  def micro(state, params, g):
    u, state = tx.update(g[0], state, params, weight=weight)
    return state, optax.apply_updates(params, u)

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  run = jax.jit(
    jax.shard_map(micro, mesh=mesh, in_specs=(specs, P(), P(AX)), out_specs=(specs, P()))
  )
  params = jnp.zeros(DIM)
  state = init(params)
  split = NamedSharding(mesh, P(AX))
  for g in grads:
    state, params = run(state, params, jax.device_put(g, split))
  text = run.lower(state, params, jax.device_put(grads[0], split)).compile().as_text()
  return np.asarray(params), state, text


@pytest.mark.parametrize("weight", [None, 8.0], ids=["default", "examples"])
def test_gain_two_devices_times_k_equal_one_device_times_2k(weight):
  """The same micro-batches (2 devices × k, or one device × 2k): same r, same update. With the
  default weight a device's share is half a global micro-batch, so the one-device run weighs
  each piece 1/2; with example counts both weigh it 8. No collective is added by the gain."""
  k = 2
  grads = _grads(7, 3 * k * 2).reshape(3 * k, 2, DIM)  # 3 windows of k steps on 2 devices
  base = 1.0 if weight is None else 16.0
  inner = optax.chain(optax.trace(0.9), scale_by_gain(0.05, base_weight=base))
  two, state2, text = _sharded_updates(inner, grads, 2, k, weight)
  piece = 0.5 if weight is None else weight
  tx = accumulate(inner, 2 * k, noise_scale=True)
  params, state1 = jnp.zeros(DIM), tx.init(jnp.zeros(DIM))
  update = jax.jit(tx.update)
  for g in grads.reshape(-1, DIM):  # each window's 2k pieces, in order
    u, state1 = update(g, state1, params, weight=piece)
    params = optax.apply_updates(params, u)
  np.testing.assert_allclose(two, params, rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(_gain_state(state2).gain, _gain_state(state1).gain, rtol=2e-6)
  np.testing.assert_allclose(progress(state2), progress(state1), rtol=2e-6)
  assert float(_gain_state(state1).gain) > 1.01  # the gain acted
  _, _, plain = _sharded_updates(
    optax.chain(optax.trace(0.9), optax.sgd(0.05)), grads, 2, k, weight
  )
  assert optax_accum.count_collectives(text) == optax_accum.count_collectives(plain) == 1


def _recipe():
  return optax.chain(
    optax.trace(0.9), scale_by_gain(optax.cosine_decay_schedule(0.1, 40), base_weight=2)
  )


def test_gain_checkpoint_mid_window_resumes_bit_for_bit():
  """TrainStep and accumulate with the gain and FollowNoiseScale: a state saved mid-window
  (copied to the host, as a checkpoint) and resumed by a fresh object continues exactly."""
  grads = _grads(8, 40, noise=6.0)
  policy = FollowNoiseScale(min_k=2, max_k=8)
  loss = lambda p, x: jnp.sum(p * x)  # noqa: E731

  def train_step_run(stop=None):
    step = optax_accum.TrainStep(loss, _recipe(), policy, noise_scale=True)
    params = jnp.zeros(DIM)
    state = step.init(params)
    for i, g in enumerate(grads):
      if i == stop:
        saved = jax.device_get((params, state))
        assert int(saved[1].mini_step) != 0  # mid-window
        step = optax_accum.TrainStep(loss, _recipe(), policy, noise_scale=True)
        params, state = jax.tree.map(jnp.asarray, saved)
      params, state, _ = step(params, state, g)
    return params, state

  def accumulate_run(stop=None):
    tx = accumulate(_recipe(), policy, noise_scale=True)
    params = jnp.zeros(DIM)
    state, update = tx.init(params), jax.jit(tx.update)
    for i, g in enumerate(grads):
      if i == stop:
        saved = jax.device_get((params, state))
        assert int(saved[1].mini_step) != 0
        update = jax.jit(accumulate(_recipe(), policy, noise_scale=True).update)
        params, state = jax.tree.map(jnp.asarray, saved)
      u, state = update(g, state, params)
      params = optax.apply_updates(params, u)
    return params, state

  for run in (train_step_run, accumulate_run):
    whole, resumed = run(), run(stop=23)
    assert float(progress(whole[1])) > int(whole[1].gradient_step)  # the gain acted
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
      np.testing.assert_array_equal(a, b)


def test_gain_train_step_matches_accumulate():
  grads = _grads(9, 24)
  loss = lambda p, x: jnp.sum(p * x)  # noqa: E731
  step = optax_accum.TrainStep(loss, _recipe(), 4, noise_scale=True)
  p1 = jnp.zeros(DIM)
  s1 = step.init(p1)
  tx = accumulate(_recipe(), 4, noise_scale=True)
  p2, s2 = jnp.zeros(DIM), tx.init(jnp.zeros(DIM))
  update = jax.jit(tx.update)  # as TrainStep's own update is (eagerly, 24 compilations)
  for g in grads:
    p1, s1, _ = step(p1, s1, g)
    u, s2 = update(g, s2, p2)
    p2 = optax.apply_updates(p2, u)
  np.testing.assert_allclose(p1, p2, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(progress(s1), progress(s2), rtol=1e-6)


@pytest.mark.parametrize(
  ("base_weight", "error", "match"),
  [
    (0, ValueError, "base_weight must be positive and finite, got 0.0"),
    (-2.0, ValueError, "base_weight must be positive and finite, got -2.0"),
    (float("nan"), ValueError, "base_weight must be positive and finite, got nan"),
    ("4", TypeError, "base_weight must be a positive number .* got '4' of type str"),
    (True, TypeError, "base_weight must be a positive number"),
  ],
)
def test_gain_bad_base_weight(base_weight, error, match):
  with pytest.raises(error, match=match):
    scale_by_gain(0.1, base_weight=base_weight)


def test_gain_bad_rule_and_misuse():
  with pytest.raises(ValueError, match=r"rule must be 'linear' .* or 'sqrt' .* got 'adam'"):
    scale_by_gain(0.1, base_weight=1, rule="adam")
  params = jnp.zeros(3)
  tx = accumulate(scale_by_gain(0.1, base_weight=1), 2)
  with pytest.raises(ValueError, match="noise_scale=False keeps none. Build it with noise_scale"):
    tx.init(params)
  step = optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), scale_by_gain(0.1, base_weight=1), 2)
  with pytest.raises(ValueError, match="noise_scale=True"):
    step.init(params)
  for outside in (
    scale_by_gain(0.1, base_weight=1),
    optax.chain(scale_by_gain(0.1, base_weight=1)),
  ):
    with pytest.raises(ValueError, match="no window figures were passed to it.*accumulate"):
      outside.update(params, outside.init(params), params)
  with pytest.raises(ValueError, match="progress: found no GainState in a AccumulateState"):
    progress(accumulate(optax.sgd(0.1), 2).init(params))
