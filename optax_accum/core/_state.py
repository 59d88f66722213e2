"""`AccumulateState`, what every front end keeps between micro-steps, and its readers.

The state of `accumulate` (and of `TrainStep`, which makes the same one), the readers a user
calls on it (`has_updated`, `window_mean_grad`), and what the front ends, the partition specs
and the audit ask of it: where it sits in a larger state (`find_state`), whether it holds an
accumulator (`holds_sums`, `no_sums`), whether gradients fit it (`check_tree`), and what the
gradients of some parameters look like (`gradient_like`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum.core import _checks, _core, _find


class AccumulateState(NamedTuple):
  """State of `accumulate`: the open window's weighted sums and the inner optimizer's state."""

  mini_step: jax.Array  # shape=(), dtype=jnp.int32: micro-steps taken in the open window
  gradient_step: jax.Array  # shape=(), dtype=jnp.int32: inner updates applied so far
  # shape=(), dtype=jnp.int32: the open window's length, fixed when it opened (its every_k, the
  # schedule's value then, or FollowNoiseScale's decision); when mini_step == 0, the length of
  # the window that opens next, as decided when the last one closed (a configuration other than
  # the one that made the state decides it again: `front_ends._config.window_length`).
  window_k: jax.Array
  # Σ wᵢ gᵢ of the open window (a weighted *sum*, not optax.MultiSteps' running mean), in
  # accum_dtype. Stale when mini_step == 0 (the closed window's sums or the updates it returned;
  # the next micro-step ignores it and writes over it): read it with `window_mean_grad`. On a
  # private path (a dp_noise inside) zeros then: the closed window's clipped sums are secret.
  # every_k == 1: the same tree, one boolean scalar False per leaf (`NO_SUMS`), no buffer.
  grad_sum: Any
  acc_weight: jax.Array  # shape=(), dtype=jnp.float32: Σ wᵢ of the open window (same rule)
  num_skipped: jax.Array  # shape=(), dtype=jnp.int32: non-finite micro-batches dropped so far
  inner_state: Any  # the inner optimizer's state, untouched between updates
  updated: jax.Array  # shape=(), dtype=jnp.bool_: the call that made this state updated
  noise: Any = None  # the noise-scale statistics (`_noise.NoiseState`), None without them

  def __getattr__(self, name: str) -> Any:
    # Only for names that are not fields: optax.MultiStepsState's get the replacement.
    if name in MULTISTEPS_FIELDS:
      raise AttributeError(
        f"AccumulateState has no field {name!r} (optax.MultiStepsState's); "
        f"{MULTISTEPS_FIELDS[name]} (see the migration guide)."
      )
    raise AttributeError(f"'AccumulateState' object has no attribute {name!r}")


# optax.MultiStepsState's fields that `AccumulateState` names otherwise, and what replaces each.
MULTISTEPS_FIELDS = {
  "acc_grads": (
    "it held the running mean of the open window's gradients, zeros after an update. Here "
    "grad_sum holds the weighted sum Σ wᵢ gᵢ, stale when mini_step == 0: for the window's mean "
    "gradient use optax_accum.window_mean_grad(state, grads) with the state before update"
  ),
  "inner_opt_state": "the inner optimizer's state is inner_state",
  "skip_state": "num_skipped counts the non-finite micro-batches dropped",
}


def no_sums(axis: Any, tree: Any) -> Any:
  """`grad_sum` at every_k == 1, where a window is one micro-batch and nothing is kept: the
  gradients' tree with one boolean scalar False per leaf (per device under an axis, like the
  sums it stands for). The same tree as an accumulator, so a state's structure does not depend
  on `every_k`, at a few bytes instead of a parameter-sized buffer; boolean, so that it cannot
  be mistaken for sums (an accumulator is never boolean)."""
  return jax.tree.map(lambda _: axis.per_device(jnp.zeros((), jnp.bool_)), tree)


def holds_sums(state: AccumulateState) -> bool | None:
  """Whether ``state.grad_sum`` is an accumulator (every_k > 1), not `no_sums` (every_k == 1);
  None for a tree without leaves (both are empty)."""
  leaves = jax.tree.leaves(state.grad_sum)
  if not leaves:
    return None
  return any(jnp.dtype(x.dtype) != jnp.bool_ for x in leaves)


def find_state(state: Any, caller: str) -> AccumulateState:
  """The one `AccumulateState` inside `state` (an `optax.chain` tuple, an `nnx.Optimizer`'s
  state, a Flax `TrainState`, ...), its own fields unwrapped to arrays (`_find.find`)."""
  missing = (
    f"{caller}: expected a state holding exactly one AccumulateState, found 0 in a "
    f"{type(state).__name__}."
  )
  return _find.find(state, AccumulateState, caller, missing, skip=("inner_state",))


def has_updated(state: Any) -> jax.Array:
  """True iff the `update` call that produced `state` applied an inner update.

  Args:
    state: an `AccumulateState`, or a state that contains one (an `optax.chain` state, an
      `nnx.Optimizer`'s ``opt_state``, a Flax `TrainState`'s ``opt_state``).

  Returns:
    A boolean scalar `jax.Array` (never a wrapper such as an nnx Variable: ``bool()`` works).

  Raises:
    ValueError: if `state` holds no `AccumulateState` or several.

  >>> import jax.numpy as jnp, optax, optax_accum
  >>> tx = optax_accum.accumulate(optax.sgd(0.1), every_k=2)
  >>> params = {"w": jnp.ones(3)}
  >>> state = tx.init(params)
  >>> _, state = tx.update({"w": jnp.ones(3)}, state, params)
  >>> bool(optax_accum.has_updated(state))
  False
  >>> _, state = tx.update({"w": jnp.ones(3)}, state, params)
  >>> bool(optax_accum.has_updated(state))
  True
  """
  return find_state(state, "has_updated").updated


def window_mean_grad(state: Any, grads: Any, *, weight: Any = None) -> Any:
  """The mean gradient ``Σ wᵢ gᵢ / Σ wᵢ`` of the open window with `grads` added.

  Call it with the state *before* ``tx.update(grads, state, ..., weight=weight)``: on the call
  that closes the window, it is the gradient the inner optimizer receives (with the default
  ``reduction="mean"``; "sum" gives it ``Σ wᵢ gᵢ``, i.e. this times the window's total
  weight), so ``optax.tree.norm(window_mean_grad(state, grads))`` logged where
  `has_updated` turns true is the norm of each update's gradient, the large batch's. On the
  other calls it is the mean of the window so far. What `optax.MultiSteps` users computed
  from its ``acc_grads``, a running mean, as ``acc + (g - acc) / (mini_step + 1)``.

  A non-finite `grads` (or a zero weight) is left out, as ``skip_nonfinite=True`` (the
  default) drops it; the mean of a window with no weight is zeros. Under ``jax.jit``, a norm
  of it is one fused pass over the sums and the gradients (no parameter-sized temporary).

  Args:
    state: an `AccumulateState`, or a state that contains one (an `optax.chain` state, an
      `nnx.Optimizer`'s ``opt_state``, a Flax `TrainState`'s ``opt_state``), as it was before
      this micro-step's update; any ``every_k`` (with every_k=1 the window is `grads` alone).
    grads: this micro-step's gradients, the tree the optimizer updates.
    weight: this micro-step's weight, as passed to ``update`` (default 1).

  Returns:
    A tree like `grads` (in their dtypes): the window's weighted mean gradient.

  Raises:
    ValueError: if `state` holds no `AccumulateState` or several, if `grads` do not match its
      accumulator, or if it holds per-device sums (``accumulate(..., axis_name=...)``), whose
      mean needs the other devices' (inside the map: ``psum`` of ``grad_sum + w·g`` over
      ``psum`` of ``acc_weight + w``).

  >>> import jax.numpy as jnp, optax, optax_accum
  >>> tx = optax_accum.accumulate(optax.sgd(1.0), every_k=2)
  >>> params = jnp.zeros(2)
  >>> state = tx.init(params)
  >>> _, state = tx.update(jnp.array([1.0, 1.0]), state, params, weight=1.0)
  >>> g = jnp.array([4.0, 4.0])
  >>> optax_accum.window_mean_grad(state, g, weight=3.0)  # (1*1 + 3*4) / (1 + 3)
  Array([3.25, 3.25], dtype=float32)
  >>> u, state = tx.update(g, state, params, weight=3.0)
  >>> u  # sgd(1.0) of that very gradient
  Array([-3.25, -3.25], dtype=float32)
  """
  caller = "window_mean_grad"
  acc = find_state(state, caller)
  if jnp.ndim(acc.acc_weight) > jnp.ndim(acc.mini_step):
    raise ValueError(PER_DEVICE_MEAN)
  if holds_sums(acc):
    check_tree(grads, acc.grad_sum, 0, "state", "the tree the state was initialised with")
    sums, total = acc.grad_sum, acc.acc_weight
  else:  # every_k == 1: every window is this micro-batch alone
    sums, total = _core.zeros(grads, jnp.float32), jnp.zeros((), jnp.float32)
  weight = _checks.weight(weight, caller)
  restart = acc.mini_step == 0  # the sums of a window closed last are stale
  sums, total, _ = _core.add(sums, total, grads, weight, skip_nonfinite=True, restart=restart)
  return _core.normalise(sums, total, grads, "mean")


PER_DEVICE_MEAN = (
  "window_mean_grad: this state holds per-device sums (accumulate(..., axis_name=...)): each "
  "device holds a part of the window, and this function reads states without an axis_name "
  "only. Inside the map, the window's mean is jax.lax.psum of the sums over jax.lax.psum of "
  "the weights (grad_sum + w * g and acc_weight + w, from zero when mini_step == 0); or log "
  "the norm of the micro-step's own gradients."
)


def check_tree(grads: Any, reference: Any, skip: int, name: str, described: str) -> None:
  """Raises if `grads` has another tree or other shapes than `reference` (`name`: the state's
  accumulator, whose first `skip` axes are the per-device stacking, or the parameters)."""
  got, want = jax.tree.structure(grads), jax.tree.structure(reference)
  if got != want:
    raise ValueError(
      f"accumulate.update: grads do not match {described}.\n  grads: {got}\n  {name}: {want}\n"
      "Maybe init was called on different parameters than those you differentiate."
    )
  pairs = zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(reference), strict=True)
  bad = [
    f"  {jax.tree_util.keystr(path)}: grads {jnp.shape(g)}, {name} {jnp.shape(a)[skip:]}"
    for (path, g), a in pairs
    if jnp.shape(a)[skip:] != jnp.shape(g)
  ]
  if bad:
    raise ValueError(
      f"accumulate.update: grads have other shapes than the {name}:\n" + "\n".join(bad)
    )


def gradient_like(params: Any) -> Any:
  """What the gradients look like: the parameters, except for `optax.lookahead`, whose
  parameters are ``LookaheadParams(fast, slow)`` and whose gradients are the fast weights'."""
  return params.fast if isinstance(params, optax.LookaheadParams) else params
