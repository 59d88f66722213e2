"""The noise step of DP-SGD: ``(Σ clipped gradients + σ·C·ξ) / B``, once per update.

`dp_noise` is an optax transformation. Placed first in the inner chain of
`accumulate(..., reduction="sum")` or `TrainStep(..., reduction="sum")` it runs once per window
(the inner update runs only on the emitting step), after the window's one all-reduce, so the
noise is drawn once per logical batch however many micro-steps and devices made the sum; used
after an in-step `microbatch(clipped_grad(...), k, reduction="sum")` it runs once per step.
The noise key is ``fold_in(key, count)`` with ``count`` the transformation's own update count
(its state): never reused between updates, identical on every device (the key and the count
are replicated), and the count is what the accountant must be given (`dp_updates`). The key is
held by the transformation, never put in its state: a saved or shared optimizer state holds the
count only, from which nobody can regenerate the noise. To resume, build `dp_noise` again with
the same key and restore the state: the stream continues at the restored count. A key drawn
from once is remembered for the life of the process (`_DRAWN`): a second `dp_noise` on it is
refused, whether or not the first is still alive, except to resume (``allow_key_reuse``).

The noise is independent per coordinate whatever the layout. Under plain `jax.jit` a leaf is
one global array, drawn whole (sharded or not, the same numbers: JAX's partitionable
threefry). Inside `shard_map` a leaf that varies over mapped axes is a different piece on each
device of them (a tensor-parallel shard): its key also folds in the device's index along each
of those axes, so shards draw different noise, while a leaf replicated over an axis (a
replicated parameter; a sum already reduced over the data axis) draws the same noise on every
device of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum.core import _checks
from optax_accum.parallel import _collectives
from optax_accum.privacy import _clipping, _guard

# Every key given to a dp_noise that draws noise in this process (its implementation and data,
# as bytes), alive or not: the registry outlives the transformations on purpose (a second run's
# noise equals the first's even when the first optimizer was garbage-collected).
_DRAWN: set[bytes] = set()


class DPNoiseState(NamedTuple):
  """`dp_noise`'s state: its update count (the accountant's). The key is not in it: a saved or
  shared state cannot regenerate the noise."""

  count: jax.Array  # shape=(), dtype=jnp.int32: noisy updates made so far


def _check_number(value: Any, name: str, *, positive: bool) -> float:
  if isinstance(value, bool) or not isinstance(value, int | float | np.number):
    raise TypeError(f"dp_noise: {name} must be a number, got {value!r}.")
  ok = value > 0 if positive else value >= 0
  if not (np.isfinite(value) and ok):
    need = "a positive finite number" if positive else "a finite number >= 0"
    raise ValueError(f"dp_noise: {name} must be {need}, got {value!r}.")
  return float(value)


def _bound(l2_clip: Any) -> float:
  """One example's bound on the clipped sum: a number, or read from the clipped function
  (`ClippedGrad`, `clipped_loss`'s): ``C``, or 1 with ``rescale_to_unit_norm``."""
  if callable(l2_clip):
    bound = getattr(l2_clip, "l2_norm_bound", None)
    if bound is None:
      raise TypeError(
        f"dp_noise: l2_clip must be a number (the clip norm C) or the clipped function "
        f"(privacy.clipped_grad or privacy.clipped_loss, whose bound it reads), got {l2_clip!r}."
      )
    return float(bound)
  clip = _check_number(l2_clip, "l2_clip", positive=True)
  if clip != 1.0 and _clipping.only_rescaled(clip):
    text = _checks.PRIVATE_REFUSED["rescaled_clip"].format(caller="dp_noise")
    raise ValueError(f"{text} Got l2_clip={l2_clip!r}.")
  return clip


def _key_data(key: Any) -> tuple[jax.Array, Any]:
  """The raw uint32 data of a single PRNG key (typed, of any implementation, or legacy) and
  its implementation, else a clear error."""
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"dp_noise: key must be a single PRNG key, got keys of shape {key.shape}.")
    return jax.random.key_data(key), jax.random.key_impl(key)
  arr = key if isinstance(key, jax.Array | np.ndarray) else None
  # A legacy raw key is the default implementation's data (`jax.random.PRNGKey`).
  impl = jax.random.key_impl(jax.random.key(0))
  shape = jax.random.key_data(jax.random.key(0)).shape
  if arr is None or arr.dtype != np.uint32 or arr.shape != shape:
    what = repr(key) if arr is None else f"{arr.dtype}{list(arr.shape)}"
    raise TypeError(
      f"dp_noise: key must be a PRNG key (jax.random.key(seed), of any implementation, or the "
      f"legacy jax.random.PRNGKey(seed), uint32{list(shape)}), got {what}."
    )
  return jnp.asarray(arr), impl


def _claim(data: jax.Array, impl: Any, allow: bool) -> None:
  """Records the key as drawn from in this process; raises if it was already (alive or not)."""
  if isinstance(data, jax.core.Tracer):  # built under jit/vmap: no value to compare
    _guard.refuse("key_traced", "dp_noise", kind=type(data).__name__)
  fingerprint = str(impl).encode() + b":" + np.asarray(data).tobytes()
  if fingerprint in _DRAWN and not allow:
    _guard.refuse("key_reused", "dp_noise", data=np.asarray(data).tolist())
  _DRAWN.add(fingerprint)


def _leaf_key(key: jax.Array, x: Any) -> jax.Array:
  """`key`, folded with this device's index along each mapped axis `x` varies over (inside
  `shard_map`: a shard of a leaf split over that axis draws its own noise)."""
  for axis in sorted(_collectives.vma(x)):
    key = jax.random.fold_in(key, lax.axis_index(axis))
  return key


def _noise(tree: Any, key: jax.Array, stddev: float) -> Any:
  """``stddev · ξ`` with ξ ~ N(0, I) shaped like `tree`, float32, one key per leaf (and per
  shard of a leaf that varies over mapped axes)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  noise = [
    stddev * jax.random.normal(_leaf_key(k, x), jnp.shape(x), jnp.float32)
    for k, x in zip(keys, leaves, strict=True)
  ]
  return jax.tree.unflatten(treedef, noise)


def dp_noise(
  noise_multiplier: float,
  l2_clip: float,
  expected_batch_size: float,
  key: Any,
  *,
  allow_key_reuse: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """The Gaussian mechanism of DP-SGD: ``update = (g + σ·C·ξ) / B``, ξ ~ N(0, I).

  `g` is the sum of clipped per-example gradients over one logical batch (`clipped_grad`,
  `clipped_loss`). The noise is drawn from ``fold_in(key, count)``, ``count`` being this
  transformation's own update count, so each update gets fresh noise and a resumed run continues
  the stream. The key is held by the transformation, not put in its state (`DPNoiseState` is the
  count only): a saved or shared optimizer state cannot regenerate the noise. `privacy.Mechanism`
  builds this transformation together with its clipped loss. Divide by the public *expected* batch
  size ``B = q·N`` (Poisson sampling), not the realised one: the realised size depends on the data
  set, and dividing by it would leak it (the accounting of DP-SGD assumes a fixed divisor).

  Where to put it: first in the inner chain of `accumulate(..., reduction="sum")` or
  `TrainStep(..., reduction="sum")` (it runs once per window, after the one all-reduce; `init`
  refuses anything before it), or after an in-step ``microbatch(clipped_grad(loss, C), k,
  reduction="sum")``. Then any optax optimizer (post-processing keeps the guarantee). Give the
  accountant `dp_updates(state)`.

  Args:
    noise_multiplier: σ >= 0 (0: no noise, for testing; not private). The same σ is given to
      the accountant whatever the neighbouring relation (`dp_epsilon` counts replace-one's
      distance 2C itself).
    l2_clip: the bound on one example's contribution to the sum: C > 0, the clip norm used by
      `clipped_grad`/`clipped_loss`; or that clipped function itself, whose bound is read
      (C, or 1 with ``rescale_to_unit_norm``: then a number here must be 1, not C). The noise
      std is σ times this bound.
    expected_batch_size: B > 0, the public expected size of a logical batch.
    key: a PRNG key (``jax.random.key(seed)``, of any implementation, e.g.
      ``jax.random.key(seed, impl="rbg")``, or the legacy ``PRNGKey``), used for nothing else;
      each run needs its own. It is secret: it regenerates every draw. With σ > 0 it is
      remembered for the life of the process: a second `dp_noise` on it is refused, whether or
      not the first is still alive; and it must be concrete (build `dp_noise` outside
      `jax.jit`/`jax.vmap`, then jit the step that uses it): a traced key's value cannot be
      remembered.
    allow_key_reuse: allow a key already drawn from in this process, for the one legitimate
      reuse: the same run resumed, its state restored at its update count (no draw repeats).

  Returns:
    An optax `GradientTransformationExtraArgs` with `DPNoiseState`. Updates keep the
    gradients' dtypes (the noise is added in float32).

  Raises:
    TypeError, ValueError: for σ < 0, C <= 0, B <= 0 (or non-finite ones), a key that is not
      a single PRNG key, a key already drawn from in this process or a traced one (σ > 0:
      `dp_noise` built under `jax.jit`/`jax.vmap` with the key an argument), or an `l2_clip`
      number ``C != 1`` when every live clipped function with clip norm ``C`` rescales to
      unit norm (the noise must follow their bound 1: pass the function); when tracing the
      update, inside a map without device-variance types (``shard_map(check_vma=False)``,
      ``pmap``).

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> tx = optax_accum.privacy.dp_noise(0.0, 1.0, 4.0, jax.random.key(0))
  >>> updates, state = tx.update(jnp.array([2.0, 4.0]), tx.init(jnp.zeros(2)))
  >>> updates, int(optax_accum.privacy.dp_updates(state))
  (Array([0.5, 1. ], dtype=float32), 1)
  """
  sigma = _check_number(noise_multiplier, "noise_multiplier", positive=False)
  clip = _bound(l2_clip)
  batch = _check_number(expected_batch_size, "expected_batch_size", positive=True)
  with jax.ensure_compile_time_eval():  # a concrete key's data stays concrete under a trace
    data, impl = _key_data(key)
  if not isinstance(data, jax.core.Tracer):
    # A host constant: a jax.Array made under a mesh would carry that mesh's sharding into
    # every program the update is traced in (a manual axis there: a mesh mismatch).
    data = np.asarray(data)
  stddev = sigma * clip

  def init_fn(params: Any) -> DPNoiseState:
    del params
    return DPNoiseState(jnp.zeros((), jnp.int32))

  def update_fn(updates: Any, state: DPNoiseState, params: Any = None, **extra_args: Any):
    del params, extra_args
    _guard.check_variance("dp_noise")
    total = jax.tree.map(lambda g: jnp.asarray(g, jnp.promote_types(g.dtype, jnp.float32)), updates)
    if stddev > 0:  # σ = 0 draws nothing: the update is exactly the clipped sum / B
      key = jax.random.fold_in(jax.random.wrap_key_data(data, impl=impl), state.count)
      total = jax.tree.map(lambda g, z: g + z, total, _noise(total, key, stddev))
    new = jax.tree.map(lambda t, g: (t / batch).astype(g.dtype), total, updates)
    return new, DPNoiseState(optax.safe_increment(state.count))

  if stddev > 0:  # σ = 0 draws nothing from the key
    _claim(data, impl, allow_key_reuse)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dp_updates(state: Any) -> jax.Array:
  """The number of noisy updates `dp_noise` made: the count to give the accountant.

  Finds the one `DPNoiseState` anywhere in an optimizer state (inside `accumulate`,
  `optax.chain`, `inject_hyperparams`, ...). Micro-steps are never counted: inside
  `accumulate`/`TrainStep` the noise step runs once per window.

  Args:
    state: an optimizer state that holds exactly one `DPNoiseState`.

  Returns:
    The count, an int32 scalar array.

  Raises:
    ValueError: if the state holds no `DPNoiseState`, or more than one.

  >>> import jax, jax.numpy as jnp, optax, optax_accum
  >>> tx = optax_accum.accumulate(
  ...   optax.chain(optax_accum.privacy.dp_noise(0.0, 1.0, 8.0, jax.random.key(1)), optax.sgd(0.1)),
  ...   4, reduction="sum")
  >>> state = tx.init(jnp.zeros(2))
  >>> for _ in range(8):
  ...   _, state = tx.update(jnp.ones(2), state)
  >>> int(optax_accum.privacy.dp_updates(state))  # 8 micro-steps, 2 updates
  2
  """
  found = [
    x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, DPNoiseState))
    if isinstance(x, DPNoiseState)
  ]  # fmt: skip
  if len(found) != 1:
    raise ValueError(
      f"dp_updates: the state must hold exactly one DPNoiseState (from dp_noise), found "
      f"{len(found)}."
    )
  return found[0].count
