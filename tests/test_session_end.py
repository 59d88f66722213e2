"""A green run ends quietly: tests/conftest.py leaves pytest's final garbage collections nothing
to walk (see its `pytest_sessionfinish`), so an xdist worker finishes within execnet's 5 s and
is never sent the SIGINT that printed a `KeyboardInterrupt` from JAX's gc callback."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two pytest sessions in subprocesses

CONFTEST = pathlib.Path(__file__).resolve().parent / "conftest.py"

PROBE = """
import gc


def pytest_unconfigure(config):  # before pytest's cleanup collects five times
  print(f"\\nPROBE tracked={len(gc.get_objects())} frozen={gc.get_freeze_count()}", flush=True)
"""

TEST = """
HELD = [[i] for i in range(200_000)]  # live objects, as a long session's caches are


def test_holds_objects():
  assert len(HELD) == 200_000
"""


def _probe(tmp_path, with_conftest: bool) -> tuple[int, int]:
  (tmp_path / "probe.py").write_text(PROBE)
  (tmp_path / "test_hold.py").write_text(TEST)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's configuration
  if with_conftest:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
     "-p", "probe", "test_hold.py"],
    cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": ""}, capture_output=True, text=True,
    timeout=120,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout + proc.stderr
  line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE"))
  tracked, frozen = (int(part.split("=")[1]) for part in line.split()[1:])
  return tracked, frozen


def test_session_end_leaves_the_final_collections_nothing_to_walk(tmp_path):
  tracked, frozen = _probe(tmp_path, with_conftest=True)
  assert frozen > 200_000 and tracked < 20_000, (tracked, frozen)


def test_session_end_probe_sees_the_objects_without_the_hook(tmp_path):
  # The control: without tests/conftest.py, the final collections walk every live object.
  tracked, frozen = _probe(tmp_path, with_conftest=False)
  assert frozen == 0 and tracked > 200_000, (tracked, frozen)
