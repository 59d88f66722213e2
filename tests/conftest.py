"""Test configuration: 8 host CPU devices for the multi-device tests, and a quiet session end.

`XLA_FLAGS` must be set before JAX initialises its backends; the README's test command sets it,
and this file sets it too so that `pytest tests/test_x.py` alone behaves the same.
"""

import gc
import os

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
