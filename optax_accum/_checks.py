"""What users pass in, checked once: clear errors that name the argument and the value.

Factory arguments are checked when `accumulate`, `TrainStep` or `microbatch` is called; values
that arrive with each call (a micro-batch's weight) are checked at trace time where they are
concrete.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._typing import REDUCTIONS, Reduction


def positive_int(value: Any, name: str, caller: str | None = None, *, alternative: str = "") -> int:
  """`value` as a Python int >= 1 (NumPy integers accepted); bools, floats, < 1 raise.

  `alternative` completes the message for arguments that take something else too, e.g.
  " or a callable gradient_step -> k".
  """
  prefix = f"{caller}: " if caller else ""
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(
      f"{prefix}{name} must be a positive int{alternative}, got {value!r} of type "
      f"{type(value).__name__}."
    )
  if value < 1:
    raise ValueError(f"{prefix}{name} must be a positive int, got {value}.")
  return int(value)


def reduction(value: Any) -> Reduction:
  """`accumulate`'s `reduction`: "mean" or "sum"."""
  if value not in REDUCTIONS:
    hint = " Maybe you meant 'mean'." if value in ("avg", "average") else ""
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}.{hint}")
  return value


def accum_dtype(value: Any) -> jnp.dtype | None:
  """The canonical accumulator dtype (None: each leaf's own dtype)."""
  return None if value is None else jnp.dtype(value)


def weight(value: Any, caller: str) -> jax.Array | None:
  """Validates a micro-batch weight: a real, non-negative scalar (checked when concrete)."""
  if value is None:
    return None
  try:
    w = jnp.asarray(value)
  except TypeError as e:
    raise TypeError(f"{caller}: weight must be a non-negative scalar, got {value!r}.") from e
  if w.ndim != 0:
    raise ValueError(
      f"{caller}: weight must be a scalar (e.g. this micro-batch's number of real tokens), "
      f"got an array of shape {w.shape}. Maybe you passed a per-example mask; pass its sum."
    )
  if not (jnp.issubdtype(w.dtype, jnp.number) or w.dtype == jnp.bool_) or jnp.issubdtype(
    w.dtype, jnp.complexfloating
  ):
    raise TypeError(f"{caller}: weight must be a real number, got dtype {w.dtype}.")
  if isinstance(value, int | float | np.number | np.ndarray) and not isinstance(value, bool):
    host = float(np.asarray(value))  # a host value: checkable even under jit
  else:
    try:
      host = float(w)
    except jax.errors.ConcretizationTypeError:
      return w  # traced: checked by the caller's program, not here
  if not (0 <= host < float("inf")):  # also catches nan
    raise ValueError(f"{caller}: weight must be non-negative and finite, got {host}.")
  return w
