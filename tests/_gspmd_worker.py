"""One process of the two-process plain-`jax.jit` test (and its one-process reference, `train`).

Run by `tests/test_gspmd.py` through `optax_accum.launch`:
``python tests/_gspmd_worker.py OUT_DIR FRONT``. Plain `jax.jit` with the mesh set (no
hand-written `shard_map`), one of two front ends (FRONT):

* ``recipe`` — the user's own jitted step: `accumulate(axis_name="data")` with
  `optax_accum.data_parallel` binding the data axis;
* ``train_step`` — `TrainStep(..., axis_name="data", weight_fn=...)`, which binds it itself.

Each process writes the parameters it ends with to ``OUT_DIR/params_<process index>.npz``.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

WINDOWS, K, ROWS = 2, 3, 2  # windows, micro-steps per window, rows per device per micro-step


def train(devices=None, front="recipe"):
  """Data-parallel training over `devices` (default: every process's) under plain jit."""
  import _reference as ref  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  from jax.sharding import AxisType, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import optax_accum  # noqa: PLC0415

  devices = jax.devices() if devices is None else devices
  n = len(devices)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,), devices=devices)
  params = ref.mlp_params(0)
  batches = []
  for i in range(WINDOWS * K):
    batch = ref.regression_data(100 + i, n * ROWS)
    batch["mask"] = (np.random.default_rng(i).random(n * ROWS) < 0.7).astype(np.float32)
    batch["mask"][::ROWS] = 1.0  # every device has a real row in every micro-step
    batches.append(batch)

  tx = optax_accum.accumulate(optax.adam(0.05), K, axis_name="data")
  shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
  state_shardings = optax_accum.state_partition_specs(tx, shardings, "data")

  def train_step(params, state, batch):
    grads = jax.grad(ref.mlp_loss)(lax.pcast(params, "data", to="varying"), batch)
    updates, state = tx.update(grads, state, params, weight=ref.token_count(batch))
    return optax.apply_updates(params, updates), state

  if front == "train_step":
    with jax.set_mesh(mesh):
      helper = optax_accum.TrainStep(
        ref.mlp_loss, optax.adam(0.05), K, axis_name="data", weight_fn=ref.token_count
      )
      params = ref.shard(params, mesh, P())
      state = helper.init(params)
      for batch in batches:
        params, state, _ = helper(params, state, ref.shard(batch, mesh, P("data")))
    return {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}

  with jax.set_mesh(mesh):
    init = jax.jit(optax_accum.data_parallel(tx.init, "data"), out_shardings=state_shardings)
    step = jax.jit(
      optax_accum.data_parallel(train_step, "data", batch_argnums=2),
      out_shardings=(shardings, state_shardings),
    )
    params = ref.shard(params, mesh, P())
    state = init(params)
    for batch in batches:  # every process gives its own rows of the global batch
      params, state = step(params, state, ref.shard(batch, mesh, P("data")))
  return {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}


if __name__ == "__main__":
  from optax_accum import launch

  launch.initialize()
  import jax

  params = train(front=sys.argv[2])
  np.savez(f"{sys.argv[1]}/params_{jax.process_index()}.npz", **params)
