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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum._typing import Split


def check_argnums(name: str, argnums: Any) -> tuple[int, ...]:
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


def resolve(name: str, argnums: tuple[int, ...], nargs: int) -> tuple[int, ...]:
  out = []
  for a in argnums:
    if not -nargs <= a < nargs:
      raise ValueError(
        f"microbatch: {name} contains {a}, but the function was called with {nargs} positional "
        f"argument{'s' if nargs != 1 else ''} (valid positions: 0..{nargs - 1}, or negative)."
      )
    out.append(a % nargs)
  return tuple(out)


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
  return lax.dynamic_index_in_dim(x, i, axis=1 if split == "strided" else 0, keepdims=False)


def unsplit(y: jax.Array, split: Split) -> jax.Array:
  """The inverse of `split_batch`: ``(k, b, ...) -> (k·b, ...)`` in the original example order."""
  if split == "strided":
    y = y.swapaxes(0, 1)
  return y.reshape(y.shape[0] * y.shape[1], *y.shape[2:])
