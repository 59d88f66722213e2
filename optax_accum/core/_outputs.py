"""`microbatch`'s output plan: what becomes of each leaf of `fun`'s output.

Decided once per call, at trace time, from one abstract evaluation of micro-batch 0:

* each leaf's reduction (`reduction` is a pytree prefix of the output): "mean", "sum",
  "concat" (per-example rows, joined in batch order), "stack" (one entry per micro-batch, on a
  new leading axis) or "last"; nothing is guessed from shapes: a "concat" leaf must have one row
  per example of the micro-batch, else the request is an error;
* which leaves are the threaded state's new value (`state_out`) and which are the gradient whose
  noise scale is measured (`noise_scale`): both *select* leaves of the output, found by applying
  the selector to integer markers of the leaf positions (never by identity or by shape).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.core._typing import OUT_REDUCTIONS

_HINTS = {
  "avg": "mean",
  "average": "mean",
  "concatenate": "concat",
  "cat": "concat",
  "stacked": "stack",
  "final": "last",
  "total": "sum",
}

STATE_OUT_NOT_SELECTION = (
  "microbatch: {name} must *select* {what_for} out of fun's output (indexing, attribute "
  "access), so that those output leaves are known by position. Applied to fun's output "
  "with every leaf replaced by an integer marker of its position, it {what}. Return the "
  "output's own leaves, e.g. `{name}=lambda out: out[0][1]`, not a value computed from them."
)

CONCAT_ROWS = (
  "microbatch: output{path} has reduction 'concat' (per-example rows, joined in batch order), "
  "so it needs one row per example of the micro-batch: a leading size of {b}{split_note}, but "
  "it has shape {shape}. For one entry per micro-batch (a scalar, a summary) use 'stack': a new "
  "leading axis of length k, in micro-batch order.{unnamed}"
)


class Plan(NamedTuple):
  """What becomes of each leaf of `fun`'s output."""

  tree: Any  # the PyTreeDef of fun's output
  like: tuple[jax.ShapeDtypeStruct, ...]  # one micro-batch's value, per leaf
  kinds: tuple[str, ...]  # per leaf: "mean", "sum", "concat", "stack", "last" or "state"
  state: tuple[tuple[int, ...], ...]  # per state argument: the output leaves of its new value
  noise: tuple[int, ...]  # the gradient's leaves (noise_scale), or () for none
  total: jax.ShapeDtypeStruct  # the accumulated weight's type (its device variance)
  # The leaves whose finiteness decides whether a micro-batch is dropped (`skip_nonfinite`);
  # None: every "mean" and "sum" leaf.
  decide: tuple[int, ...] | None = None

  def pick(self, leaves: Any, *kinds: str) -> list[Any]:
    """The entries of `leaves` (one per output leaf) whose leaf is reduced by one of `kinds`."""
    return [x for x, r in zip(leaves, self.kinds, strict=True) if r in kinds]

  def where(self, *kinds: str) -> list[int]:
    """The positions of the output leaves reduced by one of `kinds`."""
    return [n for n, r in enumerate(self.kinds) if r in kinds]


# ----------------------------------------------------------------------------------------------
# Reductions.


def check_reduction(reduction: Any) -> Any:
  """`reduction` (factory time): one of OUT_REDUCTIONS, or a pytree of them."""
  paths = jax.tree.leaves_with_path(reduction)
  bad = [(p, r) for p, r in paths if not (isinstance(r, str) and r in OUT_REDUCTIONS)]
  if not paths or bad:
    lines = []
    for p, r in bad:
      hint = f" Maybe you meant {_HINTS[r]!r}." if isinstance(r, str) and r in _HINTS else ""
      lines.append(f"  reduction{jax.tree_util.keystr(p)} = {r!r}.{hint}")
    raise ValueError(
      f"microbatch: reduction must be one of {OUT_REDUCTIONS} or a pytree prefix of fun's "
      f"output with those strings at its leaves, got {reduction!r}"
      + (":\n" if lines else ".")
      + "\n".join(lines)
    )
  return reduction


def leaf_reductions(reduction: Any, out: Any) -> list[str]:
  """One reduction string per leaf of `out` (reduction is a prefix of out's structure)."""
  if isinstance(reduction, str):
    return [reduction] * len(jax.tree.leaves(out))
  try:
    full = jax.tree.broadcast(reduction, out)
  except ValueError as e:
    raise ValueError(
      "microbatch: reduction is not a pytree prefix of fun's output.\n"
      f"  reduction: {jax.tree.structure(reduction)}\n"
      f"  output:    {jax.tree.structure(out)}\n"
      "Give one string, or a tree with fun's output structure (same container types: a tuple "
      "for a tuple, a dict with the same keys) cut off at any depth."
    ) from e
  return jax.tree.leaves(full)


def check_rows(tree: Any, like: Any, kinds: list[str], b: int, batch: int, note: str) -> None:
  """Every "concat" leaf has one row per example of the micro-batch (leading size `b`).

  `batch`: the whole batch's size; a leaf of that many rows most likely came from an argument
  holding batch data that was not named a batch argument (`note` says which were).
  """
  paths = [p for p, _ in jax.tree.leaves_with_path(jax.tree.unflatten(tree, like))]
  for path, t, r in zip(paths, like, kinds, strict=True):
    if r != "concat" or (t.shape and t.shape[0] == b):
      continue
    unnamed = ""
    if t.shape and t.shape[0] == batch != b:
      unnamed = (
        f" Its {batch} rows are the whole batch's: an argument holding batch data may be passed "
        f"whole to every micro-batch because it is not named ({note}); name it there."
      )
    raise ValueError(
      CONCAT_ROWS.format(
        path=jax.tree_util.keystr(path),
        b=b,
        split_note="" if b == batch else f" (a batch of {batch} in micro-batches of {b})",
        shape=tuple(t.shape),
        unnamed=unnamed,
      )
    )


# ----------------------------------------------------------------------------------------------
# Selections: `state_out` and `noise_scale` pick output leaves.

# A selector is applied to integer markers ``n * _STRIDE + _OFFSET`` in place of output leaf
# ``n``: a selection keeps a marker as it is, while arithmetic on one (``out[1] * 2``, ``+ 1``)
# lands between markers (the stride is prime, the offset not a multiple of it) and is caught
# instead of silently picking another leaf. Markers stay below 2**31 (they may become int32).
_STRIDE, _OFFSET = 8191, 1009


def _markers(num_leaves: int) -> tuple[int, int]:
  """(stride, offset) of the markers for `num_leaves` leaves (plain positions for huge trees)."""
  return (_STRIDE, _OFFSET) if num_leaves * _STRIDE < 2**31 - _STRIDE else (1, 0)


def _position(x: Any, num_leaves: int) -> int | None:
  """The output leaf whose marker `x` is, or None if `x` is not a marker."""
  if isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer | jax.Array):
    return None
  try:
    m = operator.index(x)
  except TypeError:
    return None
  stride, offset = _markers(num_leaves)
  n, rest = divmod(m - offset, stride)
  return n if rest == 0 and 0 <= n < num_leaves else None


def select(selector: Callable[[Any], Any], tree: Any, name: str, what_for: str) -> Any:
  """``selector(output)`` with each output leaf replaced by its position (an int).

  Raises:
    ValueError: naming `name`, if `selector` raises or returns anything but output leaves.
  """
  num = tree.num_leaves
  stride, offset = _markers(num)
  error = STATE_OUT_NOT_SELECTION.format(name=name, what_for=what_for, what="{what}")
  try:
    with jax.ensure_compile_time_eval():  # so that e.g. stop_gradient(marker) stays concrete
      picked = selector(jax.tree.unflatten(tree, [n * stride + offset for n in range(num)]))
  except Exception as e:
    raise ValueError(error.format(what=f"raised {type(e).__name__}: {e}")) from e
  for path, x in jax.tree.leaves_with_path(picked):
    if _position(x, num) is None:
      what = f"returned {x!r} at {name}(out){jax.tree_util.keystr(path)}, not a marker"
      raise ValueError(error.format(what=what))
  return jax.tree.map(lambda x: _position(x, num), picked)


def state_leaves(state_out, pos, tree, like, state0: tuple) -> tuple[tuple[int, ...], ...]:
  """Which output leaves are each state argument's new value, found by position, not identity.

  `state_out` is applied to `fun`'s output structure with integer markers of the leaf positions
  in place of the leaves, so a selection (``out[0][1]``, even wrapped in `stop_gradient`) says
  exactly which leaves it picked.
  """
  if not pos.states:
    return ()
  picked = select(state_out, tree, "state_out", "the new state")
  picked = (picked,) if pos.single_state else tuple(picked)
  if len(picked) != len(state0):
    raise ValueError(
      f"microbatch: state_out returned {len(picked)} states for state_argnums={pos.states}."
    )
  found = []
  for j, p, s in zip(pos.states, picked, state0, strict=True):
    if jax.tree.structure(p) != jax.tree.structure(s):
      raise ValueError(
        f"microbatch: state_out's new state for argument {j} has another tree than the "
        f"argument:\n  new:      {jax.tree.structure(p)}\n"
        f"  argument: {jax.tree.structure(s)}"
      )
    found.append(tuple(jax.tree.leaves(p)))
  _check_state_shapes(pos.states, [[like[n] for n in f] for f in found], state0)
  return tuple(found)


def _check_state_shapes(states: tuple[int, ...], new: list[list[Any]], state0: tuple) -> None:
  bad = [
    f"  argument {j}{jax.tree_util.keystr(p)}: new {jnp.shape(x)}, argument {jnp.shape(y)}"
    for j, n, s in zip(states, new, state0, strict=True)
    for x, (p, y) in zip(n, jax.tree.leaves_with_path(s), strict=True)
    if jnp.shape(x) != jnp.shape(y)
  ]
  if bad:
    raise ValueError("microbatch: state_out's new state changes shapes:\n" + "\n".join(bad))


def noise_leaves(noise_scale: Any, tree: Any, kinds: list[str]) -> tuple[int, ...]:
  """The output leaves of the gradient whose noise scale `noise_scale` asks for; () for None.

  `noise_scale`: an int ``j`` (the output's ``j``-th entry, e.g. 1 for `jax.value_and_grad`'s
  ``(value, grad)``) or a selector ``out -> gradient tree``. The leaves must be "mean" leaves:
  the statistics are those of the weighted mean gradient.
  """
  if noise_scale is None:
    return ()
  selector = noise_scale if callable(noise_scale) else (lambda out: out[noise_scale])
  leaves = tuple(jax.tree.leaves(select(selector, tree, "noise_scale", "the gradient")))
  bad = [f"leaf {n} ({kinds[n]!r})" for n in leaves if kinds[n] != "mean"]
  if not leaves or bad:
    raise ValueError(
      "microbatch: noise_scale must select the gradient among the outputs reduced by 'mean' "
      f"(the noise scale is that of their weighted mean), got {', '.join(bad) or 'no leaves'}."
    )
  return leaves


def deciding_leaves(skip_nonfinite: Any, tree: Any, kinds: list[str]) -> tuple[int, ...] | None:
  """The output leaves whose NaN/Inf drops a micro-batch (`skip_nonfinite` given as an int
  ``j``, the output's ``j``-th entry, or a selector ``out -> outputs``); None for True/False
  (True: every "mean" and "sum" leaf). They must be "mean" or "sum" leaves: a dropped
  micro-batch leaves exactly those sums."""
  if isinstance(skip_nonfinite, bool):
    return None
  selector = skip_nonfinite if callable(skip_nonfinite) else (lambda out: out[skip_nonfinite])
  picked = select(selector, tree, "skip_nonfinite", "the outputs that decide a drop")
  leaves = tuple(jax.tree.leaves(picked))
  bad = [f"leaf {n} ({kinds[n]!r})" for n in leaves if kinds[n] not in ("mean", "sum")]
  if not leaves or bad:
    raise ValueError(
      "microbatch: skip_nonfinite must select outputs reduced by 'mean' or 'sum' (their "
      f"NaN/Inf drops the micro-batch from those sums), got {', '.join(bad) or 'no leaves'}."
    )
  return leaves
