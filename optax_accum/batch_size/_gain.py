"""The AdaScale gain: the learning rate and the schedule follow the batch, so the recipe stays.

A recipe (learning rate, schedule, number of updates) is tuned at one batch, of weight W0. A
window of weight W = S·W0 averages S times as much data, which is worth at most S updates of
the base batch — S when the noise dominates the gradient, 1 when the gradient dominates.
AdaScale (Johnson, Agrawal, Gu & Guestrin, "AdaScale SGD", ICML 2020,
https://arxiv.org/abs/2007.05105) measures where between the two a window lies, from the
statistics `_noise` already keeps (T, the trace of the gradient covariance per unit weight,
and Q, the squared norm of the true gradient):

* the gain ``r = (T/W0 + Q) / (T/W + Q)``, the ratio of the expected squared norm of a base
  batch's gradient to that of the window's, in ``[1, S]`` (clipped there; Q ≤ 0 gives S);
* the update is ``−r·lr(τ)·u`` ("linear", AdaScale's rule for SGD) or ``−√r·lr(τ)·u``
  ("sqrt", adaptdl's rule for Adam-like optimizers, whose updates are already normalised);
* progress ``τ += r``: the updates of the base recipe this one is worth; every schedule is
  evaluated at τ (before the update), and a run ends when τ reaches the recipe's length.

The shape follows adaptdl's `adaptdl/torch/scaling_rules.py` (petuum/adaptdl), where a rule
maps the statistics to a learning-rate factor and the progress clock (``progress +=
gain(scale)`` after every step, for every rule) lives beside it. Here the rule is an optax
transformation at the end of the inner chain; `accumulate` hands it the closing window's
figures as an extra argument (`WINDOW_ARG`), so it runs only where a window closes and needs
no collective of its own: the figures are global scalars once the window's all-reduce ran.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum.core import _find

Rule = Literal["linear", "sqrt"]

_F32 = jnp.float32

# The extra argument through which `accumulate` passes a closing window's figures to the
# inner optimizer (optax chains forward extra arguments to every transformation that takes
# them); a name no user argument is likely to have.
WINDOW_ARG = "optax_accum_gain_window"


class GainState(NamedTuple):
  """State of `scale_by_gain`: the progress τ and the last update's gain."""

  progress: jax.Array  # shape=(), dtype=jnp.float32: τ, the sum of the gains applied so far
  gain: jax.Array  # shape=(), dtype=jnp.float32: r of the last update (1 before any)
  # No gain is lost however long the run: from τ = 2**23 on, a float32 sum alone would add a
  # gain of 1.028 as 1; the pair (progress, progress_low) keeps what it rounds away.
  progress_low: jax.Array = 0.0  # shape=(), dtype=jnp.float32: τ − progress, what it lost


class WindowFigures(NamedTuple):
  """What `accumulate` passes `scale_by_gain` for the closing window (global scalars)."""

  trace_cov: jax.Array  # smoothed T including this window (NaN until measured)
  grad_sq: jax.Array  # smoothed Q including this window (NaN until measured)
  weight: jax.Array  # W, this window's kept weight in the units of the statistics


def gain(
  trace_cov: jax.Array, grad_sq: jax.Array, weight: jax.Array, base_weight: float
) -> jax.Array:
  """The AdaScale gain of a window of weight W over the base batch of weight W0.

  ``r = (T/W0 + Q) / (T/W + Q)``, clipped to ``[1, S]`` with ``S = W/W0`` (to ``[S, 1]`` for a
  window lighter than the base, e.g. a short last window); ``Q ≤ 0`` (the noise swamps the
  gradient) gives S; no estimate yet (T or Q NaN) gives 1.

  Args:
    trace_cov: T, the per-unit-weight trace of the gradient covariance (float32 scalar).
    grad_sq: Q, the squared norm of the true gradient.
    weight: W, the window's weight, in the units of the weights.
    base_weight: W0, the recipe's batch in the same units.

  Returns:
    r, a float32 scalar.

  >>> from optax_accum.batch_size import _gain
  >>> _gain.gain(3.0, 1.0, 4.0, 1.0)  # (3 + 1) / (3/4 + 1)
  Array(2.2857144, dtype=float32)
  """
  t, q, w = (jnp.asarray(x).astype(_F32) for x in (trace_cov, grad_sq, weight))
  w0 = jnp.asarray(base_weight, _F32)
  s = w / w0
  r = (t / w0 + q) / (t / w + q)
  r = jnp.where(q <= 0, s, r)
  r = jnp.clip(r, jnp.minimum(s, 1), jnp.maximum(s, 1))
  measured = jnp.isfinite(t) & jnp.isfinite(q)
  return jnp.where(measured, r, jnp.ones((), _F32))


OUTSIDE = (
  "scale_by_gain: no window figures were passed to it. scale_by_gain reads the gradient noise "
  "statistics of the window that closes, which only optax_accum.accumulate(..., "
  "noise_scale=True) and optax_accum.TrainStep(..., noise_scale=True) hand to their inner "
  "optimizer. Put it at the end of the inner chain of one of them:\n\n"
  "    inner = optax.chain(optax.scale_by_adam(), optax_accum.scale_by_gain(lr, base_weight=4,"
  " rule='sqrt'))\n"
  "    tx = optax_accum.accumulate(inner, every_k, noise_scale=True)\n\n"
  "(a wrapper between them that does not forward extra arguments, e.g. optax.MultiSteps, "
  "stops them too). Outside accumulate there is no gain to apply: use "
  "optax.scale_by_learning_rate(lr)."
)


def _check_base_weight(base_weight: Any) -> float:
  if isinstance(base_weight, bool) or not isinstance(
    base_weight, int | float | np.integer | np.floating
  ):
    raise TypeError(
      "scale_by_gain: base_weight must be a positive number (the weight of the recipe's batch "
      "in the units of the weights: micro-batches with the default weight 1, examples or "
      f"tokens when the weights count them), got {base_weight!r} of type "
      f"{type(base_weight).__name__}."
      # optax.inject_hyperparams makes every numeric argument an array:
      + (f"\n\n{INJECTED}" if isinstance(base_weight, jax.Array) else "")
    )
  value = float(base_weight)
  if not (np.isfinite(value) and value > 0):
    raise ValueError(
      f"scale_by_gain: base_weight must be positive and finite, got {value}: it is the weight "
      "of the batch the recipe was tuned at (e.g. base_weight=4 for 4 micro-batches)."
    )
  return value


def _check_rule(rule: Any) -> Rule:
  if rule not in ("linear", "sqrt"):
    raise ValueError(
      f"scale_by_gain: rule must be 'linear' (SGD-like optimizers: lr × r) or 'sqrt' (Adam-like "
      f"ones: lr × √r), got {rule!r}."
    )
  return rule


def scale_by_gain(
  learning_rate: optax.ScalarOrSchedule, *, base_weight: float, rule: Rule = "linear"
) -> optax.GradientTransformationExtraArgs:
  """Scales updates by ``−r·lr(τ)`` (AdaScale): the learning rate follows the window's gain.

  Put it at the end of the inner chain of `optax_accum.accumulate` or `optax_accum.TrainStep`
  (with ``noise_scale=True``), in place of `optax.scale_by_learning_rate`: it multiplies the
  updates by ``−r·lr(τ)`` ("linear") or ``−√r·lr(τ)`` ("sqrt"), as that one multiplies them by
  ``−lr``. r is the AdaScale gain ``(T/W0 + Q) / (T/W + Q)`` of the closing window (weight W)
  over the recipe's batch (weight W0, `base_weight`), from the smoothed noise statistics
  (`optax_accum.noise_scale`) updated with that window, clipped to ``[1, S]``, ``S = W/W0``;
  r = 1 until an estimate exists; Q ≤ 0 gives r = S. τ (`optax_accum.progress`) is the sum of
  the gains so far; a schedule is evaluated at τ before the update, as optax evaluates one at
  the number of updates already done, so at S = 1 the run is exactly the plain schedule's.

  Args:
    learning_rate: the recipe's learning rate, a number or an optax schedule (evaluated at τ,
      a float32 scalar).
    base_weight: W0, the weight of the batch the recipe was tuned at, in the units of the
      weights: micro-batches with the default weight (one *global* micro-batch, on any number
      of devices), examples or tokens when the weights count them.
    rule: "linear" (r; AdaScale's analysis, for SGD and momentum) or "sqrt" (√r; adaptdl's
      heuristic for Adam-like optimizers). τ grows by r for both.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `GainState`.

  Raises:
    TypeError, ValueError: for a `base_weight` that is not a positive finite number or an
      unknown `rule`, at construction; at update time, if no window figures were passed (the
      transformation is not inside `accumulate`/`TrainStep`). `accumulate`'s `init` raises if
      its inner optimizer holds this transformation without ``noise_scale=True``.

  >>> import jax.numpy as jnp, optax, optax_accum
  >>> inner = optax_accum.scale_by_gain(0.1, base_weight=1)
  >>> tx = optax_accum.accumulate(inner, every_k=2, noise_scale=True)
  >>> params = jnp.zeros(2)
  >>> state = tx.init(params)
  >>> for g in ([1.0, 1.0], [3.0, 3.0]):
  ...   u, state = tx.update(jnp.array(g), state, params)
  >>> u  # 2 micro-batches, 1 measured window: T = 4, Q = 6, r = (4 + 6) / (4/2 + 6)
  Array([-0.25, -0.25], dtype=float32)
  >>> optax_accum.progress(state)
  Array(1.25, dtype=float32)
  """
  base_weight = _check_base_weight(base_weight)
  rule = _check_rule(rule)

  def init_fn(params: Any) -> GainState:
    del params
    # Distinct arrays: a donating step (TrainStep) cannot donate one buffer twice.
    zeros = jnp.zeros((2,), _F32)
    return GainState(progress=zeros[0], gain=jnp.ones((), _F32), progress_low=zeros[1])

  def update_fn(updates: Any, state: GainState, params: Any = None, **extra_args: Any):
    del params
    figures = extra_args.get(WINDOW_ARG)
    if figures is None:
      raise ValueError(OUTSIDE)
    r = gain(figures.trace_cov, figures.grad_sq, figures.weight, base_weight)
    lr = learning_rate(state.progress) if callable(learning_rate) else learning_rate
    factor = -(r if rule == "linear" else jnp.sqrt(r)) * jnp.asarray(lr).astype(_F32)
    updates = jax.tree.map(lambda u: factor.astype(u.dtype) * u, updates)
    high, low = _add_exactly(state.progress, state.progress_low, r)
    return updates, GainState(progress=high, gain=r, progress_low=low)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _add_exactly(high: jax.Array, low: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``high + low + r`` as a new (high, low) pair of float32s: the rounding error of each sum is
  kept in `low` (Knuth's two-sum, then a renormalisation), not lost."""
  high, low, r = (jnp.asarray(x).astype(_F32) for x in (high, low, r))
  total = high + r
  back = total - high
  error = (high - (total - back)) + (r - back)  # exactly high + r - total
  low = low + error
  new_high = total + low
  return new_high, low - (new_high - total)


INJECTED = (
  "scale_by_gain inside optax.inject_hyperparams: inject_hyperparams evaluates a schedule at "
  "its own count of updates, not at the progress τ that every schedule of scale_by_gain runs "
  "on, so a schedule there would ignore the gain. Pass the schedule to scale_by_gain itself, "
  "which evaluates it at τ:\n\n"
  "    optax_accum.scale_by_gain(schedule, base_weight=W0)\n\n"
  "To set a factor by hand during the run, inject it into a transformation of its own before "
  "scale_by_gain:\n\n"
  "    optax.chain(optax.inject_hyperparams(optax.scale)(step_size=1.0),\n"
  "                optax_accum.scale_by_gain(schedule, base_weight=W0))"
)
_INJECT_STATES = tuple(
  getattr(optax, name)
  for name in ("InjectHyperparamsState", "InjectStatefulHyperparamsState")
  if hasattr(optax, name)
)


def holds_gain(inner_state: Any) -> bool:
  """Whether an inner optimizer's state holds a `GainState` (its chain has `scale_by_gain`).

  Raises:
    ValueError: if the `GainState` is inside an `optax.inject_hyperparams` state, whose
      schedules would run on the update count instead of τ (`INJECTED`).
  """
  is_gain = lambda x: isinstance(x, GainState)  # noqa: E731
  is_either = lambda x: is_gain(x) or isinstance(x, _INJECT_STATES)  # noqa: E731
  found = False
  for x in jax.tree.leaves(inner_state, is_leaf=is_either):
    if isinstance(x, _INJECT_STATES) and holds_gain(x.inner_state):
      raise ValueError(INJECTED)
    found = found or is_gain(x)
  return found


_NO_GAIN = (
  "progress: found no GainState in a {what}. The progress τ is kept by "
  "optax_accum.scale_by_gain at the end of the inner optimizer of accumulate/TrainStep (with "
  "noise_scale=True); pass that optimizer's state (or a state holding it: an optax.chain "
  "state, nnx.Optimizer.opt_state, TrainState.opt_state)."
)


def progress(state: Any) -> jax.Array:
  """The progress τ: the sum of the AdaScale gains of the updates so far (`scale_by_gain`).

  τ counts updates of the base recipe: a schedule inside `scale_by_gain` is evaluated at it,
  and a run whose batch changes ends when τ reaches the recipe's number of updates. At S = 1
  (every window the base batch) τ is the number of updates.

  Args:
    state: the optimizer state, or a state (pytree) that holds it (an `optax.chain` state, an
      ``nnx.Optimizer``'s ``opt_state``, a Flax ``TrainState``, an `AccumulateState`).

  Returns:
    τ, a float32 scalar `jax.Array`.

  Raises:
    ValueError: if `state` holds no `GainState` (no `scale_by_gain`), or several.

  >>> import jax.numpy as jnp, optax, optax_accum
  >>> tx = optax_accum.accumulate(optax_accum.scale_by_gain(0.1, base_weight=2), 2,
  ...                             noise_scale=True)
  >>> optax_accum.progress(tx.init(jnp.zeros(3)))
  Array(0., dtype=float32)
  """
  missing = _NO_GAIN.format(what=type(state).__name__)
  return jnp.asarray(_find.find(state, GainState, "progress", missing).progress, _F32)
