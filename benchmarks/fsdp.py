"""FSDP with accumulation (issue 43): the three points of `keep_unsharded`, in-step and across.

For each layout where the parameters are sharded over a data-parallel axis (1-D FSDP,
`data × fsdp`, `data × model` with the weights also split over "data"), and each point
("nothing", "params", "params_and_grads"), one compiled update of an MLP: its collectives per
call counted in the optimised HLO (`_hlo.collective_runs`: all-gathers, reduce-scatters and
all-reduces, those in the loop times its trip count, the bytes of their full buffers and what
each device sends with ring algorithms), XLA's memory analysis (argument, output, temp, peak),
and the time per update, the points alternated in rounds after a warm-up (median; the ratio to
"nothing" is the figure that counts on a shared machine). Every point's gradient is checked
against the default point's before anything is reported.

The same for `TrainStep(..., keep_unsharded=...)` (adam), a window of ``k`` calls of one
micro-batch each: the collectives of each of its programs (the gather, the accumulating
program, the closing program) times the calls a window makes of it, each program's memory
analysis (the table shows the largest peak, the held whole copy included as an argument), and
the time per update (a whole window, alternated); the parameters after one window are checked
against the default point's.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/fsdp.py \\
      --out benchmarks/results/cpu
    python benchmarks/fsdp.py --quick --out DIR   # tiny sizes: checks that it runs

Uses the default backend's devices when there are at least 8 (a GPU node), else 8 host CPU
devices (set XLA_FLAGS as above before running, or the script sets it for itself).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import optax_accum  # noqa: E402
from optax_accum.core import _hlo  # noqa: E402

POINTS = ("nothing", "params", "params_and_grads")
LAYOUTS = {  # mesh shape, names, axis_name, batch entry, weight spec (2-D), the weight's FSDP axes
  "1-D FSDP": ((8,), ("data",), "data", "data", P("data", None)),
  "data × fsdp": ((4, 2), ("data", "fsdp"), ("data", "fsdp"), ("data", "fsdp"), P("fsdp", None)),
  "data × model": ((4, 2), ("data", "model"), "data", "data", P("data", "model")),
}
SIZES = {
  "full": dict(width=512, depth=4, rows=2048, k=8),
  "quick": dict(width=32, depth=2, rows=64, k=2),
}


def _devices():
  devices = jax.devices()
  return devices if len(devices) >= 8 else jax.devices("cpu")


def _loss(ws, x):
  """A tanh MLP's mean squared output; contractions over a sharded dimension name their result's
  sharding (Explicit axes), the batch entry read from the value's type."""
  h = x
  for w in ws:
    batch = jax.typeof(h).sharding.spec[0]
    model = "model" if "model" in jax.typeof(w).sharding.spec else None
    h = jnp.tanh(jnp.matmul(h, w, out_sharding=P(batch, model)))
  return jnp.mean(h**2)


def _setup(layout: str, size: dict):
  shape, names, axis, entry, wspec = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names),
                       devices=_devices()[:8])  # fmt: skip
  rng = np.random.default_rng(0)
  w = size["width"]
  ws = [
    jax.device_put(rng.standard_normal((w, w)).astype(np.float32) / np.sqrt(w),
                   NamedSharding(mesh, wspec))
    for _ in range(size["depth"])
  ]  # fmt: skip
  x = jax.device_put(
    rng.standard_normal((size["rows"], w)).astype(np.float32), NamedSharding(mesh, P(entry, None))
  )
  return mesh, axis, ws, x


def _measure(layout: str, size: dict, rounds: int) -> list[dict]:
  mesh, axis, ws, x = _setup(layout, size)
  rows, steps = [], {}
  with jax.set_mesh(mesh):
    for keep in POINTS:
      step = jax.jit(optax_accum.microbatch(
        jax.value_and_grad(_loss), size["k"], axis_name=axis, keep_unsharded=keep))  # fmt: skip
      compiled = step.lower(ws, x).compile()
      runs = _hlo.collective_runs(compiled.as_text())
      steps[keep] = compiled
      rows.append(dict(
        layout=layout, keep_unsharded=keep, k=size["k"], memory=_hlo.memory(compiled),
        collectives={kind: r._asdict() for kind, r in runs.items()},
        sent_bytes=sum(r.traffic for r in runs.values()),
      ))  # fmt: skip
    ref = steps["nothing"](ws, x)[1]
    for keep in POINTS[1:]:
      got = steps[keep](ws, x)[1]
      for a, b in zip(ref, got, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    times = {keep: [] for keep in POINTS}
    for _ in range(2):  # warm-up
      for keep in POINTS:
        jax.block_until_ready(steps[keep](ws, x))
    for _ in range(rounds):  # alternated
      for keep in POINTS:
        t0 = time.perf_counter()
        jax.block_until_ready(steps[keep](ws, x))
        times[keep].append(time.perf_counter() - t0)
  base = statistics.median(times["nothing"])
  for row in rows:
    med = statistics.median(times[row["keep_unsharded"]])
    row.update(ms_per_update=med * 1e3, ratio_to_nothing=med / base)
  return rows


def _adam_loss(ws, x):
  return _loss(ws, x)


def _train_windows(layout: str, size: dict, rounds: int) -> list[dict]:
  """TrainStep's three points on `layout`: per-window collectives, memory, time per update."""
  mesh, axis, ws, x = _setup(layout, size)
  k = size["k"]
  entry = LAYOUTS[layout][3]
  rows_per_call = size["rows"] // k
  host = np.asarray(x)
  micro = [jax.device_put(host[i * rows_per_call : (i + 1) * rows_per_call],
                          NamedSharding(mesh, P(entry, None))) for i in range(k)]  # fmt: skip
  out, steps = [], {}
  with jax.set_mesh(mesh):
    for keep in POINTS:
      step = optax_accum.TrainStep(_adam_loss, optax.adam(1e-3), k, axis_name=axis,
                                   keep_unsharded=keep, donate=False)  # fmt: skip
      state = step.init(ws)
      programs = step._fsdp.window_programs(ws, state, micro[0])
      found = {kind: dict(outside=0, in_loop=0, bytes=0) for kind in _hlo._GATHERS}
      sent, peaks = 0.0, {}
      for name, lowered, calls in programs:
        compiled = lowered.compile()
        peaks[name] = _hlo.memory(compiled)
        for kind, r in _hlo.collective_runs(compiled.as_text()).items():
          found[kind]["outside"] += r.outside * calls
          found[kind]["bytes"] += r.bytes * calls
          sent += r.traffic * calls
      top = max(peaks.values(), key=lambda m: m["peak"])
      steps[keep] = (step, state)
      out.append(dict(layout=layout, keep_unsharded=keep, k=k, front="TrainStep", memory=top,
                      programs=peaks, collectives=found, sent_bytes=sent))  # fmt: skip

    def window(keep):
      step, state = steps[keep]
      p = ws
      for xb in micro:
        p, state, _ = step(p, state, xb)
      return jax.block_until_ready(p)

    ref = window("nothing")
    for keep in POINTS[1:]:
      for a, b in zip(ref, window(keep), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    times = {keep: [] for keep in POINTS}
    for _ in range(rounds):
      for keep in POINTS:
        t0 = time.perf_counter()
        window(keep)
        times[keep].append(time.perf_counter() - t0)
  base = statistics.median(times["nothing"])
  for row in out:
    med = statistics.median(times[row["keep_unsharded"]])
    row.update(ms_per_update=med * 1e3, ratio_to_nothing=med / base)
  return out


def _table(rows: list[dict], command: str, meta: dict) -> str:
  mib = 2.0**20
  lines = [
    "# FSDP with accumulation: the three points per layout",
    "",
    f"Command: `{command}`",
    "",
    f"{meta['devices']} devices ({meta['backend']}), jax {meta['jax']}; an MLP of "
    f"{meta['depth']} layers of {meta['width']}×{meta['width']} float32 weights, "
    f"{meta['rows']} rows, k = {meta['k']} micro-batches. AG/RS/AR: all-gathers, "
    "reduce-scatters, all-reduces per update as `outside + in the loop × trips` (each "
    "FSDP weight is one op; the `data × model` row includes the tensor-parallel loss's own "
    'collectives over "model"); "sent": bytes each device sends per update (ring); peak: '
    "XLA's argument + output + temp − alias.",
    "",
    "| layout | keep_unsharded | AG | RS | AR | sent MiB | temp MiB | peak MiB | ms/update |"
    " / nothing |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  train = [r for r in rows if r.get("front") == "TrainStep"]
  for r in (r for r in rows if r.get("front") != "TrainStep"):
    cell = lambda kind, c=r["collectives"]: f"{c[kind]['outside']} + {c[kind]['in_loop']}"  # noqa: E731
    lines.append(
      f"| {r['layout']} | {r['keep_unsharded']} | {cell('all-gather')} | "
      f"{cell('reduce-scatter')} | {cell('all-reduce')} | {r['sent_bytes'] / mib:.2f} | "
      f"{r['memory']['temp'] / mib:.2f} | {r['memory']['peak'] / mib:.2f} | "
      f"{r['ms_per_update']:.2f} | {r['ratio_to_nothing']:.2f} |"
    )
  if train:
    lines += [
      "",
      f"`TrainStep(..., keep_unsharded=...)` with adam, a window of k = {meta['k']} calls of "
      f"{meta['rows'] // meta['k']} rows: AG/RS/AR per window (each program's ops times the "
      "calls a window makes of it: the gather once, the accumulating program k times, the "
      "closing program once); peak: the largest of its programs' (the held whole copy is an "
      "argument of the accumulating one); ms/update: the whole window.",
      "",
      "| layout | keep_unsharded | AG | RS | AR | sent MiB | temp MiB | peak MiB | ms/update |"
      " / nothing |",
      "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in train:
      c = r["collectives"]
      lines.append(
        f"| {r['layout']} | {r['keep_unsharded']} | {c['all-gather']['outside']} | "
        f"{c['reduce-scatter']['outside']} | {c['all-reduce']['outside']} | "
        f"{r['sent_bytes'] / mib:.2f} | {r['memory']['temp'] / mib:.2f} | "
        f"{r['memory']['peak'] / mib:.2f} | {r['ms_per_update']:.2f} | "
        f"{r['ratio_to_nothing']:.2f} |"
      )
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="benchmarks/results/cpu")
  parser.add_argument("--quick", action="store_true", help="tiny sizes: check that it runs")
  parser.add_argument("--rounds", type=int, default=20)
  args = parser.parse_args(argv)
  size = SIZES["quick" if args.quick else "full"]
  rounds = 2 if args.quick else args.rounds
  rows = [row for layout in LAYOUTS for row in _measure(layout, size, rounds)]
  rows += [row for layout in LAYOUTS for row in _train_windows(layout, size, rounds)]
  meta = dict(size, devices=8, backend=_devices()[0].platform, jax=jax.__version__)
  command = "XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/fsdp.py " + (
    " ".join(argv if argv is not None else sys.argv[1:])
  )
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "fsdp.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  (out / "fsdp.md").write_text(_table(rows, command, meta))
  print(_table(rows, command, meta))


if __name__ == "__main__":
  main()
