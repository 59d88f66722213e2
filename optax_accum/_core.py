"""The accumulation core shared by `accumulate` and `microbatch`.

Everything that decides *what* the accumulated result is lives here, once:

* `zeros` — an accumulator for a pytree, in the accumulator dtype;
* `all_finite` — whether a micro-batch counts (NaN/Inf anywhere drops it);
* `add` — ``sums + w * x`` and ``total + w`` for one micro-batch, the drop applied;
* `reduce`, `reduce_window` — the cross-device sums over an axis name, run once per update;
* `normalise` — ``sums / total`` (guarded) or ``sums``, cast back to the input dtypes.

The two front ends only decide *when* these run (a `lax.cond` on the k-th step, or a
`lax.scan` over the micro-batches).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Reduction = Literal["mean", "sum"]
REDUCTIONS = ("mean", "sum")


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def accum_dtype_for(x, accum_dtype) -> Any:
  """The dtype in which leaf `x` is accumulated.

  Floating leaves use `accum_dtype` (their own dtype when it is None). Integer and bool leaves
  (counts, e.g. "number of correct predictions") are summed exactly in their own dtype
  widened to int32.
  """
  dtype = jnp.result_type(x)
  if jnp.issubdtype(dtype, jnp.inexact):
    return dtype if accum_dtype is None else jnp.dtype(accum_dtype)
  return jnp.promote_types(dtype, jnp.int32)


def zeros(tree: Any, accum_dtype) -> Any:
  """A zero accumulator with `tree`'s structure and shapes, in the accumulator dtype.

  `tree` may hold arrays or `jax.ShapeDtypeStruct`s; `None` leaves and empty subtrees stay
  as they are (they carry no gradient).
  """
  return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), accum_dtype_for(x, accum_dtype)), tree)


def all_finite(tree: Any) -> jax.Array:
  """A boolean scalar: True iff every floating leaf of `tree` is free of NaN and Inf.

  Computed as ``isfinite(Σ (x·2⁻⁶⁴)²)`` in float32: a NaN or ±Inf anywhere makes the sum NaN
  or Inf, and the scale keeps finite values from overflowing (the sum exceeds float32's range
  only if ‖x‖ itself does, > 3.4e38). XLA lowers it to one fused multiply-reduce, without a
  temporary — measured 1.7× a bare accumulation pass on CPU, against 2.8× for
  ``all(isfinite(x))`` (a bool array and chained reduce-windows) and 5.9× for
  ``sum(x * 0) == 0``; ``max(abs(x)) < inf`` would be wrong (XLA:CPU's max drops NaN).
  """
  scale = jnp.float32(2.0**-64)
  squares = [jnp.sum(jnp.square(x.astype(jnp.float32) * scale)) for x in _float_leaves(tree)]
  if not squares:
    return jnp.asarray(True)
  return jnp.isfinite(sum(squares[1:], squares[0]))


def _float_leaves(tree: Any) -> list[Any]:
  return [x for x in jax.tree.leaves(tree) if _is_float(x)]


def add(
  sums: Any,
  total: jax.Array,
  tree: Any,
  weight: jax.Array | None,
  *,
  skip_nonfinite: bool,
  restart: jax.Array | None = None,
) -> tuple[Any, jax.Array, jax.Array]:
  """Adds one micro-batch: ``sums + w * tree`` and ``total + w``.

  Args:
    sums: the accumulator (from `zeros`); its dtypes are kept.
    total: the accumulated weight, a float32 scalar.
    tree: the micro-batch's values (a gradient, or a function's outputs), same structure.
    weight: this micro-batch's non-negative scalar weight; None means 1.
    skip_nonfinite: when True a micro-batch with any NaN/Inf in `tree` adds nothing, neither
      to `sums` nor to `total` (selected away, never multiplied by 0: ``0 * nan`` is nan).
    restart: an optional boolean scalar; where True, `sums` and `total` are treated as zero
      (a new window starts). Resetting lazily here, inside the same elementwise pass, is what
      lets the emitting step leave the donated accumulator alone instead of copying it out
      and writing zeros over it.

  Returns:
    ``(sums, total, dropped)`` where `dropped` is a bool scalar, True iff the micro-batch was
    dropped.
  """
  w = jnp.ones((), total.dtype) if weight is None else jnp.asarray(weight, total.dtype)
  if skip_nonfinite:
    keep = all_finite(tree)
    w = jnp.where(keep, w, jnp.zeros_like(w))
  else:
    keep = jnp.asarray(True)

  if restart is not None:
    total = jnp.where(restart, jnp.zeros_like(total), total)

  def add_leaf(s, x):
    if restart is not None:
      s = jnp.where(restart, jnp.zeros_like(s), s)
    x = x.astype(s.dtype)
    if weight is not None:
      x = x * w.astype(s.dtype)
    if skip_nonfinite:
      x = jnp.where(keep, x, jnp.zeros_like(x))
    return s + x

  sums = jax.tree.map(add_leaf, sums, tree)
  return sums, total + w, jnp.logical_not(keep)


def normalise(sums: Any, total: jax.Array, like: Any, reduction: Reduction) -> Any:
  """``sums / total`` ("mean", zero where `total` is 0) or ``sums`` ("sum"), cast like `like`.

  The division happens once, in the accumulator dtype, then the result is cast to the dtypes of
  `like` (the micro-batch values), so callers never see the accumulator dtype. The mean of an
  integer leaf stays a float (float32): truncating it back to an int would be silently wrong.
  """
  if reduction == "mean":
    safe = jnp.where(total > 0, total, jnp.ones_like(total))

    def div(s):
      if jnp.issubdtype(s.dtype, jnp.inexact):
        return s / safe.astype(s.dtype)
      return s / safe  # integer counts: a float mean

    sums = jax.tree.map(div, sums)

  def cast(s, x):
    dtype = jnp.result_type(x)
    if reduction == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
      return s  # the mean of integer counts is a float: casting back would truncate it
    return s.astype(dtype)

  return jax.tree.map(cast, sums, like)


# ----------------------------------------------------------------------------------------------
# Cross-device reduction.

AXIS_NOT_BOUND = (
  "axis_name={axis!r} is not bound here. `axis_name` names a mapped axis of an enclosing "
  "`jax.shard_map` (its mesh axis) or `jax.pmap` (its `axis_name=`); call this inside the "
  "mapped function, e.g.\n\n"
  "    @jax.shard_map(mesh=mesh, in_specs=..., out_specs=...)\n"
  "    def train_step(params, opt_state, batch): ...  # tx.update(...) in here\n\n"
  "Under plain `jax.jit` with sharded arrays (no mapped axis) pass axis_name=None: XLA inserts "
  "the reduction itself."
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


def check_axis(axis_name: str | tuple[str, ...] | None, where: str) -> None:
  """Raises a clear NameError-like ValueError if `axis_name` is not bound here."""
  if axis_name is None:
    return
  try:
    lax.axis_index(axis_name)
  except NameError as e:
    raise ValueError(f"{where}: " + AXIS_NOT_BOUND.format(axis=axis_name)) from e


def axis_names(axis_name) -> tuple[str, ...]:
  """`axis_name` (one name, or a tuple of names for several mesh axes) as a tuple."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def vma(x) -> frozenset:
  """The mapped axes over which `x` is device-varying (empty outside shard_map or untracked)."""
  t = jax.typeof(x)
  v = getattr(t, "vma", None)  # the jax < 0.9 spelling
  if v is None:
    v = getattr(getattr(t, "manual_axis_type", None), "varying", None)
  return frozenset(v or ())


def tracks_varying(axis_name) -> bool:
  """True when the enclosing map tracks device variance (shard_map with check_vma)."""
  return all(a in vma(lax.axis_index(axis_name)) for a in axis_names(axis_name))


def is_varying(x, axis_name) -> bool:
  return all(a in vma(x) for a in axis_names(axis_name))


def to_varying(tree: Any, axis_name) -> Any:
  """Marks every leaf device-varying over `axis_name` (a no-op where variance isn't tracked)."""
  if axis_name is None or not tracks_varying(axis_name):
    return tree

  def cast(x):
    missing = tuple(a for a in axis_names(axis_name) if a not in vma(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def reduce(tree: Any, axis_name) -> Any:
  """Sums every leaf of `tree` over `axis_name` (one fused all-reduce); identity for None.

  Prefer `reduce_window`: it reduces the weight in the same all-reduce and knows what to do
  with values that autodiff already reduced.
  """
  if axis_name is None:
    return tree
  return lax.psum(to_varying(tree, axis_name), axis_name)


def reduce_window(
  sums: Any, total: jax.Array, like: Any, axis_name, reduction: Reduction
) -> tuple[Any, jax.Array]:
  """The window's global ``(sums, total)``: ONE all-reduce over `axis_name` for both.

  Call it once per update, right before `normalise`; identity when `axis_name` is None.

  Leaves whose micro-batch values (`like`) are not device-varying, in a `shard_map` that tracks
  variance, were already all-reduced by autodiff (see `ALREADY_REDUCED`): every device added
  the same values with the same weights (`warn_if_reduced` rejects per-device weights), so the
  global sums count them once per device, and so does the global weight. "mean" divides the
  two and gets the window mean of those values back, as without `axis_name` (no double
  reduction); "sum" divides them by the axis size. They still ride in the one all-reduce: the
  sums are per-device (device-varying) state, and only a collective makes a device-varying
  value invariant again.
  """
  if axis_name is None:
    return sums, total
  sums, total = reduce((sums, total), axis_name)
  if reduction == "sum" and tracks_varying(axis_name):
    size = 1
    for a in axis_names(axis_name):
      size *= lax.axis_size(a)

    def undo(s, x):
      if is_varying(x, axis_name):
        return s
      return s // size if jnp.issubdtype(s.dtype, jnp.integer) else s / size

    sums = jax.tree.map(undo, sums, like)
  return sums, total


def warn_if_reduced(tree: Any, weight, axis_name, where: str) -> None:
  """Warns (or raises, when it would be wrong) about gradients autodiff already all-reduced."""
  if axis_name is None or not tracks_varying(axis_name):
    return
  leaves = [x for x in jax.tree.leaves(tree) if _is_float(x)]
  if not leaves or all(is_varying(x, axis_name) for x in leaves):
    return
  if weight is not None and is_varying(jnp.asarray(weight), axis_name):
    raise ValueError(
      f"{where}: `weight` differs per device but the gradients were already all-reduced, so "
      "the per-device weights cannot be applied. " + ALREADY_REDUCED.format(axis=axis_name)
    )
  warnings.warn(f"{where}: " + ALREADY_REDUCED.format(axis=axis_name), stacklevel=4)


def check_uniform(x: Any, name: str, axis_name, where: str) -> None:
  """Raises if `x` is device-varying: every device must take the same branch (the collective)."""
  if axis_name is None or isinstance(x, (bool, int)) or not tracks_varying(axis_name):
    return
  if is_varying(x, axis_name):
    raise ValueError(
      f"{where}: {name} differs per device (it is device-varying over {axis_name!r}), but every "
      "device must close the window at the same step: the reduction is an all-reduce that all "
      f"devices join. Compute {name} from replicated values, or agree on it first, e.g. "
      f"`{name} = jax.lax.pmax(flag.astype(jnp.int32), {axis_name!r}) > 0`."
    )


def check_weight(weight: Any, where: str) -> jax.Array | None:
  """Validates a micro-batch weight: a real, non-negative scalar (checked when concrete)."""
  if weight is None:
    return None
  try:
    w = jnp.asarray(weight)
  except TypeError as e:
    raise TypeError(f"{where}: weight must be a non-negative scalar, got {weight!r}.") from e
  if w.ndim != 0:
    raise ValueError(
      f"{where}: weight must be a scalar (e.g. this micro-batch's number of real tokens), "
      f"got an array of shape {w.shape}. Maybe you passed a per-example mask; pass its sum."
    )
  if not (jnp.issubdtype(w.dtype, jnp.number) or w.dtype == jnp.bool_) or jnp.issubdtype(
    w.dtype, jnp.complexfloating
  ):
    raise TypeError(f"{where}: weight must be a real number, got dtype {w.dtype}.")
  if isinstance(weight, (int, float, np.number, np.ndarray)) and not isinstance(weight, bool):
    value = float(np.asarray(weight))  # a host value: checkable even under jit
    if not (0 <= value < float("inf")):
      raise ValueError(f"{where}: weight must be non-negative and finite, got {value}.")
    return w
  try:
    value = float(w)
  except jax.errors.ConcretizationTypeError:
    return w  # traced: checked by the caller's program, not here
  if not (0 <= value < float("inf")):  # also catches nan
    raise ValueError(f"{where}: weight must be non-negative and finite, got {value}.")
  return w
