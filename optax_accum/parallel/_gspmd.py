"""The axis binder: a data axis of the mesh bound under plain `jax.jit` (GSPMD).

Under plain `jax.jit` with sharded arrays XLA decides the collectives, and it reduces every
micro-batch's gradient where it is computed: k all-reduces per update, inside the loop. To
defer the reduction the gradients must stay per-device until the update, which needs the data
axis *bound*, as `jax.shard_map` binds it. `bind` binds it over that one axis only:

* the mesh is the one in effect (`jax.set_mesh`, Auto or Explicit axes) or an explicit `mesh=`;
* `fun` runs under ``jax.shard_map(..., axis_names={axis})``: manual over the data axis, the
  other mesh axes (a tensor-parallel "model" axis) stay automatic, so XLA still partitions
  `fun` over them and inserts their collectives where the model needs them;
* batch arguments are split over the axis (along `batch_axes`, positions read by `_batch`, the
  one parser); every other array argument is the same on every device (an argument sharded over
  the data axis, an FSDP parameter, is gathered once, on entry), except what the front end's
  `state_specs` hook says is per-device state (an optimizer state's per-device sums);
* outputs that are the same on every device come out replicated over the axis; per-device state
  comes out as the hook says (stacked ``(num_devices, ...)``); any other device-varying output is
  an error (or, with ``varying="concat"``, is joined along its leading axis).

The binder knows no optimizer state: the front end (`optax_accum.parallel._data_parallel`) passes
the hook. `fun` itself reduces what must be global: `microbatch(..., axis_name=axis)` after its
loop, `accumulate(..., axis_name=axis)` on the emitting step. Inside a map that already binds the
axis, `fun` is called unchanged.

``sync="microbatch"`` is the other FSDP trade-off: it binds the axis as a trivial one (size 1,
every collective over it the identity) and leaves the whole mesh to GSPMD, which reduces each
micro-batch's gradient where autodiff makes it — for parameters sharded over the data axis a
reduce-scatter into an accumulator sharded like them, instead of a full-size accumulator on
every device.

`Axis` is the axis of one call, resolved once (`resolve_axis`: the names, the mesh, whether an
enclosing map binds it, whether this call binds it itself) and handed down, so that the code
below asks it instead of testing whether the name is None.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum.core import _batch, _checks
from optax_accum.core._typing import ArgNums, AxisName
from optax_accum.parallel import _collectives

Sync = Literal["update", "microbatch"]
SYNCS: tuple[str, ...] = ("update", "microbatch")
Varying = Literal["error", "concat"]
VARYINGS: tuple[str, ...] = ("error", "concat")
# ``state_specs(x, entry)``: the spec tree of `x` if it is per-device state (its per-device
# leaves split over the spec entry `entry`), else None. Called on every argument and output node.
StateSpecs = Callable[[Any, Any], Any]

OUTPUT_VARIES = (
  "{caller}: output{path} differs per device over axis_name={axis!r} ({type}), so it has "
  "no single value to return under plain `jax.jit`. Reduce it inside the function (e.g. "
  "`jax.lax.pmean(x, {axis!r})`, or `microbatch(..., axis_name={axis!r})` with reduction "
  "'mean'/'sum'), or pass varying='concat' to join the devices' values along its leading axis."
)
# TrainStep returns the loss's float values averaged over the devices (summed with
# reduction="sum"); anything else its loss returns must be made global inside the loss.
TRAIN_STEP_VARIES = (
  "{caller}: output{path} differs per device over axis_name={axis!r} ({type}), so it has "
  "no single value to return. TrainStep averages the float values the loss returns over the "
  "devices (sums them with reduction='sum'); reduce this one inside the loss, where the axis "
  "is bound (e.g. `jax.lax.psum(x, {axis!r})` for a count), or return it as a float."
)

MANUAL_SPEC = (
  "{caller}: a sharding written inside the function names the data axis {axis!r}, which is "
  "Manual where {caller} binds it: each device runs the function on its own rows, so a spec "
  "there may name only the other (Explicit) mesh axes. JAX said: {error}\n"
  "Take the batch dimension's entry from the value's own type: it is {axis!r} under plain "
  "`jax.jit` and None inside the binding, so one spelling is right in both places, e.g.\n\n"
  "    spec = jax.typeof(x).sharding.spec[0]   # x: the batch, sharded over {axis!r}\n"
  "    out = jnp.einsum('bi,ij->bj', x, w, out_sharding=P(spec, None))\n"
)

SYNC_MICROBATCH_STATE = (
  "{caller}: sync='microbatch' reduces every micro-step, but argument or output{path} is "
  "per-device state (e.g. an AccumulateState of accumulate(..., axis_name={axis!r})). For one "
  "reduction per micro-step under plain `jax.jit` use accumulate(..., axis_name=None): its "
  "accumulator then keeps each parameter's sharding (`state_partition_specs(tx, shardings, "
  "None)`). For one reduction per update keep axis_name and use sync='update'."
)


# ----------------------------------------------------------------------------------------------
# The mesh and the axis.

Mode = Literal["none", "mapped", "unbound", "bound_here"]


class Axis(NamedTuple):
  """The data-parallel axis of one call, resolved once by `resolve_axis` and handed down.

  `mode` says where the call stands: "none" (no axis: everything here is the identity),
  "mapped" (an enclosing `shard_map`/`pmap` binds it: outputs stay per device where the front
  end says so), "unbound" (plain `jax.jit`: the front end binds it itself over `mesh`) and
  "bound_here" (inside the map this call opened: outputs must be global).
  """

  name: AxisName | None  # as the user spelled it (a name or a tuple of names); None: no axis
  mode: Mode
  mesh: Any = None  # "unbound": the mesh to bind over

  @property
  def names(self) -> tuple[str, ...]:
    return _collectives.axis_names(self.name) if self.mode != "none" else ()

  @property
  def bound(self) -> bool:
    """True where collectives over the axis may run (inside a map)."""
    return self.mode in ("mapped", "bound_here")

  @property
  def entry(self) -> Any:
    """The spec entry for one array dimension split over the axis."""
    return _axis_entry(self.names)

  def index(self) -> jax.Array | int:
    """This device's index along the axis (0 without one)."""
    return lax.axis_index(self.name) if self.bound else 0

  def size(self) -> int:
    """The number of devices along the axis: inside a map, or on the mesh to bind over."""
    if self.bound:
      return int(np.prod([lax.axis_size(a) for a in self.names]))
    if self.mode == "unbound":
      return int(np.prod([self.mesh.shape[a] for a in self.names]))
    return 1

  @property
  def collectives(self) -> Any:
    """What the collectives do over this axis: `_collectives.Axis` where it is bound (inside a
    map), else `_collectives.NO_AXIS`, whose operations are the identity."""
    return _collectives.resolve(self.name if self.bound else None)


def resolve_axis(axis_name: AxisName | None, mesh: Any, caller: str) -> Axis:
  """`axis_name` for this call: no axis, bound by an enclosing map, or to bind over a mesh.

  Raises:
    TypeError: for an `axis_name` that is not a name or a tuple of names.
    ValueError: unbound with no mesh in effect, or a mesh without the axis (`find_mesh`).
  """
  if axis_name is None:
    return Axis(None, "none")
  check_axis_name(axis_name, caller)
  if _collectives.is_bound(axis_name):
    return Axis(axis_name, "mapped")
  return Axis(axis_name, "unbound", find_mesh(axis_name, mesh, caller))


def check_axis_name(axis_name: Any, caller: str) -> None:
  """Raises TypeError unless `axis_name` is a mesh axis name or a non-empty tuple of them."""
  axes = _collectives.axis_names(axis_name) if isinstance(axis_name, str | tuple | list) else ()
  if not axes or not all(isinstance(a, str) for a in axes):
    raise TypeError(
      f"{caller}: axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}."
    )


def find_mesh(axis_name: AxisName, mesh: Any, caller: str) -> Any:
  """The mesh whose `axis_name` to bind: `mesh`, else the one in effect; checked.

  Raises:
    ValueError: with no mesh (and no enclosing map: the caller checked), or a mesh without
      every name in `axis_name`.
  """
  axes = _collectives.axis_names(axis_name)
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(
        f"{caller}: "
        + _collectives.AXIS_NOT_BOUND.format(axis=axis_name, where="No mesh is in effect. ")
      )
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"{caller}: axis_name={axis_name!r} is not an axis of the mesh, whose axes are "
      f"{tuple(mesh.axis_names)}. Name the mesh's data-parallel axis (the one the batch is "
      "sharded over)."
    )
  return mesh


def _axis_types(mesh: Any) -> dict[str, Any]:
  return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


def _axis_entry(axes: tuple[str, ...]) -> Any:
  """The spec entry for one array dimension split over `axes`."""
  return axes[0] if len(axes) == 1 else axes


# ----------------------------------------------------------------------------------------------
# Arguments: which leaves travel, and how each is split.


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray | np.generic)


def no_state(x: Any, entry: Any) -> None:
  """The hook of a front end without per-device state."""
  del x, entry


def _per_device(state_specs: StateSpecs, entry: Any) -> Callable[[Any], bool]:
  """`is_leaf` for tree maps that stop at per-device state."""
  return lambda x: state_specs(x, entry) is not None


def _batch_spec(x: Any, axis: int, entry: Any, n: int, where: str, caller: str) -> P:
  """The spec of one batch leaf: split over the axis along dimension `axis`."""
  shape = np.shape(x)
  if not -len(shape) <= axis < len(shape):
    raise ValueError(
      f"{caller}: {where} has shape {shape}, which has no batch axis {axis} to split over the "
      "devices."
    )
  axis %= len(shape)
  if shape[axis] % n:
    raise ValueError(
      f"{caller}: {where} has batch size {shape[axis]} (axis {axis}), which does not divide "
      f"over the {n} devices of axis_name={entry!r}."
    )
  return P(*([None] * axis), entry)


def _arg_specs(key: int | str, a: Any, axes: dict, ctx: Binding) -> Any:
  """The spec tree of one argument (over the bound axis only)."""
  entry, caller = ctx.axis.entry, ctx.caller
  if key in axes:
    name = f"argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"
    n = ctx.axis.size()
    return jax.tree_util.tree_map_with_path(
      lambda p, x: _batch_spec(x, axes[key], entry, n, name + jax.tree_util.keystr(p), caller), a
    )
  hook = ctx.state_specs
  return jax.tree.map(lambda x: hook(x, entry) or P(), a, is_leaf=_per_device(hook, entry))


def _place(x: Any, spec: P, mesh: Any, axes: tuple[str, ...]) -> Any:
  """On an Explicit mesh, `x` resharded so that it is split over `axes` as `spec` says.

  `shard_map` checks that an Explicit argument's type already matches `in_specs` (it does not
  reshard by itself, as it does for Auto axes): split a replicated batch, gather a parameter
  sharded over the data axis. Placements over other mesh axes are kept.
  """
  if any(_axis_types(mesh)[a] != AxisType.Explicit for a in axes):
    return x
  ndim = np.ndim(x)
  # A host array (NumPy) is typed with an empty mesh: replicated.
  spec_now = getattr(getattr(jax.typeof(x), "sharding", None), "spec", P())
  now = list(spec_now) + [None] * (ndim - len(spec_now))
  want = list(spec) + [None] * (ndim - len(spec))
  new = []
  for cur, w in zip(now, want, strict=True):
    names = () if cur is None else cur if isinstance(cur, tuple) else (cur,)
    keep = tuple(a for a in names if a not in axes)
    names = (() if w is None else w if isinstance(w, tuple) else (w,)) + keep
    new.append(None if not names else names[0] if len(names) == 1 else names)
  if new == now:
    return x
  return jax.reshard(x, NamedSharding(mesh, P(*new)))


# ----------------------------------------------------------------------------------------------
# Outputs.


def _out_spec(path: Any, t: Any, ctx: Binding) -> P:
  entry = ctx.axis.entry
  if not set(ctx.axis.names) & _collectives.vma(t):
    return P()
  where = jax.tree_util.keystr(path)
  if ctx.varying == "concat":
    if not t.shape:
      raise ValueError(
        f"{ctx.caller}: output{where} is a scalar that differs per device over "
        f"axis_name={entry!r}; there is no leading axis to join the devices' values along. "
        f"Reduce it inside the function (e.g. `jax.lax.pmean(x, {entry!r})`)."
      )
    return P(entry)
  said = TRAIN_STEP_VARIES if ctx.caller == "TrainStep" else OUTPUT_VARIES
  raise ValueError(
    said.format(caller=ctx.caller, path=where, axis=entry, type=f"{t.dtype}{list(t.shape)}")
  )


def _out_specs(types: Any, ctx: Binding) -> Any:
  """Specs of `fun`'s outputs: per-device state as the hook says; the rest from their types,
  replicated, or (varying="concat") split over the axis."""
  hook, entry = ctx.state_specs, ctx.axis.entry

  # A front end's own specs for some output leaves (by path), e.g. an FSDP gradient's shard.
  own = ctx.out_specs(types) if ctx.out_specs is not None else {}

  def node(path, x):
    specs = own.get(jax.tree_util.keystr(path)) or hook(x, entry)
    return _out_spec(path, x, ctx) if specs is None else specs

  return jax.tree_util.tree_map_with_path(node, types, is_leaf=_per_device(hook, entry))


# ----------------------------------------------------------------------------------------------
# The two ways to bind.


class Binding(NamedTuple):
  """How one front end binds: the axis, its hook for per-device state (`no_state`: none), what
  to do with device-varying outputs, and its name for errors."""

  axis: Axis
  state_specs: StateSpecs
  varying: Varying
  caller: str
  # ``types -> {keystr(path): spec}``: specs of some output leaves, chosen by the front end.
  out_specs: Callable[[Any], dict[str, P]] | None = None


def _flatten_args(args: tuple, kwargs: dict) -> tuple[list[int], Callable[[list], tuple]]:
  """Where the array leaves of ``(args, kwargs)`` are, and how to put them back.

  Only arrays travel through `shard_map`; Python values (flags, sizes) stay what they are, the
  same on every device, so `fun` can branch on them as it would unbound.
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, x in enumerate(leaves) if _is_array(x)]

  def rebuild(arrays: list) -> tuple:
    full = list(leaves)
    for i, x in zip(where, arrays, strict=True):
      full[i] = x
    return jax.tree.unflatten(tree, full)

  return where, rebuild


def run_bound(fun: Callable, ctx: Binding, pos: _batch.Positions, args, kwargs) -> Any:
  """`fun(*args, **kwargs)` under `shard_map` over the mesh of ``ctx.axis`` (mode "unbound"),
  manual over its names only (sync="update"); `pos` is the call's resolved batch positions."""
  axes, mesh = ctx.axis.names, ctx.axis.mesh
  batch = pos.axis_of()
  spec_tree = (
    tuple(_arg_specs(i, a, batch, ctx) for i, a in enumerate(args)),
    {key: _arg_specs(key, a, batch, ctx) for key, a in kwargs.items()},
  )
  where, rebuild = _flatten_args(args, kwargs)
  leaves = jax.tree.leaves((args, kwargs))
  spec_leaves = jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P))
  specs = [spec_leaves[i] for i in where]
  arrays = [_place(leaves[i], s, mesh, axes) for i, s in zip(where, specs, strict=True)]

  def body(arrays):
    a, kw = rebuild(arrays)
    return fun(*a, **kw)

  # The output specs depend on which outputs vary per device: trace once to find out (the
  # types exist only inside the map, so the probe hands them out).
  types: list = []

  def probe(arrays):
    types.append(jax.eval_shape(lambda: body(arrays)))
    return ()

  sm = functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs,), axis_names=set(axes))
  try:
    jax.eval_shape(sm(probe, out_specs=()), arrays)
  except ValueError as e:
    if "of type Auto or Manual" not in str(e):
      raise
    raise ValueError(MANUAL_SPEC.format(caller=ctx.caller, axis=ctx.axis.entry, error=e)) from e
  return sm(body, out_specs=_out_specs(types[0], ctx))(arrays)


def _trivially_mapped(f: Callable, axis: str) -> Callable:
  """``f(x)`` with `axis` bound by a vmap of size 1 (outputs unstacked again)."""

  def g(x):
    return jax.tree.map(lambda y: y[0], jax.vmap(f, axis_name=axis)(x[None]))

  return g


def _bind_trivial(fun: Callable, ctx: Binding, args, kwargs) -> Any:
  """`fun` with the axis bound as size-1 vmap axes: every collective over them is the identity,
  and GSPMD partitions `fun` over the whole mesh (sync="microbatch")."""
  entry = ctx.axis.entry
  per_device = _per_device(ctx.state_specs, entry)
  if any(per_device(x) for x in jax.tree.leaves((args, kwargs), is_leaf=per_device)):
    raise ValueError(SYNC_MICROBATCH_STATE.format(caller=ctx.caller, path="", axis=entry))

  def call(_):
    return fun(*args, **kwargs)

  f = call
  for a in reversed(ctx.axis.names):
    f = _trivially_mapped(f, a)
  out = f(np.zeros((), np.int32))
  if any(per_device(x) for x in jax.tree.leaves(out, is_leaf=per_device)):
    raise ValueError(
      SYNC_MICROBATCH_STATE.format(caller=ctx.caller, path=" (an output)", axis=entry)
    )
  return out


class BindOptions(NamedTuple):
  """`bind`'s keyword options (`data_parallel` documents them)."""

  batch_argnums: ArgNums = ()  # positions split over the devices
  batch_argnames: str | tuple[str, ...] = ()  # keywords split over the devices
  batch_axes: ArgNums = 0  # each batch argument's batch axis
  mesh: Any = None  # None: the mesh in effect
  varying: Varying = "error"  # or "concat": join device-varying outputs
  sync: Sync = "update"  # or "microbatch": a trivial axis, GSPMD reduces


def bind(
  fun: Callable[..., Any],
  axis_name: AxisName,
  *,
  caller: str,
  state_specs: StateSpecs | None = None,
  **options: Any,
) -> Callable[..., Any]:
  """`fun` with `axis_name` bound under plain jit, naming `caller` (the front end) in its errors.

  The one seam through which ``data_parallel`` and ``TrainStep(axis_name=...)`` bind the axis
  (``microbatch(axis_name=...)`` resolves its axis itself and calls `run_bound`). `options` are
  `BindOptions`' fields. `state_specs` (``(node, entry) -> spec tree | None``) names the
  per-device state among arguments and outputs; None: there is none. Arguments are checked
  here; the axis is resolved once per call (`resolve_axis`).
  """
  opts = BindOptions(**options)
  if not callable(fun):
    raise TypeError(f"{caller}: fun must be callable, got {fun!r}.")
  if opts.varying not in VARYINGS:
    raise ValueError(f"{caller}: varying must be one of {VARYINGS}, got {opts.varying!r}.")
  if opts.sync not in SYNCS:
    raise ValueError(f"{caller}: sync must be one of {SYNCS}, got {opts.sync!r}.")
  pos = _batch.positions(
    opts.batch_argnums, opts.batch_argnames, opts.batch_axes, caller=caller, need_batch=False
  )
  check_axis_name(axis_name, caller)
  hook = state_specs or no_state

  @_checks.wraps(fun)
  def wrapped(*args, **kwargs):
    axis = _resolve_for(axis_name, opts.mesh, opts.sync, caller)
    if axis.mode == "mapped":
      return fun(*args, **kwargs)
    binding = Binding(axis, hook, opts.varying, caller)
    if opts.sync == "microbatch":
      return _bind_trivial(fun, binding, args, kwargs)
    return run_bound(fun, binding, _batch.resolve(pos, len(args), kwargs), args, kwargs)

  return wrapped


def _resolve_for(axis_name: AxisName, mesh: Any, sync: Sync, caller: str) -> Axis:
  """`resolve_axis`, except that sync="microbatch" needs no mesh (it binds a trivial axis)."""
  if sync == "microbatch" and not _collectives.is_bound(axis_name):
    return Axis(axis_name, "unbound")
  return resolve_axis(axis_name, mesh, caller)
