"""The gradient noise scale in `accumulate` and `TrainStep` (``noise_scale=True``, and
``every_k=FollowNoiseScale(...)``), against the window formulas in float64.

For a window of k kept micro-batch gradients gᵢ with weights wᵢ, ``W = Σ wᵢ`` and the weighted
mean ``ḡ``: ``T = (Σ wᵢ|gᵢ|² − W|ḡ|²) / (k − 1)`` and ``Q = |ḡ|² − T / W``; the EMAs of T and Q
are bias-corrected like Adam's moments. The gradients here are given (a linear loss whose
gradient is its input), so the float64 side is computed from the very numbers the library sees.
Tolerance: 1e-5 relative (float32 sums of a few squares; T and Q are kept away from zero by
gradients with a mean of norm 2 and noise of norm ~1, so neither is a cancellation).
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
from optax_accum import FollowNoiseScale, accumulate, noise_scale
from optax_accum.batch_size._noise import DEFAULT_DECAY

AX = "data"
DIM = 5
RTOL = 1e-5


def _grads(seed: int, n: int, noise: float = 1.0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  mean = rng.standard_normal(DIM)
  mean *= 2 / np.linalg.norm(mean)  # |G|² = 4, tr Σ = noise²: Q and T far from 0
  return (mean + noise * rng.standard_normal((n, DIM)) / np.sqrt(DIM)).astype(np.float32)


def _window_tq(g: np.ndarray, w: np.ndarray) -> tuple[float, float]:
  """T and Q of one window in float64."""
  g, w = g.astype(np.float64), w.astype(np.float64)
  total = w.sum()
  mean = (w[:, None] * g).sum(0) / total
  mean_sq = (mean**2).sum()
  trace = ((w * (g**2).sum(1)).sum() - total * mean_sq) / (len(g) - 1)
  return trace, mean_sq - trace / total


def _expected(windows: list[tuple[float, float]]) -> dict:
  """The NoiseScale fields after these windows, in float64."""
  ema_t = ema_q = norm = 0.0
  for t, q in windows:
    ema_t = DEFAULT_DECAY * ema_t + (1 - DEFAULT_DECAY) * t
    ema_q = DEFAULT_DECAY * ema_q + (1 - DEFAULT_DECAY) * q
    norm = DEFAULT_DECAY * norm + (1 - DEFAULT_DECAY)
  t, q = windows[-1]
  trace, grad_sq = ema_t / norm, ema_q / norm
  return dict(
    trace_cov=trace,
    grad_sq=grad_sq,
    b_simple=trace / grad_sq,
    window_trace_cov=t,
    window_grad_sq=q,
  )


def _assert_scale(got: optax_accum.NoiseScale, want: dict, rtol: float = RTOL) -> None:
  for name, value in want.items():
    np.testing.assert_allclose(float(getattr(got, name)), value, rtol=rtol, err_msg=name)


K = 4
WEIGHTS = [None, 3.0]  # equal weights: the default 1, or 3 each


@pytest.mark.parametrize("weight", WEIGHTS)
def test_noise_accumulate_matches_the_float64_window_formulas(weight):
  grads = _grads(0, 2 * K)
  tx = accumulate(optax.sgd(1.0), K, noise_scale=True)
  params = np.zeros(DIM, np.float32)
  state, update = tx.init(params), jax.jit(tx.update)
  for g in grads:
    _, state = update(g, state, params, weight=weight)
  w = np.full(K, 1.0 if weight is None else weight)
  windows = [_window_tq(grads[:K], w), _window_tq(grads[K:], w)]
  _assert_scale(noise_scale(state), _expected(windows))


@pytest.mark.parametrize("weight", WEIGHTS)
def test_noise_train_step_matches_the_float64_window_formulas(weight):
  grads = _grads(1, 2 * K)
  loss = lambda p, x: jnp.sum(p * x)  # its gradient is x
  step = optax_accum.TrainStep(loss, optax.sgd(1.0), K, noise_scale=True)
  params = np.zeros(DIM, np.float32)
  state = step.init(params)
  for g in grads:
    params, state, _ = step(params, state, g, weight=weight)
  w = np.full(K, 1.0 if weight is None else weight)
  windows = [_window_tq(grads[:K], w), _window_tq(grads[K:], w)]
  _assert_scale(noise_scale(state), _expected(windows))


def _sharded_run(
  tx, grads: np.ndarray, mesh, weight: float | None = None
) -> tuple[optax_accum.AccumulateState, str]:
  """`grads` of shape (steps, devices, DIM): device d's share of each step's micro-batch, its
  gradient fed to `tx` inside shard_map (the gradient of a device-local linear loss,
  device-varying), with `weight` on every device. Returns the final state and the compiled
  micro-step's text."""
  specs = optax_accum.state_partition_specs(tx, P(), AX)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

  def micro_step(state, g):
    _, state = tx.update(g[0], state, jnp.zeros(DIM, jnp.float32), weight=weight)
    return state

  step = jax.jit(jax.shard_map(micro_step, mesh=mesh, in_specs=(specs, P(AX)), out_specs=specs))
  split = NamedSharding(mesh, P(AX))
  state = init(np.zeros(DIM, np.float32))
  for g in grads:
    state = step(state, jax.device_put(g, split))
  return state, step.lower(state, jax.device_put(grads[0], split)).compile().as_text()


@pytest.mark.parametrize("weight", WEIGHTS)
def test_noise_two_devices_times_k_equal_one_device_times_2k(weight):
  """Each device's share is a piece of the window: with the default weight, half of one
  global micro-batch (weight 1/2, issue 22); with example counts, its own count."""
  mesh = jax.make_mesh((2,), (AX,), devices=jax.devices()[:2])
  grads = _grads(2, 2 * 2 * K).reshape(2 * K, 2, DIM)  # 2 windows of K steps on 2 devices
  tx = accumulate(optax.sgd(1.0), K, axis_name=AX, noise_scale=True)
  state, _ = _sharded_run(tx, grads, mesh, weight)
  piece = 0.5 if weight is None else weight
  one = accumulate(optax.sgd(1.0), 2 * K, noise_scale=True)
  flat = grads[:K].reshape(-1, DIM), grads[K:].reshape(-1, DIM)  # each window's 2K pieces
  single, update = one.init(np.zeros(DIM, np.float32)), jax.jit(one.update)
  for g in np.concatenate(flat):
    _, single = update(g, single, np.zeros(DIM, np.float32), weight=piece)
  got, want = noise_scale(state), noise_scale(single)
  for name in got._fields:  # the same sums, added in another order
    np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-6, err_msg=name)
  windows = [_window_tq(f, np.full(2 * K, piece)) for f in flat]
  _assert_scale(got, _expected(windows))
  assert state.noise.sq_sum.shape == (2,)  # the window partials are per device


@pytest.mark.structure
def test_noise_rides_on_the_emitting_all_reduce():
  """No collective beyond the one the window's sums need: scalars join it."""
  mesh = jax.make_mesh((2,), (AX,), devices=jax.devices()[:2])
  grads = _grads(3, 2 * K).reshape(K, 2, DIM)
  texts = {}
  for noise in (False, True):
    tx = accumulate(optax.sgd(1.0), K, axis_name=AX, noise_scale=noise)
    _, texts[noise] = _sharded_run(tx, grads, mesh)
  assert optax_accum.count_collectives(texts[False]) == 1  # positive control
  assert optax_accum.count_collectives(texts[True]) == 1


@pytest.mark.structure
@pytest.mark.parametrize("axis_name", [None, AX])
def test_noise_state_costs_at_most_256_bytes(axis_name):
  params = {"w": np.zeros((64, 32), np.float32), "b": np.zeros(32, np.float32)}

  mesh = jax.make_mesh((8,), (AX,))

  def nbytes(noise):  # the global state: per-device fields stacked over the 8 devices
    tx = accumulate(optax.adam(1e-3), 4, axis_name=axis_name, noise_scale=noise)
    init = tx.init
    if axis_name is not None:
      specs = optax_accum.state_partition_specs(tx, jax.tree.map(lambda _: P(), params), AX)
      init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.eval_shape(init, params)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

  assert 0 < nbytes(True) - nbytes(False) <= 256


def _follow_run(grads, feed):
  """Feeds `grads` one micro-step each; returns per call (window_k, updated, update)."""
  trace = []
  for g in grads:
    state, update = feed(g)
    trace.append((int(state.window_k), bool(optax_accum.has_updated(state)), update))
  return trace


def _check_windows(trace, grads):
  """window_k changes only when a window closes, each window is as long as the window_k in
  force when it opened, and each update is the window's mean gradient (sgd(1.0), params 0)."""
  start, lengths = 0, []
  k_open = trace[0][0]
  for i, (k, updated, update) in enumerate(trace):
    if not updated:
      assert k == k_open, f"window_k changed mid-window at call {i}"
      continue
    lengths.append(i + 1 - start)
    assert lengths[-1] == k_open, (i, lengths, k_open)
    np.testing.assert_allclose(update, -grads[start : i + 1].mean(0), rtol=1e-5, atol=1e-6)
    start, k_open = i + 1, k
  assert len(set(lengths)) > 1, f"k never changed: {lengths}"  # the policy did act
  return lengths


def test_noise_follow_noise_scale_changes_k_only_at_window_boundaries():
  grads = _grads(4, 40, noise=8.0)  # B_simple ~ 64 / 4 = 16 micro-batches: k grows from 2
  tx = accumulate(optax.sgd(1.0), FollowNoiseScale(min_k=2, max_k=8))
  params = np.zeros(DIM, np.float32)
  state, update = [tx.init(params)], jax.jit(tx.update)

  def feed(g):
    u, state[0] = update(g, state[0], params)
    return state[0], np.asarray(u)

  lengths = _check_windows(_follow_run(grads, feed), grads)
  assert lengths[0] == 2 and max(lengths) == 8


def test_noise_train_step_follows_noise_scale_reading_k_once_per_update():
  grads = _grads(4, 40, noise=8.0)
  loss = lambda p, x: jnp.sum(p * x)
  step = optax_accum.TrainStep(loss, optax.sgd(1.0), FollowNoiseScale(min_k=2, max_k=8))
  params = [np.zeros(DIM, np.float32)]
  state = [step.init(params[0])]

  def feed(g):
    before = np.asarray(params[0])
    params[0], state[0], _ = step(params[0], state[0], g)
    return state[0], np.asarray(params[0]) - before  # the update sgd(1.0) applied

  trace = _follow_run(grads, feed)
  lengths = _check_windows(trace, grads)
  # The same windows as accumulate's device-side decision.
  tx = accumulate(optax.sgd(1.0), FollowNoiseScale(min_k=2, max_k=8))
  s, update = tx.init(np.zeros(DIM, np.float32)), jax.jit(tx.update)
  ks = []
  for g in grads:
    _, s = update(g, s, np.zeros(DIM, np.float32))
    ks.append(int(s.window_k))
  assert [k for k, _, _ in trace] == ks and lengths[0] == 2


def test_noise_scale_bad_states_raise():
  tx = accumulate(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match="noise_scale=True"):
    noise_scale(tx.init(np.zeros(3, np.float32)))
  made = accumulate(optax.sgd(1.0), 2, noise_scale=True).init(np.zeros(3, np.float32))
  with pytest.raises(ValueError, match="made with noise_scale=True but is updated with noise"):
    tx.update(np.ones(3, np.float32), made, np.zeros(3, np.float32))
  with pytest.raises(TypeError, match="noise_scale must be a bool, got 'yes'"):
    accumulate(optax.sgd(1.0), 2, noise_scale="yes")


def test_noise_state_placed_by_state_partition_specs():
  tx = accumulate(optax.sgd(1.0), 2, axis_name=AX, noise_scale=True)
  specs = optax_accum.state_partition_specs(tx, P(), AX)
  assert specs.noise.sq_sum == P(AX) and specs.noise.count == P(AX)
  assert specs.noise.grad_sq_ema == P()
  mesh = jax.make_mesh((8,), (AX,))
  with jax.set_mesh(mesh):
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    state = jax.jit(optax_accum.data_parallel(tx.init, AX), out_shardings=shardings)(
      np.zeros(3, np.float32)
    )
  assert state.noise.count.shape == (8,)


@pytest.mark.parametrize("path", ["accumulate", "TrainStep"])
def test_noise_sq_norm_finite_check_is_exact(path):
  """With noise_scale=True, Σ|g|² is the finite check: a gradient whose squares overflow float32
  (finite values of 1e30) is kept, exactly as without the statistics, and NaN/±Inf are
  dropped (the exact check that runs when Σ|g|² is not finite)."""
  cases = [np.full(DIM, 1e30, np.float32), np.ones(DIM, np.float32)]
  for bad in (np.nan, np.inf, -np.inf):
    g = np.ones(DIM, np.float32)
    g[2] = bad
    cases.append(g)
  got = {}
  for noise in (False, True):
    if path == "accumulate":
      tx = accumulate(optax.sgd(1.0), 1, noise_scale=noise)
      state, update = tx.init(np.zeros(DIM, np.float32)), jax.jit(tx.update)
      skipped = []
      for g in cases:
        _, state = update(g, state, np.zeros(DIM, np.float32))
        skipped.append(int(state.num_skipped))
    else:
      step = optax_accum.TrainStep(
        lambda p, x: jnp.sum(p * x), optax.sgd(1.0), 2, noise_scale=noise
      )
      params = jnp.zeros(DIM)
      state, skipped = step.init(params), []
      for g in cases:
        params, state, _ = step(params, state, g)
        skipped.append(int(state.num_skipped))
    got[noise] = skipped
  assert got[True] == got[False] == [0, 0, 1, 2, 3]
