"""The accumulation core shared by `accumulate` and `microbatch`.

Everything that decides *what* the accumulated result is lives here, once:

* `zeros` — an accumulator for a pytree, in the accumulator dtype;
* `all_finite` — whether a micro-batch counts (NaN/Inf anywhere drops it);
* `add` — ``sums + w * x`` and ``total + w`` for one micro-batch, the drop applied;
* `normalise` — ``sums / total`` (guarded) or ``sums``, cast back to the input dtypes.

The two front ends only decide *when* these run (a `lax.cond` on the k-th step, or a
`lax.scan` over the micro-batches); `_collectives` makes the sums global across devices, once
per update, and `_checks` validates what users pass in.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum.core import _checks
from optax_accum.core._typing import DType, Reduction


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def accum_dtype_for(
  x: Any, accum_dtype: DType | None, *, mean: bool = False, exact: bool = False
) -> Any:
  """The dtype in which leaf `x` is accumulated.

  Floating and complex leaves: their own dtype when `accum_dtype` is None, else
  ``promote_types(accum_dtype, leaf dtype)`` of the leaf's kind — never narrower than the leaf
  (a float64 gradient stays float64), complex leaves complex (float32 asks for complex64, so
  the imaginary part is kept), real leaves real. Integer and bool leaves (counts, e.g.
  "number of correct predictions") are summed exactly in their own dtype widened to int32,
  except when they are averaged (`mean`): a weighted mean of counts is accumulated as a float
  (float32, or `accum_dtype`'s precision), so fractional weights are not truncated.

  `exact` (an explicit `rounding`, see `check_rounding`): a real floating leaf accumulates in
  `accum_dtype` itself, narrower than the leaf if asked (a bfloat16 accumulator of float32
  gradients), each addition rounded as `rounding` says.
  """
  dtype = jnp.result_type(x)
  if jnp.issubdtype(dtype, jnp.inexact):
    if accum_dtype is None:
      return dtype
    if exact and jnp.issubdtype(dtype, jnp.floating):
      return jnp.dtype(accum_dtype)
    promoted = jnp.promote_types(accum_dtype, dtype)
    if not jnp.issubdtype(dtype, jnp.complexfloating):
      promoted = jnp.finfo(promoted).dtype  # a real leaf: the real dtype of that precision
    return promoted
  if mean:
    return jnp.finfo(jnp.float32 if accum_dtype is None else accum_dtype).dtype
  return jnp.promote_types(dtype, jnp.int32)


def zeros(tree: Any, accum_dtype: DType | None, *, mean: bool = False, exact: bool = False) -> Any:
  """A zero accumulator with `tree`'s structure and shapes, in the accumulator dtype.

  `tree` may hold arrays, Python numbers or `jax.ShapeDtypeStruct`s; `None` leaves and empty
  subtrees stay as they are (they carry no gradient). `mean`, `exact`: see `accum_dtype_for`.
  """
  return jax.tree.map(
    lambda x: jnp.zeros(jnp.shape(x), accum_dtype_for(x, accum_dtype, mean=mean, exact=exact)),
    tree,
  )


ROUNDINGS = (None, "nearest", "stochastic")
# The fixed seed of stochastic rounding's keys: each micro-step's key is this seed folded with
# the state's counters (`rounding_key`), so a run is reproducible and a restored state resumes
# bit for bit, with no random state kept.
ROUNDING_SEED = 0x5EED_ACC


def check_rounding(rounding: Any, accum_dtype: Any) -> str | None:
  """`rounding` checked against the (canonical) `accum_dtype`: None (the accumulator is never
  narrower than a gradient), "nearest" or "stochastic" (the accumulator is `accum_dtype`
  itself, each addition rounded to nearest or stochastically; "stochastic" is for bfloat16)."""
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be None, 'nearest' or 'stochastic', got {rounding!r}.")
  if rounding is None:
    return None
  if accum_dtype is None or not jnp.issubdtype(accum_dtype, jnp.floating):
    raise ValueError(
      f"rounding={rounding!r} accumulates in accum_dtype itself, which must then be a real "
      f"floating dtype, got accum_dtype={accum_dtype}. E.g. accum_dtype=jnp.bfloat16, "
      "rounding='stochastic' for a 2-byte accumulator."
    )
  if rounding == "stochastic" and jnp.dtype(accum_dtype) != jnp.bfloat16:
    raise ValueError(
      "rounding='stochastic' rounds a float32 sum to bfloat16 (the upper half of its bits), "
      f"so it needs accum_dtype=jnp.bfloat16, got accum_dtype={jnp.dtype(accum_dtype).name}. "
      "Use rounding='nearest' (or None) for other dtypes."
    )
  return rounding


def check_skip_window(skip_nonfinite: Any) -> bool:
  """Whether `skip_nonfinite` is "window" (checked: a bool or "window")."""
  if not isinstance(skip_nonfinite, str):
    return False
  if skip_nonfinite != "window":
    raise ValueError(f"skip_nonfinite must be a bool or 'window', got {skip_nonfinite!r}.")
  return True


def rounding_key(
  gradient_step: jax.Array,
  num_skipped: jax.Array,
  mini_step: jax.Array,
  device: jax.Array | None = None,
) -> jax.Array:
  """The stochastic-rounding key of one micro-step: `ROUNDING_SEED` folded with the state's
  counters, so that the same state always draws the same bits, and no two micro-steps of a
  run draw the same: within a window `mini_step` moves; a window that closes with an update
  moves `gradient_step`; one dropped for NaN/Inf moves `num_skipped` (a window that closes
  empty otherwise held only zero weights, whose additions are exact zeros whatever the bits).
  `device`: the device's index along the data axis, so that devices round independently
  (the same bits everywhere would make every device's rounding errors one error, n times)."""
  key = jax.random.fold_in(jax.random.key(ROUNDING_SEED), gradient_step)
  key = jax.random.fold_in(jax.random.fold_in(key, num_skipped), mini_step)
  return key if device is None else jax.random.fold_in(key, device)


def wide_sums(sums: Any) -> Any:
  """A narrow accumulator's sums (an explicit `rounding`: bfloat16, float16) in float32, for
  the window's all-reduce: summed across devices in their own dtype, each addition of the
  reduction would round again (to nearest)."""
  narrow = lambda s: jnp.issubdtype(s.dtype, jnp.floating) and jnp.finfo(s.dtype).bits < 32  # noqa: E731
  return jax.tree.map(lambda s: s.astype(jnp.float32) if narrow(s) else s, sums)


def stochastic_round(y: jax.Array, key: jax.Array) -> jax.Array:
  """float32 `y` rounded to bfloat16, up or down with probabilities that make it unbiased
  (``E[round(y)] = y`` for every finite `y` that does not round to ±Inf): a uniform 16-bit
  integer is added to the low half of `y`'s bits, which are then dropped. The sign is a bit
  of its own, so the magnitude is what is rounded, and the expectation holds for both signs.
  NaN and ±Inf stay as they are."""
  bits = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.uint32)
  noise = jax.random.bits(key, y.shape, jnp.uint16).astype(jnp.uint32)
  rounded = lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.where(jnp.isfinite(y), rounded, y).astype(jnp.bfloat16)


def all_finite(tree: Any, *, pooled: bool = False) -> jax.Array:
  """A boolean scalar: True iff every floating (or complex) leaf of `tree` is free of NaN/Inf.

  Exact for every finite input, up to each dtype's largest value: a NaN or ±Inf anywhere
  propagates through a sum, while the scale 2⁻⁶⁴ keeps finite values from overflowing. Each leaf
  is read once, with no temporary (`_leaf_finite`); integer and bool leaves are always finite.

  `pooled=True` (where nothing is sharded: `TrainStep`'s programs for a small model on one
  device): the float32 and float64 leaves are pooled (`_pooled`), each one's scaled values (a
  small leaf) or scaled row sums (a larger one, a matrix-vector `dot`) joined per dtype into
  pools of at most `_POOL` elements, each summed once (a part larger than that alone). Per
  leaf, the check is one to three operations, and XLA:CPU's executor costs each about half a
  microsecond a call whatever its size: the optax notebook's MLP (six leaves) took 12 for its
  check, pooled 4 (the weight's row sums, the join, its rows' sums, the total; `_pooled`,
  `_scales`). Not by default: a join of leaves that a mesh shards differently makes GSPMD
  gather them (and explicitly sharded leaves have no joined sharding), so narrower floats,
  complex leaves and leaves sharded by their type are checked one by one even then.
  """
  flags, pools = [], {}
  for x in _float_leaves(tree):
    x = jnp.asarray(x)
    if not x.size:
      continue
    if not (pooled and _poolable(x)):
      flags.append(_leaf_finite(x))
      continue
    part = _scaled_part(x)
    if part.size > _POOL:  # (a leaf of many rows: summed alone, as it comes)
      flags.append(_pooled([part]))
      continue
    parts = pools.setdefault(x.dtype, [])
    if sum(p.size for p in parts) + part.size > _POOL:
      flags.append(_pooled(parts))
      parts = pools[x.dtype] = []
    parts.append(part)
  flags += [_pooled(parts) for parts in pools.values()]
  if not flags:
    return jnp.asarray(True)
  return functools.reduce(jnp.logical_and, flags)


def zeros_unless(keep: jax.Array, tree: Any) -> Any:
  """`tree` where the boolean scalar `keep` is True, else exact zeros like it: selected, never
  multiplied (``0 * nan`` is nan)."""
  return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)


def finite_from_sq_norm(sq: jax.Array, tree: Any, cond: Any = lax.cond) -> jax.Array:
  """`all_finite` of `tree`, given its squared norm ``sq = Σ|x|²`` (`_noise.sq_norm`).

  ``Σ|x|²`` is non-finite iff some element is NaN/±Inf or the sum overflows. So where it is
  finite, `tree` is finite, and the squared norm the noise statistics need anyway *is* the
  finite check: the micro-step reads each gradient once for both. Only where it is not finite
  does the exact check run (a `lax.cond`: rare, the drop decision stays exact), telling an
  overflow of large finite values (kept) from a NaN or Inf (dropped). `cond`: `lax.cond`, or
  inside a map with model axes `_collectives.cond` (the exact check of a model shard varies
  over the model axes, while a squared norm summed over the shards does not).
  """
  return cond(jnp.isfinite(sq), lambda s, t: jnp.isfinite(s), lambda s, t: all_finite(t), sq, tree)


# The scale of the check's sums: |x|·2⁻⁶⁴ summed over every element that fits in memory
# (< 2⁶⁴ elements) stays below the largest float32/float64, so only NaN/Inf can make the sum
# non-finite. A power of two, so the products are exact or underflow (harmless).
_CHECK_SCALE = 2.0**-64
# `all_finite`'s pools: a leaf of at most `_INLINE` elements joins its dtype's pool as its
# scaled values (a multiply fused into the join), a larger one as its rows' scaled sums; a
# pool holds at most `_POOL` elements (256 KiB of float32: its temporary, never parameter-sized).
_INLINE = 4096
_POOL = 2**16
# XLA:CPU sums an array of more than this many elements in steps (`_pooled`).
_WINDOW = 32
# The longest scale vector a check's `dot` carries as a literal (`_scales`): 16 KiB of float32.
_LITERAL = 4096
# The check's dots in full float32 whatever the default matmul precision: a bfloat16 pass (a
# TPU's default) or TF32 (a GPU's) rounds a float32 near its largest value to Inf.
_EXACT = lax.Precision.HIGHEST


def _scaled_part(x: jax.Array) -> jax.Array:
  """`x`·2⁻⁶⁴ as a pool takes it, 1-D: a small leaf's values, or a larger leaf's row sums as
  ``rows @ c`` with ``c = 2⁻⁶⁴`` (the last 2⁻⁶⁵, `_scales`), a matrix-vector product that XLA
  keeps a real `dot` (one read of `x`, no temporary; measured 0.37 of an accumulation pass on
  CPU, against 1.06 for a scaled sum of squares, which also materialised the scale as a
  parameter-sized constant)."""
  if x.size <= _INLINE:
    return x.reshape(-1) * jnp.asarray(_CHECK_SCALE, x.dtype)
  return _row_sums(x)


def _row_sums(x: jax.Array) -> jax.Array:
  """``rows @ c``, `x`'s rows (its last axis) summed scaled by ``c = 2⁻⁶⁴`` (`_scales`), in one
  `dot`."""
  rows = x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(1, -1)
  return lax.dot(rows, _scales(rows.shape[-1], x.dtype, _CHECK_SCALE), precision=_EXACT)


def _scales(n: int, dtype: Any, scale: float) -> jax.Array:
  """A vector of `n` powers of two, `scale` and (the last one) `scale`/2, for a check's `dot`.

  Not uniform, so that XLA keeps it a literal of the program: a uniform vector (`jnp.full`)
  stays a `broadcast` that XLA:CPU runs as an operation on every call, a fixed dispatch as
  costly as any small operation. Powers of two keep each product exact or underflowing to 0,
  which leaves NaN and ±Inf as they are. Uniform above `_LITERAL` elements (a literal is part
  of the compiled program)."""
  if n > _LITERAL:
    return jnp.full((n,), scale, dtype)
  values = np.full((n,), scale, dtype)
  values[-1] = scale / 2
  return jnp.asarray(values)


def _poolable(x: jax.Array) -> bool:
  """Whether `x` joins a pool: float32 or float64, and not sharded by its type (an explicit
  mesh axis: a join of differently sharded arrays, or a reshape across a sharded dimension,
  has no sharding to give; such a leaf is checked alone, as its sharding allows)."""
  if jnp.finfo(x.dtype).bits < 32 or jnp.issubdtype(x.dtype, jnp.complexfloating):
    return False
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", ())
  return all(axis is None for axis in spec)


def _pooled(parts: list[jax.Array]) -> jax.Array:
  """Whether a pool's parts are all finite: joined and summed once.

  XLA:CPU sums more than `_WINDOW` elements in steps of `_WINDOW` (a `reduce-window` each:
  three operations for the optax notebook MLP's 2,202), so a pool of more is first laid out as
  `_WINDOW` rows, padded with zeros, and the rows summed by a matrix-vector `dot` (one
  operation): two operations in all. The join stays one array (an optimisation barrier): XLA
  would otherwise turn the sum of a join back into one sum per part (`reduce(concatenate)` →
  a `reduce` each)."""
  size = sum(p.size for p in parts)
  width = -(-size // _WINDOW)
  if size <= _WINDOW or width > _LITERAL:
    pool = parts[0] if len(parts) == 1 else lax.optimization_barrier(jnp.concatenate(parts))
    return jnp.isfinite(jnp.sum(pool))
  dtype = parts[0].dtype
  padding = [jnp.zeros((_WINDOW * width - size,), dtype)] if _WINDOW * width > size else []
  rows = lax.optimization_barrier(jnp.concatenate([*parts, *padding])).reshape(_WINDOW, width)
  return jnp.isfinite(jnp.sum(lax.dot(rows, _scales(width, dtype, 1.0), precision=_EXACT)))


def _leaf_finite(x: Any) -> jax.Array:
  """Whether one leaf is free of NaN/Inf, in the cheapest exact form XLA offers for its dtype.

  float32, float64 and complex leaves: ``isfinite(Σ x @ c)`` with ``c = 2⁻⁶⁴`` (see
  `_scaled_part`); a complex `c·x` keeps the real and imaginary sums apart, so both parts are
  checked. Narrower floats (bfloat16, float16, float8): ``Σ (x - x) == 0`` — each term is 0,
  or NaN for NaN/±Inf, so the sum cannot overflow; a `dot` would first convert them to
  float32 into a temporary. (``max(abs(x)) < inf`` would be wrong: XLA:CPU's max drops NaN.)
  """
  x = jnp.asarray(x)
  dtype = x.dtype
  if jnp.finfo(dtype).bits < 32:
    return jnp.sum(x - x, dtype=jnp.float32) == 0
  return jnp.isfinite(jnp.sum(_row_sums(x)))


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
  finite: jax.Array | None = None,
  agree: Any = None,
  check: Any = None,
  key: jax.Array | None = None,
) -> tuple[Any, jax.Array, jax.Array]:
  """Adds one micro-batch: ``sums + w * tree`` and ``total + w``.

  Args:
    sums: the accumulator (from `zeros`); its dtypes are kept.
    total: the accumulated weight, a float32 scalar.
    tree: the micro-batch's values (a gradient, or a function's outputs), same structure.
    weight: this micro-batch's non-negative scalar weight; None means 1. A weight that is
      negative, NaN or ±Inf (possible only when traced: host values are checked by
      `_checks.weight`) drops the micro-batch, whatever `skip_nonfinite` says.
    skip_nonfinite: when True a micro-batch with any NaN/Inf in `tree` adds nothing, neither
      to `sums` nor to `total` (selected away, never multiplied by 0: ``0 * nan`` is nan).
      Whatever it says, a micro-batch of weight 0 adds exact zeros (a NaN in it included) and
      is not counted as dropped.
    restart: an optional boolean scalar; where True, `sums` and `total` are treated as zero
      (a new window starts). Resetting lazily here, inside the same elementwise pass, is what
      lets the emitting step leave the donated accumulator alone instead of copying it out
      and writing zeros over it.
    finite: whether `tree` is free of NaN/Inf, when the caller knows it already
      (`finite_from_sq_norm`); None: `all_finite` here. Read only with `skip_nonfinite`.
    agree: an optional ``(keep, weight) -> (keep, weight)`` that makes the drop decision and
      the weight one value across the model axes (`_collectives.Axis.agree`).
    check: the values whose NaN/Inf drops the micro-batch (`skip_nonfinite`); None: `tree`.
      `finite`, when given, is about these values.
    key: stochastic rounding (`rounding_key`): each bfloat16 leaf of `sums` takes
      ``sums + w * x`` computed in float32, then `stochastic_round`-ed with the key folded
      with the leaf's index. None: every addition in the accumulator dtype, rounded to nearest.

  Returns:
    ``(sums, total, dropped)`` where `dropped` is a bool scalar, True iff the micro-batch was
    dropped.
  """
  checked = tree if check is None else check
  w, keep = _kept_weight(checked, weight, total.dtype, skip_nonfinite, finite, agree)
  masked = skip_nonfinite or weight is not None
  # A micro-batch adds its values only with a positive weight: one dropped, or weighing 0,
  # contributes exact zeros whatever it holds (``0 * nan`` is nan), in every mode.
  adds = w > 0
  if restart is not None:
    total = jnp.where(restart, jnp.zeros_like(total), total)

  def add_leaf(i, s, x):
    if restart is not None:
      s = jnp.where(restart, jnp.zeros_like(s), s)
    stochastic = key is not None and s.dtype == jnp.bfloat16
    dtype = jnp.float32 if stochastic else s.dtype
    x = jnp.asarray(x).astype(dtype)
    if weight is not None:
      x = x * w.astype(dtype)
    if masked:
      x = jnp.where(adds, x, jnp.zeros_like(x))
    if stochastic:  # the sum in float32, then rounded once (a kept-out x adds exact zeros)
      return stochastic_round(s.astype(dtype) + x, jax.random.fold_in(key, i))
    return s + x

  leaves, tree_def = jax.tree.flatten(sums)
  xs = tree_def.flatten_up_to(tree)
  sums = tree_def.unflatten(
    [add_leaf(i, s, x) for i, (s, x) in enumerate(zip(leaves, xs, strict=True))]
  )
  return sums, total + w, jnp.logical_not(keep)


def _kept_weight(
  tree: Any,
  weight: jax.Array | None,
  dtype: Any,
  skip_nonfinite: bool,
  finite: jax.Array | None = None,
  agree: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """The micro-batch's weight (0 if dropped) and whether it is kept: its weight is valid (see
  `_checks.valid_weight`) and, with `skip_nonfinite`, its values are finite (`finite`, or
  `all_finite` of `tree` when it is None)."""
  keep = jnp.asarray(True)
  if skip_nonfinite:
    keep = all_finite(tree) if finite is None else finite
  if weight is None:
    w = jnp.ones((), dtype)
  else:
    keep = keep & _checks.valid_weight(weight)
    w = jnp.asarray(weight).astype(dtype)
  if agree is not None:  # one decision and one weight across the model shards
    keep, w = agree(keep, w)
  return jnp.where(keep, w, jnp.zeros_like(w)), keep


def add_one(
  tree: Any,
  weight: jax.Array | None,
  *,
  skip_nonfinite: bool,
  reduction: Reduction,
  accum_dtype: DType | None = None,
  finite: jax.Array | None = None,
  agree: Any = None,
) -> tuple[Any, jax.Array, jax.Array]:
  """A window of exactly one micro-batch, with no accumulator: ``(sums, total, dropped)``.

  What `add` into zeros gives, except that the sums are already the window's result: `tree`
  itself for "mean" (its weighted mean; no multiply and divide by the weight, which could move
  a result by an ulp) and ``w * tree`` for "sum", multiplied in the accumulator dtype (as
  `add` does) and cast back. Normalise them with "sum". `total` is the weight, 0 when the
  micro-batch is dropped, so a zero weight or a drop still empties the window. `finite`: as
  for `add`.
  """
  total, keep = _kept_weight(tree, weight, jnp.float32, skip_nonfinite, finite, agree)
  if weight is not None and reduction == "sum":

    def weigh(x):
      dtype = accum_dtype_for(x, accum_dtype)
      return (jnp.asarray(x).astype(dtype) * total.astype(dtype)).astype(jnp.result_type(x))

    tree = jax.tree.map(weigh, tree)
    if skip_nonfinite:  # a finite gradient times a large weight can overflow its dtype
      keep = keep & all_finite(tree)
      if agree is not None:
        keep, total = agree(keep, total)
      total = jnp.where(keep, total, jnp.zeros_like(total))
  return tree, total, jnp.logical_not(keep)


def normalise(sums: Any, total: jax.Array, like: Any, reduction: Reduction) -> Any:
  """``sums / total`` ("mean", zero where `total` is 0) or ``sums`` ("sum"), cast like `like`.

  The mean is taken in the accumulator dtype as ``sums * (1 / total)``: one scalar division,
  then a multiply that XLA fuses into every consumer (an optimizer reads the mean twice, for
  both of Adam's moments). An elementwise division is too costly for XLA to duplicate, so it
  would be materialised as a parameter-sized temporary. The price is at most one ulp against
  ``sums / total`` (none when the total is a power of two). The result is then cast to the
  dtypes of `like` (the micro-batch values), so callers never see the accumulator dtype. The
  mean of an integer leaf stays a float (float32): truncating it back would be silently wrong.
  """

  def widen(s, x):  # a narrower accumulator (explicit `rounding`): the mean in x's precision
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(s.dtype, jnp.floating):
      return s.astype(jnp.promote_types(s.dtype, dtype))
    return s

  sums = jax.tree.map(widen, sums, like)
  if reduction == "mean":
    safe = jnp.where(total > 0, total, jnp.ones_like(total))

    def div(s):
      if jnp.issubdtype(s.dtype, jnp.inexact):
        return s * (1 / safe.astype(s.dtype))
      return s * (1 / safe)  # integer counts: a float mean

    sums = jax.tree.map(div, sums)

  def cast(s, x):
    dtype = jnp.result_type(x)
    if reduction == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
      return s  # the mean of integer counts is a float: casting back would truncate it
    return s.astype(dtype)

  return jax.tree.map(cast, sums, like)
