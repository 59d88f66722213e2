"""Batch arguments: where the batch sits, its size, and how it splits into micro-batches.

The batch arguments are positional (`batch_argnums`) or keyword (`batch_argnames`) arguments,
each a pytree whose leaves share one batch axis (`batch_axes`, per argument, in the order
``batch_argnums + batch_argnames``). Which rows go into micro-batch ``i`` (batch size
``B = k·b``, batch axis ``a``):

* ``split="strided"`` (default): rows ``i, i+k, i+2k, …`` — axis ``a`` reshaped to ``(b, k)``,
  micro-batch ``i`` read at index ``i`` of the second. Each micro-batch's batch axis is a slice
  of the full batch's, so a batch sharded over devices stays sharded the same way (no reshard
  inside the loop).
* ``split="contiguous"``: rows ``i·b, …, (i+1)·b - 1`` — axis ``a`` reshaped to ``(k, b)``.

Both reshapes are free (no copy); micro-batch ``i`` is read in place inside the loop.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec

from optax_accum.core._typing import ArgNums, Split


class Positions(NamedTuple):
  """Where the batch, the PRNG keys and the threaded state sit among a call's arguments."""

  batch: tuple[int, ...]  # positional batch arguments, in the order given
  names: tuple[str, ...]  # keyword batch arguments, in the order given
  axes: tuple[int, ...]  # the batch axis of each entry of batch + names
  rngs: tuple[int, ...]  # positional PRNG-key arguments (one fresh key per micro-batch)
  states: tuple[int, ...]  # positional arguments threaded through the micro-batches
  single_state: bool  # state_argnums was one int: `state_out` returns one state, not a tuple
  caller: str = "microbatch"  # the front end, named in every error

  def batch_trees(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The batch arguments of a call, in the order of `axes`."""
    return [args[j] for j in self.batch] + [kwargs[n] for n in self.names]

  def describe(self) -> list[str]:
    """How errors name each batch argument, in the order of `axes`."""
    return [f"argument {j}" for j in self.batch] + [f"keyword argument {n}" for n in self.names]

  def axis_of(self) -> dict[int | str, int]:
    """{position or keyword: its batch axis} for every batch argument."""
    return dict(zip(self.batch + self.names, self.axes, strict=True))


def check_argnums(name: str, argnums: Any, caller: str = "microbatch") -> tuple[int, ...]:
  """`argnums` (an int or a sequence of ints, no repeats; no bools) as a tuple of ints."""
  items = (argnums,) if isinstance(argnums, int | np.integer) else argnums
  try:
    items = tuple(items)
  except TypeError:
    items = (argnums,)
  bad = [a for a in items if isinstance(a, bool) or not isinstance(a, int | np.integer)]
  if bad:
    raise TypeError(f"{caller}: {name} must be an int or a sequence of ints, got {argnums!r}.")
  items = tuple(operator.index(a) for a in items)
  if len(set(items)) != len(items):
    raise ValueError(f"{caller}: {name} has repeated positions: {argnums!r}.")
  return items


def check_argnames(argnames: Any, caller: str = "microbatch") -> tuple[str, ...]:
  """`batch_argnames` (a str or a sequence of str, no repeats) as a tuple of str."""
  items = (argnames,) if isinstance(argnames, str) else argnames
  try:
    items = tuple(items)
  except TypeError:
    items = (argnames,)
  if not all(isinstance(a, str) for a in items):
    raise TypeError(
      f"{caller}: batch_argnames must be a str or a sequence of str, got {argnames!r}."
    )
  if len(set(items)) != len(items):
    raise ValueError(f"{caller}: batch_argnames has repeated names: {argnames!r}.")
  return items


def _check_axes(batch_axes: Any, count: int, caller: str) -> tuple[int, ...]:
  if isinstance(batch_axes, int | np.integer) and not isinstance(batch_axes, bool):
    return (operator.index(batch_axes),) * count
  try:
    axes = tuple(batch_axes)
  except TypeError:
    axes = (batch_axes,)
  if any(isinstance(a, bool) or not isinstance(a, int | np.integer) for a in axes):
    raise TypeError(
      f"{caller}: batch_axes must be an int or a sequence of ints, got {batch_axes!r}."
    )
  if len(axes) != count:
    raise ValueError(
      f"{caller}: batch_axes has {len(axes)} entries, {batch_axes!r}, but there are {count} "
      "batch arguments (batch_argnums + batch_argnames): give one axis per batch argument, in "
      "that order, or one int for all."
    )
  return tuple(operator.index(a) for a in axes)


def positions(
  batch_argnums: ArgNums | None,
  batch_argnames: str | Sequence[str],
  batch_axes: int | Sequence[int],
  rng_argnums: ArgNums = (),
  state_argnums: ArgNums = (),
  *,
  caller: str = "microbatch",
  need_batch: bool = True,
) -> Positions:
  """The checked positions, as given (negative ones count from the end of the call's arguments).

  The one parser of batch positions: `microbatch`, `data_parallel` (and the binder under
  `microbatch`/`TrainStep`) and `plan_microbatches` all read a call's batch through it, and
  every error names `caller`. `batch_argnums=None` means argument 1, or none when
  `batch_argnames` names some. `need_batch`: at least one batch argument must be named.
  """
  names = check_argnames(batch_argnames, caller)
  if batch_argnums is None:
    batch_argnums = () if names else 1
  batch = check_argnums("batch_argnums", batch_argnums, caller)
  if need_batch and not batch and not names:
    raise ValueError(
      f"{caller}: name at least one batch argument, with batch_argnums (positions) or "
      "batch_argnames (keywords); got batch_argnums=() and batch_argnames=()."
    )
  return Positions(
    batch,
    names,
    _check_axes(batch_axes, len(batch) + len(names), caller),
    check_argnums("rng_argnums", rng_argnums, caller),
    check_argnums("state_argnums", state_argnums, caller),
    isinstance(state_argnums, int | np.integer),
    caller,
  )


def _resolve_argnums(
  name: str, argnums: tuple[int, ...], nargs: int, caller: str
) -> tuple[int, ...]:
  out = []
  for a in argnums:
    if not -nargs <= a < nargs:
      raise ValueError(
        f"{caller}: {name} contains {a}, but the function was called with {nargs} positional "
        f"argument{'s' if nargs != 1 else ''} (valid positions: 0..{nargs - 1}, or negative)."
      )
    out.append(a % nargs)
  return tuple(out)


def _check_names(names: tuple[str, ...], kwargs: dict[str, Any], caller: str) -> None:
  missing = [n for n in names if n not in kwargs]
  if missing:
    given = ", ".join(repr(k) for k in kwargs) or "none"
    raise ValueError(
      f"{caller}: batch_argnames names {missing[0]!r}, but the function was called without a "
      f"keyword argument {missing[0]!r} (keywords given: {given}). Pass it by keyword "
      f"({missing[0]}=...), or name its position in batch_argnums instead."
    )


def resolve(pos: Positions, nargs: int, kwargs: dict[str, Any]) -> Positions:
  """`pos` for a call with `nargs` positional arguments and `kwargs`: present, in range, disjoint.

  The positions become non-negative; their order (which `axes` follows) is kept.
  """
  caller = pos.caller
  batch = _resolve_argnums("batch_argnums", pos.batch, nargs, caller)
  if len(set(batch)) != len(batch):
    raise ValueError(f"{caller}: batch_argnums {pos.batch} name the same argument twice.")
  _check_names(pos.names, kwargs, caller)
  rngs = _resolve_argnums("rng_argnums", pos.rngs, nargs, caller)
  states = _resolve_argnums("state_argnums", pos.states, nargs, caller)
  for name, other in (("rng_argnums", rngs), ("state_argnums", states)):
    both = sorted(set(batch) & set(other))
    if both:
      raise ValueError(f"{caller}: argument {both[0]} is in both batch_argnums and {name}.")
  if set(rngs) & set(states):
    raise ValueError(f"{caller}: an argument is in both rng_argnums and state_argnums.")
  return pos._replace(batch=batch, rngs=rngs, states=states)


def _leaf_sizes(pos: Positions, trees: list[Any]) -> list[tuple[str, int | None, int]]:
  """(description, size along the batch axis or None for a scalar, axis) for every leaf."""
  sizes = []
  for what, tree, axis in zip(pos.describe(), trees, pos.axes, strict=True):
    leaves = jax.tree.leaves_with_path(tree)
    if not leaves:
      raise ValueError(f"{pos.caller}: batch {what} holds no arrays (got {tree!r}).")
    for path, x in leaves:
      shape, where = jnp.shape(x), f"{what}{jax.tree_util.keystr(path)}"
      if shape and not -len(shape) <= axis < len(shape):
        raise ValueError(
          f"{pos.caller}: batch_axes gives axis {axis} for {where}, which has shape {shape}: no "
          "such axis."
        )
      sizes.append((where, shape[axis] if shape else None, axis))
  return sizes


def batch_size(pos: Positions, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
  """The common size of every batch leaf along its batch axis."""
  sizes = _leaf_sizes(pos, pos.batch_trees(args, kwargs))
  scalars = [d for d, s, _ in sizes if s is None]
  if scalars:
    raise ValueError(
      f"{pos.caller}: every leaf of a batch argument needs a batch axis; these are scalars: "
      + ", ".join(scalars)
      + ". Maybe they belong in a non-batch argument (see batch_argnums, batch_argnames)."
    )
  if len({s for _, s, _ in sizes}) > 1:
    listing = "\n".join(f"  {d}: {s} (axis {a})" for d, s, a in sizes)
    raise ValueError(
      f"{pos.caller}: the batch arguments disagree on the batch size (along batch_axes):\n{listing}"
    )
  return sizes[0][1]


def num_microbatches(
  pos: Positions, args: Sequence[Any], kwargs: dict[str, Any], k: int | None, size: int | None
) -> tuple[int, int]:
  """``(B, k)``: the batch size, and ``k`` (given, or ``B / microbatch_size``), which divides it."""
  total = batch_size(pos, args, kwargs)
  parts = k if k is not None else total // size
  if not parts or total % parts or (k is None and total % size):
    where, _, axis = _leaf_sizes(pos, pos.batch_trees(args, kwargs))[0]
    along = f"leading size {total}" if axis == 0 else f"size {total} along axis {axis}"
    given = f"num_microbatches={k}" if k is not None else f"microbatch_size={size}"
    raise ValueError(
      f"microbatch: batch {where} has {along}, which is not divisible by {given}. "
      f"Choose among the divisors of {total}, or pad the batch (and give padding zero weight "
      "with weight_fn, or leave whole padding micro-batches out with num_real_microbatches)."
    )
  return total, parts


def check_keys(args: Sequence[Any], rngs: tuple[int, ...]) -> None:
  """Raises unless every leaf of the `rngs` arguments is one PRNG key (typed or raw)."""
  for i in rngs:
    for path, x in jax.tree.leaves_with_path(args[i]):
      dtype, shape = jnp.result_type(x), jnp.shape(x)
      typed = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
      raw = dtype == jnp.uint32 and len(shape) == 1
      if not (typed or raw):
        raise TypeError(
          f"microbatch: rng_argnums names argument {i}, but {jax.tree_util.keystr(path) or 'it'}"
          f" is not a single PRNG key (jax.random.key(...) or jax.random.PRNGKey(...)): got "
          f"{dtype}{list(shape)}."
        )


def _axis(split: Split, axis: int) -> int:
  """The axis of a `split_batch` array that numbers the micro-batches."""
  return axis + 1 if split == "strided" else axis


def split_batch(x: jax.Array, k: int, split: Split, axis: int = 0) -> jax.Array:
  """Axis ``B`` -> ``(b, k)`` (strided) or ``(k, b)`` (contiguous) in place: a free reshape.

  No transpose: micro-batch ``i`` is read inside the loop with `take` (a strided read for
  "strided"), so the full batch is never copied into another layout.
  """
  axis %= x.ndim
  b = x.shape[axis] // k
  inner = (b, k) if split == "strided" else (k, b)
  shape = (*x.shape[:axis], *inner, *x.shape[axis + 1 :])
  spec = explicit_spec(x)
  if spec is None or split == "strided":
    return x.reshape(shape)
  # Contiguous blocks of a batch sharded over an Explicit axis: the sharding moves to the
  # block's rows (a reshard; the strided split is the one that keeps it for free).
  return jnp.reshape(x, shape, out_sharding=PartitionSpec(*spec[:axis], None, *spec[axis:]))


def take(x: jax.Array, i: jax.Array, split: Split, axis: int = 0) -> jax.Array:
  """Micro-batch ``i`` of a `split_batch` array: rows ``i, i+k, …`` or ``i·b, …, (i+1)·b - 1``.

  `axis` is the batch axis of the unsplit array (negative counts from its end).
  """
  axis %= x.ndim - 1
  return lax.dynamic_index_in_dim(x, i, axis=_axis(split, axis), keepdims=False)


def interleave(x: jax.Array, k: int, axis: int = 0) -> jax.Array:
  """Rows ``i·b + j`` moved to ``j·k + i`` (``b = B/k``): the strided split of the result is the
  contiguous split of `x`, row for row. ``interleave(y, B // k)`` undoes it.

  This is how a contiguous split survives a batch sharded over devices in blocks: each device's
  strided micro-batch ``i`` is then its piece of the global contiguous micro-batch ``i``. A
  transpose: under a sharded batch, rows move between devices once.
  """
  axis %= x.ndim
  b = x.shape[axis] // k
  shape = (*x.shape[:axis], k, b, *x.shape[axis + 1 :])
  spec = explicit_spec(x)
  if spec is None:
    return jnp.swapaxes(jnp.reshape(x, shape), axis, axis + 1).reshape(x.shape)
  # Explicit sharding: the batch axis's devices go to the rows within each block (the rows
  # move between devices here), so that the interleaved batch is sharded as `x` was. Where the
  # blocks have fewer rows than devices (k·devices > B, e.g. undoing the interleave of rows
  # with B/k blocks), they go to the blocks instead, or, if neither divides, nowhere.
  entry, n = spec[axis], _entry_size(x, spec[axis])
  inner = (None, entry) if b % n == 0 else (entry, None) if k % n == 0 else (None, None)
  blocks = jnp.reshape(
    x, shape, out_sharding=PartitionSpec(*spec[:axis], *inner, *spec[axis + 1 :])
  )
  return jnp.reshape(jnp.swapaxes(blocks, axis, axis + 1), x.shape, out_sharding=spec)


def _entry_size(x: jax.Array, entry: Any) -> int:
  """How many devices the spec entry `entry` splits an axis of `x` over (1 for None)."""
  if entry is None:
    return 1
  mesh = jax.typeof(x).sharding.mesh
  return int(np.prod([mesh.shape[a] for a in (entry if isinstance(entry, tuple) else (entry,))]))


def zeros_split(like: Any, k: int, split: Split) -> jax.Array:
  """Zeros for ``k`` micro-batches' values of shape ``like.shape``, laid out as `split_batch`."""
  shape = tuple(like.shape)
  shape = (*shape[:1], k, *shape[1:]) if split == "strided" else (k, *shape)
  return jnp.zeros(shape, like.dtype)


def put(buffer: jax.Array, y: jax.Array, i: jax.Array, split: Split) -> jax.Array:
  """Writes micro-batch ``i``'s rows `y` into a `zeros_split` `buffer` (in place)."""
  return lax.dynamic_update_index_in_dim(buffer, y.astype(buffer.dtype), i, _axis(split, 0))


def unsplit(y: jax.Array) -> jax.Array:
  """The inverse of `split_batch` on axis 0: ``(b, k, ...)`` or ``(k, b, ...)`` -> ``(k·b, ...)``.

  Free (a reshape). A stack of scalars, ``(k,)``, stays as it is. Under Explicit sharding the
  joined axis keeps the first axis's sharding when the second is unsharded (the strided
  per-example case: the batch's sharding), and is replicated otherwise.
  """
  if y.ndim < 2:
    return y
  shape = (y.shape[0] * y.shape[1], *y.shape[2:])
  spec = explicit_spec(y)
  if spec is None:
    return y.reshape(shape)
  joined = spec[0] if spec[1] is None else None
  return jnp.reshape(y, shape, out_sharding=PartitionSpec(joined, *spec[2:]))


def explicit_spec(x: Any) -> PartitionSpec | None:
  """`x`'s partition spec (one entry per axis) when it shards over an Explicit mesh axis.

  `x` is an array (its type's sharding) or a `jax.ShapeDtypeStruct` (its `sharding`); None when
  no Explicit axis shards it, e.g. on a mesh of Auto axes or no mesh at all.
  """
  sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
  if not isinstance(x, jax.ShapeDtypeStruct):
    sharding = getattr(jax.typeof(x), "sharding", None)
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None:
    return None
  explicit = {
    n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
  }
  if not {a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))} & explicit:
    return None
  return PartitionSpec(*spec, *[None] * (len(np.shape(x)) - len(spec)))


# ----------------------------------------------------------------------------------------------
# Non-array leaves (Equinox modules' functions and static fields) pass through unchanged.


class Static:
  """A non-array leaf hidden from JAX: a pytree node with no children, the value its aux data.

  What `eqx.filter_jit` does with such leaves: arrays are traced, everything else (activation
  functions, Python numbers, strings) is held as it is. Wrapped, they ride through
  `jax.eval_shape`, a loop carry and `shard_map` as part of the tree's structure. Compared by
  identity (functions and arbitrary objects need not be hashable or comparable).
  """

  __slots__ = ("value",)

  def __init__(self, value: Any):
    self.value = value

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, Static) and other.value is self.value

  def __hash__(self) -> int:
    return id(self.value)

  def __repr__(self) -> str:
    return f"Static({self.value!r})"


jax.tree_util.register_pytree_node(Static, lambda s: ((), s.value), lambda v, _: Static(v))


def is_array(x: Any) -> bool:
  """A leaf that travels as an array (JAX and NumPy arrays, as `eqx.is_array` says)."""
  return isinstance(x, jax.Array | np.ndarray | np.generic)


def hide_static(tree: Any) -> Any:
  """`tree` with every non-array leaf wrapped in `Static` (see `show_static`)."""
  return jax.tree.map(lambda x: x if is_array(x) else Static(x), tree)


def show_static(tree: Any) -> Any:
  """The inverse of `hide_static`."""
  return jax.tree.map(
    lambda x: x.value if isinstance(x, Static) else x, tree, is_leaf=lambda x: isinstance(x, Static)
  )


def none_for_static(tree: Any) -> Any:
  """`hide_static`'s tree with each `Static` node replaced by None: the arrays-only tree, as
  ``eqx.filter(tree, eqx.is_array)`` spells it (what an optimizer state is shaped like)."""
  return jax.tree.map(
    lambda x: None if isinstance(x, Static) else x, tree, is_leaf=lambda x: isinstance(x, Static)
  )


def restore_static(arrays: Any, hidden: Any) -> Any:
  """The inverse of `none_for_static`: `hidden`'s `Static` nodes back where `arrays` has None."""
  return jax.tree.map(
    lambda h, a: h if isinstance(h, Static) else a,
    hidden,
    arrays,
    is_leaf=lambda x: isinstance(x, Static),
  )
