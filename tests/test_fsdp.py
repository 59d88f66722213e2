"""FSDP with accumulation (issue 43): `microbatch(keep_unsharded=...)` on 8 CPU devices.

Each layout shards the parameters over a data-parallel axis: 1-D FSDP (8 devices, "data"),
`data × fsdp` (4 × 2, the batch over both, the weights over "fsdp") and `data × model`
(4 × 2, the weights over "data" and, tensor-parallel, over "model"). For each of the three
points (what stays unsharded for the window) the gradient is compared with the one-device
large batch (a direct `jax.value_and_grad` over all rows, token-weighted, with a NaN
micro-batch dropped), and the compiled program's collectives per call are counted against the
table (`L` FSDP parameters, `k` micro-batches):

| point | all-gathers | reduce-scatters |
|---|---|---|
| "nothing" | L·k, in the loop | L·k, in the loop |
| "params" | L, outside it | L·k, in the loop |
| "params_and_grads" | L, outside it | L, outside it |

with no gradient-sized all-reduce inside the loop, and the FSDP gradients leaving sharded like
their parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.core import _hlo

K = 4
ROWS = 64  # the whole batch
D_IN, HIDDEN = 16, 32
POINTS = ("nothing", "params", "params_and_grads")
TOL = dict(rtol=2e-5, atol=2e-6)

# mesh shape, names, axis_name, batch spec, parameter specs, the FSDP parameters
LAYOUTS = {
  "1d": ((8,), ("data",), "data", P("data"),
         dict(w0=P("data", None), b0=P(), w1=P("data")), ("w0", "w1")),
  "fsdp": ((4, 2), ("data", "fsdp"), ("data", "fsdp"), P(("data", "fsdp")),
           dict(w0=P("fsdp", None), b0=P(), w1=P("fsdp")), ("w0", "w1")),
  "model": ((4, 2), ("data", "model"), "data", P("data"),
            dict(w0=P("data", "model"), b0=P("model"), w1=P("model")), ("w0",)),
}  # fmt: skip


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return dict(
    w0=rng.standard_normal((D_IN, HIDDEN)).astype(np.float32) * 0.5,
    b0=rng.standard_normal(HIDDEN).astype(np.float32) * 0.1,
    w1=rng.standard_normal(HIDDEN).astype(np.float32) * 0.5,
  )


def _data(seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((ROWS, D_IN)).astype(np.float32)
  mask = (rng.random(ROWS) < 0.7).astype(np.float32)
  # Every device's piece of every micro-batch has a real row (each device holds 8 rows, its
  # piece of micro-batch i its rows i and i + 4): a piece of padding only would make the
  # token-weighted loss 0/0, a NaN that skip_nonfinite drops and counts like any other.
  mask[np.arange(ROWS) % 8 < K] = 1.0
  return x, mask


def _plain(p, x, mask):
  """The token-weighted loss of a batch (the large batch's, on one device)."""
  h = jnp.tanh(x @ p["w0"] + p["b0"])
  return jnp.sum((h @ p["w1"]) ** 2 * mask) / jnp.sum(mask)


def _explicit(p, x, mask):
  """The same loss on an Explicit mesh: contractions over a "model"-sharded dimension say where
  their result goes, the batch entry read from the value's own type."""
  batch = jax.typeof(x).sharding.spec[0]
  h = jnp.tanh(jnp.matmul(x, p["w0"], out_sharding=P(batch, "model")) + p["b0"])
  out = jnp.matmul(h, p["w1"], out_sharding=P(batch))
  return jnp.sum(out**2 * mask) / jnp.sum(mask)


def _weight(p, x, mask):
  del p, x
  return jnp.sum(mask)


def _placed(layout):
  shape, names, _, bspec, pspecs, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
  p = {k: jax.device_put(v, NamedSharding(mesh, pspecs[k])) for k, v in _params().items()}
  x, mask = _data()
  batch = [jax.device_put(a, NamedSharding(mesh, P(bspec[0], *[None] * (a.ndim - 1))))
           for a in (x, mask)]  # fmt: skip
  return mesh, p, batch


def _step(layout, keep, **kwargs):
  loss = _explicit if layout == "model" else _plain
  return jax.jit(
    optax_accum.microbatch(
      jax.value_and_grad(loss), K, batch_argnums=(1, 2), weight_fn=_weight,
      axis_name=LAYOUTS[layout][2], keep_unsharded=keep, **kwargs,
    )
  )  # fmt: skip


@functools.cache
def _compiled(layout, keep, auto=False):
  """The gradient of one update and the compiled program's text, per layout and point: on
  Explicit axes from placed arrays; on Auto axes under `jax.jit(in_shardings=...)`, the same
  shardings given to `microbatch` (a traced array's type carries no placement there)."""
  if auto:
    return _auto(layout, keep)
  mesh, p, batch = _placed(layout)
  with jax.set_mesh(mesh):
    step = _step(layout, keep)
    value, grads = step(p, *batch)
    text = step.lower(p, *batch).compile().as_text()
  return value, grads, text


def _auto(layout, keep):
  shape, names, axis, bspec, pspecs, _ = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  shardings = (
    {k: NamedSharding(mesh, s) for k, s in pspecs.items()},
    NamedSharding(mesh, P(bspec[0], None)),
    NamedSharding(mesh, P(bspec[0])),
  )
  step = optax_accum.microbatch(
    jax.value_and_grad(_plain), K, batch_argnums=(1, 2), weight_fn=_weight, axis_name=axis,
    keep_unsharded=keep, in_shardings=shardings,
  )  # fmt: skip
  with jax.set_mesh(mesh):
    jitted = jax.jit(step, in_shardings=shardings)
    value, grads = jitted(_params(), *_data())  # host arrays: jax.jit places them
    text = jitted.lower(_params(), *_data()).compile().as_text()
  return value, grads, text


MESHES = [(layout, auto) for layout in LAYOUTS for auto in (False, True)]
MESH_IDS = [f"{layout}-{'auto' if auto else 'explicit'}" for layout, auto in MESHES]


@pytest.mark.parametrize("keep", POINTS)
@pytest.mark.parametrize(("layout", "auto"), MESHES, ids=MESH_IDS)
def test_fsdp_point_matches_large_batch(layout, auto, keep):
  value, grads, _ = _compiled(layout, keep, auto)
  ref_value, ref_grads = jax.value_and_grad(_plain)(_params(), *_data())
  np.testing.assert_allclose(value, ref_value, **TOL)
  for name in ref_grads:
    np.testing.assert_allclose(grads[name], ref_grads[name], err_msg=name, **TOL)
  # The FSDP gradients leave sharded like their parameters (ready for a sharded update).
  pspecs = LAYOUTS[layout][4]
  for name in LAYOUTS[layout][5]:
    want = NamedSharding(grads[name].sharding.mesh, pspecs[name])
    assert grads[name].sharding.is_equivalent_to(want, grads[name].ndim), name


@pytest.mark.structure
@pytest.mark.parametrize("keep", POINTS)
@pytest.mark.parametrize(("layout", "auto"), MESHES, ids=MESH_IDS)
def test_fsdp_collectives_per_update(layout, auto, keep):
  _, _, text = _compiled(layout, keep, auto)
  fsdp = LAYOUTS[layout][5]
  n = len(fsdp)
  # The FSDP parameters' bytes on each device once gathered over the data-parallel axes
  # (in `data × model` each device holds its "model" half of w0 even then).
  whole = sum(_params()[k].nbytes for k in fsdp) // (2 if layout == "model" else 1)
  runs = _hlo.collective_runs(text)
  rs = runs["reduce-scatter"]
  per_window = keep == "params_and_grads"
  assert (rs.outside, rs.in_loop) == ((n, 0) if per_window else (0, n * K))
  assert rs.bytes == whole * (1 if per_window else K)
  ag = runs["all-gather"]
  if layout != "model":  # (the tensor-parallel loss has all-gathers of its own over "model")
    assert (ag.outside, ag.in_loop) == ((0, n * K) if keep == "nothing" else (n, 0))
    assert ag.bytes == whole * (K if keep == "nothing" else 1)
  elif keep != "nothing":
    assert ag.in_loop == 0
  # No gradient-sized all-reduce inside the loop (scalars and the tensor-parallel bias aside).
  assert _hlo.collective_runs(text, min_bytes=HIDDEN * 4 + 1)["all-reduce"].in_loop == 0


def _with_nan(keep):
  mesh, p, _ = _placed("1d")
  if keep is None:  # the same call without keep_unsharded: replicated parameters
    p = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in _params().items()}
  x, mask = _data()
  x[1] = np.nan  # one device's piece of one micro-batch holds a NaN: that piece is dropped
  with jax.set_mesh(mesh):
    xb, mb = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, mask))
    step = optax_accum.microbatch(
      jax.value_and_grad(_plain), K, batch_argnums=(1, 2), weight_fn=_weight, axis_name="data",
      keep_unsharded=keep, return_info=True,
    )  # fmt: skip
    return jax.jit(step)(p, xb, mb)


@pytest.mark.parametrize("keep", POINTS)
def test_fsdp_nonfinite_piece_dropped_as_without_it(keep):
  """skip_nonfinite drops the same pieces, with the same weights, as without keep_unsharded:
  the weight and the finite check apply to each device's whole gradient before its
  reduce-scatter."""
  (value, grads), info = _with_nan(keep)
  (ref_value, ref_grads), ref_info = _with_nan(None)
  # One unit dropped: the device's piece of the micro-batch holding the NaN row.
  assert int(info.num_skipped) == int(ref_info.num_skipped) == 1
  np.testing.assert_allclose(info.total_weight, ref_info.total_weight)
  np.testing.assert_allclose(value, ref_value, **TOL)
  for name in ref_grads:
    assert np.all(np.isfinite(grads[name])), name
    np.testing.assert_allclose(grads[name], ref_grads[name], err_msg=name, **TOL)


def _audit_row(mesh, p, batch, front):
  loss = lambda q, b: _plain(q, *b)
  with jax.set_mesh(mesh):
    report = optax_accum.audit(loss, p, tuple(batch), K, front_end=front, mesh=mesh)
  return report, report["collectives"]


@pytest.mark.parametrize("keep", POINTS)
def test_audit_collectives_row_on_each_fsdp_point(keep):
  """The audit's collectives row on FSDP weights: the reduce-scatter per micro-batch of
  "nothing" and "params" is what those points do (least memory), said as "info" and not FAIL,
  with the point that reduces once named; "params_and_grads" reduces one gradient: "ok"."""
  mesh, p, batch = _placed("1d")
  step = optax_accum.microbatch(
    jax.value_and_grad(_plain), K, batch_argnums=(1, 2), weight_fn=_weight,
    axis_name="data", keep_unsharded=keep,
  )  # fmt: skip
  report, row = _audit_row(mesh, p, batch, lambda lf, q, b: step(q, *b)[1])
  assert report.ok, str(report)
  if keep == "params_and_grads":
    assert row.verdict == "ok", str(row)
  else:
    assert row.verdict == "info", str(row)
    assert "(FSDP)" in row.figure and "'params_and_grads' reduces once" in row.figure, str(row)


def test_audit_collectives_row_fails_fsdp_weights_gathered_then_all_reduced_per_micro_batch():
  """The control: the same FSDP weights, gathered once, and the whole gradient all-reduced for
  each micro-batch (a Python loop over replicated weights): k gradients over "data", FAIL."""
  mesh, p, batch = _placed("1d")

  def front(lf, q, b):
    whole = jax.tree.map(lambda a: jax.sharding.reshard(a, P()), q)
    x, mask = b
    total, weight = None, 0.0
    for i in range(K):
      piece = (x[i::K], mask[i::K])
      w = jnp.sum(piece[1])
      g = jax.grad(lambda r, piece=piece, w=w: _plain(r, *piece) * w)(whole)
      total = g if total is None else jax.tree.map(jnp.add, total, g)
      weight = weight + w
    spec = lambda a: jax.typeof(a).sharding.spec
    return jax.tree.map(lambda t, a: jax.sharding.reshard(t / weight, spec(a)), total, q)

  report, row = _audit_row(mesh, p, batch, front)
  assert row.verdict == "FAIL", str(report)
  assert report["equivalence: gradient"].verdict == "ok", str(report)
  assert "4.0" in row.figure and "(FSDP)" not in row.figure, str(row)


def test_fsdp_errors():
  with pytest.raises(ValueError, match="keep_unsharded must be None or one of"):
    optax_accum.microbatch(jax.grad(_plain), K, axis_name="data", keep_unsharded="all")
  with pytest.raises(ValueError, match="needs axis_name"):
    optax_accum.microbatch(jax.grad(_plain), K, keep_unsharded="params")
  # data × fsdp with only "data" named: the weights are sharded over "fsdp" alone.
  mesh, p, batch = _placed("fsdp")
  with jax.set_mesh(mesh):
    step = optax_accum.microbatch(
      jax.grad(_plain), K, batch_argnums=(1, 2), axis_name="data", keep_unsharded="params"
    )
    with pytest.raises(
      ValueError, match=r"name it in axis_name, e.g. axis_name=\('data', 'fsdp'\)"
    ):
      jax.jit(step)(p, *batch)


def test_fsdp_auto_axes_under_jit_without_in_shardings_say_what_to_do():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  p = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in _params().items()}
  x, mask = _data()
  with jax.set_mesh(mesh):
    step = optax_accum.microbatch(
      jax.grad(_plain), K, batch_argnums=(1, 2), axis_name="data", keep_unsharded="params"
    )
    with pytest.raises(ValueError, match="are Auto: its placement is not part of its type"):
      jax.jit(step)(p, x, mask)
    with pytest.raises(ValueError, match="in_shardings has 2 entries but the function was"):
      jax.jit(optax_accum.microbatch(
        jax.grad(_plain), K, batch_argnums=(1, 2), axis_name="data", keep_unsharded="params",
        in_shardings=(None, None)))(p, x, mask)  # fmt: skip
  with pytest.raises(TypeError, match=r"in_shardings\[0\]\['w'\] is 'data'; each entry"):
    optax_accum.microbatch(jax.grad(_plain), K, axis_name="data", keep_unsharded="params",
                           in_shardings=({"w": "data"},))  # fmt: skip
  with pytest.raises(ValueError, match="without keep_unsharded it is not read"):
    optax_accum.microbatch(jax.grad(_plain), K, axis_name="data", in_shardings=(P(),))


def test_fsdp_inside_shard_map_is_refused():
  mesh, p, batch = _placed("1d")
  step = optax_accum.microbatch(
    jax.grad(_plain), K, batch_argnums=(1, 2), axis_name="data", keep_unsharded="params"
  )
  mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
  replicated = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in _params().items()}
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="binds axis_name='data' itself"):
    jax.jit(mapped)(replicated, *batch)


def test_fsdp_data_parallel_refuses_and_names_the_front_ends_that_have_it():
  """data_parallel owns no window: keep_unsharded there raises naming microbatch and TrainStep,
  and microbatch(keep_unsharded=...) inside data_parallel says to call it without it."""
  with pytest.raises(ValueError, match=r"not an option of data_parallel(.|\n)*TrainStep\("):
    optax_accum.data_parallel(jax.grad(_plain), "data", keep_unsharded="params")
  mesh, p, batch = _placed("1d")
  step = optax_accum.microbatch(
    jax.grad(_plain), K, batch_argnums=(1, 2), axis_name="data", keep_unsharded="params"
  )
  wrapped = optax_accum.data_parallel(step, "data", batch_argnums=(1, 2))
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="without data_parallel around it"):
    jax.jit(wrapped)(p, *batch)


@pytest.mark.structure
def test_collective_runs_counts_loop_trips():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  w = jax.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P("data")))

  def f(w):
    def body(i, acc):
      g = jax.lax.all_gather(w + i.astype(w.dtype), "data", tiled=True)  # varies with i
      return acc + jax.lax.psum_scatter(g * 2.0, "data", tiled=True)

    return jax.lax.fori_loop(0, 5, body, jnp.zeros_like(w))

  with jax.set_mesh(mesh):
    mapped = jax.shard_map(f, in_specs=P("data"), out_specs=P("data"))
    text = jax.jit(mapped).lower(w).compile().as_text()
  runs = _hlo.collective_runs(text)
  for kind in ("all-gather", "reduce-scatter"):
    assert (runs[kind].outside, runs[kind].in_loop, runs[kind].ops_in_loop) == (0, 5, 1)
    assert runs[kind].bytes == 5 * 64 * 32 * 4
    assert runs[kind].traffic == pytest.approx(5 * 64 * 32 * 4 * 7 / 8)
  assert runs["all-reduce"].runs == 0


# A GPU program's combined all-reduce: one asynchronous op over two gradients, its shape the
# tuple of its results (an async all-gather's shape holds its operands too, an all-reduce's not).
ASYNC_ALL_REDUCE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[8], p1: f32[4]) -> (f32[8], f32[4]) {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %ars = (f32[8]{0}, f32[4]{0}) all-reduce-start(%p0, %p1), replica_groups={{0,1}}, to_apply=%add
  ROOT %ard = (f32[8]{0}, f32[4]{0}) all-reduce-done(%ars)
}
"""


def test_collective_runs_reads_the_ops_collective_ops_reads():
  # One reader of collectives: the table FSDP and the planner read sums the audit's ops. It
  # read a combined async all-reduce's bytes as 0 while it had a walk of its own (the result
  # tuple minus the operands, as for an async all-gather).
  (op,) = _hlo.collective_ops(ASYNC_ALL_REDUCE)
  runs = _hlo.collective_runs(ASYNC_ALL_REDUCE)["all-reduce"]
  assert (op.op, op.result_bytes, op.groups) == ("all-reduce", (8 + 4) * 4, [[0, 1]])
  assert (runs.outside, runs.in_loop, runs.bytes) == (1, 0, op.result_bytes)
  assert runs.traffic == pytest.approx(op.result_bytes * 2 * (2 - 1) / 2)


def _plan(memory_limit):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  spec = NamedSharding(mesh, P("data"))
  p = dict(
    w0=jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=spec),
    w1=jax.ShapeDtypeStruct((512,), jnp.float32, sharding=spec),
  )
  x = jax.ShapeDtypeStruct((4096, 256), jnp.float32, sharding=spec)

  def loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w0"]) @ p["w1"]) ** 2)

  with jax.set_mesh(mesh):
    return optax_accum.plan_microbatches(
      jax.value_and_grad(loss), p, x, memory_limit=memory_limit, axis_name="data",
      keep_unsharded=POINTS,
    )  # fmt: skip


def test_planner_takes_the_fewest_microbatches_then_the_least_bytes():
  """The pathological budget: the whole accumulator fits only with micro-batches of one row per
  device (it sends least there). The planner keeps the fewest micro-batches that fit for any
  point and, among the points that fit with them, sends least."""
  plan = _plan(2 * 2**20)
  assert set(plan.points) <= set(POINTS) and plan.keep_unsharded in plan.points
  ks = {point: k for point, (k, _, _) in plan.points.items()}
  assert ks["nothing"] < ks["params_and_grads"]  # the budget separates the points
  sent = {point: s for point, (_, _, s) in plan.points.items()}
  assert sent["params_and_grads"] < sent[plan.keep_unsharded]  # ... which it did not take
  k, peak, _ = plan.points[plan.keep_unsharded]
  assert k == plan.num_microbatches == min(ks.values()) and peak <= plan.memory_limit
  same_k = [point for point in ks if ks[point] == k]
  assert sent[plan.keep_unsharded] == min(sent[point] for point in same_k)
  assert "keep_unsharded=" in str(plan)


def test_planner_between_points_at_the_same_k_takes_the_one_that_sends_least():
  """A budget where gathering once fits with the fewest micro-batches (2, as gathering per
  micro-batch does) and the whole accumulator needs more: "params", which sends less than
  "nothing" at the same k (XLA's compiled peaks for this model, jax 0.10)."""
  plan = _plan(int(2.5 * 2**20))
  ks = {point: k for point, (k, _, _) in plan.points.items()}
  assert ks["nothing"] == ks["params"] == 2 < ks["params_and_grads"]
  assert plan.keep_unsharded == "params" and plan.num_microbatches == 2
  assert plan.points["params"][2] < plan.points["nothing"][2]
