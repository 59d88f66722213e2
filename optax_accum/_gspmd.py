"""`data_parallel`: bind a data axis of the mesh under plain `jax.jit` (GSPMD).

Under plain `jax.jit` with sharded arrays XLA decides the collectives, and it reduces every
micro-batch's gradient where it is computed: k all-reduces per update, inside the loop. To
defer the reduction the gradients must stay per-device until the update, which needs the data
axis *bound*, as `jax.shard_map` binds it. `data_parallel` binds it over that one axis only:

* the mesh is the one in effect (`jax.set_mesh`, Auto or Explicit axes) or an explicit `mesh=`;
* `fun` runs under ``jax.shard_map(..., axis_names={axis})``: manual over the data axis, the
  other mesh axes (a tensor-parallel "model" axis) stay automatic, so XLA still partitions
  `fun` over them and inserts their collectives where the model needs them;
* batch arguments are split over the axis (along `batch_axes`); every other array argument is
  the same on every device (an argument sharded over the data axis, an FSDP parameter, is
  gathered once, on entry); the per-device sums of an `AccumulateState` are split over the
  axis, so an optimizer state can leave one call and enter the next;
* outputs that are the same on every device come out replicated over the axis; the per-device
  sums of an `AccumulateState` come out stacked ``(num_devices, ...)``, as
  `state_partition_specs` says; any other device-varying output is an error (or, with
  ``varying="concat"``, is joined along its leading axis).

`fun` itself reduces what must be global: `microbatch(..., axis_name=axis)` after its loop,
`accumulate(..., axis_name=axis)` on the emitting step. Inside a map that already binds the
axis, `data_parallel` calls `fun` unchanged.

``sync="microbatch"`` is the other FSDP trade-off: it binds the axis as a trivial one (size 1,
every collective over it the identity) and leaves the whole mesh to GSPMD, which reduces each
micro-batch's gradient where autodiff makes it — for parameters sharded over the data axis a
reduce-scatter into an accumulator sharded like them, instead of a full-size accumulator on
every device.

`bind` is the same with the front end's name in its errors: the seam through which
``microbatch(axis_name=...)`` and ``TrainStep(axis_name=...)`` bind the axis themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _collectives
from optax_accum._accumulate import AccumulateState
from optax_accum._typing import AxisName

Sync = Literal["update", "microbatch"]
SYNCS: tuple[str, ...] = ("update", "microbatch")
Varying = Literal["error", "concat"]
VARYINGS: tuple[str, ...] = ("error", "concat")

OUTPUT_VARIES = (
  "{caller}: output{path} differs per device over axis_name={axis!r} ({type}), so it has "
  "no single value to return under plain `jax.jit`. Reduce it inside the function (e.g. "
  "`jax.lax.pmean(x, {axis!r})`, or `microbatch(..., axis_name={axis!r})` with reduction "
  "'mean'/'sum'), or pass varying='concat' to join the devices' values along its leading axis."
)

SYNC_MICROBATCH_STATE = (
  "{caller}: sync='microbatch' reduces every micro-step, but argument or output{path} is "
  "an AccumulateState with per-device sums (accumulate(..., axis_name={axis!r})). For one "
  "reduction per micro-step under plain `jax.jit` use accumulate(..., axis_name=None): its "
  "accumulator then keeps each parameter's sharding (`state_partition_specs(tx, shardings, "
  "None)`). For one reduction per update keep axis_name and use sync='update'."
)


# ----------------------------------------------------------------------------------------------
# The mesh and the axis.


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


def _is_state(x: Any) -> bool:
  return isinstance(x, AccumulateState)


def _per_device_state(x: Any) -> bool:
  """An `AccumulateState` whose sums are per device (stacked over the axis outside the map)."""
  return _is_state(x) and np.ndim(x.acc_weight) > np.ndim(x.mini_step)


def _state_specs(state: AccumulateState, entry: Any) -> AccumulateState:
  """Specs of a per-device `AccumulateState`'s leaves: its sums split over the axis."""
  rep = P()
  split = jax.tree.map(lambda _: P(entry), state.acc_grads)
  return AccumulateState(
    mini_step=rep,
    gradient_step=rep,
    acc_grads=split,
    acc_weight=P(entry),
    num_skipped=P(entry),
    inner_state=jax.tree.map(lambda _: rep, state.inner_state),
    updated=rep,
  )


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


def _canonical_batch(
  batch_argnums: Any, batch_argnames: Any, batch_axes: Any, caller: str
) -> dict[int | str, int]:
  """{argument position or keyword: batch axis}, axes in the order argnums then argnames."""
  nums = (batch_argnums,) if isinstance(batch_argnums, int | np.integer) else tuple(batch_argnums)
  names = (batch_argnames,) if isinstance(batch_argnames, str) else tuple(batch_argnames)
  keys = tuple(int(a) for a in nums) + names
  if isinstance(batch_axes, int | np.integer):
    axes = (int(batch_axes),) * len(keys)
  else:
    axes = tuple(int(a) for a in batch_axes)
    if len(axes) != len(keys):
      raise ValueError(
        f"{caller}: batch_axes must be an int or have one entry per batch argument "
        f"(batch_argnums, then batch_argnames), got batch_axes={batch_axes!r} for "
        f"{len(keys)} batch arguments."
      )
  return dict(zip(keys, axes, strict=True))


def _resolve(batch: dict[int | str, int], nargs: int, kwargs: dict, caller: str) -> dict:
  """The batch positions of this call: negative positions counted from the end, all present."""
  out: dict[int | str, int] = {}
  for key, axis in batch.items():
    if isinstance(key, str):
      if key not in kwargs:
        raise ValueError(
          f"{caller}: batch argument {key!r} (batch_argnames) was not passed by keyword; got "
          f"keywords {sorted(kwargs)}."
        )
    elif not -nargs <= key < nargs:
      raise ValueError(f"{caller}: batch_argnums {key} is out of range for {nargs} arguments.")
    out[key % nargs if isinstance(key, int) else key] = axis
  return out


def _arg_specs(key: int | str, a: Any, batch: dict, entry: Any, n: int, caller: str) -> Any:
  """The spec tree of one argument (over the bound axis only)."""
  if key in batch:
    name = f"argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"
    return jax.tree_util.tree_map_with_path(
      lambda p, x: _batch_spec(x, batch[key], entry, n, name + jax.tree_util.keystr(p), caller),
      a,
    )
  return jax.tree.map(
    lambda x: _state_specs(x, entry) if _per_device_state(x) else P(), a, is_leaf=_is_state
  )


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


def _out_spec(
  path: Any, t: Any, entry: Any, axes: tuple, varying: Varying, stacked: bool, caller: str
) -> P:
  if not set(axes) & _collectives.vma(t):
    return P()
  where = jax.tree_util.keystr(path)
  if stacked or varying == "concat":
    if not t.shape:
      raise ValueError(
        f"{caller}: output{where} is a scalar that differs per device over "
        f"axis_name={entry!r}; there is no leading axis to join the devices' values along. "
        f"Reduce it inside the function (e.g. `jax.lax.pmean(x, {entry!r})`)."
      )
    return P(entry)
  raise ValueError(
    OUTPUT_VARIES.format(caller=caller, path=where, axis=entry, type=f"{t.dtype}{list(t.shape)}")
  )


def _out_specs(types: Any, entry: Any, axes: tuple, varying: Varying, caller: str) -> Any:
  """Specs of `fun`'s outputs, from their types: replicated, or split over the axis."""

  def node(path, x):
    if _is_state(x):  # its per-device sums are device-varying: stacked over the axis
      return jax.tree_util.tree_map_with_path(
        lambda p, t: _out_spec(path + p, t, entry, axes, varying, True, caller), x
      )
    return _out_spec(path, x, entry, axes, varying, False, caller)

  return jax.tree_util.tree_map_with_path(node, types, is_leaf=_is_state)


# ----------------------------------------------------------------------------------------------
# The two ways to bind.


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


def _bind_manual(
  fun: Callable, mesh: Any, axes: tuple, batch: dict, varying: Varying, caller: str, args, kwargs
) -> Any:
  """`fun` under `shard_map`, manual over `axes` only (sync="update")."""
  entry = _axis_entry(axes)
  n = int(np.prod([dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[a] for a in axes]))
  batch = _resolve(batch, len(args), kwargs, caller)
  spec_tree = (
    tuple(_arg_specs(i, a, batch, entry, n, caller) for i, a in enumerate(args)),
    {key: _arg_specs(key, a, batch, entry, n, caller) for key, a in kwargs.items()},
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
  jax.eval_shape(sm(probe, out_specs=()), arrays)
  out_specs = _out_specs(types[0], entry, axes, varying, caller)
  return sm(body, out_specs=out_specs)(arrays)


def _trivially_mapped(f: Callable, axis: str) -> Callable:
  """``f(x)`` with `axis` bound by a vmap of size 1 (outputs unstacked again)."""

  def g(x):
    return jax.tree.map(lambda y: y[0], jax.vmap(f, axis_name=axis)(x[None]))

  return g


def _bind_trivial(fun: Callable, axes: tuple, caller: str, args, kwargs) -> Any:
  """`fun` with `axes` bound as size-1 vmap axes: every collective over them is the identity,
  and GSPMD partitions `fun` over the whole mesh (sync="microbatch")."""
  for x in jax.tree.leaves((args, kwargs), is_leaf=_is_state):
    if _per_device_state(x):
      raise ValueError(SYNC_MICROBATCH_STATE.format(caller=caller, path="", axis=_axis_entry(axes)))

  def call(_):
    return fun(*args, **kwargs)

  f = call
  for a in reversed(axes):
    f = _trivially_mapped(f, a)
  out = f(np.zeros((), np.int32))
  for x in jax.tree.leaves(out, is_leaf=_is_state):
    if _per_device_state(x):
      raise ValueError(
        SYNC_MICROBATCH_STATE.format(caller=caller, path=" (an output)", axis=_axis_entry(axes))
      )
  return out


def data_parallel(
  fun: Callable[..., Any],
  axis_name: AxisName,
  *,
  batch_argnums: int | Sequence[int] = (),
  batch_argnames: str | Sequence[str] = (),
  batch_axes: int | Sequence[int] = 0,
  mesh: Any = None,
  varying: Varying = "error",
  sync: Sync = "update",
) -> Callable[..., Any]:
  """Runs `fun` once per device over the mesh axis `axis_name`, under plain `jax.jit`.

  Binds `axis_name` the way `jax.shard_map` does, over that axis only (the other mesh axes stay
  automatic), so that inside `fun` gradients can stay per-device and
  ``microbatch(..., axis_name=...)`` / ``accumulate(..., axis_name=...)`` reduce them once per
  update instead of XLA reducing every micro-batch. Each device sees its share of the batch
  arguments and the whole of every other argument. Inside a map that already binds
  `axis_name`, `fun` is called unchanged.

  Outputs that are the same on every device (what `microbatch` and `accumulate` reduce) come
  out replicated over the axis; the per-device sums of an `AccumulateState` come out stacked
  ``(num_devices, ...)`` and go back in split, as `state_partition_specs` describes them.

  Args:
    fun: the function to run per device; it reduces over `axis_name` what must be global.
    axis_name: the data-parallel mesh axis (or a tuple of axes) the batch is sharded over.
    batch_argnums: the positional arguments split over the devices (every array leaf along its
      batch axis); all other array arguments are passed whole to every device. Arguments
      sharded over `axis_name` that are not batch arguments (FSDP parameters) are gathered
      once, on entry.
    batch_argnames: keyword arguments split over the devices, like `batch_argnums`.
    batch_axes: the batch axis: one int for every batch argument, or one per argument in the
      order ``batch_argnums + batch_argnames`` (as `microbatch` takes them).
    mesh: the mesh; default the one in effect (``jax.set_mesh``).
    varying: what to do with an output that differs per device and is not an
      `AccumulateState`'s sums: "error" (default), or "concat" to join the devices' values
      along its leading axis (per-example outputs).
    sync: "update" (default): bind the axis over the devices, one reduction per update, and
      arguments sharded over the axis are gathered (a full-size accumulator per device).
      "microbatch": bind it as a trivial axis of size 1 (its collectives are the identity) and
      leave the whole mesh to GSPMD, which reduces each micro-batch's gradient (for parameters
      sharded over the axis: a reduce-scatter into an accumulator sharded like them).

  Returns:
    A function with `fun`'s signature, to be called (typically under `jax.jit`) with global
    arrays.

  Raises:
    ValueError: at call time, with no mesh in effect, a mesh without `axis_name`, a batch that
      does not divide over the devices, or an output that differs per device (see `varying`).

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> def mean_of_squares(w, x):  # per device, then global: ONE all-reduce
  ...   return jax.lax.pmean(jnp.mean((x @ w) ** 2), "data")
  >>> f = jax.jit(optax_accum.data_parallel(mean_of_squares, "data", batch_argnums=1, mesh=mesh))
  >>> x = jnp.arange(8.0 * jax.device_count()).reshape(-1, 2)
  >>> bool(jnp.allclose(f(jnp.ones(2), x), jnp.mean((x @ jnp.ones(2)) ** 2)))
  True
  """
  return bind(
    fun,
    axis_name,
    batch_argnums=batch_argnums,
    batch_argnames=batch_argnames,
    batch_axes=batch_axes,
    mesh=mesh,
    varying=varying,
    sync=sync,
    caller="data_parallel",
  )


def bind(
  fun: Callable[..., Any],
  axis_name: AxisName,
  *,
  batch_argnums: int | Sequence[int] = (),
  batch_argnames: str | Sequence[str] = (),
  batch_axes: int | Sequence[int] = 0,
  mesh: Any = None,
  varying: Varying = "error",
  sync: Sync = "update",
  caller: str,
) -> Callable[..., Any]:
  """`data_parallel`, naming `caller` (the front end) in its errors: the one seam through which
  ``microbatch(axis_name=...)`` and ``TrainStep(axis_name=...)`` bind the axis under plain jit."""
  if not callable(fun):
    raise TypeError(f"{caller}: fun must be callable, got {fun!r}.")
  axes = _collectives.axis_names(axis_name)
  if not axes or not all(isinstance(a, str) for a in axes):
    raise TypeError(f"{caller}: axis_name must be a mesh axis name or a tuple of them, got "
                    f"{axis_name!r}.")  # fmt: skip
  if varying not in VARYINGS:
    raise ValueError(f"{caller}: varying must be one of {VARYINGS}, got {varying!r}.")
  if sync not in SYNCS:
    raise ValueError(f"{caller}: sync must be one of {SYNCS}, got {sync!r}.")
  batch = _canonical_batch(batch_argnums, batch_argnames, batch_axes, caller)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    if _collectives.is_bound(axis_name):
      return fun(*args, **kwargs)
    if sync == "microbatch":
      return _bind_trivial(fun, axes, caller, args, kwargs)
    found = find_mesh(axis_name, mesh, caller)
    return _bind_manual(fun, found, axes, batch, varying, caller, args, kwargs)

  return wrapped
