"""`accumulate`'s configuration and the checks of each call, shared with `TrainStep`.

`make_config` checks the factory's arguments once into a static `Config`; `check_update` (and
`check_state`) checks one `update` call at trace time, before anything is added: the state
against this configuration (its window, accumulator dtypes, per-device axis), the gradients
against the state, the weight and the emit flags. `check_private` holds a private path to the
privacy contract. A window's length (`window_length`, `next_length`) is decided here too: the
state records the length a window opened with, and a configuration other than the one that made
the state finishes it at that length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum.batch_size import _gain, _noise
from optax_accum.core import _checks, _core
from optax_accum.core._state import AccumulateState, check_tree, gradient_like, holds_sums
from optax_accum.core._typing import AxisName, Reduction
from optax_accum.parallel import _collectives

EveryK = int | Callable[[jax.Array], Any] | _noise.FollowNoiseScale


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
  # Each micro-batch's finite check and the window's sums check pool their leaves into one
  # sum (`_core.all_finite(pooled=True)`): only where nothing is sharded (`TrainStep`'s
  # programs in the lean convention, one device).
  pool_check: bool = False

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
    """How `_window.close_window` turns the sums `_window.add` returns into the window's
    gradient: "mean" divides by the total weight, "sum" keeps them — also for a window of one
    with no accumulator, whose sums `_core.add_one` returns already normalised."""
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
  dtypes = [] if params is None else _made_dtypes(cfg, gradient_like(params))
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
    like = gradient_like(params)
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
    check_tree(grads, state.grad_sum, int(cfg.axis.stacks), "state", described)
  elif params is not None:
    check_tree(grads, gradient_like(params), 0, "params", "the tree of the parameters")
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


def first_length(every_k: EveryK) -> jax.Array:
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
