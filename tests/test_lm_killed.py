"""The language-model run killed mid-window (SIGKILL) and resumed: bit for bit.

``python -m optax_accum.demo lm --quick --checkpoint-dir DIR`` checkpoints (Orbax, async) every 3
micro-steps, k = 4 micro-steps per window, 12 micro-steps in all. With ``OPTAX_ACCUM_LM_STOP_AT=N``
the run stops itself (SIGSTOP, every thread) right after micro-step N and its checkpoint call;
the test then SIGKILLs it there, starts it again on the same directory, and at the end compares
the final parameters with those of a run never interrupted, bit for bit.

Kill points (micro-step: position in the window of 4, the checkpoint restored):

* one process, twice in one run: at 6 (position 2/4) while checkpoint 6 is being written — its
  temporary directory is left half-written, never listed, and checkpoint 3 (position 3/4) is
  restored — then at 11 (position 3/4), restoring checkpoint 9 (position 1/4); then
  interrupted (SIGINT, as Ctrl-C sends) after micro-step 10 (position 2/4): it stops after the
  next one, saves checkpoint 11 (position 3/4), prints one line and no traceback, and the last
  run resumes from 11;
* two processes (`optax_accum.launch`, 127.0.0.1): at 6 (position 2/4) in both, checkpoint 6 in
  flight, checkpoint 3 restored.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from test_multihost import needs_loopback_hostname

from optax_accum import launch as launcher

pytestmark = pytest.mark.slow  # processes killed and restarted: an integration test

K, TOTAL, EVERY = 4, 12, 3
RUN = ["-m", "optax_accum.demo", "lm", "--quick", "--no-progress", "--steps", str(TOTAL // K)]
RUN += ["--batch-size", "8", "--k", str(K), "--checkpoint-every", str(EVERY)]


def _env(tmp_path, stop_at: int | None) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  # One compilation cache for every run of a test: a restarted process loads its programs.
  env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env.pop("OPTAX_ACCUM_LM_STOP_AT", None)
  if stop_at is not None:
    env["OPTAX_ACCUM_LM_STOP_AT"] = str(stop_at)
  return env


def _wait_for(logs, line: str, procs, timeout: float = 240.0) -> list[int]:
  """Waits until every log holds `line`; returns the pids the runs printed."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    texts = [log.read_text() if log.exists() else "" for log in logs]
    if all(line in t for t in texts):
      return [int(re.search(r"pid (\d+)", t).group(1)) for t in texts]
    if any(p() is not None for p in procs):
      break
    time.sleep(0.05)
  pytest.fail(f"no {line!r} in the logs:\n" + "\n".join(t[-2000:] for t in texts))


def _finished_steps(ckpt) -> tuple[list[int], list[str]]:
  """The checkpoints Orbax committed (integer names) and those left half-written."""
  names = os.listdir(ckpt / "checkpoints")
  done = sorted(int(n) for n in names if n.isdigit())
  return done, sorted(n for n in names if not n.isdigit())


def _stopped(pid: int, timeout: float = 60.0) -> None:
  """Waits until the process has stopped itself (SIGSTOP: state T in /proc)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    with open(f"/proc/{pid}/stat") as f:
      if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
        return
    time.sleep(0.01)
  pytest.fail(f"process {pid} did not stop")


def _one_process(tmp_path, ckpt, stop_at=None, interrupt=False):
  """Runs (or resumes) the single-process run; with `stop_at`, SIGKILLs it there (or, with
  `interrupt`, sends it SIGINT there, as Ctrl-C does, and lets it stop by itself)."""
  log = ckpt / f"log_{stop_at}.txt"
  with open(log, "w") as out:
    proc = subprocess.Popen(
      [sys.executable, *RUN, "--checkpoint-dir", str(ckpt)],
      env=_env(tmp_path, stop_at), stdout=out, stderr=subprocess.STDOUT,
    )  # fmt: skip
    if stop_at is None:
      assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    elif interrupt:
      _wait_for([log], f"micro-step {stop_at}/{TOTAL} ", [proc.poll])
      _stopped(proc.pid)
      proc.send_signal(signal.SIGINT)
      proc.send_signal(signal.SIGCONT)
      assert proc.wait(timeout=120) == 128 + signal.SIGINT, log.read_text()[-3000:]
    else:
      _wait_for([log], f"micro-step {stop_at}/{TOTAL} ", [proc.poll])
      proc.send_signal(signal.SIGKILL)
      assert proc.wait(timeout=60) == -signal.SIGKILL
  return log.read_text()


def _final(ckpt, process: int = 0) -> dict:
  return dict(np.load(ckpt / f"final_params_{process}.npz"))


def _assert_bit_identical(got: dict, want: dict) -> None:
  assert got.keys() == want.keys() and len(want) > 10
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name, strict=True)


def _in_flight(partial: list[str]) -> list[int]:
  """The steps of the half-written checkpoints: Orbax names them ``<step>.orbax-checkpoint-tmp``
  (with a ``-<n>`` suffix in older releases, e.g. 0.11.17)."""
  return [
    int(m.group(1))
    for p in partial
    if (m := re.fullmatch(r"(\d+)\.orbax-checkpoint-tmp(-\d+)?", p))
  ]


def _restored(log: str) -> tuple[int, int]:
  step, position = re.search(r"restored micro-step (\d+) window position (\d+)/", log).groups()
  return int(step), int(position)


def test_lm_killed_mid_window_resumes_bit_for_bit(tmp_path):
  want_dir, ckpt = tmp_path / "uninterrupted", tmp_path / "killed"
  want_dir.mkdir(), ckpt.mkdir()
  _one_process(tmp_path, want_dir)

  _one_process(tmp_path, ckpt, stop_at=6)  # position 2/4, checkpoint 6 being written
  done, partial = _finished_steps(ckpt)
  assert max(done) == 3 and len(partial) == 1 and _in_flight(partial) == [6], (done, partial)
  log = _one_process(tmp_path, ckpt, stop_at=11)  # position 3/4
  assert _restored(log) == (3, 3)  # the finished checkpoint, not the half-written one
  # Checkpoint 9 is restored, or 6 where the kill at 11 caught 9 still in flight (a loaded CPU).
  assert _restored(_one_process(tmp_path, ckpt, stop_at=10, interrupt=True)) in [(9, 1), (6, 2)]
  after = (ckpt / "log_10.txt").read_text().split(f"micro-step 10/{TOTAL} window position 2/4\n")[1]
  assert after.splitlines() == [  # a few lines, no traceback
    "interrupted: stopping after this micro-step (Ctrl-C again to exit at once)",
    f"micro-step 11/{TOTAL} window position 3/4",
    f"interrupted after micro-step 11/{TOTAL} (window position 3/4): checkpoint 11 saved in "
    f"{ckpt}; the same command resumes from it",
  ], after
  done, partial = _finished_steps(ckpt)
  assert max(done) == 11, (done, partial)  # saved, the manager closed: committed
  log = _one_process(tmp_path, ckpt)
  assert _restored(log) == (11, 3)
  assert f"micro-step {TOTAL}/{TOTAL}" in log

  _assert_bit_identical(_final(ckpt), _final(want_dir))


def _two_processes(monkeypatch, tmp_path, ckpt, stop_at=None) -> list[str]:
  """Runs (or resumes) the run as two `jax.distributed` processes; SIGKILLs both at `stop_at`."""
  for name, value in _env(tmp_path, stop_at).items():
    monkeypatch.setenv(name, value)  # `launch` passes this environment on
  if stop_at is None:
    monkeypatch.delenv("OPTAX_ACCUM_LM_STOP_AT", raising=False)
  command = [sys.executable, *RUN, "--checkpoint-dir", str(ckpt), "--distributed"]
  logs = [ckpt / f"process_{i}.log" for i in range(2)]
  for log in logs:
    log.unlink(missing_ok=True)
  codes: list = []
  run = lambda: codes.append(  # noqa: E731
    launcher.launch(command, num_processes=2, local_devices=1, timeout=300, log_dir=str(ckpt))
  )
  launched = threading.Thread(target=run)
  launched.start()
  if stop_at is not None:
    pids = _wait_for(logs, f"micro-step {stop_at}/{TOTAL} ", [lambda: codes or None])
    for pid in pids:
      os.kill(pid, signal.SIGKILL)
  launched.join(timeout=360)
  texts = [log.read_text() for log in logs]
  want = [-signal.SIGKILL] * 2 if stop_at is not None else [0, 0]
  assert codes == [want], "\n".join(t[-2000:] for t in texts)
  return texts


@needs_loopback_hostname
def test_lm_killed_mid_window_two_processes_resume_bit_for_bit(tmp_path, monkeypatch):
  want_dir, ckpt = tmp_path / "uninterrupted", tmp_path / "killed"
  want_dir.mkdir(), ckpt.mkdir()
  _two_processes(monkeypatch, tmp_path, want_dir)
  _assert_bit_identical(_final(want_dir, 1), _final(want_dir, 0))  # the processes agree

  _two_processes(monkeypatch, tmp_path, ckpt, stop_at=6)  # position 2/4, checkpoint 6 in flight
  done, partial = _finished_steps(ckpt)
  assert max(done) == 3 and len(partial) == 1 and _in_flight(partial) == [6], (done, partial)
  logs = _two_processes(monkeypatch, tmp_path, ckpt)
  assert [_restored(log) for log in logs] == [(3, 3), (3, 3)]

  for process in range(2):
    _assert_bit_identical(_final(ckpt, process), _final(want_dir, process))
