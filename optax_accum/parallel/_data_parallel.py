"""`data_parallel`: bind a data axis of the mesh under plain `jax.jit`, optimizer states included.

The binding itself is `_gspmd`'s (which knows no optimizer); this front end tells it which
arguments and outputs are per-device state: an `AccumulateState` made with an `axis_name`,
whose sums are split over the axis outside the map (stacked ``(num_devices, ...)``) as
`state_partition_specs` describes them, so that an optimizer state can leave one call and
enter the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from optax_accum.core._typing import AxisName
from optax_accum.parallel import _fsdp, _gspmd, _sharding


def data_parallel(
  fun: Callable[..., Any],
  axis_name: AxisName,
  *,
  batch_argnums: int | Sequence[int] = (),
  batch_argnames: str | Sequence[str] = (),
  batch_axes: int | Sequence[int] = 0,
  mesh: Any = None,
  varying: _gspmd.Varying = "error",
  sync: _gspmd.Sync = "update",
  keep_unsharded: None = None,
) -> Callable[..., Any]:
  """Runs `fun` once per device over the mesh axis `axis_name`, under plain `jax.jit`.

  Binds `axis_name` the way `jax.shard_map` does, over that axis only (the other mesh axes stay
  automatic), so that inside `fun` gradients can stay per-device and
  ``microbatch(..., axis_name=...)`` / ``accumulate(..., axis_name=...)`` reduce them once per
  update instead of XLA reducing every micro-batch. Each device sees its share of the batch
  arguments and the whole of every other argument. Inside a map that already binds
  `axis_name`, `fun` is called unchanged.

  Outputs that are the same on every device (what `microbatch` and `accumulate` reduce) come
  out replicated over the axis; the per-device sums of an `AccumulateState` come out stacked
  ``(num_devices, ...)`` and go back in split, as `state_partition_specs` describes them.

  Args:
    fun: the function to run per device; it reduces over `axis_name` what must be global.
    axis_name: the data-parallel mesh axis (or a tuple of axes) the batch is sharded over.
    batch_argnums: the positional arguments split over the devices (every array leaf along its
      batch axis): an int or a sequence of distinct ints (as `microbatch` takes them; read by
      the same parser). All other array arguments are passed whole to every device. Arguments
      sharded over `axis_name` that are not batch arguments (FSDP parameters) are gathered
      once, on entry.
    batch_argnames: keyword arguments split over the devices, like `batch_argnums`.
    batch_axes: the batch axis: one int for every batch argument, or one per argument in the
      order ``batch_argnums + batch_argnames`` (as `microbatch` takes them).
    mesh: the mesh; default the one in effect (``jax.set_mesh``).
    varying: what to do with an output that differs per device and is not an
      `AccumulateState`'s sums: "error" (default), or "concat" to join the devices' values
      along its leading axis (per-example outputs).
    sync: "update" (default): bind the axis over the devices, one reduction per update, and
      arguments sharded over the axis are gathered (a full-size accumulator per device).
      "microbatch": bind it as a trivial axis of size 1 (its collectives are the identity) and
      leave the whole mesh to GSPMD, which reduces each micro-batch's gradient (for parameters
      sharded over the axis: a reduce-scatter into an accumulator sharded like them).
    keep_unsharded: not an option here (anything but None raises ValueError): data_parallel
      owns no window of micro-batches, so it holds nothing across them; `sync` gives two of
      FSDP's points (per micro-batch, or gathered once per call). `microbatch` and `TrainStep`
      take ``keep_unsharded`` (all three points, with reduce-scatters).

  Returns:
    A function with `fun`'s signature, to be called (typically under `jax.jit`) with global
    arrays.

  Raises:
    TypeError, ValueError: here, for a bad `axis_name`, `batch_argnums` (a bool, repeated
      positions), `batch_argnames`, `batch_axes`, `varying`, `sync` or `keep_unsharded`; at
      call time, with no
      mesh in effect, a mesh without `axis_name`, a batch that does not divide over the
      devices, or an output that differs per device (see `varying`).

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> def mean_of_squares(w, x):  # per device, then global: ONE all-reduce
  ...   return jax.lax.pmean(jnp.mean((x @ w) ** 2), "data")
  >>> f = jax.jit(optax_accum.data_parallel(mean_of_squares, "data", batch_argnums=1, mesh=mesh))
  >>> x = jnp.arange(8.0 * jax.device_count()).reshape(-1, 2)
  >>> bool(jnp.allclose(f(jnp.ones(2), x), jnp.mean((x @ jnp.ones(2)) ** 2)))
  True
  """
  if keep_unsharded is not None:  # (FSDP's points belong to the front ends that own a window)
    raise ValueError(_fsdp.DATA_PARALLEL.format(keep=keep_unsharded))
  return _gspmd.bind(
    fun,
    axis_name,
    state_specs=_sharding.per_device_specs,
    batch_argnums=batch_argnums,
    batch_argnames=batch_argnames,
    batch_axes=batch_axes,
    mesh=mesh,
    varying=varying,
    sync=sync,
    caller="data_parallel",
  )
