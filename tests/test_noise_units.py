"""Issue 22's four noise-scale faults: the unit of the statistics does not depend on the layout.

The data: examples xₑ ~ N(μ, σ²I) in D dimensions, a linear loss ``mean_e(xₑ·p)`` whose gradient
on a micro-batch is the mean of its rows. One *global* micro-batch of B rows then has gradient
covariance σ²I/B, so in units of one global micro-batch (the default weight) the truth is
``T = D·σ²/B`` and ``Q = |μ|²``, on any number of devices. D is large so that every window's
estimates are tight: with n·k pieces a window's T has a relative spread of about
``sqrt(2 / ((n·k − 1)·D))`` (5% at n·k = 4, D = 256), and the mean over WINDOWS windows is
compared with the truth at TOL; each test checks that 3 standard errors of its own samples fit
inside TOL. The old unit (a device's share counted as one micro-batch) is off by the device
count n (2 to 8×), far outside it.
"""

from __future__ import annotations

import warnings

import _stats as stats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import FollowNoiseScale, accumulate, noise_scale

AX = "data"
D, B, K = 256, 16, 4  # dimensions, rows per global micro-batch, micro-batches per window
SIGMA, MU_SQ = 1.0, 16.0
TRUE_T, TRUE_Q = D * SIGMA**2 / B, MU_SQ  # T = 16, Q = 16: B_simple = 1 micro-batch
WINDOWS = 24
TOL = 0.06


def _data(seed: int, windows: int = WINDOWS, k: int = K, mu_sq: float = MU_SQ) -> np.ndarray:
  """(windows·k, B, D) rows: micro-batch i of the run is ``data[i]``."""
  rng = np.random.default_rng(seed)
  mu = np.full(D, np.sqrt(mu_sq / D))
  return (mu + SIGMA * rng.standard_normal((windows * k, B, D))).astype(np.float32)


def _loss(p, x):
  return jnp.mean(x @ p)


def _check(ts: list, qs: list) -> None:
  """The windows' mean T and Q against the truth, within 3 standard errors (computed from the
  windows, at most TOL), and the same check on the mean mis-scaled must fail (2 % low and high
  where the windows can see that, else 6.5 SE)."""
  for name, xs, truth in (("T", ts, TRUE_T), ("Q", qs, TRUE_Q)):
    xs = np.asarray(xs, np.float64)
    se = xs.std(ddof=1) / np.sqrt(len(xs))
    assert 3 * se < TOL * truth, f"{name}: too few windows (3 SE = {3 * se / truth:.3f})"
    stats.check(xs.mean(), truth, se, name, stats.controls(se / truth))


def _shard_map_windows(n: int, data: np.ndarray) -> tuple[list, list]:
  """accumulate inside shard_map on n devices, each device's share of every micro-batch."""
  mesh = jax.make_mesh((n,), (AX,), devices=jax.devices()[:n])
  tx = accumulate(optax.sgd(0.0), K, axis_name=AX, noise_scale=True)
  specs = optax_accum.state_partition_specs(tx, P(), AX)
  params = np.zeros(D, np.float32)

  def window(state, xs):  # K micro-batches, xs: (K, B/n, D) on each device
    def micro(state, x):
      local = jax.lax.pcast(jnp.zeros(D), AX, to="varying")
      g = jax.grad(_loss)(local, x)
      return tx.update(g, state, params)[1], None

    state, _ = jax.lax.scan(micro, state, xs)
    return state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  run = jax.jit(jax.shard_map(window, mesh=mesh, in_specs=(specs, P(None, AX)), out_specs=specs))
  state, ts, qs = init(params), [], []
  for w in range(len(data) // K):
    state = run(state, jax.device_put(data[w * K : (w + 1) * K], NamedSharding(mesh, P(None, AX))))
    ns = noise_scale(state)
    ts.append(float(ns.window_trace_cov))
    qs.append(float(ns.window_grad_sq))
  return ts, qs


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_noise_units_shard_map_one_global_micro_batch_regression_issue_22(n):
  _check(*_shard_map_windows(n, _data(n)))


def _train_step_windows(n: int, data: np.ndarray, every_k: int | FollowNoiseScale = K):
  """TrainStep under plain jit: axis_name over n devices (n > 1), or none at all (n = 1)."""
  mesh = jax.make_mesh((n,), (AX,), devices=jax.devices()[:n])
  kwargs = dict(axis_name=AX, mesh=mesh) if n > 1 else {}
  step = optax_accum.TrainStep(_loss, optax.sgd(0.0), every_k, noise_scale=True, **kwargs)
  params = jnp.zeros(D)
  state, ts, qs, ks = step.init(params), [], [], []
  for x in data:
    params, state, _ = step(params, state, x)
    if bool(optax_accum.has_updated(state)):
      ns = noise_scale(state)
      ts.append(float(ns.window_trace_cov))
      qs.append(float(ns.window_grad_sq))
      ks.append(int(state.window_k))
  return ts, qs, ks


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_noise_units_train_step_one_global_micro_batch_regression_issue_22(n):
  ts, qs, _ = _train_step_windows(n, _data(10 + n))
  _check(ts, qs)


def test_noise_units_microbatch_and_data_parallel_regression_issue_22():
  """microbatch(axis_name=...) under plain jit, and accumulate under data_parallel, on 8."""
  mesh = jax.make_mesh((8,), (AX,))
  data = _data(20)
  with jax.set_mesh(mesh):
    grad = optax_accum.microbatch(jax.value_and_grad(_loss), K, axis_name=AX, noise_scale=1)
    step = jax.jit(grad)
    ts, qs = [], []
    for w in range(WINDOWS):
      batch = data[w * K : (w + 1) * K].reshape(K * B, D)
      _, info = step(jnp.zeros(D), jax.device_put(batch, NamedSharding(mesh, P(AX))))
      ts.append(float(info.noise.window_trace_cov))
      qs.append(float(info.noise.window_grad_sq))
  _check(ts, qs)

  tx = accumulate(optax.sgd(0.0), K, axis_name=AX, noise_scale=True)

  def micro(state, x):
    g = jax.grad(_loss)(jax.lax.pcast(jnp.zeros(D), AX, to="varying"), x)
    return tx.update(g, state, jnp.zeros(D))[1]

  with jax.set_mesh(mesh):
    init = jax.jit(optax_accum.data_parallel(tx.init, AX))
    run = jax.jit(optax_accum.data_parallel(micro, AX, batch_argnums=1))
    state, ts, qs = init(jnp.zeros(D)), [], []
    for i, x in enumerate(_data(21)):
      state = run(state, jax.device_put(x, NamedSharding(mesh, P(AX))))
      if i % K == K - 1:
        ns = noise_scale(state)
        ts.append(float(ns.window_trace_cov))
        qs.append(float(ns.window_grad_sq))
  _check(ts, qs)


def test_noise_units_follow_noise_scale_same_k_on_1_and_4_devices_regression_issue_22():
  """FollowNoiseScale ramps to B_simple = 4 micro-batches (|μ|² = 4) on 1 device and on 4 (the
  old unit ramped about 4× further on 4 devices). Growth is capped at +25% per window, so 14 windows
  from k = 2 reach any k up to 16: the policy's bound, not the ramp, decides the end."""
  policy = FollowNoiseScale(min_k=2, max_k=16)
  data = _data(30, windows=14, k=16, mu_sq=4.0)
  ends = {}
  for n in (1, 4):
    _, _, ks = _train_step_windows(n, data, policy)
    ends[n] = ks[-1]
  assert ends[1] == ends[4] and 3 <= ends[1] <= 6, ends


# ----------------------------------------------------------------------------------------------
# Fault 2: max_k after a restore.


@pytest.mark.parametrize("window_k", [8, 32])
def test_noise_units_max_k_holds_after_restore_regression_issue_22(window_k):
  """A state at a window boundary whose window_k is beyond this policy's max_k opens its next
  window at max_k, in accumulate and in TrainStep."""
  policy = FollowNoiseScale(min_k=2, max_k=4)
  params = jnp.zeros(3)
  tx = accumulate(optax.sgd(1.0), policy)
  restored = tx.init(params)._replace(window_k=jnp.int32(window_k))  # e.g. from Follow(2, 32)
  state, update = restored, jax.jit(tx.update)
  for i in range(4):
    _, state = update(jnp.ones(3), state, params)
    assert bool(optax_accum.has_updated(state)) == (i == 3), i
  assert int(state.window_k) <= 4

  step = optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), optax.sgd(1.0), policy)
  step.init(params)
  state, p = restored, params
  updated = []
  for _ in range(4):
    p, state, _ = step(p, state, jnp.ones(3))
    updated.append(bool(optax_accum.has_updated(state)))
  assert updated == [False, False, False, True]


# ----------------------------------------------------------------------------------------------
# Fault 3: already-reduced gradients.


def _reduced_run(n: int, k: int, data: np.ndarray):
  """accumulate inside shard_map with replicated parameters and a pmean'd loss: every device's
  gradient is the global one (the warned path)."""
  mesh = jax.make_mesh((n,), (AX,), devices=jax.devices()[:n])
  tx = accumulate(optax.sgd(0.0), k, axis_name=AX, noise_scale=True)
  specs = optax_accum.state_partition_specs(tx, P(), AX)

  def micro(state, p, x):
    g = jax.grad(lambda p: jax.lax.pmean(_loss(p, x), AX))(p)
    return tx.update(g, state, p)[1]

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
  run = jax.jit(jax.shard_map(micro, mesh=mesh, in_specs=(specs, P(), P(AX)), out_specs=specs))
  state = init(jnp.zeros(D))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for x in data:
      state = run(state, jnp.zeros(D), jax.device_put(x, NamedSharding(mesh, P(AX))))
  return noise_scale(state)


def test_noise_units_already_reduced_gradients_count_once_regression_issue_22():
  data = _data(40, windows=1, k=2)
  one = _reduced_run(1, 2, data)  # one device: the global micro-batch gradients, plainly
  four = _reduced_run(4, 2, data)
  for name in ("window_trace_cov", "window_grad_sq"):
    np.testing.assert_allclose(getattr(four, name), getattr(one, name), rtol=1e-5, err_msg=name)
  assert np.isnan(_reduced_run(4, 1, data[:1]).b_simple)  # k = 1: one micro-batch, no variance


# ----------------------------------------------------------------------------------------------
# Fault 4: the smaller ones.


@pytest.mark.parametrize(
  "every_k",
  [4, lambda step: jnp.where(step < 1, 2, 3), FollowNoiseScale(min_k=2, max_k=8)],
  ids=["int", "schedule", "follow"],
)
def test_noise_units_window_k_is_the_next_window_after_an_update_regression_issue_22(every_k):
  """Right after an update, window_k is the length of the window that opens next, for every
  kind of every_k (and the window that follows has that length)."""
  tx = accumulate(optax.sgd(1.0), every_k, noise_scale=True)
  params = jnp.zeros(3)
  state, update = tx.init(params), jax.jit(tx.update)
  rng = np.random.default_rng(0)
  announced, length, lengths = int(state.window_k), 0, []
  for _ in range(40):
    _, state = update(jnp.asarray(rng.normal(1.0, 3.0, 3), jnp.float32), state, params)
    length += 1
    if bool(optax_accum.has_updated(state)):
      assert length == announced, (lengths, length, announced)
      lengths.append(length)
      announced, length = int(state.window_k), 0
  assert len(lengths) >= 3


def test_noise_units_min_k_one_leaves_k_one_on_one_device_regression_issue_22():
  tx = accumulate(optax.sgd(1.0), FollowNoiseScale())  # min_k=1
  params = jnp.zeros(3)
  state, update = tx.init(params), jax.jit(tx.update)
  rng = np.random.default_rng(1)
  for _ in range(12):
    _, state = update(jnp.asarray(rng.normal(0.1, 3.0, 3), jnp.float32), state, params)
  assert int(state.window_k) >= 2 and np.isfinite(noise_scale(state).b_simple)


def test_noise_units_follow_replace_checks_regression_issue_22():
  policy = FollowNoiseScale(min_k=2, max_k=8)
  with pytest.raises(ValueError, match="min_k must be a positive int, got 0"):
    policy._replace(min_k=0)
  with pytest.raises(ValueError, match="max_k must be >= min_k"):
    policy._replace(max_k=1)
  with pytest.raises(ValueError, match="min_k must be a positive int"):
    FollowNoiseScale._make((0, 8, 1.0, False, 1.25))
  assert policy._replace(max_k=4) == FollowNoiseScale(min_k=2, max_k=4)


def test_noise_units_microbatch_selector_naming_the_gradient_twice_regression_issue_22():
  fun = optax_accum.microbatch(
    jax.value_and_grad(_loss), 2, noise_scale=lambda out: (out[1], out[1])
  )
  with pytest.raises(ValueError, match=r"selects output leaves \[1\] more than once"):
    fun(jnp.zeros(D), _data(0, 1, 1)[0])


def test_noise_units_microbatch_traced_invalid_weight_gives_nan_regression_issue_22():
  x = _data(1, 1, 1)[0]
  fun = optax_accum.microbatch(
    jax.value_and_grad(lambda p, x, w: _loss(p, x)),
    4,
    batch_argnums=(1, 2),
    noise_scale=1,
    weight_fn=lambda p, x, w: w[0],
  )
  for w, finite in ((1.0, True), (-1.0, False), (np.nan, False)):
    weights = jnp.full((B,), w, jnp.float32)
    (_, g), info = jax.jit(fun)(jnp.zeros(D), x, weights)
    assert bool(jnp.all(jnp.isfinite(g))) == finite
    assert bool(jnp.isfinite(info.noise.window_trace_cov)) == finite
    assert bool(jnp.isfinite(info.noise.b_simple)) == finite
