"""The checkpointed run: ``python -m optax_accum.demo lm --checkpoint-dir DIR [--distributed]``.

`TrainStep` with token weights on the grain pipeline, one process or several (`--distributed`,
e.g. under ``python -m optax_accum.launch``: data parallel over every process's devices, each
process reading its own rows of every micro-batch). Every ``--checkpoint-every`` micro-steps an
Orbax `CheckpointManager` saves, asynchronously, the parameters, the optimizer state (the open
window's weighted sums and position included) and each process's grain iterator state. Orbax
writes a checkpoint into a temporary directory and renames it when every file is written, so a
checkpoint that a kill interrupts is never listed, never restored. Started again on the same
directory, the run restores the latest finished checkpoint and goes on: it reads the same
micro-batches and ends with the same parameters, to the bit, as a run never interrupted.

After each micro-step it prints ``micro-step N/TOTAL window position P/K`` (flushed): a test
can wait for one and kill the process there. With the environment variable
``OPTAX_ACCUM_LM_STOP_AT=N`` the process stops itself (SIGSTOP, every thread: an asynchronous
save in flight stays half-written) right after that line for micro-step N, to be killed there.
"""

from __future__ import annotations

import json
import os
import signal

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum._lm import data, model, require

AXIS = "data"
STOP_AT = "OPTAX_ACCUM_LM_STOP_AT"


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


def _items(params, state, iterator, restore: bool):
  """The checkpoint's three items, as Orbax save (or restore) arguments."""
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


def _setup(args):
  """The mesh, the train step, the initial (replicated) parameters and state, the iterator."""
  mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
  k = args.k or 4
  rows = args.batch_size // k
  if rows % jax.device_count():
    raise SystemExit(f"--batch-size / k = {rows} rows must split over {jax.device_count()} devices")
  graphdef, params0 = model.init(args.cfg, args.seed)
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


def main(args):
  """Trains with checkpoints, resuming from the latest; writes the final parameters."""
  if args.distributed:
    from optax_accum import launch  # noqa: PLC0415

    launch.initialize()
  mesh, step, params, state, iterator, k = _setup(args)
  total, stop_at = args.steps * k, int(os.environ.get(STOP_AT, "0"))
  manager = _manager(os.path.join(args.checkpoint_dir, "checkpoints"), args.checkpoint_every)
  start = manager.latest_step() or 0
  print(f"process {jax.process_index()} of {jax.process_count()}: pid {os.getpid()}", flush=True)
  if start:
    restored = manager.restore(start, args=_items(params, state, iterator, restore=True))
    params, state = restored["params"], restored["opt_state"]
    print(f"restored micro-step {start} window position {int(state.mini_step)}/{k}", flush=True)
  for n in range(start + 1, total + 1):
    params, state, _ = step(params, state, _global(mesh, next(iterator)))
    jax.block_until_ready(params)
    manager.save(n, args=_items(params, state, iterator, restore=False))
    print(f"micro-step {n}/{total} window position {n % k}/{k}", flush=True)
    if n == stop_at:
      os.kill(os.getpid(), signal.SIGSTOP)
  manager.wait_until_finished()
  manager.close()
  flat = {jax.tree_util.keystr(p): np.asarray(v.addressable_data(0))
          for p, v in jax.tree_util.tree_leaves_with_path(params)}  # fmt: skip
  out = os.path.join(args.checkpoint_dir, f"final_params_{jax.process_index()}.npz")
  np.savez(out, **flat)
  print(f"final parameters written to {out}", flush=True)
  return params
