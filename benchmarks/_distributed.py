"""Distributed: all-reduces per optimizer update in the compiled programs, and bytes moved.

Runs in its own process (`bench.py` starts it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on CPU) because the device count is fixed
when JAX starts. Data-parallel over one mesh axis ``"d"``: parameters replicated, batch sharded.

Counted from the optimised HLO, each collective placed where it runs: on every call ("step"),
inside a conditional branch ("cond", only on the emitting step) or inside a loop body ("loop",
once per micro-batch). Per update = what runs over one window of k micro-steps.

Contenders:

* cross-step `accumulate(adam, k, axis_name="d")`, gradients local (taken w.r.t. params made
  device-varying): static programs (`emit=False` / `emit=True`) and the device conditional;
* cross-step naive: `accumulate(adam, k)` without `axis_name`, gradients w.r.t. replicated
  params (autodiff all-reduces every micro-batch) — what one gets without deferral;
* within-step `microbatch(..., axis_name="d")` vs `optax.microbatching.microbatch` on
  replicated params (an all-reduce inside the loop body).

Plain `jax.jit` (GSPMD, no hand-written `shard_map`; sections "plain-jit within" and "plain-jit
cross", on an Explicit and an Auto mesh), with time per update (median of interleaved rounds):

* within: a naive `lax.scan` of `jax.grad` (GSPMD reduces every micro-batch, inside the loop)
  vs `microbatch(..., axis_name="d")` bound by `optax_accum.data_parallel` (one reduction);
  the naive scan gets its micro-batches pre-split (`presplit`), so its timed program holds no
  transpose of the batch that `microbatch` (which reads them in place) does not pay either;
* cross: `accumulate` without an axis name in the user's jitted step (GSPMD reduces every
  micro-step) vs the recipe: `accumulate(axis_name="d")` in a step bound by `data_parallel`.

FSDP (section "fsdp": parameters sharded over "d", Auto mesh): memory of both choices, within
a step (`data_parallel` sync="update" vs sync="microbatch") and across steps (`accumulate` with
the axis bound vs without an axis name), from XLA's memory analysis.

``--gpu-topology 1x1x8`` compiles the plain-jit programs for a virtual 8-GPU topology of the
attached GPU (compile only, counts only), to see what XLA:GPU's pipeline does with the naive
scan's all-reduce (it may move it out of the loop).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optax_accum  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from benchmarks import _models  # noqa: E402


def _lead(x):
  return jax.tree.map(lambda a: a[None], x)


def cross_programs(model, params, batch, mesh, k: int):
  """{name: {program: Program}} for the cross-step contenders."""
  adam = optax.adam(1e-3)
  out = {}

  def deferred(emit):
    tx = optax_accum.accumulate(adam, k, axis_name="d")

    def f(params, batch, mini_step):
      # The window position comes in as an argument, so XLA cannot fold the device conditional.
      state = tx.init(params)._replace(mini_step=mini_step)
      local = jax.lax.pcast(params, "d", to="varying")
      grads = jax.grad(model.loss)(local, batch)
      updates, state = tx.update(grads, state, params, emit=emit)
      return _lead((updates, state.grad_sum, state.acc_weight))

    return f

  def naive(emit):
    tx = optax_accum.accumulate(adam, k)

    def f(params, batch, mini_step):
      state = tx.init(params)._replace(mini_step=mini_step)
      grads = jax.grad(model.loss)(params, batch)  # replicated params: psum on every call
      updates, state = tx.update(grads, state, params, emit=emit)
      return _lead((updates, state.grad_sum))

    return f

  def compile_mapped(f):
    mapped = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d"), P()), out_specs=P("d"))
    return H.compile_fn(mapped, params, batch, jnp.zeros((), jnp.int32))

  out["accumulate(axis_name), local grads, static"] = {
    "accumulate": compile_mapped(deferred(False)),
    "emit": compile_mapped(deferred(True)),
  }
  out["accumulate(axis_name), local grads, device cond"] = {"step": compile_mapped(deferred(None))}
  out["naive: grads of replicated params, static"] = {
    "accumulate": compile_mapped(naive(False)),
    "emit": compile_mapped(naive(True)),
  }
  return out


def within_programs(model, params, batch, mesh, k: int):
  vg = jax.value_and_grad(model.loss)
  per_device = jax.tree.leaves(batch)[0].shape[0] // mesh.size
  ours = optax_accum.microbatch(vg, k, axis_name="d")
  theirs = optax.microbatching.microbatch(
    vg,
    argnums=1,
    microbatch_size=per_device // k,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )

  def compile_mapped(f):
    mapped = jax.shard_map(
      lambda p, b: _lead(f(p, b)), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")
    )
    return H.compile_fn(mapped, params, batch)

  return {
    "microbatch(axis_name)": {"step": compile_mapped(ours)},
    "optax.microbatching.microbatch, replicated params": {"step": compile_mapped(theirs)},
  }


def per_update(programs: dict[str, H.Program], k: int, kind: str) -> dict[str, float]:
  """All-reduce ops and bytes executed over one update (a window of k micro-steps)."""
  ops = 0.0
  nbytes = 0.0
  for name, c in programs.items():
    where, by = c.hlo.collective_where, c.hlo.collective_bytes
    if kind == "cross":
      calls = {"accumulate": k - 1, "emit": 1, "step": k}[name]
      # inside a conditional: runs once per window (the emitting call)
      ops += calls * where.get("step", 0) + where.get("cond", 0) + calls * k * where.get("loop", 0)
      nbytes += calls * by.get("step", 0) + by.get("cond", 0) + calls * k * by.get("loop", 0)
    else:
      ops += where.get("step", 0) + k * where.get("loop", 0) + where.get("cond", 0)
      nbytes += by.get("step", 0) + k * by.get("loop", 0) + by.get("cond", 0)
  return {"all_reduce_ops": ops, "bytes": nbytes}


# ----------------------------------------------------------------------------------------------
# Plain jax.jit (GSPMD).


def presplit(batch, k: int):
  """The batch laid out as (k, n/k, ...) micro-batches before the step, as a data loader would
  hand them over: micro-batch i = rows i, i+k, ... (the strided split), the rows of each still
  sharded over "d". Arrays (rearranged on the host) or `jax.ShapeDtypeStruct`s.

  The naive scans take this layout, so their timed program holds no transpose of the batch:
  `microbatch` reads its micro-batches in place from the unsplit batch, and a naive baseline
  that paid for a transpose inside the step would make ours look faster than it is."""

  def one(x):
    sharding = NamedSharding(x.sharding.mesh, P(None, "d"))
    shape = (k, x.shape[0] // k, *x.shape[1:])
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
    host = np.asarray(x).reshape(-1, k, *x.shape[1:]).swapaxes(0, 1)
    return jax.device_put(np.ascontiguousarray(host), sharding)

  return jax.tree.map(one, batch)


def naive_scan(model, k: int):
  """The textbook in-step accumulation: a `lax.scan` of `jax.grad` over pre-split
  micro-batches (`presplit`), no axis name."""

  def f(params, micro):
    def body(acc, mb):
      return jax.tree.map(jnp.add, acc, jax.grad(model.loss)(params, mb)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    acc, _ = lax.scan(body, zeros, micro)
    return jax.tree.map(lambda a: a / k, acc)

  return f


def naive_weighted_scan(model, k: int):
  """The same, weighted by each micro-batch's number of real rows (``acc + w·g``, as for token
  counts; here every row is real, so it is the same mean): the all-reduce's result is no longer
  added into the carry as it is."""

  def f(params, micro):
    def body(carry, mb):
      acc, total = carry
      w = jnp.sum(mb[1] >= 0).astype(jnp.float32)  # data-dependent: XLA cannot fold it
      g = jax.grad(model.loss)(params, mb)
      return (jax.tree.map(lambda a, x: a + w * x, acc, g), total + w), None

    zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
    (acc, total), _ = lax.scan(body, zeros, micro)
    return jax.tree.map(lambda a: a / total, acc)

  return f


def bound_microbatch(model, k: int):
  """`microbatch(axis_name="d")` under plain jit: it binds "d" over the mesh itself."""
  return optax_accum.microbatch(jax.grad(model.loss), k, axis_name="d")


NAIVE_SCANS = {
  "plain jit: naive lax.scan of jax.grad": naive_scan,
  "plain jit: naive lax.scan, weighted (acc + w*g)": naive_weighted_scan,
}


def plain_within_programs(model, params, batch, k: int):
  """({name: {"step": Program}}, {name: its batch argument}): the naive scans take the batch
  pre-split (`presplit`, outside the timed program), `microbatch` the batch as it comes."""
  fns = {name: make(model, k) for name, make in NAIVE_SCANS.items()}
  fns["plain jit: microbatch (no axis name)"] = optax_accum.microbatch(jax.grad(model.loss), k)
  fns["plain jit: microbatch(axis_name)"] = bound_microbatch(model, k)
  micro = presplit(batch, k)
  inputs = {name: micro if name in NAIVE_SCANS else batch for name in fns}
  programs = {name: {"step": H.compile_fn(f, params, inputs[name])} for name, f in fns.items()}
  return programs, inputs


def _protocol_step(model, tx, local: bool):
  def step(params, state, batch, emit):
    p = jax.lax.pcast(params, "d", to="varying") if local else params
    grads = jax.grad(model.loss)(p, batch)
    updates, state = tx.update(grads, state, params, emit=emit)
    return optax.apply_updates(params, updates), state

  return step


def plain_cross_programs(model, params, batch, mesh, k: int):
  """{name: ({"accumulate"|"emit": Program}, init)} for the cross-step contenders (`params`
  and `batch` may be `jax.ShapeDtypeStruct`s: nothing runs here)."""
  adam = optax.adam(1e-3)
  out = {}
  for name, axis in (
    ("plain jit: accumulate (no axis name), static emit", None),
    ("plain jit: accumulate(axis_name) recipe via data_parallel, static emit", "d"),
  ):
    tx = optax_accum.accumulate(adam, k, axis_name=axis)
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    state_shardings = optax_accum.state_partition_specs(tx, shardings, axis)
    bind = _binder(axis, mesh)
    init = jax.jit(bind(tx.init), out_shardings=state_shardings)
    state = jax.eval_shape(init, params)
    step = bind(_protocol_step(model, tx, local=axis is not None), batch_argnums=2)
    programs = {
      p: H.compile_fn(
        step, params, state, batch, emit, static_argnums=(3,),
        out_shardings=(shardings, state_shardings),
      )
      for p, emit in (("accumulate", False), ("emit", True))
    }  # fmt: skip
    out[name] = (programs, init)
  return out


def _binder(axis, mesh):
  """`data_parallel` over `axis` (or nothing when None), as a decorator with keywords."""
  if axis is None:
    return lambda f, **kw: f
  return lambda f, **kw: optax_accum.data_parallel(f, axis, mesh=mesh, **kw)


# A reduction whose result holds at least this much is a gradient's (fused or not); below it,
# scalars: a loss, a total weight, a count of micro-batches.
GRADIENT_BYTES = 1024


def _reductions_per_update(programs: dict[str, H.Program], k: int, kind: str) -> dict:
  """Reductions (all-reduce + reduce-scatter; all, and gradient-sized ones) and all-gathers
  run per update."""
  calls = {"accumulate": k - 1, "emit": 1, "step": 1 if kind == "within" else k}
  out = {"reductions": 0, "gradient_reductions": 0, "all_gathers": 0, "reductions_in_loop": 0}
  for name, c in programs.items():
    n = calls[name]
    for key, kinds, min_bytes in (
      ("reductions", ("all-reduce", "reduce-scatter"), 0),
      ("gradient_reductions", ("all-reduce", "reduce-scatter"), GRADIENT_BYTES),
      ("all_gathers", ("all-gather",), 0),
    ):
      for kd in kinds:
        count = functools.partial(optax_accum.count_collectives, c.text, kd, min_bytes=min_bytes)
        loop, total = count(where="loop"), count()
        out[key] += n * ((total - loop) + k * loop)
        if key == "reductions":
          out["reductions_in_loop"] += loop
  return out


def _window(programs, params, state, batch, k: int):
  """One update: k-1 accumulating calls and the emitting one."""
  for i in range(k):
    params, state = programs["emit" if i == k - 1 else "accumulate"](params, state, batch)
  return params, state


def _put(mesh, tree, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


def _plain_within_rows(model, params, batch, k, axis_type, rounds) -> list[dict]:
  within, inputs = plain_within_programs(model, params, batch, k)
  outs = {name: progs["step"](params, inputs[name]) for name, progs in within.items()}
  first = next(iter(outs.values()))
  for name, out in outs.items():
    d, rel = H.max_diff(out, first)
    assert rel < 1e-4, f"plain-jit within: {name} disagrees: {d} ({rel} relative)"
  fns = {
    name: (lambda f=progs["step"], b=inputs[name]: f(params, b)) for name, progs in within.items()
  }
  times = H.run_side_by_side(fns, rounds=rounds)
  return [
    _plain_row("plain-jit within", name, k, axis_type, progs, times[name], params)
    for name, progs in within.items()
  ]


TRAIN_STEP = "plain jit: TrainStep(axis_name)"


def _train_step_contender(model, params, batch, k: int):
  """`TrainStep(axis_name="d")`: its two programs (for the counts) and one window (to time)."""
  step = optax_accum.TrainStep(model.loss, optax.adam(1e-3), k, axis_name="d", donate=False)
  state = step.init(params)
  programs = {}
  for name, emit in (("accumulate", False), ("emit", True)):
    programs[name] = H.compile_lowered(
      lambda emit=emit: step.lower(params, state, batch, emit=emit)
    )

  def window():
    p, s = params, state
    for _ in range(k):
      p, s, _ = step(p, s, batch)
    return p, s

  return programs, window


def _plain_cross_rows(model, params, batch, mesh, k, axis_type, rounds) -> list[dict]:
  cross = plain_cross_programs(model, params, batch, mesh, k)
  states = {name: init(params) for name, (_, init) in cross.items()}
  fns = {
    name: (lambda p=progs, s=states[name]: _window(p, params, s, batch, k))
    for name, (progs, _) in cross.items()
  }
  programs = {name: progs for name, (progs, _) in cross.items()}
  programs[TRAIN_STEP], fns[TRAIN_STEP] = _train_step_contender(model, params, batch, k)
  ends = {name: fn()[0] for name, fn in fns.items()}
  first = next(iter(ends.values()))
  for name, end in ends.items():
    d, rel = H.max_diff(end, first)
    assert rel < 1e-4, f"plain-jit cross: {name} disagrees: {d} ({rel} relative)"
  times = H.run_side_by_side(fns, rounds=rounds)
  return [
    _plain_row("plain-jit cross", name, k, axis_type, progs, times[name], params)
    for name, progs in programs.items()
  ]


def plain_rows(model, params, cfg: dict, k: int, axis_type) -> list[dict]:
  """Plain-jit rows for one k and one mesh axis type: counts, time per update, agreement."""
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",), axis_types=(axis_type,))
  rounds = cfg.get("dist_rounds", 5)
  with jax.set_mesh(mesh):
    params = _put(mesh, params, P())
    within = _put(mesh, model.batch(jax.random.key(1), cfg["dist_micro"] * k * n), P("d"))
    cross = _put(mesh, model.batch(jax.random.key(2), cfg["dist_micro"] * n), P("d"))
    return _plain_within_rows(model, params, within, k, axis_type, rounds) + _plain_cross_rows(
      model, params, cross, mesh, k, axis_type, rounds
    )


def _plain_row(section, name, k, axis_type, programs, timing, params) -> dict:
  kind = "cross" if "cross" in section or "cross" in name else "within"
  counts = _reductions_per_update(programs, k, kind)
  return {
    "section": section,
    "k": k,
    "devices": jax.device_count(),
    "contender": f"{name} [{axis_type.name}]",
    # For these rows: reductions (all-reduce + reduce-scatter) run per update, and of them the
    # gradient-sized ones (a loss or weight all-reduce is a few bytes).
    "all_reduce_ops": counts["reductions"],
    "gradient_reductions": counts["gradient_reductions"],
    "bytes": per_update(programs, k, kind)["bytes"],
    "param_bytes": H.tree_bytes(params),
    "all_gather_ops": counts["all_gathers"],
    "reductions_in_loop_body": counts["reductions_in_loop"],
    "axis_types": axis_type.name,
    "time_per_update_s": None if timing is None else timing.median,
    "iqr_rel": None if timing is None else timing.spread,
    "programs": {
      p: {"collectives": c.hlo.collectives, "where": c.hlo.collective_where, "memory": c.memory}
      for p, c in programs.items()
    },
  }


# ----------------------------------------------------------------------------------------------
# FSDP: parameters sharded over "d". Memory of both choices.


def _fsdp_shardings(params, mesh):
  n = mesh.size
  return jax.tree.map(lambda x: NamedSharding(mesh, P("d") if x.shape[0] % n == 0 else P()), params)


def _per_device_bytes(tree) -> int:
  return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)))


def _fsdp_within(model, params, batch, shardings, k: int):
  """{choice: (Program step, optimizer state)}: one Adam update on a microbatched gradient."""
  adam = optax.adam(1e-3)
  opt_shardings = optax_accum.state_partition_specs(adam, shardings, None)
  opt_state = jax.jit(adam.init, out_shardings=opt_shardings)(params)
  out = {}
  for choice, sync in (
    ("defer: sync='update'", "update"),
    ("per micro-batch: sync='microbatch'", "microbatch"),
  ):
    grad = optax_accum.microbatch(jax.grad(model.loss), k, axis_name="d")
    grad = optax_accum.data_parallel(grad, "d", batch_argnums=1, sync=sync)

    def step(params, opt_state, batch, grad=grad):
      updates, opt_state = adam.update(grad(params, batch), opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    c = H.compile_fn(
      step,
      params,
      opt_state,
      batch,
      donate_argnums=(0, 1),
      out_shardings=(shardings, opt_shardings),
    )
    out[f"fsdp within, {choice}"] = ({"step": c}, opt_state)
  return out


def _fsdp_cross(model, params, batch, shardings, mesh, k: int):
  """{choice: ({"accumulate"|"emit": Program}, state)}: accumulate across steps."""
  adam = optax.adam(1e-3)
  out = {}
  for choice, axis in (
    ("defer: axis_name + data_parallel", "d"),
    ("per micro-step: no axis name", None),
  ):
    tx = optax_accum.accumulate(adam, k, axis_name=axis)
    state_shardings = optax_accum.state_partition_specs(tx, shardings, axis, gathered=True)
    bind = _binder(axis, mesh)
    state = jax.jit(bind(tx.init), out_shardings=state_shardings)(params)
    step = bind(_protocol_step(model, tx, local=axis is not None), batch_argnums=2)
    programs = {
      p: H.compile_fn(
        step, params, state, batch, emit, static_argnums=(3,), donate_argnums=(0, 1),
        out_shardings=(shardings, state_shardings),
      )
      for p, emit in (("accumulate", False), ("emit", True))
    }  # fmt: skip
    out[f"fsdp cross, {choice}"] = (programs, state)
  return out


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def fsdp_rows(model, params, cfg: dict, k: int) -> list[dict]:
  """Memory (XLA's analysis) and reductions of both FSDP choices, within and across steps."""
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,))
  rows = []
  with jax.set_mesh(mesh):
    shardings = _fsdp_shardings(params, mesh)
    params = jax.device_put(params, shardings)
    within = _put(mesh, model.batch(jax.random.key(3), cfg["dist_micro"] * k * n), P("d"))
    cross = _put(mesh, model.batch(jax.random.key(4), cfg["dist_micro"] * n), P("d"))
    ends = {}
    for name, (progs, state) in _fsdp_within(model, params, within, shardings, k).items():
      ends[name] = progs["step"](_copy(params), _copy(state), within)[0]
      rows.append(_fsdp_row(name, "within", k, progs, state, params))
    for name, (progs, state) in _fsdp_cross(model, params, cross, shardings, mesh, k).items():
      p, s = _copy(params), _copy(state)
      for i in range(k):
        p, s = progs["emit" if i == k - 1 else "accumulate"](p, s, cross)
      ends[name] = p
      rows.append(_fsdp_row(name, "cross", k, progs, state, params))
  names = list(ends)
  for a, b in ((names[0], names[1]), (names[2], names[3])):
    d, rel = H.max_diff(ends[a], ends[b])
    assert rel < 1e-4, f"FSDP choices disagree: {a} vs {b}: {d} ({rel} relative)"
  return rows


def _fsdp_row(name, kind, k, programs, state, params) -> dict:
  counts = _reductions_per_update(programs, k, kind)
  return {
    "section": "fsdp",
    "k": k,
    "devices": jax.device_count(),
    "contender": name,
    "all_reduce_ops": counts["reductions"],
    "bytes": per_update(programs, k, kind)["bytes"],
    "param_bytes": H.tree_bytes(params),
    "all_gather_ops": counts["all_gathers"],
    "reductions_in_loop_body": counts["reductions_in_loop"],
    "param_bytes_per_device": _per_device_bytes(params),
    "state_bytes_per_device": _per_device_bytes(state),
    "temp_bytes": max(c.memory["temp"] for c in programs.values()),
    "peak_bytes": max(c.memory["peak"] for c in programs.values()),
    "programs": {
      p: {"collectives": c.hlo.collectives, "memory": c.memory} for p, c in programs.items()
    },
  }


# ----------------------------------------------------------------------------------------------
# Compile only, for a virtual multi-GPU topology of the attached GPU.


def _fsdp_within_compile_only(model, params, batch, mesh, k: int) -> dict:
  """`_fsdp_within`'s programs for `jax.ShapeDtypeStruct` inputs (nothing runs)."""
  adam = optax.adam(1e-3)
  shardings = _fsdp_shardings(params, mesh)
  params = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
  )
  opt_shardings = optax_accum.state_partition_specs(adam, shardings, None)
  opt_state = jax.eval_shape(jax.jit(adam.init, out_shardings=opt_shardings), params)
  out = {}
  for sync in ("update", "microbatch"):
    grad = optax_accum.data_parallel(
      optax_accum.microbatch(jax.grad(model.loss), k, axis_name="d"),
      "d",
      batch_argnums=1,
      sync=sync,
    )

    def step(params, opt_state, batch, grad=grad):
      updates, opt_state = adam.update(grad(params, batch), opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    c = H.compile_fn(step, params, opt_state, batch, out_shardings=(shardings, opt_shardings))
    out[f"fsdp within, sync='{sync}'"] = {"step": c}
  return out


def _batch_shapes(model, n: int):
  return jax.eval_shape(lambda: model.batch(jax.random.key(0), n))


def gpu_topology_rows(cfg: dict, topology: str) -> list[dict]:
  """Counts of the plain-jit contenders compiled (not run) for `topology` GPUs."""
  if topology == "cpu":  # the same programs on this process's devices: to check this path
    devices = jax.devices()
  else:
    from jax.experimental import topologies  # noqa: PLC0415

    devices = topologies.get_topology_desc(platform="cuda", topology=topology).devices
  model = _models.mlp(tuple(cfg["dist_mlp"]), name="mlp")
  params = jax.eval_shape(model.init, jax.random.key(0))
  rows = []
  for axis_type in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",), axis_types=(axis_type,))
    n = mesh.size

    def sds(tree, spec, mesh=mesh):
      return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), tree
      )

    with jax.set_mesh(mesh):
      p = sds(params, P())
      for k in cfg["dist_ks"]:
        # Shapes only: nothing may run on compile-only devices (not even making a key).
        within = sds(_batch_shapes(model, cfg["dist_micro"] * k * n), P("d"))
        for name, progs in plain_within_programs(model, p, within, k)[0].items():
          rows.append(_plain_row("plain-jit within", name, k, axis_type, progs, None, params))
        cross = sds(_batch_shapes(model, cfg["dist_micro"] * n), P("d"))
        for name, (progs, _) in plain_cross_programs(model, p, cross, mesh, k).items():
          rows.append(_plain_row("plain-jit cross", name, k, axis_type, progs, None, params))
        if axis_type == AxisType.Auto:  # FSDP: an unannotated model needs Auto axes unbound
          for name, progs in _fsdp_within_compile_only(model, params, within, mesh, k).items():
            rows.append(_plain_row("fsdp", name, k, axis_type, progs, None, params))
  for r in rows:
    r["devices"] = f"{len(devices)} x {devices[0].device_kind} (compile only)"
    r["jax_version"] = jax.__version__
  return rows


def run(cfg: dict) -> list[dict]:
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",))
  model = _models.mlp(tuple(cfg["dist_mlp"]), name="mlp")
  params = model.init(jax.random.key(0))
  param_bytes = H.tree_bytes(params)
  rows = []
  for k in cfg["dist_ks"]:
    for kind, make, per_dev in (
      ("cross", cross_programs, cfg["dist_micro"]),
      ("within", within_programs, cfg["dist_micro"] * k),
    ):
      batch = model.batch(jax.random.key(1), per_dev * n)
      batch = jax.device_put(batch, NamedSharding(mesh, P("d")))
      for name, programs in make(model, params, batch, mesh, k).items():
        rows.append(
          {
            "section": kind,
            "k": k,
            "devices": n,
            "contender": name,
            **per_update(programs, k, kind),
            "param_bytes": param_bytes,
            "programs": {
              p: {
                "collectives": c.hlo.collectives,
                "where": c.hlo.collective_where,
                "bytes": c.hlo.collective_bytes,
              }
              for p, c in programs.items()
            },
          }
        )
  for k in cfg["dist_ks"]:
    for axis_type in (AxisType.Explicit, AxisType.Auto):
      rows += plain_rows(model, params, cfg, k, axis_type)
    rows += fsdp_rows(model, params, cfg, k)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", required=True, help="JSON config")
  ap.add_argument("--out", required=True, help="where to write the rows (JSON)")
  ap.add_argument(
    "--gpu-topology",
    default=None,
    help="compile only, for this virtual topology of the attached GPU (e.g. 1x1x8)",
  )
  args = ap.parse_args()
  cfg = json.loads(args.config)
  rows = gpu_topology_rows(cfg, args.gpu_topology) if args.gpu_topology else run(cfg)
  Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
  main()
