"""One process of the multi-host test (and its single-process reference, `train`).

Run by `tests/test_multihost.py` through `optax_accum.launch`:
``python tests/_multihost_worker.py OUT_DIR`` (run as a script, Python puts tests/ on the path:
`_reference` imports; it touches no device at import, before `jax.distributed` starts). Each
process writes the parameters it ends with to ``OUT_DIR/params_<process index>.npz``.
"""

import sys

import _reference as ref
import numpy as np

WINDOWS, K, B, F = 3, 2, 2, 4  # windows, micro-steps per window, rows per device, features


def micro_batches(n_devices):
  """WINDOWS·K global micro-batches of n_devices·B rows, a random token mask (each device's
  first row real)."""
  data = ref.regression_data(0, WINDOWS * K * n_devices * B, F, 1)
  mask = (np.random.default_rng(1).random(WINDOWS * K * n_devices * B) < 0.7).astype(np.float32)
  mask[::B] = 1.0
  return ref.split({**data, "mask": mask}, WINDOWS * K)


def train(devices=None):
  """Data-parallel training over `devices` (default: every process's), with accumulate."""
  import jax  # noqa: PLC0415  (after launch.initialize() in a worker process)

  import optax_accum  # noqa: PLC0415

  devices = jax.devices() if devices is None else devices
  mesh = jax.make_mesh((len(devices),), (ref.AXIS,), devices=devices)
  tx = optax_accum.accumulate(ref.ADAM, K, axis_name=ref.AXIS)
  params = ref.mlp_params(0, (F, 1))
  batches = micro_batches(len(devices))
  params, _ = ref.train_data_parallel(tx, params, batches, mesh, weight_fn=ref.token_count)
  return {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}


if __name__ == "__main__":
  from optax_accum import launch

  launch.initialize()
  import jax

  params = train()
  np.savez(f"{sys.argv[1]}/params_{jax.process_index()}.npz", **params)
