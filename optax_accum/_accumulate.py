"""`accumulate`: an optax transformation that applies its inner optimizer every k-th step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _core

EveryK = int | Callable[[jax.Array], Any]


class AccumulateState(NamedTuple):
  """State of `accumulate`: the open window's weighted sums and the inner optimizer's state."""

  mini_step: jax.Array  # shape=(), dtype=jnp.int32: micro-steps taken in the open window
  gradient_step: jax.Array  # shape=(), dtype=jnp.int32: inner updates applied so far
  # Σ wᵢ gᵢ of the open window, in accum_dtype; None when every_k == 1. Stale (the closed
  # window's sums, ignored and overwritten by the next micro-step) when mini_step == 0.
  acc_grads: Any
  acc_weight: jax.Array  # shape=(), dtype=jnp.float32: Σ wᵢ of the open window (same rule)
  num_skipped: jax.Array  # shape=(), dtype=jnp.int32: non-finite micro-batches dropped so far
  inner_state: Any  # the inner optimizer's state, untouched between updates
  updated: jax.Array  # shape=(), dtype=jnp.bool_: the call that made this state updated


def has_updated(state: AccumulateState) -> jax.Array:
  """True iff the `update` call that produced `state` applied an inner update.

  Args:
    state: an `AccumulateState` (or a state that contains one, e.g. an `optax.chain` state).

  Returns:
    A boolean scalar array.

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
  if not isinstance(state, AccumulateState):
    is_state = lambda x: isinstance(x, AccumulateState)
    found = [x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]
    if len(found) != 1:
      raise ValueError(
        "has_updated: expected a state holding exactly one AccumulateState, "
        f"found {len(found)} in a {type(state).__name__}."
      )
    state = found[0]
  return state.updated


def _check_every_k(every_k: Any) -> EveryK:
  if callable(every_k):
    return every_k
  if isinstance(every_k, bool) or not isinstance(every_k, int):
    raise TypeError(
      "every_k must be a positive int or a callable gradient_step -> k, got "
      f"{every_k!r} of type {type(every_k).__name__}."
    )
  if every_k < 1:
    raise ValueError(f"every_k must be a positive int, got {every_k}.")
  return every_k


def _check_reduction(reduction: Any) -> _core.Reduction:
  if reduction not in _core.REDUCTIONS:
    hint = " Maybe you meant 'mean'." if reduction in ("avg", "average") else ""
    raise ValueError(f"reduction must be one of {_core.REDUCTIONS}, got {reduction!r}.{hint}")
  return reduction


def _check_tree(grads: Any, state: AccumulateState, lead: int) -> None:
  """Raises if `grads` has another tree or other shapes than the accumulator in `state`."""
  if state.acc_grads is None:
    return
  got, want = jax.tree.structure(grads), jax.tree.structure(state.acc_grads)
  if got != want:
    raise ValueError(
      "accumulate.update: grads do not match the tree the state was initialised with.\n"
      f"  grads: {got}\n  state: {want}\n"
      "Maybe init was called on different parameters than those you differentiate."
    )
  pairs = zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(state.acc_grads), strict=True)
  bad = [
    f"  {jax.tree_util.keystr(path)}: grads {jnp.shape(g)}, state {jnp.shape(a)[lead:]}"
    for (path, g), a in pairs
    if jnp.shape(a)[lead:] != jnp.shape(g)
  ]
  if bad:
    raise ValueError(
      "accumulate.update: grads have other shapes than the state:\n" + "\n".join(bad)
    )


def accumulate(
  inner: optax.GradientTransformation,
  every_k: EveryK,
  *,
  reduction: _core.Reduction = "mean",
  accum_dtype: Any = jnp.float32,
  skip_nonfinite: bool = True,
  axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates weighted micro-batch gradients and applies `inner` every `every_k` steps.

  Each `update` adds one micro-batch gradient to sums kept in the state. On the k-th call of a
  window the normalised sum ``Σ wᵢ gᵢ / Σ wᵢ`` goes to `inner`, whose updates are returned; on
  the other calls the updates are zeros (same structure, shapes and dtypes as `inner`'s) and
  `inner` does not run at all (`lax.cond`, not a select).

  `update(grads, state, params=None, *, weight=None, force_emit=False, emit=None, **extra)`:

  * ``weight``: a non-negative scalar, how much this micro-batch's mean gradient counts (e.g. its
    number of real tokens). Default 1.
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
      force when it opened.
    reduction: "mean" divides the weighted sum by the total weight; "sum" does not.
    accum_dtype: the accumulator's dtype; None means the gradients' own dtype.
    skip_nonfinite: drop micro-batches whose gradient has a NaN or Inf: neither their gradient
      nor their weight enters the sums; `num_skipped` counts them. They still count towards k.
    axis_name: inside `shard_map`/`pmap`, the mapped axis to reduce the sums and weights over,
      once, on the emitting step only. Gradients must then be device-local (see README).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is an `AccumulateState`.

  Raises:
    TypeError, ValueError: for a bad `every_k` or `reduction` (at construction), or a bad
      `weight` or gradient tree (at trace time).

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
  every_k = _check_every_k(every_k)
  reduction = _check_reduction(reduction)
  if accum_dtype is not None:
    accum_dtype = jnp.dtype(accum_dtype)
  inner = optax.with_extra_args_support(inner)
  single = isinstance(every_k, int) and every_k == 1  # no accumulator at all

  def window_length(gradient_step):
    if isinstance(every_k, int):
      return jnp.asarray(every_k, jnp.int32)
    k = jnp.asarray(every_k(gradient_step))
    if k.ndim != 0 or not jnp.issubdtype(k.dtype, jnp.integer):
      raise TypeError(
        f"every_k(gradient_step) must return an integer scalar, got {k.dtype}{list(k.shape)}."
      )
    return jnp.maximum(k.astype(jnp.int32), 1)

  def per_device(x):
    # With an axis name each device holds its own partial sums: a leading axis of length 1
    # makes them a stacked (num_devices, ...) array outside the map (see `state_partition_specs`).
    if axis_name is None:
      return x
    return jax.tree.map(lambda a: a[None], _core.to_varying(x, axis_name))

  def init_fn(params):
    acc = None if single else per_device(_core.zeros(params, accum_dtype))
    return AccumulateState(
      mini_step=jnp.zeros((), jnp.int32),
      gradient_step=jnp.zeros((), jnp.int32),
      acc_grads=acc,
      acc_weight=per_device(jnp.zeros((), jnp.float32)),
      num_skipped=per_device(jnp.zeros((), jnp.int32)),
      inner_state=inner.init(params),
      updated=jnp.zeros((), jnp.bool_),
    )

  def update_fn(
    updates,
    state: AccumulateState,
    params=None,
    *,
    weight=None,
    force_emit=False,
    emit: bool | None = None,
    _apply_to_params: bool = False,
    **extra_args,
  ):
    grads = updates
    where = "accumulate.update"
    _core.check_axis(axis_name, where)
    _check_tree(grads, state, lead=0 if axis_name is None else 1)
    weight = _core.check_weight(weight, where)
    if emit is not None and not isinstance(emit, bool):
      raise TypeError(f"{where}: emit must be None or a Python bool, got {emit!r}.")
    if emit is False and force_emit is True:
      raise ValueError(f"{where}: emit=False contradicts force_emit=True.")
    if _apply_to_params and (emit is not True or params is None):
      raise ValueError(f"{where}: _apply_to_params needs emit=True and params.")
    if axis_name is not None:
      _core.warn_if_reduced(grads, weight, axis_name, where)
      _core.check_uniform(force_emit, "force_emit", axis_name, where)
    if single:
      emit = True

    def local(x):
      return x if axis_name is None else jax.tree.map(lambda a: a[0], x)

    window_reduction = reduction
    if single and axis_name is None:
      # No accumulator: the window is this one gradient, whose mean is itself (so no division:
      # "sum"); only a drop or a zero weight (total == 0) changes anything.
      w = jnp.ones((), jnp.float32) if weight is None else weight.astype(jnp.float32)
      finite = _core.all_finite(grads) if skip_nonfinite else jnp.asarray(True)
      total = jnp.where(finite, w, jnp.zeros_like(w))
      dropped = jnp.logical_not(finite)
      window_reduction = "sum"
      sums = grads
      if weight is not None and reduction == "sum":
        sums = jax.tree.map(lambda g: g * w.astype(g.dtype), grads)
    elif single:
      # Other devices will see this gradient through the psum: mask and weigh it like any
      # window (XLA folds the zero it starts from).
      sums, total, dropped = _core.add(
        _core.zeros(grads, accum_dtype),
        jnp.zeros((), jnp.float32),
        grads,
        weight,
        skip_nonfinite=skip_nonfinite,
      )
    else:
      # The accumulator is reset lazily: a window's first micro-step ignores what the state
      # holds (the sums of the window closed last), so the emitting step never rewrites it.
      sums, total, dropped = _core.add(
        local(state.acc_grads),
        local(state.acc_weight),
        grads,
        weight,
        skip_nonfinite=skip_nonfinite,
        restart=state.mini_step == 0,
      )
    num_skipped = local(state.num_skipped) + dropped.astype(jnp.int32)

    # The zero updates of a non-emitting step: exactly the inner optimizer's output types.
    try:
      out_types = jax.eval_shape(
        lambda g, s, p: inner.update(g, s, p, **extra_args)[0], grads, state.inner_state, params
      )
    except TypeError:
      if emit is not False:
        raise
      # emit=False never runs the inner optimizer, so a caller may leave out arguments only the
      # emitting step needs (e.g. `value=` for reduce_on_plateau); updates then take the
      # gradients' structure and dtypes.
      out_types = jax.eval_shape(lambda g: g, grads)

    def apply(sums, total, inner_state, params, extra_args):
      g = _core.normalise(sums, total, grads, window_reduction)
      new_updates, new_inner = inner.update(g, inner_state, params, **extra_args)
      # Some optimizers return state in the gradients' dtype (adam's mu for bf16 params and
      # f32 grads); the state's dtypes are fixed by init so that it stays a valid carry.
      new_inner = optax.tree.cast_like(new_inner, inner_state)
      if _apply_to_params:
        # TrainStep's emitting program: applying inside the branch lets XLA fuse the inner
        # update into the apply, instead of materialising `updates` as the branch's output.
        return optax.apply_updates(params, new_updates), new_inner
      return new_updates, new_inner

    def skip(sums, total, inner_state, params, extra_args):
      del sums, total, extra_args
      if _apply_to_params:
        return params, inner_state
      zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), out_types)
      return zeros, inner_state

    def close(sums, total, inner_state, params, extra_args):
      """The emitting step: reduce across devices, then apply unless the window is empty."""
      sums, total = _core.reduce_window(sums, total, grads, axis_name, window_reduction)
      ok = total > 0
      if single and weight is None and not skip_nonfinite:
        # Nothing can empty this window: the inner optimizer itself, with no conditional.
        return *apply(sums, total, inner_state, params, extra_args), ok
      new_updates, new_inner = lax.cond(
        ok, apply, skip, sums, total, inner_state, params, extra_args
      )
      return new_updates, new_inner, ok

    def stay_open(sums, total, inner_state, params, extra_args):
      """A non-emitting step: zero updates, the inner optimizer untouched."""
      new_updates, new_inner = skip(sums, total, inner_state, params, extra_args)
      return new_updates, new_inner, jnp.asarray(False)

    operands = (sums, total, state.inner_state, params, extra_args)
    k = window_length(state.gradient_step)
    if emit is True:
      new_updates, new_inner, applied = close(*operands)
      emitting = jnp.asarray(True)
    elif emit is False:
      new_updates, new_inner, applied = stay_open(*operands)
      emitting = jnp.asarray(False)
    else:
      emitting = jnp.logical_or(state.mini_step + 1 >= k, jnp.asarray(force_emit, jnp.bool_))
      new_updates, new_inner, applied = lax.cond(emitting, close, stay_open, *operands)

    new_state = AccumulateState(
      mini_step=jnp.where(emitting, 0, optax.safe_increment(state.mini_step)).astype(jnp.int32),
      gradient_step=jnp.where(
        applied, optax.safe_increment(state.gradient_step), state.gradient_step
      ).astype(jnp.int32),
      acc_grads=None if single else per_device(sums),
      acc_weight=per_device(jnp.zeros((), jnp.float32) if single else total),
      num_skipped=per_device(num_skipped),
      inner_state=new_inner,
      updated=applied,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
