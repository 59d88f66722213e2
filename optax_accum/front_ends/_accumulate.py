"""`accumulate`: an optax transformation that applies its inner optimizer every k-th step.

`update_fn` strings small module-level pieces together, each taking its operands explicitly, so
that `TrainStep` builds its two compiled programs from the very same pieces::

    check_update → add (+ add_noise) → close_window (every k-th step) or keep_open → advance

* `add` — the micro-batch into the window's sums (`_core`; no accumulator when every_k == 1);
  `add_noise` — with ``noise_scale=True`` only, its ``w|g|²`` into the noise statistics;
* `close_window` — the window's sums, total weight (and noise partials) across devices in one
  all-reduce (`cfg.axis`, resolved once: `_collectives.Axis` or `NO_AXIS`), then the inner
  update unless the window is empty, *finished* (`Finish`) into updates (the optax protocol)
  or into new parameters (`TrainStep`);
* `keep_open` — a non-emitting step: no inner update at all;
* `advance` — the next `AccumulateState`, which records the open window's length
  (`window_length`: a window finishes at the length it opened with).

What makes the default path as fast as a plain optimizer step (measured on CPU, where large
temporaries cost page faults on every call): the finite check reads each gradient once
(`_core.all_finite`); the mean is a multiply XLA fuses into the inner update
(`_core.normalise`); and the protocol returns its updates through the accumulator's own
buffer (`IN_ACCUMULATOR`), so neither zeros nor the updates are a parameter-sized temporary,
and one conditional decides whether the inner optimizer runs (`emit_dynamic`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import _checks, _collectives, _core, _find, _gain, _noise
from optax_accum._typing import AxisName, DType, Reduction

EveryK = int | Callable[[jax.Array], Any] | _noise.FollowNoiseScale


class AccumulateState(NamedTuple):
  """State of `accumulate`: the open window's weighted sums and the inner optimizer's state."""

  mini_step: jax.Array  # shape=(), dtype=jnp.int32: micro-steps taken in the open window
  gradient_step: jax.Array  # shape=(), dtype=jnp.int32: inner updates applied so far
  # shape=(), dtype=jnp.int32: the open window's length, fixed when it opened (its every_k, the
  # schedule's value then, or FollowNoiseScale's decision); when mini_step == 0, the length of
  # the window that opens next, as decided when the last one closed (a configuration other than
  # the one that made the state decides it again: `window_length`).
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
    _check_tree(grads, acc.grad_sum, 0, "state", "the tree the state was initialised with")
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


# ----------------------------------------------------------------------------------------------
# The pieces.


class Config(NamedTuple):
  """`accumulate`'s arguments, checked and canonical (static: hashable, never traced)."""

  inner: optax.GradientTransformationExtraArgs
  every_k: EveryK
  reduction: Reduction
  accum_dtype: jnp.dtype | None
  skip_nonfinite: bool
  axis: _collectives.Axis | _collectives.NoAxis  # resolved once (`_collectives.resolve`)
  noise: bool  # keep the noise-scale statistics (`_noise`) in the state
  front: str = "accumulate"  # the front end the messages name ("TrainStep" for its own)
  weighted: bool = False  # TrainStep's weight_fn weighs each micro-batch
  rounding: str | None = None  # None, "nearest" or "stochastic" (`_core.check_rounding`)
  # skip_nonfinite="window": no finite check per micro-step (each gradient read once, by the
  # add); a window whose sums are not finite at emission is dropped whole and counted.
  window_check: bool = False

  @property
  def axis_name(self) -> AxisName | None:
    return self.axis.name

  @property
  def sums_check(self) -> bool:
    """Whether a closing window's sums are checked for NaN/Inf, the window dropped whole (and
    its micro-batches counted) where they are not: with ``skip_nonfinite="window"`` (the only
    check), and with ``skip_nonfinite=True`` too, where finite micro-batches can still add up
    to ±Inf (an overflow of a narrow accumulator: two float16 gradients of 40000). One read of
    the sums on the closing micro-step, one boolean scalar per window. Not for a window of one
    micro-batch without an axis: its sums are that micro-batch, checked already (`_core.add_one`
    checks a weighted "sum" too)."""
    if self.window_check:
      return True
    return self.skip_nonfinite and not (self.unaccumulated and not self.axis.stacks)

  @property
  def unaccumulated(self) -> bool:
    """every_k is the static int 1: every micro-batch is a window of its own, no accumulator."""
    return isinstance(self.every_k, int) and self.every_k == 1

  @property
  def normalisation(self) -> Reduction:
    """How `close_window` turns the sums `add` returns into the window's gradient: "mean"
    divides by the total weight, "sum" keeps them — also for a window of one with no
    accumulator, whose sums `_core.add_one` returns already normalised."""
    return "sum" if self.unaccumulated and not self.axis.stacks else self.reduction


def make_config(
  inner: optax.GradientTransformation,
  every_k: Any,
  reduction: Any,
  accum_dtype: Any,
  skip_nonfinite: bool,
  axis_name: AxisName | None,
  noise_scale: bool = False,
  rounding: str | None = None,
) -> Config:
  """Checks `accumulate`'s arguments (raising errors that name them) into a `Config`."""
  if not isinstance(noise_scale, bool):
    raise TypeError(f"noise_scale must be a bool, got {noise_scale!r}.")
  follows = isinstance(every_k, _noise.FollowNoiseScale)
  window = _core.check_skip_window(skip_nonfinite)
  if not callable(every_k) and not follows:
    every_k = _checks.positive_int(
      every_k,
      "every_k",
      alternative=" or a callable gradient_step -> k or a FollowNoiseScale",
      maximum=_checks.MAX_WINDOW,
    )
  return Config(
    inner=optax.with_extra_args_support(inner),
    every_k=every_k,
    reduction=_checks.reduction(reduction),
    accum_dtype=_checks.accum_dtype(accum_dtype),
    # every_k=1: a window is one micro-batch, whose own check is the window's
    skip_nonfinite=bool(skip_nonfinite) and not (window and every_k != 1),
    window_check=window and every_k != 1,
    axis=_collectives.resolve(axis_name),
    noise=noise_scale or follows,  # following the noise scale needs its statistics
    rounding=_core.check_rounding(rounding, _checks.accum_dtype(accum_dtype)),
  )


def check_private(cfg: Config, caller: str, params: Any = None, inner_state: Any = None) -> None:
  """The privacy contract of a private path (`_checks.PRIVATE_REFUSED`): raises for the first
  option that would change the sensitivity, the noise or the sampling. Called where the path
  is known to be private: `init` (a `DPNoiseState` in the inner state), `TrainStep`'s
  constructor (a clipped loss). `params` (at ``init``): the accumulator's dtypes made for them
  (`accum_dtype` promoted with each parameter's) must be at least float32."""
  if cfg.reduction == "mean":
    _checks.refuse_private("reduction_mean", caller)
  if isinstance(cfg.every_k, _noise.FollowNoiseScale):
    _checks.refuse_private("follow_noise_scale", caller)
  if inner_state is not None and _gain.holds_gain(inner_state):
    _checks.refuse_private("scale_by_gain", caller)
  if cfg.noise:
    _checks.refuse_private("noise_scale", caller)
  if cfg.weighted:
    _checks.refuse_private("weight_fn", caller)
  dtypes = [] if params is None else _made_dtypes(cfg, _gradient_like(params))
  narrow = [d for d in dtypes if _checks.narrow_float(d)]
  if narrow:
    _checks.refuse_private("accum_dtype", caller, dtype=jnp.dtype(narrow[0]).name)
  if inner_state is not None:  # dp_noise first in the inner chain (the privacy package's check)
    _checks.private_check("inner", caller, inner_state)


def is_private(state: AccumulateState) -> bool:
  """Whether this `accumulate` is on a private path: its inner state holds a `DPNoiseState`
  (static: the state's structure)."""
  return _checks.holds_private_state(state.inner_state)


def _check_window(cfg: Config, state: AccumulateState) -> None:
  """Raises if the state was made for another window length (every_k == 1 keeps no sums) or
  with(out) the noise-scale statistics."""
  if (state.noise is not None) != cfg.noise:
    made, now = (f"noise_scale={state.noise is not None}", f"noise_scale={cfg.noise}")
    raise ValueError(
      f"accumulate.update: this state was made with {made} but is updated with {now}. Make the "
      "state with the object that updates it: `tx.init(params)` or `step.init(params)`."
    )
  holds = holds_sums(state)
  if holds is None or holds != cfg.unaccumulated:
    return
  if not holds:
    made, now = "every_k=1 (it holds no accumulator)", f"every_k={cfg.every_k}"
  else:
    made, now = "every_k > 1 (it holds an accumulator)", "every_k=1"
  raise ValueError(
    f"accumulate.update: this state was made with {made} but is updated with {now}. Make the "
    "state with the object that updates it: `tx.init(params)` or `step.init(params)`. To "
    "change every_k between runs at a window boundary (mini_step == 0), carry the rest over "
    "into that new state: new._replace(inner_state=old.inner_state, "
    "gradient_step=old.gradient_step, num_skipped=old.num_skipped)."
  )


def _check_dtypes(cfg: Config, grads: Any, acc: Any, params: Any) -> None:
  """Raises if the state's accumulator has other dtypes than this configuration makes (a state
  made with another `accum_dtype`: ValueError naming both), or, with ``accum_dtype=None``
  (the parameters' dtypes at `init`), if it would narrow a wider gradient (TypeError)."""
  if acc is None:
    return
  made = acc  # without the parameters: this configuration applied to the state's own dtypes
  if params is not None:
    like = _gradient_like(params)
    made = like if jax.tree.structure(like) == jax.tree.structure(acc) else acc
  pairs = zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(acc), strict=True)
  mismatched = [
    f"  {jax.tree_util.keystr(path)}: the state's accumulator {a.dtype}, accum_dtype="
    f"{None if cfg.accum_dtype is None else cfg.accum_dtype.name} makes {want}"
    for ((path, _), a), want in zip(pairs, _made_dtypes(cfg, made), strict=True)
    if want != a.dtype
  ]
  if mismatched:
    raise ValueError(
      "accumulate.update: this state was made with another accum_dtype:\n"
      + "\n".join(mismatched)
      + "\nAn open window keeps the precision it was opened with; make the state with the "
      "object that updates it: `tx.init(params)` or `step.init(params)`."
    )
  narrowed = [
    f"  {jax.tree_util.keystr(path)}: gradient {jnp.result_type(g)}, accumulator {a.dtype}"
    for (path, g), a in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(acc), strict=True)
    if jnp.promote_types(jnp.result_type(g), a.dtype) != a.dtype
  ]
  if narrowed and cfg.accum_dtype is None:
    raise TypeError(
      "accumulate.update: accum_dtype=None made the accumulator in the parameters' dtypes at "
      "init, which cannot hold these gradients exactly:\n" + "\n".join(narrowed) + "\n"
      "Pass the dtype to accumulate in, e.g. accum_dtype=jnp.float32."
    )


def _made_dtypes(cfg: Config, made: Any) -> list[Any]:
  """The accumulator dtypes `init` makes from `made` (the parameters, or the accumulator)."""
  exact = cfg.rounding is not None
  return [
    jnp.dtype(_core.accum_dtype_for(x, cfg.accum_dtype, exact=exact)) for x in jax.tree.leaves(made)
  ]


def _check_tree(grads: Any, reference: Any, skip: int, name: str, described: str) -> None:
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


OUTSIDE_MAP_RECIPE = (
  "With an axis each device keeps its own partial sums, so the state is made by init inside the "
  "map that binds {axis!r}. With jax.pmap (Flax's TrainState.create calls tx.init outside any "
  "map), create it inside a pmap over the replicated parameters:\n\n"
  "    state = jax.pmap(\n"
  "        lambda p: TrainState.create(apply_fn=model.apply, params=p, tx=tx),\n"
  "        axis_name={axis!r},\n"
  "    )(flax.jax_utils.replicate(params))\n"
  "    # or, for the optimizer state alone: jax.pmap(tx.init, axis_name={axis!r})(replicated)\n\n"
  "With shard_map, call tx.init inside it (optax_accum.state_partition_specs gives the specs "
  "that keep the state across calls); under plain jax.jit, optax_accum.TrainStep or "
  "data_parallel bind the axis for you."
)

NOT_PER_DEVICE = (
  "{caller}: axis_name={axis!r}, but this state was not made by init inside a map that binds "
  "it: its sums have no per-device axis (acc_weight has shape {shape}; a per-device state's "
  "has shape (1,) inside the map). " + OUTSIDE_MAP_RECIPE
)


def _check_per_device(cfg: Config, state: AccumulateState, caller: str) -> None:
  """Raises `NOT_PER_DEVICE` for a state made without the axis (or outside the map, e.g. by
  Flax's ``TrainState.create``) but updated with it: else a shapes error naming no fix."""
  shape = jnp.shape(state.acc_weight)
  if cfg.axis.stacks and shape != (1,):
    raise ValueError(NOT_PER_DEVICE.format(caller=caller, axis=cfg.axis.name, shape=shape))


def check_state(state: Any, caller: str) -> None:
  """Raises a TypeError naming the fix if `state` is not an `AccumulateState`; for plain
  containers holding its fields (a checkpoint restored without a target), the recipe."""
  if isinstance(state, AccumulateState):
    return
  fields = list(state) if isinstance(state, Mapping) else []
  if "mini_step" in fields or "grad_sum" in fields:
    raise TypeError(UNTYPED_STATE.format(caller=caller, kind=type(state).__name__, n=len(fields)))
  raise TypeError(
    f"{caller}: expected the AccumulateState that init made, got a {type(state).__name__}. "
    "Pass the state that init (or the last update) returned."
  )


UNTYPED_STATE = (
  "{caller}: the state is a {kind} of {n} entries holding AccumulateState's fields, not an "
  "AccumulateState: a checkpoint restored without a target (Orbax then gives back plain "
  "containers). Restore into the abstract tree of what you saved, made by init:\n\n"
  "    abstract = jax.eval_shape(lambda p: {{'params': p, 'opt_state': tx.init(p)}}, params)\n"
  "    restored = ocp.StandardCheckpointer().restore(path, abstract)\n\n"
  "(with TrainStep, step.init in place of tx.init; see the checkpointing guide)."
)


def check_update(
  cfg: Config,
  grads: Any,
  state: AccumulateState,
  params: Any,
  weight: Any,
  force_emit: Any,
  emit: Any,
  caller: str = "accumulate.update",
) -> jax.Array | None:
  """The trace-time checks of one `update` call; returns the weight as an array (or None)."""
  cfg.axis.check_bound(caller)
  _check_per_device(cfg, state, caller)
  _check_window(cfg, state)
  if holds_sums(state):
    described = "the tree the state was initialised with"
    _check_tree(grads, state.grad_sum, int(cfg.axis.stacks), "state", described)
  elif params is not None:
    _check_tree(grads, _gradient_like(params), 0, "params", "the tree of the parameters")
  _check_dtypes(cfg, grads, state.grad_sum if holds_sums(state) else None, params)
  if weight is not None and is_private(state):
    _checks.refuse_private("weight", caller)
  if is_private(state):  # clipped sums at least float32 until the noise
    _checks.private_check("grads", caller, grads)
  weight = _checks.weight(weight, caller)
  _checks.flag(force_emit, "force_emit", caller)
  if emit is not None and not isinstance(emit, bool):
    raise TypeError(f"{caller}: emit must be None or a Python bool, got {emit!r}.")
  if emit is False and force_emit is True:
    raise ValueError(f"{caller}: emit=False contradicts force_emit=True.")
  if emit is False and cfg.unaccumulated:
    raise ValueError(EMIT_FALSE_AT_1.format(caller=caller))
  if emit is False:
    _check_emit_false(cfg, state, caller)
  cfg.axis.warn_if_reduced(grads, weight, caller)
  cfg.axis.check_uniform(force_emit, "force_emit", caller)
  return weight


def _check_emit_false(cfg: Config, state: AccumulateState, caller: str) -> None:
  """Raises if ``emit=False`` is passed on (or past) the last call of the open window, where
  the state is concrete (outside `jax.jit`: its position is known without a device read in
  a traced program, which cannot check it)."""
  if any(isinstance(x, jax.core.Tracer) for x in (state.mini_step, state.window_k)):
    return
  k, at = int(window_length(cfg, state)), int(state.mini_step) + 1
  if at >= k:
    raise ValueError(EMIT_FALSE_PAST_K.format(caller=caller, at=at, k=k))


EMIT_FALSE_PAST_K = (
  "{caller}: emit=False on call {at} of a window of {k} micro-steps: the window's last call "
  "must pass emit=True (it closes the window and applies the update), and no window holds "
  "more than its k calls. Pass emit=True on every k-th call, e.g. emit=(step + 1) % k == 0 "
  "for a step counter from 0, or omit emit (emit=None) to let the device decide from the "
  "state's mini_step."
)


EMIT_FALSE_AT_1 = (
  "{caller}: emit=False with every_k=1: every call is the last of its window (emit must be True "
  "exactly on a window's k-th call), and with every_k=1 there is no accumulator to keep this "
  "micro-batch for a later call. To gather micro-batches across calls use every_k >= 2 (or a "
  "schedule), with emit=True on each window's last call; to close every window, omit emit."
)


def _opening_length(every_k: EveryK, gradient_step: jax.Array, decided: jax.Array) -> jax.Array:
  """The length of a window that opens at `gradient_step` (schedules clamped to >= 1);
  `FollowNoiseScale` takes the one `decided` when the last window closed (`next_length`)."""
  if isinstance(every_k, int):
    return jnp.asarray(every_k, jnp.int32)
  if isinstance(every_k, _noise.FollowNoiseScale):
    return every_k.clip(decided)  # a restored state's decision, within this policy's bounds
  k = jnp.asarray(every_k(gradient_step))
  if k.ndim != 0 or not jnp.issubdtype(k.dtype, jnp.integer):
    raise TypeError(
      f"every_k(gradient_step) must return an integer scalar, got {k.dtype}{list(k.shape)}."
    )
  return jnp.maximum(k.astype(jnp.int32), 1)


def _first_length(every_k: EveryK) -> jax.Array:
  """The first window's length: `every_k`, the schedule's value at step 0, or `min_k`."""
  if isinstance(every_k, _noise.FollowNoiseScale):
    return jnp.asarray(every_k.min_k, jnp.int32)
  return _opening_length(every_k, jnp.zeros((), jnp.int32), None)


def next_length(
  cfg: Config, k: jax.Array, noise: Any, emitting: Any, gradient_step: jax.Array
) -> jax.Array:
  """`window_k` after this micro-step: the open window's length `k`, or, when a window closes,
  the next window's (one meaning for every `every_k`): the int, the schedule's value at the
  new `gradient_step`, or `FollowNoiseScale`'s decision from the noise statistics now (so a
  host driver reads it once per update)."""
  if isinstance(cfg.every_k, _noise.FollowNoiseScale):
    following = _noise.next_k(cfg.every_k, noise, k)
  else:
    following = _opening_length(cfg.every_k, gradient_step, None)
  return jnp.where(emitting, following, k).astype(jnp.int32)


def window_length(cfg: Config, state: AccumulateState) -> jax.Array:
  """The open window's length: the one recorded in the state when it opened, or, for a window
  that opens now, the one in force (so a state from another `every_k`, or a schedule whose
  value changes mid-window, finishes its window at the length it opened with)."""
  opening = _opening_length(cfg.every_k, state.gradient_step, state.window_k)
  return jnp.where(state.mini_step == 0, opening, state.window_k).astype(jnp.int32)


# With the noise statistics, their squared norm is the finite check (`add`). The benchmark of
# what the statistics cost (`benchmarks/_noise.py`) turns this off while it traces a "before"
# contender, the earlier spelling (a separate finite check), to time both in one run.
SQ_NORM_IS_FINITE_CHECK = True
# ... and, with emission decided on the device, where the window's ``|Σ wᵢgᵢ|²`` is read
# (`emit_dynamic`): "closing", in a conditional of its own, on the micro-step that closes the
# window; "every", before the conditionals, on every micro-step (what issue 22 first did; a
# structure test's control); "inside", in the conditional that closes the window (the
# "before" contender: XLA then copies weight matrices on every accumulating micro-step).
SUMS_SQ_READ = "closing"


def sq_norm(
  cfg: Config, grads: Any, state: Any = None, emit: bool | None = None, force_emit: Any = False
) -> jax.Array | None:
  """With the noise statistics, the micro-batch's ``Σ|g|²`` (`_noise.sq_norm`), read once: it
  is both the noise statistics' term and the finite check (`_core.finite_from_sq_norm`).
  None without them. With ``skip_nonfinite="window"``, `sampled_sq_norm` (`state`, `emit`,
  `force_emit`: where the micro-step is in its window)."""
  if not cfg.noise:
    return None
  if cfg.window_check:
    return sampled_sq_norm(cfg, grads, state, emit, force_emit)
  return _noise.sq_norm(grads, _over_shards(cfg))


def sampled_sq_norm(
  cfg: Config, grads: Any, state: AccumulateState, emit: bool | None, force_emit: Any
) -> jax.Array:
  """The noise statistics' term when each gradient is read once (``skip_nonfinite="window"``):
  only the window's last micro-batch is read, ``n·|g_n|²`` with n its micro-batches so far
  (``mini_step + 1``); the others add 0 (their weight and count still add up). ``n·w_n|g_n|²``
  is an unbiased estimate of the window's ``Σ wᵢ|gᵢ|²`` over the order of its micro-batches
  (shuffled data: the last one is each of them with probability 1/n), so T and Q stay unbiased
  (`_noise.window_stats`) with more variance. The k−1 other micro-steps never read the gradient
  a second time: with static emission (``emit=False``, `TrainStep`) their programs hold no
  read at all; with a device conditional the read sits in the branch that closes the window."""
  n = (state.mini_step + 1).astype(jnp.float32)
  zero = jnp.zeros((), jnp.float32)
  read = lambda g: _noise.sq_norm(g, _over_shards(cfg)) * n  # noqa: E731
  if emit is not None:
    return read(grads) if emit else zero
  return _collectives.cond(closes_window(cfg, state, force_emit), read, lambda g: zero, grads)


def _over_shards(cfg: Config) -> Any:
  """How per-leaf squares add up to the whole gradient's under an axis whose map has other
  axes that shard the parameters (tensor parallelism): a model shard's slice is not the whole
  leaf (`_collectives.Axis.sum_over_shards`, one scalar all-reduce over those axes, none
  without them). None without an axis."""
  return None if cfg.axis.name is None else cfg.axis.sum_over_shards


def add(
  cfg: Config,
  grads: Any,
  state: AccumulateState,
  weight: jax.Array | None,
  sq: jax.Array | None = None,
) -> tuple[Any, jax.Array, jax.Array]:
  """This micro-batch into the open window: ``(sums, total, dropped)`` for this device (`sq`:
  its `sq_norm`, which then serves as the finite check)."""
  finite = None
  if sq is not None and cfg.skip_nonfinite and SQ_NORM_IS_FINITE_CHECK:
    finite = _core.finite_from_sq_norm(sq, grads, _collectives.cond)
  if cfg.unaccumulated and not cfg.axis.stacks:
    return _core.add_one(
      grads,
      weight,
      skip_nonfinite=cfg.skip_nonfinite,
      reduction=cfg.reduction,
      accum_dtype=cfg.accum_dtype,
      finite=finite,
      agree=cfg.axis.agree,
    )
  if cfg.unaccumulated:
    # Other devices will see this gradient through the psum: mask and weigh it like any window
    # (XLA folds the zeros it starts from).
    sums, total = _core.zeros(grads, cfg.accum_dtype), jnp.zeros((), jnp.float32)
    restart = None
  else:
    # The accumulator is reset lazily: a window's first micro-step ignores what the state holds
    # (the sums of the window closed last), so the emitting step never rewrites it.
    sums = cfg.axis.this_device(state.grad_sum)
    total = cfg.axis.this_device(state.acc_weight)
    restart = state.mini_step == 0
  return _core.add(
    sums,
    total,
    grads,
    weight,
    skip_nonfinite=cfg.skip_nonfinite,
    restart=restart,
    finite=finite,
    agree=cfg.axis.agree,
    key=rounding_key(cfg, state) if cfg.rounding == "stochastic" else None,
  )


def rounding_key(cfg: Config, state: AccumulateState) -> jax.Array:
  """This micro-step's stochastic-rounding key (`_core.rounding_key`), with an axis folded with
  the device's index: each device rounds its own sums independently."""
  device = None if cfg.axis.name is None else lax.axis_index(cfg.axis.name)
  skipped = cfg.axis.this_device(state.num_skipped)
  return _core.rounding_key(state.gradient_step, skipped, state.mini_step, device)


def add_noise(
  cfg: Config,
  grads: Any,
  state: AccumulateState,
  weight: jax.Array | None,
  dropped: jax.Array,
  sq: jax.Array | None = None,
) -> Any:
  """This micro-batch's ``w|g|²`` into the open window's noise statistics (this device's part),
  or None without them. The unit of the default weight is one *global* micro-batch: under an
  axis each device adds its share of it (`_noise.piece_weight`), unless autodiff already
  reduced the gradients (each device then holds the whole micro-batch's)."""
  if not cfg.noise:
    return None
  ns = _with_partials(state.noise, cfg.axis.this_device(_noise.partials(state.noise)))
  pieces = 1 if _reduced(cfg, grads) else cfg.axis.size()
  w = _noise.piece_weight(weight, pieces)
  return _noise.add(ns, grads, w, jnp.logical_not(dropped), restart=state.mini_step == 0, sq=sq)


def _reduced(cfg: Config, grads: Any) -> bool:
  """Gradients that autodiff already all-reduced over the axis (the same on every device:
  `_collectives.ALREADY_REDUCED`)."""
  leaves = [x for x in jax.tree.leaves(grads) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return cfg.axis.stacks and _collectives.already_reduced(leaves, cfg.axis.name)


def update_types(
  cfg: Config, grads: Any, inner_state: Any, params: Any, extra_args: dict, emit: bool | None
) -> Any:
  """The inner optimizer's updates as `jax.ShapeDtypeStruct` leaves (traced abstractly, not run)."""
  extra_args = _with_figures(extra_args, inner_state, _gain.WindowFigures(*[jnp.ones(())] * 3))
  try:
    return jax.eval_shape(
      lambda g, s, p: cfg.inner.update(g, s, p, **extra_args)[0], grads, inner_state, params
    )
  except TypeError:
    if emit is not False:
      raise
    # emit=False never runs the inner optimizer, so a caller may leave out arguments only the
    # emitting step needs (e.g. `value=` for reduce_on_plateau); updates then take the
    # gradients' structure and dtypes.
    return jax.eval_shape(lambda g: g, grads)


def can_be_empty(cfg: Config, weight: jax.Array | None) -> bool:
  """Whether a closing window may hold no weight (so its inner update needs a guard)."""
  return not cfg.unaccumulated or weight is not None or cfg.skip_nonfinite


class Window(NamedTuple):
  """What a closing window works on: the operands `lax.cond` carries into its branches."""

  sums: Any  # this device's Σ wᵢ gᵢ, in the accumulator dtype
  total: jax.Array  # this device's Σ wᵢ
  inner_state: Any
  params: Any
  extra_args: dict
  noise: Any = None  # this device's noise statistics (`add_noise`), or None
  # ``Σ|sums|²`` when read before the conditional that closes the window (`emit_dynamic`), or
  # None: read where the window closes.
  sums_sq: Any = None
  # skip_nonfinite="window" on a private path: whether the window's sums are finite (a boolean
  # scalar); if not, the inner update runs on zeros (`_inner_update`). None: the sums as they are.
  finite: Any = None


class Closed(NamedTuple):
  """What a micro-step's emission (or not) gives `advance`."""

  out: Any  # the finished output (see `Finish`)
  inner_state: Any
  noise: Any  # the noise statistics: closed into the EMAs if the window closed, or None
  applied: jax.Array  # bool scalar: the inner update ran
  # bool scalar: skip_nonfinite="window" found the closing window's sums not finite, so its
  # micro-batches are dropped (`advance` counts them)
  nonfinite: jax.Array


class Finish(NamedTuple):
  """What the emitting step outputs: from the inner updates, or when nothing is applied.

  Both take the window's sums too, so that an output may reuse the accumulator's buffer.
  """

  applied: Callable[[Any, Any, Any], Any]  # (updates, params, sums) -> output
  empty: Callable[[Any, Any], Any]  # (params, sums) -> output


# `TrainStep`'s emitting program applies the updates where they are made: XLA fuses the inner
# update into the parameter update instead of materialising the updates. The sums ride
# through the conditional too: as an output of it, they need no buffer besides the
# accumulator's (as an operand only, XLA keeps a parameter-sized temporary for them).
APPLY = Finish(applied=lambda updates, params, sums: (optax.apply_updates(params, updates), sums),
               empty=lambda params, sums: (params, sums))  # fmt: skip

# The optax protocol, where the updates fit the accumulator (same tree and shapes, a dtype it
# holds exactly): the emitting step writes them over the window's sums, which are spent, so
# they need no buffer of their own; on other steps the output *is* the new sums, and the
# caller reads the updates through `where(applied, output, 0)` (see `protocol_updates`). This
# is what keeps a conditional's parameter-sized output out of the caller's temporary memory.
IN_ACCUMULATOR = Finish(
  applied=lambda updates, params, sums: optax.tree.cast_like(updates, sums),
  empty=lambda params, sums: sums,
)


def zeros_finish(types: Any) -> Finish:
  """The optax protocol otherwise: the updates, or zeros typed like them (their sharding
  included: on an Explicit mesh it is part of the type, and both branches of a conditional
  must agree on it)."""
  zeros = jax.tree.map(
    lambda t: jnp.zeros(t.shape, t.dtype, out_sharding=getattr(t.sharding, "spec", None)), types
  )
  return Finish(applied=lambda updates, params, sums: updates, empty=lambda params, sums: zeros)


def fits_accumulator(cfg: Config, types: Any, sums: Any) -> bool:
  """Whether the inner updates can be returned through the window's sums (`IN_ACCUMULATOR`):
  same tree and shapes, dtypes the sums hold exactly, and no axis name (per-device sums,
  while the updates are the same on every device)."""
  if cfg.axis.stacks or jax.tree.structure(types) != jax.tree.structure(sums):
    return False
  return all(
    t.shape == jnp.shape(s) and jnp.promote_types(t.dtype, jnp.result_type(s)) == jnp.result_type(s)
    for t, s in zip(jax.tree.leaves(types), jax.tree.leaves(sums), strict=True)
  )


def _inner_update(cfg: Config, like: Any, finish: Finish, window: Window) -> tuple[Any, ...]:
  """The window's noise statistics closed (`window` holds the global sums, total and
  partials), then the inner update on the window's mean, finished (see `Finish`); a
  `scale_by_gain` inside reads the closed statistics."""
  sums, total, inner_state, params, extra, noise, sums_sq, finite = window
  if finite is not None:  # a private window's non-finite sums: dropped, the noise still added
    sums = _core.zeros_unless(finite, sums)
  noise = _close_noise(noise, sums, total, _over_shards(cfg), sums_sq)
  extra = _with_figures(extra, inner_state, _figures(noise))
  g = _core.normalise(sums, total, like, cfg.normalisation)
  updates, new_inner = cfg.inner.update(g, inner_state, params, **extra)
  # Some optimizers return state in the gradients' dtype (adam's mu for bf16 params and f32
  # grads); the state's dtypes are fixed by init so that it stays a valid carry.
  new_inner = _collectives.keep_sharding(optax.tree.cast_like(new_inner, inner_state), inner_state)
  _collectives.check_state_variance(new_inner, inner_state, "accumulate")
  return finish.applied(updates, params, sums), new_inner, noise


def _figures(noise: Any) -> _gain.WindowFigures | None:
  """The closing window's figures for `scale_by_gain`: the smoothed T and Q including it, and
  its weight in the units of the statistics (global scalars)."""
  if noise is None:
    return None
  measured = _noise.scale(noise)
  return _gain.WindowFigures(measured.trace_cov, measured.grad_sq, noise.weight)


def _with_figures(extra: dict, inner_state: Any, figures: Any) -> dict:
  """The inner optimizer's extra arguments, with the window's figures where it has a gain."""
  if figures is None or not _gain.holds_gain(inner_state):
    return extra
  return {**extra, _gain.WINDOW_ARG: figures}


def _close_noise(
  noise: Any, sums: Any, total: jax.Array, over_shards: Any = None, sums_sq: Any = None
) -> Any:
  """The window's estimates into the noise EMAs: ``|ḡ|²`` of the mean ``Σ wᵢgᵢ / W`` from the
  sums (one more read of them, on the emitting step only, unless `sums_sq` has it)."""
  if noise is None:
    return None
  inv = 1 / jnp.where(total > 0, total, jnp.ones_like(total))
  if sums_sq is None:
    sums_sq = _noise.sq_norm(sums, over_shards)
  mean_sq = sums_sq * jnp.square(inv)
  return _noise.close(noise, mean_sq, *_noise.partials(noise))


def _no_sq(sums: Any) -> jax.Array:
  """What a window that does not close reads of its sums: nothing."""
  del sums
  return jnp.zeros((), jnp.float32)


def _no_update(finish: Finish, window: Window) -> tuple[Any, ...]:
  return finish.empty(window.params, window.sums), window.inner_state, window.noise


def close_window(
  cfg: Config, like: Any, finish: Finish, guard: bool, window: Window, reduced: bool = False
) -> Closed:
  """The emitting step: one all-reduce across devices (the sums, the total weight and the
  noise partials together), then the inner update unless the window holds no weight.
  `reduced`: `window` is global already (`TrainStep`'s emitting program with an axis, which
  reduces leaf by leaf): no all-reduce here.

  `like` (the micro-batch gradients) is read only for its dtypes and device variance.
  `guard=False` (every_k == 1, no weight, no skipping: the window cannot be empty) runs the
  inner optimizer with no conditional. The guard is a `lax.cond`, not a select: a select keeps
  the old and the new optimizer state alive together, i.e. parameter-sized copies.

  On a private path the noisy update always happens (`private_window`).
  """
  local = window.noise
  private = _checks.holds_private_state(window.inner_state)
  window = window if reduced else _global(cfg, window, like)
  # The window's sums, read once at emission (global with an axis): `Config.sums_check`
  finite = agreed(cfg, _core.all_finite(window.sums)) if cfg.sums_check else jnp.asarray(True)
  apply = functools.partial(_inner_update, cfg, like, finish)
  if private:
    window = private_window(cfg, window, finite)
  if private or not guard:
    closed = Closed(*apply(window), jnp.asarray(True), ~finite)
  else:
    applied = (window.total > 0) & finite
    empty = functools.partial(_no_update, finish)
    closed = Closed(*_collectives.cond(applied, apply, empty, window), applied, ~finite)
  # The noise partials stay this device's (spent: the next add restarts them).
  return closed._replace(noise=_with_partials(closed.noise, _noise_partials(local)))


def agreed(cfg: Config, finite: jax.Array) -> jax.Array:
  """A window's finite verdict, one across the model axes of a map (each model shard reads
  its own slice of a sharded leaf): a NaN or Inf in any slice drops the window everywhere. One
  scalar all-reduce, none where nothing varies over another axis (`_collectives.agree`)."""
  return cfg.axis.agree(finite, jnp.zeros((), jnp.float32))[0]


def _global(cfg: Config, window: Window, like: Any) -> Window:
  """The window summed across devices: its sums, total weight and noise partials in ONE
  all-reduce (`like`: the micro-batch gradients, for `reduce_window`)."""
  scalars = (window.total, _noise_partials(window.noise))
  sums = reduced_sums(cfg, window.sums)
  sums, (total, partials) = cfg.axis.reduce_window(sums, scalars, like, cfg.normalisation)
  if partials and _reduced(cfg, like):  # n copies of the same micro-batches: count them once
    partials = _noise.once(partials, cfg.axis.size())
  return window._replace(sums=sums, total=total, noise=_with_partials(window.noise, partials))


def reduced_sums(cfg: Config, sums: Any) -> Any:
  """The sums as the window's all-reduce takes them: a narrow accumulator (an explicit
  `rounding`) in float32 (`_core.wide_sums`), the global sums and their mean then float32 too
  (`advance` stores them back in the accumulator's dtypes)."""
  return _core.wide_sums(sums) if cfg.rounding is not None and cfg.axis.stacks else sums


def _noise_partials(noise: Any) -> tuple:
  return () if noise is None else _noise.partials(noise)


def _with_partials(noise: Any, partials: tuple) -> Any:
  """The noise statistics with these window partials ``(sq_sum, count, weight)``; None stays
  None."""
  if noise is None:
    return None
  return noise._replace(sq_sum=partials[0], count=partials[1], weight=partials[2])


def keep_open(finish: Finish, window: Window) -> Closed:
  """A step that applies nothing: the inner optimizer untouched."""
  return Closed(*_no_update(finish, window), jnp.asarray(False), jnp.asarray(False))


def private_window(cfg: Config, window: Window, finite: jax.Array) -> Window:
  """A closing window on a private path (a `dp_noise` in the inner state), whose noisy update
  always happens and is counted by `dp_updates`, whatever the window holds: the accountant
  counts every window, and whether an update was made must not depend on the data. A window
  whose every micro-batch was dropped makes the update of zero sums; with
  ``skip_nonfinite="window"``, so does a window whose sums are not `finite` (clipped sums
  always are: a gradient clipping did not make, or a NaN clipping did not catch): its sums are
  dropped (`_inner_update` replaces them by zeros) and its micro-batches counted in
  `num_skipped` (`advance`), as elsewhere, and the parameters stay finite."""
  return window._replace(finite=finite) if cfg.sums_check else window


def emit_dynamic(
  cfg: Config, like: Any, finish: Finish, guard: bool, window: Window, emitting: Any
) -> Closed:
  """Emission decided on the device: the inner update runs (`lax.cond`) only when it applies.

  Without an axis name the window's total is known here, so one conditional on ``emitting and
  total > 0`` decides everything; with one, the total is global only after the emitting
  step's all-reduce, so `close_window` guards the empty window inside the emitting branch.
  """
  if cfg.axis.stacks:
    close = functools.partial(close_window, cfg, like, finish, guard)
    return _collectives.cond(emitting, close, functools.partial(keep_open, finish), window)
  # On a private path the noisy update always happens and is counted (`private_window`).
  private = _checks.holds_private_state(window.inner_state)
  applies = emitting & (window.total > 0) if guard and not private else emitting
  if window.noise is not None and applies is not True and SUMS_SQ_READ != "inside":
    # ``|Σ wᵢgᵢ|²`` read in a conditional of its own, before the one that closes the window:
    # read inside that one, it keeps XLA from updating the sums in place, and its branch that
    # keeps the window open then copies three of 784-2048³-10's weight matrices on every
    # accumulating micro-step (1.13-1.18x against noise_scale=False, `benchmarks/_noise.py`).
    # Read here, the sums are read on the micro-step that closes the window only.
    if SUMS_SQ_READ == "every":
      sums_sq = _noise.sq_norm(window.sums)
    else:
      sums_sq = _collectives.cond(applies, _noise.sq_norm, _no_sq, window.sums)
    window = window._replace(sums_sq=sums_sq)
  apply = functools.partial(_inner_update, cfg, like, finish)
  empty = functools.partial(_no_update, finish)
  if cfg.sums_check:  # the sums read inside the closing branch: one conditional per micro-step
    apply = functools.partial(_apply_if_finite, cfg, private, apply, empty)
  else:
    apply = functools.partial(_finite_anyway, apply)
  if applies is True:  # every_k == 1 and nothing can empty the window: no conditional at all
    out, finite = apply(window)
  else:
    out, finite = _collectives.cond(
      applies, apply, functools.partial(_finite_anyway, empty), window
    )
  return Closed(*out, applies & (finite | private), ~finite)


def _finite_anyway(branch: Any, window: Window) -> tuple[Any, jax.Array]:
  """A branch of the closing conditional that reads no sums: its outputs, and "finite"."""
  return branch(window), jnp.asarray(True)


def _apply_if_finite(
  cfg: Config, private: bool, apply: Any, empty: Any, window: Window
) -> tuple[Any, jax.Array]:
  """The closing branch with the sums check (`Config.sums_check`): the window's sums read for
  NaN/Inf here, on the micro-step that closes the window only (on a GPU each conditional that
  runs makes the host wait for its predicate, so the check adds none per micro-step); a window
  whose sums are not finite is dropped (its micro-batches counted by `advance`), or on a
  private path its sums replaced by zeros under the noise (`private_window`). Returns the
  branch's outputs and the verdict."""
  finite = agreed(cfg, _core.all_finite(window.sums))
  if private:
    return apply(private_window(cfg, window, finite)), finite
  return _collectives.cond(finite, apply, empty, window), finite


def advance(
  cfg: Config,
  state: AccumulateState,
  sums: Any,
  total: jax.Array,
  dropped: jax.Array,
  closed: Closed,
  emitting: Any,
  in_window: jax.Array | None = None,
) -> AccumulateState:
  """The state after this micro-step (`emitting`: a bool or boolean scalar; `in_window`: the
  window's micro-batches, default ``mini_step + 1``, counted when `Config.sums_check` drops
  it)."""
  axis = cfg.axis
  skipped = axis.this_device(state.num_skipped) + jnp.asarray(dropped).astype(jnp.int32)
  applied, noise = closed.applied, closed.noise
  if cfg.sums_check:  # a window with weight whose sums were not finite: dropped whole
    whole = state.mini_step + 1 if in_window is None else in_window
    nonfinite = emitting & closed.nonfinite & (total > 0)
    skipped = skipped + jnp.where(nonfinite, whole, 0).astype(jnp.int32)
  k = window_length(cfg, state)
  gradient_step = jnp.where(
    applied, optax.safe_increment(state.gradient_step), state.gradient_step
  ).astype(jnp.int32)
  if not cfg.unaccumulated:
    sums, total = private_spent(closed.inner_state, emitting, (sums, total))
  return AccumulateState(
    mini_step=jnp.where(emitting, 0, optax.safe_increment(state.mini_step)).astype(jnp.int32),
    gradient_step=gradient_step,
    window_k=next_length(cfg, k, noise, emitting, gradient_step),
    grad_sum=no_sums(axis, sums) if cfg.unaccumulated else axis.per_device(_like(sums, state)),
    acc_weight=axis.per_device(jnp.zeros((), jnp.float32) if cfg.unaccumulated else total),
    num_skipped=axis.per_device(skipped),
    inner_state=closed.inner_state,
    updated=jnp.asarray(applied, jnp.bool_),
    noise=_per_device_noise(axis, noise),
  )


def _like(sums: Any, state: AccumulateState) -> Any:
  """The sums in the accumulator's dtypes (the global sums of a closed window may be wider:
  `reduced_sums`)."""
  return jax.tree.map(lambda s, a: s.astype(a.dtype), sums, state.grad_sum)


def private_spent(inner_state: Any, emitting: Any, tree: tuple[Any, jax.Array]) -> Any:
  """A closed window's ``(sums, weight)`` (`tree`) as the state keeps them. On a private path (a
  `dp_noise` in `inner_state`) they are the un-noised clipped sums and the realised window
  size, secret: zeroed where the window closes (`emitting`), so a state saved at a window
  boundary (a checkpoint after an update) holds none of them; one parameter-sized write per
  window. Elsewhere the spent sums stay (reset lazily by the next window's first add)."""
  if emitting is False or not _checks.holds_private_state(inner_state):
    return tree
  # Statically emitting: keep where the weight is negative, which it never is (weights are
  # refused on a private path). A constant predicate would make the zeros a constant, written
  # into a buffer of their own while the inner update still reads the sums (6 MiB more
  # temporary memory for update(emit=True) on a 1M-parameter model); a select that reads the
  # sums is done in their buffer.
  keep = jnp.logical_not(emitting) if emitting is not True else jnp.any(tree[1] < 0)
  return _core.zeros_unless(keep, tree)


def close_from_state(
  cfg: Config, state: AccumulateState, params: Any, like: Any
) -> tuple[Any, AccumulateState]:
  """`TrainStep`'s closing program: the open window closed from the state alone (its sums,
  total weight, noise partials and inner state), after its last micro-batch was added by an
  accumulating step (which counted it). Returns the new parameters (`APPLY`) and the state
  `advance` makes for an emitting step, i.e. what one step that adds and closes returns.
  `like` (the micro-batch gradients' types) is read only for dtypes and device variance.

  The window's length: `advance`'s `window_length` reads the one the accumulating step
  recorded (its mini_step is no longer 0), i.e. the length the window opened with.
  """
  axis = cfg.axis
  noise = state.noise
  if noise is not None:
    noise = _with_partials(noise, axis.this_device(_noise.partials(noise)))
  sums, total = axis.this_device(state.grad_sum), axis.this_device(state.acc_weight)
  window = Window(sums, total, state.inner_state, params, {}, noise)
  closed = close_window(cfg, like, APPLY, True, window)  # an accumulated window can be empty
  new_params, sums = closed.out
  dropped = jnp.asarray(False)  # the accumulating step counted this micro-batch
  return new_params, advance(cfg, state, sums, total, dropped, closed, True, state.mini_step)


def _per_device_noise(axis: Any, noise: Any) -> Any:
  """The noise statistics as state: their window partials per device, like `acc_weight`."""
  return _with_partials(noise, axis.per_device(_noise_partials(noise)))


def _gradient_like(params: Any) -> Any:
  """What the gradients look like: the parameters, except for `optax.lookahead`, whose
  parameters are ``LookaheadParams(fast, slow)`` and whose gradients are the fast weights'."""
  return params.fast if isinstance(params, optax.LookaheadParams) else params


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
    acc = no_sums(axis, _gradient_like(params))
  else:
    exact = cfg.rounding is not None
    acc = axis.per_device(_core.zeros(_gradient_like(params), cfg.accum_dtype, exact=exact))
  inner_state = _inner_init(cfg, params)
  if _checks.holds_private_state(inner_state):
    check_private(cfg, f"{cfg.front}.init", params, inner_state)
  if _gain.holds_gain(inner_state) and not cfg.noise:
    raise ValueError(GAIN_WITHOUT_NOISE.format(caller=f"{cfg.front}.init"))
  # Distinct arrays: a donating step (TrainStep) cannot donate one buffer twice.
  return AccumulateState(
    mini_step=jnp.zeros((), jnp.int32),
    gradient_step=jnp.zeros((), jnp.int32),
    window_k=_first_length(cfg.every_k),
    grad_sum=acc,
    acc_weight=axis.per_device(jnp.zeros((), jnp.float32)),
    num_skipped=axis.per_device(jnp.zeros((), jnp.int32)),
    inner_state=inner_state,
    updated=jnp.zeros((), jnp.bool_),
    noise=_per_device_noise(axis, _noise.init()) if cfg.noise else None,
  )


def _inner_init(cfg: Config, params: Any) -> Any:
  """The inner optimizer's initial state; inside a `shard_map`, checked for per-shard statistics
  (`_collectives.check_init_variance`)."""
  inner_state = cfg.inner.init(params)
  _collectives.check_init_variance(
    inner_state, _gradient_like(params), cfg.axis.axes, f"{cfg.front}.init"
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


def closes_window(cfg: Config, state: AccumulateState, force_emit: Any) -> jax.Array:
  """Whether this micro-step is the last of its window (or `force_emit` closes it early)."""
  k = window_length(cfg, state)
  return (state.mini_step + 1 >= k) | jnp.asarray(force_emit, jnp.bool_)


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
