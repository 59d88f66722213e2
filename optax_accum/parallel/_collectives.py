"""Cross-device machinery: axis names, device variance, and the once-per-update reduction.

Inside `jax.shard_map` (with ``check_vma``, the default) every value's type says over which
mapped axes it is *device-varying*. Deferred reduction rests on that type: gradients taken with
respect to device-varying parameters stay local (no collective in autodiff), the accumulator
sums them per device, and one `psum` per update makes the sums global.

The front ends resolve their ``axis_name`` once, with `resolve`, into an `Axis` (a named,
mapped axis) or `NO_AXIS` (none: every method is the identity), and hand that object down:
no piece asks "is there an axis?" again. The module-level functions take a name for callers
that hold one.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum.core import _batch
from optax_accum.core._typing import AxisName, Reduction

AXIS_NOT_BOUND = (
  "axis_name={axis!r} is not bound here. `axis_name` names a mapped axis: a mesh axis of an "
  "enclosing `jax.shard_map` (or `jax.pmap`'s `axis_name=`), or, under plain `jax.jit`, an "
  "axis of the mesh in effect once `optax_accum.data_parallel` binds it. {where}Either call "
  "this inside the mapped function, e.g.\n\n"
  "    @jax.shard_map(mesh=mesh, in_specs=..., out_specs=...)\n"
  "    def train_step(params, opt_state, batch): ...  # tx.update(...) in here\n\n"
  "or, under plain `jax.jit` with a mesh that has an axis {axis!r}, let `data_parallel` bind it "
  "(the other mesh axes stay automatic):\n\n"
  "    jax.set_mesh(jax.make_mesh((jax.device_count(),), ({axis!r},)))\n"
  "    train_step = jax.jit(optax_accum.data_parallel(train_step, {axis!r}, batch_argnums=2))\n\n"
  "or let `optax_accum.TrainStep(loss_fn, inner, every_k, axis_name={axis!r})` (or "
  "`microbatch(..., axis_name={axis!r})`) bind it for you under plain `jax.jit`, or pass "
  "axis_name=None and let XLA reduce every micro-batch's gradient itself."
)

ALREADY_REDUCED = (
  "axis_name={axis!r}: these gradients are already reduced over {axis!r} (their type carries "
  "no varying axis), so autodiff ran an all-reduce on every micro-batch. That happens when "
  "`jax.grad` differentiates with respect to a *replicated* parameter inside `shard_map`. "
  "optax_accum will not reduce them again: the update uses the window's weighted mean of these "
  "gradients as autodiff returned them (the same on every device), so it is the large-batch "
  "one only if your loss is the global one (e.g. `jax.lax.pmean` of the device losses; the "
  "gradient of a device-local mean loss is the SUM over devices of the local gradients), and "
  "the point of deferring the reduction is lost. To keep gradients local until the update, "
  "differentiate the device-local loss with respect to device-varying parameters:\n\n"
  "    local = jax.lax.pcast(params, {axis!r}, to='varying')\n"
  "    grads = jax.grad(loss)(local, batch)   # no collective here\n"
  "    updates, state = tx.update(grads, state, params, weight=n_tokens)\n"
)


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
  """`axis_name` (one name, or a tuple of names for several mesh axes) as a tuple."""
  return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def is_bound(axis_name: AxisName) -> bool:
  """True when every name in `axis_name` is bound by an enclosing map (shard_map, pmap, vmap)."""
  try:
    lax.axis_index(axis_name)
  except NameError:
    return False
  return True


def _mesh_in_effect() -> str:
  """Where the mesh in effect stands, for AXIS_NOT_BOUND."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return "No mesh is in effect (`jax.set_mesh`). "
  return f"The mesh in effect has axes {tuple(mesh.axis_names)}. "


def vma(x: Any) -> frozenset:
  """The mapped axes over which `x` is device-varying (empty outside shard_map or untracked)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    # Read the struct's own field: inside a shard_map that is manual over some axes of a mesh
    # with Auto axes, `eval_shape` returns structs without a sharding, which `jax.typeof`
    # rejects (an AssertionError in jax 0.10.2).
    return frozenset(getattr(getattr(x, "manual_axis_type", None), "varying", None) or ())
  t = jax.typeof(x)
  v = getattr(t, "vma", None)  # the jax < 0.9 spelling
  if v is None:
    v = getattr(getattr(t, "manual_axis_type", None), "varying", None)
  return frozenset(v or ())


def tracks_variance(axis_name: AxisName) -> bool:
  """True when the enclosing map tracks device variance (shard_map with check_vma).

  Raises:
    ValueError: `AXIS_NOT_BOUND`, if no enclosing map binds `axis_name`.
  """
  resolve(axis_name).check_bound("optax_accum")
  return all(a in vma(lax.axis_index(axis_name)) for a in axis_names(axis_name))


def is_varying(x: Any, axis_name: AxisName) -> bool:
  return all(a in vma(x) for a in axis_names(axis_name))


def already_reduced(leaves: list[Any], axis_name: AxisName) -> bool:
  """Whether autodiff already reduced these values over the bound `axis_name`: the map tracks
  device variance and one of them carries no varying axis of it (it is the same on every
  device: `ALREADY_REDUCED`). False without variance tracking, where nothing can tell. The one
  test for `accumulate`'s and `microbatch`'s noise statistics and for `microbatch`'s "sum"
  outputs, which must then count such values once, not once per device."""
  return (
    bool(leaves)
    and tracks_variance(axis_name)
    and not all(is_varying(x, axis_name) for x in leaves)
  )


def _pcast(x: Any, axes: frozenset | tuple) -> Any:
  missing = tuple(sorted(a for a in axes if a not in vma(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def match_variance(tree: Any, like: Any) -> Any:
  """Casts each leaf of `tree` to (at least) the device-variance of its leaf in `like`.

  A `lax.scan` carry must keep its type: an initial value built from constants is invariant,
  while what the loop writes into it varies wherever the micro-batch values do.
  """
  return jax.tree.map(lambda x, t: _pcast(x, vma(t)), tree, like)


# ----------------------------------------------------------------------------------------------
# One value across the model axes.
#
# Inside a `shard_map` over (data, model) with tensor-parallel parameters, a micro-batch's
# gradient leaves vary over "model" too: each model shard holds its own slice. Everything a
# micro-batch decides as a whole — whether it is dropped (its finite check), its weight, its
# noise partials — is then computed per model shard, and must be made ONE value across the
# non-data axes (else a NaN in one shard drops the micro-batch on that shard only, and the
# state's per-device scalars are not replicated over "model"). These helpers do it with
# scalar collectives over those axes only, never over the data axes (whose reduction waits for
# the update) and never parameter-sized. Under plain `jax.jit`, where the model axes are
# automatic, the values are global already and the helpers are the identity.


def _extra_axes(values: Any, data_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The mapped axes (other than `data_axes`) over which any leaf of `values` varies."""
  found = frozenset().union(*(vma(x) for x in jax.tree.leaves(values)))
  return tuple(sorted(found - set(data_axes)))


def agree(
  keep: jax.Array, weight: jax.Array, data_axes: tuple[str, ...] = ()
) -> tuple[jax.Array, jax.Array]:
  """A micro-batch's keep flag and weight, one value across every mapped axis but `data_axes`.

  The micro-batch is kept only if every shard keeps it (one NaN anywhere drops it everywhere);
  its weight is the largest any shard computed (shards normally agree; a weight computed from
  replicated batch values is already one value). One scalar all-reduce (a `pmax` of
  ``[dropped, weight]``), and none when nothing varies over another axis.
  """
  extra = _extra_axes((keep, weight), data_axes)
  if not extra:
    return keep, weight
  weight = jnp.asarray(weight)
  both = jnp.stack([jnp.logical_not(keep).astype(weight.dtype), weight])
  dropped, weight = lax.pmax(both, extra)
  return dropped == 0, weight


def sum_over_shards(parts: Any, like: Any, data_axes: tuple[str, ...] = ()) -> jax.Array:
  """The sum of per-leaf scalar `parts` (e.g. each gradient leaf's ``|g|²``), whole across the
  model axes: a part whose leaf in `like` varies over an axis other than `data_axes` is one
  shard's piece, summed over those axes; a part of a leaf replicated there counts once.

  Scalars only: one small all-reduce per distinct set of such axes (typically one, or none).
  The helper for the noise statistics' partials (`_noise`), whose ``Σ wᵢ|gᵢ|²`` must not count
  a model shard's slice as the whole gradient.
  """
  groups: dict[tuple[str, ...], list[jax.Array]] = {}
  for p, x in zip(jax.tree.leaves(parts), jax.tree.leaves(like), strict=True):
    groups.setdefault(_extra_axes(x, data_axes), []).append(jnp.asarray(p))
  total = jnp.zeros((), jnp.float32)
  for axes, ps in groups.items():
    s = functools.reduce(jnp.add, ps)
    total = total + (lax.psum(s, axes) if axes else s)
  return total


def cond(pred: Any, true_fun: Any, false_fun: Any, *operands: Any) -> Any:
  """`lax.cond` whose branches may differ in device variance: each branch's outputs are cast to
  the variance both have (e.g. zero updates, made from constants, against updates that vary
  over a tensor-parallel "model" axis). The same as `lax.cond` where nothing is mapped."""
  types = [jax.eval_shape(f, *operands) for f in (true_fun, false_fun)]
  joined = jax.tree.map(lambda a, b: _Vma(vma(a) | vma(b)), *types)

  def join(f):
    return lambda *xs: jax.tree.map(lambda x, t: _pcast(x, t.axes), f(*xs), joined)

  return lax.cond(pred, join(true_fun), join(false_fun), *operands)


PER_SHARD_STATE = (
  "{caller}: the inner optimizer's state at {path} varies over {axes} after its update but "
  "did not before: the optimizer computed it from one shard of a parameter sharded over "
  "{axes} (e.g. adafactor's factored moments, which average over a dimension a shard holds "
  "only part of), so each shard would keep its own statistics and the update would not be the "
  "one-device result. Inside `shard_map` an optimizer sees local shards only. Run the update "
  "where the model axes are automatic: under plain `jax.jit` with `optax_accum.data_parallel` "
  "or `TrainStep(..., axis_name=...)` (they bind the data axis and leave the others to GSPMD), "
  "or use an elementwise optimizer (adam, sgd, ...) inside the shard_map."
)


def check_state_variance(new: Any, old: Any, caller: str) -> None:
  """Raises `PER_SHARD_STATE` if a leaf of `new` (an optimizer state after its update) varies
  over a mapped axis its leaf in `old` did not: per-shard statistics no spec can describe.
  The window's gradient is global over the data axes (reduced) and one value across the
  model axes where the parameter is replicated (`agree`), so a correct state never gains
  variance."""
  for (path, x), o in zip(jax.tree.leaves_with_path(new), jax.tree.leaves(old), strict=True):
    gained = vma(x) - vma(o)
    if gained:
      raise ValueError(
        PER_SHARD_STATE.format(
          caller=caller, path=jax.tree_util.keystr(path), axes=tuple(sorted(gained))
        )
      )


def check_init_variance(state: Any, params: Any, data_axes: tuple[str, ...], caller: str) -> None:
  """Raises `PER_SHARD_STATE` if `init` made a state leaf that varies over a mapped axis other
  than `data_axes` without having its parameter's (local) shape: statistics of one shard of a
  sharded parameter (adafactor's factored moments), which no partition spec describes.
  Parameter-shaped leaves (Adam's moments of a tensor-parallel weight) are that shard's piece."""
  shapes = {tuple(p): jnp.shape(x) for p, x in jax.tree.leaves_with_path(params)}
  for path, x in jax.tree.leaves_with_path(state):
    gained = _extra_axes(x, data_axes)
    if not gained:
      continue
    path = tuple(path)
    owner = next((shapes[path[i:]] for i in range(len(path)) if path[i:] in shapes), None)
    if owner != jnp.shape(x):
      raise ValueError(
        PER_SHARD_STATE.format(caller=caller, path=jax.tree_util.keystr(path), axes=gained).replace(
          "after its update but did not before", "when it is made"
        )
      )


class _Vma(NamedTuple):
  axes: frozenset


def keep_sharding(new: Any, old: Any) -> Any:
  """Each leaf of `new` with the Explicit sharding of its leaf in `old`, where they differ.

  A state's type must not drift between calls (it is a `lax.scan` carry, and both branches of
  the conditional that skips the inner update return it): an optimizer may compute a leaf
  sharded otherwise than it was placed (adafactor's factored ``v_col`` of a parameter sharded
  over "model", placed replicated by `state_partition_specs`). Auto and unsharded leaves pass.
  """

  def one(x, o):
    want, now = _batch.explicit_spec(o), _batch.explicit_spec(x)
    if want == now or (want is None and now is None):
      return x
    return jax.sharding.reshard(x, want if want is not None else jax.sharding.PartitionSpec())

  return jax.tree.map(one, new, old)


class Axis(NamedTuple):
  """A data-parallel axis (one mesh axis name or a tuple of them), resolved once per front end.

  Its methods are what accumulation does with the axis: per-device partial sums (a leading
  axis of length 1 inside the map, stacked ``(num_devices, ...)`` outside it), one reduction per
  update, and the checks that keep that reduction right. `NO_AXIS` has the same methods, each
  the identity.
  """

  name: AxisName

  stacks = True  # the window's sums are per device: stacked over the axis outside the map

  @property
  def axes(self) -> tuple[str, ...]:
    """The mesh axis names, as a tuple."""
    return axis_names(self.name)

  def size(self) -> int:
    """The number of devices along the axis (inside the map that binds it)."""
    size = 1
    for a in self.axes:
      size *= lax.axis_size(a)
    return size

  def unbound(self) -> bool:
    """Whether no enclosing map binds the axis (under plain jit, a front end binds it)."""
    return not is_bound(self.name)

  def check_bound(self, caller: str) -> None:
    """Raises `AXIS_NOT_BOUND` (naming `caller`) if no enclosing map binds the axis."""
    if self.unbound():
      raise ValueError(
        f"{caller}: " + AXIS_NOT_BOUND.format(axis=self.name, where=_mesh_in_effect())
      )

  def to_varying(self, tree: Any) -> Any:
    """Marks every JAX-array leaf device-varying over the axis (a no-op where variance is not
    tracked; Python scalars and other static leaves are the same on every device anyway)."""
    if not tracks_variance(self.name):
      return tree
    axes = axis_names(self.name)
    return jax.tree.map(lambda x: _pcast(x, axes) if isinstance(x, jax.Array) else x, tree)

  def per_device(self, tree: Any) -> Any:
    """This device's partial sums as state: a leading axis of length 1, so that outside the map
    they are a stacked ``(num_devices, ...)`` array (see `state_partition_specs`)."""
    return jax.tree.map(lambda a: a[None], self.to_varying(tree))

  def this_device(self, tree: Any) -> Any:
    """The inverse of `per_device`: this device's partial sums."""
    return jax.tree.map(lambda a: a[0], tree)

  def reduce(self, tree: Any) -> Any:
    """Sums every leaf over the axis (one fused all-reduce)."""
    return lax.psum(self.to_varying(tree), self.name)

  def join_rows(self, tree: Any) -> Any:
    """Each leaf's rows from every device, joined along axis 0 in device order and the same on
    every device (a tiled ``all_gather`` whose result no longer varies over the axis): a
    ``psum`` of each device's rows placed in its own block, exact (the others add zeros)."""

    def join(x):
      x = jnp.asarray(x)
      kind, b = x.dtype, x.shape[0]
      x = x.astype(jnp.int32) if kind == jnp.bool_ else x  # psum has no bool
      full = jnp.zeros((b * self.size(), *x.shape[1:]), x.dtype)
      full = lax.dynamic_update_slice_in_dim(full, x, lax.axis_index(self.name) * b, 0)
      return lax.psum(full, self.name).astype(kind)

    return jax.tree.map(join, tree)

  def reduce_leaves(self, tree: Any) -> Any:
    """Sums each leaf over the axis in an all-reduce of its own, which depends on that leaf
    only: XLA's scheduler can start it as soon as the leaf exists (e.g. while the backward
    pass computes the gradients of earlier layers), where one fused all-reduce of the whole
    tree waits for its last leaf."""
    return jax.tree.map(lambda x: lax.psum(self.to_varying(x), self.name), tree)

  def reduce_window(
    self, sums: Any, total: jax.Array, like: Any, reduction: Reduction
  ) -> tuple[Any, jax.Array]:
    """The window's global ``(sums, total)``: ONE all-reduce for both, once per update.

    Leaves whose micro-batch values (`like`) are not device-varying, in a `shard_map` that
    tracks variance, were already all-reduced by autodiff (see `ALREADY_REDUCED`): every device
    added the same values with the same weights (`warn_if_reduced` rejects per-device
    weights), so the global sums and the global weight count them once per device. "mean"
    divides the two and gets the window mean back (no double reduction); "sum" divides them by
    the axis size. They still ride in the one all-reduce: only a collective makes a
    device-varying value invariant again.
    """
    sums, total = self.reduce((sums, total))
    if reduction == "sum" and tracks_variance(self.name):
      size = self.size()

      def undo(s, x):
        if is_varying(x, self.name):
          return s
        return s // size if jnp.issubdtype(s.dtype, jnp.integer) else s / size

      sums = jax.tree.map(undo, sums, like)
    return sums, total

  def warn_if_reduced(self, tree: Any, weight: Any, caller: str, stacklevel: int = 4) -> None:
    """Warns (or raises, when it would be wrong) about gradients autodiff already reduced
    (`stacklevel`: the user's frame, for the warning)."""
    if not tracks_variance(self.name):
      return
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves or all(is_varying(x, self.name) for x in leaves):
      return
    if weight is not None and is_varying(jnp.asarray(weight), self.name):
      raise ValueError(
        f"{caller}: `weight` differs per device but the gradients were already all-reduced, "
        "so the per-device weights cannot be applied. " + ALREADY_REDUCED.format(axis=self.name)
      )
    warnings.warn(f"{caller}: " + ALREADY_REDUCED.format(axis=self.name), stacklevel=stacklevel)

  def agree(self, keep: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`agree` over every mapped axis but this one (see the module-level function)."""
    return agree(keep, weight, self.axes)

  def sum_over_shards(self, parts: Any, like: Any) -> jax.Array:
    """`sum_over_shards` over every mapped axis but this one."""
    return sum_over_shards(parts, like, self.axes)

  def check_uniform(self, x: Any, name: str, caller: str) -> None:
    """Raises if `x` is device-varying: every device must take the same branch (the
    collective)."""
    if isinstance(x, bool | int) or not tracks_variance(self.name):
      return
    if is_varying(x, self.name):
      raise ValueError(
        f"{caller}: {name} differs per device (it is device-varying over {self.name!r}), but "
        "every device must close the window at the same step: the reduction is an all-reduce "
        f"that all devices join. Compute {name} from replicated values, or agree on it first, "
        f"e.g. `{name} = jax.lax.pmax(flag.astype(jnp.int32), {self.name!r}) > 0`."
      )


class NoAxis(NamedTuple):
  """No data-parallel axis: `Axis`'s methods, each the identity (XLA reduces, if anything)."""

  name: None = None

  stacks = False
  axes = ()

  def unbound(self) -> bool:
    return False

  def check_bound(self, caller: str) -> None:
    del caller

  def to_varying(self, tree: Any) -> Any:
    return tree

  per_device = this_device = reduce = to_varying

  def reduce_leaves(self, tree: Any) -> Any:
    return tree

  def reduce_window(
    self, sums: Any, total: jax.Array, like: Any, reduction: Reduction
  ) -> tuple[Any, jax.Array]:
    del like, reduction
    return sums, total

  def warn_if_reduced(self, tree: Any, weight: Any, caller: str, stacklevel: int = 4) -> None:
    del tree, weight, caller, stacklevel

  def agree(self, keep: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`agree` over every mapped axis (inside a `shard_map` with no data axis named)."""
    return agree(keep, weight)

  def sum_over_shards(self, parts: Any, like: Any) -> jax.Array:
    return sum_over_shards(parts, like)

  def check_uniform(self, x: Any, name: str, caller: str) -> None:
    del x, name, caller

  def size(self) -> int:
    return 1


NO_AXIS = NoAxis()


def resolve(axis_name: AxisName | None) -> Axis | NoAxis:
  """The axis object for an ``axis_name`` argument: `NO_AXIS` for None. The one place that
  asks whether there is an axis."""
  return NO_AXIS if axis_name is None else Axis(axis_name)
