"""`accumulate`: an optax transformation that applies its inner optimizer every k-th step.

`update_fn` strings small module-level pieces together, each taking its operands explicitly, so
that `TrainStep` builds its two compiled programs from the very same pieces::

    check_update → add (+ add_noise) → close_window (every k-th step) or keep_open → advance

(`_config`: the configuration and the checks of a call; `_window`: the window's pieces.)

What makes the default path as fast as a plain optimizer step (measured on CPU, where large
temporaries cost page faults on every call): the finite check reads each gradient once
(`_core.all_finite`); the mean is a multiply XLA fuses into the inner update
(`_core.normalise`); and the protocol returns its updates through the accumulator's own
buffer (`_window.IN_ACCUMULATOR`), so neither zeros nor the updates are a parameter-sized
temporary, and one conditional decides whether the inner optimizer runs
(`_window.emit_dynamic`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_accum.batch_size import _gain, _noise
from optax_accum.core import _checks, _core
from optax_accum.core._state import AccumulateState, gradient_like, no_sums
from optax_accum.core._typing import AxisName, DType, Reduction
from optax_accum.front_ends._config import (
  OUTSIDE_MAP_RECIPE,
  Config,
  EveryK,
  check_private,
  check_state,
  check_update,
  first_length,
  make_config,
)
from optax_accum.front_ends._window import (
  IN_ACCUMULATOR,
  Window,
  add,
  add_noise,
  advance,
  can_be_empty,
  close_window,
  closes_window,
  emit_dynamic,
  fits_accumulator,
  keep_open,
  per_device_noise,
  sq_norm,
  update_types,
  zeros_finish,
)
from optax_accum.parallel import _collectives

# ----------------------------------------------------------------------------------------------
# The transformation's init and update.


GAIN_WITHOUT_NOISE = (
  "{caller}: the inner optimizer holds optax_accum.scale_by_gain, which reads the "
  "gradient noise statistics of each window, but noise_scale=False keeps none. Build it with "
  "noise_scale=True: accumulate(inner, every_k, noise_scale=True) or TrainStep(..., "
  "noise_scale=True) (every_k=FollowNoiseScale(...) implies it)."
)


def init(cfg: Config, params: Any) -> AccumulateState:
  """The initial state: an empty window (no accumulator when every_k == 1)."""
  axis = cfg.axis
  try:
    axis.check_bound(f"{cfg.front}.init")
  except ValueError as e:  # the usual case: Flax's TrainState.create, outside any map
    if cfg.front != "accumulate":
      raise
    raise ValueError(f"{e}\n\n" + OUTSIDE_MAP_RECIPE.format(axis=axis.name)) from None
  if cfg.unaccumulated:
    acc = no_sums(axis, gradient_like(params))
  else:
    exact = cfg.rounding is not None
    acc = axis.per_device(_core.zeros(gradient_like(params), cfg.accum_dtype, exact=exact))
  inner_state = _inner_init(cfg, params)
  if _checks.holds_private_state(inner_state):
    check_private(cfg, f"{cfg.front}.init", params, inner_state)
  if _gain.holds_gain(inner_state) and not cfg.noise:
    raise ValueError(GAIN_WITHOUT_NOISE.format(caller=f"{cfg.front}.init"))
  # Distinct arrays: a donating step (TrainStep) cannot donate one buffer twice.
  return AccumulateState(
    mini_step=jnp.zeros((), jnp.int32),
    gradient_step=jnp.zeros((), jnp.int32),
    window_k=first_length(cfg.every_k),
    grad_sum=acc,
    acc_weight=axis.per_device(jnp.zeros((), jnp.float32)),
    num_skipped=axis.per_device(jnp.zeros((), jnp.int32)),
    inner_state=inner_state,
    updated=jnp.zeros((), jnp.bool_),
    noise=per_device_noise(axis, _noise.init()) if cfg.noise else None,
  )


def _inner_init(cfg: Config, params: Any) -> Any:
  """The inner optimizer's initial state; inside a `shard_map`, checked for per-shard statistics
  (`_collectives.check_init_variance`)."""
  inner_state = cfg.inner.init(params)
  _collectives.check_init_variance(
    inner_state, gradient_like(params), cfg.axis.axes, f"{cfg.front}.init"
  )
  return inner_state


def update(
  cfg: Config,
  updates: Any,
  state: AccumulateState,
  params: Any = None,
  *,
  weight: Any = None,
  force_emit: Any = False,
  emit: bool | None = None,
  **extra_args: Any,
) -> tuple[Any, AccumulateState]:
  """`accumulate`'s update: the optax protocol, read top-down (`updates` are gradients)."""
  grads = updates
  check_state(state, "accumulate.update")
  weight = check_update(cfg, grads, state, params, weight, force_emit, emit)
  sq = sq_norm(cfg, grads, state, emit, force_emit)
  sums, total, dropped = add(cfg, grads, state, weight, sq)
  noise = add_noise(cfg, grads, state, weight, dropped, sq)
  if cfg.unaccumulated:
    emit = True if cfg.axis.stacks else None  # every step closes its window
  types = update_types(cfg, grads, state.inner_state, params, extra_args, emit)
  in_acc = fits_accumulator(cfg, types, sums)
  finish = IN_ACCUMULATOR if in_acc else zeros_finish(types)
  window = Window(sums, total, state.inner_state, params, extra_args, noise)
  guard = can_be_empty(cfg, weight)
  if emit is None:
    emitting = True if cfg.unaccumulated else closes_window(cfg, state, force_emit)
    closed = emit_dynamic(cfg, grads, finish, guard, window, emitting)
  else:
    emitting = emit
    closed = close_window(cfg, grads, finish, guard, window) if emit else keep_open(finish, window)
  updates = closed.out
  if in_acc:
    sums, updates = closed.out, protocol_updates(closed.applied, closed.out, types)
  return updates, advance(cfg, state, sums, total, dropped, closed, emitting)


def protocol_updates(applied: jax.Array, out: Any, types: Any) -> Any:
  """The updates returned through the accumulator: the inner updates, or exact zeros."""
  return jax.tree.map(
    lambda o, t: jnp.where(applied, o, jnp.zeros_like(o)).astype(t.dtype), out, types
  )


# ----------------------------------------------------------------------------------------------
# The transformation.


# optax.MultiSteps' methods and attributes, and what replaces each (issue 34, item 9).
MULTISTEPS_ATTRIBUTES = {
  "has_updated": (
    "use the function optax_accum.has_updated(state); it also finds the state inside an "
    "optax.chain state"
  ),
  "gradient_transformation": (
    "not needed: accumulate already returns an optax.GradientTransformationExtraArgs; use it "
    "directly in optax.chain, a Flax TrainState or an nnx.Optimizer"
  ),
  "inner_opt": "keep your own reference to the inner optimizer you passed to accumulate",
}

# optax.MultiSteps' keyword arguments, and what replaces each (`{value}`: the value given).
MULTISTEPS_KEYWORDS = {
  "every_k_schedule": "write every_k={value!r} (an int >= 1 or a callable gradient_step -> k)",
  "use_grad_mean": "write reduction={reduction!r} (use_grad_mean={value!r})",
  "should_skip_update_fn": (
    "optax.skip_not_finite is the default here (skip_nonfinite=True); for another rule, compute "
    "it yourself and pass update(..., weight=0.0) to leave a micro-batch out"
  ),
}


class Accumulate(optax.GradientTransformationExtraArgs):
  """`accumulate`'s transformation: an `optax.GradientTransformationExtraArgs` whose
  `optax.MultiSteps` methods (``has_updated``, ``gradient_transformation``, ``inner_opt``)
  raise an AttributeError naming what replaces them."""

  __slots__ = ()

  def __getattr__(self, name: str) -> Any:
    if name in MULTISTEPS_ATTRIBUTES:
      raise AttributeError(
        f"accumulate: .{name} is optax.MultiSteps'; {MULTISTEPS_ATTRIBUTES[name]} "
        "(see the migration guide)."
      )
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def transformation(cfg: Config) -> optax.GradientTransformationExtraArgs:
  """The optax transformation of a `Config`: `init` and `update` above."""
  return Accumulate(functools.partial(init, cfg), functools.partial(update, cfg))


def _refuse_multisteps(every_k: Any, unknown: dict[str, Any]) -> None:
  """optax.MultiSteps' keywords get an error naming their replacement; others Python's."""
  for name, value in unknown.items():
    if name in MULTISTEPS_KEYWORDS:
      reduction = "mean" if value else "sum"
      fix = MULTISTEPS_KEYWORDS[name].format(value=value, reduction=reduction)
      raise TypeError(f"accumulate: {name}= is optax.MultiSteps' keyword; {fix}.")
    raise TypeError(f"accumulate() got an unexpected keyword argument {name!r}")
  if every_k is None:
    raise TypeError("accumulate() missing 1 required argument: 'every_k'")


def accumulate(
  inner: optax.GradientTransformation,
  every_k: EveryK = None,  # type: ignore[assignment]  # required: None is refused below
  *,
  reduction: Reduction = "mean",
  accum_dtype: DType | None = jnp.float32,
  skip_nonfinite: bool = True,
  axis_name: AxisName | None = None,
  noise_scale: bool = False,
  rounding: str | None = None,
  **multisteps: Any,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates weighted micro-batch gradients and applies `inner` every `every_k` steps.

  Each `update` adds one micro-batch gradient to sums kept in the state. On the k-th call of a
  window the normalised sum ``Σ wᵢ gᵢ / Σ wᵢ`` goes to `inner`, whose updates are returned; on
  the other calls the updates are zeros (same structure, shapes and dtypes as `inner`'s) and
  `inner` does not run at all (`lax.cond`, not a select).

  `update(grads, state, params=None, *, weight=None, force_emit=False, emit=None, **extra)`:

  * ``weight``: a non-negative scalar, how much this micro-batch's mean gradient counts (e.g. its
    number of real tokens). Default 1. A host value that is negative, NaN, ±Inf or too large
    for float32 raises; a traced one drops its micro-batch and counts it in `num_skipped`.
  * ``force_emit``: bool or boolean scalar array; True closes the window now (a short last
    window), normalised by the weight it holds.
  * ``emit``: None (default) lets the device decide from the state's step counter. A Python
    bool states it statically: True traces only the emitting program, False only the
    accumulating one, so a training loop can compile two programs with no conditional at all
    (see `optax_accum.TrainStep`). The caller must pass True exactly on the k-th call.
  * ``extra``: forwarded to `inner` on the emitting step.

  Args:
    inner: the optimizer to apply every k-th step; any `optax.GradientTransformation`.
    every_k: the window length, an int >= 1, or a callable ``gradient_step -> k`` (int32
      scalar in, integer scalar out) for batch-size ramps. The length of a window is the one in
      force when it opened, recorded in the state (`window_k`): a schedule whose value changes
      mid-window, or a state made with another `every_k` (restored from another run), finishes
      its open window at that length; the next window takes the length in force then.
      every_k=1 is the same contract as every_k >= 2 with each window one micro-batch long
      (weights, drops, dtypes); it keeps no accumulator, so ``emit=False`` raises there.
      ``optax_accum.FollowNoiseScale(...)``: each window's length follows the measured noise
      scale (`optax_accum.noise_scale`), decided when the window before it closes and
      recorded in `window_k`; it changes only at window boundaries. Implies `noise_scale`.
    reduction: "mean" divides the weighted sum ``Σ wᵢ gᵢ`` by the total weight ``Σ wᵢ``;
      "sum" keeps the weighted sum.
    accum_dtype: the accumulator's dtype (floating or complex). Each leaf accumulates in
      ``promote_types(accum_dtype, its dtype)`` of its own kind: never narrower than the
      gradient (float64 stays float64, complex stays complex, bfloat16 is summed in float32).
      None: the parameters' dtypes at `init` (the gradients' own for `jax.grad`); a wider
      gradient then raises rather than being narrowed.
    skip_nonfinite: drop micro-batches whose gradient has a NaN or Inf: neither their gradient
      nor their weight enters the sums; `num_skipped` counts them. They still count towards k.
      A window whose sums are not finite even so (finite gradients that overflow a narrow
      accumulator, e.g. float16 with ``accum_dtype=None``) is dropped whole when it closes
      (one read of the sums then), its micro-batches counted. A micro-batch of weight 0 adds
      nothing in every mode, a NaN in it included.
      With `axis_name`, each device decides for its own piece of the micro-batch (no collective
      on the accumulating steps): a NaN on one device drops that device's piece only; across
      the model axes of a `shard_map` the decision is one (a NaN in one model shard drops the
      piece on every shard). "window": no check per micro-step (each gradient is read once,
      by the add); at emission a window whose (global) sums hold a NaN or Inf is dropped
      whole, its micro-batches counted in `num_skipped`. With `noise_scale`, ``|g|²`` is then
      read from the window's last micro-batch only (`sampled_sq_norm`: unbiased over the order
      of the micro-batches, noisier than reading every one).
    axis_name: the data-parallel axis to reduce the sums and weights over, once, on the
      emitting step only: inside `shard_map`/`pmap`, or in a step bound by
      `optax_accum.data_parallel` under plain `jax.jit`. The gradients must be device-local:
      differentiate with respect to ``jax.lax.pcast(params, axis_name, to="varying")``
      (already-reduced gradients warn). The accumulator is then per device (see
      `state_partition_specs`).
    noise_scale: keep the statistics of the gradient noise scale in the state (`noise`: a few
      float32 scalars, no parameter-sized memory): each micro-step adds ``wᵢ|gᵢ|²`` of a kept
      micro-batch (its squared norm, which with `skip_nonfinite` is also the finite check, so
      no extra read of the gradient), and the emitting step reduces those sums in the
      all-reduce it makes anyway (scalars only) and reads the sums once more for ``|ḡ|²``.
      Read them with `optax_accum.noise_scale(state)`. With the default weight the unit is
      one global micro-batch: under `axis_name` each device's share weighs 1/n. End the
      inner chain with `optax_accum.scale_by_gain` to scale the learning rate by the AdaScale
      gain. Default False: none of this.
    rounding: None (default): the accumulator is never narrower than a gradient. "nearest" or
      "stochastic": it is `accum_dtype` itself, also narrower (a 2-byte accumulator:
      ``accum_dtype=jnp.bfloat16``). "nearest": each addition in `accum_dtype`, rounded to
      nearest (what bfloat16 gradients summed in bfloat16 do; its error grows with the
      window). "stochastic" (bfloat16 only): each addition in float32, rounded to bfloat16 up
      or down at random, unbiased; keyed per micro-step from the state's counters (and with
      `axis_name` per device: independent roundings), so reproducible and resumable bit for
      bit. With `axis_name` the window's all-reduce sums the devices' sums in float32. See the
      fast-path guide for what each costs.

  A private inner optimizer (one holding ``privacy.dp_noise``'s state) is held to the
  privacy contract (`optax_accum.privacy.CONTRACT`): at `init`, ``reduction="mean"``,
  `noise_scale`, `FollowNoiseScale`, `scale_by_gain` and an accumulator narrower than float32
  raise, and a ``weight=`` raises at the first `update`; every window then makes its noisy
  update, even one whose micro-batches were all dropped, or, with ``skip_nonfinite="window"``,
  whose sums were not finite (the update of zero sums; `dp_updates` counts it, `num_skipped`
  its dropped micro-batches).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is an `AccumulateState`.

  Raises:
    TypeError, ValueError: for a bad `every_k`, `reduction` or `accum_dtype` (at
      construction); at `init`, for an option a private inner optimizer refuses; at trace
      time, for a bad host `weight` or `force_emit`, gradients of another tree or shape than
      the state, a state made with every_k=1 for every_k > 1 (or the
      reverse) or with another `accum_dtype` (ValueError naming both dtypes), ``emit=False``
      with every_k=1, or an `axis_name` that nothing binds (the error names the ways to bind
      it: `jax.shard_map`, `optax_accum.data_parallel`, ``TrainStep(axis_name=...)``).
      TypeError naming the replacement for `optax.MultiSteps`' keywords (``every_k_schedule=``,
      ``use_grad_mean=``, ``should_skip_update_fn=``); AttributeError naming it for its methods
      (``tx.has_updated``, ``tx.gradient_transformation()``, ``tx.inner_opt``).

  >>> import jax, jax.numpy as jnp, optax, optax_accum
  >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  >>> params = jnp.zeros(2)
  >>> state = tx.init(params)
  >>> u, state = tx.update(jnp.array([1.0, 1.0]), state, params, weight=1.0)
  >>> u  # not the k-th step: zeros, and sgd did not run
  Array([0., 0.], dtype=float32)
  >>> u, state = tx.update(jnp.array([4.0, 4.0]), state, params, weight=3.0)
  >>> u  # -(1*1 + 3*4) / (1 + 3)
  Array([-3.25, -3.25], dtype=float32)
  """
  _refuse_multisteps(every_k, multisteps)
  return transformation(
    make_config(
      inner, every_k, reduction, accum_dtype, skip_nonfinite, axis_name, noise_scale, rounding
    )
  )
