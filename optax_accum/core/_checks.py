"""What users pass in, checked once: clear errors that name the argument and the value.

Factory arguments are checked when `accumulate`, `TrainStep` or `microbatch` is called. Values
that arrive with each call are checked where they can be:

* a host value (a Python or NumPy number) raises, before anything is dispatched, even under
  `jax.jit` (it is a constant there);
* a traced value cannot raise: `valid_weight` gives the scalar predicate with which the front
  ends drop (`accumulate`) or poison (`microbatch`) what it would have spoiled.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.core._typing import REDUCTIONS, Reduction

# The window counters are int32 (a state that is a `lax.scan` carry needs fixed dtypes).
MAX_WINDOW = int(np.iinfo(np.int32).max)

# The dtype of the accumulated weight (`AccumulateState.acc_weight`, microbatch's total).
WEIGHT_DTYPE = np.float32


def positive_int(
  value: Any,
  name: str,
  caller: str | None = None,
  *,
  alternative: str = "",
  maximum: int | None = None,
) -> int:
  """`value` as a Python int in ``[1, maximum]`` (NumPy integers accepted); bools, floats raise.

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
  if maximum is not None and value > maximum:
    raise ValueError(
      f"{prefix}{name} must be at most {maximum} (the int32 step counters' range), got {value}."
    )
  return int(value)


def reduction(value: Any) -> Reduction:
  """`accumulate`'s `reduction`: "mean" or "sum"."""
  if value not in REDUCTIONS:
    hint = " Maybe you meant 'mean'." if value in ("avg", "average") else ""
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}.{hint}")
  return value


def accum_dtype(value: Any, caller: str | None = None) -> jnp.dtype | None:
  """The canonical accumulator dtype: floating or complex (None: each leaf's own dtype)."""
  if value is None:
    return None
  prefix = f"{caller}: " if caller else ""
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise TypeError(f"{prefix}accum_dtype must be a floating dtype, got {value!r}.") from e
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise TypeError(
      f"{prefix}accum_dtype must be a floating (or complex) dtype, got {dtype}: an integer "
      "or bool accumulator would truncate every gradient. Maybe you meant jnp.float32."
    )
  return dtype


def flag(value: Any, name: str, caller: str) -> Any:
  """A Python bool, or a boolean (or integer) scalar array, e.g. `force_emit`."""
  if isinstance(value, bool | np.bool_):
    return bool(value)
  try:
    dtype, shape = (None, None) if value is None else (jnp.result_type(value), jnp.shape(value))
  except TypeError:
    dtype, shape = None, None
  if dtype is None or shape != () or not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(
      f"{caller}: {name} must be a bool or a boolean scalar array, got {value!r}"
      + (f" (dtype {dtype}, shape {shape})." if dtype is not None else ".")
    )
  return value


def host_bool(value: Any, name: str, caller: str) -> bool:
  """A flag the host decides on (TrainStep's `force_emit`): a Python, NumPy or concrete JAX
  boolean scalar, as a Python bool; anything else (an int, an array of another dtype or shape,
  a traced value) raises a TypeError naming `name`, what it got and what it needs."""
  if isinstance(value, bool | np.bool_):
    return bool(value)
  dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
  if isinstance(value, np.ndarray | jax.Array) and dtype == np.bool_ and shape == ():
    if not isinstance(value, jax.core.Tracer):
      return bool(value)
    raise TypeError(
      f"{caller}: {name} must be known on the host (it picks which compiled program runs), got "
      "a traced value: call the step outside jax.jit, or pass a Python bool."
    )
  got = f"{type(value).__name__} {value!r}" if dtype is None else f"{dtype}{list(shape)} array"
  raise TypeError(
    f"{caller}: {name} must be a bool (Python, NumPy or a JAX boolean scalar), got {got}. "
    f"Write {name}=True to close the window now, or {name}=bool(x)."
  )


def weight(value: Any, caller: str, name: str = "weight") -> jax.Array | None:
  """Validates a micro-batch weight: a real scalar; where concrete, non-negative and finite.

  `name` is what the messages call it (e.g. "weight_fn(*args)" for the value a function gave).

  A host value (or any concrete one) must also be representable in float32, the dtype the
  weights are summed in: 1e39 passes a float64 check and overflows to inf there. A traced value
  is returned unchecked: see `valid_weight`.
  """
  if value is None:
    return None
  if isinstance(value, (str, bytes)):  # jnp.asarray would first read a string as a dtype name
    raise TypeError(f"{caller}: {name} must be a non-negative scalar, got {value!r}.")
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)  # float32 overflow: reported below
      w = jnp.asarray(value)
  except TypeError as e:
    raise TypeError(f"{caller}: {name} must be a non-negative scalar, got {value!r}.") from e
  if w.ndim != 0:
    raise ValueError(
      f"{caller}: {name} must be a scalar (e.g. this micro-batch's number of real tokens), "
      f"got an array of shape {w.shape}. Maybe you passed a per-example mask; pass its sum."
    )
  if not (jnp.issubdtype(w.dtype, jnp.number) or w.dtype == jnp.bool_) or jnp.issubdtype(
    w.dtype, jnp.complexfloating
  ):
    raise TypeError(f"{caller}: {name} must be a real number, got dtype {w.dtype}.")
  host = _concrete(value, w)
  if host is None:
    return w  # traced: dropped or poisoned by the caller's program if invalid
  if not (0 <= host < float("inf")):  # also catches nan
    raise ValueError(f"{caller}: {name} must be non-negative and finite, got {host}.")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # the overflow we are testing for
    if not np.isfinite(np.asarray(host, WEIGHT_DTYPE)):
      raise ValueError(
        f"{caller}: {name}={host} is not representable in {np.dtype(WEIGHT_DTYPE).name}, the "
        f"dtype weights are summed in (largest {np.finfo(WEIGHT_DTYPE).max:.4g}). Scale the "
        "weights down: only their ratios matter for a mean."
      )
  return w


def _concrete(value: Any, w: jax.Array) -> float | None:
  """The weight's value where it is known on the host (even under jit), else None."""
  if isinstance(value, int | float | np.number | np.ndarray) and not isinstance(value, bool):
    return float(np.asarray(value))
  try:
    return float(w)
  except jax.errors.ConcretizationTypeError:
    return None


def valid_weight(w: jax.Array) -> jax.Array:
  """A boolean scalar: the (traced) weight is non-negative and finite in float32.

  One scalar comparison: cheap enough to run on every micro-step whatever `skip_nonfinite` says.
  """
  w = jnp.asarray(w).astype(WEIGHT_DTYPE)
  return (w >= 0) & jnp.isfinite(w)


def wraps(fun: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """`functools.wraps` without ``__wrapped__``: the wrapper keeps `fun`'s name, docstring and
  signature (``__signature__``), but not a reference Equinox follows.

  `eqx.filter_jit` (any Equinox module field) warns about a plain function whose
  ``__wrapped__`` chain holds array-like leaves, taking it for a JAX transform that hides
  parameters; ``eqx.filter_value_and_grad(loss, has_aux=True)`` holds ``True``. The wrappers
  of `microbatch` and `data_parallel` hide nothing: they hold `fun` and call it.
  """

  def decorate(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    functools.update_wrapper(wrapper, fun)
    del wrapper.__wrapped__
    with contextlib.suppress(TypeError, ValueError):  # no signature to read (some builtins)
      wrapper.__signature__ = inspect.signature(fun)  # type: ignore[attr-defined]
    return wrapper

  return decorate


# ----------------------------------------------------------------------------------------------
# The private path. The core never imports `optax_accum.privacy`; it recognises a private path
# by a small protocol: a state node or a function that declares itself private, with the
# attribute ``__dp_private__`` set to True, or one defined in the privacy package (its
# `DPNoiseState`, its `ClippedGrad` and `clipped_loss` functions, and what `jax.grad`,
# `jax.value_and_grad`, `functools.wraps` or `functools.partial` make of them). The rows of the
# privacy contract (`optax_accum.privacy.CONTRACT`) name the messages below.

PRIVATE_PACKAGE = "optax_accum.privacy"

_WHY = (
  "on a private path (dp_noise in the inner optimizer, or a clipped_grad/clipped_loss function)"
)

# What each refused option does to the guarantee, and the fix: `refuse_private` formats one into
# the error (``{caller}`` the front end). One key per refused row of the contract.
PRIVATE_REFUSED: dict[str, str] = {
  "window_not_batch": (
    "{caller}: this window reached every_k = {k} micro-batches without force_emit. A "
    "privacy.Mechanism's window is one Poisson batch: pass force_emit=True on each batch's last "
    "micro-batch (i == batch.num_microbatches - 1); every_k is only a cap above any batch. "
    "Closed here, the window would hold micro-batches of two batches in one update (an example "
    "sampled in both counted twice: 2·C), and the accountant would count updates that are not "
    "the sampler's batches. Nothing was run or changed."
  ),
  "reduction_mean": (
    "{caller}: reduction='mean' " + _WHY + " divides the clipped sum by the realised total "
    "weight (the number of micro-batches, which depends on the data: one example more can add a "
    "micro-batch), so one example moves the update by more than C/B and the printed (ε, δ) is "
    "false. Use reduction='sum': dp_noise divides the noised sum by the public expected batch "
    "size B itself."
  ),
  "weight": (
    "{caller}: weight= " + _WHY + " multiplies the clipped sums (and an all-padding window of "
    "weight 0 would skip the noisy update), so one example moves the update by weight·C/B and "
    "the printed (ε, δ) is false. Remove it: padding is the mask's job "
    "(clipped_grad/clipped_loss(..., mask_argnum=...)), and every micro-batch counts 1."
  ),
  "weight_fn": (
    "{caller}: weight_fn " + _WHY + " multiplies the clipped sums by a data-dependent weight "
    "(e.g. a real-example count), so one example moves the update by up to weight·C/B and the "
    "printed (ε, δ) is false. Remove it: padding is the mask's job "
    "(clipped_grad/clipped_loss(..., mask_argnum=...)), and every micro-batch counts 1."
  ),
  "noise_scale": (
    "{caller}: noise_scale " + _WHY + " measures the gradient noise scale from the un-noised "
    "clipped sums and releases it (noise_scale(state), info.noise), which the accountant does "
    "not cover: the printed (ε, δ) would be false. Remove noise_scale (the noise scale of a "
    "private run is a private release of its own)."
  ),
  "follow_noise_scale": (
    "{caller}: every_k=FollowNoiseScale(...) " + _WHY + " chooses each window's length from "
    "the un-noised clipped sums, while dp_noise divides by a fixed B and the accountant assumes "
    "a fixed sampling rate q: the printed (ε, δ) is false. Use a fixed int every_k (the "
    "PoissonSampler decides the batch)."
  ),
  "scale_by_gain": (
    "{caller}: optax_accum.scale_by_gain in the inner optimizer " + _WHY + " scales the noised "
    "update by a gain computed from the un-noised clipped sums (a data-dependent factor the "
    "noise does not cover): the printed (ε, δ) is false. Remove scale_by_gain from the chain."
  ),
  "accum_dtype": (
    "{caller}: accum_dtype={dtype} " + _WHY + " sums the clipped gradients in a dtype narrower "
    "than float32: rounding the running sum moves it by more than one clipped gradient's C, so "
    "the sensitivity the noise is scaled to no longer bounds it. Use accum_dtype=jnp.float32 "
    "(the default)."
  ),
  "rdp_replace_one": (
    "{caller}: neighboring_relation='replace_one' with accountant='rdp': dp-accounting's RDP "
    "accountant has no analysis of Poisson-sampled Gaussian updates under replace-one "
    "adjacency (it refuses the event), so no ε could be printed for it. Use accountant='pld' "
    "(privacy loss distributions analyse it), or neighboring_relation='add_or_remove_one'."
  ),
  "rescaled_clip": (
    "{caller}: l2_clip is the clip norm C of a clipped function that divides each clipped "
    "gradient by C (rescale_to_unit_norm=True): one example moves its sum by at most 1, not C, "
    "so noise of std σ·C is not the noise the accountant is told about (σ for a bound of 1). "
    "Use the clipped function itself as l2_clip, dp_noise(σ, clipped_fn, B, key), whose bound "
    "the noise then follows, or l2_clip=1.0."
  ),
  "state_argnums": (
    "{caller}: state_argnums " + _WHY + " threads a state computed from the examples (e.g. "
    "BatchNorm statistics) from one micro-batch into the next: an example then reaches the "
    "other examples' gradients and the threaded state, which clipping does not bound, so the "
    "printed (ε, δ) is false. Use a model without batch statistics (GroupNorm, LayerNorm)."
  ),
}


def refuse_private(key: str, caller: str, **fields: Any) -> None:
  """Raises the privacy contract's error for a refused option (`PRIVATE_REFUSED[key]`)."""
  raise ValueError(PRIVATE_REFUSED[key].format(caller=caller, **fields))


# The privacy package's own checks of a private path, by name: `optax_accum.privacy._guard`
# installs them when it is imported (every private path has imported it: its objects come from
# there), so the front ends call them with one line each and the core imports nothing from it.
PRIVATE_CHECKS: dict[str, Callable[..., None]] = {}


def private_check(name: str, *args: Any, **kwargs: Any) -> None:
  """Runs the privacy package's check `name` (`PRIVATE_CHECKS`): it raises the contract's
  error for a refused pipeline, and returns None for any other."""
  check = PRIVATE_CHECKS.get(name)
  if check is not None:
    check(*args, **kwargs)


def _declares_private(x: Any) -> bool:
  if getattr(x, "__dp_private__", False) is True:
    return True
  module = getattr(x, "__module__", None)
  return isinstance(module, str) and (
    module == PRIVATE_PACKAGE or module.startswith(PRIVATE_PACKAGE + ".")
  )


def _unwrapped(fun: Any):
  """`fun`, then what it wraps (``__wrapped__``, `functools.partial`), outermost first."""
  for _ in range(32):  # a wrapper chain, not a cycle
    if fun is None:
      return
    yield fun
    fun = getattr(fun, "__wrapped__", None) or (
      fun.func if isinstance(fun, functools.partial) else None
    )


def private_fun(fun: Any) -> bool:
  """Whether `fun` is a private (clipped) function: one that declares itself private or is
  defined in `optax_accum.privacy`, or wraps one (``__wrapped__``, `functools.partial`)."""
  return any(_declares_private(f) for f in _unwrapped(fun))


def private_reduction(fun: Any) -> Any:
  """The `microbatch` reduction a private function declares (``ClippedGrad.reduction``, found
  through its wrappers), else "sum" (a clipped sum)."""
  for f in _unwrapped(fun):
    reduction = getattr(f, "reduction", None)
    if reduction is not None and not callable(reduction):
      return reduction
  return "sum"


def private_aux_rows(fun: Any) -> bool:
  """Whether a private loss returns ``(value, aux)`` with one aux row per example
  (`privacy.clipped_loss(..., has_aux=True)`: its ``has_aux``, found through its wrappers), and
  declares no `microbatch` reduction of its own (a `privacy.clipped_grad` does)."""
  for f in _unwrapped(fun):
    if _declares_private(f) and getattr(f, "has_aux", None) is True:
      return getattr(f, "reduction", None) is None
  return False


def private_mask_argnum(fun: Any) -> int | None:
  """Where a private function takes its padding mask (``mask_argnum`` of `privacy.clipped_grad`
  or `privacy.clipped_loss`, found through its wrappers; a `functools.partial`'s bound
  positional arguments shift it), or None."""
  shift = 0
  for f in _unwrapped(fun):
    n = getattr(f, "mask_argnum", None)
    if isinstance(n, int) and not isinstance(n, bool) and _declares_private(f):
      return n - shift if n >= shift else None
    if isinstance(f, functools.partial):
      shift += len(f.args)
  return None


def _private_node(x: Any) -> bool:
  t = type(x)
  return getattr(t, "__dp_private__", False) is True or (
    t.__name__ == "DPNoiseState" and _declares_private(t)
  )


def holds_private_state(tree: Any) -> bool:
  """Whether an optimizer state (or its `jax.eval_shape`) holds a private node, e.g.
  `privacy.dp_noise`'s `DPNoiseState`: the optimizer adds DP noise. Reads the tree's structure
  only (static under tracing)."""
  return any(_private_node(x) for x in jax.tree.leaves(tree, is_leaf=_private_node))


def narrow_float(dtype: Any) -> bool:
  """A floating dtype narrower than float32 (bfloat16, float16, float8...)."""
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32
