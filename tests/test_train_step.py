"""TrainStep: the static two-program path equals the large batch and the dynamic path.

The reference is `_reference.run_steps` (a plain optax step on a direct `jax.grad` of the whole
batch); the compiled structure of the two programs is guarded in test_structure.py.
"""

import functools

import _reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

P0 = ref.mlp_params(42, (6, 8, 1))
SGD, MOMENTUM, ADAM = ref.SGD, ref.MOMENTUM, ref.ADAM


def _micro_batches(n, b, seed=0):
  """`n` micro-batches of `b` examples."""
  return ref.split(ref.regression_data(seed, n * b, 6, 1), n)


def _run(step, batches, params=P0, state=None, **kw):
  """`step` over `batches`, one call each, from `params` and `state` (``step.init``)."""
  state = step.init(params) if state is None else state
  for batch in batches:
    params, state, _ = step(params, state, batch, **kw)
  return params, state


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("donate", [True, False])
def test_train_step_matches_large_batch(k, donate):
  # Momentum: sensitive to the scale of the window's gradient (Adam is nearly blind to it).
  n_updates = 3
  mbs = _micro_batches(k * n_updates, 4)
  step = optax_accum.TrainStep(ref.mlp_loss, MOMENTUM, every_k=k, donate=donate)
  params, state = _run(step, mbs)
  want, _ = ref.run_steps(MOMENTUM, P0, ref.mlp_loss, ref.windows(mbs, k))
  assert int(state.gradient_step) == n_updates
  chex.assert_trees_all_close(params, want, **ref.TOL)


def test_train_step_equals_dynamic_accumulate():
  """Same numbers as the dynamic path; the counters exactly, the floats to rounding.

  Not bitwise: TrainStep applies the update inside the emitting branch, where XLA fuses the Adam
  update into the apply and may contract multiply-adds differently (1 ulp). The accumulator is
  not compared: after a window closes it is stale (the next micro-step ignores it), and the
  dynamic path leaves the returned updates there, TrainStep the window's sums.
  """
  k = 3
  mbs = _micro_batches(2 * k, 4, seed=1)
  step = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=k, donate=False)
  p1, s1 = _run(step, mbs)
  p2, s2 = ref.run_steps(optax_accum.accumulate(ADAM, k), P0, ref.mlp_loss, mbs)
  assert int(s1.gradient_step) == int(s2.gradient_step) == 2
  assert int(s1.mini_step) == int(s2.mini_step) == 0
  s1, s2 = s1._replace(grad_sum=None), s2._replace(grad_sum=None)
  chex.assert_trees_all_close((p1, s1), (p2, s2), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("noise_scale", [False, True])
def test_train_step_emitting_call_equals_the_fused_emitting_program(noise_scale, monkeypatch):
  """The emitting micro-step runs the accumulating program, then the closing one (on params
  and state only). It gives bit for bit what one program that adds and closes gives
  (`_step(emit=True)`: TrainStep's emitting program before the split), for the parameters,
  the loss and the whole state, the stale accumulator included; and to float32 rounding what
  `accumulate` stepped through `jax.jit` with a static `emit=` gives (not bitwise: see
  `test_train_step_equals_dynamic_accumulate`)."""
  # Two programs per emitting micro-step, as beyond a small model (FUSED_EMIT_MAX_OPS): here
  # this test's MLP takes the one program it is compared with (the choice changes no bit).
  monkeypatch.setattr(optax_accum.front_ends._train_step, "FUSED_EMIT_MAX_OPS", 0)
  k = 3
  mbs = _micro_batches(2 * k + 1, 4, seed=3)
  weights = [1.0, 2.0, 0.0, 0.5, 3.0, 1.0, 2.0]  # a zero weight too
  kw = dict(every_k=k, donate=False, grad_buffer=False, noise_scale=noise_scale)
  step = optax_accum.TrainStep(ref.mlp_loss, ADAM, **kw)
  fused = jax.jit(functools.partial(step._step, emit=True))
  tx = optax_accum.accumulate(ADAM, k, noise_scale=noise_scale)
  protocol = jax.jit(functools.partial(ref.step, tx, ref.mlp_loss), static_argnames="emit")
  params = want = P0
  state = proto_state = step.init(P0)
  assert len(step.lower(P0, state, mbs[0], emit=True).args_info[0]) == 2  # the closing program
  for i, (batch, w) in enumerate(zip(mbs, weights, strict=True)):
    emit = i % k == k - 1 or i == len(mbs) - 1  # the last call closes a short window
    if emit:
      fused_out = fused(params, state, (), (batch,), jnp.float32(w))
    params, state, loss = step(params, state, batch, weight=jnp.float32(w), force_emit=emit)
    want, proto_state = protocol(want, proto_state, batch, weight=jnp.float32(w), emit=emit)
    if emit:
      fused_params, fused_state, _, fused_loss = fused_out
      chex.assert_trees_all_equal((params, state, loss), (fused_params, fused_state, fused_loss))
  assert int(state.gradient_step) == int(proto_state.gradient_step) == 3
  # The protocol leaves its updates in the stale accumulator, TrainStep the window's sums.
  state, proto_state = state._replace(grad_sum=None), proto_state._replace(grad_sum=None)
  chex.assert_trees_all_close((params, state), (want, proto_state), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
  "options",
  [
    {},
    {"noise_scale": True},
    {"reduction": "sum"},
    {"accum_dtype": jnp.bfloat16, "rounding": "stochastic"},
  ],
  ids=["default", "noise_scale", "sum", "bf16_stochastic"],
)
def test_train_step_lean_programs_equal_the_two_programs(options, monkeypatch):
  """A small model's programs take and hand back only the state's arrays they read or write
  (`front_ends._lean`; issue 42, item 7). Against the same model run with the accumulating and
  the closing program on whole states: the parameters, the losses and every field of every
  state bit for bit, except the sums after a window closes, stale in both (the lean emitting
  program leaves the ones the state had). Windows: weights, one of them 0; a NaN micro-batch
  mid-window and one closing a window (dropped); weights all 0 (an empty window); a short
  window closed by force_emit whose only micro-batch is NaN. With the options the lean programs
  read more of the state for: the noise statistics, a sum, stochastic rounding (whose bits come
  from the counters; its extra operations would put this model over `FUSED_EMIT_MAX_OPS`, so
  the limit is raised for the lean run). The lean run's finite checks are pooled, the
  control's leaf by leaf: the same micro-batches and windows dropped."""
  module = optax_accum.front_ends._train_step
  k = 3
  mbs = _micro_batches(3 * k + 1, 4, seed=4)
  nan = lambda b: jax.tree.map(lambda x: np.where(np.arange(len(x))[:, None] == 0, np.nan, x), b)  # noqa: E731
  for i in (4, 5, 9):
    mbs[i] = nan(mbs[i])
  weights = [1.0, 2.0, 0.0, 0.5, 3.0, 1.0, 0.0, 0.0, 0.0, 2.0]
  results = []
  for limit in (10**6, 0):
    monkeypatch.setattr(module, "FUSED_EMIT_MAX_OPS", limit)
    step = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=k, **options)
    params, out = jax.tree.map(jnp.array, P0), []
    state = step.init(params)
    for i, (batch, w) in enumerate(zip(mbs, weights, strict=True)):
      emit = i == len(mbs) - 1
      params, state, loss = step(params, state, batch, weight=jnp.float32(w), force_emit=emit)
      sums = None if int(state.mini_step) == 0 else state.grad_sum
      # host copies: the next call donates these arrays
      out.append(jax.tree.map(np.array, (params, state._replace(grad_sum=sums), loss)))
    # The lean programs check each micro-batch, and the window's sums, with one pooled sum
    # (`_core.all_finite(pooled=True)`); the control checks leaf by leaf.
    assert step._cfg.pool_check == step._lean
    results.append((step._lean, out))
  assert results[0][0] and not results[1][0]  # the lean convention, and the control without it
  last = results[0][1][-1][1]
  assert int(last.num_skipped) == 3 and int(last.gradient_step) == 2  # (the empty windows: none)
  chex.assert_trees_all_equal(results[0][1], results[1][1])


def test_train_step_host_known_scalars_survive_a_state_donated_elsewhere():
  """The lean convention's host-known scalars (the position, the window's length, `updated`
  between updates) are device arrays TrainStep makes once and puts in the states it hands
  back. A state donated to the user's own jitted function deletes them with it: TrainStep makes
  them again, every state it hands back after that is alive, and the run is the large batch's."""
  k = 3
  mbs = _micro_batches(2 * k, 4, seed=5)
  step = optax_accum.TrainStep(ref.mlp_loss, MOMENTUM, every_k=k)
  params, state, _ = step(jax.tree.map(jnp.copy, P0), step.init(P0), mbs[0])
  assert step._lean
  saved = jax.tree.map(np.array, state)  # a copy (a NumPy view would keep the buffers)
  flip = lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else -x  # noqa: E731
  jax.jit(lambda s: jax.tree.map(flip, s), donate_argnums=0)(state)  # the user's donating step
  assert state.window_k.is_deleted() and state.updated.is_deleted()
  state = jax.tree.map(jnp.asarray, saved)  # the state back, as a restore makes it
  _rest_alive_and_exact(step, params, state, mbs, 1, k)


def _rest_alive_and_exact(step, params, state, mbs, start, k):
  """`step` (MOMENTUM, from P0) over ``mbs[start:]``: every state it hands back alive, and the
  parameters after all of `mbs` the large batch's, one update per window of `k`."""
  for batch in mbs[start:]:
    params, state, _ = step(params, state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  want, _ = ref.run_steps(MOMENTUM, P0, ref.mlp_loss, ref.windows(mbs, k))
  assert int(state.gradient_step) == len(mbs) // k
  chex.assert_trees_all_close(params, want, **ref.TOL)


def test_train_step_host_known_scalars_of_the_last_state_deleted_through_an_older_one():
  """The last state TrainStep handed back is passed on without looking at its host-known
  scalars (they are checked only when the program refuses them). An older state that shares
  them, donated to the user's own function, deletes them under the last one: the next call is
  refused before anything is donated, runs again with live ones, and so does every call after
  it (the scalars it keeps for the next positions are made again too); the run is the large
  batch's."""
  k = 3
  mbs = _micro_batches(3 * k, 4, seed=7)
  step = optax_accum.TrainStep(ref.mlp_loss, MOMENTUM, every_k=k)
  params, state = jax.tree.map(jnp.copy, P0), step.init(P0)
  for batch in mbs[:4]:  # the window of length 3 that opened at mbs[3] shares its window_k
    older = state
    params, state, _ = step(params, state, batch)
  assert step._lean and older.window_k is state.window_k
  # (the user's step donates the older state's host-known scalars; its other arrays TrainStep
  # donated already)
  bump = lambda t: jax.tree.map(lambda x: x + 1, t)  # noqa: E731
  jax.jit(bump, donate_argnums=0)((older.mini_step, older.window_k, older.updated))
  assert state.window_k.is_deleted() and not state.acc_weight.is_deleted()
  _rest_alive_and_exact(step, params, state, mbs, 4, k)


def test_train_step_short_path_agrees_with_the_full_one_and_steps_aside():
  """A call given back what the last one handed out, with no weight and no force_emit, takes
  `_lean_call` (none of `__call__`'s checks): bit for bit what the full path gives, on every
  call. Whatever else comes (a micro-batch of other types, a weight, force_emit, a state the
  object did not hand out) takes the full path, and the run goes on exact."""
  k = 3
  mbs = _micro_batches(3 * k, 4, seed=9)
  short = optax_accum.TrainStep(ref.mlp_loss, MOMENTUM, every_k=k)
  full = optax_accum.TrainStep(ref.mlp_loss, MOMENTUM, every_k=k)
  taken = []

  def counted(*a, f=short._lean_call):
    out = f(*a)
    taken.append(out is not None)  # (None: it stepped aside)
    return out

  short._lean_call = counted
  full._lean_call = lambda *a: None  # (steps aside on every call: the full path)
  runs = {o: (jax.tree.map(jnp.array, P0), o.init(P0)) for o in (short, full)}
  for batch in mbs[: 2 * k]:
    for o, (params, state) in runs.items():
      runs[o] = o(params, state, batch)[:2]
    chex.assert_trees_all_equal(runs[short], runs[full])
  assert short._lean and taken == [True] * (2 * k - 1)  # (the first call compiles)
  # Both programs called through their own C++ call (`_direct`), where this JAX keeps one.
  for emit, program in short._pair.items():
    assert short._calls.get(emit) is getattr(program, "_call", None), emit
  want, _ = ref.run_steps(MOMENTUM, P0, ref.mlp_loss, ref.windows(mbs[: 2 * k], k))
  chex.assert_trees_all_close(runs[short][0], want, **ref.TOL)
  # Other micro-batch types (6 examples, not 4), a weight, force_emit: the full path.
  six = _micro_batches(1, 6, seed=10)[0]
  for o, (params, state) in runs.items():
    params, state, _ = o(params, state, six)
    params, state, _ = o(params, state, mbs[6], weight=jnp.float32(0.5))
    runs[o] = o(params, state, mbs[7], force_emit=True)[:2]
  chex.assert_trees_all_equal(runs[short], runs[full])
  assert int(runs[short][1].gradient_step) == 3  # (the full path's results: tested above)
  # A state it did not hand out (a copy): the full path, then the short one again.
  params, state = jax.tree.map(jnp.array, runs[short])
  n = len(taken)
  params, state, _ = short(params, state, mbs[8])
  short(params, state, mbs[0])
  assert taken[n:] == [True]


def test_train_step_lean_host_scalars_with_other_placements_and_runs():
  """The lean convention (`front_ends._lean`) where its host-known scalars meet what users do:
  a state of NumPy arrays passed back (``jax.device_get``), to this object and to a new one; two
  runs alternating on one object, one of them donated to the user's own jitted function (the
  scalars both runs share are made again for the other); a run placed on another device (the
  scalars follow it). Each run lands on the large batch's parameters."""
  k = 3
  mbs = _micro_batches(2 * k, 4, seed=6)
  want, _ = ref.run_steps(MOMENTUM, P0, ref.mlp_loss, ref.windows(mbs, k))
  step = optax_accum.TrainStep(ref.mlp_loss, MOMENTUM, every_k=k)

  def run(step, params, state, batches):
    for batch in batches:
      params, state, _ = step(params, state, batch)
    return params, state

  params, state = run(step, jax.tree.map(jnp.array, P0), step.init(P0), mbs[:1])
  assert step._lean
  host = jax.device_get((params, state))  # NumPy leaves
  for target in (step, optax_accum.TrainStep(ref.mlp_loss, MOMENTUM, every_k=k)):
    got, _ = run(target, *jax.tree.map(np.copy, host), mbs[1:])
    chex.assert_trees_all_close(got, want, **ref.TOL)
  # Two runs on one object, A donated away after its first window's second call.
  a = run(step, jax.tree.map(jnp.array, P0), step.init(P0), mbs[:2])
  b = run(step, jax.tree.map(jnp.array, P0), step.init(P0), mbs[:2])
  flip = lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else -x  # noqa: E731
  jax.jit(lambda s: jax.tree.map(flip, s), donate_argnums=0)(a[1])
  got, state = run(step, *b, mbs[2:])
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))
  chex.assert_trees_all_close(got, want, **ref.TOL)
  if len(jax.devices()) < 2:
    pytest.skip("needs two devices (the test command forces 8 host devices)")
  device = jax.devices()[-1]
  params = jax.device_put(jax.tree.map(jnp.array, P0), device)
  got, state = run(step, params, jax.device_put(step.init(P0), device), mbs)
  assert {d for x in jax.tree.leaves(state) for d in x.devices()} == {device}
  chex.assert_trees_all_close(got, want, **ref.TOL)


LEAN_CONFIGS = [
  {},
  {"skip_nonfinite": False},
  {"skip_nonfinite": "window"},
  {"noise_scale": True},
  {"reduction": "sum"},
  {"weight_fn": lambda batch: jnp.sum(jnp.abs(batch["y"]))},  # a weight per micro-batch
  {"grad_buffer": True},
  {"accum_dtype": jnp.bfloat16, "rounding": "stochastic"},  # reads gradient_step (its key)
  {"every_k": 1},
]


@pytest.mark.parametrize("kw", LEAN_CONFIGS, ids=lambda kw: ",".join(map(str, kw)) or "default")
def test_train_step_lean_programs_read_all_they_use(monkeypatch, kw):
  """The lean programs take neither ``window_k`` nor, without stochastic rounding, the
  accumulating program ``gradient_step`` (`front_ends._lean.whole` puts stand-ins there: each
  scalar passed costs a small model's call dispatch time). Nothing they write may depend on a
  stand-in: with other stand-ins every call gives the same bits. The control: the stochastic
  rounding's key does read ``gradient_step``, and another value there changes the sums (its
  operations put this model over `FUSED_EMIT_MAX_OPS`; a smaller one takes the lean programs)."""
  monkeypatch.setattr(optax_accum.front_ends._train_step, "FUSED_EMIT_MAX_OPS", 10_000)
  kw = {"every_k": 3, **kw}
  batches = _micro_batches(7, 4, seed=1)
  whole = optax_accum.front_ends._lean.whole

  def run(*, window_k=None, gradient_step=None):
    def other(emit, reads, part, layout):
      state = whole(emit, reads, part, layout)
      if window_k is not None:
        state = state._replace(window_k=jnp.asarray(window_k, jnp.int32))
      if gradient_step is not None and not emit:
        state = state._replace(gradient_step=jnp.asarray(gradient_step, jnp.int32))
      return state

    monkeypatch.setattr(optax_accum.front_ends._lean, "whole", other)
    step = optax_accum.TrainStep(ref.mlp_loss, ADAM, **kw)
    params, state, calls = P0, step.init(P0), []
    for batch in batches:
      params, state, value = step(params, state, batch)
      calls.append(jax.device_get((params, state, value)))  # (before donation)
    assert step._lean and step._layout.step == (kw.get("rounding") == "stochastic")
    return calls

  want = run()
  reads_step = kw.get("rounding") == "stochastic"
  got = run(window_k=97, gradient_step=None if reads_step else 1000)
  chex.assert_trees_all_equal(got, want)
  if reads_step:  # the control
    other = run(gradient_step=1000)
    assert any(
      not np.array_equal(a, b)
      for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(want), strict=True)
    )


def test_train_step_lean_only_where_a_state_is_spent_and_the_model_small():
  """Not with ``donate=False``: the fields a lean program only reads would be shared by the
  state it is given and the one it hands back, and a user keeping both may give one away. Not
  for ``skip_nonfinite="window"`` with the noise statistics, whose one emitting program is
  chosen for any model size (its sums would be a parameter-sized temporary)."""
  batch = _micro_batches(1, 4)[0]
  for kw, lean in (({}, True), ({"donate": False}, False)):
    step = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=2, **kw)
    step.compile(P0, step.init(P0), batch)
    assert step._lean == lean, kw
  window = dict(skip_nonfinite="window", noise_scale=True, grad_buffer=True)
  step = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=2, **window)
  step.compile(P0, step.init(P0), batch)
  assert not step._lean and step._fused_emit


@pytest.mark.parametrize("every_k", [1, 2])
def test_train_step_pools_its_finite_check_only_off_a_mesh(every_k):
  """The pooled finite check (`Config.pool_check`: the leaves joined into one sum) goes with
  the lean programs, on one device. Parameters sharded on a mesh take whole-state programs and
  the check per leaf: a join of leaves sharded differently would make GSPMD gather them on
  every micro-step (every_k = 1 starts lean, and turns both off when it sees the mesh)."""
  batch = _micro_batches(1, 4)[0]
  step = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=every_k)
  step.compile(P0, step.init(P0), batch)
  assert step._lean and step._cfg.pool_check
  if len(jax.devices()) < 2:
    pytest.skip("needs two devices (the test command forces 8 host devices)")
  mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
  spec = lambda x: P(None, "model") if x.ndim == 2 and x.shape[1] % 2 == 0 else P()  # noqa: E731
  params = {k: jax.device_put(x, NamedSharding(mesh, spec(x))) for k, x in P0.items()}
  gathers = []
  for skip in (True, False):  # the control: no finite check (the model's own gathers only)
    step = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=every_k, skip_nonfinite=skip)
    params, state, _ = step(params, step.init(params), batch)
    assert not step._lean and not step._cfg.pool_check
    text = step.lower(params, state, batch, emit=True).compile().as_text()
    gathers.append(text.count(" all-gather("))
  assert gathers[0] == gathers[1], gathers


def test_train_step_resyncs_with_a_restored_state():
  """A state restored mid-window (not the object the step returned) is read once, then used."""
  k = 4
  mbs = _micro_batches(2 * k, 2, seed=2)
  step = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=k, donate=False)
  params, state = _run(step, mbs[:3])
  saved = jax.device_get((params, state))

  fresh = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=k, donate=False)
  restored = _run(fresh, mbs[3:], *jax.device_put(saved))
  params, state = _run(step, mbs[3:], params, state)
  chex.assert_trees_all_equal(restored, (params, state), strict=True)
  assert int(restored[1].gradient_step) == 2


def test_train_step_force_emit_closes_a_short_window():
  mbs = _micro_batches(2, 3, seed=3)
  step = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=4, donate=False)
  params, state = _run(step, mbs[:1])
  params, state = _run(step, mbs[1:], params, state, force_emit=True)
  assert int(state.gradient_step) == 1 and int(state.mini_step) == 0
  want, _ = ref.run_steps(SGD, P0, ref.mlp_loss, [ref.concat(mbs)])
  chex.assert_trees_all_close(params, want, **ref.TOL)


def test_train_step_has_aux_returns_aux():
  def loss_aux(params, batch):
    value = ref.mlp_loss(params, batch)
    return value, {"twice": 2 * value}

  step = optax_accum.TrainStep(loss_aux, SGD, every_k=2, has_aux=True, donate=False)
  _, _, (value, aux) = step(P0, step.init(P0), _micro_batches(1, 4)[0])
  np.testing.assert_allclose(aux["twice"], 2 * value, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", lambda step: 4])
def test_train_step_rejects_non_static_every_k(bad):
  with pytest.raises((TypeError, ValueError), match="every_k"):
    optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=bad)


def test_train_step_rejects_traced_force_emit():
  step = optax_accum.TrainStep(ref.mlp_loss, SGD, every_k=2, donate=False)
  (batch,) = _micro_batches(1, 2)
  state = step.init(P0)
  with pytest.raises(TypeError, match="force_emit must be known on the host"):
    jax.jit(lambda f: step(P0, state, batch, force_emit=f))(True)
