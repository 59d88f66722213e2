"""One process of the multi-host test (and its single-process reference, `train`).

Run by `tests/test_multihost.py` through `optax_accum.launch`:
``python tests/_multihost_worker.py OUT_DIR``. Each process writes the parameters it ends with
to ``OUT_DIR/params_<process index>.npz``.
"""

import sys

import numpy as np

WINDOWS, K, B, F = 3, 2, 2, 4  # windows, micro-steps per window, rows per device, features


def train(devices=None):
  """Data-parallel training over `devices` (default: every process's), with accumulate."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax import lax  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import optax_accum  # noqa: PLC0415
  from optax_accum._sharding import state_partition_specs  # noqa: PLC0415

  devices = jax.devices() if devices is None else devices
  n = len(devices)
  mesh = jax.make_mesh((n,), ("data",), devices=devices)
  r = np.random.default_rng(0)
  x = r.normal(size=(WINDOWS, K, n * B, F)).astype(np.float32)
  y = r.normal(size=(WINDOWS, K, n * B)).astype(np.float32)
  m = (r.random(size=(WINDOWS, K, n * B)) < 0.7).astype(np.float32)
  m[..., ::B] = 1.0  # every device has a real row in every micro-batch
  params = {"w": r.normal(size=(F,)).astype(np.float32), "b": np.zeros((), np.float32)}

  def global_array(a, spec):  # every process holds the whole value, gives its own shards
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

  def loss(p, x, y, m):
    return jnp.sum(m * (x @ p["w"] + p["b"] - y) ** 2) / jnp.sum(m)

  tx = optax_accum.accumulate(optax.adam(0.05), K, axis_name="data")
  pspecs = {"w": P(), "b": P()}
  sspecs = state_partition_specs(tx, pspecs, "data")

  def step(params, state, x, y, m):
    g = jax.grad(loss)(lax.pcast(params, "data", to="varying"), x, y, m)
    u, state = tx.update(g, state, params, weight=jnp.sum(m))
    return optax.apply_updates(params, u), state

  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=sspecs))
  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(pspecs, sspecs, P("data"), P("data"), P("data")),
      out_specs=(pspecs, sspecs),
    )
  )
  params = {k: global_array(v, P()) for k, v in params.items()}
  state = init(params)
  for t in range(WINDOWS):
    for i in range(K):
      batch = [global_array(a[t, i], P("data")) for a in (x, y, m)]
      params, state = step(params, state, *batch)
  return {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}


if __name__ == "__main__":
  from optax_accum import launch

  launch.initialize()
  import jax

  params = train()
  np.savez(f"{sys.argv[1]}/params_{jax.process_index()}.npz", **params)
