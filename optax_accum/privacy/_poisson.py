"""Poisson sampling on the host: logical batches of variable size, padded to fixed shapes.

Each example of ``range(N)`` enters logical batch ``t`` independently with probability ``q``
(the sampling the accountant assumes). Batch ``t`` is a pure function of ``(seed, t)``, so a
run is reproducible, and resuming at step ``t`` needs only ``t``. The sampled indices are
padded to whole micro-batches (and, for one compiled step, to a fixed number of them) with a
mask: padding rows repeat a real index and have mask 0, so `clipped_grad` gives them exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum.core._typing import SPLITS, Split

TOO_LARGE = (
  "PoissonSampler: logical batch {step} drew {n} examples, more than max_microbatches={m} "
  "micro-batches of {b} hold ({cap}). Dropping examples would silently break the privacy "
  "accounting (which assumes every sampled example is used), so this is an error. The "
  "expected size is {mean:.1f} (std {std:.1f}); choose max_microbatches so that "
  "max_microbatches * microbatch_size is at least the mean + 6 std, e.g. max_microbatches={hint}."
)


def _int(value: Any, name: str, low: int) -> int:
  """`value` as an int >= `low`: a TypeError for what is not an int (bool, float, str), a
  ValueError for one out of range."""
  need = "a positive int" if low == 1 else f"an int >= {low}"
  if isinstance(value, bool) or not isinstance(value, int | np.integer):
    raise TypeError(
      f"PoissonSampler: {name} must be {need}, got {value!r} of type {type(value).__name__}."
    )
  if value < low:
    raise ValueError(f"PoissonSampler: {name} must be {need}, got {value!r}.")
  return int(value)


def _rate(value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
    raise TypeError(
      f"PoissonSampler: sampling_rate must be a number in (0, 1], got {value!r} of type "
      f"{type(value).__name__}."
    )
  if not 0 < float(value) <= 1:  # NaN fails too
    raise ValueError(f"PoissonSampler: sampling_rate must be in (0, 1], got {value!r}.")
  return float(value)


class PoissonBatch(NamedTuple):
  """One Poisson-sampled logical batch, padded to whole micro-batches, with its layout."""

  step: int  # which logical batch (the update it feeds)
  indices: np.ndarray  # (num_microbatches * microbatch_size,) int64 example indices
  mask: np.ndarray  # same shape, bool: True for sampled examples, False for padding
  num_real: int  # the sampled examples (the realised batch size; not public)
  num_microbatches: int  # micro-batches holding real examples (at least 1)
  # how the rows are laid out into micro-batches: `microbatch`'s split of the same name
  split: Split = "strided"
  microbatch_size: int | None = None  # rows per micro-batch (None: rows / num_microbatches)

  def microbatch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, mask)`` of micro-batch `i` in this batch's own layout: what a host loop
    feeds micro-step `i` of `TrainStep`/`accumulate`, for ``i < num_microbatches`` (never
    slice the rows by hand: under the strided layout micro-batch ``i`` is rows ``i, i+k, …``).

    Raises:
      IndexError: for an `i` outside ``[0, k)``, ``k`` the batch's micro-batches (padding
        ones included).
    """
    rows = self.indices.shape[0]
    b = self.microbatch_size or rows // max(1, self.num_microbatches)
    k = rows // b
    if isinstance(i, bool) or not isinstance(i, int | np.integer) or not 0 <= i < k:
      raise IndexError(f"PoissonBatch.microbatch: i must be an int in [0, {k}), got {i!r}.")
    at = np.arange(i, rows, k) if self.split == "strided" else np.arange(i * b, (i + 1) * b)
    return self.indices[at], self.mask[at]

  def take(self, *arrays: Any, microbatch: int | None = None) -> tuple[Any, ...]:
    """The batch's rows of each array, then its mask: ``x_b, y_b, mask = batch.take(x, y)``.

    The mask travels with the rows, so the padding (copies of example 0) is never taken
    without it: pass them together to a clipped function that takes the mask (its
    `mask_argnum` right after the batch arguments, as `privacy.Mechanism`'s), e.g.
    ``step(params, state, *batch.take(x, y, microbatch=i))``.

    Args:
      *arrays: arrays (NumPy or JAX) whose leading axis is the data set's examples, or pytrees
        of them (a dict data set, ``{"image": ..., "label": ...}``: its rows, the same dict).
      microbatch: None for the whole padded batch, or `i` for micro-batch `i` in this batch's
        layout (`microbatch`).

    Returns:
      ``(rows of arrays[0], rows of arrays[1], ..., mask)`` (each a pytree like its argument);
      the mask is float32 (1 for sampled rows, 0 for padding).
    """
    if microbatch is None:
      at, mask = self.indices, self.mask
    else:
      at, mask = self.microbatch(microbatch)
    rows = tuple(jax.tree.map(lambda a: a[at], tree) for tree in arrays)
    return (*rows, mask.astype(np.float32))


class PoissonSampler:
  """Poisson-sampled logical batches of ``range(num_examples)``: seeded, reproducible, resumable.

  Every example is in logical batch ``t`` with probability `sampling_rate`, independently
  (``numpy.random.default_rng((seed, t))``), so batch ``t`` depends on nothing but the seed
  and ``t``. The indices are padded with masked rows to whole micro-batches:

  * across steps (`TrainStep`/`accumulate`): ``num_microbatches`` micro-steps per logical
    batch, the window length decided on the host (``force_emit`` on the last), nothing
    recompiled per size;
  * in one step (`microbatch`): give `max_microbatches` and every batch has
    ``max_microbatches * microbatch_size`` rows (one shape, one compilation), with
    ``num_real_microbatches = num_microbatches`` micro-batches to run.

  An empty draw still gives one (all-padding) micro-batch: the update must happen, with its
  noise, whatever was sampled.

  Args:
    num_examples: ``N``, the data set size.
    sampling_rate: ``q`` in (0, 1]; the expected batch size is ``q·N``.
    microbatch_size: rows per micro-batch ``b``.
    seed: an int; the run's sampling is a function of it alone.
    max_microbatches: pad every batch to this many micro-batches (fixed shapes). A draw
      larger than that raises (truncating would break the accounting). None: pad to
      the batch's own whole micro-batches.
    split: how the rows are laid out into micro-batches, for `microbatch` with
      ``num_real_microbatches``: "strided" (the default, as `microbatch`'s: micro-batch ``i``
      is rows ``i, i+k, …`` with ``k`` the batch's micro-batches) or "contiguous" (rows
      ``i·b … i·b+b-1``). Either way the real examples sit in the first ``num_microbatches``
      micro-batches. Give `microbatch` the same split (a batch laid out for the other one
      makes it raise, or poison its sums under `jax.jit`, rather than drop real rows); a host
      loop takes micro-batch ``i`` with `PoissonBatch.microbatch`, right for either.
    start: the first logical batch iteration yields (resume at ``start``).

  Raises:
    TypeError: for an argument of the wrong type (a size, seed or start that is not an int,
      e.g. a float or a bool; a rate that is not a number, e.g. the string "0.1"; a split
      that is not a string).
    ValueError: for sizes that are not positive, a negative seed or start, a rate outside
      (0, 1], an unknown split, or (when sampling) a draw larger than `max_microbatches`
      micro-batches hold.

  >>> import optax_accum
  >>> s = optax_accum.privacy.PoissonSampler(1000, 0.1, 32, seed=0, max_microbatches=6)
  >>> b = s.batch(3)
  >>> b.indices.shape, int(b.mask.sum()) == b.num_real, (s.batch(3).indices == b.indices).all()
  ((192,), True, np.True_)
  """

  def __init__(
    self,
    num_examples: int,
    sampling_rate: float,
    microbatch_size: int,
    *,
    seed: int,
    max_microbatches: int | None = None,
    split: Split = "strided",
    start: int = 0,
  ):
    self.num_examples = _int(num_examples, "num_examples", 1)
    self.sampling_rate = _rate(sampling_rate)
    self.microbatch_size = _int(microbatch_size, "microbatch_size", 1)
    self.seed = _int(seed, "seed", 0)
    if max_microbatches is not None:
      max_microbatches = _int(max_microbatches, "max_microbatches", 1)
    self.max_microbatches = max_microbatches
    if not isinstance(split, str):
      raise TypeError(f"PoissonSampler: split must be one of {SPLITS}, got {split!r}.")
    if split not in SPLITS:
      raise ValueError(f"PoissonSampler: split must be one of {SPLITS}, got {split!r}.")
    self.split = split
    self.step = _int(start, "start", 0)

  @property
  def expected_batch_size(self) -> float:
    """``q·N``: the public divisor of `dp_noise`."""
    return self.sampling_rate * self.num_examples

  def batch(self, step: int) -> PoissonBatch:
    """Logical batch `step`, a pure function of the seed and `step` (any order, any process).

    Args:
      step: which logical batch, an int >= 0.

    Returns:
      A `PoissonBatch`: the padded indices and mask, the realised size and the number of
      micro-batches that hold it.

    Raises:
      ValueError: with `max_microbatches`, if the draw does not fit in them.
    """
    rng = np.random.default_rng((self.seed, int(step)))
    sampled = np.flatnonzero(rng.random(self.num_examples) < self.sampling_rate)
    n, b = sampled.size, self.microbatch_size
    mbs = max(1, math.ceil(n / b))
    rows = mbs * b
    if self.max_microbatches is not None:
      if mbs > self.max_microbatches:
        raise ValueError(self._too_large(step, n))
      rows = self.max_microbatches * b
    # Where the j-th sampled example goes: micro-batch j // b, row j % b of it.
    # "strided": micro-batch i holds rows i, i + k, i + 2k, ... (`microbatch`'s split).
    j = np.arange(n)
    where = (j % b) * (rows // b) + j // b if self.split == "strided" else j
    indices = np.zeros(rows, np.int64)  # padding repeats example 0, masked out
    indices[where] = sampled
    mask = np.zeros(rows, bool)
    mask[where] = True
    return PoissonBatch(int(step), indices, mask, int(n), mbs, self.split, b)

  def _too_large(self, step: int, n: int) -> str:
    q, big_n, b = self.sampling_rate, self.num_examples, self.microbatch_size
    mean, std = q * big_n, math.sqrt(big_n * q * (1 - q))
    return TOO_LARGE.format(
      step=step, n=n, m=self.max_microbatches, b=b, cap=self.max_microbatches * b, mean=mean,
      std=std, hint=math.ceil((mean + 6 * std) / b),
    )  # fmt: skip

  def __iter__(self) -> Iterator[PoissonBatch]:
    return self

  def __next__(self) -> PoissonBatch:
    batch = self.batch(self.step)
    self.step += 1
    return batch
