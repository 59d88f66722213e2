"""The training run of tests/test_orbax.py, importable and runnable as a fresh process.

``python tests/_orbax_worker.py resume CKPT_DIR OUT.npz`` restores a checkpoint that
`save_mid_window` wrote (in another process), finishes the run and writes the parameters (and
the restored window position) to OUT.npz. The test compares them bit for bit with the run that
was never interrupted. Run as a script, Python puts tests/ on the path: `_reference` imports.
"""

from __future__ import annotations

import sys

import _reference as ref
import jax
import numpy as np
import orbax.checkpoint as ocp

import optax_accum

K = 4  # micro-steps per window
TOTAL = 10  # micro-steps in the whole run: 2.5 windows
SAVE_AT = 6  # checkpoint after micro-step 6: two micro-batches into the second window


def setup():
  """Initial parameters, the batch of every micro-step, and the optimizer: all deterministic."""
  params = ref.mlp_params(0, (16, 4))
  batches = ref.split(ref.regression_data(0, TOTAL * 8, 16, 4), TOTAL)
  return params, batches, optax_accum.accumulate(ref.ADAM, K)


def run(tx, params, state, batches):
  """One jitted micro-step per batch (the kit's, so every process compiles the same program)."""
  return ref.run_steps(tx, params, ref.mlp_loss, batches, state=state)


def save(path, params, state):
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, {"params": params, "opt_state": state})
  ckptr.wait_until_finished()


def restore(path, abstract):
  """Restores into `abstract` (a tree of `jax.ShapeDtypeStruct`s, shardings included)."""
  return ocp.StandardCheckpointer().restore(path, abstract)


def save_mid_window(path):
  """Trains SAVE_AT micro-steps and checkpoints parameters and optimizer state."""
  params, batches, tx = setup()
  params, state = run(tx, params, tx.init(params), batches[:SAVE_AT])
  save(path, params, state)
  return params, state


def uninterrupted():
  params, batches, tx = setup()
  return run(tx, params, tx.init(params), batches)


def resume(path, out):
  params0, batches, tx = setup()
  abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params0)
  restored = restore(path, abstract)
  state = restored["opt_state"]
  if not isinstance(state, optax_accum.AccumulateState):
    raise TypeError(f"restored optimizer state is a {type(state).__name__}")
  mini_step, acc_w = int(state.mini_step), np.asarray(state.acc_grads["w0"])
  params, state = run(tx, restored["params"], state, batches[SAVE_AT:])
  np.savez(
    out,
    **{name: np.asarray(value) for name, value in params.items()},
    restored_mini_step=mini_step,
    restored_acc_w=acc_w,
    gradient_step=int(state.gradient_step),
  )


if __name__ == "__main__":
  mode, path, out = sys.argv[1:]
  if mode != "resume":
    raise SystemExit(f"usage: {sys.argv[0]} resume CKPT_DIR OUT.npz (got mode {mode!r})")
  resume(path, out)
