"""optax_accum benchmarks: every contender side by side in one run, tables and plots.

    python benchmarks/bench.py                      # CPU defaults (see "How long" below)
    python benchmarks/bench.py --quick              # tiny sizes: checks the harness end to end
    python benchmarks/bench.py --scale gpu          # larger sizes for a GPU/TPU
    python benchmarks/bench.py --only cross,within  # some sections only

Sections: `cross` (accumulate vs optax.MultiSteps vs chain(adam, apply_every) vs plain Adam,
plus the static-emission paths and `TrainStep`), `noise` (what `noise_scale=True` costs the
protocol path and `TrainStep` on the cross-step models, each against itself without it),
`within` (microbatch vs
optax.microbatching vs a Python loop vs the large batch), `precision` (bf16 accumulators),
`emission` (dispatch share of each emission strategy; part of `cross`), `distributed`
(all-reduces per update on 8 host devices, in a subprocess), `compile` (`TrainStep`'s two
programs, sequential and concurrent, against the protocol path's one: compile.md).

How long: measured on a 2-core CPU shared with other jobs (2026-12-01), `--quick` took 11 min
35 s for the cross, within and precision sections (a docs build ran beside it for 6 of those
minutes) and 4 min 47 s for `--quick --only distributed`; an earlier, less loaded measurement
of the whole `--quick` took 3 min 14 s. The CPU defaults take several times longer: a run's
`results.md` header records its total (998 s for the committed CPU run).

Writes results.md, results.json and PNG plots to benchmarks/results/<backend>/ (or --out;
--quick: benchmarks/results/tmp/<backend>-quick/, ignored by git),
and prints the backend and device it ran on. The protocol (what is measured and how) is in
CONTRIBUTING.md, "Benchmark protocol", and on the docs' Benchmarks page.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import optax  # noqa: E402

from benchmarks import _compile, _cross, _dp, _models, _noise, _precision, _report, _within  # noqa: E402

SECTIONS = ("cross", "noise", "within", "precision", "emission", "distributed", "compile", "dp")

SCALES = {
  # Tiny: checks that the harness runs end to end; figures are dispatch-bound, not meaningful.
  "quick": {
    "cross_models": [
      (("mlp", (64, 128, 128, 10)), 8),
      (("mlp", (64, 96, 96, 96, 10)), 8),
      (("transformer", (64, 32, 1, 2, 16)), 4),
    ],
    "ks": (1, 4),
    "micro_steps": 8,
    "min_rounds": 3,
    "dispatch_k": 4,
    "dispatch_windows": 2,
    "noise_ks": (4,),
    "noise_micro_steps": 8,
    "within_mlp": (16, 64, 64, 10),
    "global_batch": 512,
    "within_ks": (1, 2, 4, 8, 16, 32, 64),
    "within_rounds": 3,
    "precision_ks": (64, 256),
    "precision_n": 1 << 14,
    "dist_mlp": (16, 64, 64, 10),
    "dist_ks": (4, 16),
    "dist_micro": 4,
    "compile_k": 4,
    "compile_rounds": 2,
  },
  # CPU defaults: two MLPs of ~10M parameters at micro-batch 64 and a small transformer; an
  # activation-dominated MLP for the within-step memory figures. Two MLP shapes because a ratio
  # to plain Adam depends on Adam's own temp: on 784-2048^3-10 it is 35.7 MB, above glibc's
  # 32 MiB mmap threshold, so the baseline pays ~8.7k page faults per step and every ratio
  # against it looks better; on 784-1600^4-10 it is 21.9 MiB (no faults).
  "cpu": {
    "cross_models": [
      (("mlp", (784, 2048, 2048, 2048, 10)), 64),
      (("mlp", (784, 1600, 1600, 1600, 1600, 10)), 64),
      (("transformer", (256, 128, 2, 4, 64)), 8),
    ],
    "ks": (1, 4, 16),
    "micro_steps": 24,
    "min_rounds": 3,
    "dispatch_k": 4,
    "dispatch_windows": 2,
    # Four contenders only, and a ratio near 1 to resolve: more rounds than `cross`.
    "noise_ks": (4, 16),
    "noise_micro_steps": 192,
    "within_mlp": (16, 128, 128, 128, 128, 10),
    "global_batch": 8192,
    "within_ks": (1, 2, 4, 8, 16, 32, 64),
    "within_rounds": 15,
    "precision_ks": (64, 256),
    "precision_n": 1 << 18,
    "dist_mlp": (64, 256, 256, 10),
    "dist_ks": (4, 16),
    "dist_micro": 8,
    "compile_k": 4,
    "compile_rounds": 3,
  },
  # Accelerators: larger models and batches, more rounds.
  "gpu": {
    "cross_models": [
      (("mlp", (784, 2048, 2048, 2048, 10)), 256),
      (("transformer", (1024, 512, 4, 8, 256)), 32),
    ],
    "ks": (1, 4, 16),
    "micro_steps": 96,
    "min_rounds": 10,
    "interleave_steps": False,  # keep asynchronous dispatch: whole windows, blocked at the end
    "dispatch_k": 4,
    "dispatch_windows": 16,
    "noise_ks": (4, 16),
    "noise_micro_steps": 384,
    "within_mlp": (64, 1024, 1024, 1024, 1024, 10),
    "global_batch": 65536,
    "within_ks": (1, 2, 4, 8, 16, 32, 64),
    "within_rounds": 20,
    "precision_ks": (64, 256),
    "precision_n": 1 << 22,
    "dist_mlp": (64, 256, 256, 10),
    "dist_ks": (4, 16),
    "dist_micro": 8,
    "compile_k": 4,
    "compile_rounds": 3,
  },
}
# One GPU in at most 8 minutes (benchmarks/gpu.sh): the `gpu` sizes, fewer k and rounds.
SCALES["gpu_short"] = dict(
  SCALES["gpu"],
  ks=(1, 4),
  micro_steps=48,
  min_rounds=5,
  dispatch_windows=8,
  noise_ks=(4,),
  noise_micro_steps=96,
  within_ks=(1, 4, 16, 64),
  within_rounds=5,
  compile_rounds=2,
)
# `benchmarks/gpu.sh --dry-run` on any CPU: every section and code path of the GPU script end to
# end, not a measurement. Its cost is compiling XLA programs (dozens per model and section), so:
# one tiny MLP (a transformer doubles the compile time), one k > 1 in every section (k=1 runs
# none of the accumulating paths), one round of each, one compile sample.
SCALES["gpu_dry_run"] = dict(
  SCALES["quick"],
  cross_models=[(("mlp", (8, 16, 4)), 2)],
  ks=(2,),
  micro_steps=2,
  min_rounds=1,
  dispatch_k=2,
  dispatch_windows=1,
  noise_ks=(2,),
  noise_micro_steps=2,
  within_mlp=(8, 16, 4),
  global_batch=8,
  within_ks=(2,),
  within_rounds=1,
  within_compile_repeats=1,
  compile_k=2,
  compile_rounds=1,
)


def build_model(spec, name: str | None = None):
  kind, args = spec
  if kind == "mlp":
    return _models.mlp(tuple(args), name=name or "mlp")
  return _models.transformer(*args, name="transformer")


def cross_models(cfg: dict) -> list:
  """[(model, micro-batch)]: the first MLP is `mlp`, a further one `mlp_<width>x<depth>`."""
  out = []
  for spec, micro in cfg["cross_models"]:
    name = None
    if spec[0] == "mlp" and any(m.name == "mlp" for m, _ in out):
      hidden = spec[1][1:-1]
      name = f"mlp_{hidden[0]}x{len(hidden)}"
    out.append((build_model(spec, name), micro))
  return out


def run_distributed(cfg: dict, log) -> list[dict]:
  """The distributed section in a subprocess with 8 host devices (the count is fixed at start)."""
  env = dict(os.environ)
  if jax.default_backend() == "cpu":
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
  keys = ("dist_mlp", "dist_ks", "dist_micro")
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "dist.json"
    cmd = [
      sys.executable,
      str(Path(__file__).with_name("_distributed.py")),
      "--config",
      json.dumps({k: cfg[k] for k in keys}),
      "--out",
      str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
      log(proc.stdout[-3000:] + proc.stderr[-3000:])
      raise RuntimeError("distributed section failed (output above)")
    rows = json.loads(out.read_text())
  for r in rows:
    log(
      f"[distributed] {r['section']} k={r['k']} {r['contender']}: "
      f"{r['all_reduce_ops']:.0f} all-reduce(s) / update"
    )
  return rows


def render(out: Path) -> None:
  """Rewrites a committed run's report (tables, plots) from its results.json."""
  res = json.loads((out / "results.json").read_text())
  # Runs recorded before the models described themselves: describe them from the config.
  models = cross_models(res["meta"]["config"])
  for model, _ in models:
    res["meta"]["models"].get(model.name, {}).setdefault("shape", model.shape)
  files = _report.write(res, out)
  print(f"rewrote {', '.join(files)} in {out}")


def write_compile(res: dict, out: Path) -> list[str]:
  """compile.md from the `compile` section, if the run has one."""
  if not res.get("compile"):
    return []
  load = res["meta"].get("load_end")
  load = "not recorded" if load is None else f"{load:.1f}"
  (out / "compile.md").write_text(
    "# Compile time: TrainStep's two programs / the protocol path's one\n\n"
    f"{_compile.__doc__.split(chr(10) + chr(10), 1)[1].strip()}\n\n"
    f"{_compile.markdown(res['compile'])}\n\n"
    f"Load average at the end: {load} on {res['meta']['cpu_count']} CPUs (concurrent "
    "compilation needs a free core).\n"
  )
  return ["compile.md"]


def combine(parts: list[Path], out: Path) -> None:
  """One report from the `--part` files of one run (benchmarks/gpu.sh runs each section as a
  process of its own, each under its own time limit). A part that is missing or was stopped
  before it finished is named in the report's command line, never silently dropped."""
  found = [json.loads(p.read_text()) for p in parts if p.exists()]
  if not found:
    raise SystemExit(f"--combine: none of {[str(p) for p in parts]} exists")
  res: dict = {"meta": dict(found[0]["meta"], models={})}
  notes = [f"{p.stem}: missing" for p in parts if not p.exists()]
  for part, p in zip(found, [p for p in parts if p.exists()], strict=True):
    res["meta"]["models"].update(part["meta"].get("models", {}))
    if "within_model" in part["meta"]:
      res["meta"]["within_model"] = part["meta"]["within_model"]
    if not part["meta"].get("complete", True):
      notes.append(f"{p.stem}: stopped at its time limit after {part['meta']['seconds']:.0f} s")
    for key, value in part.items():  # sections are lists of rows; within_compile is a dict
      if key != "meta":
        res[key] = res.get(key, []) + value if isinstance(value, list) else value
  res["meta"]["seconds"] = sum(p["meta"]["seconds"] for p in found)
  res["meta"]["command"] = "; ".join(p["meta"]["command"] for p in found)
  res["meta"]["complete"] = not notes
  if notes:
    res["meta"]["command"] += f" ({'; '.join(notes)})"
  out.mkdir(parents=True, exist_ok=True)
  files = _report.write(res, out) + write_compile(res, out)
  print(f"combined {len(found)} of {len(parts)} parts: wrote {', '.join(files)} to {out}")


def rounds_total(only: list[str], cfg: dict, n_models: int) -> int:
  """Rounds the progress bar counts for the sections in `only`."""
  total = 0
  if "cross" in only:
    total += n_models * sum(_cross.rounds_for(cfg, k) for k in cfg["ks"])
  if "noise" in only:
    total += n_models * sum(
      _cross.rounds_for(cfg, k, cfg["noise_micro_steps"]) for k in cfg["noise_ks"]
    )
  if "within" in only:
    total += cfg["within_rounds"] * len(cfg["within_ks"])
  if "precision" in only:
    total += len(cfg["precision_ks"])
  return total


def run_cross_models(only: list[str], cfg: dict, models: list, res: dict, bar, save) -> None:
  """The sections on the cross-step models (`cross`, `noise`), into `res`; `save()` after each
  model, so that a part stopped at its time limit keeps the models it finished."""
  if not {"cross", "noise"} & set(only):
    return
  for model, micro in models:
    res["meta"]["models"][model.name] = {
      "params": _models.num_params(model.init(jax.random.key(0))),
      "micro": micro,
      "shape": model.shape,
    }
  if "cross" in only:
    res["cross"] = []
    for model, micro in models:
      mcfg = dict(cfg, micro=micro)
      res["cross"] += _cross.run(model, mcfg, cfg["ks"], progress=bar, log=bar.write)
      save()
  if "noise" in only:
    res["noise"] = []
    for model, micro in models:
      res["noise"] += _noise.run(model, dict(cfg, micro=micro), progress=bar, log=bar.write)
      save()


def run_meta(backend: str, device_kind: str, scale: str, cfg: dict) -> dict:
  """What the run was: backend, device, versions, the command and its configuration."""
  return {
    "backend": backend,
    "device": f"{device_kind} × {jax.device_count()}",
    "scale": scale,
    "command": "python benchmarks/bench.py" + (f" --scale {scale}" if scale != "cpu" else ""),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "cpu_count": os.cpu_count(),
    "config": cfg,
    "models": {},
  }


def main(argv=None):
  ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument(
    "--scale", choices=sorted(SCALES), default=None, help="problem sizes (default: cpu)"
  )
  ap.add_argument("--quick", action="store_true", help="same as --scale quick")
  ap.add_argument(
    "--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
  )
  ap.add_argument(
    "--out", default=None, help="output folder (default benchmarks/results/<backend>)"
  )
  ap.add_argument(
    "--render",
    metavar="DIR",
    default=None,
    help="measure nothing: rewrite DIR/results.md and the plots from DIR/results.json",
  )
  ap.add_argument(
    "--part",
    metavar="FILE",
    default=None,
    help="write this run's raw results to FILE (after each model and section, so a run stopped"
    " at a time limit keeps what it finished) and no report; --combine joins the parts",
  )
  ap.add_argument(
    "--combine",
    metavar="FILE",
    nargs="+",
    default=None,
    help="measure nothing: join the --part FILEs of one run into the report in --out",
  )
  args = ap.parse_args(argv)
  if args.render:
    return render(Path(args.render))
  if args.combine:
    return combine([Path(f) for f in args.combine], Path(args.out or "."))
  scale = "quick" if args.quick else (args.scale or "cpu")
  cfg = SCALES[scale]
  only = [s.strip() for s in args.only.split(",") if s.strip()]
  bad = [s for s in only if s not in SECTIONS]
  if bad:
    ap.error(f"--only: unknown section(s) {bad}; choose from {SECTIONS}")
  if "emission" in only and "cross" not in only:
    only.append("cross")  # the emission figures come from the cross-step contenders
  cfg = dict(cfg, dispatch_windows=cfg["dispatch_windows"] if "emission" in only else 0)

  backend = jax.default_backend()
  device = jax.devices()[0]
  device_kind = getattr(device, "device_kind", str(device))
  out = (
    Path(args.out)
    if args.out
    # A quick run checks the harness: its figures go to the ignored tmp/ folder.
    else ROOT / "benchmarks" / "results" / (backend if scale != "quick" else f"tmp/{backend}-quick")
  )
  print(f"backend: {backend} · device: {device_kind} × {jax.device_count()} · scale: {scale}")
  if "dp" in only:  # its own files (dp.md, dp.json): a dp-only run rewrites nothing else
    _dp.run(scale, out)
    only.remove("dp")
    if not only:
      return

  from tqdm import tqdm

  models = cross_models(cfg)
  total = rounds_total(only, cfg, len(models))
  bar = tqdm(total=total, unit="round", dynamic_ncols=True)
  log = bar.write

  t0 = time.perf_counter()
  res: dict = {"meta": run_meta(backend, device_kind, scale, cfg)}
  if set(only) != set(SECTIONS):  # the command that reproduces this run
    res["meta"]["command"] += f" --only {','.join(only)}"
  part = Path(args.part) if args.part else None

  def save(complete: bool = False) -> None:
    if part is not None:
      res["meta"].update(seconds=time.perf_counter() - t0, complete=complete)
      part.parent.mkdir(parents=True, exist_ok=True)
      part.write_text(json.dumps(res, indent=1, default=str))

  run_cross_models(only, cfg, models, res, bar, save)
  if "within" in only:
    model = _models.mlp(tuple(cfg["within_mlp"]), name="activation-heavy mlp")
    res["meta"]["within_model"] = {
      "name": f"MLP {'-'.join(map(str, cfg['within_mlp']))}",
      "params": _models.num_params(model.init(jax.random.key(0))),
      "global_batch": cfg["global_batch"],
    }
    wcfg = dict(cfg, ks=cfg["within_ks"])
    res["within"] = _within.run(model, wcfg, progress=bar, log=log)
    res["within_compile"] = _within.compile_times(
      model, wcfg, repeats=cfg.get("within_compile_repeats", 3), log=log
    )
    save()
  if "precision" in only:
    res["precision"] = _precision.run(cfg, progress=bar, log=log)
    save()
  if "distributed" in only:
    res["distributed"] = run_distributed(cfg, log)
    save()
  if "compile" in only:
    res["compile"] = [
      _compile.run(model, dict(cfg, micro=micro), cfg["compile_k"], cfg["compile_rounds"], log)
      for model, micro in models
    ]
  bar.close()
  res["meta"]["seconds"] = time.perf_counter() - t0
  res["meta"]["load_end"] = os.getloadavg()[0]
  if part is not None:
    save(complete=True)
    print(f"wrote the part {part}")
    return
  # A compile-only run writes compile.md alone: results.md and results.json stay the full run's.
  files = [] if set(only) <= {"compile"} else _report.write(res, out)
  files += write_compile(res, out)
  print()
  print(
    _report.markdown(
      {**res, "cross": [], "noise": [], "within": [], "precision": [], "distributed": []}
    )
  )
  print(f"wrote {', '.join(files)} to {out}")


if __name__ == "__main__":
  main()
