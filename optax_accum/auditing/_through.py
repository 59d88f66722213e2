"""Judging a whole step through its optimizer, where the gradient cannot be read back.

`_step.read_back` recovers the gradient a step's optimizer received where the optimizer
is elementwise affine in it. Behind one that is not — `clip_by_global_norm` that acts,
Adafactor, Muon's orthogonalisation, schedule-free — nothing recovers it. But the optimizer is
known (it is the user's) and deterministic, and so is what the step must have produced: the
audit applies it to the large batch's gradient from the step's own optimizer state, and compares
every leaf of the state the step produced (Adam's and Adafactor's moments, a momentum, a step
count) and the new parameters with that reference. A fault in the gradient shows in the moments
(Adam's first moment is linear in the clipped gradient); one in the state the update started
from (a step count advanced per micro-step) in the count and the parameters.

The tolerance is the optimizer's own response to an error the gradient row accepts. That row
allows each leaf of the gradient to differ from the large batch's by ``tol · max|leaf|``
(``a``, entry by entry); how far that moves each output entry depends on the optimizer (Adam's
first update is about ``sign(g)``: an entry of the gradient within ``a`` of zero may flip it
whole; a clipped gradient moves through its norm too). So the audit measures it, at the
reference, by applying the optimizer to four gradients that move every entry by ``a``: ``g ±
a ⊙ ξ`` with random signs ξ (each entry's response to its own error; a global scalar such as a
norm hardly moves) and ``g ± a ⊙ sign(g)`` (every magnitude one way: a norm or an RMS moves the
most it can). To first order, for an optimizer that acts entry by entry through a few global
scalars, an entry's response is at most its own part plus the part through the scalars; the
signed probe holds both, possibly cancelling, so ``2·|ξ response| + |signed response|`` bounds
their sum (both signs taken, so a response even in the error, ``g²``, is covered at its end
points). Each output entry may differ from the reference by that, plus four roundings of its
own dtype (the step's program and the audit's round differently); what is left, relative to
the largest change the reference makes to the leaf, is held to ``tol``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum.auditing._report import leaf_rel_diffs, worst

# Roundings of an output entry's own dtype allowed between the step's program and the audit's.
OUTPUT_ULPS = 4
_PROBE_SEED = 0


class Through(NamedTuple):
  """One update of a whole step, kept to be judged through its optimizer (the located states
  are ``optimizer.init(params)``'s structure)."""

  apply: Callable[..., Any]  # (grads, state, params) -> (updates, state, params), jitted once
  before: Any  # the optimizer's state before the updating call
  start: Any  # its state at the window's start: the state the previous update left
  after: Any  # its state after the updating call
  params: Any  # the parameters the window started from (array leaves)
  params_after: Any  # the parameters the step returned


def applied(optimizer: optax.GradientTransformation) -> Callable[..., Any]:
  """The optimizer's step as one jitted function, ``(grads, state, params) -> (updates, new
  state, new params)``: the state an argument, so that every window and probe, read back or
  judged through, runs one compiled program."""

  def step(grads, state, params):
    updates, state = optimizer.update(grads, state, params)
    return updates, state, optax.apply_updates(params, updates)

  return jax.jit(step)


def placed(x: Any, like: Any) -> Any:
  """`x` placed as `like` (a probe beside parameters on a mesh: one program, one device set);
  on one device as it is (committed, it would compile the update once more than the others)."""
  sharding = getattr(like, "sharding", None)
  if sharding is None or len(sharding.device_set) == 1:
    return x
  return jax.device_put(x, sharding)


def _f64(x: Any) -> np.ndarray:
  if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x, np.float64)


def _eps(x: Any) -> float:
  dtype = jnp.result_type(x)
  return float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.inexact) else 0.0


def _inputs(grads: Any, params: Any, tol: float) -> list[Any]:
  """The gradient (at least float32, placed as the parameters) and its four probes."""
  rng = np.random.default_rng(_PROBE_SEED)

  def five(g: Any, p: Any) -> list[Any]:
    g64 = np.asarray(g, np.float64)
    dtype = jnp.promote_types(jnp.result_type(p), jnp.float32)
    a = tol * float(np.max(np.abs(g64), initial=0.0))
    xi = rng.choice([-1.0, 1.0], size=g64.shape)
    sign = np.where(g64 >= 0, 1.0, -1.0)
    moves = (0.0, a * xi, -a * xi, a * sign, -a * sign)
    return [placed(jnp.asarray(g64 + m, dtype), p) for m in moves]

  per_leaf = [five(g, p) for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params),
                                         strict=True)]  # fmt: skip
  treedef = jax.tree.structure(params)
  return [jax.tree.unflatten(treedef, [leaf[i] for leaf in per_leaf]) for i in range(5)]


def compare(th: Through, grads: Any, tol: float, *, from_start: bool = False) -> tuple[str, float]:
  """The worst leaf and its difference between what the step produced and the optimizer
  applied to `grads` (from the state before the updating call, or with `from_start` from the
  window's start), each entry less the optimizer's response to a gradient error within `tol`,
  relative to the largest change the reference makes to that leaf."""
  state = th.start if from_start else th.before
  outs = [th.apply(g, state, th.params) for g in _inputs(grads, th.params, tol)]
  diffs, raw = [], []
  for i, (name, got, base) in (
    (1, ("opt_state", th.after, state)),
    (2, ("params", th.params_after, th.params)),
  ):
    want = jax.tree.map(_f64, outs[0][i])
    probes = [jax.tree.map(_f64, o[i]) for o in outs[1:]]
    slack = jax.tree.map(
      lambda w, p1, p2, p3, p4, g, ref: (
        2 * np.maximum(np.abs(p1 - w), np.abs(p2 - w))
        + np.maximum(np.abs(p3 - w), np.abs(p4 - w))
        + OUTPUT_ULPS * max(_eps(g), _eps(ref)) * np.maximum(np.abs(w), np.abs(_f64(g)))
      ),
      want, *probes, got, outs[0][i],
    )  # fmt: skip
    change = jax.tree.map(lambda w, b: w - _f64(b), want, base)
    moved = jax.tree.map(lambda g, b: _f64(g) - _f64(b), got, base)
    label = lambda path, name=name: name + ("" if path == "<root>" else path)
    diffs += [(label(p), d) for p, d in leaf_rel_diffs(moved, change, slack)]
    raw += [(label(p), d) for p, d in leaf_rel_diffs(moved, change)]
  if not diffs:
    return "<none>", 0.0
  leaf, diff = worst(diffs)
  if diff > 0:
    return leaf, diff
  leaf, apart = worst(raw)
  return f"{leaf}, {apart:.1e} apart: within your optimizer's response", diff
