"""Orbax checkpoints of an `accumulate` state saved in the middle of a window.

* Resume in a fresh process (a subprocess running tests/_orbax_worker.py) and finish the run:
  the parameters are bit-identical to the run that was never interrupted.
* Restore onto a mesh of 8 CPU devices: every leaf, the accumulator sums included, comes back
  with the sharding asked for, and training continues to the unsharded run's result.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import _orbax_worker as worker
import _reference as ref
import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

pytestmark = pytest.mark.slow  # subprocesses and checkpoints on disk: an integration test


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
  """Per variant: the parameters and state saved mid-window here, and what a fresh process (one
  for both variants: the restores are independent) wrote after restoring and finishing."""
  root = tmp_path_factory.mktemp("orbax")
  saved, jobs = {}, []
  for variant in worker.VARIANTS:
    saved[variant] = worker.save_mid_window(root / variant / "ckpt", variant)
    jobs += [str(root / variant / "ckpt"), str(root / variant / "resumed.npz"), variant]
  proc = subprocess.run(
    [sys.executable, worker.__file__, "resume", *jobs],
    capture_output=True,
    text=True,
    timeout=300,
    env=_env_importing_this_checkout(),
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return {v: (*saved[v], dict(np.load(root / v / "resumed.npz"))) for v in worker.VARIANTS}


def test_orbax_resume_mid_window_in_fresh_process_is_bit_identical(resumed):
  assert worker.SAVE_AT % worker.K != 0  # the checkpoint is taken inside a window
  saved_params, saved_state, got = resumed["adam"]
  got = dict(got)  # popped below
  assert int(saved_state.mini_step) == worker.SAVE_AT % worker.K
  assert float(np.abs(saved_state.grad_sum["w0"]).max()) > 0  # the open window's sums

  # The fresh process saw the window exactly as it was left.
  assert int(got.pop("restored_mini_step")) == worker.SAVE_AT % worker.K
  np.testing.assert_array_equal(got.pop("restored_acc_w"), saved_state.grad_sum["w0"])

  params, state = worker.uninterrupted()
  assert int(got.pop("gradient_step")) == int(state.gradient_step) == worker.TOTAL // worker.K
  assert ref.max_abs_diff(params, saved_params) > 0  # the second window did update
  chex.assert_trees_all_equal(got, params, strict=True)


def test_orbax_resume_mid_window_with_gain_and_follow_noise_scale_regression_issue_22(resumed):
  """The batch following the noise scale and the learning rate the AdaScale gain: a checkpoint
  inside a window, resumed in a fresh process, finishes bit-identical to the uninterrupted run,
  with the same progress τ and the same next window length."""
  saved_params, saved_state, got = resumed["gain"]
  got = dict(got)  # popped below
  assert int(saved_state.mini_step) > 0  # inside a window
  assert int(saved_state.gradient_step) >= 2  # after updates whose gains entered τ
  assert float(optax_accum.progress(saved_state)) > int(saved_state.gradient_step)  # some r > 1

  assert int(got.pop("restored_mini_step")) == int(saved_state.mini_step)
  np.testing.assert_array_equal(got.pop("restored_acc_w"), saved_state.grad_sum["w0"])

  params, state = worker.uninterrupted("gain")
  assert int(got.pop("gradient_step")) == int(state.gradient_step)
  assert int(got.pop("window_k")) == int(state.window_k)
  np.testing.assert_array_equal(got.pop("progress"), np.asarray(optax_accum.progress(state)))
  assert ref.max_abs_diff(params, saved_params) > 0
  chex.assert_trees_all_equal(got, params, strict=True)


def _env_importing_this_checkout() -> dict:
  """The environment for a worker process that imports the `optax_accum` under test (this
  checkout's, as the tests do), not whichever copy is installed."""
  root = str(pathlib.Path(optax_accum.__file__).resolve().parent.parent)
  path = os.environ.get("PYTHONPATH")
  return {**os.environ, "PYTHONPATH": root if not path else root + os.pathsep + path}


@pytest.fixture(scope="module")
def mesh():
  if len(jax.devices()) < 8:
    pytest.fail("needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8")
  return jax.make_mesh((4, 2), ("data", "model"))


def test_orbax_sharded_restore_keeps_accumulator_sharding(tmp_path, mesh):
  params0, batches, tx = worker.setup()
  param_shardings = {
    "w0": NamedSharding(mesh, P("data", "model")),  # (16, 4) over 4 x 2 devices
    "b0": NamedSharding(mesh, P("model")),
  }
  state_shardings = optax_accum.state_partition_specs(tx, param_shardings, None)
  assert state_shardings.grad_sum["w0"] == param_shardings["w0"]

  params = jax.device_put(params0, param_shardings)
  state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  step = jax.jit(
    functools.partial(ref.step, tx, ref.mlp_loss),
    out_shardings=(param_shardings, state_shardings),
    donate_argnums=(0, 1),
  )
  for batch in batches[: worker.SAVE_AT]:
    params, state = step(params, state, batch)
  worker.save(tmp_path / "ckpt", params, state)
  saved = jax.device_get({"params": params, "opt_state": state})

  # Restore onto the mesh: the target says, leaf by leaf, which sharding to restore into.
  shardings = {"params": param_shardings, "opt_state": state_shardings}
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    jax.eval_shape(lambda: saved),
    shardings,
  )
  restored = worker.restore(tmp_path / "ckpt", abstract)
  jax.tree.map(_assert_sharded_as, restored, shardings)
  assert restored["opt_state"].grad_sum["w0"].sharding.spec == P("data", "model")
  chex.assert_trees_all_equal(jax.device_get(restored), saved, strict=True)

  # Continue on the mesh: the unsharded uninterrupted run's result (float32: the sharded
  # program may sum the gradient's reduction in another order, so not bit for bit).
  params, state = restored["params"], restored["opt_state"]
  for batch in batches[worker.SAVE_AT :]:
    params, state = step(params, state, batch)
  want, _ = worker.uninterrupted()
  chex.assert_trees_all_close(params, want, **ref.TOL)
  assert optax_accum.AccumulateState is type(state)
  assert params["w0"].sharding.spec == P("data", "model")


def _assert_sharded_as(x, want):
  assert x.sharding.is_equivalent_to(want, x.ndim), (x.sharding, want)


def test_orbax_restore_without_target_loses_the_state_type(tmp_path):
  """Why the recipe restores into `jax.eval_shape(tx.init, params)`: without a target, Orbax
  returns plain containers, not an `AccumulateState` an optimizer can update."""
  worker.save_mid_window(tmp_path / "ckpt")
  raw = worker.restore(tmp_path / "ckpt", None)
  assert not isinstance(raw["opt_state"], optax_accum.AccumulateState)
