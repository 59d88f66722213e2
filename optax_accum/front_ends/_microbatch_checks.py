"""`microbatch`'s arguments, checked when the transform is made (and the count of real
micro-batches, checked again per call once k is known, and by `plan_microbatches`).

Each check names the argument, what it got and what it needs; on a private function
(`privacy.clipped_grad`, a clipped loss) `private_options` holds the options to the privacy
contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.core import _checks, _outputs

STATE_OUT_MISSING = (
  "microbatch: state_argnums={argnums} needs `state_out`, a function that picks the new state "
  "out of `fun`'s output, e.g. for `jax.value_and_grad(loss, has_aux=True)` whose aux is the "
  "new batch_stats:\n\n"
  "    step = microbatch(jax.value_and_grad(loss, has_aux=True), k, state_argnums=2,\n"
  "                      state_out=lambda out: out[0][1])\n"
)


AUX_ROWS_NEED_REDUCTION = (
  "microbatch: fun differentiates privacy.clipped_loss(..., has_aux=True), whose aux holds one "
  "row per example; the default reduction of a private function sums every output, rows too, "
  "and where jax.value_and_grad or jax.grad puts the aux is not known here. Name it: "
  "reduction=(('sum', 'concat'), 'sum') for jax.value_and_grad(f, has_aux=True) (the rows in "
  "the batch's order), reduction=('sum', 'concat') for jax.grad(f, has_aux=True)."
)


class _DefaultSplit(str):
  """The default "strided", told apart from a "strided" the caller asked for (`check_split`)."""

  __slots__ = ()


DEFAULT_SPLIT = _DefaultSplit("strided")


PADDED_SPLIT = (
  "microbatch: num_real_microbatches={n} runs the first micro-batches only, and which rows they "
  "hold depends on split, here left at its default 'strided' (micro-batch i is rows i, i+k, "
  "i+2k, ...): the real rows would have to be those with row % k < n. The usual padded batch "
  "has its real rows first (padded at its end, e.g. np.pad), and with the strided split that "
  "runs real and padding rows alike and leaves real rows out, silently. Say how the batch is "
  "laid out: split='contiguous' for a batch padded at its end (micro-batch i is rows i*b to "
  "i*b + b - 1, so the first n micro-batches are the first n*b rows), or split='strided' for "
  "rows laid out so that row r is real when r % k < n (privacy.PoissonSampler(split='strided') "
  "lays its batches out so)."
)


def check_callables(fun: Any, weight_fn: Any, state_out: Any, states: tuple[int, ...]) -> None:
  if not callable(fun):
    raise TypeError(f"microbatch: fun must be callable, got {fun!r}.")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"microbatch: weight_fn must be callable or None, got {weight_fn!r}.")
  if states and state_out is None:
    raise ValueError(STATE_OUT_MISSING.format(argnums=states[0]))
  if state_out is not None and not states:
    raise ValueError(
      "microbatch: state_out is given but state_argnums is empty; name the "
      "state arguments with state_argnums."
    )


def check_sizes(num_microbatches: Any, microbatch_size: Any) -> tuple[int | None, int | None]:
  """``(k, None)`` or ``(None, microbatch_size)``: exactly one of the two is given."""
  if (num_microbatches is None) == (microbatch_size is None):
    got = "neither" if num_microbatches is None else "both"
    raise TypeError(
      "microbatch: give exactly one of num_microbatches (how many micro-batches) and "
      f"microbatch_size (examples per micro-batch), got {got}."
    )
  if microbatch_size is None:
    return _checks.positive_int(num_microbatches, "num_microbatches", "microbatch"), None
  return None, _checks.positive_int(microbatch_size, "microbatch_size", "microbatch")


def check_num_real(value: Any, k: int | None, *, sized: bool = False) -> int | jax.Array | None:
  """`num_real_microbatches`: None, a host int in ``[0, k]``, or an integer scalar array
  (clamped into ``[0, k]`` where it is used). `sized`: `k` came from `microbatch_size`.

  The one check of the count: at factory time (`k` None when not known yet), per call once
  `k` is known, and by `plan_microbatches`.
  """
  if value is None:
    return None
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]  # a 0-d NumPy array is a host value too
  if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
    if sized and value > k:
      raise ValueError(
        f"microbatch: num_real_microbatches={value} is more than the {k} micro-batches this "
        "batch holds (batch size / microbatch_size)."
      )
    if value < 0 or (k is not None and value > k):
      upper = f"num_microbatches={k}" if k is not None else "num_microbatches"
      raise ValueError(f"microbatch: num_real_microbatches must be in [0, {upper}], got {value}.")
    return int(value)
  if (
    isinstance(value, jax.Array) and value.shape == () and jnp.issubdtype(value.dtype, jnp.integer)
  ):
    return value
  what = f"{value.dtype}{list(value.shape)}" if isinstance(value, jax.Array) else repr(value)
  raise TypeError(
    "microbatch: num_real_microbatches must be None, an int, or an integer scalar array (e.g. "
    f"traced under jax.jit), got {what} of type {type(value).__name__}."
  )


def loop_trips(num_real: int | jax.Array | None, k: int, sized: bool) -> int | jax.Array:
  """How many micro-batches run: k, a checked host int, or a device scalar clamped into [0, k]."""
  num_real = check_num_real(num_real, k, sized=sized)
  if num_real is None:
    return k
  if isinstance(num_real, int):
    return num_real
  return jnp.clip(num_real, 0, k).astype(jnp.int32)


def private_options(
  fun: Any, reduction: Any, weight_fn: Any, noise_scale: Any, states: tuple, accum_dtype: Any
) -> tuple[Any, bool]:
  """The privacy contract of `microbatch` on a private function (`privacy.clipped_grad`,
  ``jax.value_and_grad(privacy.clipped_loss(...))``): the options that would change the
  sensitivity raise (`_checks.PRIVATE_REFUSED`); the default reduction is the function's own
  (``ClippedGrad.reduction``, else "sum"); and no micro-batch is ever dropped (returns
  ``skip_nonfinite=False``): a non-finite per-example gradient already counts 0 in clipping,
  and dropping a whole micro-batch for a non-finite loss value would remove up to ``b·C``."""
  if reduction is None and _checks.private_aux_rows(fun):
    raise ValueError(AUX_ROWS_NEED_REDUCTION)
  if reduction is None:
    reduction = _checks.private_reduction(fun)
  if any(r == "mean" for r in jax.tree.leaves(_outputs.check_reduction(reduction))):
    _checks.refuse_private("reduction_mean", "microbatch")
  if weight_fn is not None:
    _checks.refuse_private("weight_fn", "microbatch")
  if noise_scale is not None:
    _checks.refuse_private("noise_scale", "microbatch")
  if states:
    _checks.refuse_private("state_argnums", "microbatch")
  dtype = _checks.accum_dtype(accum_dtype, "microbatch")
  if dtype is not None and _checks.narrow_float(dtype):
    _checks.refuse_private("accum_dtype", "microbatch", dtype=dtype.name)
  return reduction, False


def check_split(fun: Any, split: Any, num_real: Any, k: int | None) -> None:
  """Raises `PADDED_SPLIT` for `num_real_microbatches` with the default split, where the
  batch's layout decides which rows run and nothing says it: not with one micro-batch, nor a
  count of all of them, nor for a private function with a mask (its real rows are checked
  against the split: `_microbatch._misplaced_rows`)."""
  if num_real is None or not isinstance(split, _DefaultSplit) or k == 1:
    return
  if isinstance(num_real, int) and num_real == k:
    return
  if _checks.private_mask_argnum(fun) is not None:
    return
  n = num_real if isinstance(num_real, int) else "n"
  raise ValueError(PADDED_SPLIT.format(n=n))


def check_noise(value: Any) -> Any:
  if value is None or callable(value):
    return value
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(
      "microbatch: noise_scale must be None, an int (the gradient's position in fun's output, "
      f"e.g. 1 for jax.value_and_grad) or a selector `lambda out: ...`, got {value!r}."
    )
  return int(value)


def check_noise_once(leaves: tuple[int, ...]) -> None:
  """Each gradient leaf once: a selector that names one twice would count its squares twice
  (doubling T and Q)."""
  twice = sorted({n for n in leaves if leaves.count(n) > 1})
  if twice:
    raise ValueError(
      f"microbatch: noise_scale selects output leaves {twice} more than once; it must select "
      "each leaf of the gradient once (e.g. noise_scale=1 for jax.value_and_grad's (value, "
      "grad), or `lambda out: out[1]`), or T and Q would count them twice."
    )


def check_skip(value: Any) -> bool | int | Callable[[Any], Any]:
  """`skip_nonfinite`: a bool, an int (an output entry) or a selector of the deciding outputs."""
  if isinstance(value, bool | np.bool_):
    return bool(value)
  if callable(value):
    return value
  if isinstance(value, int | np.integer):
    return int(value)
  raise TypeError(
    f"microbatch: skip_nonfinite must be a bool, got {value!r}; or name the outputs whose "
    "NaN/Inf drops a micro-batch: an int (their entry in fun's output, e.g. 1 for "
    "jax.value_and_grad's gradient) or a selector `lambda out: ...`."
  )


def check_bool(value: Any, name: str) -> bool:
  if not isinstance(value, bool | np.bool_):
    raise TypeError(f"microbatch: {name} must be a bool, got {value!r}.")
  return bool(value)
