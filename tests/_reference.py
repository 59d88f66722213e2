"""The test kit: one problem, one large-batch reference, one data-parallel harness.

The tests prove one claim: k micro-batches of size b give what one batch of size k·b gives. The
reference side of every comparison is computed here *independently* of optax_accum: a direct
`jax.grad` of the loss on the whole batch, then one plain optax step on it (`run_steps` with a
plain optimizer). The side under test is the same `run_steps` fed the micro-batches with an
accumulating transformation, or the data-parallel `train_data_parallel`, or a front end of the
test's own; trees are compared with chex (``chex.assert_trees_all_close(got, want, **TOL)``).

Import it from a test module as ``import _reference as ref`` (pytest puts ``tests/`` on the path;
the worker scripts run as ``python tests/_x_worker.py``, which puts it there too).

* The problem: `mlp_params`, `mlp_apply`, `mlp_loss` (a tanh MLP; a token-weighted mean when the
  batch has a ``"mask"``), `regression_data`, `token_data`; shared optimizers (`OPTIMIZERS`).
* Batches: `split` (contiguous or strided micro-batches), `concat`, `stack`, `micro` and `windows`
  (large batches to micro-batches and back).
* Steps: `step` (grad → update → apply), `run_steps` (n steps, jitted, scanned or eager).
* Devices: `shard`, `accumulate_step`, `shard_step`, `data_parallel`, `train_data_parallel`.

Parameters and data are host numpy arrays made with numpy's generator, and the batch helpers work
on the host: eager JAX slicing compiles one tiny program per distinct slice, which on a 2-core CI
machine costs more than the tests themselves. Nothing here touches a device at import time (the
multi-host worker imports this module before `jax.distributed` starts).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import state_partition_specs

# Float32 results against the large batch: the values are O(0.1-1), and a mean of micro-batch
# means rounds differently from the large batch's mean in the last bits, nothing more. Tests
# that need more say why next to their own tolerance.
TOL = dict(rtol=1e-6, atol=1e-6)

# One object per optimizer: compiled programs are cached per transformation object, so tests
# that share these compile each reference once per process. Adam's update is nearly blind to
# the gradient's scale: a test that must catch a wrong normalisation (a mean off by a factor)
# needs SGD or momentum among its optimizers.
SGD = optax.sgd(0.1)
MOMENTUM = optax.sgd(0.1, momentum=0.9)
ADAM = optax.adam(1e-2)
ADAMW = optax.adamw(1e-2, weight_decay=1e-2)
WARMUP_COSINE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10)
CLIP = 0.5  # below the initial large-batch gradient norm of the default problem: clipping acts

OPTIMIZERS = {
  "sgd": SGD,
  "momentum": MOMENTUM,
  "adam": ADAM,
  "adamw": ADAMW,
  "lion": optax.lion(1e-3),
  # min_dim_size_to_factor=2: the matrices use the factored second moment, as at scale.
  "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=2),
  "clip_adamw_warmup_cosine": optax.chain(
    optax.clip_by_global_norm(CLIP), optax.adamw(WARMUP_COSINE, weight_decay=1e-2)
  ),
}
# An inner optimizer that takes an extra argument (`value`) on its update. patience=0: the scale
# halves as soon as `value` fails to improve, which PLATEAU_VALUES (one per window) never does
# after the first window.
PLATEAU = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(factor=0.5, patience=0))
PLATEAU_VALUES = (1.0, 2.0, 3.0)


# ----------------------------------------------------------------------------------------------
# The problem.


def mlp_params(seed: int, sizes: Sequence[int] = (3, 8, 2), dtype=np.float32) -> dict:
  """Parameters of a tanh MLP with layer widths `sizes` (a dict of w0, b0, w1, b1, ...)."""
  rng = np.random.default_rng(seed)
  params = {}
  for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
    params[f"w{i}"] = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(dtype)
    params[f"b{i}"] = (0.1 * rng.standard_normal(n_out)).astype(dtype)
  return params


def mlp_apply(params: dict, x: jax.Array) -> jax.Array:
  """The MLP on `x` (any leading axes): tanh between layers, linear output."""
  n = len(params) // 2
  for i in range(n):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def mlp_loss(params: dict, batch: dict) -> jax.Array:
  """Squared error summed over the outputs, averaged over the batch's examples.

  With a ``"mask"`` (1 for a real token or row, 0 for padding; the shape of the error without its
  output axis) the average is over the real ones only: the token-weighted mean whose
  accumulation needs weights.
  """
  err = jnp.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  if "mask" not in batch:
    return jnp.mean(err)
  return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def regression_data(seed: int, n: int, d_in: int = 3, d_out: int = 2, dtype=np.float32) -> dict:
  """`n` examples ``{"x": (n, d_in), "y": (n, d_out)}`` of a noisy nonlinear target."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d_in))
  w = rng.standard_normal((d_in, d_out))
  y = np.sin(x @ w) + 0.1 * rng.standard_normal((n, d_out))
  return {"x": x.astype(dtype), "y": y.astype(dtype)}


def token_data(seed: int, lengths: Any, tokens: int, d_in: int = 3) -> dict:
  """Sequences of `tokens` positions with `lengths` real ones (the rest padding, garbage
  targets): ``{"x": (n, tokens, d_in), "y": (n, tokens, 1), "mask": (n, tokens)}``."""
  lengths = np.asarray(lengths).reshape(-1)
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((len(lengths), tokens, d_in)).astype(np.float32)
  y = rng.standard_normal((len(lengths), tokens, 1)).astype(np.float32)
  mask = (np.arange(tokens)[None, :] < lengths[:, None]).astype(np.float32)
  return {"x": x, "y": y, "mask": mask}


def token_count(batch: dict) -> jax.Array:
  """A batch's number of real tokens: its weight in a token-weighted mean."""
  return jnp.sum(batch["mask"])


# ----------------------------------------------------------------------------------------------
# Batches (host numpy).


def split(batch: Any, k: int, *, strided: bool = False) -> list:
  """Cuts every leaf's leading axis into `k` equal micro-batches: consecutive blocks, or with
  `strided` rows ``i, i+k, i+2k, ...`` in micro-batch i (`microbatch`'s default split)."""
  (n,) = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
  assert n % k == 0, f"batch of {n} does not split into {k}"
  b = n // k
  if strided:
    return [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]
  return [jax.tree.map(lambda x, i=i: x[i * b : (i + 1) * b], batch) for i in range(k)]


def concat(batches: Sequence[Any]) -> Any:
  """Concatenates batches along the leading axis (the large batch of some micro-batches)."""
  return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


def stack(batches: Sequence[Any]) -> Any:
  """Stacks equally shaped batches on a new leading axis (numpy on host, jnp under a trace)."""
  host = all(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(batches))
  return jax.tree.map(lambda *xs: (np.stack if host else jnp.stack)(xs), *batches)


def micro(big_batches: Sequence[Any], k: int) -> list:
  """The micro-batches of `big_batches`, in order: k contiguous ones per large batch."""
  return [m for b in big_batches for m in split(b, k)]


def windows(micro_batches: Sequence[Any], k: int) -> list:
  """The large batches of `micro_batches`: each k consecutive ones concatenated (`micro`'s
  inverse)."""
  assert len(micro_batches) % k == 0, f"{len(micro_batches)} micro-batches, windows of {k}"
  return [concat(micro_batches[i : i + k]) for i in range(0, len(micro_batches), k)]


# ----------------------------------------------------------------------------------------------
# Steps.


def step(tx: optax.GradientTransformation, loss_fn: Callable, params, state, batch, **update_kw):
  """One training step: ``g = grad(loss_fn)(params, batch)``, ``tx.update(g, state, params,
  **update_kw)``, apply. Returns ``(params, state)``."""
  grads = jax.grad(loss_fn)(params, batch)
  updates, state = tx.update(grads, state, params, **update_kw)
  return optax.apply_updates(params, updates), state


@functools.cache
def _program(tx: optax.GradientTransformation, loss_fn: Callable, scan: bool, jit: bool):
  """The (jitted) step, or the whole jitted scan, of `run_steps`; cached per arguments."""

  def one(carry, xs):
    batch, extra = xs
    return step(tx, loss_fn, *carry, batch, **extra), None

  if scan:
    return jax.jit(lambda carry, xs: lax.scan(one, carry, xs)[0])
  run = lambda carry, xs: one(carry, xs)[0]  # noqa: E731
  return jax.jit(run) if jit else run


def run_steps(
  tx: optax.GradientTransformation,
  params: Any,
  loss_fn: Callable[[Any, Any], jax.Array],
  batches: Sequence[Any],
  *,
  scan: bool = False,
  jit: bool = True,
  state: Any = None,
  extra_args: Sequence[dict] | None = None,
) -> tuple[Any, Any]:
  """One `tx` step per batch (`step`): the large-batch reference with a plain optimizer on the
  large batches, the side under test with an accumulating one on the micro-batches.

  Args:
    tx: any optax transformation.
    params: initial parameters.
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    batches: a sequence of batches, one step each.
    scan: run all steps in one jitted `lax.scan` whose carry is ``(params, state)``.
    jit: with ``scan=False``, one jitted step per batch (True) or eager op-by-op (False).
    state: the initial optimizer state; ``tx.init(params)`` when None.
    extra_args: one dict per batch of extra keyword arguments for ``tx.update`` (traced: give
      them fixed dtypes, e.g. ``np.float32``).

  Returns:
    ``(params, state)`` after the last step.

  The programs are cached per ``(tx, loss_fn, scan, jit)``: reuse one `tx` object (and a
  module-level loss) across tests to compile each reference once per process.
  """
  if state is None:
    state = tx.init(params)
  extra_args = [{}] * len(batches) if extra_args is None else list(extra_args)
  assert len(extra_args) == len(batches), (len(extra_args), len(batches))
  run = _program(tx, loss_fn, scan, jit)
  if scan:
    return run((params, state), (stack(batches), stack(extra_args)))
  carry = (params, state)
  for batch, extra in zip(batches, extra_args, strict=True):
    carry = run(carry, (batch, extra))
  return carry


def max_abs_diff(a: Any, b: Any) -> float:
  """The largest absolute difference between two trees' leaves (float32): for "it trained" and
  "this other computation is visibly different" checks, the positive controls."""
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return max(
    float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)))) for x, y in pairs
  )


# ----------------------------------------------------------------------------------------------
# Data parallelism over a mesh axis (shard_map).

AXIS = "data"


@functools.cache
def mesh(shape: tuple[int, ...] = (8,), axes: tuple[str, ...] = (AXIS,)) -> Mesh:
  """A mesh of conftest's 8 host CPU devices (made on first use, never at import)."""
  return jax.make_mesh(shape, axes)


def shard(tree: Any, mesh: Mesh, spec: P) -> Any:
  """Host values as global arrays on `mesh`, split by `spec`. Every process builds its own shards
  from the same host value, so this works with one process or many."""
  sharding = NamedSharding(mesh, spec)

  def put(a):
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

  return jax.tree.map(put, tree)


def accumulate_step(
  tx: optax.GradientTransformation,
  loss_fn: Callable,
  axis: Any,
  *,
  local: bool = True,
  weight_fn: Callable | None = None,
  force_emit_fn: Callable | None = None,
  emit: bool | None = None,
) -> Callable:
  """A data-parallel micro-step, run on each device's own rows inside `shard_map` (or `pmap`).

  Gradients are local (taken with respect to parameters made device-varying) unless `local` is
  False; `weight_fn(batch)` and `force_emit_fn(batch)`, when given, supply ``tx.update``'s
  `weight` and `force_emit`; `emit` is passed as is. Returns ``step(params, state, batch) ->
  (params, state)``.
  """

  def micro_step(params, state, batch):
    p = lax.pcast(params, axis, to="varying") if local else params
    kw = {} if emit is None else {"emit": emit}
    if weight_fn is not None:
      kw["weight"] = weight_fn(batch)
    if force_emit_fn is not None:
      kw["force_emit"] = force_emit_fn(batch)
    grads = jax.grad(loss_fn)(p, batch)
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state

  return micro_step


def shard_step(fn: Callable, mesh: Mesh, params_specs, state_specs, batch_spec: P) -> Callable:
  """``jax.jit(shard_map(fn))`` for ``fn(params, state, batch) -> (params, state)``."""
  return jax.jit(
    jax.shard_map(
      fn,
      mesh=mesh,
      in_specs=(params_specs, state_specs, batch_spec),
      out_specs=(params_specs, state_specs),
    )
  )


class DataParallel(NamedTuple):
  """The jitted `shard_map` programs of a data-parallel `accumulate` run."""

  init: Callable  # params -> state (per-device accumulators, stacked over the axis)
  step: Callable  # (params, state, batch) -> (params, state); batch split over the axis
  params_specs: Any
  state_specs: Any


def data_parallel(
  tx: optax.GradientTransformation,
  params: Any,
  mesh: Mesh,
  axis: Any = AXIS,
  *,
  loss_fn: Callable = mlp_loss,
  **step_kw: Any,
) -> DataParallel:
  """The init and step programs of `tx` (an `accumulate(..., axis_name=axis)`, or a chain holding
  one) with replicated parameters, the state's partition specs from `state_partition_specs`, and
  batches split over `axis`. `step_kw` go to `accumulate_step`."""
  params_specs = jax.tree.map(lambda _: P(), params)
  state_specs = state_partition_specs(tx, params_specs, axis)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(params_specs,), out_specs=state_specs))
  fn = accumulate_step(tx, loss_fn, axis, **step_kw)
  step_fn = shard_step(fn, mesh, params_specs, state_specs, P(axis))
  return DataParallel(init, step_fn, params_specs, state_specs)


def train_data_parallel(
  tx: optax.GradientTransformation,
  params: Any,
  batches: Sequence[Any],
  mesh: Mesh,
  axis: Any = AXIS,
  **kw: Any,
) -> tuple[Any, Any]:
  """`data_parallel`'s init, then one step per global micro-batch in `batches` (host arrays whose
  leading axis is split over `axis`: device d holds the d-th block of rows). Returns
  ``(params, state)``."""
  dp = data_parallel(tx, params, mesh, axis, **kw)
  params = shard(params, mesh, P())
  state = dp.init(params)
  for batch in batches:
    params, state = dp.step(params, state, shard(batch, mesh, P(axis)))
  return params, state


def replica_groups(rest: str) -> list[frozenset]:
  """The replica groups of one collective in a compiled program's text (the rest of its HLO
  line): the explicit spelling, the iota spelling and the mesh-of-named-axes spelling."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
  if m:
    return [frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\], device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\) \{([^}]*)\}",
    rest,
  )
  if m:  # a mesh of named axes over an iota of device ids; the groups span the axes in {...}
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    dims = [int(d) for d in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    ids = ids.reshape([int(n) for _, n in axes])
    over = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in m.group(4)]
    rest_axes = [i for i in range(len(axes)) if i not in over]
    size = int(np.prod([ids.shape[i] for i in over]))
    return [frozenset(g) for g in ids.transpose(rest_axes + over).reshape(-1, size).tolist()]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  assert m, f"replica groups not understood: {rest[:200]}"
  ids = np.arange(int(np.prod([int(d) for d in m.group(3).split(",")])))
  ids = ids.reshape([int(d) for d in m.group(3).split(",")])
  if m.group(4):
    ids = ids.transpose([int(d) for d in m.group(4).split(",")])
  return [frozenset(g) for g in ids.reshape(int(m.group(1)), int(m.group(2))).tolist()]
