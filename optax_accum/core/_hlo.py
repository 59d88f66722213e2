"""Reading compiled programs: the one HLO reader of the library, its tests and benchmarks.

`jax.jit(f).lower(*args).compile()` gives ``.as_text()``, the optimised HLO module, and
``.memory_analysis()``, XLA's byte accounting. This module turns them into the facts the
library's structure guards and benchmarks are about:

* `computations` — the module split into computations of parsed instructions (in a scheduled
  module, ``is_scheduled=true``, each computation's instructions are in their run order);
  `operands` and `ancestors` — what an instruction depends on;
* `count_collectives`, `conditional_branches` — collectives per program, per loop body, per
  branch of a conditional (one all-reduce per update, none inside a loop);
* `hlo_stats` — copies, conditionals, loops, fusions and collectives, each placed by how often
  it runs (every call, inside a loop body, inside a conditional branch);
* `narrowing_ops` — the reductions and matrix-vector products of large buffers, placed alike;
* `memory`, `peak_bytes` — argument, output, temp and alias bytes, and the compiled peak
  ``argument + output + temp - alias``;
* `compile_fn` — all of the above for one jitted function, with its compile time.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP = re.compile(r"\s*([\w\-]+)\((.*)$")
_CALL = re.compile(
  r"\b(?:to_apply|body|condition|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALL_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_DTYPE_BYTES = {
  "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip


class Instruction(NamedTuple):
  """One HLO instruction: ``%name = <shape> op(<rest>``."""

  name: str
  shape: str  # the result type, e.g. "f32[8,4]{1,0}" or "(f32[2], s32[])"
  op: str  # the opcode, e.g. "fusion", "all-reduce-start", "while"
  rest: str  # operands and attributes


def parse_instruction(line: str) -> Instruction | None:
  """Parses one instruction line; None for anything else."""
  m = _NAME.match(line.strip())
  if not m:
    return None
  name, rhs = m.groups()
  depth, i = 0, 0
  while i < len(rhs):  # skip the (possibly nested tuple) type up to the first top-level space
    c = rhs[i]
    depth += c in "([{"
    depth -= c in ")]}"
    if c == " " and depth == 0:
      break
    i += 1
  op = _OP.match(rhs[i:])
  return Instruction(name, rhs[:i], op.group(1), op.group(2)) if op else None


def computations(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
  """The instructions of each computation in an HLO module's text, and the entry's name."""
  comps: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    stripped = line.strip()
    if current is None:
      m = _COMPUTATION.match(stripped)
      if m and "=" not in stripped.split("(")[0]:
        current = m.group(1)
        comps[current] = []
        if stripped.startswith("ENTRY"):
          entry = current
    elif stripped == "}":
      current = None
    elif (instr := parse_instruction(stripped)) is not None:
      comps[current].append(instr)
  return comps, entry


_OPERAND = re.compile(r"%([\w.\-]+)")


def operands(instr: Instruction) -> list[str]:
  """The names of an instruction's operands (its argument list, not the computations it
  calls)."""
  depth = 1
  for end, c in enumerate(instr.rest):  # the argument list ends at its closing parenthesis
    depth += c in "([{"
    depth -= c in ")]}"
    if depth == 0:
      return _OPERAND.findall(instr.rest[:end])
  return _OPERAND.findall(instr.rest)


def ancestors(instrs: list[Instruction], name: str) -> set[str]:
  """Every instruction of one computation that `name` depends on, directly or not (its
  operands, theirs, ...): what must have run before it, in any schedule."""
  by_name = {i.name: i for i in instrs}
  seen: set[str] = set()
  todo = [name]
  while todo:
    for o in operands(by_name[todo.pop()]):
      if o not in seen and o in by_name:
        seen.add(o)
        todo.append(o)
  return seen


def callees(instr: Instruction) -> list[str]:
  """The computations an instruction calls (fusion bodies, loop bodies, branches, ...)."""
  names = _CALL.findall(instr.rest)
  for group in _CALL_LIST.findall(instr.rest):
    names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
  return names


def reachable(comps: dict[str, list[Instruction]], roots: list[str]) -> set[str]:
  """Every computation reachable from `roots` through calls."""
  seen: set[str] = set()
  todo = collections.deque(roots)
  while todo:
    c = todo.popleft()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for instr in comps[c]:
      todo.extend(callees(instr))
  return seen


def _is(instr: Instruction, kind: str, min_bytes: int = 0) -> bool:
  # An async pair (-start/-done) counts once.
  if instr.op not in (kind, kind + "-start"):
    return False
  return min_bytes <= 0 or shape_bytes(instr.shape) >= min_bytes


def count_collectives(
  hlo_text: str,
  kind: str = "all-reduce",
  *,
  where: Literal["all", "loop", "entry"] = "all",
  min_bytes: int = 0,
) -> int:
  """Counts the collective ops of one kind in a compiled program's HLO text.

  Asynchronous pairs (``all-reduce-start``/``-done``) count once.

  Args:
    hlo_text: ``jax.jit(f).lower(*args).compile().as_text()``.
    kind: the HLO opcode, e.g. ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``.
    where: ``"all"`` (every computation the entry computation reaches), ``"loop"`` (only those
      inside a ``while`` body or condition, or what they call), or ``"entry"``.
    min_bytes: count only ops whose result holds at least this many bytes, e.g. to count the
      gradient-sized all-reduces and not a scalar loss's (a fused all-reduce counts its whole
      result).

  Returns:
    The number of such ops.

  Raises:
    ValueError: for an unknown `kind` or `where`.

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> text = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile().as_text()
  >>> optax_accum.count_collectives(text)
  0
  """
  if kind not in COLLECTIVES:
    raise ValueError(f"count_collectives: kind must be one of {COLLECTIVES}, got {kind!r}.")
  if where not in ("all", "loop", "entry"):
    raise ValueError(f"count_collectives: where must be 'all', 'loop' or 'entry', got {where!r}.")
  comps, entry = computations(hlo_text)
  counts = {name: sum(_is(i, kind, min_bytes) for i in instrs) for name, instrs in comps.items()}
  if entry is None:
    return sum(counts.values())
  if where == "entry":
    return counts[entry]
  roots = [entry]
  if where == "loop":
    roots = [c for instrs in comps.values() for i in instrs if i.op == "while" for c in callees(i)]
  return sum(counts.get(c, 0) for c in reachable(comps, roots))


def conditional_branches(hlo_text: str, kind: str = "all-reduce") -> list[list[int]]:
  """For each ``conditional`` op: the count of `kind` ops reachable from each of its branches.

  Branches are in HLO order: for a boolean ``lax.cond(pred, true_fun, false_fun)`` JAX emits
  ``branch_computations={false_fun, true_fun}``.
  """
  comps, _ = computations(hlo_text)
  return [
    [sum(_is(x, kind) for c in reachable(comps, [b]) for x in comps[c]) for b in callees(i)]
    for instrs in comps.values()
    for i in instrs
    if i.op == "conditional"
  ]


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple shape counts every element)."""
  total = 0.0
  for dtype, dims in _SHAPE.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _DTYPE_BYTES.get(dtype, 0)
  return int(total)


Placement = Literal["step", "loop", "cond"]


def placements(comps: dict[str, list[Instruction]], entry: str) -> tuple[dict[str, str], set[str]]:
  """How often each computation runs, and which computations are fusion bodies.

  "step": on every call; "loop": inside a while body (once per iteration); "cond": inside a
  conditional branch (only when taken). A computation reached several ways gets the most
  specific placement (cond over loop over step).
  """
  rank = {"step": 0, "loop": 1, "cond": 2}
  fused: set[str] = set()
  placement: dict[str, str] = {}
  todo = [(entry, "step")]
  while todo:
    name, where = todo.pop()
    if name not in comps or (name in placement and rank[placement[name]] >= rank[where]):
      continue
    placement[name] = where
    for instr in comps[name]:
      if instr.op == "fusion":
        fused.update(callees(instr))
      elif instr.op == "conditional":
        todo += [(c, "cond") for c in callees(instr)]
      elif instr.op == "while":
        todo += [(c, "loop" if where == "step" else where) for c in callees(instr)]
      elif instr.op in ("call", "async-start", "custom-call"):
        todo += [(c, where) for c in callees(instr)]
  return placement, fused


@dataclasses.dataclass
class HloStats:
  """What the optimised HLO of one compiled program contains (fusion bodies excluded)."""

  copies: int = 0  # top-level `copy` instructions: real memory copies
  copy_bytes: int = 0
  conditionals: int = 0
  whiles: int = 0
  fusions: int = 0
  sqrt_ops: int = 0  # sqrt/rsqrt anywhere (fusion bodies included): Adam's update ran
  collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # op -> count
  collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # placement -> bytes
  collective_where: dict[str, int] = dataclasses.field(default_factory=dict)  # placement -> count
  copies_where: dict[str, int] = dataclasses.field(default_factory=dict)  # placement -> bytes

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def hlo_stats(hlo_text: str) -> HloStats:
  """Parses optimised HLO text (``compiled.as_text()``) into `HloStats`.

  Every instruction is placed by `placements`. Fusion bodies are not counted for copies: a
  fused copy is part of a kernel, not a separate pass over memory.
  """
  comps, entry = computations(hlo_text)
  placement, fused = placements(comps, entry) if entry is not None else ({}, set())
  stats = HloStats()

  def bump(d: dict[str, int], key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n

  for comp, instrs in comps.items():
    where = placement.get(comp)
    for instr in instrs:
      op = instr.op
      stats.sqrt_ops += op in ("sqrt", "rsqrt")
      if where is None or comp in fused:
        continue
      stats.conditionals += op == "conditional"
      stats.whiles += op == "while"
      stats.fusions += op == "fusion"
      if op == "copy":
        stats.copies += 1
        stats.copy_bytes += shape_bytes(instr.shape)
        bump(stats.copies_where, where, shape_bytes(instr.shape))
      base = op.removesuffix("-start")
      if base in COLLECTIVES and not op.endswith("-done"):
        bump(stats.collectives, base)
        bump(stats.collective_where, where)
        bump(stats.collective_bytes, where, shape_bytes(instr.shape))
  return stats


_NARROWING = ("fusion", "reduce", "reduce-window", "dot")


def narrowing_ops(hlo_text: str, min_read: int, max_write: int) -> list[tuple[str, Instruction]]:
  """``(placement, instruction)`` of each op that reads a buffer of at least `min_read` bytes
  and writes fewer than `max_write`: a reduction (a fusion, a reduce or a reduce-window) or a
  `dot` down to a vector, e.g. a squared norm or the finite check of a gradient. Fusion bodies
  are part of their fusion; placements as `placements` gives them."""
  comps, entry = computations(hlo_text)
  if entry is None:
    return []
  placement, fused = placements(comps, entry)
  found = []
  for comp, instrs in comps.items():
    where = placement.get(comp)
    if where is None or comp in fused:
      continue
    shapes = {i.name: i.shape for i in instrs}
    for i in instrs:
      if i.op not in _NARROWING or shape_bytes(i.shape) >= max_write:
        continue
      operands = [o.strip().lstrip("%") for o in i.rest.split(")")[0].split(",")]
      if any(shape_bytes(shapes.get(o, "")) >= min_read for o in operands):
        found.append((where, i))
  return found


def memory(compiled: Any) -> dict[str, int]:
  """XLA's byte accounting of a compiled program, with ``peak`` (see `peak_bytes`).

  Empty where the backend reports none.
  """
  m = compiled.memory_analysis()
  if m is None:
    return {}
  out = {
    "argument": int(m.argument_size_in_bytes),
    "output": int(m.output_size_in_bytes),
    "temp": int(m.temp_size_in_bytes),
    "alias": int(m.alias_size_in_bytes),
  }
  # Arguments and outputs live for the whole call, temporaries are XLA's scratch buffers, and
  # outputs that alias (donated) arguments are counted once.
  out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


def peak_bytes(compiled: Any) -> int:
  """The device memory a compiled program needs: ``argument + output + temp - alias`` bytes.

  Raises:
    RuntimeError: if the backend reports no memory analysis.
  """
  m = memory(compiled)
  if not m:
    raise RuntimeError("this backend's compiled programs report no memory analysis.")
  return m["peak"]


@dataclasses.dataclass
class Compiled:
  """One compiled program: callable, compile seconds, memory (`memory`), HLO stats, HLO text."""

  fn: Any
  compile_s: float
  memory: dict[str, int]
  hlo: HloStats
  text: str

  def __call__(self, *args):
    return self.fn(*args)


def compile_fn(
  f: Callable, *args: Any, donate_argnums: Sequence[int] = (), **jit_kwargs: Any
) -> Compiled:
  """Lowers and compiles ``jax.jit(f)`` for `args` (timed), with `donate_argnums` donated."""
  t0 = time.perf_counter()
  compiled = jax.jit(f, donate_argnums=tuple(donate_argnums), **jit_kwargs).lower(*args).compile()
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  return Compiled(compiled, seconds, memory(compiled), hlo_stats(text), text)


# ----------------------------------------------------------------------------------------------
# Collective traffic: each collective with how often it runs and the groups it spans; and per
# kind, FSDP's table (`collective_runs`), summed from the same ops.

_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GATHERS = ("all-gather", "reduce-scatter", "all-reduce")


class CollectiveOp(NamedTuple):
  """One collective of a compiled program, placed by how often it runs."""

  op: str  # the opcode without "-start", e.g. "all-reduce"
  placement: str  # "step", "loop" or "cond", as `placements` gives it
  conditionals: int  # the conditionals around it (0: it runs whenever its loop does)
  repeats: int | None  # runs per call: the product of the enclosing loops' trip counts (1
  # outside loops; None where a loop's trip count is not known)
  result_bytes: int  # bytes of its result (a combined collective: all of its operands)
  input_bytes: int  # bytes it reads per device: the result's, times the group for a
  # reduce-scatter (which returns 1/group of what it reduces)
  input_elements: int  # elements it reads per device (as `input_bytes`)
  groups: list[list[int]] | None  # replica groups (device ids), None if not given or not parsed


def replica_groups(rest: str) -> list[list[int]] | None:
  """The replica groups of one collective (its HLO line after the opcode), in the explicit
  (``{{0,1},{2,3}}``) or the iota (``[2,2]<=[4]``, ``[2,2]<=[2,2]T(1,0)``) spelling; None for
  any other spelling or none."""
  m = _EXPLICIT_GROUPS.search(rest)
  if m:
    return [list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
  m = _IOTA_GROUPS.search(rest)
  if not m:
    return None
  dims = [int(d) for d in m.group(3).split(",")]
  total = int(np.prod(dims))
  ids = np.arange(total).reshape(dims)
  if m.group(4):  # a transposed iota: device ids laid out in `dims`, axes permuted
    ids = ids.transpose([int(d) for d in m.group(4).split(",")])
  ids = ids.reshape(-1).tolist()
  rows, cols = int(m.group(1)), int(m.group(2))
  return [ids[r * cols : (r + 1) * cols] for r in range(rows)]


def trip_count(instr: Instruction) -> int | None:
  """A ``while`` instruction's trip count where XLA knows it (``known_trip_count`` in its
  backend config: a `lax.scan` or a `fori_loop` with static bounds), else None."""
  m = _TRIP_COUNT.search(instr.rest)
  return int(m.group(1)) if m else None


class _Runs(NamedTuple):
  """How often one computation runs per call of the program."""

  repeats: int | None  # the product of the trip counts of the loops around it (None: unknown)
  conditionals: int  # the conditionals around it (their branches run only when taken)
  counted: int  # `repeats` with a loop of unknown trip count counted once (FSDP's table)
  looped: bool  # inside a loop


def _merge(old: _Runs | None, new: _Runs) -> _Runs:
  """A computation reached several ways: the most runs (an unknown count the most), the
  fewest conditionals; for the counted runs the most, and inside a loop if that path is."""
  if old is None:
    return new
  m, n = old.repeats, new.repeats
  repeats = None if m is None or n is None else max(m, n)
  if new.counted > old.counted:
    counted, looped = new.counted, new.looped
  else:
    counted, looped = old.counted, old.looped or (new.counted == old.counted and new.looped)
  return _Runs(repeats, min(old.conditionals, new.conditionals), counted, looped)


def _runs(comps: dict[str, list[Instruction]], entry: str) -> dict[str, _Runs]:
  """For each computation reachable from `entry`, how often it runs per call (`_Runs`)."""
  out: dict[str, _Runs] = {}
  todo: list[tuple[str, _Runs]] = [(entry, _Runs(1, 0, 1, False))]
  while todo:
    name, reached = todo.pop()
    if name not in comps:
      continue
    merged = _merge(out.get(name), reached)
    if merged == out.get(name):
      continue
    out[name] = merged
    for instr in comps[name]:
      inner = merged
      if instr.op == "while":
        trips = trip_count(instr)
        n = None if merged.repeats is None or trips is None else merged.repeats * trips
        inner = _Runs(n, merged.conditionals, merged.counted * (trips or 1), True)
      elif instr.op == "conditional":
        inner = merged._replace(conditionals=merged.conditionals + 1)
      todo += [(c, inner) for c in callees(instr)]
  return out


class _Found(NamedTuple):
  """A collective as the two readers below take it: the op, how often its computation runs,
  and what it reads and returns."""

  op: CollectiveOp
  runs: _Runs
  operand_bytes: int  # the bytes of its operands (an async start's shape holds them too)


def _found(hlo_text: str) -> list[_Found]:
  """Every collective of a compiled program (an async pair once), read once: one walk of the
  computations (`_runs`), one parser of the replica groups (`replica_groups`)."""
  comps, entry = computations(hlo_text)
  if entry is None:
    return []
  placement, _ = placements(comps, entry)
  runs = _runs(comps, entry)
  found = []
  for comp, instrs in comps.items():
    if comp not in runs:
      continue
    shapes = {i.name: i.shape for i in instrs}
    for i in instrs:
      base = i.op.removesuffix("-start")
      if base not in COLLECTIVES or i.op.endswith("-done"):
        continue
      groups = replica_groups(i.rest)
      parts = _SHAPE.findall(i.shape)
      if i.op == "all-gather-start":  # its shape is (operand, result)
        parts = parts[1:]
      size = sum(shape_bytes(f"{t}[{d}]") for t, d in parts)
      elements = sum(int(np.prod([int(x) for x in d.split(",") if x])) for _, d in parts)
      scale = max(len(g) for g in groups) if base == "reduce-scatter" and groups else 1
      where = placement.get(comp, "step")
      reach = runs[comp]
      op = CollectiveOp(
        base, where, reach.conditionals, reach.repeats, size, size * scale, elements * scale,
        groups,
      )  # fmt: skip
      ins = sum(shape_bytes(shapes.get(o, "")) for o in operands(i))
      found.append(_Found(op, reach, ins))
  return found


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
  """Every collective of a compiled program (an async pair once), with its placement, its runs
  per call and its bytes: what `count_collectives` counts, with the traffic it moves.

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> from optax_accum.core import _hlo
  >>> _hlo.collective_ops(jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile().as_text())
  []
  """
  return [f.op for f in _found(hlo_text)]


class CollectiveRuns(NamedTuple):
  """The collectives of one kind that one call of a compiled program runs."""

  outside: int  # ops that run once per call (outside every loop)
  in_loop: int  # op runs inside loops: each op times its loops' trip counts
  ops_in_loop: int  # distinct ops inside loops (each counted once)
  bytes: int  # the full buffers they handle, all runs (all-gather: its result; reduce-scatter:
  # its operand; all-reduce: its result)
  traffic: float  # bytes each device sends, all runs, ring algorithms: (n-1)/n of the full
  # buffer for an all-gather or a reduce-scatter over n devices, 2(n-1)/n for an all-reduce

  @property
  def runs(self) -> int:
    return self.outside + self.in_loop


def collective_runs(hlo_text: str, *, min_bytes: int = 0) -> dict[str, CollectiveRuns]:
  """What one call of a compiled program communicates: for each of all-gather, reduce-scatter
  and all-reduce, the ops outside loops and the op runs inside them (times the loops' trip
  counts; a loop whose trip count XLA does not know counts once), and their bytes
  (`CollectiveRuns`). The ops are `collective_ops`', summed by kind.

  Args:
    hlo_text: ``jax.jit(f).lower(*args).compile().as_text()``.
    min_bytes: count only ops whose full buffer holds at least this many bytes (e.g. to leave
      out a scalar loss's all-reduce).

  Returns:
    ``{kind: CollectiveRuns}`` for the three kinds (zeros where there are none).

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> text = jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile().as_text()
  >>> optax_accum.core._hlo.collective_runs(text)["all-reduce"].runs
  0
  """
  found = {k: [0, 0, 0, 0, 0.0] for k in _GATHERS}
  for f in _found(hlo_text):
    kind = f.op.op
    if kind not in found:
      continue
    full, size = _full_bytes(f)
    if full < min_bytes:
      continue
    n, looped = f.runs.counted, f.runs.looped
    row = found[kind]
    row[1 if looped else 0] += n
    row[2] += looped
    row[3] += n * full
    share = (size - 1) / size if size else 1.0
    row[4] += n * full * share * (2 if kind == "all-reduce" else 1)
  return {k: CollectiveRuns(*r[:4], r[4]) for k, r in found.items()}


def _full_bytes(f: _Found) -> tuple[int, int | None]:
  """The full buffer a collective handles (all-gather: its result; reduce-scatter: its
  operand; all-reduce: its result), and its group size (None where unknown): for a gather or
  a scatter the ratio of the two, else the replica groups'."""
  out, ins, groups = f.op.result_bytes, f.operand_bytes, f.op.groups
  group = len(groups[0]) if groups else None
  if f.op.op == "all-gather":
    return out, round(out / ins) if ins else group
  if f.op.op == "reduce-scatter":
    return ins, round(ins / out) if out else group
  return out, group
