"""`benchmarks/gpu.sh --dry-run`: the one-GPU script end to end on tiny sizes (any CPU), so that
it is known to run before a GPU is lent for it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # every benchmark section and the LM run: ~1-2 minutes

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_script_dry_run_writes_every_section():
  out = ROOT / "benchmarks" / "results" / "tmp" / "gpu-dry-run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
    ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "gpu.sh: done in " in proc.stdout
  res = json.loads((out / "results.json").read_text())
  assert res["meta"]["scale"] == "gpu_dry_run"
  assert res["cross"] and res["noise"] and res["within"] and res["compile"]
  contenders = {row["contender"] for row in res["cross"]}
  assert any("TrainStep" in c for c in contenders) and any("MultiSteps" in c for c in contenders)
  assert any(row["dispatch"] for row in res["cross"])  # the emission section
  assert any(row.get("case") == "padded" for row in res["within"]) and res["within_compile"]
  assert any("TrainStep" in c for row in res["noise"] for c in row["contenders"])
  assert set(res["compile"][0]["seconds"]) == {"protocol (one program)", "TrainStep, sequential",
                                               "TrainStep.compile"}  # fmt: skip
  assert "TrainStep.compile" in (out / "compile.md").read_text()
  assert "tokens/s" in (out / "lm" / "results.md").read_text()
  accel = json.loads((out / "accel.json").read_text())  # issue 33's rows
  assert {r["contender"] for r in accel["fusion"]} == {r["contender"] for r in accel["microstep"]
                                                        if "accumulator_bytes" in r}  # fmt: skip
  assert any("device conditional" in r["contender"] for r in accel["microstep"])
  assert "beta = 1" in (out / "accel.md").read_text()
  # the overlapped reduction's price against the closing program, and the LM per accumulator
  assert [r["contender"].split(" ")[0] for r in accel["overlap"]] == ["leaf", "closing"]
  assert all(r["compile_s"] > 0 and r["us_per_micro_step"] > 0 for r in accel["overlap"])
  lm_rows = accel["lm"][1:]
  assert {r["contender"] for r in lm_rows} == {r["contender"] for r in accel["microstep"]
                                               if "skip_nonfinite" not in r["contender"]
                                               and "accumulator_bytes" in r}  # fmt: skip
  assert all(np.isfinite(r["held_out_loss"]) for r in lm_rows)
  assert "byte LM's final loss" in (out / "accel.md").read_text()
  fsdp = json.loads((out / "fsdp.json").read_text())  # issue 43: three points per layout
  assert {r["keep_unsharded"] for r in fsdp["rows"]} == {"nothing", "params", "params_and_grads"}
  assert all(r["ms_per_update"] > 0 and r["memory"]["peak"] > 0 for r in fsdp["rows"])
