"""The training run of tests/test_orbax.py, importable and runnable as a fresh process.

``python tests/_orbax_worker.py resume CKPT_DIR OUT.npz VARIANT [CKPT_DIR OUT.npz VARIANT ...]``
restores each checkpoint that `save_mid_window` wrote (in another process), finishes its run and
writes the parameters (and the restored window position) to its OUT.npz: one fresh process for
every variant. The test compares them bit for bit with the runs that were never interrupted.
Run as a script, Python puts tests/ on the path: `_reference` imports.
"""

from __future__ import annotations

import sys

import _reference as ref
import jax
import numpy as np
import optax
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


# The same run with the batch following the noise scale and the learning rate following the
# AdaScale gain (issue 22): window lengths chosen on the device, a schedule on progress τ.
GAIN_TOTAL = 16
GAIN_SAVE_AT = 7


def setup_gain():
  params = ref.mlp_params(0, (16, 4))
  batches = ref.split(ref.regression_data(0, GAIN_TOTAL * 8, 16, 4), GAIN_TOTAL)
  lr = optax.cosine_decay_schedule(1e-2, 12)
  inner = optax.chain(
    optax.scale_by_adam(), optax_accum.scale_by_gain(lr, base_weight=2, rule="sqrt")
  )
  every_k = optax_accum.FollowNoiseScale(2, 4)
  return params, batches, optax_accum.accumulate(inner, every_k, noise_scale=True)


VARIANTS = {"adam": (setup, TOTAL, SAVE_AT), "gain": (setup_gain, GAIN_TOTAL, GAIN_SAVE_AT)}


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


def save_mid_window(path, variant="adam"):
  """Trains the variant's SAVE_AT micro-steps and checkpoints parameters and optimizer state."""
  make, _, save_at = VARIANTS[variant]
  params, batches, tx = make()
  params, state = run(tx, params, tx.init(params), batches[:save_at])
  save(path, params, state)
  return params, state


def uninterrupted(variant="adam"):
  params, batches, tx = VARIANTS[variant][0]()
  return run(tx, params, tx.init(params), batches)


def resume(path, out, variant="adam"):
  make, _, save_at = VARIANTS[variant]
  params0, batches, tx = make()
  abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params0)
  restored = restore(path, abstract)
  state = restored["opt_state"]
  if not isinstance(state, optax_accum.AccumulateState):
    raise TypeError(f"restored optimizer state is a {type(state).__name__}")
  mini_step, acc_w = int(state.mini_step), np.asarray(state.grad_sum["w0"])
  params, state = run(tx, restored["params"], state, batches[save_at:])
  extra = {}
  if variant == "gain":
    extra = dict(progress=np.asarray(optax_accum.progress(state)), window_k=int(state.window_k))
  np.savez(
    out,
    **{name: np.asarray(value) for name, value in params.items()},
    restored_mini_step=mini_step,
    restored_acc_w=acc_w,
    gradient_step=int(state.gradient_step),
    **extra,
  )


if __name__ == "__main__":
  mode, *jobs = sys.argv[1:]
  if mode != "resume" or not jobs or len(jobs) % 3:
    raise SystemExit(f"usage: {sys.argv[0]} resume CKPT_DIR OUT.npz VARIANT [...] (got {mode!r})")
  for i in range(0, len(jobs), 3):
    resume(*jobs[i : i + 3])
