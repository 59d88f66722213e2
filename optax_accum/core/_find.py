"""Finding one state of a given type inside a nested optimizer state, the one way.

`has_updated`, `noise_scale` and `progress` read a field of a state that a user holds wrapped:
inside an `optax.chain` tuple, an ``nnx.Optimizer``'s ``opt_state`` (whose arrays are nnx
Variables), a Flax ``TrainState``, or an `AccumulateState`'s ``inner_state``. `find` locates
the one state of the wanted type and returns it with its own array fields unwrapped; zero or
several raise, naming the caller.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def unwrap(x: Any) -> Any:
  """A plain array from a leaf that Flax NNX wrapped in a Variable (other leaves as they are)."""
  if x is None or isinstance(x, jax.Array | np.ndarray | tuple | list | dict):
    return x
  if hasattr(x, "get_value"):  # flax.nnx.Variable (its `.value` is deprecated)
    return x.get_value()
  if hasattr(x, "value"):
    return x.value
  leaves = jax.tree.leaves(x)
  return leaves[0] if len(leaves) == 1 else x


def _is_wrapper(x: Any) -> bool:
  return x is not None and not isinstance(x, jax.Array | np.ndarray | tuple | list | dict)


def find(state: Any, kind: type, caller: str, missing: str, skip: tuple[str, ...] = ()) -> Any:
  """The one `kind` (a NamedTuple state class) inside `state`, its fields unwrapped.

  Args:
    state: an optimizer state, or any pytree holding one.
    kind: the NamedTuple class to find (`AccumulateState`, `NoiseState`, `GainState`).
    caller: the public function asking, for the errors.
    missing: the error message when `state` holds none.
    skip: fields of `kind` left as they are (a nested optimizer state, e.g. ``inner_state``).

  Returns:
    The `kind` instance, each field except `skip` with nnx Variables unwrapped to arrays.

  Raises:
    ValueError: `missing` if `state` holds no `kind`; if it holds several, naming how many.

  >>> import jax.numpy as jnp
  >>> from typing import NamedTuple
  >>> from optax_accum.core import _find
  >>> class S(NamedTuple):
  ...   count: jnp.ndarray
  >>> _find.find(({"a": S(jnp.int32(3))}, ()), S, "f", "no S").count
  Array(3, dtype=int32)
  """
  is_kind = lambda x: isinstance(x, kind)  # noqa: E731
  found = [x for x in jax.tree.leaves(state, is_leaf=is_kind) if is_kind(x)]
  if not found:
    raise ValueError(missing)
  if len(found) > 1:
    raise ValueError(
      f"{caller}: expected a state holding exactly one {kind.__name__}, found {len(found)} in "
      f"a {type(state).__name__}; pass the part of the state that holds the one you mean."
    )
  own = {f: getattr(found[0], f) for f in found[0]._fields if f not in skip}
  return found[0]._replace(**jax.tree.map(unwrap, own, is_leaf=_is_wrapper))
