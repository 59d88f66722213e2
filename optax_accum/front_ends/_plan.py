"""`plan_microbatches`: the fewest micro-batches whose compiled program fits in memory.

No trial runs: each candidate ``k`` is lowered and compiled (never executed), and XLA's own
memory analysis of the compiled program says how much device memory it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum.core import _batch, _hlo
from optax_accum.front_ends import _microbatch, _microbatch_checks
from optax_accum.parallel import _fsdp

NO_LIMIT = (
  "plan_microbatches: memory_limit=None asks the device for its memory limit, but {device} "
  "reports none (CPU devices never do). Pass the budget in bytes, e.g. "
  "memory_limit=8 * 2**30 for 8 GiB."
)


class MicrobatchPlan(NamedTuple):
  """The choice of `plan_microbatches` and the compiled peak of every candidate it tried."""

  num_microbatches: int  # the smallest k whose compiled peak fits in memory_limit
  peak_bytes: dict[int, int]  # k -> compiled peak (argument + output + temp - alias), bytes
  memory_limit: int  # the budget, bytes
  # FSDP, when `keep_unsharded` named several points: the one chosen (least communication),
  # and for each point that fits, ``(k, peak bytes, bytes each device sends per update)``.
  keep_unsharded: str | None = None
  points: dict[str, tuple[int, int, float]] | None = None

  def __str__(self) -> str:
    mib = 2.0**20
    if self.points is not None:
      rows = [
        f"  {p:<17s} k={k:<5d} peak {peak / mib:10.1f} MiB  sends {sent / mib:10.2f} MiB/update"
        for p, (k, peak, sent) in self.points.items()
      ]
      return (
        f"MicrobatchPlan: keep_unsharded={self.keep_unsharded!r}, num_microbatches="
        f"{self.num_microbatches} (limit {self.memory_limit / mib:.1f} MiB)\n" + "\n".join(rows)
      )
    rows = [
      f"  k={k:<6d} peak {p / mib:10.1f} MiB  {'fits' if p <= self.memory_limit else 'too big'}"
      for k, p in sorted(self.peak_bytes.items())
    ]
    return (
      f"MicrobatchPlan: num_microbatches={self.num_microbatches} "
      f"(limit {self.memory_limit / mib:.1f} MiB)\n" + "\n".join(rows)
    )


def _device_limit() -> int:
  device = jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # some backends raise instead of returning None
    stats = None
  if not stats or "bytes_limit" not in stats:
    raise ValueError(NO_LIMIT.format(device=f"{device.platform} device {device}"))
  return int(stats["bytes_limit"])


def _check_limit(memory_limit: Any) -> int:
  if memory_limit is None:
    return _device_limit()
  if isinstance(memory_limit, bool) or not isinstance(memory_limit, int | float | np.number):
    raise TypeError(
      f"plan_microbatches: memory_limit must be a number of bytes or None, got {memory_limit!r}."
    )
  if not 0 < memory_limit < float("inf"):
    raise ValueError(f"plan_microbatches: memory_limit must be positive bytes, got {memory_limit}.")
  return int(memory_limit)


def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def _candidates(args: tuple, kwargs: dict[str, Any], options: dict[str, Any]) -> list[int]:
  """The divisors of the batch size, from `microbatch`'s own reading of the batch arguments.

  With a Python int `num_real_microbatches` ``n``, only ``k >= n`` can hold ``n`` micro-batches.
  """
  for name in ("num_microbatches", "microbatch_size"):
    if name in options:
      raise TypeError(f"plan_microbatches: {name} is what it chooses; do not pass it.")
  pos = _batch.positions(
    options.get("batch_argnums"),
    options.get("batch_argnames", ()),
    options.get("batch_axes", 0),
    caller="plan_microbatches",
  )
  size = _batch.batch_size(_batch.resolve(pos, len(args), kwargs), args, kwargs)
  if size == 0:
    raise ValueError(
      "plan_microbatches: the batch arguments are empty (batch size 0): there is no "
      "micro-batch to plan. Pass the shapes of a real batch (arrays or jax.ShapeDtypeStruct)."
    )
  size //= _devices(options)  # with axis_name each device splits its own rows into k pieces
  n = _microbatch_checks.check_num_real(options.get("num_real_microbatches"), None)
  least = n if isinstance(n, int) else 1
  if least > size:
    raise ValueError(
      f"plan_microbatches: num_real_microbatches={n} is more than the batch size {size}: no "
      "num_microbatches can hold that many micro-batches."
    )
  return [k for k in _divisors(size) if k >= least]


def _devices(options: dict[str, Any]) -> int:
  """The devices the batch is split over: those of `axis_name` on the mesh (1 without it)."""
  axis = options.get("axis_name")
  mesh = options.get("mesh") or jax.sharding.get_abstract_mesh()
  if axis is None or mesh is None or mesh.empty:
    return 1
  names = axis if isinstance(axis, tuple | list) else (axis,)
  return int(np.prod([mesh.shape[a] for a in names if a in mesh.axis_names]))


def plan_microbatches(
  fun: Callable[..., Any],
  *args: Any,
  memory_limit: int | None = None,
  kwargs: dict[str, Any] | None = None,
  **microbatch_kwargs: Any,
) -> MicrobatchPlan:
  """Picks the smallest `num_microbatches` whose compiled `microbatch(fun, k)` fits in memory.

  The candidates are the divisors of the batch size ``B`` (read as `microbatch` reads it: the batch
  arguments named by `batch_argnums`/`batch_argnames`, along `batch_axes`), and only those ``k >=
  n`` for a Python-int `num_real_microbatches` ``n``. Each candidate is compiled with
  ``jax.jit(microbatch(fun, k, **microbatch_kwargs)).lower(*args, **kwargs).compile()`` — never run
  — and its peak is ``argument + output + temp - alias`` bytes from the compiled program's
  ``memory_analysis()`` (`optax_accum.core._hlo.peak_bytes`). The search gallops up the divisors
  (1st, 2nd, 4th, 8th, … smallest) until one fits, then bisects between the last that did not fit
  and the first that did, so it compiles ``O(log #divisors)`` programs, and usually one or two. It
  assumes, as XLA's estimates show in practice, that more micro-batches never need more memory; the
  returned ``k`` fits and the next smaller divisor (when there is one) was compiled and does not.

  FSDP: with ``keep_unsharded`` a sequence of points (e.g. ``("nothing", "params",
  "params_and_grads")``, see `microbatch`), it answers which point and which ``k`` to run
  within the budget: for each point the fewest micro-batches that fit (as above), and the
  bytes each device sends per update in that compiled program (every all-gather,
  reduce-scatter and all-reduce of its HLO, those in the loop times its trip count; ring
  algorithms), never from trial runs. The rule: the fewest micro-batches first — the
  smallest ``k`` that fits for any point — then, among the points that fit at that ``k``, the
  one that sends least (ties: the smaller peak). At equal ``k`` the points compute the same
  micro-batches, so the bytes are the whole difference; a point that fits only with more
  micro-batches trades bytes for smaller ones, whose cost (launches, smaller matrix products)
  the compiled program does not say, and which grows without bound (at one row per device a
  micro-batch, the point that sends least would run slowest). To accept a larger ``k`` for
  less communication, list only the points you want. ``plan.keep_unsharded`` is the choice,
  ``plan.points`` maps each point that fits to ``(k, peak bytes, bytes sent per update)``.

  Args:
    fun: the function to micro-batch, as for `microbatch`.
    *args: its positional arguments: arrays, or `jax.ShapeDtypeStruct`s so the full batch
      need never exist in memory.
    memory_limit: the budget in bytes; None means the device's reported limit
      (``jax.local_devices()[0].memory_stats()["bytes_limit"]``; GPUs and TPUs report one, CPUs
      do not).
    kwargs: `fun`'s keyword arguments (a dict), e.g. the batch when `batch_argnames` names it;
      arrays or `jax.ShapeDtypeStruct`s like `args`.
    **microbatch_kwargs: passed to `microbatch` (`batch_argnums`, `batch_argnames`,
      `batch_axes`, `num_real_microbatches`, `reduction`, `weight_fn`, …), all but
      `num_microbatches` and `microbatch_size`, which are what it chooses.

  Returns:
    A `MicrobatchPlan(num_microbatches, peak_bytes, memory_limit)`; `peak_bytes` maps every
    compiled candidate ``k`` to its peak. It prints as a small table.

  Raises:
    ValueError: when `memory_limit` is None and the device reports no limit, when no
      candidate fits (the message gives the smallest peak found), or when a Python-int
      `num_real_microbatches` exceeds the batch size; and `microbatch`'s errors.
    TypeError: for a bad `memory_limit`, or a `num_microbatches` or `microbatch_size` keyword.

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> def loss(w, x):
  ...   return jnp.mean(jnp.tanh(x @ w) ** 2)
  >>> w = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  >>> x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
  >>> plan = optax_accum.plan_microbatches(jax.value_and_grad(loss), w, x, memory_limit=2**30)
  >>> plan.num_microbatches  # 1 GiB is plenty for the whole batch
  1
  """
  kwargs = dict(kwargs or {})
  if isinstance(microbatch_kwargs.get("keep_unsharded"), tuple | list):
    return _choose_point(fun, args, memory_limit, kwargs, microbatch_kwargs)
  candidates = _candidates(args, kwargs, microbatch_kwargs)
  limit = _check_limit(memory_limit)
  peaks: dict[int, int] = {}

  def fits(n: int) -> bool:
    k = candidates[n]
    if k not in peaks:
      step = _microbatch.microbatch(fun, k, **microbatch_kwargs)
      peaks[k] = _hlo.peak_bytes(jax.jit(step).lower(*args, **kwargs).compile())
    return peaks[k] <= limit

  # Gallop: indices 0, 1, 3, 7, … (clipped to the last) until one fits.
  below, n = -1, 0
  while not fits(n):
    if n == len(candidates) - 1:
      k_min = min(peaks, key=peaks.get)
      raise ValueError(
        f"plan_microbatches: memory_limit={limit} bytes ({limit / 2**20:.1f} MiB) is too small "
        f"for any num_microbatches dividing the batch size {candidates[-1]}: the smallest "
        f"compiled peak was {peaks[k_min]} bytes ({peaks[k_min] / 2**20:.1f} MiB) at "
        f"num_microbatches={k_min}. The arguments alone (e.g. the parameters) may not fit; tried "
        f"{sorted(peaks)}."
      )
    below, n = n, min(2 * n + 1, len(candidates) - 1)
  # Bisect (below: does not fit, n: fits) down to neighbours.
  while n - below > 1:
    mid = (below + n) // 2
    if fits(mid):
      n = mid
    else:
      below = mid
  return MicrobatchPlan(candidates[n], dict(sorted(peaks.items())), limit)


def _choose_point(fun, args: tuple, memory_limit, kwargs: dict, options: dict) -> MicrobatchPlan:
  """FSDP: for each point of ``keep_unsharded`` (a sequence of them), the fewest micro-batches
  that fit (`plan_microbatches`: compiled memory), then the bytes its compiled program sends
  per update (`_hlo.collective_runs`: every all-gather, reduce-scatter and all-reduce, in-loop
  ones times the trip count); among the points whose ``k`` is the smallest found, the one
  that sends least wins (ties: the smaller peak)."""
  points = [_fsdp.check_keep(p, "plan_microbatches") for p in options["keep_unsharded"]]
  if not points or None in points:
    raise ValueError(
      "plan_microbatches: keep_unsharded, as a sequence, lists the points to choose among, "
      f"e.g. {_fsdp.KEEP_UNSHARDED}; got {options['keep_unsharded']!r}."
    )
  limit = _check_limit(memory_limit)
  found: dict[str, tuple[int, int, float]] = {}
  plans: dict[str, MicrobatchPlan] = {}
  errors = []
  for point in points:
    opts = {**options, "keep_unsharded": point}
    try:
      plans[point] = plan_microbatches(fun, *args, memory_limit=limit, kwargs=kwargs, **opts)
    except ValueError as e:
      if "is too small" not in str(e):
        raise
      errors.append(f"{point}: {e}")
      continue
    k = plans[point].num_microbatches
    step = _microbatch.microbatch(fun, k, **opts)
    text = jax.jit(step).lower(*args, **kwargs).compile().as_text()
    sent = sum(r.traffic for r in _hlo.collective_runs(text).values())
    found[point] = (k, plans[point].peak_bytes[k], sent)
  if not found:
    raise ValueError("plan_microbatches: no point fits.\n" + "\n".join(errors))
  fewest = min(k for k, _, _ in found.values())
  at_fewest = [p for p in found if found[p][0] == fewest]
  best = min(at_fewest, key=lambda p: (found[p][2], found[p][1]))
  return plans[best]._replace(keep_unsharded=best, points=found)
