"""The core's sharp edges (issue 42): each test is the user's code that used to get a raw XLA
error, a half-deleted state or a silently wrong number, against an independent reference.

1. aliased leaves under donation (`optax.LookaheadParams.init_synced`, one array for two biases);
2. finite micro-batches whose sum overflows a narrow accumulator;
3. an end-padded last batch with `num_real_microbatches` and the default split;
4. stochastic rounding across devices (independent bits, a float32 reduction, fresh bits after a
   dropped window);
5. ``emit=False`` past a window's k-th call, an Orbax state restored without a target, a NaN
   micro-batch of weight 0 under ``skip_nonfinite="window"``.
"""

import pathlib

import _reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum.front_ends import _window

# ----------------------------------------------------------------------------------------------
# 1. Aliased leaves under donation.


def _lookahead_reference(params, micro, k, tx):
  """optax.lookahead applied once per window to the large batch's gradient at the fast weights
  (the k micro-batches joined), with no optax_accum at all."""
  lp = optax.LookaheadParams.init_synced(params)
  state = tx.init(lp)
  for w in range(len(micro) // k):
    grads = jax.grad(ref.mlp_loss)(lp.fast, ref.concat(micro[w * k : (w + 1) * k]))
    updates, state = tx.update(grads, state, lp)
    lp = optax.apply_updates(lp, updates)
  return lp


def test_train_step_trains_lookahead_built_with_init_synced():
  # The composition guide's documented use: TrainStep(loss, optax.lookahead(...)) with the
  # parameters optax.lookahead asks for, LookaheadParams.init_synced(params), whose slow
  # weights are the very arrays of its fast weights.
  params = jax.tree.map(jnp.asarray, ref.mlp_params(0))
  micro = ref.split(ref.regression_data(0, 48), 6)
  tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
  step = optax_accum.TrainStep(ref.mlp_loss, tx, every_k=2)
  lp = optax.LookaheadParams.init_synced(params)
  state = step.init(lp)
  for x in micro:  # 3 windows: 3 lookahead steps, one synchronisation
    lp, state, _ = step(lp, state, x)
  want = _lookahead_reference(ref.mlp_params(0), micro, 2, tx)
  chex.assert_trees_all_close(lp, want, **ref.TOL)
  assert int(state.gradient_step) == 3


def test_train_step_trains_parameters_that_share_one_array():
  zeros = jnp.zeros(8)  # one array for two biases
  params = {"w0": jnp.asarray(ref.mlp_params(0)["w0"]), "b0": zeros, "b_extra": zeros}

  def loss(p, batch):
    return ref.mlp_loss({**ref.mlp_params(0), "w0": p["w0"], "b0": p["b0"] + p["b_extra"]}, batch)

  micro = ref.split(ref.regression_data(1, 32), 4)
  step = optax_accum.TrainStep(loss, optax.sgd(0.1), every_k=2)
  state = step.init(params)
  p = params
  for x in micro:
    p, state, _ = step(p, state, x)
  separate = {"w0": ref.mlp_params(0)["w0"], "b0": np.zeros(8), "b_extra": np.zeros(8)}
  want = ref.run_steps(optax.sgd(0.1), separate, loss, ref.windows(micro, 2))[0]
  chex.assert_trees_all_close(p, want, **ref.TOL)


def _alive(tree):
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted()]


def test_a_refused_train_step_call_deletes_nothing_it_was_given():
  params = jax.tree.map(jnp.asarray, ref.mlp_params(0))
  micro = ref.split(ref.regression_data(2, 32), 4)
  step = optax_accum.TrainStep(ref.mlp_loss, optax.adam(1e-2), every_k=2)
  state = step.init(params)
  params, state, _ = step(params, state, micro[0])  # the next call updates: it donates both
  n = len(jax.tree.leaves((params, state)))
  other = optax_accum.TrainStep(ref.mlp_loss, optax.adam(1e-2), 1)  # a state for every_k=1
  wrong_params = {**params, "w0": params["w0"][:, :4]}
  for call, said in [
    (lambda: step(params, state, micro[1], weight=-1.0), "weight"),
    (lambda: step(wrong_params, state, micro[1]), "shapes"),
    (lambda: other(params, state, micro[1]), "made with every_k > 1"),
  ]:
    with pytest.raises(ValueError, match=said):
      call()
    assert len(_alive((params, state))) == n  # every array still there
  params, state, _ = step(params, state, micro[1])  # and the window completes with them
  assert int(state.gradient_step) == 1


# ----------------------------------------------------------------------------------------------
# 2. A finite window whose sum overflows.


def _overflow_run(front):
  """float16 parameters, accum_dtype=None (the accumulator in float16), every_k=2: two finite
  micro-batches whose gradients are 40000 each add up to 80000 > 65504, float16's largest."""
  params = jnp.zeros(2, jnp.float16)
  loss = lambda p, x: jnp.sum(p * x)  # noqa: E731
  x = jnp.full(2, 40000, jnp.float16)
  if front == "TrainStep":
    step = optax_accum.TrainStep(loss, optax.sgd(1e-4), 2, accum_dtype=None)
    state = step.init(params)
    for _ in range(2):
      params, state, _ = step(params, state, x)
    return params, state
  tx = optax_accum.accumulate(optax.sgd(1e-4), 2, accum_dtype=None)
  state = tx.init(params)
  update = jax.jit(tx.update, static_argnames="emit")
  for i in range(2):
    kw = {} if front == "dynamic" else {"emit": i == 1}
    updates, state = update(jax.grad(loss)(params, x), state, params, **kw)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("front", ["dynamic", "static", "TrainStep"])
def test_a_window_whose_finite_sum_overflows_is_dropped_and_counted(front):
  params, state = _overflow_run(front)
  np.testing.assert_array_equal(params, np.zeros(2, np.float16))  # not -inf
  assert int(state.num_skipped) == 2 and int(state.gradient_step) == 0


def test_overflow_window_check_is_one_read_per_window():
  # The accumulating program reads each gradient as before; only the closing program checks the
  # sums. Its control: the same window with float32 sums (accum_dtype's default) trains.
  params = jnp.zeros(2, jnp.float16)
  step = optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), optax.sgd(1e-4), 2)
  state = step.init(params)
  for _ in range(2):
    params, state, _ = step(params, state, jnp.full(2, 40000, jnp.float16))
  np.testing.assert_array_equal(params, np.full(2, -4.0, np.float16))  # the large batch's
  assert int(state.num_skipped) == 0 and int(state.gradient_step) == 1


def test_every_k_1_weighted_sum_that_overflows_is_dropped():
  tx = optax_accum.accumulate(optax.sgd(1.0), 1, reduction="sum", accum_dtype=None)
  params = jnp.zeros(2, jnp.float16)
  state = tx.init(params)
  updates, state = tx.update(jnp.full(2, 40000, jnp.float16), state, params, weight=2.0)
  np.testing.assert_array_equal(updates, np.zeros(2, np.float16))
  assert int(state.num_skipped) == 1 and int(state.gradient_step) == 0


# ----------------------------------------------------------------------------------------------
# 3. The usual padded last batch.

K3, B3 = 8, 32
VG = jax.value_and_grad(ref.mlp_loss)


def _end_padded(real=20):
  """The last batch of an epoch as usually padded: its `real` rows first, zeros after (np.pad)."""
  data = ref.regression_data(3, real)
  return data, jax.tree.map(lambda x: np.pad(x, [(0, B3 - real)] + [(0, 0)] * (x.ndim - 1)), data)


def test_num_real_microbatches_with_the_default_split_is_refused_naming_the_fix():
  with pytest.raises(ValueError, match=r"split='contiguous' for a batch padded at its end"):
    optax_accum.microbatch(VG, K3, num_real_microbatches=5)
  step = jax.jit(lambda p, b, n: optax_accum.microbatch(VG, K3, num_real_microbatches=n)(p, b))
  with pytest.raises(ValueError, match=r"left at its default 'strided'"):
    step(ref.mlp_params(3), _end_padded()[1], 5)
  # Where the layout cannot matter: one micro-batch, or all of them real.
  optax_accum.microbatch(VG, 1, num_real_microbatches=0)
  optax_accum.microbatch(VG, K3, num_real_microbatches=K3)


def test_end_padded_last_batch_gives_the_real_rows_gradient():
  real, padded = _end_padded()  # 20 real rows of 32: 5 micro-batches of 4 at k = 8
  params = ref.mlp_params(3)

  @jax.jit
  def step(params, batch, n):
    f = optax_accum.microbatch(VG, K3, split="contiguous", num_real_microbatches=n)
    return f(params, batch)

  chex.assert_trees_all_close(step(params, padded, 5), VG(params, real), **ref.TOL)


# ----------------------------------------------------------------------------------------------
# 4. Stochastic rounding across devices.

N4, K4 = 4096, 4
BF16_SR = dict(accum_dtype=jnp.bfloat16, rounding="stochastic")


def _sr_loss(p, x):
  return jnp.sum(p * jnp.mean(x, 0))


def _sr_windows(rng, windows=4, rows=16):
  """Windows of k micro-batches whose rows are all alike, so every device's piece has the same
  gradient: a first of ~1, then k-1 of ~2⁻¹⁰, below half a bfloat16 ulp of the sum."""
  out = []
  for _ in range(windows):
    g = rng.uniform(1.0, 1.5, (K4, N4)).astype(np.float32)
    g[1:] *= np.float32(2**-10)
    out.append([np.repeat(row[None], rows, 0) for row in g])
  return out


def _sr_error(make, windows):
  """The rms error of each window's mean against float64, one window per fresh state (its
  gradient_step moved on, so each window draws other bits)."""
  errors = []
  for w, micro in enumerate(windows):
    step = make()
    params = jnp.zeros(N4)
    state = step.init(params)
    state = state._replace(gradient_step=state.gradient_step + w)
    for x in micro:
      params, state, _ = step(params, state, jnp.asarray(x))
    exact = np.mean([x[0].astype(np.float64) for x in micro], 0)
    errors.append(np.asarray(params, np.float64) - exact)  # sgd(-1): params = the mean
  e = np.concatenate(errors)
  return np.sqrt(np.mean(e**2)), e.mean(), e.std() / np.sqrt(e.size)


@pytest.fixture(scope="module")
def sr_errors():
  """rms errors on one device and on 8 (TrainStep's leafwise emitting program), and with the
  window's all-reduce done in bfloat16 (the mutation control of the float32 reduction)."""
  mesh = jax.make_mesh((8,), ("data",))
  windows = _sr_windows(np.random.default_rng(0))
  one = lambda: optax_accum.TrainStep(_sr_loss, optax.sgd(-1.0), K4, **BF16_SR)  # noqa: E731
  eight = lambda: optax_accum.TrainStep(  # noqa: E731
    _sr_loss, optax.sgd(-1.0), K4, axis_name="data", mesh=mesh, **BF16_SR
  )
  out = {"one": _sr_error(one, windows), "eight": _sr_error(eight, windows)}
  with pytest.MonkeyPatch.context() as m:
    m.setattr(_window, "reduced_sums", lambda cfg, sums: sums)
    out["eight, bfloat16 reduction"] = _sr_error(eight, windows)
  return out


def test_stochastic_rounding_is_independent_per_device_and_reduced_in_float32(sr_errors):
  # Every device holds the same gradient. Independent bits: the mean of 8 devices' rounding
  # errors, rms 1/√8 = 0.354 of one device's; the same bits on every device: 1.0 (what each
  # device drew is one error, 8 times). A bfloat16 all-reduce of independent sums adds its own
  # roundings: 0.54 measured.
  rms1, _, _ = sr_errors["one"]
  rms8, mean8, se8 = sr_errors["eight"]
  ratio = rms8 / rms1  # its standard error ~ 0.4 % (16384 entries on each side)
  assert 0.32 < ratio < 0.40, ratio
  assert abs(mean8) < 3 * se8 + 1e-7, (mean8, se8)  # unbiased
  control = sr_errors["eight, bfloat16 reduction"][0] / rms1
  assert control > 0.45, control


def test_stochastic_rounding_bits_differ_per_device_under_shard_map():
  # The protocol path inside the user's own shard_map: the devices' accumulators, fed the same
  # gradient, hold different roundings of it (the window's all-reduce is `_window._global`).
  mesh = jax.make_mesh((8,), ("data",))
  tx = optax_accum.accumulate(optax.sgd(-1.0), K4, axis_name="data", **BF16_SR)
  g = jnp.full((8, 64), 1 + 2**-9 + 2**-12, jnp.float32)  # between two bfloat16 values

  def run(g):  # each device's row of g: its own (device-varying) gradient
    params = jnp.zeros(64)
    state = tx.init(params)
    _, state = tx.update(g[0], state, params)
    return state.grad_sum  # (1, 64) per device: its own accumulator

  spec = jax.sharding.PartitionSpec("data")
  g = jax.device_put(g, jax.sharding.NamedSharding(mesh, spec))
  sums = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec))(g)
  rows = {tuple(np.asarray(r, np.float32)) for r in np.asarray(sums).reshape(8, 64)}
  assert len(rows) == 8, len(rows)


def test_stochastic_rounding_draws_fresh_bits_after_a_dropped_window():
  # skip_nonfinite="window": a window with a NaN is dropped whole and does not count as an
  # update, so the next window starts at the same (gradient_step, mini_step). Its bits must
  # still be new: the same first micro-batch rounds differently.
  tx = optax_accum.accumulate(
    optax.sgd(-1.0), 2, skip_nonfinite="window", reduction="sum", **BF16_SR
  )
  update = jax.jit(tx.update)
  params = jnp.zeros(4096)
  g = jnp.asarray(np.random.default_rng(4).uniform(1, 2, 4096).astype(np.float32))
  state = tx.init(params)
  _, state = update(g, state, params)
  first = np.asarray(state.grad_sum, np.float32)
  _, state = update(jnp.full(4096, jnp.nan), state, params)  # the window is dropped
  assert (int(state.num_skipped), int(state.gradient_step)) == (2, 0)
  _, state = update(g, state, params)
  again = np.asarray(state.grad_sum, np.float32)
  assert np.mean(first != again) > 0.2, np.mean(first != again)


# ----------------------------------------------------------------------------------------------
# 5. Small things.


def test_emit_false_past_the_kth_call_is_refused():
  tx = optax_accum.accumulate(optax.sgd(0.1), every_k=4)
  params = jnp.zeros(3)
  state = tx.init(params)
  for _ in range(3):
    _, state = tx.update(jnp.ones(3), state, params, emit=False)
  with pytest.raises(ValueError, match=r"emit=False on call 4 of a window of 4 micro-steps"):
    tx.update(jnp.ones(3), state, params, emit=False)
  updates, state = tx.update(jnp.ones(3), state, params, emit=True)  # the fix
  np.testing.assert_allclose(updates, np.full(3, -0.1))


def test_orbax_restore_without_a_target_names_the_recipe(tmp_path: pathlib.Path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = optax_accum.accumulate(optax.adam(1e-2), every_k=2)
  params = {"w": jnp.zeros(3)}
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "c", {"params": params, "opt_state": tx.init(params)})
  ckptr.wait_until_finished()
  untyped = ocp.StandardCheckpointer().restore(tmp_path / "c")
  with pytest.raises(TypeError, match=r"(?s)restored without a target .* jax.eval_shape"):
    tx.update(params, untyped["opt_state"], untyped["params"])
  step = optax_accum.TrainStep(lambda p, x: jnp.sum(p["w"] * x), optax.adam(1e-2), 2)
  with pytest.raises(TypeError, match=r"TrainStep: the state is a dict of 9 entries"):
    step(untyped["params"], untyped["opt_state"], jnp.ones(3))
  abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params)
  restored = ocp.StandardCheckpointer().restore(tmp_path / "c", abstract)  # the recipe
  tx.update(params, restored["opt_state"], restored["params"])


@pytest.mark.parametrize("skip", [True, "window", False])
def test_a_zero_weight_contributes_nothing_even_a_nan(skip):
  tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2, skip_nonfinite=skip)
  params = jnp.zeros(2)
  state = tx.init(params)
  _, state = tx.update(jnp.array([1.0, 2.0]), state, params, weight=0.5)
  updates, state = tx.update(jnp.array([jnp.nan, 2.0]), state, params, weight=0.0)
  np.testing.assert_array_equal(updates, [-1.0, -2.0])  # the first micro-batch's alone
  assert int(state.gradient_step) == 1
  assert int(state.num_skipped) == (1 if skip is True else 0)  # True checks every micro-batch
