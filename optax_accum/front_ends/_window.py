"""A micro-step's work on its window: add, then close (emit) or keep open, then advance.

The pieces `accumulate`'s `update` and `TrainStep`'s programs string together, each taking
its operands explicitly::

    add (+ add_noise) → close_window (every k-th step) or keep_open → advance

* `add` — the micro-batch into the window's sums (`_core`; no accumulator when every_k == 1);
  `add_noise` — with ``noise_scale=True`` only, its ``w|g|²`` into the noise statistics;
* `close_window` — the window's sums, total weight (and noise partials) across devices in one
  all-reduce (`cfg.axis`, resolved once: `_collectives.Axis` or `NO_AXIS`), then the inner
  update unless the window is empty, *finished* (`Finish`) into updates (the optax protocol)
  or into new parameters (`TrainStep`); `emit_dynamic` decides on the device whether it runs;
* `keep_open` — a non-emitting step: no inner update at all;
* `advance` — the next `AccumulateState`, which records the open window's length
  (`_config.window_length`: a window finishes at the length it opened with).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum.batch_size import _gain, _noise
from optax_accum.core import _checks, _core
from optax_accum.core._state import AccumulateState, no_sums
from optax_accum.front_ends._config import Config, next_length, window_length
from optax_accum.parallel import _collectives

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
  elif cfg.pool_check and cfg.skip_nonfinite:
    finite = _core.all_finite(grads, pooled=True)
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
  ns = with_partials(state.noise, cfg.axis.this_device(_noise.partials(state.noise)))
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
# caller reads the updates through `where(applied, output, 0)` (see
# `_accumulate.protocol_updates`). This is what keeps a conditional's parameter-sized output
# out of the caller's temporary memory.
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
    sums_sq = None if sums_sq is None else jnp.where(finite, sums_sq, 0.0)
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
  # The window's sums, read once at emission (global with an axis): `Config.sums_check`. With
  # the noise statistics their squared norm, which the statistics read anyway, is the check.
  finite = jnp.asarray(True)
  if cfg.sums_check and window.noise is not None and SQ_NORM_IS_FINITE_CHECK:
    window = window._replace(sums_sq=_noise.sq_norm(window.sums, _over_shards(cfg)))
    finite = agreed(cfg, _core.finite_from_sq_norm(window.sums_sq, window.sums, _collectives.cond))
  elif cfg.sums_check:
    finite = agreed(cfg, _core.all_finite(window.sums, pooled=cfg.pool_check))
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
  return closed._replace(noise=with_partials(closed.noise, noise_partials(local)))


def close_leafwise(
  cfg: Config,
  grads: Any,
  state: AccumulateState,
  weight: jax.Array | None,
  window: Window,
  dropped: jax.Array,
  guard: bool,
) -> Closed:
  """The emitting program's window, global, with the sums all-reduced leaf by leaf: each
  leaf's all-reduce reads ``acc + w·g`` of that leaf only, so it can start as soon as its
  gradient exists. The scalars (total weight, drop count, noise partials) take one small
  all-reduce of their own. A per-micro-batch finite check (`skip_nonfinite=True`) reads every
  leaf, so the sums are reduced without it; if any device dropped this micro-batch, a
  conditional reduces the checked sums again (exact, rare: an update with a non-finite last
  micro-batch pays a second all-reduce)."""
  axis = cfg.axis
  # acc + w·g: without the finite check (the weight's own check is a scalar)
  optimistic = add(cfg._replace(skip_nonfinite=False), grads, state, weight)[0]
  sums = axis.reduce_leaves(reduced_sums(cfg, optimistic))
  local = window.noise
  partials = () if local is None else _noise.partials(local)
  # (one all-reduce: the drop count as float32, like the total)
  total, drops, partials = axis.reduce((window.total, dropped.astype(jnp.float32), partials))
  if cfg.skip_nonfinite:
    added = state._replace(inner_state=None, noise=None)  # what `add` reads of the state

    def checked(operands):
      g, s, w, _ = operands
      return axis.reduce_leaves(reduced_sums(cfg, add(cfg, g, s, w)[0]))

    operands = (grads, added, weight, sums)
    sums = _collectives.cond(drops > 0, checked, lambda ops: ops[-1], operands)
  noise = None if local is None else with_partials(local, partials)
  window = window._replace(sums=sums, total=total, noise=noise)
  closed = close_window(cfg, grads, APPLY, guard, window, reduced=True)
  # The noise partials stay this device's (spent: the next add restarts them).
  mine = noise_partials(local)
  return closed._replace(noise=with_partials(closed.noise, mine))


def agreed(cfg: Config, finite: jax.Array) -> jax.Array:
  """A window's finite verdict, one across the model axes of a map (each model shard reads
  its own slice of a sharded leaf): a NaN or Inf in any slice drops the window everywhere. One
  scalar all-reduce, none where nothing varies over another axis (`_collectives.agree`)."""
  return cfg.axis.agree(finite, jnp.zeros((), jnp.float32))[0]


def _global(cfg: Config, window: Window, like: Any) -> Window:
  """The window summed across devices: its sums, total weight and noise partials in ONE
  all-reduce (`like`: the micro-batch gradients, for `reduce_window`)."""
  scalars = (window.total, noise_partials(window.noise))
  sums = reduced_sums(cfg, window.sums)
  sums, (total, partials) = cfg.axis.reduce_window(sums, scalars, like, cfg.normalisation)
  if partials and _reduced(cfg, like):  # n copies of the same micro-batches: count them once
    partials = _noise.once(partials, cfg.axis.size())
  return window._replace(sums=sums, total=total, noise=with_partials(window.noise, partials))


def reduced_sums(cfg: Config, sums: Any) -> Any:
  """The sums as the window's all-reduce takes them: a narrow accumulator (an explicit
  `rounding`) in float32 (`_core.wide_sums`), the global sums and their mean then float32 too
  (`advance` stores them back in the accumulator's dtypes)."""
  return _core.wide_sums(sums) if cfg.rounding is not None and cfg.axis.stacks else sums


def noise_partials(noise: Any) -> tuple:
  return () if noise is None else _noise.partials(noise)


def with_partials(noise: Any, partials: tuple) -> Any:
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
  private path its sums replaced by zeros under the noise (`private_window`). With the noise
  statistics the window's ``|Σ wᵢgᵢ|²``, read anyway, is the check (`_core.finite_from_sq_norm`,
  exact): no second read of the sums. Returns the branch's outputs and the verdict."""
  if window.sums_sq is not None and SQ_NORM_IS_FINITE_CHECK:  # read for the noise statistics
    finite = _core.finite_from_sq_norm(window.sums_sq, window.sums, _collectives.cond)
  else:
    finite = _core.all_finite(window.sums)
  finite = agreed(cfg, finite)
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
    noise=per_device_noise(axis, noise),
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
    noise = with_partials(noise, axis.this_device(_noise.partials(noise)))
  sums, total = axis.this_device(state.grad_sum), axis.this_device(state.acc_weight)
  window = Window(sums, total, state.inner_state, params, {}, noise)
  closed = close_window(cfg, like, APPLY, True, window)  # an accumulated window can be empty
  new_params, sums = closed.out
  dropped = jnp.asarray(False)  # the accumulating step counted this micro-batch
  return new_params, advance(cfg, state, sums, total, dropped, closed, True, state.mini_step)


def per_device_noise(axis: Any, noise: Any) -> Any:
  """The noise statistics as state: their window partials per device, like `acc_weight`."""
  return with_partials(noise, axis.per_device(noise_partials(noise)))


def closes_window(cfg: Config, state: AccumulateState, force_emit: Any) -> jax.Array:
  """Whether this micro-step is the last of its window (or `force_emit` closes it early)."""
  k = window_length(cfg, state)
  return (state.mini_step + 1 >= k) | jnp.asarray(force_emit, jnp.bool_)
