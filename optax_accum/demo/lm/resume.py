"""The checkpointed run: ``python -m optax_accum.demo lm --checkpoint-dir DIR [--distributed]``.

`TrainStep` with token weights on the grain pipeline, one process or several (`--distributed`,
e.g. under ``python -m optax_accum.launch``: data parallel over every process's devices, each
process reading its own rows of every micro-batch). Every ``--checkpoint-every`` micro-steps an
Orbax `CheckpointManager` saves, asynchronously, the parameters, the optimizer state (the open
window's weighted sums and position included) and each process's grain iterator state. Orbax
writes a checkpoint into a temporary directory and renames it when every file is written, so a
checkpoint that a kill interrupts is never listed, never restored. Started again on the same
directory, the run restores the latest finished checkpoint and goes on: it reads the same
micro-batches and ends with the same parameters, to the bit, as a run never interrupted. Each
checkpoint also holds the run's configuration (`run_config`): a resume under another one
refuses before it restores anything.

`examples/lm_resume.py` is the same recipe on public names only, for one process.

After each micro-step it prints ``micro-step N/TOTAL window position P/K`` (flushed; P = K:
the window closed and the update was applied): a test
can wait for one and kill the process there. Ctrl-C (SIGINT) stops the run after the current
micro-step, with a checkpoint there, closes the checkpoint manager and prints one line saying
where the run will resume (a second Ctrl-C exits at once; the run then resumes from the latest
finished checkpoint). With the environment variable
``OPTAX_ACCUM_LM_STOP_AT=N`` the process stops itself (SIGSTOP, every thread: an asynchronous
save in flight stays half-written) right after that line for micro-step N, to be killed there.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo.lm import budget, data, model, require, run_config

AXIS = "data"
STOP_AT = "OPTAX_ACCUM_LM_STOP_AT"


class _Interrupt:
  """Ctrl-C (SIGINT) as a request to stop after the current micro-step, not an exception.

  A `KeyboardInterrupt` raised inside a step or an asynchronous Orbax save leaves the manager's
  threads to fail one by one at exit (hundreds of lines of tracebacks that read like a corrupted
  checkpoint). Here the first Ctrl-C only sets `requested`; the loop saves, closes the manager and
  says where the run resumes. A second one exits at once: a checkpoint in flight is left in its
  temporary directory, never listed, never restored.
  """

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc):
    signal.signal(signal.SIGINT, self._previous)

  def _handle(self, signum, frame):
    if self.requested:
      print("interrupted again: exiting now (the run resumes from its latest finished "
            "checkpoint)", file=sys.stderr, flush=True)  # fmt: skip
      os._exit(128 + signal.SIGINT)
    self.requested = True
    print("interrupted: stopping after this micro-step (Ctrl-C again to exit at once)",
          file=sys.stderr, flush=True)  # fmt: skip

  def agreed(self) -> bool:
    """Whether any process was interrupted: every process stops at the same micro-step (the
    saves are collective)."""
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))


class _Snapshot:
  """A grain iterator's state, taken now: what grain's Orbax handler saves (the live iterator
  moves on while the save is written in the background)."""

  def __init__(self, iterator):
    self._state = json.dumps(iterator.get_state()).encode()

  def get_state(self) -> bytes:
    return self._state


def _manager(directory: str, every: int):
  ocp = require("orbax.checkpoint")
  options = ocp.CheckpointManagerOptions(
    save_interval_steps=every, max_to_keep=2, enable_async_checkpointing=True
  )
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def _items(params, state, iterator, config: dict, restore: bool):
  """The checkpoint's four items, as Orbax save (or restore) arguments."""
  ocp, grain = require("orbax.checkpoint"), require("grain")
  if restore:
    abstract = lambda tree: jax.tree.map(  # noqa: E731
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    return ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract(params)),
      opt_state=ocp.args.StandardRestore(abstract(state)),
      data=grain.checkpoint.CheckpointRestore(iterator),
    )
  return ocp.args.Composite(
    params=ocp.args.StandardSave(params),
    opt_state=ocp.args.StandardSave(state),
    data=grain.checkpoint.CheckpointSave(_Snapshot(iterator)),
    config=ocp.args.JsonSave(config),
  )


def _global(mesh, local: dict) -> dict:
  """This process's rows of a micro-batch as one global array over the data axis."""
  sharding = NamedSharding(mesh, P(AXIS))
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def _replicated(mesh, tree):
  sharding = NamedSharding(mesh, P())
  return jax.tree.map(
    lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: np.asarray(a)[i]), tree
  )


def _window_k(args, loss, params) -> int:
  """``--k``, or the k that `plan_microbatches` picks under ``--memory-budget-mib``."""
  if args.k:
    return args.k
  limit = int(args.memory_budget_mib * budget.MIB)
  return budget.plan(loss, params, args.batch_size, args.cfg.seq_len, limit).num_microbatches


def _setup(args):
  """The mesh, the train step, the initial (replicated) parameters and state, the iterator."""
  mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
  graphdef, params0 = model.init(args.cfg, args.seed)
  k = _window_k(args, model.loss_fn(graphdef), params0)
  rows = args.batch_size // k
  if rows % jax.device_count():
    raise SystemExit(
      f"--batch-size / k = {args.batch_size} / {k} = {rows} rows per micro-batch must split "
      f"over the {jax.device_count()} devices: give a --batch-size that is a multiple of "
      f"{k * jax.device_count()}"
    )
  docs = data.documents(args.num_docs)
  tokens, mask = data.encode(docs, args.cfg.seq_len)
  pi, pc = jax.process_index(), jax.process_count()
  ds = data.dataset(tokens, mask, rows // pc, seed=args.seed, process_index=pi, process_count=pc)
  step = optax_accum.TrainStep(
    model.loss_fn(graphdef), require("optax").adam(args.lr), k,
    weight_fn=model.real_tokens, axis_name=AXIS, mesh=mesh, noise_scale=True,
  )  # fmt: skip
  params = _replicated(mesh, params0)
  return mesh, step, params, step.init(params), iter(ds), k


def _check_resumable(manager, start: int, config: dict, total: int, directory: str) -> None:
  """Exits (code 2, the message) unless the checkpoints were written by this configuration."""
  ocp = require("orbax.checkpoint")
  try:
    saved = manager.restore(start, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  except (KeyError, ValueError, FileNotFoundError) as e:
    raise SystemExit(
      f"refusing to resume {directory}: checkpoint {start} holds no run configuration (written "
      f"by an older version?): give another --checkpoint-dir to start a new run. ({e})"
    ) from None
  refusal = run_config.mismatch(saved["config"], config, directory) or run_config.past_the_end(
    start, total, config["k"], directory
  )
  if refusal:
    print(refusal, file=sys.stderr, flush=True)
    raise SystemExit(2)


def _position(mini_step: int, k: int) -> int:
  """The window position after a micro-step: k (not 0) once the window has closed."""
  return mini_step or k


def main(args):
  """Trains with checkpoints, resuming from the latest; writes the final parameters.

  Ctrl-C stops it after the current micro-step with a checkpoint there (exit code 130).
  """
  with _Interrupt() as interrupt:
    return _train(args, interrupt)


def _train(args, interrupt: _Interrupt):
  if args.distributed:
    from optax_accum import launch  # noqa: PLC0415

    launch.initialize()
  mesh, step, params, state, iterator, k = _setup(args)
  total, stop_at = args.steps * k, int(os.environ.get(STOP_AT, "0"))
  config = run_config.of(args, k, jax.process_count())
  manager = _manager(os.path.join(args.checkpoint_dir, "checkpoints"), args.checkpoint_every)
  start = manager.latest_step() or 0
  print(f"process {jax.process_index()} of {jax.process_count()}: pid {os.getpid()}", flush=True)
  if start:
    _check_resumable(manager, start, config, total, args.checkpoint_dir)
    restored = manager.restore(start, args=_items(params, state, iterator, config, restore=True))
    params, state = restored["params"], restored["opt_state"]
    position = _position(int(state.mini_step), k)
    print(f"restored micro-step {start} window position {position}/{k}", flush=True)
  print(f"compiling the train step (micro-step {start + 1}/{total} follows) …", flush=True)
  for n in range(start + 1, total + 1):
    params, state, _ = step(params, state, _global(mesh, next(iterator)))
    jax.block_until_ready(params)
    stopping = interrupt.agreed() and n < total
    save = _items(params, state, iterator, config, restore=False)
    manager.save(n, args=save, force=n == total or stopping)
    print(f"micro-step {n}/{total} window position {_position(n % k, k)}/{k}", flush=True)
    if n == stop_at:
      os.kill(os.getpid(), signal.SIGSTOP)
    if stopping:
      manager.wait_until_finished()
      manager.close()
      print(f"interrupted after micro-step {n}/{total} (window position {_position(n % k, k)}/"
            f"{k}): checkpoint {n} saved in {args.checkpoint_dir}; the same command resumes "
            "from it", flush=True)  # fmt: skip
      raise SystemExit(128 + signal.SIGINT)
  manager.wait_until_finished()
  manager.close()
  flat = {jax.tree_util.keystr(p): np.asarray(v.addressable_data(0))
          for p, v in jax.tree_util.tree_leaves_with_path(params)}  # fmt: skip
  out = os.path.join(args.checkpoint_dir, f"final_params_{jax.process_index()}.npz")
  np.savez(out, **flat)
  print(f"final parameters written to {out}", flush=True)
  return params
