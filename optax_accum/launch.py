"""Run a multi-host JAX program as N local processes: ``python -m optax_accum.launch``.

A multi-host program (one Python process per host, `jax.distributed`) can be tried on one
machine: this starts N copies of a script, each told its process id and a coordinator on
127.0.0.1, optionally with N fake CPU devices each, and CPU collectives over gloo::

    python -m optax_accum.launch --num-processes 2 --local-devices 4 train.py --steps 10

The script calls `initialize` before anything else touches JAX::

    import optax_accum.launch
    optax_accum.launch.initialize()   # jax.distributed.initialize(...) from the launcher's env
    import jax
    mesh = jax.make_mesh((jax.device_count(),), ("data",))   # every process's devices

On a real cluster use its own launcher (SLURM, Kubernetes, ...): `initialize` then calls
``jax.distributed.initialize()``, which finds the cluster by itself.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

_COORDINATOR = "OPTAX_ACCUM_COORDINATOR"
_NUM_PROCESSES = "OPTAX_ACCUM_NUM_PROCESSES"
_PROCESS_ID = "OPTAX_ACCUM_PROCESS_ID"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def initialize() -> None:
  """Initialises `jax.distributed` in a process started by `launch` (or by a cluster).

  Call it first, before any other use of JAX. Under `launch` it selects CPU collectives over
  gloo (so that CPU devices of different processes can all-reduce) and connects to the
  launcher's coordinator on 127.0.0.1; elsewhere it calls ``jax.distributed.initialize()``,
  which detects the cluster environment (SLURM, Open MPI, Kubernetes, Cloud TPU).
  """
  import jax  # noqa: PLC0415  (only the launched processes need it)

  if _COORDINATOR not in os.environ:
    jax.distributed.initialize()
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=os.environ[_COORDINATOR],
    num_processes=int(os.environ[_NUM_PROCESSES]),
    process_id=int(os.environ[_PROCESS_ID]),
  )


def _env(process_id: int, num_processes: int, port: int, local_devices: int | None) -> dict:
  env = dict(os.environ)
  env[_COORDINATOR] = f"127.0.0.1:{port}"
  env[_NUM_PROCESSES] = str(num_processes)
  env[_PROCESS_ID] = str(process_id)
  if local_devices is not None:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
  return env


def launch(
  command: Sequence[str],
  num_processes: int,
  *,
  local_devices: int | None = None,
  timeout: float | None = None,
  log_dir: str | None = None,
) -> list[int]:
  """Runs `command` as `num_processes` `jax.distributed` processes on this machine.

  Every process gets the coordinator address (127.0.0.1 and a free port), the number of
  processes and its id in its environment (`initialize` reads them). When one process fails,
  or `timeout` passes, the others are killed: a process left waiting in a collective would
  wait for ever.

  Args:
    command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
    num_processes: how many processes, an int >= 1.
    local_devices: if given, each process runs on the CPU with this many devices.
    timeout: seconds before every process is killed; None waits for ever.
    log_dir: if given, process i writes its stdout and stderr to ``log_dir/process_i.log``;
      otherwise they go to this process's.

  Returns:
    The processes' exit codes, in process-id order (all 0 on success).

  Raises:
    ValueError: for a bad `num_processes` or `local_devices`.
    TimeoutError: if the processes did not all finish within `timeout`.

  >>> import sys
  >>> from optax_accum.launch import launch
  >>> launch([sys.executable, "-c", "pass"], num_processes=2, timeout=60)
  [0, 0]
  """
  for name, value in (("num_processes", num_processes), ("local_devices", local_devices)):
    if value is None and name == "local_devices":
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"launch: {name} must be a positive int, got {value!r}.")
  port = free_port()
  logs, procs = [], []
  try:
    for i in range(num_processes):
      out = None
      if log_dir is not None:
        out = open(os.path.join(log_dir, f"process_{i}.log"), "w")  # noqa: SIM115
        logs.append(out)
      procs.append(
        subprocess.Popen(
          list(command),
          env=_env(i, num_processes, port, local_devices),
          stdout=out,
          stderr=subprocess.STDOUT if out is not None else None,
        )
      )
    deadline = None if timeout is None else time.monotonic() + timeout
    while [p.poll() for p in procs].count(None):  # poll every process, not just the first
      if any(p.returncode not in (None, 0) for p in procs):
        break  # one failed: the others would wait in a collective
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(
          f"launch: the {num_processes} processes did not finish within {timeout} s."
        )
      time.sleep(0.05)
    return [p.returncode if p.poll() is not None else -9 for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
    for f in logs:
      f.close()


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m optax_accum.launch",
    description="Run a JAX script as N jax.distributed processes on 127.0.0.1.",
  )
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--local-devices", type=int, default=None, help="CPU devices per process")
  parser.add_argument("--timeout", type=float, default=None, help="seconds")
  parser.add_argument("--log-dir", default=None)
  parser.add_argument("script")
  parser.add_argument("args", nargs=argparse.REMAINDER)
  a = parser.parse_args(argv)
  try:
    codes = launch(
      [sys.executable, a.script, *a.args],
      a.num_processes,
      local_devices=a.local_devices,
      timeout=a.timeout,
      log_dir=a.log_dir,
    )
  except TimeoutError as e:
    print(e, file=sys.stderr)
    return 124
  for i, c in enumerate(codes):
    if c != 0:
      print(f"process {i} exited with {c}", file=sys.stderr)
  return max((abs(c) for c in codes), default=0)


if __name__ == "__main__":
  sys.exit(main())
