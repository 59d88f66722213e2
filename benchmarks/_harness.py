"""Measurement tools shared by every benchmark section.

* `compile_fn` — lower and compile once, timing the compile separately from any run, and read
  XLA's own memory accounting (`compiled.memory_analysis()`) and HLO statistics.
* `hlo_stats` — counts, in the optimised HLO, what costs time or memory: top-level copies (and
  their bytes), conditionals, while loops, fusions, collectives, and where each collective
  sits (every call, inside a conditional branch, inside a loop body).
* `run_side_by_side` / `run_interleaved_steps` — run contenders side by side, rotating their
  order (round by round, or step by step), blocking on every result; `Timing` gives median and
  spread, `paired_ratio` the median of per-round ratios.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from optax_accum import _sharding

# ----------------------------------------------------------------------------------------------
# Compilation, memory, HLO.

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(
  r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple shape counts every element)."""
  total = 0.0
  for dtype, dims in _SHAPE.findall(shape):
    if dtype not in _DTYPE_BYTES:
      continue
    n = 1
    for d in dims.split(","):
      if d:
        n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
  return int(total)


@dataclass
class HloStats:
  """What the optimised HLO of one compiled program contains (fusion bodies excluded)."""

  copies: int = 0  # top-level `copy` instructions: real memory copies
  copy_bytes: int = 0
  conditionals: int = 0
  whiles: int = 0
  fusions: int = 0
  sqrt_ops: int = 0  # sqrt/rsqrt anywhere (fusion bodies included): Adam's update ran
  collectives: dict[str, int] = field(default_factory=dict)  # op -> count
  collective_bytes: dict[str, int] = field(default_factory=dict)  # placement -> bytes
  collective_where: dict[str, int] = field(default_factory=dict)  # placement -> count
  copies_where: dict[str, int] = field(default_factory=dict)  # placement -> copy bytes

  def as_dict(self) -> dict[str, Any]:
    return dict(self.__dict__)


def hlo_stats(text: str) -> HloStats:
  """Parses optimised HLO text (`compiled.as_text()`) into `HloStats`.

  Every instruction is placed by the path that reaches its computation from ENTRY: "step"
  (runs on every call), "cond" (inside a conditional branch: runs only when taken) or "loop"
  (inside a while body: runs once per iteration). Fusion bodies are not walked for copies:
  a fused copy is part of a kernel, not a separate pass over memory.
  """
  # The module split into computations is the library's own (`count_collectives` uses it).
  lines, entry = _sharding._computations(text)
  comps = {name: [m.groups() for m in map(_INSTR.match, body) if m] for name, body in lines.items()}

  # Walk the call graph from ENTRY, remembering the placement of every computation.
  fused: set[str] = set()
  placement: dict[str, str] = {}

  def visit(name: str, where: str) -> None:
    if name not in comps:
      return
    rank = {"step": 0, "loop": 1, "cond": 2}
    if name in placement and rank[placement[name]] >= rank[where]:
      return
    placement[name] = where
    for _, _, op, rest in comps[name]:
      if op == "fusion":
        for callee in _CALLS.findall(rest):
          fused.add(callee)
        continue
      branches = _BRANCHES.search(rest)
      callees = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
      if op == "conditional":
        callees += _CALLS.findall(rest)
        for c in callees:
          visit(c, "cond" if where != "cond" else where)
      elif op == "while":
        for c in _CALLS.findall(rest):
          visit(c, "loop" if where == "step" else where)
      elif op in ("call", "async-start", "custom-call"):
        for c in _CALLS.findall(rest):
          visit(c, where)

  if entry is not None:
    visit(entry, "step")

  stats = HloStats()
  for comp, instrs in comps.items():
    where = placement.get(comp)
    for _, shape, op, _rest in instrs:
      if op in ("sqrt", "rsqrt"):
        stats.sqrt_ops += 1
      if where is None or comp in fused:
        continue
      if op == "copy":
        stats.copies += 1
        b = shape_bytes(shape)
        stats.copy_bytes += b
        stats.copies_where[where] = stats.copies_where.get(where, 0) + b
      elif op == "conditional":
        stats.conditionals += 1
      elif op == "while":
        stats.whiles += 1
      elif op == "fusion":
        stats.fusions += 1
      base = op.removesuffix("-start")
      if base in _COLLECTIVES and not op.endswith("-done"):
        stats.collectives[base] = stats.collectives.get(base, 0) + 1
        stats.collective_where[where] = stats.collective_where.get(where, 0) + 1
        stats.collective_bytes[where] = stats.collective_bytes.get(where, 0) + shape_bytes(shape)
  return stats


@dataclass
class Compiled:
  """One compiled program: callable, compile seconds, XLA memory analysis, HLO stats."""

  fn: Any
  compile_s: float
  memory: dict[str, int]
  hlo: HloStats
  text: str

  def __call__(self, *args):
    return self.fn(*args)


def memory(compiled) -> dict[str, int]:
  """XLA's accounting of a compiled program; `peak` = argument + output + temp - alias."""
  ma = compiled.memory_analysis()
  if ma is None:  # some backends report nothing
    return {}
  out = {
    "argument": int(ma.argument_size_in_bytes),
    "output": int(ma.output_size_in_bytes),
    "temp": int(ma.temp_size_in_bytes),
    "alias": int(ma.alias_size_in_bytes),
  }
  out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


def compile_fn(f: Callable, *args, donate_argnums: Sequence[int] = (), **jit_kwargs) -> Compiled:
  """Lowers and compiles `f` for `args` (timed), with the given arguments donated."""
  t0 = time.perf_counter()
  lowered = jax.jit(f, donate_argnums=tuple(donate_argnums), **jit_kwargs).lower(*args)
  compiled = lowered.compile()
  dt = time.perf_counter() - t0
  text = compiled.as_text()
  return Compiled(compiled, dt, memory(compiled), hlo_stats(text), text)


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
