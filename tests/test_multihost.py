"""Multi-host: two real `jax.distributed` processes on 127.0.0.1 train like one process.

The processes are started by `optax_accum.launch.launch` (CPU devices, collectives over gloo),
which kills them on failure or timeout; the coordinator port is a free one and is free again
afterwards.
"""

import os
import pathlib
import socket
import sys

import _multihost_worker as worker
import _reference as ref
import chex
import jax
import numpy as np
import pytest

import optax_accum
from optax_accum import launch as launcher

pytestmark = pytest.mark.slow  # real processes and a coordinator: an integration test


def _hostname_is_loopback() -> bool:
  try:
    return socket.gethostbyname(socket.gethostname()).startswith("127.")
  except OSError:
    return False


# Gloo's TCP transport binds to the address this machine's hostname resolves to (JAX has no
# public option to pin it). Tests may only send traffic to 127.0.0.0/8, so where the hostname
# resolves elsewhere the two-process test must not run: it is skipped, loudly, with the reason.
needs_loopback_hostname = pytest.mark.skipif(
  not _hostname_is_loopback(),
  reason="the hostname does not resolve to 127.0.0.0/8; gloo would use a non-loopback address",
)


@needs_loopback_hostname
@pytest.mark.parametrize("local_devices", [1, 4])
def test_two_processes_train_like_one(tmp_path, local_devices, monkeypatch):
  ports = []
  real_free_port = launcher.free_port
  monkeypatch.setattr(launcher, "free_port", lambda: ports.append(real_free_port()) or ports[-1])
  # The workers import the optax_accum under test (this checkout's), not an installed copy.
  root = str(pathlib.Path(optax_accum.__file__).resolve().parent.parent)
  path = [root, os.environ.get("PYTHONPATH")]
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
  codes = launcher.launch(
    [sys.executable, worker.__file__, str(tmp_path)],
    num_processes=2,
    local_devices=local_devices,
    timeout=120,
    log_dir=str(tmp_path),
  )
  logs = "\n".join((tmp_path / f"process_{i}.log").read_text() for i in range(2))
  assert codes == [0, 0], logs
  got = [dict(np.load(tmp_path / f"params_{i}.npz")) for i in range(2)]
  chex.assert_trees_all_equal(got[0], got[1], strict=True)  # the processes agree to the bit
  want = worker.train(jax.devices()[: 2 * local_devices])  # one process, same devices count
  if local_devices == 1:  # a sum of two terms: the same in any order
    chex.assert_trees_all_equal(got[0], want, strict=True)
  else:
    # Eight partial sums: gloo across the processes and XLA within one add them in other
    # orders, which may differ in the last bit.
    chex.assert_trees_all_close(got[0], want, **ref.TOL)
  # Nothing listens on the coordinator port any more. (SO_REUSEADDR: closed connections may
  # linger in TIME_WAIT, which does not block a new listener; a live listener still would.)
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", ports[0]))
    s.listen()


def test_launch_kills_the_others_when_one_fails(tmp_path):
  # Process 1 fails at once; process 0 would sleep for a minute unless killed.
  code = (
    "import os, sys, time\n"
    "if os.environ['OPTAX_ACCUM_PROCESS_ID'] == '1': sys.exit(3)\n"
    "time.sleep(60)\n"
  )
  codes = launcher.launch([sys.executable, "-c", code], num_processes=2, timeout=30)
  assert codes[1] == 3 and codes[0] != 0


def test_launch_times_out(tmp_path):
  with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
    launcher.launch([sys.executable, "-c", "import time; time.sleep(60)"], 2, timeout=0.5)


def test_launch_rejects_bad_num_processes():
  with pytest.raises(ValueError, match="num_processes must be a positive int, got 0"):
    launcher.launch([sys.executable, "-c", "pass"], 0)
