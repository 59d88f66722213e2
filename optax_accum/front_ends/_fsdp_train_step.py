"""`TrainStep(..., keep_unsharded=...)`: FSDP's three points across calls (issue 43).

`_fsdp` holds the points within one program (`microbatch`); here a window spans calls, so what
stays unsharded between them is held by the `TrainStep` object or in its state:

* ``"nothing"``: each micro-step's program gathers the parameters on entry (``L`` all-gathers)
  and reduce-scatters its weighted, checked gradient into an accumulator sharded like them
  (``L`` reduce-scatters), kept in the state; the closing program updates the sharded
  parameters from it under GSPMD (the optimizer's state sharded like them too);
* ``"params"``: the window's first micro-step gathers the parameters once (a program of its own,
  ``L`` all-gathers) and the object holds that whole copy until the window closes; every
  micro-step reads it (no gather) and reduce-scatters as above;
* ``"params_and_grads"``: the held whole copy, and the state's per-device accumulator of
  whole gradients (`TrainStep`'s own with an axis); the closing program reduce-scatters the
  window once, then updates the sharded parameters under GSPMD.

So a window of ``k`` micro-steps costs ``L·k`` + ``L·k``, ``L`` + ``L·k`` and ``L`` + ``L``
(all-gathers + reduce-scatters), the programs counted by `window_programs`. The state of the
first two points is global (an `accumulate` without axis, its sums sharded like the parameters:
the weight and the drop count ride each micro-step's reduction as scalars, as do the gradients
of parameters not sharded over the axis, biases); the third's is per device, as
``TrainStep(axis_name=...)`` makes it. The inner update runs outside the bound axis, on global
sharded arrays, so any optimizer (a global-norm clip included) sees the whole gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum.core import _batch, _core, _state
from optax_accum.core._state import AccumulateState
from optax_accum.front_ends import _accumulate, _config, _host, _window
from optax_accum.parallel import _collectives, _fsdp, _gspmd, _sharding

REFUSED = {
  "axis_name": (
    "TrainStep: keep_unsharded={keep!r} needs axis_name: the data-parallel mesh axes the batch "
    "is split over, some of which shard the parameters (FSDP), e.g. axis_name='data'."
  ),
  "every_k": (
    "TrainStep: keep_unsharded={keep!r} with every_k=1: a window is one micro-step, so the "
    "three points are the same (one gather, one reduce-scatter). Drop keep_unsharded and "
    "axis_name: under plain jax.jit GSPMD then gathers the sharded parameters and "
    "reduce-scatters their gradients every step."
  ),
  "noise": (
    "TrainStep: keep_unsharded={keep!r} with the noise statistics (noise_scale=True or a "
    "FollowNoiseScale every_k) is not supported yet. Measure the noise scale in-step with "
    "microbatch(..., keep_unsharded=..., noise_scale=...), or drop keep_unsharded."
  ),
  "rounding": (
    "TrainStep: keep_unsharded={keep!r} with rounding={rounding!r}: the micro-step's gradient "
    "is reduce-scattered in the accumulator's dtype before it is added, so the stochastic "
    "rounding of each addition would not see the float32 sum. Use rounding=None with an "
    "accumulator of at least float32 (the default), or drop keep_unsharded."
  ),
  "mapped": (
    "TrainStep: keep_unsharded={keep!r} is the choice of what TrainStep gathers and "
    "reduce-scatters where it binds axis_name={axis!r} itself (under plain jax.jit); inside a "
    "map that binds it, the parameters arrive as your map splits them. Call TrainStep from "
    "your Python loop with the mesh in effect (jax.set_mesh), or drop keep_unsharded."
  ),
}


class FsdpSteps:
  """The programs and host logic of one `TrainStep` with ``keep_unsharded`` (its `owner`:
  the loss, the configuration, the weight function, the axis binding)."""

  def __init__(self, owner: Any, keep: Any):
    self.keep = keep = _fsdp.check_keep(keep, "TrainStep")
    cfg = owner._cfg
    if cfg.axis_name is None:
      raise ValueError(REFUSED["axis_name"].format(keep=keep))
    if cfg.unaccumulated:
      raise ValueError(REFUSED["every_k"].format(keep=keep))
    if cfg.noise:
      raise ValueError(REFUSED["noise"].format(keep=keep))
    if cfg.rounding == "stochastic":
      raise ValueError(REFUSED["rounding"].format(keep=keep, rounding=cfg.rounding))
    self.owner = owner
    # "nothing" and "params": a global state, its sums sharded like the parameters.
    self.per_device = keep == "params_and_grads"
    self.state_cfg = cfg if self.per_device else cfg._replace(axis=_collectives.NO_AXIS)
    self.tx = _accumulate.transformation(self.state_cfg)
    self._layouts: dict[str, _fsdp.Layout] | None = None  # by the parameter's path
    self._held: tuple[list, Any] | None = None  # (the parameters' leaves, their whole copy)
    self._jitted: dict[str, Any] = {}  # the programs by name ("gather", "accumulating", ...)
    self._compiled: dict[str, Any] = {}  # as `compile` compiled them

  # ------------------------------------------------------------------------------------------
  # What the parameters' placements say (read once, from the first placed parameters).

  def _axis(self) -> _gspmd.Axis:
    axis = _gspmd.resolve_axis(self.owner._cfg.axis_name, self.owner._mesh, "TrainStep")
    if axis.mode == "mapped":
      raise ValueError(REFUSED["mapped"].format(keep=self.keep, axis=axis.name))
    return axis

  def layouts(self, params: Any) -> dict[str, _fsdp.Layout]:
    """Each FSDP parameter's `_fsdp.Layout`, by its path (`_fsdp.plan` on the placements)."""
    if self._layouts is None:
      request = _fsdp.Request(self.keep, None)
      plan = _fsdp.plan(request, self._axis(), (params,), {}, {}, "TrainStep")
      self._layouts = {path: layout for (_, path), layout in plan.params.items()}
    return self._layouts

  def _shardings(self, params: Any, gathered: bool = False) -> Any:
    """Each parameter's sharding (replicated where unplaced); `gathered`: without the bound
    axes (the held whole copy, still split over the other axes)."""
    axis = self._axis()
    mesh = next(
      (x.sharding.mesh for x in jax.tree.leaves(params) if _named(x) is not None), axis.mesh
    )

    def one(path, x):
      spec = _named(x).spec if _named(x) is not None else P()
      layout = self.layouts(params).get(jax.tree_util.keystr(path))
      if gathered and layout is not None:
        spec = _without(spec, layout.axes)
      return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, params)

  def state_shardings(self, params: Any) -> Any:
    """The state's shardings: `state_partition_specs` of `tx` (global: the sums sharded like
    the parameters; per device: stacked whole sums)."""
    arrays = _batch.none_for_static(params)
    shardings = self._shardings(arrays)
    axis = self.owner._cfg.axis_name if self.per_device else None
    return _sharding.state_partition_specs(self.tx, shardings, axis, params=arrays)

  def init(self, params: Any) -> AccumulateState:
    """The initial state, placed where the programs keep it."""
    self._held = None
    arrays = _batch.none_for_static(_batch.hide_static(params))
    if self.per_device:
      return None  # TrainStep's own (per-device) init
    return jax.jit(self.tx.init, out_shardings=self.state_shardings(arrays))(arrays)

  # ------------------------------------------------------------------------------------------
  # The host: which programs a micro-step runs.

  def dispatch(self, emit: bool, params: Any, state: Any, args: tuple, weight: Any):
    """One micro-step: (the window's first: the gather), the accumulating program, and on the
    window's last the closing program. Returns ``(params, state, (), value)``."""
    forward = params if self.keep == "nothing" else self.whole(params)
    inner = state.inner_state
    hollow = state._replace(inner_state=self.owner._hollow(inner))
    made = (forward, hollow, params)
    state, value = self._call("accumulating", made, forward, hollow, args, weight)
    state = state._replace(inner_state=inner)
    if emit:
      params, state = self._call("closing", (params, state), params, state)
      self._held = None  # the window's whole copy is dropped
    return params, state, (), value

  def _call(self, name: str, like: tuple, *operands: Any) -> Any:
    """Program `name` on `operands`: as `compile` compiled it, for operands of the types it
    was compiled for (a compiled program checks its inputs before it runs or donates
    anything); else through `jax.jit`."""
    compiled = self._compiled.get(name)
    if compiled is not None:
      try:
        return compiled(*operands)
      except (TypeError, ValueError):
        pass
    return self._program(name, *like)(*operands)

  def whole(self, params: Any) -> Any:
    """The parameters gathered over the bound axes: held for the window, gathered by its
    first micro-step (or by the first after a restore, or after other parameters came in)."""
    leaves = jax.tree.leaves(params)
    held = self._held
    if (
      held is None
      or len(held[0]) != len(leaves)
      or any(a is not b for a, b in zip(held[0], leaves, strict=True))
    ):
      gathered = self._call("gather", (params,), params)
      self._held = held = (leaves, gathered)
    return held[1]

  def _program(self, name: str, *like: Any) -> Any:
    """The jitted program `name`, made for the placements of `like` once."""
    jitted = self._jitted.get(name)
    if jitted is None:
      jitted = self._jitted[name] = getattr(self, f"_make_{name}")(*like)
    return jitted

  def _make_gather(self, params: Any) -> Any:
    shardings = self._shardings(_batch.none_for_static(params), gathered=True)
    return jax.jit(lambda p: p, out_shardings=_static_none(params, shardings))

  def _make_accumulating(self, forward: Any, hollow: Any, params: Any) -> Any:
    owner = self.owner
    arrays = _batch.none_for_static(params)
    specs = self.state_shardings(arrays)._replace(inner_state=None)
    rep = NamedSharding(specs.mini_step.mesh, P())
    donate = (1,) if 0 in owner._donate_argnums else ()
    fun = self._add_per_device if self.per_device else self._add_global
    return jax.jit(fun, donate_argnums=donate, keep_unused=True, out_shardings=(specs, rep))

  def _make_closing(self, params: Any, state: Any) -> Any:
    arrays = _batch.none_for_static(params)
    out = (_static_none(params, self._shardings(arrays)), self.state_shardings(arrays))
    donate = (0, 1) if 0 in self.owner._donate_argnums else ()
    fun = self._close_per_device if self.per_device else self._close_global
    return jax.jit(fun, donate_argnums=donate, keep_unused=True, out_shardings=out)

  # ------------------------------------------------------------------------------------------
  # The programs.

  def _bound(self, fun, args: tuple, state_specs, out_specs=None, batch_argnums=()) -> Any:
    """`fun(*args)` with the axis bound (`_gspmd.run_bound`): batch arguments split, the
    state placed as `state_specs` says, outputs as `out_specs` (``types -> {path: spec}``)."""
    axis = self._axis()
    positions = _batch.positions(batch_argnums, (), 0, caller="TrainStep", need_batch=False)
    binding = _gspmd.Binding(axis, state_specs, "error", "TrainStep", out_specs)
    pos = _batch.resolve(positions, len(args), {})
    return _gspmd.run_bound(lambda *a: fun(*a), binding, pos, args, {})

  def _global_specs(self, x: Any, entry: Any) -> Any:
    """The hook (`_gspmd.StateSpecs`) of the global state: each FSDP parameter's sums as its
    shard over the bound axes, everything else the same on every device."""
    del entry
    if not isinstance(x, AccumulateState):
      return None
    layouts = self._layouts or {}

    def one(path, _):
      layout = layouts.get(jax.tree_util.keystr(path))
      return P() if layout is None else layout.spec

    specs = jax.tree.map(lambda _: P(), x)
    return specs._replace(grad_sum=jax.tree_util.tree_map_with_path(one, x.grad_sum))

  def _add_global(self, forward, state, args, weight):
    """The accumulating program of "nothing" and "params": per device, the micro-batch's
    gradient weighted and checked (each device's piece, as without keep_unsharded), then
    reduced (FSDP parameters' reduce-scattered, the others' all-reduced, the weight and the
    drop count with them) and added to the global sums; the state advanced."""
    run = functools.partial(self._bound_add_global)
    return self._bound(run, (forward, state, args, weight), self._global_specs, batch_argnums=2)

  def _bound_add_global(self, forward, state, args, weight):
    owner, cfg = self.owner, self.state_cfg
    axis = owner._cfg.axis
    grads, weight, value = self._local_grads(forward, state, args, weight)
    # This device's w·g, checked: added to zeros (the sums are global; restart below).
    zeros = jax.tree.map(lambda g, s: jnp.zeros(jnp.shape(g), s.dtype), grads, state.grad_sum)
    mine, w, dropped = _core.add(
      zeros, jnp.zeros((), jnp.float32), grads, weight,
      skip_nonfinite=cfg.skip_nonfinite, agree=axis.agree,
    )  # fmt: skip
    w, dropped = axis.reduce((w, dropped.astype(jnp.int32)))
    restart = state.mini_step == 0
    sums = jax.tree_util.tree_map_with_path(
      lambda path, old, x: jnp.where(restart, jnp.zeros_like(old), old) + self._reduce(path, x),
      state.grad_sum, mine,
    )  # fmt: skip
    total = jnp.where(restart, jnp.zeros_like(state.acc_weight), state.acc_weight) + w
    window = _window.Window(sums, total, state.inner_state, None, {}, None)
    closed = _window.keep_open(_window.APPLY, window)
    state = _window.advance(cfg, state, sums, total, dropped, closed, False)
    return state, owner._over_devices(value)

  def _reduce(self, path: Any, x: jax.Array) -> jax.Array:
    """One leaf of a micro-step's ``w·g`` summed over the devices: an FSDP parameter's
    reduce-scattered into this device's shard (then summed over the bound axes that do not
    shard it), any other all-reduced."""
    axis = self.owner._cfg.axis
    layout = (self._layouts or {}).get(jax.tree_util.keystr(path))
    if layout is None:
      return lax.psum(axis.to_varying(x), axis.name)
    x = layout.scatter(axis.to_varying(x))
    rest = tuple(a for a in axis.axes if a not in layout.axes)
    return lax.psum(x, rest) if rest else x

  def _local_grads(self, forward, state, args, weight):
    """This device's gradient of its piece of the micro-batch (with respect to the whole
    parameters, made device-varying so that autodiff reduces nothing), its weight, checked as
    `TrainStep` checks them, and the loss value."""

    owner = self.owner
    value, grads = owner._grad(owner._cfg.axis.to_varying(forward), *args)
    grads = _batch.none_for_static(_state.gradient_like(grads))
    if owner._weight_fn is not None:
      weight = owner._weight_fn(*args)
    like = state._replace(grad_sum=grads)  # the whole gradient's tree, for the checks
    try:
      weight = _config.check_update(
        self.state_cfg._replace(axis=_collectives.NO_AXIS), grads, like, None, weight, False,
        False, "TrainStep",
      )  # fmt: skip
    except (TypeError, ValueError) as e:
      raise _host.in_trainstep_words(e) from None
    return grads, weight, value

  def _add_per_device(self, forward, state, args, weight):
    """The accumulating program of "params_and_grads": `TrainStep`'s own (the per-device
    whole sums), on the held whole copy of the parameters (no gather)."""
    owner = self.owner
    run = functools.partial(owner._bound_step, emit=False)
    _, state, value = owner._bind(run, batch_argnums=2)(forward, state, args, weight)
    return state, value

  def _close_global(self, params, state):
    """The closing program of "nothing" and "params": the window closed from the global state
    (`_window.close_from_state`: normalise, inner update, apply) under GSPMD, on the
    sharded parameters, sums and optimizer state."""
    hidden = params
    params = _batch.none_for_static(hidden)
    like = _state.gradient_like(params)
    new_params, state = _window.close_from_state(self.state_cfg, state, params, like)
    return _batch.restore_static(new_params, hidden), state

  def _close_per_device(self, params, state):
    """The closing program of "params_and_grads": the devices' whole sums reduce-scattered
    once (the FSDP parameters'; the others' and the scalars all-reduced), then the window
    closed from that global view as for the other points; the state keeps its per-device
    fields (the spent sums stay, lazily reset, except on a private path, where they are zeroed:
    `_window.private_spent`; a window dropped by ``skip_nonfinite="window"`` is counted on
    the first device)."""
    sums, total, skipped = self._bound(
      self._bound_reduce, (state,), _sharding.per_device_specs, self._reduced_specs
    )
    view = state._replace(grad_sum=sums, acc_weight=total, num_skipped=skipped)
    cfg = self.state_cfg._replace(axis=_collectives.NO_AXIS)
    hidden = params
    arrays = _batch.none_for_static(hidden)
    like = _state.gradient_like(arrays)
    new_params, closed = _window.close_from_state(cfg, view, arrays, like)
    first = jnp.arange(state.num_skipped.shape[0]) == 0
    counted = state.num_skipped + jnp.where(first, closed.num_skipped - skipped, 0)
    spent = (state.grad_sum, state.acc_weight)
    sums, total = _window.private_spent(closed.inner_state, True, spent)
    new = closed._replace(grad_sum=sums, acc_weight=total, num_skipped=counted)
    return _batch.restore_static(new_params, hidden), new

  def _bound_reduce(self, state):
    axis = self.owner._cfg.axis
    sums = jax.tree_util.tree_map_with_path(
      lambda path, s: self._reduce(path, s), axis.this_device(state.grad_sum)
    )
    total, skipped = axis.reduce(axis.this_device((state.acc_weight, state.num_skipped)))
    return sums, total, skipped

  def _reduced_specs(self, types: Any) -> dict[str, P]:
    """`_bound_reduce`'s output specs: each FSDP parameter's sums as its shard."""
    layouts = self._layouts or {}
    return {f"[0]{path}": layout.spec for path, layout in layouts.items()}

  # ------------------------------------------------------------------------------------------
  # For inspection: the programs of one window.

  def compile(self, params: Any, state: Any, args: tuple, weight: Any) -> None:
    """Compiles the window's programs now, for arguments like these (`TrainStep.compile`)."""
    for name, lowered, _ in self.window_programs(params, state, *args, weight=weight):
      self._compiled[name] = lowered.compile()

  def lower(self, emit: bool, params: Any, state: Any, args: tuple, weight: Any) -> Any:
    """`TrainStep.lower`: the accumulating program (as a micro-step within a window gets its
    operands), or with `emit` the closing one."""
    programs = {n: low for n, low, _ in self.window_programs(params, state, *args, weight=weight)}
    return programs["closing" if emit else "accumulating"]

  def window_programs(self, params: Any, state: Any, *args: Any, weight: Any = None) -> list:
    """The programs one window of ``k`` micro-steps runs, as ``(name, lowered, calls)``:
    the gather (once, except with "nothing"), the accumulating program (``k`` times) and the
    closing program (once). Lowered for these arguments (`jax.stages.Lowered`)."""
    params = _batch.hide_static(params)
    self.layouts(_batch.none_for_static(params))
    k = self.owner._window_k
    out = []
    forward = params
    if self.keep != "nothing":
      gather = self._program("gather", params)
      out.append(("gather", gather.lower(params), 1))
      forward = jax.eval_shape(gather, params)
    hollow = state._replace(inner_state=self.owner._hollow(state.inner_state))
    acc = self._program("accumulating", forward, hollow, params)
    out.append(("accumulating", acc.lower(forward, hollow, args, weight), k))
    closing = self._program("closing", params, state)
    out.append(("closing", closing.lower(params, state), 1))
    return out


def _named(x: Any) -> NamedSharding | None:
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, NamedSharding) else None


def _without(spec: P, axes: tuple[str, ...]) -> P:
  """`spec` with `axes` taken out of every entry."""
  entries = []
  for e in spec:
    names = tuple(a for a in _fsdp._names(e) if a not in axes)
    entries.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*entries)


def _static_none(hidden: Any, shardings: Any) -> Any:
  """`shardings` (of the arrays-only tree) shaped like the hidden parameters
  (`_batch.hide_static`): their `Static` nodes, which hold no array, back in place."""
  return _batch.restore_static(shardings, hidden)
