"""DP-SGD with virtual batches: ĝ = (Σ clip_C(∇ℓᵢ) + σ·C·ξ) / B, noise once per update.

σ = 0: every split (in one step, across steps, TrainStep, devices) equals the independent
per-example float64 reference Σ clip_C(gᵢ) / B (`test_dp_clipping.reference_sum`) to 2e-6 of
its scale. σ > 0: the noise's statistics over 2,000 seeds, its sameness across devices, and the
number of random-number draws in the compiled programs.
"""

import gc
import re

import _reference as ref
import _stats as stats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from test_dp_clipping import assert_close, median_norm, reference_sum

import optax_accum as oa
from optax_accum.core import _hlo

N = 64  # one logical batch; B = N (fixed batches)
AX = ref.AXIS


@pytest.fixture(scope="module")
def problem():
  params, batch = ref.mlp_params(0), ref.regression_data(1, N)
  clip = median_norm(params, batch)
  expected = jax.tree.map(lambda v: v / N, reference_sum(params, batch, clip))
  return params, batch, clip, expected


_SEEDS = iter(range(10_000, 1_000_000))


def noise(sigma, clip, batch_size=N):
  """A dp_noise with a fresh key (each test its own stream)."""
  return oa.privacy.dp_noise(sigma, clip, float(batch_size), jax.random.key(next(_SEEDS)))


def micro_batches(batch, k):
  size = len(batch["x"]) // k
  return [jax.tree.map(lambda v, i=i: v[i * size : (i + 1) * size], batch) for i in range(k)]


# ----------------------------------------------------------------------------------------------
# σ = 0: exact against the reference.


@pytest.mark.parametrize("k", [1, 4, 16])
def test_dp_noise_sigma_zero_in_one_step_matches_reference(problem, k):
  params, batch, clip, expected = problem
  tx = noise(0.0, clip)
  summed = oa.microbatch(
    oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None), k, reduction="sum"
  )

  @jax.jit
  def step(params, state, batch):
    return tx.update(summed(params, batch), state, params)

  updates, state = step(params, tx.init(params), batch)
  assert_close(updates, expected)
  assert int(oa.privacy.dp_updates(state)) == 1


@pytest.mark.parametrize("k", [2, 8])
def test_dp_noise_sigma_zero_across_steps_matches_reference(problem, k):
  params, batch, clip, expected = problem
  tx = oa.accumulate(noise(0.0, clip), k, reduction="sum")
  grad = jax.jit(jax.grad(oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None)))
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i, mb in enumerate(micro_batches(batch, k)):
    updates, state = update(grad(params, mb), state, params)
    assert bool(oa.has_updated(state)) == (i == k - 1)
  assert_close(updates, expected)
  assert int(oa.privacy.dp_updates(state)) == 1


def test_dp_noise_sigma_zero_train_step_matches_reference(problem):
  params, batch, clip, expected = problem
  inner = optax.chain(noise(0.0, clip), optax.sgd(1.0))
  step = oa.TrainStep(
    oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None), inner, every_k=4, reduction="sum"
  )
  state, new = step.init(params), params
  for mb in micro_batches(batch, 4):
    new, state, _ = step(new, state, mb)
  moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, params, new)
  assert_close(moved, expected, rtol=1e-5)  # through p - (p - ĝ): float32 rounding of p
  assert int(oa.privacy.dp_updates(state)) == 1


def _shard_map_run(params, batches, mesh, clip, k, sigma=0.0, key_seed=None):
  """accumulate(dp_noise, k, axis_name) inside shard_map: the emitted update of one window,
  per device (stacked along the axis, so that devices can be compared)."""
  key = jax.random.key(next(_SEEDS) if key_seed is None else key_seed)
  tx = oa.accumulate(
    oa.privacy.dp_noise(sigma, clip, float(N), key), k, reduction="sum", axis_name=AX
  )
  grad = jax.grad(oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None))

  def micro(params, state, batch):
    updates, state = tx.update(grad(lax.pcast(params, AX, to="varying"), batch), state, params)
    per_device = jax.tree.map(lambda u: lax.pcast(u, AX, to="varying")[None], updates)
    return per_device, state

  pspec = jax.tree.map(lambda _: P(), params)
  sspec = oa.state_partition_specs(tx, pspec, AX)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspec,), out_specs=sspec))
  step = jax.jit(
    jax.shard_map(micro, mesh=mesh, in_specs=(pspec, sspec, P(AX)), out_specs=(P(AX), sspec))
  )
  p = ref.shard(params, mesh, P())
  state = init(p)
  for mb in batches:
    updates, state = step(p, state, ref.shard(mb, mesh, P(AX)))
  return jax.tree.map(np.asarray, updates), state


def test_dp_noise_two_devices_times_k_equals_one_device_times_2k(problem):
  params, batch, clip, expected = problem
  k = 4
  two = jax.make_mesh((2,), (AX,), devices=jax.devices()[:2])
  one = jax.make_mesh((1,), (AX,), devices=jax.devices()[:1])
  per_device, _ = _shard_map_run(params, micro_batches(batch, k), two, clip, k)
  single, state = _shard_map_run(params, micro_batches(batch, 2 * k), one, clip, 2 * k)
  for d in range(2):
    assert_close(jax.tree.map(lambda u, d=d: u[d], per_device), expected)
  assert_close(jax.tree.map(lambda u: u[0], single), expected)
  assert_close(jax.tree.map(lambda u: u[0], per_device), jax.tree.map(lambda u: u[0], single))


def test_dp_noise_in_step_microbatch_across_devices_matches_reference(problem):
  params, batch, clip, expected = problem
  mesh = jax.make_mesh((2,), (AX,), devices=jax.devices()[:2])
  tx = noise(0.0, clip)
  summed = oa.microbatch(
    oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None), 4, reduction="sum", axis_name=AX
  )

  def step(params, state, batch):
    return tx.update(summed(params, batch), state, params)

  pspec = jax.tree.map(lambda _: P(), params)
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(pspec, P(), P(AX)), out_specs=(pspec, P())))
  updates, _ = f(ref.shard(params, mesh, P()), tx.init(params), ref.shard(batch, mesh, P(AX)))
  assert_close(updates, expected)


def test_dp_noise_train_step_data_parallel_matches_reference(problem):
  params, batch, clip, expected = problem
  mesh = jax.make_mesh((2,), (AX,), devices=jax.devices()[:2])
  inner = optax.chain(noise(0.0, clip), optax.sgd(1.0))
  loss = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None)
  step = oa.TrainStep(loss, inner, every_k=2, reduction="sum", axis_name=AX, mesh=mesh)
  state, new = step.init(params), params
  for mb in micro_batches(batch, 2):
    new, state, _ = step(new, state, mb)
  moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b), params, new)
  assert_close(moved, expected, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# σ > 0: the noise.

SEEDS = 2000
SIGMA = 1.3
K = 16  # micro-steps per update


def _noisy_runs(params, batch, clip, sigma):
  """Two updates (windows of K micro-steps) for each of SEEDS keys, vmapped over the keys."""
  tx = oa.accumulate(
    oa.privacy.dp_noise(sigma, clip, float(N), jax.random.key(7)), K, reduction="sum"
  )
  grad = jax.grad(oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None))
  stacked = jax.tree.map(lambda v: v.reshape(K, N // K, *v.shape[1:]), batch)

  def run(start):
    # Independent noise streams from one key: each run starts at its own update count (the key
    # is not in the state; fold_in(key, count) is as good a stream as another key's).
    state = optax.tree_utils.tree_set(tx.init(params), count=start)

    def window(state, _):
      def micro(state, mb):
        updates, state = tx.update(grad(params, mb), state, params)
        return state, updates

      state, updates = lax.scan(micro, state, stacked)
      return state, jax.tree.map(lambda u: u[-1], updates)  # the emitting step's update

    return lax.scan(window, state, length=2)[1]

  starts = jnp.arange(SEEDS, dtype=jnp.int32) * 1000  # two updates each: no count shared
  return jax.jit(jax.vmap(run))(starts)


@pytest.fixture(scope="module")
def noise_samples(problem):
  params, batch, clip, expected = problem
  updates = _noisy_runs(params, batch, clip, SIGMA)
  flat = lambda t: np.concatenate(  # noqa: E731
    [np.asarray(v, np.float64).reshape(SEEDS, 2, -1) for v in jax.tree.leaves(t)], axis=-1
  )
  clean = np.concatenate([np.ravel(v) for v in jax.tree.leaves(expected)])
  return flat(updates) - clean, SIGMA * clip / N


def test_dp_noise_std_is_sigma_c_over_b_not_sqrt_k_larger(noise_samples):
  z, std = noise_samples  # (seeds, updates, coordinates)
  # z.size = 200,000 draws: the std estimate's standard error is std / √(2n) = 0.16 %, so the
  # tolerance (3 SE) is 0.47 %, and the control (the same draw 2 % low, 2 % high) must fail it.
  stats.check_std(z, std, "dp_noise std")
  assert z.std() < std * np.sqrt(K) / 2  # noise per micro-step would be sqrt(K) larger


def test_dp_noise_is_unbiased(noise_samples):
  z, std = noise_samples
  per_coordinate = z.mean(axis=(0, 1))  # each coordinate's mean over 2 x SEEDS draws
  se = std / np.sqrt(z.shape[0] * z.shape[1])
  assert np.all(np.abs(per_coordinate) < 4.5 * se)  # 4.5 SE: 50 coordinates at once
  assert abs(z.mean()) < 3 * std / np.sqrt(z.size)


def test_dp_noise_differs_between_updates_and_seeds(noise_samples):
  z, std = noise_samples
  first, second = z[:, 0].ravel(), z[:, 1].ravel()
  assert not np.any(first == second)
  corr = np.corrcoef(first, second)[0, 1]
  assert abs(corr) < 3 / np.sqrt(first.size)
  across_seeds = np.corrcoef(z[:-1, 0].ravel(), z[1:, 0].ravel())[0, 1]
  assert abs(across_seeds) < 3 / np.sqrt(first.size)


def test_dp_noise_is_the_same_on_every_device(problem):
  params, batch, clip, _ = problem
  mesh = jax.make_mesh((8,), (AX,))
  per_device, _ = _shard_map_run(params, micro_batches(batch, 2), mesh, clip, 2, sigma=SIGMA)
  for leaf in jax.tree.leaves(per_device):
    leaf = np.asarray(leaf)
    assert np.all(leaf == leaf[:1]), "devices drew different noise"
  # and it is noise: the σ = 0 run differs from it
  clean, _ = _shard_map_run(params, micro_batches(batch, 2), mesh, clip, 2, sigma=0.0)
  assert ref.max_abs_diff(per_device, clean) > 0.1 * SIGMA * clip / N


def test_dp_noise_train_step_same_noise_on_every_device_shard(problem):
  params, batch, clip, _ = problem
  mesh = jax.make_mesh((8,), (AX,))
  inner = optax.chain(noise(SIGMA, clip), optax.sgd(1.0))
  loss = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None)
  step = oa.TrainStep(loss, inner, every_k=2, reduction="sum", axis_name=AX, mesh=mesh)
  state, new = step.init(params), params
  for mb in micro_batches(batch, 2):
    new, state, _ = step(new, state, mb)
  for leaf in jax.tree.leaves(new):
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == 8 and all(np.array_equal(s, shards[0]) for s in shards)


# ----------------------------------------------------------------------------------------------
# A window whose sums are not finite: every front end makes the same noisy update.
#
# Clipped sums are finite by construction (a non-finite per-example gradient counts 0), but a
# gradient clipping did not make (a user's own, a NaN clipping does not catch) can reach a
# private window. Every front end then drops what `skip_nonfinite` says (the micro-batch, or
# with "window" the whole window), counts it in `num_skipped`, and still makes the window's
# noisy update, counted by `dp_updates`: the update of the sums without what was dropped.

WK, DEVICES = 3, 8  # micro-steps per window; devices of the axis (each takes 1/8 of a gradient)
NAN_AT = 1  # the micro-step of the first window whose gradient holds the NaN
NF_PARAMS = {"w": np.array([0.5, -1.0, 2.0], np.float32), "b": np.float32(0.25)}


def _pieces(i, planted=(), zero=False):
  """Micro-step `i`'s gradient as DEVICES equal pieces (a leading axis; powers of two, so any
  order of summing them is exact), with a NaN in ``w[0]`` of the pieces in `planted`; `zero`:
  the micro-batch dropped, for the reference."""
  g = {"w": np.array([1.0, -2.0, 0.5], np.float32) * (i + 1), "b": np.float32(i + 1)}
  pieces = {
    k: np.repeat(np.float32(v)[None] / DEVICES * (not zero), DEVICES, 0) for k, v in g.items()
  }
  for d in planted:
    pieces["w"][d, 0] = np.nan
  return pieces


def piece_loss(p, pieces):
  """A loss whose gradient is the sum of `pieces` along their leading axis (NaN included)."""
  return jnp.sum(p["w"] * pieces["w"].sum(0)) + p["b"] * pieces["b"].sum()


def _dp_inner():
  """σ > 0, one key for every front end (the same run, rebuilt): the same noise in each."""
  key = jax.random.key(2026)
  return optax.chain(oa.privacy.dp_noise(0.5, 1.0, 4.0, key, allow_key_reuse=True), optax.sgd(1.0))


def _counters(state):
  return {
    "gradient_step": int(state.gradient_step),
    "num_skipped": np.broadcast_to(np.asarray(state.num_skipped), (DEVICES,)).tolist(),
    "dp_updates": int(oa.privacy.dp_updates(state)),
  }


def _nf_accumulate(skip, batches, emit_static=False):
  tx = oa.accumulate(_dp_inner(), WK, reduction="sum", skip_nonfinite=skip)
  kw = lambda i: {"emit": i % WK == WK - 1} if emit_static else {}  # noqa: E731
  update = jax.jit(tx.update, static_argnames="emit")
  p, state, after = NF_PARAMS, tx.init(NF_PARAMS), []
  for i, pieces in enumerate(batches):
    u, state = update(jax.grad(piece_loss)(p, pieces), state, p, **kw(i))
    p = optax.apply_updates(p, u)
    if i % WK == WK - 1:
      after.append(p)
  return after, state


def _nf_accumulate_shard_map(skip, batches):
  mesh = jax.make_mesh((DEVICES,), (AX,))
  tx = oa.accumulate(_dp_inner(), WK, reduction="sum", skip_nonfinite=skip, axis_name=AX)

  def micro(p, state, pieces):
    u, state = tx.update(jax.grad(piece_loss)(lax.pcast(p, AX, to="varying"), pieces), state, p)
    return optax.apply_updates(p, u), state

  pspec = jax.tree.map(lambda _: P(), NF_PARAMS)
  sspec = oa.state_partition_specs(tx, pspec, AX)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspec,), out_specs=sspec))
  specs = (pspec, sspec, P(AX))
  step = jax.jit(jax.shard_map(micro, mesh=mesh, in_specs=specs, out_specs=(pspec, sspec)))
  p = ref.shard(NF_PARAMS, mesh, P())
  state, after = init(p), []
  for i, pieces in enumerate(batches):
    p, state = step(p, state, ref.shard(pieces, mesh, P(AX)))
    if i % WK == WK - 1:
      after.append(p)
  return after, state


def _nf_train_step(skip, batches, **kw):
  def planted_loss(p, pieces):  # stands for a clipped loss (TrainStep needs both halves)
    return piece_loss(p, pieces)

  planted_loss.__dp_private__ = True
  step = oa.TrainStep(
    planted_loss, _dp_inner(), WK, reduction="sum", skip_nonfinite=skip, donate=False, **kw
  )
  p = jax.tree.map(jnp.asarray, NF_PARAMS)
  state, after = step.init(p), []
  for i, pieces in enumerate(batches):
    p, state, _ = step(p, state, pieces)
    if i % WK == WK - 1:
      after.append(p)
  return after, state


@pytest.mark.parametrize("skip", [True, "window"])
def test_private_nonfinite_window_same_in_every_front_end(skip):
  # "window": one device's piece is NaN, which makes the window's global sums NaN: dropped
  # whole, on every device. True: the micro-batch is NaN on every device (each device drops its
  # own piece, so a NaN on one device would drop that piece only, as designed).
  planted = (0,) if skip == "window" else tuple(range(DEVICES))
  batches = [_pieces(i, planted if i == NAN_AT else ()) for i in range(2 * WK)]
  dropped = range(WK) if skip == "window" else (NAN_AT,)
  clean = [_pieces(i, zero=i in dropped) for i in range(2 * WK)]
  want, _ = _nf_accumulate(False, clean)  # the same noise on sums without what was dropped
  mesh = jax.make_mesh((DEVICES,), (AX,))
  runs = {
    "accumulate": lambda: _nf_accumulate(skip, batches),
    "accumulate(emit=)": lambda: _nf_accumulate(skip, batches, emit_static=True),
    "accumulate(axis_name) in shard_map": lambda: _nf_accumulate_shard_map(skip, batches),
    "TrainStep": lambda: _nf_train_step(skip, batches),
    "TrainStep(axis_name)": lambda: _nf_train_step(skip, batches, axis_name=AX, mesh=mesh),
  }
  counters = {"gradient_step": 2, "num_skipped": [len(dropped)] * DEVICES, "dp_updates": 2}
  for name, run in runs.items():
    after, state = run()
    for got, expected in zip(after, want, strict=True):
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)
    assert _counters(state) == counters, name
  # The dropped window's update is the noise alone: the parameters moved, by σC/B-sized steps.
  if skip == "window":
    pairs = zip(jax.tree.leaves(want[0]), jax.tree.leaves(NF_PARAMS), strict=True)
    assert max(np.max(np.abs(a - b)) for a, b in pairs) > 0.01


# ----------------------------------------------------------------------------------------------
# Random numbers in the compiled programs: once per update, whatever k.


_RNG = re.compile(r"jit\((_threefry\w*|_normal\w*|_uniform|_random_bits|_bernoulli|_gamma\w*)\)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _is_rng(line):
  """An instruction of a random-number computation (by JAX's op_name metadata), or an rng op."""
  m = _OP_NAME.search(line)
  parsed = _hlo.parse_instruction(line.strip())
  return bool((m and _RNG.search(m.group(1))) or (parsed and parsed.op.startswith("rng")))


def rng_ops(hlo_text):
  """Random-number instructions of an optimised HLO module, by where they run: "step" (once
  per call), "loop" (in the body of one of the program's while loops: once per iteration),
  "cond" (in a conditional branch). The hash's own loops (threefry rounds) are not the
  program's loops: a while loop whose metadata says it belongs to a random function keeps its
  caller's placement. Fusion bodies take their caller's placement."""
  comps, entry = _hlo.computations(hlo_text)
  lines = {}
  for line in hlo_text.splitlines():
    parsed = _hlo.parse_instruction(line.strip())
    if parsed is not None:
      lines[parsed.name] = line
  where, todo = {}, [(entry, "step")]
  while todo:
    name, place = todo.pop()
    if name in where or name not in comps:
      continue
    where[name] = place
    for instr in comps[name]:
      inner = place
      if instr.op == "while" and not _is_rng(lines.get(instr.name, "")):
        inner = "loop" if place == "step" else place
      elif instr.op == "conditional":
        inner = "cond"
      todo += [(c, inner) for c in _hlo.callees(instr)]
  counts = {"step": 0, "loop": 0, "cond": 0}
  for name, instrs in comps.items():
    for instr in instrs:
      if name in where and _is_rng(lines.get(instr.name, "")):
        counts[where[name]] += 1
  return counts


def _in_step_hlo(params, clip, k, sigma):
  batch = ref.regression_data(1, 4 * k)
  tx = noise(sigma, clip, 4 * k)
  summed = oa.microbatch(
    oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None), k, reduction="sum"
  )

  def step(params, state, batch):
    return tx.update(summed(params, batch), state, params)

  return jax.jit(step).lower(params, tx.init(params), batch).compile().as_text()


def _accumulate_hlo(params, clip, k, sigma):
  tx = oa.accumulate(noise(sigma, clip, 4 * k), k, reduction="sum")
  grad = jax.grad(oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None))
  step = lambda p, s, b: tx.update(grad(p, b), s, p)  # noqa: E731
  return jax.jit(step).lower(params, tx.init(params), ref.regression_data(1, 4)).compile().as_text()


def test_dp_noise_draws_random_numbers_once_per_update_whatever_k(problem):
  params, _, clip, _ = problem
  in_step = {k: rng_ops(_in_step_hlo(params, clip, k, SIGMA)) for k in (2, 16)}
  assert in_step[2]["loop"] == in_step[16]["loop"] == 0, in_step  # none per micro-batch
  assert in_step[2] == in_step[16] and in_step[2]["step"] > 0, in_step
  assert rng_ops(_in_step_hlo(params, clip, 16, 0.0)) == {"step": 0, "loop": 0, "cond": 0}
  # Across steps (device conditional): only in the emitting branch, the same for every k.
  across = {k: rng_ops(_accumulate_hlo(params, clip, k, SIGMA)) for k in (2, 16)}
  assert across[2] == across[16] and across[2]["cond"] > 0, across
  assert across[2]["step"] == across[2]["loop"] == 0, across


def test_dp_noise_train_step_accumulating_program_draws_nothing(problem):
  params, batch, clip, _ = problem
  inner = optax.chain(noise(SIGMA, clip), optax.sgd(1.0))
  loss = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None)
  counts = {}
  for k in (2, 16):
    step = oa.TrainStep(loss, inner, every_k=k, reduction="sum", donate=False)
    state, mb = step.init(params), micro_batches(batch, 16)[0]
    counts[k] = {
      emit: rng_ops(step.lower(params, state, mb, emit=emit).compile().as_text())
      for emit in (False, True)
    }
  assert counts[2] == counts[16], counts
  assert sum(counts[2][False].values()) == 0, counts  # nothing drawn on accumulating steps
  # The emitting program draws (in the branch that guards an empty window), never per loop.
  assert counts[2][True]["loop"] == 0 and sum(counts[2][True].values()) > 0, counts


# ----------------------------------------------------------------------------------------------
# Dtypes and bad input.


def test_dp_noise_keeps_gradient_dtypes():
  tx = noise(1.0, 1.0, 8)
  grads = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones((2, 2), jnp.float32)}
  updates, state = jax.jit(tx.update)(grads, tx.init(grads))
  assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda g: g.dtype, grads)
  assert state.count.dtype == jnp.int32 and state._fields == ("count",)  # no key in the state


@pytest.mark.parametrize(
  "args, match",
  [
    ((-0.1, 1.0, 8.0), r"noise_multiplier must be a finite number >= 0, got -0.1"),
    ((1.0, 0.0, 8.0), r"l2_clip must be a positive finite number, got 0.0"),
    ((1.0, -2.0, 8.0), r"l2_clip must be a positive finite number, got -2.0"),
    ((1.0, 1.0, 0), r"expected_batch_size must be a positive finite number, got 0"),
    ((1.0, 1.0, -8.0), r"expected_batch_size must be a positive finite number, got -8.0"),
    ((np.nan, 1.0, 8.0), r"noise_multiplier must be a finite number >= 0, got nan"),
  ],
)
def test_dp_noise_rejects_out_of_range_arguments(args, match):
  with pytest.raises(ValueError, match=rf"dp_noise: {match}"):
    oa.privacy.dp_noise(*args, jax.random.key(next(_SEEDS)))


def test_dp_noise_rejects_a_reused_key():
  key = jax.random.key(123_456)
  first = oa.privacy.dp_noise(1.0, 1.0, 8.0, key)
  with pytest.raises(ValueError, match=r"dp_noise: this key \(data \[0, 123456\]\) was already"):
    oa.privacy.dp_noise(1.0, 1.0, 8.0, key)
  with pytest.raises(ValueError, match=r"already given to a dp_noise in this process"):
    oa.privacy.dp_noise(2.0, 1.0, 8.0, jax.random.PRNGKey(123_456))  # the same key, legacy spelling
  again = oa.privacy.dp_noise(1.0, 1.0, 8.0, key, allow_key_reuse=True)  # a resumed run
  assert again is not first
  del first, again
  gc.collect()
  with pytest.raises(ValueError, match=r"already given to a dp_noise in this process"):
    oa.privacy.dp_noise(1.0, 1.0, 8.0, key)  # no live holder: still the same noise (issue 40)
  oa.privacy.dp_noise(0.0, 1.0, 8.0, key)  # σ = 0 draws nothing from the key


def test_dp_noise_key_of_a_finished_run_is_still_refused():
  """A re-run notebook cell: the first run is gone (collected), its key is not free again."""
  key = jax.random.key(654_321)

  class Run:  # a training-step object in a reference cycle, as TrainStep and its closures are
    def __init__(self):
      self.tx = oa.privacy.dp_noise(1.0, 1.0, 8.0, key)
      self.me = self

  Run()  # finished: unreachable
  gc.collect()
  with pytest.raises(ValueError, match=r"already given to a dp_noise in this process"):
    oa.privacy.dp_noise(1.0, 1.0, 8.0, key)


@pytest.mark.parametrize(
  "key, match",
  [
    (0, r"key must be a PRNG key .* got 0"),
    (np.zeros(3, np.uint32), r"got uint32\[3\]"),
    (jax.random.split(jax.random.key(0), 2), r"single PRNG key, got keys of shape \(2,\)"),
  ],
)
def test_dp_noise_rejects_what_is_not_one_key(key, match):
  with pytest.raises((TypeError, ValueError), match=match):
    oa.privacy.dp_noise(1.0, 1.0, 8.0, key)


def test_dp_updates_needs_exactly_one_noise_state():
  with pytest.raises(ValueError, match=r"dp_updates: the state must hold exactly one .*found 0"):
    oa.privacy.dp_updates(optax.adam(1e-3).init(jnp.zeros(2)))
  two = optax.chain(noise(1.0, 1.0), noise(1.0, 1.0))
  with pytest.raises(ValueError, match=r"found 2"):
    oa.privacy.dp_updates(two.init(jnp.zeros(2)))


def test_dp_noise_rides_on_the_one_all_reduce_per_update(problem):
  # The noise adds no collective: the emitting program of a private TrainStep has exactly the
  # gradient-sized all-reduces of the same step without dp_noise (one per leaf or combined, plus
  # the exact re-reduction in a conditional that runs only when a device dropped its last
  # micro-batch: XLA's combiner decides how many), the accumulating program none, no loop any.
  params, batch, clip, _ = problem
  mesh = jax.make_mesh((2,), (AX,), devices=jax.devices()[:2])
  loss = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=None)
  big = 4 * sum(v.size for v in jax.tree.leaves(params)) // 8  # the loss's scalar is not one
  for k in (2, 16):
    counts = {}
    for name, inner in (
      ("noise", optax.chain(noise(SIGMA, clip), optax.sgd(1.0))),
      # σ = 0: no random numbers, the division only (a clipped loss needs dp_noise in TrainStep)
      ("plain", optax.chain(noise(0.0, clip), optax.sgd(1.0))),
    ):
      step = oa.TrainStep(loss, inner, every_k=k, reduction="sum", axis_name=AX, mesh=mesh)
      state, mb = step.init(params), micro_batches(batch, 16)[0]
      for e in (False, True):
        text = step.lower(params, state, mb, emit=e).compile().as_text()
        counts[name, e] = oa.count_collectives(text, "all-reduce", min_bytes=big)
        assert oa.count_collectives(text, "all-reduce", where="loop") == 0
    assert counts["noise", False] == counts["plain", False] == 0, counts
    assert counts["noise", True] == counts["plain", True] >= 1, counts


# ----------------------------------------------------------------------------------------------
# Every key implementation.

IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


@pytest.mark.parametrize("impl", IMPLS)
def test_dp_noise_takes_every_key_implementation(impl):
  # One update of a 200,000-coordinate zero gradient: 200,000 draws, whose std has a standard
  # error of 1/√400,000 = 0.16 %: the tolerance is 3 SE (0.47 %), and the same draw 2 % low or
  # 2 % high must fail it (the control).
  clip, batch = 2.0, 8.0
  tx = oa.privacy.dp_noise(SIGMA, clip, batch, jax.random.key(next(_SEEDS), impl=impl))
  zeros = jnp.zeros(200_000)
  state = tx.init(zeros)
  assert state._fields == ("count",)  # the key stays with the transformation
  update = jax.jit(tx.update)
  first, state = update(zeros, state)
  second, state = update(zeros, state)
  std = SIGMA * clip / batch
  for z in (first, second):
    stats.check_std(z, std, f"dp_noise std ({impl})")
    assert abs(float(jnp.mean(z))) < 3 * std / np.sqrt(z.size)
  assert abs(np.corrcoef(first, second)[0, 1]) < 3 / np.sqrt(first.size)  # fresh per update
  assert int(oa.privacy.dp_updates(state)) == 2
  # Inside accumulate (the device conditional) and at σ = 0 (exact).
  acc = oa.accumulate(
    oa.privacy.dp_noise(0.0, clip, batch, jax.random.key(next(_SEEDS), impl=impl)),
    2,
    reduction="sum",
  )
  s = acc.init(zeros[:3])
  for _ in range(2):
    u, s = jax.jit(acc.update)(jnp.ones(3), s)
  np.testing.assert_array_equal(u, np.full(3, 2 / batch, np.float32))


def test_dp_noise_same_key_data_of_other_implementations_are_different_keys():
  # rbg's key data is 4 words: never confused with a threefry key (2 words), held or not.
  a = oa.privacy.dp_noise(1.0, 1.0, 8.0, jax.random.key(777_001, impl="rbg"))
  b = oa.privacy.dp_noise(1.0, 1.0, 8.0, jax.random.key(777_001, impl="unsafe_rbg"))
  with pytest.raises(ValueError, match=r"already given to a dp_noise in this process"):
    oa.privacy.dp_noise(1.0, 1.0, 8.0, jax.random.key(777_001, impl="rbg"))
  del a, b
