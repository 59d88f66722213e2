"""The training run of tests/test_orbax.py, importable and runnable as a fresh process.

``python tests/_orbax_worker.py resume CKPT_DIR OUT.npz`` restores a checkpoint that
`save_mid_window` wrote (in another process), finishes the run and writes the parameters (and
the restored window position) to OUT.npz. The test compares them bit for bit with the run that
was never interrupted.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_accum

K = 4  # micro-steps per window
TOTAL = 10  # micro-steps in the whole run: 2.5 windows
SAVE_AT = 6  # checkpoint after micro-step 6: two micro-batches into the second window


def setup():
  """Initial parameters, the data of every micro-step, and the optimizer: all deterministic."""
  kp, kx, ky = jax.random.split(jax.random.key(0), 3)
  params = {"w": jax.random.normal(kp, (16, 4)), "b": jnp.zeros((4,))}
  xs = jax.random.normal(kx, (TOTAL, 8, 16))
  ys = jax.random.normal(ky, (TOTAL, 8, 4))
  tx = optax_accum.accumulate(optax.adam(0.05), K)
  return params, (xs, ys), tx


def _loss(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def make_step(tx):
  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(step, params, state, data, start, stop):
  xs, ys = data
  for i in range(start, stop):
    params, state = step(params, state, xs[i], ys[i])
  return params, state


def save(path, params, state):
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, {"params": params, "opt_state": state})
  ckptr.wait_until_finished()


def restore(path, abstract):
  """Restores into `abstract` (a tree of `jax.ShapeDtypeStruct`s, shardings included)."""
  return ocp.StandardCheckpointer().restore(path, abstract)


def save_mid_window(path):
  """Trains SAVE_AT micro-steps and checkpoints parameters and optimizer state."""
  params, data, tx = setup()
  step = make_step(tx)
  params, state = run(step, params, tx.init(params), data, 0, SAVE_AT)
  save(path, params, state)
  return params, state


def uninterrupted():
  params, data, tx = setup()
  return run(make_step(tx), params, tx.init(params), data, 0, TOTAL)


def resume(path, out):
  params0, data, tx = setup()
  abstract = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, params0)
  restored = restore(path, abstract)
  state = restored["opt_state"]
  if not isinstance(state, optax_accum.AccumulateState):
    raise TypeError(f"restored optimizer state is a {type(state).__name__}")
  mini_step, acc_w = int(state.mini_step), np.asarray(state.acc_grads["w"])
  params, state = run(make_step(tx), restored["params"], state, data, SAVE_AT, TOTAL)
  np.savez(
    out,
    w=np.asarray(params["w"]),
    b=np.asarray(params["b"]),
    restored_mini_step=mini_step,
    restored_acc_w=acc_w,
    gradient_step=int(state.gradient_step),
  )


if __name__ == "__main__":
  mode, path, out = sys.argv[1:]
  if mode != "resume":
    raise SystemExit(f"usage: {sys.argv[0]} resume CKPT_DIR OUT.npz (got mode {mode!r})")
  resume(path, out)
