"""`examples/lm_resume.py`, the language-model guide's recipe, run as a user runs it: interrupted
with SIGINT (Ctrl-C) mid-window, it saves, prints a few lines and no traceback; killed with
SIGKILL mid-window and started again on the same directory, it ends with the parameters of a run
never interrupted, bit for bit; started under another configuration, it refuses.

With k = 5 and a checkpoint every 4 micro-steps, every checkpoint before the last one (4, 8, 12,
16: window positions 4, 3, 2, 1 of 5) is mid-window, wherever the kill lands.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

# The runs: processes killed and restarted, integration tests (slow); the flag checks are not.
slow = pytest.mark.slow

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "examples" / "lm_resume.py"
TOTAL = 20  # the script's defaults: k = 5, 4 optimizer steps


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
  """The runs' environment, with one compilation cache for every run of this file: a restarted
  process loads the programs the first run compiled (the same programs, so the same bits)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  return env


@pytest.fixture(scope="module")
def uninterrupted(env, tmp_path_factory) -> pathlib.Path:
  """The script's whole run with its defaults, never interrupted: its checkpoint directory."""
  directory = tmp_path_factory.mktemp("lm_example") / "uninterrupted"
  done = _run(env, directory)
  assert done.returncode == 0, done.stderr[-3000:]
  return directory


def _run(env, directory, *flags: str) -> subprocess.CompletedProcess:
  command = [sys.executable, str(SCRIPT), "--dir", str(directory), *flags]
  return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _killed_at(env, directory, line: str) -> None:
  """Starts the script and SIGKILLs it as soon as it prints `line`."""
  command = [sys.executable, str(SCRIPT), "--dir", str(directory)]
  proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
  seen = []
  for out in proc.stdout:
    seen.append(out)
    if out.startswith(line):
      proc.send_signal(signal.SIGKILL)
      break
  assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(seen)


def _interrupted_at(env, directory, line: str) -> tuple[int, int, list[str]]:
  """Starts the script, sends it SIGINT (what Ctrl-C sends) as soon as it prints `line`, lets it
  stop by itself; returns the micro-step and window position it saved at, and the lines it
  printed after `line` (stdout and stderr)."""
  command = [sys.executable, str(SCRIPT), "--dir", str(directory)]
  proc = subprocess.Popen(
    command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  seen = []
  for out in proc.stdout:
    seen.append(out)
    if out.startswith(line):
      proc.send_signal(signal.SIGINT)
      break
  after = proc.stdout.read().splitlines()
  assert proc.wait(timeout=120) == 130, "".join(seen) + "\n".join(after)
  saved = re.fullmatch(
    r"interrupted: saved at micro-step (\d+), window position (\d+)/5; run the same command to "
    r"resume from there",
    after[-1],
  )
  assert saved, after
  return int(saved[1]), int(saved[2]), after


@slow
def test_lm_example_killed_mid_window_resumes_bit_for_bit(env, uninterrupted, tmp_path):
  ckpt = tmp_path / "killed"
  # Interrupted after micro-step 6 (position 1/5): it stops after that one or a next one, before
  # the window's end at 10 unless the machine stalls it for 3 micro-steps.
  step, position, after = _interrupted_at(env, ckpt, "micro-step 6/")
  assert 6 <= step < 10 and position == step % 5, after
  assert "interrupted: stopping after this micro-step" in after, after
  assert len(after) <= 2 + (step - 6) and not any("Traceback" in a for a in after), after
  _killed_at(env, ckpt, "micro-step 13/")
  resumed = _run(env, ckpt)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  step, position = map(int, re.search(r"resumed after micro-step (\d+): window position (\d+)/5",
                                      resumed.stdout).groups())  # fmt: skip
  assert 4 <= step < TOTAL and position == step % 5 and position != 0  # mid-window
  assert f"micro-step {TOTAL}/{TOTAL}" in resumed.stdout
  assert f"micro-step {step}/" not in resumed.stdout  # nothing trained twice

  got = np.load(ckpt / "final_params.npz")
  ref = np.load(uninterrupted / "final_params.npz")
  assert sorted(got.files) == sorted(ref.files) == ["down", "embed", "head", "pos", "up"]
  for name in ref.files:
    np.testing.assert_array_equal(got[name], ref[name], err_msg=name, strict=True)
  assert not np.array_equal(ref["head"], _initial_head())  # it trained


def _example():
  """examples/lm_resume.py as a module."""
  sys.path.insert(0, str(SCRIPT.parent))
  try:
    import lm_resume  # noqa: PLC0415

    return lm_resume
  finally:
    sys.path.remove(str(SCRIPT.parent))


def _initial_head() -> np.ndarray:
  return np.asarray(_example().init_params(0, 32, 64)["head"])


@pytest.mark.parametrize(
  "flag, value, needs",
  [
    ("--k", "0", "a positive int"),
    ("--every", "0", "a positive int"),
    ("--rows", "0", "a positive int"),
    ("--steps", "-2", "a positive int"),
    ("--k", "2.5", "a positive int"),
    ("--seed", "-1", "an int in [0, 2**32)"),
  ],
)
def test_lm_example_bad_flags_are_argparse_errors(flag, value, needs, tmp_path, capsys):
  # argparse refuses before anything is built: no process, no training.
  with pytest.raises(SystemExit) as exit:
    _example().main(["--dir", str(tmp_path / "run"), flag, value])
  assert exit.value.code == 2
  err = capsys.readouterr().err
  assert f"error: argument {flag}: must be {needs}, got {value!r}" in err, err
  assert not (tmp_path / "run").exists()  # nothing written


@slow
def test_lm_example_refuses_another_configuration(env, uninterrupted, tmp_path):
  run = tmp_path / "run"
  shutil.copytree(uninterrupted, run)  # a finished run: 4 steps of k = 5, seed 0
  other = _run(env, run, "--k", "4", "--seed", "1")
  assert other.returncode == 1 and "micro-step" not in other.stdout
  assert (
    "refusing to resume: --k 5 in the checkpoints, 4 now; --seed 0 in the checkpoints, 1 now. "
    "Resume with --k 5 --seed 0, or give a new --dir." in other.stderr
  )
  fewer = _run(env, run, "--steps", "3")
  assert fewer.returncode == 1 and "at micro-step 20, past --steps 3 (15)" in fewer.stderr
  more = _run(env, run, "--steps", "5")  # more steps extend the run
  assert more.returncode == 0 and "resumed after micro-step 20: window position 0/5" in more.stdout
  assert "micro-step 25/25" in more.stdout
