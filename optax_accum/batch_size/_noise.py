"""The gradient noise scale, measured from the micro-batches of each window.

Accumulation already computes gradients at two batch sizes: every micro-batch is a small batch
and every window (all devices' micro-batches together) a large one. That is all that
McCandlish et al., "An Empirical Model of Large-Batch Training" (2018,
https://arxiv.org/abs/1812.06162), appendix A.1, need to estimate the *simple noise scale*
``B_simple = tr(Σ) / |G|²``, which predicts the critical batch size: the batch past which a
larger batch buys almost no fewer optimizer steps.

The estimator. Micro-batch i of a window has weight wᵢ (1 by default; its number of examples
or tokens when the caller passes them) and mean gradient gᵢ with ``Cov(gᵢ) = Σ / wᵢ``. Over
the k kept micro-batches (dropped ones do not count), with ``W = Σ wᵢ`` and the window's
weighted mean ``ḡ = Σ wᵢ gᵢ / W``:

* ``T = (Σ wᵢ|gᵢ|² − W|ḡ|²) / (k − 1)``, an unbiased estimate of ``tr Σ``;
* ``Q = |ḡ|² − T / W``, an unbiased estimate of ``|G|²``.

(``E[Σ wᵢ|gᵢ|²] = W|G|² + k·tr Σ`` and ``E[W|ḡ|²] = W|G|² + tr Σ``.) With equal weights they
are the paper's two-batch-size formulas with B_small one micro-batch and B_big the window.
Units: ``tr Σ`` is the covariance of one unit of weight, so B_simple is counted in units of
the weight — *global* micro-batches with the default weight 1, examples with example counts,
tokens with token counts. Devices are more pieces of the same window: each adds its own
partial ``(Σ wᵢ|gᵢ|², k, Σ wᵢ)`` (`partials`), and the sums across devices ride on the
all-reduce that the window's gradient needs anyway, so 2 devices × k micro-batches give
exactly the statistics of 1 device × 2k pieces of the same weights. With the default weight a
device's piece is its share, 1/n, of a global micro-batch (`piece_weight`), so the unit does
not depend on the layout; gradients that autodiff already all-reduced are one piece, counted
once (`once`).

B_simple is reported from exponential moving averages of T and Q taken *separately*, then
divided (the paper's advice: the ratio of the averages, not the average of the ratios, which
a noisy Q near zero would dominate). The cost is a few float32 scalars of state (`NoiseState`),
one squared norm per micro-batch gradient (which is also the finite check: `_core.
finite_from_sq_norm`) and one of the window's mean at emission: no parameter-sized buffer, no
extra collective.

Who calls what: a front end calls `add` for every micro-batch (with the same `restart` as
`_core.add`), all-reduces `partials` together with the window's sums, then `close` on the
emitting step; `noise_scale` (public) reads the smoothed figures back out of any optimizer
state, and `next_k` is the window-length policy `FollowNoiseScale` that follows them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum.core import _checks, _find

# The EMA decay of T and Q (one step per closed window). An EMA of decay β averages about
# (1 + β)/(1 − β) = 39 windows at 0.95, which cuts the spread of one window's estimate about
# sixfold (one window with a small k is noisy, Q the most), while its mean age, β/(1 − β) = 19
# windows, stays short against the thousands of updates over which B_simple drifts as the loss
# falls — and short enough for `FollowNoiseScale` to follow it within a short run. For a plot
# of a long run, a slower average (0.99, GPT-NeoX's choice for its logged noise scale) is
# smoother: pass `decay` to `close`.
DEFAULT_DECAY = 0.95

_F32 = jnp.float32


class NoiseState(NamedTuple):
  """Noise-scale statistics: float32 scalars only (32 bytes), no parameter-sized buffer."""

  # Σ wᵢ|gᵢ|² over the open window's kept micro-batches; under an axis, this device's part.
  # Stale after `close` until the next `add` restarts it (lazy reset, as the accumulator).
  # With skip_nonfinite="window" (each gradient read once), its estimate n·w_n|g_n|² from the
  # window's last micro-batch alone, added when the window closes (`_window.sampled_sq_norm`).
  sq_sum: jax.Array  # shape=(), dtype=jnp.float32
  count: jax.Array  # shape=(), dtype=jnp.float32: kept micro-batches (per device, likewise)
  # Σ wᵢ of the open window's kept micro-batches in units of the statistics (see `add`): the W
  # of the estimates (per device, likewise).
  weight: jax.Array  # shape=(), dtype=jnp.float32
  grad_sq_ema: jax.Array  # shape=(), dtype=jnp.float32: EMA of Q (divide by ema_norm)
  trace_ema: jax.Array  # shape=(), dtype=jnp.float32: EMA of T (divide by ema_norm)
  ema_norm: jax.Array  # shape=(), dtype=jnp.float32: Σ of the EMA's weights, 1 − β^t; 0: none
  window_grad_sq: jax.Array  # shape=(), dtype=jnp.float32: last measured window's Q, or NaN
  window_trace_cov: jax.Array  # shape=(), dtype=jnp.float32: last measured window's T, or NaN


class NoiseScale(NamedTuple):
  """The gradient noise scale, as `noise_scale` reports it (float32 scalars).

  `grad_sq` and `trace_cov` are the bias-corrected EMAs of the window estimates Q and T (see
  `optax_accum.batch_size._noise`), `b_simple` their ratio, in units of the micro-batch weight
  (global micro-batches by default, on any number of devices; examples or tokens when the weights
  count them). All are NaN until a window with at least two kept micro-batches has closed.
  `b_simple` is negative or infinite if the smoothed `grad_sq` is not positive: the noise swamps the
  gradient at this window size, and a larger window is needed to measure it.
  """

  grad_sq: jax.Array  # smoothed ``|G|²``, the squared norm of the true gradient
  trace_cov: jax.Array  # smoothed tr Σ, the per-unit-weight gradient variance
  b_simple: jax.Array  # trace_cov / grad_sq: the simple noise scale, in units of the weight
  window_grad_sq: jax.Array  # the last measured window's Q (not smoothed)
  window_trace_cov: jax.Array  # the last measured window's T (not smoothed)


def init() -> NoiseState:
  """Empty statistics: no open window, no window measured yet.

  Returns:
    A `NoiseState` of float32 scalars: zero sums and EMAs, NaN window estimates.

  >>> from optax_accum.batch_size import _noise
  >>> _noise.scale(_noise.init()).b_simple
  Array(nan, dtype=float32)
  """
  # A fresh array per field: a donating step must not see one buffer twice.
  zero = lambda: jnp.zeros((), _F32)  # noqa: E731
  nan = lambda: jnp.full((), jnp.nan, _F32)  # noqa: E731
  return NoiseState(zero(), zero(), zero(), zero(), zero(), zero(), nan(), nan())


def sq_norm(tree: Any, over_shards: Callable[[list, list], jax.Array] | None = None) -> jax.Array:
  """The squared norm ``Σ |x|²`` of a pytree's floating (and complex) leaves, as float32.

  Each leaf is read once: the upcast (bfloat16 and float16 to float32) and the square fuse
  into the reduction (`_sum`; on CPU a matrix leaf's rows first), so there is no leaf-sized
  temporary; a float64 leaf is reduced in float64. A complex leaf contributes ``re² + im²``.
  Integer and bool leaves are not gradients and are left out.

  Args:
    tree: a pytree of arrays (a gradient).
    over_shards: inside a map whose other axes shard the leaves (tensor parallelism), how the
      per-leaf squares become the whole gradient's (`_collectives.Axis.sum_over_shards`: a
      shard's square is summed over the axes that split its leaf, a replicated leaf's counts
      once); None: the plain sum.

  Returns:
    A float32 scalar (0 for a tree without floating leaves).

  >>> import jax.numpy as jnp
  >>> from optax_accum.batch_size import _noise
  >>> _noise.sq_norm({"a": jnp.array([3.0, 4.0]), "b": jnp.array([1j], jnp.complex64)})
  Array(26., dtype=float32)
  """
  parts, leaves = [], []
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    real = jnp.promote_types(jnp.finfo(x.dtype).dtype, _F32)  # never narrower than float32
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
      squares = jnp.square(x.real.astype(real)) + jnp.square(x.imag.astype(real))
    else:
      squares = jnp.square(x.astype(real))
    parts.append(_sum(squares).astype(_F32))
    leaves.append(x)
  if over_shards is not None:
    return over_shards(parts, leaves)
  total = jnp.zeros((), _F32)
  for part in parts:
    total = total + part
  return total


# Whether `_sum` takes the CPU's rows-first form. Off only to time the spelling before
# it (the noise benchmark's "before" contender) and to show the HLO it replaced.
SUM_ROWS_FIRST = True


def _sum(squares: jax.Array) -> jax.Array:
  """``Σ squares`` over every axis, in the form each backend reduces fastest.

  On CPU a matrix leaf is first summed over every axis but its last by a `lax.reduce_window`
  whose window spans them (the rows stream into one vector), then the vector is summed. A plain
  `jnp.sum` of a gradient is rewritten by XLA:CPU (its tree-reduction pass, which sees the
  transposed layout autodiff gives a weight's gradient) into 32×32 windows that read the
  buffer 3-4× slower than the matrix-vector product of the finite check without the
  statistics: that difference was most of `noise_scale=True`'s cost on the MLP benchmarks. A
  reduce-window is left alone by that pass. Elsewhere, and wherever the leaf may be sharded
  (a mesh axis that is not manual: a window across a sharded axis would make the partitioner
  gather the leaf), the plain sum, which every backend's reduction emitter handles well.
  """
  rows = squares.size // squares.shape[-1] if squares.ndim >= 2 and squares.size else 0
  # Fewer than 8 rows: the vector would be more than an eighth of the leaf, written again.
  if not SUM_ROWS_FIRST or rows < 8 or not _local(squares):
    return jnp.sum(squares)
  return lax.platform_dependent(squares, cpu=_sum_rows_first, default=jnp.sum)


def _sum_rows_first(squares: jax.Array) -> jax.Array:
  window = squares.shape[:-1] + (1,)
  zero = jnp.zeros((), squares.dtype)
  return jnp.sum(lax.reduce_window(squares, zero, lax.add, window, window, "VALID"))


def _local(x: jax.Array) -> bool:
  """Whether `x` is whole on each device: no mesh axis of more than one device that is not
  manual (outside any mesh, or inside a `shard_map` over all its axes)."""
  mesh = jax.typeof(x).sharding.mesh
  manual = set(getattr(mesh, "manual_axes", ()))
  return all(size == 1 or name in manual for name, size in mesh.shape.items())


def add(
  ns: NoiseState,
  grads: Any,
  weight: jax.Array | float | None,
  keep: jax.Array | bool,
  restart: jax.Array | None = None,
  *,
  sq: jax.Array | None = None,
) -> NoiseState:
  """Adds one micro-batch gradient to the open window: ``sq_sum += w|g|²``, ``count += 1``,
  ``weight += w``.

  A micro-batch counts only if it is kept and its weight is positive: a dropped one (NaN/Inf,
  an invalid weight) is selected away, never multiplied by 0, and a zero-weight one carries no
  information about the gradient (its covariance ``Σ/w`` is unbounded), so neither changes
  the sums.

  Args:
    ns: the statistics.
    grads: this micro-batch's mean gradient, a pytree.
    weight: its weight in the units of the statistics (a scalar; None means 1): what the
      caller passed, or by default `piece_weight`'s share of one global micro-batch.
    keep: a bool scalar, whether the accumulator kept this micro-batch (`_core.add`'s
      ``not dropped``).
    restart: an optional bool scalar; where True, the open window's sums are treated as 0
      first (a new window opens), exactly as `_core.add`'s `restart`.
    sq: ``sq_norm(grads)`` when the caller has it already (it is the finite check of
      `_core.finite_from_sq_norm`): the gradient is then not read again.

  Returns:
    The updated `NoiseState`.

  >>> import jax.numpy as jnp
  >>> from optax_accum.batch_size import _noise
  >>> ns = _noise.add(_noise.init(), {"w": jnp.array([1.0, 2.0])}, 2.0, True)
  >>> float(ns.sq_sum), float(ns.count), float(ns.weight)
  (10.0, 1.0, 2.0)
  """
  w = jnp.ones((), _F32) if weight is None else jnp.asarray(weight).astype(_F32)
  counts = jnp.logical_and(keep, w > 0)
  sq_sum, count, total = ns.sq_sum, ns.count, ns.weight
  if restart is not None:
    fresh = lambda x: jnp.where(restart, jnp.zeros_like(x), x)  # noqa: E731
    sq_sum, count, total = fresh(sq_sum), fresh(count), fresh(total)
  sq = sq_norm(grads) if sq is None else jnp.asarray(sq).astype(_F32)
  zero = jnp.zeros((), _F32)
  return ns._replace(
    sq_sum=sq_sum + jnp.where(counts, w * sq, zero),
    count=count + counts.astype(_F32),
    weight=total + jnp.where(counts, w, zero),
  )


def piece_weight(weight: jax.Array | None, pieces: Any) -> jax.Array | None:
  """One device's micro-batch weight in the units of the statistics.

  A weight the caller gives counts examples or tokens, whatever the layout: it is kept. The
  default unit is one *global* micro-batch: under an axis of `pieces` devices, each device
  holds ``1/pieces`` of it (its share of the rows), and a share's mean gradient has
  covariance ``pieces·Σ``; weighting it ``1/pieces`` keeps ``tr Σ`` that of one global
  micro-batch, so the same global micro-batches give the same estimates (in expectation) on
  one device and on many.

  Args:
    weight: the caller's weight, or None (the default weight).
    pieces: the number of devices that share one micro-batch (1 without an axis).

  Returns:
    `weight`, or ``1/pieces`` as a float32 scalar (None when `pieces` is the Python int 1).

  >>> from optax_accum.batch_size import _noise
  >>> _noise.piece_weight(None, 4)
  Array(0.25, dtype=float32)
  """
  if weight is not None:
    return weight
  if isinstance(pieces, int) and pieces == 1:
    return None
  return 1 / jnp.asarray(pieces, _F32)


def partials(ns: NoiseState) -> tuple[jax.Array, jax.Array, jax.Array]:
  """What a device contributes to the window's statistics: its ``(sq_sum, count, weight)``.

  Across devices, sum each over the axis (on the all-reduce that sums the window's gradients)
  and pass the sums to `close`; where the gradients were already all-reduced (every device
  added the same ones), divide the sums by the number of devices (`once`).

  Args:
    ns: this device's statistics, after the window's last `add`.

  Returns:
    ``(sq_sum, count, weight)``, float32 scalars.

  >>> from optax_accum.batch_size import _noise
  >>> _noise.partials(_noise.init())
  (Array(0., dtype=float32), Array(0., dtype=float32), Array(0., dtype=float32))
  """
  return ns.sq_sum, ns.count, ns.weight


def once(summed: tuple, copies: Any) -> tuple:
  """Global partials from sums over `copies` devices that each added the same gradients
  (already all-reduced by autodiff): they are one set of micro-batches, not `copies`.

  >>> from optax_accum.batch_size import _noise
  >>> _noise.once((8.0, 4.0, 4.0), 4)
  (2.0, 1.0, 1.0)
  """
  return tuple(x / copies for x in summed)


def window_stats(
  sq_sum: jax.Array, count: jax.Array, total: jax.Array, mean_sq: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """One window's estimates ``(T, Q)`` of ``tr Σ`` and ``|G|²``.

  ``T = (sq_sum − W·mean_sq) / (count − 1)`` and ``Q = mean_sq − T / W`` with ``W = total``.

  Args:
    sq_sum: ``Σ wᵢ|gᵢ|²`` over the window's kept micro-batches (all devices).
    count: the number of kept micro-batches (all devices).
    total: ``W = Σ wᵢ``, the window's total weight (all devices).
    mean_sq: ``|ḡ|²``, the squared norm of the window's weighted mean gradient.

  Returns:
    ``(T, Q)``, float32 scalars; both NaN where fewer than two micro-batches were kept or the
    total weight is not positive (nothing to estimate a variance from).

  >>> from optax_accum.batch_size import _noise
  >>> # two micro-batches, gradients 1 and 3 (weight 1 each): mean 2
  >>> _noise.window_stats(10.0, 2.0, 2.0, 4.0)
  (Array(2., dtype=float32), Array(3., dtype=float32))
  """
  sq_sum, count, total, mean_sq = (
    jnp.asarray(v).astype(_F32) for v in (sq_sum, count, total, mean_sq)
  )
  valid = (count >= 2) & (total > 0)
  safe_dof = jnp.where(valid, count - 1, jnp.ones_like(count))
  safe_total = jnp.where(valid, total, jnp.ones_like(total))
  trace = (sq_sum - safe_total * mean_sq) / safe_dof
  grad_sq = mean_sq - trace / safe_total
  nan = jnp.full((), jnp.nan, _F32)
  return jnp.where(valid, trace, nan), jnp.where(valid, grad_sq, nan)


def close(
  ns: NoiseState,
  mean_sq: jax.Array,
  sq_sum: jax.Array,
  count: jax.Array,
  total: jax.Array,
  decay: float = DEFAULT_DECAY,
) -> NoiseState:
  """Closes a window: its estimates ``(T, Q)`` (`window_stats`) into the EMAs.

  Call it on the emitting step with the window's *global* figures (already summed across
  devices). A window with fewer than two kept micro-batches, or with a non-finite estimate,
  measures nothing: the statistics are returned unchanged. ``sq_sum`` and ``count`` of `ns`
  are left as they are (the next `add` restarts them).

  Args:
    ns: the statistics.
    mean_sq: ``|ḡ|²`` of the window's weighted mean gradient ``ḡ = Σ wᵢgᵢ / W`` (e.g.
      ``sq_norm(sums) / W²`` from the accumulator's sums).
    sq_sum: ``Σ wᵢ|gᵢ|²`` of the window (`partials`, summed across devices).
    count: its number of kept micro-batches (likewise).
    total: ``W``, the window's total kept weight in the units of the statistics (likewise).
    decay: the EMAs' decay per window, a Python float in ``[0, 1)``.

  Returns:
    The updated `NoiseState`.

  Raises:
    ValueError: if `decay` is not in ``[0, 1)``.

  >>> import jax.numpy as jnp
  >>> from optax_accum.batch_size import _noise
  >>> ns = _noise.init()
  >>> for g in (1.0, 3.0):
  ...   ns = _noise.add(ns, jnp.array([g]), 1.0, True)
  >>> ns = _noise.close(ns, 4.0, *_noise.partials(ns))
  >>> _noise.scale(ns).b_simple  # T = 2, Q = 3
  Array(0.6666667, dtype=float32)
  """
  decay = _check_decay(decay)
  trace, grad_sq = window_stats(sq_sum, count, total, mean_sq)
  ok = jnp.isfinite(trace) & jnp.isfinite(grad_sq)

  def ema(old, new):
    return jnp.where(ok, decay * old + (1 - decay) * new, old).astype(_F32)

  return ns._replace(
    grad_sq_ema=ema(ns.grad_sq_ema, grad_sq),
    trace_ema=ema(ns.trace_ema, trace),
    ema_norm=ema(ns.ema_norm, jnp.ones((), _F32)),
    window_grad_sq=jnp.where(ok, grad_sq, ns.window_grad_sq),
    window_trace_cov=jnp.where(ok, trace, ns.window_trace_cov),
  )


def _check_decay(decay: Any) -> float:
  if isinstance(decay, bool) or not isinstance(decay, int | float | np.floating | np.integer):
    raise TypeError(
      f"decay must be a float in [0, 1), got {decay!r} of type {type(decay).__name__}."
    )
  if not 0 <= decay < 1:
    raise ValueError(f"decay must be in [0, 1), got {decay}.")
  return float(decay)


def scale(ns: NoiseState) -> NoiseScale:
  """The noise scale from the statistics: bias-corrected EMAs of Q and T, and their ratio.

  Args:
    ns: the statistics (their EMA fields; ``sq_sum``/``count`` are not read, so a state whose
      per-device fields are stacked works too).

  Returns:
    A `NoiseScale`; every field NaN until a window with at least two kept micro-batches closed.

  >>> from optax_accum.batch_size import _noise
  >>> _noise.scale(_noise.init()).grad_sq
  Array(nan, dtype=float32)
  """
  measured = ns.ema_norm > 0
  norm = jnp.where(measured, ns.ema_norm, jnp.ones_like(ns.ema_norm))
  nan = jnp.full((), jnp.nan, _F32)
  grad_sq = jnp.where(measured, ns.grad_sq_ema / norm, nan)
  trace = jnp.where(measured, ns.trace_ema / norm, nan)
  return NoiseScale(
    grad_sq=grad_sq,
    trace_cov=trace,
    b_simple=trace / grad_sq,
    window_grad_sq=ns.window_grad_sq,
    window_trace_cov=ns.window_trace_cov,
  )


_NO_NOISE = (
  "noise_scale: {what}. The statistics are kept only when asked for: build the optimizer with "
  "optax_accum.accumulate(inner, every_k, noise_scale=True) (or TrainStep(..., "
  "noise_scale=True)), then pass its state (or a state holding it: an optax.chain state, "
  "nnx.Optimizer.opt_state, TrainState.opt_state)."
)


def noise_scale(state: Any) -> NoiseScale:
  """The gradient noise scale measured by ``accumulate(..., noise_scale=True)``.

  Finds the one state holding the statistics inside `state` (an `optax.chain` state, an
  ``nnx.Optimizer``'s ``opt_state``, a Flax ``TrainState``, ...), as `has_updated` does.

  The statistics are measured from the gradients as they arrive, before any noise: on data
  that must stay private they are a release of their own, which no accountant covers. So a
  private path (a ``privacy.dp_noise`` in the inner chain, a clipped loss) refuses
  ``noise_scale=True`` and ``FollowNoiseScale`` (`optax_accum.privacy.CONTRACT`).

  Args:
    state: the optimizer state, or a state (pytree) that holds it.

  Returns:
    A `NoiseScale` of plain float32 arrays: `grad_sq` and `trace_cov` (smoothed ``|G|²`` and
    tr Σ), `b_simple` (their ratio, the simple noise scale, in units of the micro-batch
    weight: *global* micro-batches with the default weight 1, whatever the number of devices,
    examples or tokens when the weights count them), `window_grad_sq` and `window_trace_cov`
    (the last window's own estimates).
    All NaN until a window with at least two kept micro-batches has closed.

  Raises:
    ValueError: if `state` holds no noise statistics (``noise_scale=False``), or several
      (`optax_accum.core._find`, shared with `has_updated` and `progress`).

  >>> from optax_accum.batch_size import _noise
  >>> _noise.noise_scale((_noise.init(), ())).window_trace_cov
  Array(nan, dtype=float32)
  """
  return scale(_find.find(state, NoiseState, "noise_scale", _missing(state)))


def _missing(state: Any) -> str:
  """Why `state` holds no statistics: a state that keeps none (noise_scale=False), or none."""
  holds = lambda x: isinstance(x, tuple) and "noise" in getattr(x, "_fields", ())  # noqa: E731
  found = [x for x in jax.tree.leaves(state, is_leaf=holds) if holds(x)]
  what = (
    f"the {type(found[0]).__name__} in this {type(state).__name__} keeps no noise "
    "statistics (it was built with noise_scale=False)"
    if found
    else f"found no noise statistics in a {type(state).__name__}"
  )
  return _NO_NOISE.format(what=what)


class _FollowNoiseScaleFields(NamedTuple):
  """The fields of `FollowNoiseScale` (which checks them at construction)."""

  min_k: int = 1
  max_k: int | None = None
  micro_batch_weight: float = 1.0
  shrink: bool = False
  max_growth: float = 1.25


class FollowNoiseScale(_FollowNoiseScaleFields):
  """A window length that follows the measured noise scale: ``every_k=FollowNoiseScale(...)``.

  After each window, the next window's length is ``k = clip(round(B_simple /
  micro_batch_weight), min_k, max_k)`` micro-batches, with B_simple the smoothed estimate
  (`noise_scale`), so that the effective batch tracks the critical batch as it grows during
  training — the batch-size ramp of GPT-3 and of Pollux, driven by the measurement. The length
  changes only at window boundaries; every window is still exactly the large batch of its
  micro-batches. Until B_simple is measured (NaN), or while it is not a positive finite number
  (the smoothed ``|G|²`` is not positive yet), k stays where it is — except at k = 1 with
  nothing measured: a window of one micro-batch on one device measures nothing, so k steps to
  2 (within `max_k`) rather than stay at 1 for ever. A restored state whose window length lies
  outside ``[min_k, max_k]`` (another policy's) opens its next window clipped into it. To keep
  the recipe as the batch grows — the learning rate scaled by the AdaScale gain and schedules
  run on progress — end the inner chain with `optax_accum.scale_by_gain` (see the guide "How
  large a batch?", section "Changing the batch mid-run").

  Attributes:
    min_k: the shortest window, a positive int (the first window's length too).
    max_k: the longest window (what fits in memory or time), a positive int ``>= min_k``, or
      None for no bound.
    micro_batch_weight: the weight of one micro-batch, to turn B_simple from units of the
      weight into micro-batches: 1 for the default weight, the examples (tokens) per
      micro-batch when the weights count examples (tokens).
    shrink: when False (the default), k never goes below the length it reached: B_simple
      grows as the loss falls, and a noisy dip should not undo a ramp. True follows the
      estimate down as well.
    max_growth: the most k may grow in one window, a factor ``> 1`` (at least one
      micro-batch more is always allowed): ``k_next <= ceil(k · max_growth)``. The default,
      1.25, ramps from 2 to 32 micro-batches in 11 windows, a few percent of a run, yet
      keeps a noisy early estimate (short windows measure ``|G|²`` worst) from committing k at
      once to a length that, since k does not shrink, it would keep: while k ramps, the
      EMAs take in the longer, more precise windows. ``float("inf")``: no limit.

  Raises:
    TypeError, ValueError: for an argument of the wrong type or out of range, at construction.

  >>> from optax_accum.batch_size import _noise
  >>> _noise.FollowNoiseScale(min_k=2, max_k=32)
  FollowNoiseScale(min_k=2, max_k=32, micro_batch_weight=1.0, shrink=False, max_growth=1.25)
  """

  __slots__ = ()

  def __new__(
    cls,
    min_k: int = 1,
    max_k: int | None = None,
    micro_batch_weight: float = 1.0,
    shrink: bool = False,
    max_growth: float = 1.25,
  ) -> FollowNoiseScale:
    name = "FollowNoiseScale"
    min_k = _checks.positive_int(min_k, "min_k", name, maximum=_checks.MAX_WINDOW)
    if max_k is not None:
      max_k = _checks.positive_int(
        max_k, "max_k", name, alternative=" or None", maximum=_checks.MAX_WINDOW
      )
      if max_k < min_k:
        raise ValueError(f"{name}: max_k must be >= min_k, got max_k={max_k} < min_k={min_k}.")
    micro_batch_weight = _number(micro_batch_weight, "micro_batch_weight", name)
    if not (np.isfinite(micro_batch_weight) and micro_batch_weight > 0):
      raise ValueError(
        f"{name}: micro_batch_weight must be positive and finite, got {micro_batch_weight}."
      )
    if not isinstance(shrink, bool | np.bool_):
      raise TypeError(f"{name}: shrink must be a bool, got {shrink!r}.")
    max_growth = _number(max_growth, "max_growth", name)
    if not max_growth > 1:
      raise ValueError(f"{name}: max_growth must be > 1 (inf: no limit), got {max_growth}.")
    return super().__new__(cls, min_k, max_k, micro_batch_weight, bool(shrink), max_growth)

  # NamedTuple's `_replace` and `_make` build through `tuple.__new__`, past the checks above:
  # `_replace(min_k=0)` would make a policy that every window fails. Both go through them.
  @classmethod
  def _make(cls, iterable: Any) -> FollowNoiseScale:
    return cls(*iterable)

  def _replace(self, **changes: Any) -> FollowNoiseScale:
    unknown = set(changes) - set(self._fields)
    if unknown:
      raise ValueError(f"FollowNoiseScale._replace: no fields {sorted(unknown)}.")
    return type(self)(**{**self._asdict(), **changes})

  def clip(self, k: jax.Array | int) -> jax.Array:
    """`k` clipped into ``[min_k, max_k]``, an int32 scalar (a window length from another
    policy, e.g. a restored state's, becomes one this policy allows)."""
    hi = _checks.MAX_WINDOW if self.max_k is None else self.max_k
    return jnp.clip(jnp.asarray(k).astype(jnp.int32), self.min_k, hi).astype(jnp.int32)


def _number(value: Any, name: str, caller: str) -> float:
  """A real Python or NumPy number (not a bool, not NaN) as a float."""
  if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
    raise TypeError(
      f"{caller}: {name} must be a number, got {value!r} of type {type(value).__name__}."
    )
  if np.isnan(value):
    raise ValueError(f"{caller}: {name} must be a number, got nan.")
  return float(value)


def next_k(policy: FollowNoiseScale, ns: NoiseState, current_k: jax.Array | int) -> jax.Array:
  """The next window's length under `policy`, from the statistics after a window closed.

  ``k = clip(round(b_simple / micro_batch_weight), min_k, max_k)``, at most
  ``max(ceil(current_k · max_growth), current_k + 1)``; where b_simple is NaN, not positive or
  infinite (nothing measured yet, or a smoothed ``|G|²`` that is not positive), ``current_k``
  (2 for a ``current_k`` of 1 with nothing measured: such a window cannot measure); unless
  ``policy.shrink``, never below ``current_k``. The result is always in ``[min_k, max_k]``.

  Args:
    policy: a `FollowNoiseScale`.
    ns: the statistics (global: read after `close`).
    current_k: the length of the window that just closed, an integer scalar.

  Returns:
    An int32 scalar.

  >>> import jax.numpy as jnp
  >>> from optax_accum.batch_size import _noise
  >>> ns = _noise.init()._replace(grad_sq_ema=jnp.float32(1.0), trace_ema=jnp.float32(11.6),
  ...                             ema_norm=jnp.float32(1.0))
  >>> _noise.next_k(_noise.FollowNoiseScale(min_k=2, max_k=8), ns, 7)  # B_simple 11.6, max_k 8
  Array(8, dtype=int32)
  >>> _noise.next_k(_noise.FollowNoiseScale(min_k=2, max_k=32), ns, 4)  # ramps: 4 * 1.25
  Array(5, dtype=int32)
  >>> _noise.next_k(_noise.FollowNoiseScale(min_k=2, max_k=32), ns, 11)
  Array(12, dtype=int32)
  """
  if not isinstance(policy, FollowNoiseScale):
    raise TypeError(f"next_k: policy must be a FollowNoiseScale, got {type(policy).__name__}.")
  lo = policy.min_k
  hi = _checks.MAX_WINDOW if policy.max_k is None else policy.max_k
  current = jnp.asarray(current_k).astype(jnp.int32)
  b = scale(ns).b_simple / policy.micro_batch_weight
  usable = jnp.isfinite(b) & (b > 0)
  # Clip in float32 before the cast: a huge estimate must not wrap around in int32.
  cur = current.astype(_F32)
  step = jnp.maximum(jnp.ceil(cur * min(policy.max_growth, 2.0**30)), cur + 1)
  target = jnp.minimum(jnp.round(jnp.where(usable, b, 1.0)), step)
  target = jnp.clip(target, lo, min(hi, 2**30)).astype(jnp.int32)
  # One device at k = 1 measures nothing (one micro-batch, no variance): step up to 2.
  unmeasured = jnp.isnan(scale(ns).b_simple) & (current < 2)
  k = jnp.where(usable, target, jnp.where(unmeasured, 2, current))
  if not policy.shrink:
    k = jnp.maximum(k, current)
  return jnp.clip(k, lo, hi).astype(jnp.int32)
