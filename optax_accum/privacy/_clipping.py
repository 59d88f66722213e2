"""Per-example clipping: the sum of clipped per-example gradients of one (micro-)batch.

`clipped_grad` vmaps ``jax.grad(loss)`` over the examples of the batch arguments (each example
keeps its leading batch axis, of size 1), clips each gradient to global L2 norm ``C`` and sums
them in float32: ``Σᵢ clip_C(∇ℓᵢ)``. Its peak memory is one micro-batch of per-example
gradients, so it composes with `microbatch(..., reduction="sum")` (in one step) and, as the
gradient of `clipped_loss`, with `accumulate`/`TrainStep` (across steps): the sum over the whole
logical batch is exact whichever way it is split. The noise is `_noise.dp_noise`'s business.

What is known about the value travels with it (as jax_privacy's ``BoundedSensitivityCallable``):
the returned `ClippedGrad` carries its clip norm, its L2 sensitivity and the `microbatch`
reduction its outputs need.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum.core import _batch
from optax_accum.core._typing import ArgNums
from optax_accum.parallel import _collectives
from optax_accum.privacy import _guard

NO_BATCH = (
  "clipped_grad: {what}. Per-example clipping needs the examples: name the arguments whose "
  "leading axis is the batch with batch_argnums (default 1, as in `loss(params, batch)`)."
)


class _NotSaid:
  """`mask_argnum`'s default: not given. A clipped function must say how its batches are
  padded (`NOT_SAID` is refused, naming the two answers)."""

  def __repr__(self) -> str:
    return "<not given>"


NOT_SAID: Any = _NotSaid()

# The L2 sensitivity of a clipped sum per neighbouring relation, as a multiple of the bound on
# one example's contribution (jax_privacy's `BoundedSensitivityCallable.sensitivity`): replacing
# one example by any other moves the sum by up to 2C, by a zero one (or adding/removing one) C.
RELATIONS = {"add_or_remove_one": 1.0, "replace_special": 1.0, "replace_one": 2.0}


# Live clipped functions (`ClippedGrad`s, `clipped_loss`'s functions) by clip norm C: whether
# each rescales to unit norm. `dp_noise` reads it to catch l2_clip=C given for a rescaled sum.
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _register(fn: Any, l2_clip: float, rescale: bool) -> None:
  _LIVE[fn] = (l2_clip, rescale)


def only_rescaled(l2_clip: float) -> bool:
  """Whether the live clipped functions with clip norm `l2_clip` (one at least) all rescale to
  unit norm: then a noise scaled to `l2_clip` is that of another sum than theirs."""
  kinds = {rescale for clip, rescale in list(_LIVE.values()) if clip == l2_clip}
  return kinds == {True}


def check_relation(value: Any, caller: str) -> str:
  """The neighbouring relation's name: one of `RELATIONS`' keys, given as that string or as a
  ``dp_accounting.NeighboringRelation`` (its member name, case-insensitive)."""
  name = getattr(value, "name", value)
  if not isinstance(name, str) or name.lower() not in RELATIONS:
    raise ValueError(
      f"{caller}: neighboring_relation must be one of {sorted(RELATIONS)} (or a "
      f"dp_accounting.NeighboringRelation), got {value!r}."
    )
  return name.lower()


class ClipStats(NamedTuple):
  """What clipping saw in a batch (``return_stats=True``); for monitoring, not private."""

  num_examples: jax.Array  # shape=(), dtype=jnp.float32: real (unmasked) examples
  num_clipped: jax.Array  # shape=(), dtype=jnp.float32: real examples with ‖∇ℓᵢ‖ > C
  # shape=(B,), dtype=jnp.float32: ‖∇ℓᵢ‖ before clipping (to float32 precision from
  # min(C, 2^-30) ≈ 1e-9 up; inf past float32's largest); 0 for padding
  norms: jax.Array


STATS_REDUCTION = ClipStats("sum", "sum", "concat")


class ClipAux(NamedTuple):
  """`clipped_grad`'s per-example outputs (``has_aux``, ``return_values``, ``return_stats``):
  for monitoring, not private. A field that was not asked for is None."""

  # shape=(B,), dtype=jnp.float32: each example's loss value, computed by the forward pass
  # that the gradient needs (no second pass); 0 for padding
  values: jax.Array | None
  # the loss's aux of each example, one row each (B, ...): stacked, an axis 1 of size 1 (the
  # example's own batch axis) squeezed; rows of padding examples are 0
  aux: Any
  stats: ClipStats | None  # as `return_stats` alone returns it


class Clipped(NamedTuple):
  """One batch's clipping (`clipped_sum`): what `clipped_grad` and `clipped_loss` return."""

  value: jax.Array  # Σ of the real examples' loss values, float32
  sums: list  # Σ clip_C(∇ℓᵢ) per floating parameter array (÷ C when rescaled)
  stats: ClipStats
  values: jax.Array  # (B,) float32 per-example values, 0 for padding
  aux: Any  # per-example aux (B, ...), padding rows 0; None without has_aux


def _check_clip(l2_clip: Any, caller: str) -> float:
  if isinstance(l2_clip, bool) or not isinstance(l2_clip, int | float | np.number):
    raise TypeError(f"{caller}: l2_clip must be a positive finite number, got {l2_clip!r}.")
  if not (np.isfinite(l2_clip) and l2_clip > 0):
    raise ValueError(f"{caller}: l2_clip must be a positive finite number, got {l2_clip!r}.")
  return float(l2_clip)


def _argnums(
  batch_argnums: Any, mask_argnum: Any, caller: str
) -> tuple[tuple[int, ...], int | None]:
  if mask_argnum is NOT_SAID:  # a padded batch's mask must not be forgettable
    _guard.refuse("mask_not_said", caller)
  nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
  bad = [n for n in nums if isinstance(n, bool) or not isinstance(n, int) or n < 0]
  if bad or not nums:
    what = "is empty" if not nums else f"holds {bad}"
    raise ValueError(
      NO_BATCH.format(what=f"batch_argnums={batch_argnums!r} {what}; it needs positions >= 0")
    )
  if 0 in nums:
    raise ValueError(
      f"clipped_grad: batch_argnums={batch_argnums!r} holds 0, the parameters (the gradient "
      "is taken with respect to argument 0, which has no batch axis)."
    )
  if mask_argnum is not None and (
    isinstance(mask_argnum, bool) or not isinstance(mask_argnum, int) or mask_argnum < 1
  ):
    raise ValueError(f"clipped_grad: mask_argnum must be None or an int >= 1, got {mask_argnum!r}.")
  if mask_argnum in nums:
    raise ValueError(
      f"clipped_grad: mask_argnum={mask_argnum} is also in batch_argnums={nums}; the mask is "
      "its own argument (it is not passed to the loss)."
    )
  return nums, mask_argnum


def _batch_size(args: Sequence[Any], nums: tuple[int, ...]) -> int:
  """The examples' count: every leaf of every batch argument has it as its leading size.
  `nums` are positions in the loss's arguments; `args` its arguments after the parameters."""
  if max(nums) > len(args):
    raise ValueError(
      NO_BATCH.format(what=f"batch_argnums={nums}, but the loss got {len(args) + 1} arguments")
    )
  sizes = {}
  for n in nums:
    for path, leaf in jax.tree_util.tree_leaves_with_path(args[n - 1]):
      where = f"argument {n}{jax.tree_util.keystr(path)}"
      sizes[where] = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
  if not sizes:
    raise ValueError(NO_BATCH.format(what=f"the batch arguments {nums} hold no arrays"))
  if len(set(sizes.values())) != 1 or None in sizes.values():
    shown = ", ".join(f"{w}: {s}" for w, s in sizes.items())
    raise ValueError(f"clipped_grad: the batch leaves' leading sizes differ ({shown}).")
  return next(iter(sizes.values()))


def _real(mask: Any, size: int) -> jax.Array:
  """The mask as a boolean (B,) array: nonzero entries are real examples."""
  if mask is None:
    return jnp.ones((size,), bool)
  mask = jnp.asarray(mask)
  if mask.shape != (size,):
    raise ValueError(
      f"clipped_grad: the mask must have shape ({size},), one entry per example, got "
      f"{mask.dtype}{list(mask.shape)}."
    )
  return mask != 0


# The per-example norm without overflow or underflow. The plain sum of squares (one pass, as
# fast as before) is used where it is a normal float. Where it overflows (‖g‖ ≥ 2^64 ≈ 1.8e19)
# the squares are summed again scaled down by _HI, and where it is tiny (‖g‖ < 2^-30) scaled up
# by _LO (powers of two: exact scalings) — but only when C is that small too, since a gradient
# below C is not clipped and its norm's precision does not matter. That second pass runs under
# a `lax.cond`, only for a batch that holds such an example. So every finite gradient's norm
# is known to float32 precision as ``r / f`` (``r = ‖g‖·f``, ``f`` the scale used), and its
# clipped value is computed as ``((g·f)·(1/r))·C``, the unit vector g/‖g‖ times C: each factor
# and product in range even where ‖g‖ itself, or C/‖g‖, is not a normal float32.
_HI = 2.0**-80
_LO = 2.0**64
_TINY = 2.0**-60  # a plain sum of squares below this is imprecise (‖g‖ < 2^-30)

MIXES_EXAMPLES = (
  "clipped_grad: the loss has a `{prim}` over {axes}, an axis the examples are split over (the "
  "batch varies over it). Its transpose sums cotangents from the other devices of that axis, so "
  "each 'per-example' gradient would hold other devices' examples, and clipping it would not "
  "bound one example's contribution. This is what a shard_map FSDP layout does when its "
  "parameters are gathered over the axis the batch is split over. Run such a layout under "
  "plain `jax.jit` (GSPMD keeps per-example gradients per example), or shard the parameters "
  "over an axis the batch is not split over (a model axis: the clipping norm is then summed "
  "across its shards)."
)
# Collectives whose transpose brings another device's cotangent into this one's gradient.
_MIXING = frozenset({"all_gather", "reduce_scatter", "all_to_all", "ppermute"})
# Reductions whose forward value brings other devices' values into this one's (a `pmean` is a
# `psum` divided by the axis size).
_REDUCING = frozenset({"psum", "psum_invariant", "psum2", "pmax", "pmin"})
_SAID = {p: "psum (or pmean)" for p in ("psum", "psum_invariant", "psum2")} | {
  "pmax": "pmax",
  "pmin": "pmin",
}


def _is_param(x: Any) -> bool:
  """A leaf the gradient is taken with respect to: a floating array (as `eqx.is_inexact_array`)."""
  return _batch.is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _axes_of(tree: Any) -> frozenset:
  """The mapped axes any leaf of `tree` varies over (empty outside shard_map)."""
  return frozenset().union(*(_collectives.vma(x) for x in jax.tree.leaves(tree)))


def _collectives_in(jaxpr: Any) -> set[tuple[str, tuple[str, ...]]]:
  """``(primitive, axes)`` of the cross-device primitives of a jaxpr and its sub-jaxprs."""
  found = set()
  for eqn in jaxpr.eqns:
    axes = eqn.params.get("axis_name", eqn.params.get("axes"))
    if axes is not None and eqn.primitive.name in _MIXING | _REDUCING:
      found.add((eqn.primitive.name, tuple(axes) if isinstance(axes, tuple | list) else (axes,)))
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple | list) else (value,):
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
        if hasattr(inner, "eqns"):
          found |= _collectives_in(inner)
  return found


def _check_no_mixing(loss, params, args, batch_axes: frozenset) -> None:
  """Raises MIXES_EXAMPLES if the loss moves values across an axis the examples are split
  over (traced once more, abstractly: the check costs no compiled work)."""
  jaxpr = jax.make_jaxpr(loss)(params, *args).jaxpr
  for prim, axes in sorted(_collectives_in(jaxpr)):
    hit = tuple(a for a in axes if a in batch_axes)
    if hit:
      if prim in _REDUCING:
        text = _guard.REFUSED["batch_statistic"]
        raise ValueError(text.format(caller="clipped_grad", prim=_SAID[prim], axes=hit))
      raise ValueError(MIXES_EXAMPLES.format(prim=prim, axes=hit))


def _magnitudes(g: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
  """``|g|`` in (at least) float32, and the axes of one example (axis 0 the examples)."""
  return jnp.abs(g).astype(jnp.promote_types(jnp.finfo(g.dtype).dtype, jnp.float32)), tuple(
    range(1, g.ndim)
  )


def _plain_squares(g: jax.Array) -> jax.Array:
  """``Σ g²`` of each example's leaf: (B,)."""
  x, axes = _magnitudes(g)
  return jnp.sum(x * x, axes)


def _scaled_squares(g: jax.Array) -> jax.Array:
  """``[Σ (g·_HI)², Σ (g·_LO)²]`` of each example's leaf, in one read: (B, 2)."""
  x, axes = _magnitudes(g)
  zero = jnp.zeros((), x.dtype)
  high, low = lax.reduce(
    (jnp.square(x * _HI), jnp.square(x * _LO)),
    (zero, zero),
    lambda a, b: (a[0] + b[0], a[1] + b[1]),
    axes,
  )
  return jnp.stack([high, low], axis=-1)


def _scaled_norms(
  grads: list, real: jax.Array, batch_axes: frozenset, l2_clip: float
) -> tuple[jax.Array, jax.Array]:
  """``(r, f)``: each example's global gradient norm as ``‖gᵢ‖ = rᵢ / fᵢ`` (see `_HI`).

  The norm is over every parameter: inside `shard_map` a leaf that varies over a mapped axis
  the batch does not vary over (a model axis: that leaf is one shard of the example's
  gradient) has its squares summed over that axis; a replicated leaf counts once.
  """
  if not grads:
    raise ValueError("clipped_grad: the parameters hold no floating arrays to differentiate.")
  data_axes = tuple(sorted(batch_axes))
  plain = _collectives.sum_over_shards([_plain_squares(g) for g in grads], grads, data_axes)
  finite = jnp.isfinite(plain)
  low_matters = l2_clip < 2.0**-30  # else a tiny gradient is below C: not clipped
  normal = finite & ((plain >= _TINY) | (not low_matters))
  # The second pass, for a batch with an example whose plain sum is not normal (a NaN too: it
  # is then dropped). Padding is left out: its rows may hold anything.
  redo = jnp.any(real & ~normal)
  zeros = lambda gs: [jnp.zeros((g.shape[0], 2), _magnitudes(g)[0].dtype) for g in gs]  # noqa: E731
  parts = _collectives.cond(redo, lambda gs: [_scaled_squares(g) for g in gs], zeros, grads)
  both = _collectives.sum_over_shards(parts, grads, data_axes)
  high, low = both[..., 0], both[..., 1]
  r = jnp.sqrt(jnp.where(normal, plain, jnp.where(finite, low, high)))
  f = jnp.where(normal, 1.0, jnp.where(finite, _LO, _HI)).astype(r.dtype)
  return r, f


class Params(NamedTuple):
  """The parameters split for differentiation: the floating arrays, and how to put them back."""

  arrays: list  # the leaves the gradient is taken with respect to
  rebuild: Callable[[list], Any]  # arrays -> the parameters (other leaves held as they were)
  tree_of: Callable[
    [list], Any
  ]  # one value per array -> a tree like the parameters, None elsewhere


def split_params(params: Any) -> Params:
  """The floating arrays of `params` (as `eqx.is_inexact_array`): an Equinox module's functions,
  integer arrays and static fields are held as they are, not differentiated."""
  leaves, treedef = jax.tree.flatten(params)
  which = [_is_param(x) for x in leaves]

  def rebuild(arrays):
    it = iter(arrays)
    return treedef.unflatten([next(it) if w else x for x, w in zip(leaves, which, strict=True)])

  def tree_of(values):
    it = iter(values)
    return treedef.unflatten([next(it) if w else None for w in which])

  return Params([x for x, w in zip(leaves, which, strict=True) if w], rebuild, tree_of)


def like_params(sums: list, arrays: list) -> list:
  """Each clipped sum reduced over the mapped axes its parameter is replicated over (the
  batch's axes, where the parameters were made varying to keep each example's gradient its
  own): the variance `jax.grad` with respect to the given parameters would have."""
  out = []
  for g, p in zip(sums, arrays, strict=True):
    extra = tuple(sorted(_collectives.vma(g) - _collectives.vma(p)))
    out.append(lax.psum(g, extra) if extra else g)
  return out


class Options(NamedTuple):
  """`clipped_grad`'s and `clipped_loss`'s static options, checked."""

  l2_clip: float
  nums: tuple[int, ...]  # batch_argnums
  mask_argnum: int | None
  has_aux: bool = False  # the loss returns (value, aux)
  rescale: bool = False  # rescale_to_unit_norm: each clipped gradient ÷ C (bound 1)
  shared: tuple[int, ...] = ()  # shared_argnums: passed whole to every example, on purpose
  caller: str = "clipped_grad"  # the factory, named in errors

  @property
  def shared_outer(self) -> tuple[int, ...]:
    """`shared` as positions of the returned function's arguments (the mask inserted)."""
    m = self.mask_argnum
    return tuple(n + 1 if m is not None and n >= m else n for n in self.shared)


def clipped_sum(loss, opts: Options, params, args) -> Clipped:
  """One batch's `Clipped`: Σ real values, [Σ clip_C(∇ℓᵢ) per array], ClipStats, and the
  per-example values and aux; `params` a `Params`; `args` are the loss's arguments after the
  parameters, with the mask (if any) still at `opts.mask_argnum`.

  Inside `shard_map` the parameters are made device-varying over the batch's axes first, so
  that each example's gradient stays its own (no all-reduce inside the per-example vmap): the
  sums are the device's own (`like_params` reduces them as `jax.grad` would).
  """
  l2_clip, nums, mask_argnum = opts.l2_clip, opts.nums, opts.mask_argnum
  _guard.check_variance(opts.caller)
  args = list(args)
  if mask_argnum is not None and mask_argnum > len(args):
    raise TypeError(
      f"{opts.caller}: the batch's mask is argument {mask_argnum} (right after the batch "
      f"arguments), but only {len(args)} argument(s) came after the parameters. Pass the "
      "rows with their mask, step(params, state, *batch.take(x, y, microbatch=i)), never the "
      "rows alone (padding rows would count as examples); mask_argnum=None for a batch with "
      "no padding."
    )
  mask = args.pop(mask_argnum - 1) if mask_argnum is not None else None
  size = _batch_size(args, nums)
  batch = [args[n - 1] for n in nums]
  # An argument passed whole to every example with the batch's leading size (the labels of
  # `loss(params, x, y)` left out of batch_argnums) would reach every per-example gradient.
  _guard.check_unsplit(
    opts.caller, "example", (None, *args), nums, set(opts.shared), size, jax.tree.leaves(batch),
    nums,
  )  # fmt: skip
  # The same held by the loss itself (captured by a closure, bound by functools.partial).
  _guard.check_captured(opts.caller, "example", loss, size, jax.tree.leaves(batch), args)
  real = _real(mask, size)
  batch_axes = _axes_of(batch + [real])

  diff = params.arrays
  local = [_collectives._pcast(x, batch_axes) for x in diff]

  def example_loss(d, *xs):
    xs = [jax.tree.map(lambda v: v[None], a) if n + 1 in nums else a for n, a in enumerate(xs)]
    return loss(params.rebuild(d), *xs)

  if batch_axes:
    one = [jax.tree.map(lambda v: v[0], a) if n + 1 in nums else a for n, a in enumerate(args)]
    _check_no_mixing(example_loss, local, one, batch_axes)

  in_axes = (None, *[0 if n + 1 in nums else None for n in range(len(args))])
  per_example = jax.vmap(jax.value_and_grad(example_loss, has_aux=opts.has_aux), in_axes=in_axes)
  try:
    values, grads = per_example(local, *args)
  except TypeError as e:
    if "scalar-output" not in str(e):
      raise
    whole = jax.eval_shape(lambda d: loss(params.rebuild(d), *args), diff)
    shape = getattr(whole[0] if opts.has_aux else whole, "shape", None)
    raise TypeError(
      f"{opts.caller}: the loss must return a scalar for a batch (a mean or a sum over its "
      f"examples; it is given one example at a time), and it returned shape {shape} for "
      f"this batch of {size}: reduce it, e.g. return jnp.mean(losses)."
    ) from None
  values, aux = values if opts.has_aux else (values, None)
  r, f = _scaled_norms(grads, real, batch_axes, l2_clip)
  # A non-finite gradient would carry an unbounded (NaN) contribution: it counts as 0.
  keep = real & jnp.isfinite(r)
  clip = keep & (jnp.asarray(l2_clip, r.dtype) / r < 1 / f)  # ‖g‖ > C (C/r: 0 or inf is fine)
  inv_r = jnp.where(clip, 1 / r, 1.0)

  def clipped_total(g, p):
    acc = jnp.promote_types(g.dtype, jnp.float32)
    shape = (-1,) + (1,) * (g.ndim - 1)
    g = g.astype(acc)
    # (g·f)·(1/r) = g/‖g‖, each factor and product in range; then times C (rescaled: times
    # 1, and an unclipped gradient ÷ C, of norm ≤ 1).
    unit = (g * f.reshape(shape).astype(acc)) * inv_r.reshape(shape).astype(acc)
    if opts.rescale:
      out = jnp.where(clip.reshape(shape), unit, g / jnp.asarray(l2_clip, acc))
    else:
      out = jnp.where(clip.reshape(shape), unit * jnp.asarray(l2_clip, acc), g)
    # At least float32 (a bfloat16 parameter's sum too): rounded to the parameter's dtype
    # only after the noise (`dp_noise` adds it in float32; `apply_updates` casts).
    return jnp.sum(jnp.where(keep.reshape(shape), out, 0), axis=0).astype(
      jnp.promote_types(jnp.result_type(p), jnp.float32)
    )

  sums = [clipped_total(g, p) for g, p in zip(grads, diff, strict=True)]
  norms = jnp.where(real, r / f, 0.0)
  count = jnp.sum(real, dtype=jnp.float32)
  stats = ClipStats(count, jnp.sum(norms > l2_clip, dtype=jnp.float32), norms)
  values = jnp.where(real, jnp.asarray(values, jnp.float32), 0.0)
  return Clipped(jnp.sum(values), sums, stats, values, _zero_padding(aux, real))


def _zero_padding(aux: Any, real: jax.Array) -> Any:
  """The per-example aux with the padding examples' rows set to 0 (None stays None), and an
  axis 1 of size 1 squeezed: an example's ``(1, ...)`` output (its batch axis of size 1) gives
  ``(B, ...)`` rows, as jax_privacy's ``clipped_grad`` returns them."""

  def zero(x):
    x = jnp.asarray(x)
    if x.ndim >= 2 and x.shape[1] == 1:
      x = x[:, 0]
    return jnp.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))

  return None if aux is None else jax.tree.map(zero, aux)


@dataclasses.dataclass(frozen=True)
class ClippedGrad:
  """`clipped_grad`'s result: a callable that carries its clip norm and sensitivity."""

  fun: Callable[..., Any]
  l2_clip: float
  return_stats: bool
  has_aux: bool = False
  return_values: bool = False
  rescale_to_unit_norm: bool = False
  mask_argnum: int | None = None  # where the returned function takes the mask (`microbatch`)
  # where it takes arguments passed whole to every example on purpose (`shared_argnums`)
  shared_argnums: tuple[int, ...] = ()

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.fun(*args, **kwargs)

  @property
  def l2_norm_bound(self) -> float:
    """The bound on one example's contribution to the sum: ``C``, or 1 with
    `rescale_to_unit_norm` (each clipped gradient divided by ``C``). `dp_noise` given this
    function scales its noise to it."""
    return 1.0 if self.rescale_to_unit_norm else self.l2_clip

  @property
  def reduction(self) -> Any:
    """The `microbatch` reduction of this function's outputs: ``"sum"`` for the gradient;
    with per-example outputs ``("sum", ClipAux("concat", "concat", STATS_REDUCTION))`` (rows
    in batch order; counts summed), or ``("sum", STATS_REDUCTION)`` with `return_stats` alone."""
    if self.has_aux or self.return_values:
      stats = STATS_REDUCTION if self.return_stats else None
      values = "concat" if self.return_values else None
      return ("sum", ClipAux(values, "concat" if self.has_aux else None, stats))
    return ("sum", STATS_REDUCTION) if self.return_stats else "sum"

  def sensitivity(self, neighboring_relation: Any = "add_or_remove_one") -> float:
    """The L2 sensitivity of the clipped sum (what the Gaussian mechanism's noise is scaled to).

    Args:
      neighboring_relation: "add_or_remove_one" (one example added or removed: ``C``),
        "replace_special" (one example replaced by a zero one: ``C``) or "replace_one" (one
        replaced by any other: ``2C``); or a ``dp_accounting.NeighboringRelation``. ``C`` is
        `l2_norm_bound` (1 with `rescale_to_unit_norm`).

    Returns:
      The sensitivity, a Python float.

    Raises:
      ValueError: for another relation.

    >>> import jax.numpy as jnp
    >>> from optax_accum import privacy
    >>> clipped = privacy.clipped_grad(lambda w, x: jnp.mean(x @ w), 0.5, mask_argnum=None)
    >>> clipped.sensitivity("replace_one")
    1.0
    """
    return RELATIONS[check_relation(neighboring_relation, "sensitivity")] * self.l2_norm_bound


def _shared(shared_argnums: Any, nums: tuple[int, ...], caller: str) -> tuple[int, ...]:
  """`shared_argnums` checked: positions >= 1 of the loss's arguments, none a batch argument."""
  shared = (shared_argnums,) if isinstance(shared_argnums, int) else tuple(shared_argnums)
  bad = [n for n in shared if isinstance(n, bool) or not isinstance(n, int) or n < 1]
  if bad:
    raise ValueError(
      f"{caller}: shared_argnums must be positions >= 1 of the loss's arguments, got "
      f"{shared_argnums!r}."
    )
  both = sorted(set(shared) & set(nums))
  if both:
    raise ValueError(
      f"{caller}: shared_argnums={shared_argnums!r} and batch_argnums={nums} both hold {both}: "
      "an argument is either split per example or passed whole to every example."
    )
  return tuple(shared)


def _options(
  caller: str, loss: Any, l2_clip: Any, batch_argnums, mask_argnum, shared_argnums, **flags
) -> Options:
  """The options, checked: the loss callable, C, the argnums and the boolean flags."""
  if not callable(loss):
    raise TypeError(f"{caller}: loss must be callable, got {loss!r}.")
  l2_clip = _check_clip(l2_clip, caller)
  nums, mask_argnum = _argnums(batch_argnums, mask_argnum, caller)
  shared = _shared(shared_argnums, nums, caller)
  for name, value in flags.items():
    if not isinstance(value, bool | np.bool_):
      raise TypeError(f"{caller}: {name} must be a bool, got {value!r}.")
  return Options(
    l2_clip, nums, mask_argnum, bool(flags.get("has_aux")), bool(flags["rescale_to_unit_norm"]),
    shared, caller,
  )  # fmt: skip


def clipped_grad(
  loss: Callable[..., Any],
  l2_clip: float,
  *,
  batch_argnums: ArgNums = 1,
  mask_argnum: int | None = NOT_SAID,
  shared_argnums: ArgNums = (),
  has_aux: bool = False,
  return_values: bool = False,
  rescale_to_unit_norm: bool = False,
  return_stats: bool = False,
) -> ClippedGrad:
  """The sum of per-example clipped gradients, ``Σᵢ clip_C(∇ loss(params, *exampleᵢ))``.

  ``clip_C(g) = g · min(1, C / ‖g‖)``, with ``‖g‖`` the global L2 norm over all parameters,
  computed in float32. Each example is passed to `loss` with its leading batch axis kept, of
  size 1 (jax_privacy's ``keep_batch_dim=True``), so a loss written for a batch works as it is.
  The gradient is taken with respect to argument 0 and summed in float32, and returned in at least
  float32 (a bfloat16 parameter's sum too: rounding it before the noise would move the update by
  more than ``C/B``; `dp_noise` adds the noise in float32 and ``optax.apply_updates`` casts the
  noisy update to the parameter's dtype). An example whose gradient is not finite contributes 0
  (an unbounded contribution would void the guarantee). Padding examples (mask 0) contribute
  exactly 0. The norm is computed without overflow or underflow: any finite gradient longer than
  ``C`` contributes ``C·g/‖g‖`` (an exploding one too).

  The gradient is taken with respect to the floating arrays of the parameters; other leaves (an
  Equinox module's activation functions, integer arrays) are held as they are and get None in
  the result, as ``eqx.filter_grad`` gives. Every layout: under plain `jax.jit` (a sharded
  parameter is a global array); inside `shard_map`, the parameters are made device-varying over
  the axes the batch varies over (so each example's gradient stays its own) and the squares of
  a leaf that varies over another mapped axis (a model shard) are summed over it, so the norm
  is the global one across model shards; the result has the variance of the given parameters,
  as `jax.grad`'s would.

  Compose it with `microbatch` for a logical batch larger than one micro-batch, e.g.
  ``microbatch(clipped_grad(loss, C, mask_argnum=...), k, reduction="sum")``; the memory is one
  micro-batch of per-example gradients. Across steps, use `clipped_loss` with
  `accumulate`/`TrainStep`.

  Args:
    loss: ``loss(params, *args) -> scalar`` (``-> (scalar, aux)`` with `has_aux`), the loss
      of a batch (here: of one example).
    l2_clip: ``C``, the clip norm, a positive finite number.
    batch_argnums: the positions (in ``loss``'s arguments, >= 1) of the pytrees whose leaves'
      leading axis is the batch; all must have the same leading size ``B``.
    mask_argnum: required: how the batches are padded. An int: the position of one more
      argument of the returned function (not passed to `loss`), a ``(B,)`` array, nonzero for
      real examples and 0 for padding (`PoissonSampler`'s batches are padded with copies of
      example 0: ``PoissonBatch.take(x, y)`` gives the rows and this mask together). In a
      `microbatch`, name it in `batch_argnums` there so that it is split with the batch.
      None: the batches have no padding (every row a real example), said deliberately;
      `microbatch(num_real_microbatches=...)` and `TrainStep(force_emit=True)` (padded
      batches) refuse it. Not given: refused (a forgotten mask lets each padding row count as
      example 0).
    shared_argnums: positions (in `loss`'s arguments, >= 1) of arguments passed whole to every
      example on purpose: the same for every example, though their leading size may be the
      batch's. Any other argument with the batch's leading size raises (at the first call): the
      labels of ``loss(params, x, y)`` left out of `batch_argnums` would reach every example's
      gradient. So does an array with that size that `loss` holds without taking it as an
      argument (captured by a closure, bound by `functools.partial`, a global it reads): pass
      it as an argument, here if it is shared.
    has_aux: `loss` returns ``(value, aux)``; each example's aux is returned (``ClipAux.aux``,
      one row per example, padding rows 0): stacked along a new leading axis, whose next axis
      is dropped where it has size 1 (the example's batch axis: its ``(1, 10)`` logits come
      back ``(B, 10)``, as jax_privacy's ``clipped_grad`` gives them; a scalar gives ``(B,)``).
    return_values: also return each example's loss value (``ClipAux.values``, ``(B,)``
      float32, 0 for padding), from the forward pass the gradient already runs: logging the
      loss costs no second pass. Their sum over the real examples is the batch's summed loss.
    rescale_to_unit_norm: divide each clipped gradient by ``C``, so one example contributes
      at most norm 1 whatever ``C`` is (the sensitivity is 1, jax_privacy's option of the same
      name; the learning rate no longer moves with ``C``, arXiv:2204.13650). Pass this function
      itself as `dp_noise`'s ``l2_clip`` and its noise follows (``σ·1``); a number there must
      then be 1.
    return_stats: also return a `ClipStats` (real examples, clipped examples, per-example
      norms) for monitoring.

  Returns:
    A `ClippedGrad`: called like `loss` (plus the mask), it returns the clipped sum, a pytree
    like the parameters; with `has_aux` or `return_values` ``(clipped sum, ClipAux(values,
    aux, stats))`` (a field not asked for is None); with `return_stats` alone ``(clipped sum,
    ClipStats)``. The per-example outputs are not privatised: do not release them. Its
    ``.reduction`` is what `microbatch` needs for these outputs, ``.l2_norm_bound`` one
    example's bound (``C``, or 1 rescaled) and ``.sensitivity()`` the L2 sensitivity of the sum.

  Raises:
    TypeError, ValueError: for an `l2_clip` that is not a positive finite number, empty or
      negative `batch_argnums` (or one naming the parameters), a `mask_argnum` not given (or
      not None or an int >= 1), a flag that is not a bool; at call time, for batch arguments
      that are missing, hold no arrays or disagree on the batch size, a mask of the wrong
      shape, parameters without a floating array, an argument that is not split but has the
      batch's leading size (not in `shared_argnums`), inside a map without device-variance
      types (``shard_map(check_vma=False)``, ``pmap``), or (inside `shard_map`) a loss that gathers
      or permutes values over an axis the examples are split over (FSDP written by hand:
      per-example gradients would mix examples).

  >>> import jax.numpy as jnp, optax_accum
  >>> loss = lambda w, x: jnp.mean(x @ w)  # per-example gradient: the example x itself
  >>> g = optax_accum.privacy.clipped_grad(loss, 1.0, mask_argnum=None)  # batches not padded
  >>> g(jnp.zeros(2), jnp.array([[3.0, 4.0], [0.3, 0.4]]))  # norms 5 → clipped to 1, and 0.5
  Array([0.90000004, 1.2       ], dtype=float32)
  >>> g.sensitivity()
  1.0
  >>> g = optax_accum.privacy.clipped_grad(loss, 1.0, mask_argnum=None, return_values=True)
  >>> _, aux = g(jnp.ones(2), jnp.array([[3.0, 4.0], [0.3, 0.4]]))
  >>> [round(float(v), 4) for v in aux.values]  # each example's loss, from the same pass
  [7.0, 0.7]
  """
  opts = _options(
    "clipped_grad", loss, l2_clip, batch_argnums, mask_argnum, shared_argnums, has_aux=has_aux,
    return_values=return_values, rescale_to_unit_norm=rescale_to_unit_norm,
    return_stats=return_stats,
  )  # fmt: skip
  extras = bool(has_aux or return_values)

  def fun(params: Any, *args: Any) -> Any:
    split = split_params(params)
    out = clipped_sum(loss, opts, split, args)
    grads = split.tree_of(like_params(out.sums, split.arrays))
    if extras:
      values = out.values if return_values else None
      return grads, ClipAux(values, out.aux, out.stats if return_stats else None)
    return (grads, out.stats) if return_stats else grads

  out = ClippedGrad(
    fun, opts.l2_clip, bool(return_stats), opts.has_aux, bool(return_values), opts.rescale,
    opts.mask_argnum, opts.shared_outer,
  )  # fmt: skip
  _register(out, opts.l2_clip, opts.rescale)
  return out


def clipped_loss(
  loss: Callable[..., Any],
  l2_clip: float,
  *,
  batch_argnums: ArgNums = 1,
  mask_argnum: int | None = NOT_SAID,
  shared_argnums: ArgNums = (),
  has_aux: bool = False,
  rescale_to_unit_norm: bool = False,
) -> Callable[..., Any]:
  """A loss whose gradient is `clipped_grad`'s clipped sum: DP for `TrainStep`/`accumulate`.

  Its value is ``Σᵢ loss(params, *exampleᵢ)`` over the real examples (the per-example values
  come from the forward pass the gradient needs: ``jax.value_and_grad`` of it runs the loss
  once); its gradient with respect to argument 0 (a custom VJP) is ``Σᵢ clip_C(∇ℓᵢ)``,
  computed in the forward pass. So any front end that takes a loss and calls `jax.grad` on it
  accumulates clipped sums, e.g. ``TrainStep(clipped_loss(loss, C, mask_argnum=...),
  optax.chain(dp_noise(...), optax.sgd(lr)), every_k=k, reduction="sum")``. Only argument 0 is
  differentiable.

  With `has_aux` it returns ``(value, aux)``, each example's aux one row of `aux` (as
  `clipped_grad`'s ``ClipAux.aux``), from the same forward pass: differentiate it with
  ``jax.value_and_grad(f, has_aux=True)`` or ``TrainStep(f, ..., has_aux=True)`` (with
  ``axis_name``, the devices' rows joined in the batch's order). In `microbatch` name the
  reduction, the rows "concat": ``reduction=(("sum", "concat"), "sum")`` for
  ``jax.value_and_grad(f, has_aux=True)``.

  Args:
    loss: as for `clipped_grad`.
    l2_clip: as for `clipped_grad`.
    batch_argnums: as for `clipped_grad`.
    mask_argnum: as for `clipped_grad`.
    shared_argnums: as for `clipped_grad`.
    has_aux: `loss` returns ``(value, aux)``; `f` then returns ``(Σᵢ valueᵢ, aux)`` with each
      example's aux stacked as `clipped_grad`'s (one row each, an axis 1 of size 1 dropped,
      padding rows 0): not privatised, do not release it.
    rescale_to_unit_norm: as for `clipped_grad`: the gradient is ``Σᵢ clip_C(∇ℓᵢ) / C``
      (the value is not rescaled). Give the returned function to `dp_noise` as ``l2_clip``.

  Returns:
    ``f(params, *args) -> scalar`` (``-> (scalar, aux)`` with `has_aux`) with the custom
    gradient; ``f.l2_norm_bound`` is one example's bound (``C``, or 1 rescaled), as
    `ClippedGrad`'s, and ``f.has_aux`` says whether it returns an aux.

  Raises:
    TypeError, ValueError: as `clipped_grad` (a `has_aux` that is not a bool: TypeError);
      when differentiated, for a parameter narrower than float32 (bfloat16, float16): its
      gradient would be the clipped sum rounded to that dtype before the noise. Keep float32
      parameters and cast them inside the loss, or use ``microbatch(clipped_grad(...))``.

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> loss = lambda w, x: jnp.mean(x @ w)
  >>> f = optax_accum.privacy.clipped_loss(loss, 1.0, mask_argnum=None)
  >>> jax.grad(f)(jnp.zeros(2), jnp.array([[3.0, 4.0], [0.3, 0.4]]))
  Array([0.90000004, 1.2       ], dtype=float32)
  >>> g = optax_accum.privacy.clipped_loss(
  ...   lambda w, x: (loss(w, x), x @ w), 1.0, mask_argnum=None, has_aux=True)
  >>> (value, rows), grads = jax.value_and_grad(g, has_aux=True)(
  ...   jnp.ones(2), jnp.array([[3.0, 4.0], [0.5, 0.25]]))
  >>> rows  # each example's aux (its x @ w), one row each
  Array([7.  , 0.75], dtype=float32)
  """
  opts = _options(
    "clipped_loss", loss, l2_clip, batch_argnums, mask_argnum, shared_argnums, has_aux=has_aux,
    rescale_to_unit_norm=rescale_to_unit_norm,
  )  # fmt: skip

  def f(params: Any, *args: Any) -> Any:
    split = split_params(params)
    clipped = lambda arrays: clipped_sum(loss, opts, split._replace(arrays=arrays), args)  # noqa: E731

    # The value (and with has_aux its per-example aux, which no gradient flows through) from
    # the one forward pass that also clips the per-example gradients.
    @jax.custom_vjp
    def value(arrays):
      out = clipped(arrays)
      return (out.value, out.aux) if opts.has_aux else out.value

    def fwd(arrays):
      # The gradient has each parameter's dtype (a custom VJP must): narrower than float32,
      # each clipped sum is rounded before the noise, on every front end (and a cast up after
      # this cannot undo it), so the gradient of narrow parameters is refused here.
      _guard.check_grads(opts.caller, arrays)
      out = clipped(arrays)
      primal = (out.value, out.aux) if opts.has_aux else out.value
      return primal, (out.sums, arrays)

    def bwd(res, ct):
      sums, arrays = res
      ct = ct[0] if opts.has_aux else ct  # the aux's cotangent is not the loss's
      # The cotangent of each parameter has its dtype (a custom VJP must): at least float32
      # (`fwd` refuses narrower parameters).
      scaled = [(ct * g).astype(jnp.result_type(p)) for g, p in zip(sums, arrays, strict=True)]
      return (like_params(scaled, arrays),)

    value.defvjp(fwd, bwd)
    return value(split.arrays)

  f.l2_norm_bound = 1.0 if opts.rescale else opts.l2_clip  # type: ignore[attr-defined]
  f.mask_argnum = opts.mask_argnum  # type: ignore[attr-defined]
  f.shared_argnums = opts.shared_outer  # type: ignore[attr-defined]
  f.has_aux = opts.has_aux  # type: ignore[attr-defined]
  _register(f, opts.l2_clip, opts.rescale)
  return f
