"""The audit's collectives row: what the loop reduces over the data axis per update, in bytes.

One update should reduce one gradient's worth over the data axis, however many collectives
carry it. Counting collectives inside compiled loops is not enough: XLA combines the k
all-reduces of a Python loop of ``pmean``s into one that moves k gradients, and a loop that
spans calls reduces on every call. So each program's reductions are weighted by how often they
run per update — a loop body by its trip count, a micro-step's program k times, a conditional
of the emitting step once — and their elements summed, against one gradient's elements per
device. With parameters sharded over the data axis (FSDP), a reduce-scatter per micro-batch is
the least-memory choice (`keep_unsharded`), not a fault: above one gradient the row is then
"info" unless all-reduces alone pass it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from optax_accum.auditing._report import Check
from optax_accum.core import _hlo

# Collectives that read fewer bytes than this per device are scalars (loss, weight, finite
# flags) and are not counted as gradient reductions (what a reduce-scatter reads: its result is
# one device's share, a few bytes for a small parameter over many devices).
GRAD_MIN_BYTES = 32
REDUCTIONS = ("all-reduce", "reduce-scatter")
# More than this many gradients' elements reduced per update is a reduction per micro-batch
# (k >= 2 of them); one gradient, with the scalars and a weight beside it, is what is right.
MAX_GRADIENTS = 1.5


def data_axis(s: Any) -> Any:
  """The data axis: `axis_name`, else the mesh axis the batch's rows are sharded over, else
  the mesh's first axis."""
  if s.axis_name is not None or s.mesh is None:
    return s.axis_name
  spec = getattr(getattr(jax.tree.leaves(s.batch)[0], "sharding", None), "spec", None)
  return spec[0] if spec and isinstance(spec[0], str) else s.mesh.axis_names[0]


def _crosses(groups: list[list[int]] | None, mesh: Any, axis: Any) -> bool:
  """Whether a collective with these groups reduces across the data axis of `mesh` (device
  ids are positions in ``mesh.devices.flat``, the programs' device assignment)."""
  axes = axis if isinstance(axis, tuple) else (axis,)
  if groups is None or mesh is None or not all(a in mesh.axis_names for a in axes):
    return True
  dims = [mesh.axis_names.index(a) for a in axes]
  coord = lambda d: tuple(np.unravel_index(d, mesh.devices.shape)[i] for i in dims)
  return any(len({coord(d) for d in g}) > 1 for g in groups)


def gradient_elements(s: Any) -> int:
  """One gradient's elements per device: each parameter's, divided over the mesh axes other
  than the data axis that shard it (a model axis); the data axis's own share is reduced."""
  axis = data_axis(s)
  data = set(axis if isinstance(axis, tuple) else (axis,))
  total = 0
  for p in jax.tree.leaves(s.params):
    n = int(np.prod(np.shape(p)))
    spec = getattr(getattr(p, "sharding", None), "spec", None)
    mesh = getattr(getattr(p, "sharding", None), "mesh", None)
    for entry in spec or ():
      for a in entry if isinstance(entry, tuple) else (entry,):
        if a is not None and a not in data and mesh is not None:
          n //= mesh.shape[a]
    total += n
  return total


def sharded_over_data(s: Any) -> bool:
  """Whether any parameter is sharded over the data axis (FSDP): its gradient is then
  reduce-scattered, and a reduce-scatter per micro-batch is a memory choice, not a fault."""
  axis = data_axis(s)
  data = set(axis if isinstance(axis, tuple) else (axis,))
  for p in jax.tree.leaves(s.params):
    spec = getattr(getattr(p, "sharding", None), "spec", None)
    for entry in spec or ():
      if any(a in data for a in (entry if isinstance(entry, tuple) else (entry,))):
        return True
  return False


def _per_update(op: _hlo.CollectiveOp, kind: str, k: int) -> tuple[int, bool]:
  """How often one collective runs per update, and whether it is a rare one (in a
  conditional taken only on a fault, never counted): `kind` is "update" (a program run once
  per update), "micro" (run on every micro-step; its conditional is the emitting step's) or
  "closing" (once per update; its conditionals are fault paths)."""
  repeats = k if op.repeats is None else op.repeats
  if kind == "closing":
    return (0, True) if op.conditionals else (repeats, False)
  if kind == "micro":
    if op.conditionals >= 2:
      return 0, True
    return repeats * (1 if op.conditionals else k), False
  return repeats, False


def check(s: Any, programs: list[tuple[str, str]] | None, note: str) -> Check:
  """The collectives row from the loop's compiled programs (``(kind, hlo_text)`` pairs)."""
  name = "collectives"
  one = gradient_elements(s)
  threshold = f"<= {MAX_GRADIENTS} gradients ({one} elements per device) over the data axis"
  if s.mesh is None and s.axis_name is None:
    return Check(name, "n/a: no mesh or axis_name given", "", threshold)
  if programs is None:
    return Check(name, f"n/a: {note}", "", threshold)
  axis = data_axis(s)
  count = loop = rare = elements = size = all_reduced = 0
  for kind, text in programs:
    for op in _hlo.collective_ops(text):
      if op.op not in REDUCTIONS or op.input_bytes < GRAD_MIN_BYTES:
        continue
      if not _crosses(op.groups, s.mesh, axis):
        continue
      runs, is_rare = _per_update(op, kind, s.k)
      rare += is_rare
      count += runs
      loop += runs if (op.placement == "loop" or (kind == "micro" and not op.conditionals)) else 0
      elements += runs * op.input_elements
      all_reduced += runs * op.input_elements if op.op == "all-reduce" else 0
      size += runs * op.input_bytes
  ratio = elements / one if one else 0.0
  figure = (
    f"{count} reduction{'s' if count != 1 else ''} per update ({loop} per micro-batch), "
    f"{ratio:.2f} gradients ({_bytes(size)}) over {axis!r}"
  )
  if rare:
    figure += f"; {rare} more in a conditional taken only when a device drops a micro-batch"
  if count == 0:
    why = "no gradient reduction over the data axis: is the batch split over it?"
    return Check(name, f"n/a: {why}", figure, threshold)
  if ratio <= MAX_GRADIENTS:
    return Check(name, "ok", figure, threshold)
  if sharded_over_data(s) and all_reduced / one <= MAX_GRADIENTS:
    # FSDP: the weights are gathered and the gradients reduce-scattered per micro-batch unless
    # the loop keeps whole copies for the window (memory traded for bytes, both correct).
    figure += (
      f"; parameters sharded over {axis!r} (FSDP): reduce-scatters per micro-batch keep the "
      "least memory (microbatch/TrainStep keep_unsharded='nothing' or 'params'); "
      "'params_and_grads' reduces once per update"
    )
    return Check(name, "info", figure, threshold)
  return Check(name, "FAIL", figure, threshold)


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n} B"
