"""Test configuration: 8 host CPU devices for the multi-device tests, and a quiet end (a
finished session, or Ctrl-C).

`XLA_FLAGS` must be set before JAX initialises its backends; the README's test command sets it,
and this file sets it too so that `pytest tests/test_x.py` alone behaves the same.
"""

import gc
import os
import signal

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"


def pytest_sessionfinish(session):
  """Collects the session's garbage once, then freezes what is left (`gc.freeze`).

  After the last test, pytest's own cleanup runs five full garbage collections (to report
  exceptions raised in `__del__`), each of which walks every live object: after hundreds of
  JAX tests, seconds each. Under pytest-xdist, a worker still busy 5 s after the controller
  closes its channel is sent SIGINT by execnet, which landed in JAX's gc callback and ended a
  green `-n 2` run with a `KeyboardInterrupt` traceback and a
  `PytestUnraisableExceptionWarning`. This hook runs before the worker reports that it has
  finished: one collection here (with pytest's hook for unraisable exceptions still in place),
  and the frozen objects are then skipped by the later ones, which take milliseconds.
  """
  gc.collect()
  gc.freeze()


@pytest.fixture(autouse=True)
def _each_test_is_its_own_run():
  """`privacy.dp_noise` remembers every key drawn from in the process and refuses a second run
  on it (a re-run notebook cell would redraw the same noise). Each test is a run of its own,
  with its own constant keys: the keys earlier tests drew from are forgotten before it starts
  (a test of the registry builds its runs inside itself)."""
  from optax_accum.privacy import _noise  # noqa: PLC0415 (after XLA_FLAGS is set)

  _noise._DRAWN.clear()


def pytest_configure(config):
  """Under pytest-xdist, Ctrl-C is the controller's alone: a worker ignores SIGINT.

  The terminal sends SIGINT to every process of the run. In a worker it raised
  KeyboardInterrupt wherever the worker was, often inside JAX's garbage-collection callback
  (`_xla_gc_callback`), where Python can only print it and go on: each worker then printed
  its tracebacks, reported as warnings, and ran on; an interrupted run could end in hundreds
  of lines. Ignored there, the controller stops the run (its own few lines) and shuts the
  workers down: a worker lets its current test finish, or is ended 15 s later by execnet.
  """
  if hasattr(config, "workerinput"):  # an xdist worker (not a session such a worker starts)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pytest_keyboard_interrupt(excinfo):
  """After the first Ctrl-C, a second one ends the run at once, with no traceback (while the
  workers finish their current test)."""
  del excinfo
  signal.signal(signal.SIGINT, signal.SIG_DFL)
