"""Measurement tools shared by every benchmark section.

* `compile_fn`, `compile_lowered` — lower and compile once, timing the compile separately from
  any run, and record XLA's own memory accounting and what the optimised HLO holds (copies,
  conditionals, loops, collectives, and where each sits: every call, inside a conditional
  branch, inside a loop body) as a `Program`. The HLO reader is the library's own
  (`optax_accum.core._hlo`, the module its structure tests use too), read only through its
  functions `hlo_stats` and `memory`.
* `run_side_by_side` / `run_interleaved_steps` — run contenders side by side, rotating their
  order (round by round, or step by step), blocking on every result; `Timing` gives median and
  spread, `paired_ratio` the median of per-round ratios.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from optax_accum.core import _hlo

# ----------------------------------------------------------------------------------------------
# Compilation, memory, HLO.

HloStats = _hlo.HloStats
hlo_stats = _hlo.hlo_stats
memory = _hlo.memory
shape_bytes = _hlo.shape_bytes


@dataclass
class Program:
  """One compiled program and its compile seconds; its optimised HLO text, XLA's memory
  accounting (`memory`) and what the HLO holds (`hlo_stats`) are read from it on first use."""

  fn: Any  # a `jax.stages.Compiled`
  compile_s: float

  @functools.cached_property
  def text(self) -> str:
    return self.fn.as_text()

  @functools.cached_property
  def memory(self) -> dict[str, int]:
    return memory(self.fn)

  @functools.cached_property
  def hlo(self) -> HloStats:
    return hlo_stats(self.text)

  def __call__(self, *args):
    return self.fn(*args)


def compile_lowered(lower: Callable[[], Any]) -> Program:
  """Compiles what `lower()` returns (a `jax.stages.Lowered`), timing lowering and compile."""
  t0 = time.perf_counter()
  compiled = lower().compile()
  return Program(compiled, time.perf_counter() - t0)


def compile_fn(
  f: Callable, *args: Any, donate_argnums: Sequence[int] = (), **jit_kwargs: Any
) -> Program:
  """Lowers and compiles ``jax.jit(f)`` for `args` (timed), with `donate_argnums` donated."""
  jitted = jax.jit(f, donate_argnums=tuple(donate_argnums), **jit_kwargs)
  return compile_lowered(lambda: jitted.lower(*args))


# glibc's largest dynamic mmap threshold on 64-bit Linux: allocations above it are fresh pages,
# faulted in on every call (see `_cross.faults_per_program`).
MMAP_THRESHOLD = 32 * 2**20


def tree_bytes(tree: Any) -> int:
  """Bytes held by the array leaves of `tree` (shapes and dtypes only; no transfer)."""
  return int(
    sum(np.prod(x.shape, dtype=np.int64) * x.dtype.itemsize for x in jax.tree.leaves(tree))
  )


def block(x: Any) -> Any:
  return jax.block_until_ready(x)


# ----------------------------------------------------------------------------------------------
# Timing.


@dataclass
class Timing:
  """Per-round seconds of one contender (already divided by its unit count)."""

  samples: list[float]

  @property
  def median(self) -> float:
    return statistics.median(self.samples)

  @property
  def spread(self) -> float:
    """Inter-quartile range relative to the median (0.05 means ±2.5% around the middle)."""
    if len(self.samples) < 2:
      return 0.0
    q1, q3 = np.percentile(self.samples, [25, 75])
    return float((q3 - q1) / self.median)

  def as_dict(self) -> dict[str, Any]:
    return {"median_s": self.median, "iqr_rel": self.spread, "n": len(self.samples)}


def paired_ratio(a: Timing, b: Timing) -> float:
  """Median over rounds of a/b, each pair measured back to back: robust to drifting load."""
  return float(statistics.median(x / y for x, y in zip(a.samples, b.samples, strict=True)))


def run_side_by_side(
  contenders: dict[str, Callable[[], Any]],
  *,
  rounds: int,
  warmup: int = 1,
  units: dict[str, float] | float = 1.0,
  progress: Any = None,
) -> dict[str, Timing]:
  """Times each contender `rounds` times, in a rotating order, after `warmup` calls each.

  Each contender is a zero-argument callable that runs one measured unit of work (e.g. one
  whole accumulation window) and returns arrays to block on. Its seconds are divided by
  `units[name]` (e.g. the window's k, so the figure is time per micro-step).
  """
  names = list(contenders)
  for _ in range(warmup):
    for n in names:
      block(contenders[n]())
  samples: dict[str, list[float]] = {n: [] for n in names}
  for r in range(rounds):
    order = names[r % len(names) :] + names[: r % len(names)]
    if r % 2:
      order = order[::-1]
    for n in order:
      t0 = time.perf_counter()
      block(contenders[n]())
      dt = time.perf_counter() - t0
      u = units[n] if isinstance(units, dict) else units
      samples[n].append(dt / u)
    if progress is not None:
      progress.update(1)
  return {n: Timing(s) for n, s in samples.items()}


def run_interleaved_steps(
  steps_fns: dict[str, Callable[[], Any]],
  *,
  steps: int,
  rounds: int,
  progress: Any = None,
) -> dict[str, Timing]:
  """Like `run_side_by_side`, interleaved at the granularity of single steps.

  A round is `steps` micro-steps of every contender, taken round robin (the order rotates
  every step), each blocked on before the next starts; a contender's sample is the sum of its
  `steps` step times divided by `steps`. No warm-up here: call the steps once before.
  """
  names = list(steps_fns)
  samples: dict[str, list[float]] = {n: [] for n in names}
  j = 0
  for _ in range(rounds):
    acc = dict.fromkeys(names, 0.0)
    for _ in range(steps):
      order = names[j % len(names) :] + names[: j % len(names)]
      if j % 2:
        order = order[::-1]
      j += 1
      for n in order:
        t0 = time.perf_counter()
        block(steps_fns[n]())
        acc[n] += time.perf_counter() - t0
    for n in names:
      samples[n].append(acc[n] / steps)
    if progress is not None:
      progress.update(1)
  return {n: Timing(s) for n, s in samples.items()}


def max_diff(a: Any, b: Any) -> tuple[float, float]:
  """(max abs difference, max abs difference / max abs of b) over all leaves."""
  la = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
  lb = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
  if len(la) != len(lb):
    raise AssertionError(f"trees differ: {len(la)} vs {len(lb)} leaves")
  d = max(float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(la, lb, strict=True))
  scale = max(float(np.max(np.abs(y))) if y.size else 0.0 for y in lb)
  return d, d / max(scale, 1e-30)


def fmt_bytes(n: float | None) -> str:
  if n is None:
    return "–"
  for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= div:
      return f"{n / div:.1f} {unit}"
  return f"{n:.0f} B"
