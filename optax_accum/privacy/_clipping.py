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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._typing import ArgNums

NO_BATCH = (
  "clipped_grad: {what}. Per-example clipping needs the examples: name the arguments whose "
  "leading axis is the batch with batch_argnums (default 1, as in `loss(params, batch)`)."
)

_RELATIONS = {"add_or_remove_one": 1.0, "replace_special": 1.0, "replace_one": 2.0}


class ClipStats(NamedTuple):
  """What clipping saw in a batch (``return_stats=True``); for monitoring, not private."""

  num_examples: jax.Array  # shape=(), dtype=jnp.float32: real (unmasked) examples
  num_clipped: jax.Array  # shape=(), dtype=jnp.float32: real examples with ‖∇ℓᵢ‖ > C
  norms: jax.Array  # shape=(B,), dtype=jnp.float32: ‖∇ℓᵢ‖ before clipping; 0 for padding


STATS_REDUCTION = ClipStats("sum", "sum", "concat")


def _check_clip(l2_clip: Any, caller: str) -> float:
  if isinstance(l2_clip, bool) or not isinstance(l2_clip, int | float | np.number):
    raise TypeError(f"{caller}: l2_clip must be a positive finite number, got {l2_clip!r}.")
  if not (np.isfinite(l2_clip) and l2_clip > 0):
    raise ValueError(f"{caller}: l2_clip must be a positive finite number, got {l2_clip!r}.")
  return float(l2_clip)


def _argnums(batch_argnums: Any, mask_argnum: Any) -> tuple[tuple[int, ...], int | None]:
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


def _one_example(loss, nums, l2_clip):
  """``(value, clipped gradient, norm)`` of one example (its batch axis kept, of size 1)."""

  def one(params, real, *args):
    args = [jax.tree.map(lambda x: x[None], a) if n + 1 in nums else a for n, a in enumerate(args)]
    value, grads = jax.value_and_grad(loss)(params, *args)
    leaves = jax.tree.leaves(grads)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(jnp.abs(g).astype(jnp.float32))) for g in leaves))
    # A non-finite gradient would carry an unbounded (NaN) contribution: it counts as 0.
    keep = real & jnp.isfinite(norm)
    scale = jnp.where(keep, jnp.minimum(1.0, l2_clip / jnp.maximum(norm, 1e-30)), 0.0)
    clipped = jax.tree.map(lambda g: jnp.where(keep, g * scale.astype(g.dtype), 0), grads)
    value = jnp.where(real, jnp.asarray(value, jnp.float32), 0.0)
    return value, clipped, jnp.where(real, norm, 0.0)

  return one


def clipped_sum(loss, l2_clip: float, nums, mask_argnum, params, args) -> tuple[Any, Any, Any]:
  """``(Σ real values, Σ clip_C(∇ℓᵢ), ClipStats)`` of one batch; `args` are the loss's
  arguments after the parameters, with the mask (if any) still at `mask_argnum`."""
  args = list(args)
  mask = args.pop(mask_argnum - 1) if mask_argnum is not None else None
  size = _batch_size(args, nums)
  real = _real(mask, size)
  in_axes = (None, 0, *[0 if n + 1 in nums else None for n in range(len(args))])
  one = _one_example(loss, nums, l2_clip)
  values, clipped, norms = jax.vmap(one, in_axes=in_axes)(params, real, *args)
  grads = jax.tree.map(
    lambda g, p: jnp.sum(g, axis=0, dtype=jnp.promote_types(g.dtype, jnp.float32)).astype(
      jnp.result_type(p)
    ),
    clipped,
    params,
  )
  count = jnp.sum(real, dtype=jnp.float32)
  stats = ClipStats(count, jnp.sum(norms > l2_clip, dtype=jnp.float32), norms)
  return jnp.sum(values), grads, stats


@dataclasses.dataclass(frozen=True)
class ClippedGrad:
  """`clipped_grad`'s result: a callable that carries its clip norm and sensitivity."""

  fun: Callable[..., Any]
  l2_clip: float
  return_stats: bool

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.fun(*args, **kwargs)

  @property
  def reduction(self) -> Any:
    """The `microbatch` reduction of this function's outputs: ``"sum"`` for the gradient
    (``("sum", STATS_REDUCTION)`` with `return_stats`: counts summed, norms in batch order)."""
    return ("sum", STATS_REDUCTION) if self.return_stats else "sum"

  def sensitivity(self, neighboring_relation: Any = "add_or_remove_one") -> float:
    """The L2 sensitivity of the clipped sum (what the Gaussian mechanism's noise is scaled to).

    Args:
      neighboring_relation: "add_or_remove_one" (one example added or removed: ``C``),
        "replace_special" (one example replaced by a zero one: ``C``) or "replace_one" (one
        replaced by any other: ``2C``); or a ``dp_accounting.NeighboringRelation``.

    Returns:
      The sensitivity, a Python float.

    Raises:
      ValueError: for another relation.

    >>> import jax.numpy as jnp
    >>> from optax_accum import privacy
    >>> privacy.clipped_grad(lambda w, x: jnp.mean(x @ w), 0.5).sensitivity("replace_one")
    1.0
    """
    name = getattr(neighboring_relation, "name", neighboring_relation)
    factor = _RELATIONS.get(str(name).lower())
    if factor is None:
      raise ValueError(
        f"sensitivity: neighboring_relation must be one of {sorted(_RELATIONS)}, got "
        f"{neighboring_relation!r}."
      )
    return factor * self.l2_clip


def clipped_grad(
  loss: Callable[..., Any],
  l2_clip: float,
  *,
  batch_argnums: ArgNums = 1,
  mask_argnum: int | None = None,
  return_stats: bool = False,
) -> ClippedGrad:
  """The sum of per-example clipped gradients, ``Σᵢ clip_C(∇ loss(params, *exampleᵢ))``.

  ``clip_C(g) = g · min(1, C / ‖g‖)``, with ``‖g‖`` the global L2 norm over all parameters,
  computed in float32. Each example is passed to `loss` with its leading batch axis kept, of
  size 1 (jax_privacy's ``keep_batch_dim=True``), so a loss written for a batch works as it is.
  The gradient is taken with respect to argument 0 and summed in float32, then cast to each
  parameter's dtype. An example whose gradient is not finite contributes 0 (an unbounded
  contribution would void the guarantee). Padding examples (mask 0) contribute exactly 0.

  Compose it with `microbatch` for a logical batch larger than one micro-batch, e.g.
  ``microbatch(clipped_grad(loss, C), k, reduction="sum")``; the memory is one micro-batch of
  per-example gradients. Across steps, use `clipped_loss` with `accumulate`/`TrainStep`.

  Args:
    loss: ``loss(params, *args) -> scalar``, the loss of a batch (here: of one example).
    l2_clip: ``C``, the clip norm, a positive finite number.
    batch_argnums: the positions (in ``loss``'s arguments, >= 1) of the pytrees whose leaves'
      leading axis is the batch; all must have the same leading size ``B``.
    mask_argnum: optional position of one more argument of the returned function (not passed
      to `loss`): a ``(B,)`` array, nonzero for real examples and 0 for padding. In a
      `microbatch`, name it in `batch_argnums` there so that it is split with the batch.
    return_stats: also return a `ClipStats` (real examples, clipped examples, per-example
      norms) for monitoring. These are not privatised: do not release them.

  Returns:
    A `ClippedGrad`: called like `loss` (plus the mask), it returns the clipped sum, a pytree
    like the parameters, or ``(clipped sum, ClipStats)`` with `return_stats`. Its
    ``.reduction`` is what `microbatch` needs for these outputs and ``.sensitivity()`` the L2
    sensitivity of the sum.

  Raises:
    TypeError, ValueError: for an `l2_clip` that is not a positive finite number, empty or
      negative `batch_argnums` (or one naming the parameters), a bad `mask_argnum`; at call
      time, for batch arguments that are missing, hold no arrays or disagree on the batch
      size, or a mask of the wrong shape.

  >>> import jax.numpy as jnp, optax_accum
  >>> loss = lambda w, x: jnp.mean(x @ w)  # per-example gradient: the example x itself
  >>> g = optax_accum.privacy.clipped_grad(loss, 1.0)
  >>> g(jnp.zeros(2), jnp.array([[3.0, 4.0], [0.3, 0.4]]))  # norms 5 → clipped to 1, and 0.5
  Array([0.90000004, 1.2       ], dtype=float32)
  >>> g.sensitivity()
  1.0
  """
  if not callable(loss):
    raise TypeError(f"clipped_grad: loss must be callable, got {loss!r}.")
  l2_clip = _check_clip(l2_clip, "clipped_grad")
  nums, mask_argnum = _argnums(batch_argnums, mask_argnum)

  def fun(params: Any, *args: Any) -> Any:
    _, grads, stats = clipped_sum(loss, l2_clip, nums, mask_argnum, params, args)
    return (grads, stats) if return_stats else grads

  return ClippedGrad(fun, l2_clip, bool(return_stats))


def clipped_loss(
  loss: Callable[..., Any],
  l2_clip: float,
  *,
  batch_argnums: ArgNums = 1,
  mask_argnum: int | None = None,
) -> Callable[..., jax.Array]:
  """A loss whose gradient is `clipped_grad`'s clipped sum: DP for `TrainStep`/`accumulate`.

  Its value is ``Σᵢ loss(params, *exampleᵢ)`` over the real examples; its gradient with respect
  to argument 0 (a custom VJP) is ``Σᵢ clip_C(∇ℓᵢ)``, computed in the forward pass. So any
  front end that takes a loss and calls `jax.grad` on it accumulates clipped sums, e.g.
  ``TrainStep(clipped_loss(loss, C), optax.chain(dp_noise(...), optax.sgd(lr)), every_k=k,
  reduction="sum")``. Only argument 0 is differentiable.

  Args:
    loss: as for `clipped_grad`.
    l2_clip: as for `clipped_grad`.
    batch_argnums: as for `clipped_grad`.
    mask_argnum: as for `clipped_grad`.

  Returns:
    ``f(params, *args) -> scalar`` with the custom gradient.

  Raises:
    TypeError, ValueError: as `clipped_grad`.

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> loss = lambda w, x: jnp.mean(x @ w)
  >>> f = optax_accum.privacy.clipped_loss(loss, 1.0)
  >>> jax.grad(f)(jnp.zeros(2), jnp.array([[3.0, 4.0], [0.3, 0.4]]))
  Array([0.90000004, 1.2       ], dtype=float32)
  """
  if not callable(loss):
    raise TypeError(f"clipped_loss: loss must be callable, got {loss!r}.")
  l2_clip = _check_clip(l2_clip, "clipped_loss")
  nums, mask_argnum = _argnums(batch_argnums, mask_argnum)

  def f(params: Any, *args: Any) -> jax.Array:
    @jax.custom_vjp
    def value(p):
      return clipped_sum(loss, l2_clip, nums, mask_argnum, p, args)[0]

    def fwd(p):
      v, grads, _ = clipped_sum(loss, l2_clip, nums, mask_argnum, p, args)
      return v, grads

    def bwd(grads, ct):
      return (jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads),)

    value.defvjp(fwd, bwd)
    return value(params)

  return f
