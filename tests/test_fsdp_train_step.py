"""FSDP with accumulation across calls (issue 43): `TrainStep(..., keep_unsharded=...)`.

The layouts of `test_fsdp` (1-D FSDP, `data × fsdp`, `data × model`; Explicit and Auto axes),
two windows of ``K`` calls with adam, compared with the one-device large batch (a direct
`jax.value_and_grad` over each window's rows, token-weighted, then adam); the collectives of
one window counted in the compiled programs — each program's all-gathers and reduce-scatters
times the calls a window makes of it (the gather once, the accumulating program ``K`` times,
the closing program once):

| point | all-gathers per window | reduce-scatters per window |
|---|---|---|
| "nothing" | L·K (the accumulating program, on entry) | L·K (the accumulating program) |
| "params" | L (the gather) | L·K (the accumulating program) |
| "params_and_grads" | L (the gather) | L (the closing program) |
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_fsdp as base
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.core import _hlo

K = 2  # calls per window
WINDOWS = 2
ROWS = 16  # rows per call: 2 per device
ADAM = optax.adam(1e-2)
# Adam's first steps are ~lr·g/|g|: the devices' partial sums add a gradient's rows in another
# order than the one-device large batch, which moves an update by ~1e-6 relative where an entry
# of g is tiny (as in tests/test_accel.py).
TOL = dict(rtol=2e-5, atol=2e-6)
POINTS = base.POINTS
MESHES = [("1d", False), ("1d", True), ("fsdp", False), ("fsdp", True), ("model", False)]
MESH_IDS = [f"{layout}-{'auto' if auto else 'explicit'}" for layout, auto in MESHES]


def _calls(seed=3, nan_row=None):
  """``K · WINDOWS`` micro-batches ``(x, mask)``; every device's piece holds a real row."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(K * WINDOWS):
    x = rng.standard_normal((ROWS, base.D_IN)).astype(np.float32)
    mask = (rng.random(ROWS) < 0.6).astype(np.float32)
    mask[::2] = 1.0  # each device's two rows: the first is real
    if nan_row is not None and i == nan_row[0]:
      x[nan_row[1]] = np.nan
    out.append((x, mask))
  return out


def _large_batch(calls):
  """The reference: each window's rows at once on one device (token-weighted), then adam."""
  params, state = base._params(), ADAM.init(base._params())
  for w in range(WINDOWS):
    window = calls[w * K : (w + 1) * K]
    x, mask = (np.concatenate(a) for a in zip(*window, strict=True))
    grads = jax.grad(base._plain)(params, x, mask)
    updates, state = ADAM.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _mesh(layout, auto):
  shape, names = base.LAYOUTS[layout][:2]
  kind = AxisType.Auto if auto else AxisType.Explicit
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _run(layout, auto, keep, calls, **kw):
  """Two windows of TrainStep on `layout`; returns the parameters, the state, the step."""
  _, _, axis, bspec, pspecs, _ = base.LAYOUTS[layout]
  mesh = _mesh(layout, auto)
  loss = base._explicit if layout == "model" and not auto else base._plain
  with jax.set_mesh(mesh):
    if keep is None:  # the same step without keep_unsharded: the parameters replicated
      pspecs = {k: P() for k in pspecs}
    p = {k: jax.device_put(v, NamedSharding(mesh, pspecs[k])) for k, v in base._params().items()}
    step = optax_accum.TrainStep(
      loss, ADAM, K, axis_name=axis, weight_fn=lambda x, mask: jnp.sum(mask),
      keep_unsharded=keep, **kw,
    )  # fmt: skip
    state = step.init(p)
    for x, mask in calls:
      placed = [jax.device_put(a, NamedSharding(mesh, P(bspec[0]))) for a in (x, mask)]
      p, state, _ = step(p, state, *placed)
  return p, state, step


@functools.cache
def _trained(layout, auto, keep):
  return _run(layout, auto, keep, _calls())


@pytest.mark.parametrize("keep", POINTS)
@pytest.mark.parametrize(("layout", "auto"), MESHES, ids=MESH_IDS)
def test_train_step_point_matches_large_batch(layout, auto, keep):
  p, state, _ = _trained(layout, auto, keep)
  assert int(state.gradient_step) == WINDOWS and int(state.mini_step) == 0
  want = _large_batch(_calls())
  pspecs = base.LAYOUTS[layout][4]
  for name, x in p.items():
    np.testing.assert_allclose(np.asarray(x), want[name], err_msg=name, **TOL)
    # The parameters (and so their updates) stay sharded as they came in.
    assert x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, pspecs[name]), x.ndim)
  if keep != "params_and_grads":  # a global state: its sums sharded like the parameters
    for name in base.LAYOUTS[layout][5]:
      acc = state.grad_sum[name]
      assert acc.shape == base._params()[name].shape, name
      assert acc.sharding.is_equivalent_to(NamedSharding(acc.sharding.mesh, pspecs[name]), acc.ndim)


def _window_runs(layout, auto, keep):
  """Each program of one window: its collectives per call (`_hlo.collective_runs`) and the
  calls a window makes of it."""
  _, state, step = _trained(layout, auto, keep)
  _, _, _, bspec, pspecs, _ = base.LAYOUTS[layout]
  mesh = _mesh(layout, auto)
  with jax.set_mesh(mesh):
    p = {k: jax.device_put(v, NamedSharding(mesh, pspecs[k])) for k, v in base._params().items()}
    x, mask = (jax.device_put(a, NamedSharding(mesh, P(bspec[0]))) for a in _calls()[0])
    programs = step._fsdp.window_programs(p, state, x, mask)
    return {
      name: (_hlo.collective_runs(low.compile().as_text()), calls) for name, low, calls in programs
    }


@pytest.mark.structure
@pytest.mark.parametrize("keep", POINTS)
@pytest.mark.parametrize(("layout", "auto"), MESHES, ids=MESH_IDS)
def test_train_step_collectives_per_window(layout, auto, keep):
  runs = _window_runs(layout, auto, keep)
  fsdp = base.LAYOUTS[layout][5]
  n = len(fsdp)
  whole = sum(base._params()[k].nbytes for k in fsdp) // (2 if layout == "model" else 1)
  per_window = {"all-gather": [0, 0], "reduce-scatter": [0, 0]}
  for name, (found, calls) in runs.items():
    for kind, total in per_window.items():
      r = found[kind]
      assert r.in_loop == 0, (name, kind)  # no loop: one micro-batch per call
      if name == "closing" and kind == "all-gather" and layout != "model":
        # The window's finite verdict (issue 42: a window whose sums overflow is dropped)
        # reads the sharded sums: at most one partial vector of a row's length gathered (and a
        # scalar all-reduced). No parameter is gathered by the closing program.
        assert r.runs <= 1 and r.bytes <= base.HIDDEN * 4, (name, r)
        continue
      total[0] += r.outside * calls
      total[1] += r.bytes * calls
  gathers = {"nothing": K, "params": 1, "params_and_grads": 1}[keep]
  scatters = {"nothing": K, "params": K, "params_and_grads": 1}[keep]
  assert per_window["reduce-scatter"] == [n * scatters, whole * scatters]
  if layout != "model":
    assert per_window["all-gather"] == [n * gathers, whole * gathers]
  elif keep != "nothing":  # (the tensor-parallel loss gathers over "model" in its programs)
    gather = runs["gather"][0]["all-gather"]
    assert (gather.outside, gather.bytes) == (n, whole)
  # No all-reduce of a whole FSDP gradient: scalars, the unsharded bias, and on data × fsdp
  # the shards summed over "data" (which does not shard them).
  for name, (found, _) in runs.items():
    assert found["all-reduce"].bytes < whole, name


def test_train_step_nonfinite_piece_dropped_as_without_it():
  """skip_nonfinite drops a device's piece of a micro-batch as without keep_unsharded: one
  NaN row, one unit dropped and counted, the same parameters."""
  calls = _calls(nan_row=(1, 5))
  ref, ref_state, _ = _run("1d", False, None, calls)
  assert int(jnp.sum(ref_state.num_skipped)) == 1
  for keep in POINTS:
    p, state, _ = _run("1d", False, keep, calls)
    assert int(jnp.sum(state.num_skipped)) == 1, keep
    for name in ref:
      assert np.all(np.isfinite(np.asarray(p[name]))), (keep, name)
      np.testing.assert_allclose(np.asarray(p[name]), np.asarray(ref[name]), err_msg=keep, **TOL)


def test_train_step_held_copy_lives_for_the_window():
  """With "params" the window's first call gathers, the others reuse the held copy, the closing
  call drops it."""
  mesh = _mesh("1d", False)
  with jax.set_mesh(mesh):
    p = {k: jax.device_put(v, NamedSharding(mesh, base.LAYOUTS["1d"][4][k]))
         for k, v in base._params().items()}  # fmt: skip
    step = optax_accum.TrainStep(base._plain, ADAM, 3, axis_name="data", keep_unsharded="params")
    state = step.init(p)
    calls = _calls()[:3]
    step.compile(p, state, *calls[0])  # the window's three programs, compiled now
    assert set(step._fsdp._compiled) == {"gather", "accumulating", "closing"}
    held = []
    for x, mask in calls:
      p, state, _ = step(p, state, x, mask)
      held.append(None if step._fsdp._held is None else id(step._fsdp._held[1]))
  assert held[0] == held[1] is not None and held[2] is None
  assert int(state.gradient_step) == 1


def test_train_step_keep_unsharded_errors():
  with pytest.raises(ValueError, match="keep_unsharded must be None or one of"):
    optax_accum.TrainStep(base._plain, ADAM, K, axis_name="data", keep_unsharded="grads")
  with pytest.raises(ValueError, match="keep_unsharded='params' needs axis_name"):
    optax_accum.TrainStep(base._plain, ADAM, K, keep_unsharded="params")
  with pytest.raises(ValueError, match="with every_k=1: a window is one micro-step"):
    optax_accum.TrainStep(base._plain, ADAM, 1, axis_name="data", keep_unsharded="params")
  with pytest.raises(ValueError, match="with the noise statistics"):
    optax_accum.TrainStep(
      base._plain, ADAM, K, axis_name="data", keep_unsharded="params", noise_scale=True
    )
  mesh = _mesh("1d", False)
  with jax.set_mesh(mesh):
    replicated = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in base._params().items()}
    step = optax_accum.TrainStep(base._plain, ADAM, K, axis_name="data", keep_unsharded="nothing")
    with pytest.raises(ValueError, match="but no argument is sharded over them"):
      step.init(replicated)
