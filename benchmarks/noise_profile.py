"""Where `noise_scale=True`'s time goes, from XLA's own profile of the compiled programs.

    python benchmarks/noise_profile.py                  # MLP 784-2048³-10, k = 4 and 16
    python benchmarks/noise_profile.py --ks 4 --sizes 784,1600,1600,1600,1600,10 --out DIR

The noise section of `bench.py` times each path with and without the statistics. This script
says where the difference goes. It traces each contender's micro-steps with `jax.profiler`
(the runtime records every op, "thunk", it runs, with the program it belongs to), and sorts
the ops of each compiled program by what they read:

* *reductions* of a parameter-sized buffer to a few numbers: the micro-batch's ``Σ|g|²``
  (with the statistics it is the finite check), the window's ``|Σ wᵢgᵢ|²``;
* *dots to a vector* of a parameter-sized buffer: the finite check without the statistics (a
  matrix-vector product, `_core.all_finite`);
* everything else (the forward and backward pass, the add, the optimizer);

each on the micro-steps that keep the window open (*open*) and on the one that closes it
(*closing*). It writes the op time per micro-step, summed over the CPU's threads, to
``noise_profile.md`` under `--out`. A traced run is slower than an untraced one, so read the
split, not the totals; the ratios with / without are the noise section's.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.profiler  # noqa: E402
import optax  # noqa: E402

import optax_accum  # noqa: E402
from benchmarks import _cross as X  # noqa: E402
from benchmarks import _models  # noqa: E402
from optax_accum.core import _hlo  # noqa: E402

CLASSES = ("reductions", "dots to a vector", "everything else")


def _classes(text: str, big: int) -> tuple[str, dict[str, str]]:
  """The module's name and {op name: class} for its reductions and dots to a vector (ops that
  read a buffer of at least `big` bytes and write less than 1/64 of that); any other op is in
  the last class."""
  narrowing = _hlo.narrowing_ops(text, big, big // 64)
  return _module(text), {i.name: CLASSES[1] if i.op == "dot" else CLASSES[0] for _, i in narrowing}


def _trace(c: X.Contender, steps: int) -> list[tuple[str, str, float, int]]:
  """(module, op, milliseconds, execution) of every op `c` ran in `steps` traced micro-steps;
  an execution is one run of one compiled program, numbered in order."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(steps):
      jax.block_until_ready(c.step())
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
  events, starts = [], []
  for plane in data.planes:
    for line in plane.lines:
      for ev in line.events:
        stats = dict(ev.stats)
        if "wait for completion" in ev.name:
          starts.append(ev.start_ns)
        elif "hlo_op" in stats and "hlo_module" in stats:
          events.append((stats["hlo_module"], stats["hlo_op"], ev.duration_ns / 1e6, ev.start_ns))
  starts.sort()
  return [(m, op, ms, bisect.bisect_right(starts, t) - 1) for m, op, ms, t in events]


def profile(c: X.Contender, k: int, steps: int, big: int) -> dict[str, dict[str, float]]:
  """{"open" | "closing": {class: ms per such micro-step}} for one contender.

  The protocol path runs one program per micro-step, the window's last closing it.
  `TrainStep` runs its accumulating program on every micro-step and its closing program after
  the window's last: a closing micro-step is one run of each."""
  kinds = dict(_classes(p.text, big) for p in c.programs.values())
  for _ in range(2 * k):  # warm up, and start the trace on a window's first micro-step
    c.step()
  executions = collections.defaultdict(set)  # (module, phase) -> execution numbers
  ms = collections.defaultdict(collections.Counter)  # (module, phase) -> class -> ms
  protocol = isinstance(c, X.Protocol)
  for module, op, t, execution in _trace(c, steps):
    if module not in kinds:
      raise RuntimeError(f"{c.name}: the traced op {op} of {module!r} is in no compiled program")
    phase = "closing" if protocol and execution % k == k - 1 else "open"
    executions[module, phase].add(execution)
    ms[module, phase][kinds[module].get(op, CLASSES[2])] += t
  mean = {key: {cls: ms[key][cls] / len(executions[key]) for cls in CLASSES} for key in ms}
  if protocol:
    return {phase: row for (_, phase), row in mean.items()}
  accumulate, close = (_module(c.programs[p].text) for p in ("accumulate", "emit"))
  (accumulating,) = [row for (m, _), row in mean.items() if m == accumulate]
  (closing,) = [row for (m, _), row in mean.items() if m == close]
  both = {cls: accumulating[cls] + closing[cls] for cls in CLASSES}
  return {"open": accumulating, "closing": both}


def _module(text: str) -> str:
  """The name of a compiled program's HLO module (what the profile's events carry)."""
  return re.search(r"^HloModule\s+([\w.\-]+)", text, re.M).group(1)


def main(argv=None) -> dict:
  """Profiles each contender at each k; writes the table and returns it as {(k, contender):
  {micro-step: {class: ms}}}."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu"))
  parser.add_argument("--steps", type=int, default=32, help="traced micro-steps per contender")
  parser.add_argument("--ks", default="4,16")
  parser.add_argument("--sizes", default="784,2048,2048,2048,10", help="the MLP's layer sizes")
  parser.add_argument("--micro", type=int, default=64, help="examples per micro-batch")
  args = parser.parse_args(argv)
  sizes = tuple(int(x) for x in args.sizes.split(","))
  model = _models.mlp(sizes)
  params = model.init(jax.random.key(0))
  # "Parameter-sized": a quarter of the largest weight matrix or more.
  big = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) // 4
  lines = [
    "# Where the noise statistics' time goes (`benchmarks/noise_profile.py`)",
    "",
    f"`{' '.join(['python benchmarks/noise_profile.py'] + (argv or sys.argv[1:]))}`, "
    f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {model.shape}, "
    f"micro-batch {args.micro}, Adam. Op time per micro-step in ms, summed over the threads, "
    "traced.",
    "",
    "| k | path | micro-step | " + " | ".join(CLASSES) + " | all ops |",
    "|---|---|---|" + "---|" * (len(CLASSES) + 1),
  ]
  table = {}
  for k in [int(x) for x in args.ks.split(",")]:
    micro = [model.batch(jax.random.key(100 + i), args.micro) for i in range(k)]
    adam = optax.adam(X.LR)
    contenders = [
      X.Protocol("accumulate", optax_accum.accumulate(adam, k), model.loss, params, k, micro),
      X.Protocol(
        "accumulate + noise_scale",
        optax_accum.accumulate(adam, k, noise_scale=True),
        model.loss,
        params,
        k,
        micro,
      ),
      X.Fused("TrainStep", model.loss, params, k, micro),
      X.Fused("TrainStep + noise_scale", model.loss, params, k, micro, noise_scale=True),
    ]
    steps = max(args.steps // k, 2) * k
    for c in contenders:
      c.reset(params)
      figures = profile(c, k, steps, big)
      table[k, c.name] = figures
      for phase, row in figures.items():
        cells = " | ".join(f"{row[cls]:.2f}" for cls in CLASSES)
        lines.append(f"| {k} | {c.name} | {phase} | {cells} | {sum(row.values()):.2f} |")
        print(lines[-1], flush=True)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "noise_profile.md").write_text("\n".join(lines) + "\n")
  print(f"wrote {out / 'noise_profile.md'}")
  return table


if __name__ == "__main__":
  main()
