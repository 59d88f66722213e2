"""Batch arguments: which positions hold the batch, its size, and how it splits into micro-batches.

Which rows go into micro-batch ``i`` (batch size ``B = k·b``):

* ``split="strided"`` (default): rows ``i, i+k, i+2k, …`` — ``x.reshape(b, k, ...)``, axis 1.
  The leading axis of every micro-batch is a slice of the full batch's leading axis, so a batch
  sharded over devices stays sharded the same way (no reshard inside the loop).
* ``split="contiguous"``: rows ``i·b, …, (i+1)·b - 1`` — ``x.reshape(k, b, ...)``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum._typing import ArgNums, Split


class Positions(NamedTuple):
  """Where the batch, the PRNG keys and the threaded state sit among a call's arguments."""

  batch: tuple[int, ...]  # positional batch arguments
  rngs: tuple[int, ...]  # positional PRNG-key arguments (one fresh key per micro-batch)
  states: tuple[int, ...]  # positional arguments threaded through the micro-batches
  single_state: bool  # state_argnums was one int: `state_out` returns one state, not a tuple


def check_argnums(name: str, argnums: Any) -> tuple[int, ...]:
  """`argnums` (an int or a sequence of ints, no repeats) as a tuple of ints."""
  items = (argnums,) if isinstance(argnums, int | np.integer) else argnums
  try:
    items = tuple(items)
  except TypeError:
    items = (argnums,)
  bad = [a for a in items if isinstance(a, bool) or not isinstance(a, int | np.integer)]
  if bad:
    raise TypeError(f"microbatch: {name} must be an int or a sequence of ints, got {argnums!r}.")
  items = tuple(operator.index(a) for a in items)
  if len(set(items)) != len(items):
    raise ValueError(f"microbatch: {name} has repeated positions: {argnums!r}.")
  return items


def positions(batch_argnums: ArgNums, rng_argnums: ArgNums, state_argnums: ArgNums) -> Positions:
  """The checked positions, as given (negative ones count from the end of the call's arguments)."""
  batch = check_argnums("batch_argnums", batch_argnums)
  if not batch:
    raise ValueError("microbatch: batch_argnums must name at least one argument, got ().")
  return Positions(
    batch,
    check_argnums("rng_argnums", rng_argnums),
    check_argnums("state_argnums", state_argnums),
    isinstance(state_argnums, int | np.integer),
  )


def _resolve_argnums(name: str, argnums: tuple[int, ...], nargs: int) -> tuple[int, ...]:
  out = []
  for a in argnums:
    if not -nargs <= a < nargs:
      raise ValueError(
        f"microbatch: {name} contains {a}, but the function was called with {nargs} positional "
        f"argument{'s' if nargs != 1 else ''} (valid positions: 0..{nargs - 1}, or negative)."
      )
    out.append(a % nargs)
  return tuple(out)


def resolve(pos: Positions, nargs: int) -> Positions:
  """`pos` for a call with `nargs` positional arguments: in range, non-negative, disjoint."""
  batch = _resolve_argnums("batch_argnums", pos.batch, nargs)
  rngs = _resolve_argnums("rng_argnums", pos.rngs, nargs)
  states = _resolve_argnums("state_argnums", pos.states, nargs)
  for name, other in (("rng_argnums", rngs), ("state_argnums", states)):
    both = sorted(set(batch) & set(other))
    if both:
      raise ValueError(f"microbatch: argument {both[0]} is in both batch_argnums and {name}.")
  if set(rngs) & set(states):
    raise ValueError("microbatch: an argument is in both rng_argnums and state_argnums.")
  return pos._replace(batch=batch, rngs=rngs, states=states)


def batch_size(args: Sequence[Any], batch: tuple[int, ...], k: int) -> int:
  """The common leading size of every leaf of the batch arguments; checks it divides by k."""
  sizes = []  # (description, leading size or None)
  for i in batch:
    leaves = jax.tree.leaves_with_path(args[i])
    if not leaves:
      raise ValueError(f"microbatch: batch argument {i} holds no arrays (got {args[i]!r}).")
    for path, x in leaves:
      shape = jnp.shape(x)
      sizes.append((f"argument {i}{jax.tree_util.keystr(path)}", shape[0] if shape else None))
  scalars = [d for d, s in sizes if s is None]
  if scalars:
    raise ValueError(
      "microbatch: every leaf of a batch argument needs a leading batch axis; these are "
      "scalars: " + ", ".join(scalars) + ". Maybe they belong in a non-batch argument "
      "(see batch_argnums)."
    )
  distinct = sorted({s for _, s in sizes})
  if len(distinct) > 1:
    listing = "\n".join(f"  {d}: {s}" for d, s in sizes)
    raise ValueError(
      f"microbatch: the batch arguments disagree on the batch size (leading axis):\n{listing}"
    )
  size = distinct[0]
  if size % k:
    where = sizes[0][0]
    raise ValueError(
      f"microbatch: batch {where} has leading size {size}, which is not divisible by "
      f"num_microbatches={k}. Choose k among the divisors of {size}, or pad the batch (and give "
      "padding zero weight with weight_fn)."
    )
  return size


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


def _axis(split: Split) -> int:
  """The axis of a `split_batch` array that numbers the micro-batches."""
  return 1 if split == "strided" else 0


def split_batch(x: jax.Array, k: int, split: Split) -> jax.Array:
  """``(B, ...) -> (b, k, ...)`` (strided) or ``(k, b, ...)`` (contiguous): free reshapes.

  No transpose: micro-batch ``i`` is read inside the loop with `take` (a strided read for
  "strided"), so the full batch is never copied into another layout.
  """
  b = x.shape[0] // k
  if split == "strided":
    return x.reshape(b, k, *x.shape[1:])
  return x.reshape(k, b, *x.shape[1:])


def take(x: jax.Array, i: jax.Array, split: Split) -> jax.Array:
  """Micro-batch ``i`` of a `split_batch` array: rows ``i, i+k, …`` or ``i·b, …, (i+1)·b - 1``."""
  return lax.dynamic_index_in_dim(x, i, axis=_axis(split), keepdims=False)


def zeros_split(like: Any, k: int, split: Split) -> jax.Array:
  """Zeros for ``k`` micro-batches' values of shape ``like.shape``, laid out as `split_batch`."""
  shape = tuple(like.shape)
  shape = (*shape[:1], k, *shape[1:]) if split == "strided" else (k, *shape)
  return jnp.zeros(shape, like.dtype)


def put(buffer: jax.Array, y: jax.Array, i: jax.Array, split: Split) -> jax.Array:
  """Writes micro-batch ``i``'s rows `y` into a `split_batch`-shaped `buffer` (in place)."""
  return lax.dynamic_update_index_in_dim(buffer, y.astype(buffer.dtype), i, axis=_axis(split))


def unsplit(y: jax.Array) -> jax.Array:
  """The inverse of `split_batch`: ``(b, k, ...)`` or ``(k, b, ...)`` -> ``(k·b, ...)``, free.

  A stack of scalars, ``(k,)``, stays as it is.
  """
  if y.ndim < 2:
    return y
  return y.reshape(y.shape[0] * y.shape[1], *y.shape[2:])
