"""Issue 33's modes on this machine: the 2-byte accumulator's error, and each mode's micro-step.

    python benchmarks/accel.py                 # both sections, CPU sizes
    python benchmarks/accel.py --only rounding # the rounding table only
    python benchmarks/accel.py --quick         # tiny sizes (checks the script end to end)

Sections:

* `rounding`: a window's mean of k float32 gradients (a small signal under larger
  per-micro-batch noise, as in `_precision.py`) accumulated in float32 (the default), in
  bfloat16 rounded to nearest (``rounding="nearest"``, what bfloat16 gradients summed in
  bfloat16 do) and in bfloat16 rounded stochastically (``rounding="stochastic"``), against the
  window's exact mean in float64; k = 4 ... 256. The floor is the float32 rounding of the
  exact mean.
* The one-read mode (``skip_nonfinite="window"``) runs without the CPU's gradient buffer (the
  buffer is a second reader of each gradient); its control is the default check without it.
* `fusion`: whether XLA:GPU folded the accumulating add into the weight-gradient GEMM (a
  cuBLAS custom call with beta = 1), read from each mode's optimized HLO (n/a off GPU).
* `microstep`: `TrainStep`'s time and memory per micro-step in each mode, side by side in one
  run (rotating order, `_harness.run_side_by_side`), as ratios to today's default (float32
  accumulator) and to a plain jitted Adam step on the same micro-batch; beside them the optax
  protocol in a jitted step of your own, with its device conditional (``emit=None``: on GPU
  the host waits for the predicate every micro-step) and with static ``emit=``. Memory: the
  accumulating program's `memory_analysis()` (arguments + temporaries; the state is donated).

* `overlap`: the price of overlapping the reduction with the last backward pass (`TrainStep`
  with ``axis_name``): compile seconds of the pair of programs, the emitting program that
  all-reduces leaf by leaf (the default) against the closing program
  (``_train_step.OVERLAP_WITH_AXIS = False``), fresh `TrainStep`s in alternating order, and the
  time of one window each, side by side. It needs several devices: on one (a CPU, or a machine
  with one GPU) it runs in a subprocess on 8 host CPU devices
  (``--xla_force_host_platform_device_count=8``), said in the table.
* `lm`: the byte-level language model of ``python -m optax_accum.demo lm`` (its quick size),
  trained by `TrainStep` with token weights on the same micro-batches with each accumulator —
  float32, bfloat16 rounded to nearest, bfloat16 rounded stochastically — one after the other
  in one run; its held-out loss at the end, the mean training loss over the last windows and
  the largest parameter difference from the float32 run.

Writes benchmarks/results/<backend>/accel.md and accel.json (--quick: benchmarks/results/tmp/).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import optax_accum  # noqa: E402
from benchmarks import _harness, _models  # noqa: E402

SECTIONS = ("rounding", "microstep", "fusion", "overlap", "lm")
SCALES = {
  "cpu": {
    "ks": (4, 8, 16, 32, 64, 128, 256),
    "n": 1 << 16,
    "model": (784, 1024, 1024, 10),
    "rows": 64,
    "k": 8,
    "rounds": 9,
    "compile_rounds": 3,
    "lm": {"size": "quick", "k": 16, "rows": 2, "windows": 40, "docs": 1024, "lr": 3e-3},
  },
  "quick": {
    "ks": (4, 16),
    "n": 1 << 10,
    "model": (32, 64, 10),
    "rows": 8,
    "k": 2,
    "rounds": 2,
    "compile_rounds": 1,
    "lm": {"size": "dry", "k": 4, "rows": 2, "windows": 2, "docs": 64, "lr": 3e-3},
  },
}
OVERLAP = {True: "leaf by leaf in the emitting program (default)", False: "closing program"}
PROTOCOL = (
  "accumulate(adam, k), device conditional (emit=None)",
  "accumulate(adam, k), static emit=",
)
# The gradients' shapes: (name, mean, noise) per entry, i.e. signal · (1 + 0.1·N) + noise · N
# per micro-batch. Noise-dominated: each addition moves the sum by ~its size, rounding errors
# are random either way. Signal-dominated: late in a window each addition is a small fraction
# of the sum, which rounding to nearest shortens systematically.
CASES = (("noise-dominated", 0.1, 1.0), ("signal-dominated", 1.0, 0.05))
MODES = {  # TrainStep's keyword arguments per mode
  "float32 accumulator (default)": {},
  "bfloat16, rounding='nearest'": dict(accum_dtype=jnp.bfloat16, rounding="nearest"),
  "bfloat16, rounding='stochastic'": dict(accum_dtype=jnp.bfloat16, rounding="stochastic"),
  "float32, skip_nonfinite='window'": dict(skip_nonfinite="window", grad_buffer=False),
  "float32, skip_nonfinite=True, no grad_buffer": dict(grad_buffer=False),
}
LM_MODES = {k: v for k, v in MODES.items() if "skip_nonfinite" not in k}  # the accumulators


def _window_mean(kw: dict, grads: jax.Array) -> jax.Array:
  """The window's mean as `accumulate` (identity inner) emits it on the k-th micro-step."""
  tx = optax_accum.accumulate(optax.identity(), grads.shape[0], **kw)

  def body(state, g):
    u, state = tx.update(g, state)
    return state, u

  return lax.scan(body, tx.init(grads[0]), grads)[1][-1]


def _window_mean_kw(kw, grads):
  return _window_mean(dict(kw), grads)


_window_mean_jit = jax.jit(_window_mean_kw, static_argnums=0)


def rounding(cfg: dict, log=print) -> list[dict[str, Any]]:
  rows = []
  for (case, signal, noise), k in itertools.product(CASES, cfg["ks"]):
    key1, key2 = jax.random.split(jax.random.key(k))
    grads = signal * (1 + 0.1 * jax.random.normal(key1, (cfg["n"],)))
    grads = grads + noise * jax.random.normal(key2, (k, cfg["n"]))
    exact = np.asarray(grads, np.float64).mean(0)
    norm = np.linalg.norm(exact)
    err = lambda x, exact=exact, norm=norm: float(  # noqa: E731
      np.linalg.norm(np.asarray(x, np.float64) - exact) / norm
    )
    floor = err(exact.astype(np.float32))
    row = {"case": case, "k": k, "float32 rounding of the exact mean (floor)": floor}
    for name, kw in MODES.items():
      row[name] = err(_window_mean_jit(tuple(kw.items()), grads))
    rows.append(row)
    figures = ", ".join(f"{n} {v:.2e}" for n, v in row.items() if n not in ("k", "case"))
    log(f"[rounding] {case}, k={k}: {figures}")
  return rows


# The accumulating program's optimized HLO per (mode, model, rows, k), from `microstep`.
_ACCUMULATING: dict[tuple, str] = {}


def _accumulating(step: Any) -> Any:
  """The compiled accumulating program of a `TrainStep` compiled for one argument signature
  (its private table of compiled pairs: a benchmark's look inside)."""
  (pair,) = step._compiled.values()
  return pair[False]


def microstep(cfg: dict, log=print) -> list[dict[str, Any]]:
  model = _models.mlp(tuple(cfg["model"]))
  params = model.init(jax.random.key(0))
  k, rows = cfg["k"], cfg["rows"]
  batches = [model.batch(jax.random.key(i), rows) for i in range(k)]
  adam = optax.adam(1e-3)

  @jax.jit
  def adam_step(params, opt, batch):
    grads = jax.grad(model.loss)(params, batch)
    updates, opt = adam.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  live: dict[str, Any] = {"Adam": (params, adam.init(params))}
  steps, memory = {}, {}
  for name, kw in MODES.items():
    step = optax_accum.TrainStep(model.loss, adam, k, **kw)
    p = jax.tree.map(jnp.copy, params)
    state = step.init(p)
    # Both programs compiled once, as a call would (the accumulating one read from them: no
    # second compile of it for its memory, nor for the `fusion` section's HLO).
    accumulating = _accumulating(step.compile(p, state, batches[0]))
    _ACCUMULATING[(name, tuple(cfg["model"]), cfg["rows"], k)] = accumulating.as_text()
    analysis = accumulating.memory_analysis()
    memory[name] = {
      "argument_bytes": analysis.argument_size_in_bytes,
      "temp_bytes": analysis.temp_size_in_bytes,
      "accumulator_bytes": _harness.tree_bytes(state.grad_sum),
    }
    live[name] = (p, state)
    steps[name] = step

  def run_window(name):
    def go():
      p, s = live[name]
      for b in batches:
        if name == "Adam":
          p, s = adam_step(p, s, b)
        else:
          p, s, _ = steps[name](p, s, b)
      live[name] = (p, s)
      return p

    return go

  # The optax protocol in a jitted step of your own: the device conditional (emit=None; on GPU
  # a host sync per micro-step for the predicate), and static emit= (two programs, no cond).
  tx = optax_accum.accumulate(adam, k)

  @functools.partial(jax.jit, static_argnums=3, donate_argnums=(0, 1))
  def protocol_step(params, state, batch, emit):
    grads = jax.grad(model.loss)(params, batch)
    updates, state = tx.update(grads, state, params, emit=emit)
    return optax.apply_updates(params, updates), state

  for name in PROTOCOL:
    p = jax.tree.map(jnp.copy, params)
    live[name] = (p, tx.init(p))

  def run_protocol(name):
    def go():
      p, s = live[name]
      for i, b in enumerate(batches):
        emit = None if name == PROTOCOL[0] else i == k - 1
        p, s = protocol_step(p, s, b, emit)
      live[name] = (p, s)
      return p

    return go

  names = ["Adam", *MODES, *PROTOCOL]
  contenders = {n: run_protocol(n) if n in PROTOCOL else run_window(n) for n in names}
  timings = _harness.run_side_by_side(contenders, rounds=cfg["rounds"], units=float(k))
  default = next(iter(MODES))
  out = []
  for n in names:
    t = timings[n]
    out.append(
      {
        "contender": n,
        "us_per_micro_step": t.median * 1e6,
        "iqr_rel": t.spread,
        "vs_default": _harness.paired_ratio(t, timings[default]),
        "vs_adam": _harness.paired_ratio(t, timings["Adam"]),
        **memory.get(n, {}),
      }
    )
    log(f"[microstep] {n}: {t.median * 1e6:.0f} us, {out[-1]['vs_adam']:.2f}x Adam")
  return out


# A cuBLAS GEMM in XLA:GPU's optimized HLO, and its backend config's beta (1: the GEMM adds
# into its output buffer, `GemmRewriter::FuseMatrixBiasAdd`: acc + dot(...) in one kernel).
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)".*?"beta":\s*([0-9.]+)')


_OTHER_DOT = re.compile(r"__triton_gemm|triton_gemm|= [a-z0-9\[\]{},]+ dot\(")
_HLO_OUT: Path | None = None  # main() sets it to the output folder


def fusion(cfg: dict, log=print) -> list[dict[str, Any]]:
  """Whether the accumulating program's weight-gradient GEMMs add into the accumulator
  (cuBLAS beta = 1), read from each mode's optimized HLO. XLA:CPU has no GEMM rewriter (it
  fuses matrix-vector dots only): there the row says so."""
  model = _models.mlp(tuple(cfg["model"]))
  params = model.init(jax.random.key(0))
  batch = model.batch(jax.random.key(0), cfg["rows"])
  rows = []
  for name, kw in MODES.items():
    step = optax_accum.TrainStep(model.loss, optax.adam(1e-3), cfg["k"], **kw)
    text = _ACCUMULATING.get((name, tuple(cfg["model"]), cfg["rows"], cfg["k"]))
    if text is None:  # `microstep` did not run in this process
      text = step.lower(params, step.init(params), batch).compile().as_text()
    betas = [float(b) for b in _GEMM.findall(text)]
    rows.append(
      {
        "contender": name,
        "gemms": len(betas),
        "beta_1": sum(b != 0 for b in betas),
        # Dots XLA kept elsewhere (Triton GEMM fusions, plain dot ops): where cuBLAS calls are
        # 0, the GEMMs went this way and the beta = 1 question has no answer in this run.
        "other_dots": len(_OTHER_DOT.findall(text)),
        "backend": jax.default_backend(),
      }
    )
    if _HLO_OUT and not rows[1:]:  # the first mode's program, for reading by hand
      (_HLO_OUT / "accel_accumulating_hlo.txt").write_text(text)
    log(f"[fusion] {name}: {len(betas)} cuBLAS GEMMs, {rows[-1]['beta_1']} with beta = 1")
  return rows


def overlap(cfg: dict, log=print) -> list[dict[str, Any]]:
  """Compile seconds of `TrainStep(axis_name="data")`'s pair with each emitting program, and one
  window's time each, side by side (on every device of this process)."""
  from optax_accum.front_ends import _train_step  # noqa: PLC0415  (the switch is private)

  model = _models.mlp(tuple(cfg["model"]))
  params = model.init(jax.random.key(0))
  n, k = jax.device_count(), cfg["k"]
  mesh = jax.make_mesh((n,), ("data",))
  batches = [model.batch(jax.random.key(i), cfg["rows"] * n) for i in range(k)]
  seconds: dict[bool, list[float]] = {True: [], False: []}
  live: dict[bool, Any] = {}
  try:
    # round 0 warms up (jax's one-time tracing and lowering machinery), unless it is the only one
    for r in range(cfg["compile_rounds"] + (cfg["compile_rounds"] > 1)):
      for choice in (True, False) if r % 2 == 0 else (False, True):
        _train_step.OVERLAP_WITH_AXIS = choice
        with jax.set_mesh(mesh):
          step = optax_accum.TrainStep(model.loss, optax.adam(1e-3), k, axis_name="data")
          p = jax.tree.map(jnp.copy, params)
          state = step.init(p)
          t0 = time.perf_counter()
          step.compile(p, state, batches[0])
          if r or cfg["compile_rounds"] == 1:
            seconds[choice].append(time.perf_counter() - t0)
        live[choice] = (step, p, state)
  finally:
    _train_step.OVERLAP_WITH_AXIS = True

  def run_window(choice):
    def go():
      step, p, s = live[choice]
      with jax.set_mesh(mesh):
        for b in batches:
          p, s, _ = step(p, s, b)
      live[choice] = (step, p, s)
      return p

    return go

  timings = _harness.run_side_by_side(
    {OVERLAP[c]: run_window(c) for c in (True, False)}, rounds=cfg["rounds"], units=float(k)
  )
  rows = []
  for c in (True, False):
    t = timings[OVERLAP[c]]
    rows.append({
      "contender": OVERLAP[c],
      "compile_s": float(np.median(seconds[c])),
      "compile_vs_closing": float(np.median(seconds[c]) / np.median(seconds[False])),
      "us_per_micro_step": t.median * 1e6,
      "vs_closing": _harness.paired_ratio(t, timings[OVERLAP[False]]),
      "devices": f"{n} {jax.default_backend()}",
    })  # fmt: skip
    log(f"[overlap] {OVERLAP[c]}: compile {rows[-1]['compile_s']:.2f} s, {t.median * 1e6:.0f} us")
  return rows


def _overlap_elsewhere(cfg_name: str, log=print) -> list[dict[str, Any]]:
  """`overlap` in a subprocess on 8 host CPU devices (this process has one device)."""
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    argv = [sys.executable, __file__, "--only", "overlap", "--out", tmp]
    subprocess.run(argv + (["--quick"] if cfg_name == "quick" else []), env=env, check=True)
    rows = json.loads((Path(tmp) / "accel.json").read_text())["overlap"]
  for r in rows:
    log(f"[overlap] {r['contender']} ({r['devices']}): compile {r['compile_s']:.2f} s")
  return rows


def lm(cfg: dict, log=print) -> list[dict[str, Any]]:
  """The byte LM trained by `TrainStep` with each accumulator, on the same micro-batches."""
  from optax_accum.demo.lm import cli, data, model  # noqa: PLC0415  (flax: the examples extra)

  c = cfg["lm"]
  mcfg = cli.PRESETS[c["size"]][0]
  graphdef, params0 = model.init(mcfg, 0)
  loss = model.loss_fn(graphdef)
  tokens, mask = data.encode(data.documents(c["docs"] + 64), mcfg.seq_len)
  held_out = {"tokens": tokens[-64:], "mask": mask[-64:]}
  rng = np.random.default_rng(0)
  rows_of = lambda: rng.choice(len(tokens) - 64, c["rows"], replace=False)  # noqa: E731
  micro = [{"tokens": tokens[i], "mask": mask[i]}
           for i in (rows_of() for _ in range(c["k"] * c["windows"]))]  # fmt: skip
  evaluate = jax.jit(loss)
  out, ref_params = [], None
  for name, kw in LM_MODES.items():
    step = optax_accum.TrainStep(
      loss, optax.adam(c["lr"]), c["k"], weight_fn=model.real_tokens, **kw
    )
    p = jax.tree.map(jnp.copy, params0)
    state = step.init(p)
    losses = []
    for mb in micro:
      p, state, value = step(p, state, mb)
      losses.append(value)
    last = np.asarray(jax.device_get(losses[-c["k"] * min(10, c["windows"]) :]))
    ref_params = p if ref_params is None else ref_params
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(p), jax.tree.leaves(ref_params), strict=True))  # fmt: skip
    out.append({
      "contender": name,
      "held_out_loss": float(evaluate(p, held_out)),
      "train_loss_last": float(last.mean()),
      "max_param_diff_vs_f32": diff,
      "accumulator_bytes": _harness.tree_bytes(state.grad_sum),
    })  # fmt: skip
    log(f"[lm] {name}: held-out loss {out[-1]['held_out_loss']:.4f}")
  meta = {"model": str(mcfg), **{k: v for k, v in c.items() if k != "size"}}
  return [{"meta": meta}, *out]


def _markdown(res: dict) -> str:
  meta = res["meta"]
  lines = [
    "# Issue 33's modes: the 2-byte accumulator and the micro-step",
    "",
    f"{meta['backend']} ({meta['device']}), {meta['date']}, `{meta['command']}`, "
    f"{meta['seconds']:.0f} s.",
    "",
  ]
  if res.get("rounding"):
    cols = [c for c in res["rounding"][0] if c not in ("k", "case")]
    lines += [
      "## A window's mean against float64 (relative L2 error)",
      "",
      f"Gradients, {res['n']} entries: mean · (1 + 0.1·N(0,1)) + noise · N(0,1) per "
      "micro-batch; noise-dominated: mean 0.1, noise 1; signal-dominated: mean 1, noise 0.05.",
      "",
      "| gradients | k | " + " | ".join(cols) + " |",
      "|---|---:|" + "---:|" * len(cols),
    ]
    for r in res["rounding"]:
      figures = " | ".join(f"{r[c]:.2e}" for c in cols)
      lines.append(f"| {r['case']} | {r['k']} | {figures} |")
    lines.append("")
  if res.get("microstep"):
    lines += [
      f"## TrainStep per micro-step ({res['model']}, k = {res['k']})",
      "",
      "| contender | µs / micro-step | IQR | vs default | vs Adam | accumulator | arguments |"
      " temporaries |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["microstep"]:
      mem = [
        _harness.fmt_bytes(r.get(f)) if f in r else "–"
        for f in ("accumulator_bytes", "argument_bytes", "temp_bytes")
      ]
      lines.append(
        f"| {r['contender']} | {r['us_per_micro_step']:.0f} | {r['iqr_rel']:.2f} | "
        f"{r['vs_default']:.3f} | {r['vs_adam']:.3f} | " + " | ".join(mem) + " |"
      )
    lines.append("")
  if res.get("overlap"):
    r0 = res["overlap"][0]
    lines += [
      f"## The reduction overlapped with the last backward pass: its price ({res['model']}, "
      f"k = {res['k']}, TrainStep(axis_name='data') on {r0['devices']} devices)",
      "",
      "| emitting micro-step | compile s (pair) | vs closing | µs / micro-step | vs closing |",
      "|---|---:|---:|---:|---:|",
    ]
    for r in res["overlap"]:
      lines.append(
        f"| {r['contender']} | {r['compile_s']:.2f} | {r['compile_vs_closing']:.2f} | "
        f"{r['us_per_micro_step']:.0f} | {r['vs_closing']:.3f} |"
      )
    lines += [
      "",
      "The leaf-by-leaf program compiles the backward pass a second time (the closing program "
      "has none). On CPU there is nothing to overlap (XLA:CPU's combiner merges the per-leaf "
      "all-reduces into one, and its host devices share the cores), so the time column shows "
      "only that nothing is lost; the overlap is for GPUs and TPUs.",
      "",
    ]
  if res.get("lm"):
    meta, *rows = res["lm"]
    m = meta["meta"]
    lines += [
      f"## The byte LM's final loss with each accumulator ({m['model']}; k = {m['k']}, "
      f"{m['rows']} sequences per micro-batch, {m['windows']} updates, Adam lr {m['lr']}, "
      "token weights)",
      "",
      "| accumulator | held-out loss | training loss, last 10 updates | largest parameter "
      "difference from float32 | accumulator |",
      "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
      lines.append(
        f"| {r['contender']} | {r['held_out_loss']:.4f} | {r['train_loss_last']:.4f} | "
        f"{r['max_param_diff_vs_f32']:.2e} | {_harness.fmt_bytes(r['accumulator_bytes'])} |"
      )
    lines.append("")
  if res.get("fusion"):
    lines += [
      "## The accumulating program's GEMMs (optimized HLO)",
      "",
      "| contender | cuBLAS GEMMs | with beta = 1 (acc + dot fused) |",
      "|---|---:|---:|",
    ]
    for r in res["fusion"]:
      if r["backend"] != "gpu":
        lines.append(f"| {r['contender']} | n/a ({r['backend']}: no GEMM rewriter) | n/a |")
      elif r["gemms"] == 0:  # the dots were not cuBLAS calls: no beta to read
        other = r.get("other_dots")
        found = "not counted in this run" if other is None else f"{other} found"
        lines.append(f"| {r['contender']} | 0 (other GEMMs or dots: {found}) | n/a |")
      else:
        lines.append(f"| {r['contender']} | {r['gemms']} | {r['beta_1']} |")
    lines.append("")
  if "load" in meta:
    lines.append(
      f"Measured on a shared machine (load average up to {meta['load']:.1f} at the runs' starts): "
      "timings are noisy; the paired ratios (each round back to back) are the figures to read."
    )
  return "\n".join(lines)


def main(argv=None) -> Path:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--only", default=",".join(SECTIONS))
  ap.add_argument("--out", default=None)
  ap.add_argument(
    "--merge", action="store_true", help="keep the other sections of the accel.json already there"
  )
  args = ap.parse_args(argv)
  only = [s for s in args.only.split(",") if s]
  bad = [s for s in only if s not in SECTIONS]
  if bad:
    ap.error(f"--only: unknown section(s) {bad}; choose from {SECTIONS}")
  cfg = SCALES["quick" if args.quick else "cpu"]
  backend = jax.default_backend()
  out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / backend
  if args.quick and not args.out:
    out = ROOT / "benchmarks" / "results" / "tmp" / f"{backend}-quick"
  out.mkdir(parents=True, exist_ok=True)
  global _HLO_OUT
  _HLO_OUT = out if backend == "gpu" else None
  start, load = time.perf_counter(), os.getloadavg()[0]
  res: dict[str, Any] = {
    "n": cfg["n"],
    "k": cfg["k"],
    "model": "MLP " + "-".join(map(str, cfg["model"])),
  }
  if "rounding" in only:
    res["rounding"] = rounding(cfg)
  if "microstep" in only:
    res["microstep"] = microstep(cfg)
  if "fusion" in only:
    res["fusion"] = fusion(cfg)
  if "overlap" in only:
    several = jax.device_count() > 1
    res["overlap"] = overlap(cfg) if several else _overlap_elsewhere(args.quick and "quick")
  if "lm" in only:
    res["lm"] = lm(cfg)
  command = "python benchmarks/accel.py" + (" --quick" if args.quick else "")
  if set(only) != set(SECTIONS):
    command += f" --only {','.join(only)}"
  if args.merge:
    command += " --merge"
  res["meta"] = {
    "backend": backend,
    "device": jax.devices()[0].device_kind,
    "date": datetime.date.today().isoformat(),
    "command": command,
    "seconds": time.perf_counter() - start,
    "load": load,
  }
  if args.merge and (out / "accel.json").exists():  # this run's sections over an earlier run's
    old = json.loads((out / "accel.json").read_text())
    res["meta"]["command"] = f"{old['meta']['command']}; {res['meta']['command']}"
    res["meta"]["seconds"] += old["meta"]["seconds"]
    res["meta"]["load"] = max(load, old["meta"].get("load", 0.0))
    res = {**old, **res}
  (out / "accel.json").write_text(json.dumps(res, indent=1))
  (out / "accel.md").write_text(_markdown(res))
  print(f"accel.py: wrote {out / 'accel.md'}")
  return out


if __name__ == "__main__":
  main()
