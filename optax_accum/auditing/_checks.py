"""The audit's rows: the loop under test, judged against the large batch, window by window.

The large batch is the ground truth. The loop's own gradient is compared with the large
batch's gradient at the parameters its window started from; where they differ, the loop's
gradient is fitted as ``Σ cᵢ gᵢ`` over the micro-batches' own gradients, and those coefficients
(what the loop did) against the large batch's own weights (what it should have done) say which
row failed and why. Declared weights (`weight_fn`) only feed the messages: a loop that weighs
its micro-batches right passes whatever was declared.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.auditing import _keys as keys
from optax_accum.auditing import _run as run
from optax_accum.auditing._collectives import data_axis
from optax_accum.auditing._report import (
  Check,
  coefficient,
  coefficients,
  fit,
  flat,
  fmt,
  leaf_rel_diffs,
  rel,
  worst,
)
from optax_accum.auditing._through import compare as through_compare

# Float error allowed, in units of k·eps(dtype): the large batch and k micro-batches sum the
# same terms in different orders, and each of the k partial results carries its own rounding.
TOL_UNITS = 64
# At most this (a float32 or float64 audit is far tighter), at least a few roundings of the
# gradient's own dtype: in bfloat16 the large batch's gradient is itself off by some eps.
MAX_TOL = 1e-2
MIN_TOL_EPS = 4
# Two micro-batches "have the same gradient" (a fit over them is ill-posed) when their
# gradients differ by no more than this many eps of the gradient's dtype.
SAME_EPS = 4
# A coefficient this small against the largest is a micro-batch the loop left out.
MISSING = 1e-3
# Proportions of the loop's weights within this of the large batch's: the weights are right
# (a fit's coefficients carry the fit's rounding, far below it).
SAME_PROPORTIONS = 1e-3


def tolerance(dtype: Any, k: int) -> float:
  """The relative difference the audit allows: ``TOL_UNITS · k · eps(dtype)``, at most
  `MAX_TOL` and at least ``MIN_TOL_EPS · eps(dtype)``."""
  eps = float(jnp.finfo(dtype).eps)
  return max(min(TOL_UNITS * k * eps, MAX_TOL), MIN_TOL_EPS * eps)


def na(name: str, reason: str, threshold: str = "", figure: str = "") -> Check:
  return Check(name, f"n/a: {reason}", figure, threshold)


def unjudged(name: str, reason: str, threshold: str = "") -> Check:
  """A row the audit could not judge on this loop: the report is then not ok."""
  return Check(name, f"not judged: {reason}", "", threshold)


class Fitted:
  """The loop's gradient of one window as ``Σ cᵢ gᵢ`` over the gradients of `units` (the
  micro-batches, or each device's share of each), and the large batch's weights of them."""

  def __init__(self, got: np.ndarray, pieces: np.ndarray, want: np.ndarray, units: str):
    self.c, self.residual = fit(pieces, got)
    self.want, self.units = want, units


def _missing(c: np.ndarray, want: np.ndarray) -> list[int]:
  """The micro-batches the large batch counts and the loop (``c``) does not."""
  top, wtop = float(np.max(np.abs(c), initial=0.0)), float(np.max(np.abs(want), initial=0.0))
  return [i for i in range(len(c)) if abs(c[i]) <= MISSING * top and abs(want[i]) > MISSING * wtop]


def _window_diffs(ref: Any, out: run.Run) -> list[tuple[int, str, float, float]]:
  """(update, worst leaf, difference, allowance) of each window whose gradient is visible."""
  rows = []
  for j, w in enumerate(out.windows):
    if w.grads is not None:
      leaf, diff = worst(leaf_rel_diffs(w.grads, ref.large(w.params)))
      rows.append((j + 1, leaf, diff, ref.tol + w.grad_slack))
    elif w.through is not None:
      leaf, diff = ref.through(w)
      rows.append((j + 1, leaf, diff, ref.tol))
  return rows


THROUGH = (
  "beyond your optimizer's response to a gradient error that large: the gradient cannot be "
  "read back through your optimizer, so its new state and the parameters your step made are "
  "compared with it applied to the large batch's gradient"
)


def _allowance(ref: Any, out: run.Run) -> str:
  if any(w.through is not None for w in out.windows):
    return f"{ref.threshold} {THROUGH}"
  slack, source = max(((w.grad_slack, w.read_from) for w in out.windows), default=(0.0, ""))
  if not source:
    return ref.threshold
  return f"{ref.threshold} + {fmt(slack)} (the gradient read back from {source})"


def equivalence(ref: Any, out: run.Run) -> Check:
  name = "equivalence: gradient"
  if ref.not_sum:
    return na(name, "see 'decomposable'")
  if not out.windows:
    return Check(name, "FAIL", out.note or "the loop made no update in 2k micro-steps", "")
  if all(w.grads is None and w.through is None for w in out.windows):
    return unjudged(name, out.note or "the loop's gradient is not visible to the audit")
  rows = _window_diffs(ref, out)
  if not rows:
    return Check(name, "FAIL", "the loop made no update in 2k micro-steps", ref.threshold)
  bad = [r for r in rows if not r[2] <= r[3]]
  j, leaf, diff, _ = bad[0] if bad else max(rows, key=lambda r: r[2])
  where = f"update {j} of {len(rows)}, " if len(rows) > 1 else ""
  figure = f"{fmt(diff)} ({where}worst leaf {leaf})"
  if bad and len(rows) > 1:
    figure += "; against each update's own window: " + ", ".join(f"{fmt(d)}" for _, _, d, _ in rows)
  return Check(name, "FAIL" if bad else "ok", figure, _allowance(ref, out))


def _unseen(out: run.Run) -> str:
  """Why a row has no gradient to judge: the equivalence row says it in full."""
  if out.windows and all(w.grads is None and w.through is None for w in out.windows):
    return "see 'equivalence: gradient'"
  if any(w.through is not None for w in out.windows):
    return (
      "some updates' gradients were read back and others judged through your optimizer "
      "(where it was not affine in them: see 'equivalence: gradient'), so no replay of the "
      "optimizer on the loop's gradients"
    )
  return out.note or "the loop made no update"


def _window_length(s: run.Setup, out: run.Run) -> Check | None:
  if not out.across or not out.windows or out.windows[0].calls == s.k:
    return None
  calls = out.windows[0].calls
  figure = (
    f"your loop updated after {calls} micro-batch{'es' if calls > 1 else ''}, not k={s.k}: its "
    f"window is {calls} micro-batch{'es' if calls > 1 else ''} long (every_k={calls} where the "
    f"audit was told k={s.k}?)"
  )
  if calls == 1 and s.step is not None:
    figure += (
      "; an update on every call: if that is a whole step (it accumulates inside), pass it as "
      "step=, not micro_step="
    )
  return Check("every micro-batch counted", "FAIL", figure, f"an update every k={s.k} calls")


def counted(s: run.Setup, ref: Any, out: run.Run) -> Check:
  name = "every micro-batch counted"
  threshold = f"each micro-batch in Σ cᵢgᵢ (cᵢ > {MISSING:g}·max c where the large batch counts it)"
  length = _window_length(s, out)
  if length is not None:
    return length
  if ref.same_pieces:
    return na(name, "two micro-batches have the same gradient: use varied examples", threshold)
  first = out.windows[0] if out.windows else None
  if first is not None and first.grads is None and first.through is not None:
    return explained(s, ref, out)[0]
  if first is None or first.grads is None:
    return na(name, _unseen(out), threshold)
  got = flat(first.grads)
  if rel(got, ref.g) <= ref.tol + first.grad_slack:
    later = _carried_over(s, ref, out)
    return later or Check(name, "ok", "the loop's gradient is the large batch's", threshold)
  fitted = ref.fitted(got, max(ref.tol, 10 * first.grad_slack))
  if fitted.residual > max(ref.tol, 10 * first.grad_slack):
    figure = f"not Σ cᵢgᵢ of the {fitted.units}' gradients (residual {fmt(fitted.residual)})"
    later = _carried_over(s, ref, out)
    if later is not None:
      return later
    why = "the loop's gradient is no weighted sum of its micro-batches'"
    return na(name, why, threshold, figure)
  miss = _missing(fitted.c, fitted.want)
  seen = f"fits Σ cᵢgᵢ over the {fitted.units}, c = {coefficients(fitted.c)}"
  seen += f" (residual {fmt(fitted.residual)})"
  if not miss:
    later = _carried_over(s, ref, out)
    return later or Check(name, "ok", f"{seen}: all counted (see 'weighting')", threshold)
  kept = [i for i in range(len(fitted.c)) if i not in miss]
  unit = "micro-batch" if fitted.units == "micro-batches" else "share"
  if len(kept) == 1:
    seen += f": only {unit} {kept[0]} counted"
  else:
    units = unit if len(miss) == 1 else ("micro-batches" if unit == "micro-batch" else "shares")
    seen += f": {units} {', '.join(map(str, miss))} not counted"
  return Check(name, "FAIL", seen, threshold)


def _carried_over(s: run.Setup, ref: Any, out: run.Run) -> Check | None:
  """A later update whose gradient also holds the window before's micro-batches (an
  accumulator not zeroed after an update) or leaves out some of its own (one zeroed a
  micro-step late), else None."""
  for j in range(1, len(out.windows)):
    w, prev = out.windows[j], out.windows[j - 1]
    if w.grads is None or prev.grads is None:
      continue
    got = flat(w.grads)
    if rel(got, flat(ref.large(w.params))) <= ref.tol + w.grad_slack:
      continue
    both = np.concatenate([ref.pieces(w.params), ref.pieces(prev.params)])
    c, residual = fit(both, got)
    old = c[s.k :]
    if residual <= ref.tol + w.grad_slack and np.max(np.abs(old)) > MISSING * np.max(np.abs(c)):
      figure = (
        f"update {j + 1}'s gradient fits Σ cᵢgᵢ over its own micro-batches and update {j}'s: "
        f"c = {coefficients(c[: s.k])} + {coefficients(old)} (residual {fmt(residual)}): "
        "micro-batches of an earlier window counted again (an accumulator not zeroed after "
        "its update?)"
      )
      return Check("every micro-batch counted", "FAIL", figure, "each micro-batch in one update")
    own, residual = fit(ref.pieces(w.params), got)
    miss = _missing(own, ref.implied)
    if residual <= ref.tol + w.grad_slack and miss:
      figure = (
        f"update {j + 1}'s gradient fits Σ cᵢgᵢ over its own micro-batches, c = "
        f"{coefficients(own)} (residual {fmt(residual)}): micro-batch"
        f"{'es' if len(miss) > 1 else ''} {', '.join(map(str, miss))} not counted (the first "
        "window counts them all: an accumulator zeroed a micro-step late?)"
      )
      return Check("every micro-batch counted", "FAIL", figure, "each micro-batch in one update")
  return None


def weighting(s: run.Setup, ref: Any, out: run.Run) -> Check:
  name = "weighting"
  if ref.not_sum:
    return na(name, "see 'decomposable'")
  first = out.windows[0] if out.windows else None
  if _window_length(s, out) is not None:
    return na(name, "see 'every micro-batch counted'")
  if first is not None and first.grads is None and first.through is not None:
    return explained(s, ref, out)[1]
  if first is None or first.grads is None:
    return na(name, _unseen(out))
  got = flat(first.grads)
  mom = rel(ref.pieces0.mean(0), ref.g)
  if rel(got, ref.g) <= ref.tol + first.grad_slack:
    figure = f"the large batch's: {coefficients(ref.implied)}; a mean of means: {fmt(mom)} off"
    return Check(name, "ok", figure, ref.threshold)
  allowed = max(ref.tol, 10 * first.grad_slack)
  fitted = ref.fitted(got, allowed)
  if fitted.residual > allowed or _missing(fitted.c, fitted.want):
    return na(name, "see 'every micro-batch counted'")
  return Check(name, "FAIL", _weights_figure(s, fitted, ref), ref.threshold)


def _weights_figure(s: run.Setup, fitted: Fitted, ref: Any) -> str:
  """What the loop's weights are against the large batch's, and the likely cause."""
  c, want = fitted.c, fitted.want
  scale = float(c.sum() / want.sum())
  if rel(c / c.sum(), want / want.sum()) <= SAME_PROPORTIONS:
    figure = f"the proportions are the large batch's, the scale {scale:.4g}× its gradient"
    devices = _data_devices(s)
    if abs(scale * s.k - 1) < 0.01:
      figure += (
        ": the mean of a sum over examples, or a division by k done twice (average micro-batch "
        "sums: use reduction='sum')"
      )
    elif abs(scale - s.k) < 0.01 * s.k:
      figure += (
        ": the sum of micro-batch means, a division by k forgotten (use reduction='mean', or a "
        "loss that sums)"
      )
    elif devices > 1 and abs(scale - devices) < 0.01 * devices:
      figure += (
        f": the {devices} devices of the data axis summed where a mean was meant (a psum for a "
        "pmean; inside shard_map, jax.grad of parameters not pcast to varying has summed "
        "over the axis already)"
      )
    return figure
  figure = f"your loop weighs the {fitted.units} {coefficients(c)}, the large batch "
  figure += coefficients(want)
  if rel(c, np.full_like(c, c.mean())) <= SAME_PROPORTIONS:
    figure += f": a mean of the {fitted.units}' means (weight each by its real rows or tokens)"
  if s.weight_fn is not None and fitted.units == "micro-batches":
    declared = ref.declared * want.sum()
    figure += f"; your weight_fn's weights {coefficients(declared)}"
    if rel(declared, c) <= SAME_PROPORTIONS:
      figure += " (the loop's: they are not the large batch's)"
  return figure


def _data_devices(s: run.Setup) -> int:
  """The devices along the data axis of `s.mesh` (1 without a mesh)."""
  axis = data_axis(s)
  if s.mesh is None or axis is None:
    return 1
  axes = axis if isinstance(axis, tuple) else (axis,)
  return int(np.prod([s.mesh.shape[a] for a in axes if a in s.mesh.axis_names]))


def decomposable(ref: Any) -> Check:
  name = "decomposable"
  threshold = f"residual {ref.threshold}"
  figure = f"large = Σ cᵢgᵢ to {fmt(ref.residual)}"
  if ref.not_sum == ref.TOO_FEW:  # nothing was judged: not a verdict on the loss
    return unjudged(name, ref.not_sum, threshold)
  if ref.not_sum == ref.DATA_DEPENDENT:
    figure += (
      f" with c = {coefficients(ref.implied)}, but with one micro-batch's rows replaced the "
      f"large batch no longer weighs the others so ({fmt(ref.moved)} off): weights that change "
      "with the data (a max or a sort over the batch) are not weights, no weight_fn can match"
    )
    return Check(name, f"n/a: {ref.not_sum}", figure, threshold)
  if ref.not_sum:
    figure += (
      " at best: no weighted sum of the micro-batches' gradients makes the large batch's "
      "(batch statistics such as BatchNorm, in-batch negatives, a loss normalised by the "
      "batch's own statistics): accumulation cannot match it"
    )
    return Check(name, f"n/a: {ref.not_sum}", figure, threshold)
  return Check(name, "ok", figure, threshold)


def updates(s: run.Setup, ref: Any, out: run.Run) -> list[Check]:
  """The first and the last update against the optimizer applied once per update to the
  gradient the loop produced (from its initial state, at the loop's own parameters): a step
  count (a schedule) advanced per micro-step, or an update made from the wrong state, shows
  here. (Against the large batch's updates instead, Adam would turn the gradient's rounding
  into differences of 1e-2 where an entry is near zero; the gradient itself is held to the
  large batch's above.)"""
  names = ("first update", f"schedule: update {s.num_updates}")
  if s.optimizer is None:
    return [na(n, "no optimizer given") for n in names]
  if not out.across and s.step is None:
    return [na(n, "your step applies the optimizer, once per update") for n in names]
  if out.windows and all(w.through is not None for w in out.windows):
    return _through_updates(s, ref, out, names)
  if not out.windows or any(w.grads is None for w in out.windows):
    return [na(n, _unseen(out)) for n in names]
  want = _replay(s, out.windows)
  threshold = f"{ref.threshold} from the optimizer on the accumulated gradient"
  rows = [_compare_update(names[0], out.windows[0], want[0], ref, threshold)]
  if len(out.windows) < s.num_updates:
    return [*rows, na(names[1], f"the loop made {len(out.windows)} updates")]
  if s.num_updates < 2:
    return [*rows, na(names[1], "num_updates=1")]
  return [*rows, _compare_update(names[1], out.windows[-1], want[-1], ref, threshold)]


def _replay(s: run.Setup, windows: list[run.Window]) -> list[Any]:
  """The optimizer's updates for the loop's own gradients at its own parameters."""
  update = jax.jit(s.optimizer.update)
  state, out = s.optimizer.init(s.params), []
  for w in windows:
    grads = jax.tree.map(lambda g, p: jnp.asarray(g, jnp.result_type(p)), w.grads, w.params)
    u, state = update(grads, state, w.params)
    out.append(u)
  return out


def _compare_update(name: str, w: run.Window, want: Any, ref: Any, threshold: str) -> Check:
  if not w.rounded:
    leaf, diff = worst(leaf_rel_diffs(w.updates, want))
    return Check(name, "ok" if diff <= ref.tol else "FAIL", f"{fmt(diff)} (worst leaf {leaf})",
                 threshold)  # fmt: skip
  # The step's update is read as ``params_after - params``: compare the parameters each update
  # makes, allowing each entry one rounding of the new parameters.
  after = jax.tree.map(lambda p, u: np.asarray(optax_apply(p, u), np.float64), w.params, want)
  delta = jax.tree.map(lambda a, p: a - np.asarray(p, np.float64), after, w.params)
  slack = jax.tree.map(
    lambda a, p: float(jnp.finfo(jnp.result_type(p)).eps) * np.abs(a), after, w.params
  )
  leaf, diff = worst(leaf_rel_diffs(w.updates, delta, slack))
  figure = f"{fmt(diff)} (worst leaf {leaf}; after one rounding of the parameters)"
  return Check(name, "ok" if diff <= ref.tol else "FAIL", figure, threshold)


def optax_apply(p: Any, u: Any) -> Any:
  """``p + u`` in the parameter's dtype, as `optax.apply_updates` makes it."""
  return np.asarray(jnp.asarray(p) + jnp.asarray(u).astype(jnp.result_type(p)))


# ----------------------------------------------------------------------------------------------
# A whole step whose optimizer the gradient cannot be read back through (`_through`).


def _through_updates(s: run.Setup, ref: Any, out: run.Run, names: tuple[str, str]) -> list[Check]:
  """The first and the last update through the optimizer from the state the previous update
  left (the window's start, not the updating call's: a count a micro-step advanced shows)."""
  threshold = (
    f"{ref.threshold} from your optimizer on the large batch's gradient, from the state the "
    "previous update left, beyond its response to a gradient error that large"
  )

  def row(name: str, w: run.Window) -> Check:
    if ref.through(w)[1] > ref.tol:
      return na(name, "see 'equivalence: gradient'")
    leaf, diff = ref.through(w, from_start=True)
    return Check(name, "ok" if diff <= ref.tol else "FAIL", f"{fmt(diff)} (worst leaf {leaf})",
                 threshold)  # fmt: skip

  rows = [row(names[0], out.windows[0])]
  if len(out.windows) < s.num_updates:
    return [*rows, na(names[1], f"the loop made {len(out.windows)} updates")]
  if s.num_updates < 2:
    return [*rows, na(names[1], "num_updates=1")]
  return [*rows, row(names[1], out.windows[-1])]


def explained(s: run.Setup, ref: Any, out: run.Run) -> tuple[Check, Check]:
  """The rows "every micro-batch counted" and "weighting" of a step judged through its
  optimizer: ok where every update is the large batch's; else the first fault that explains
  the first wrong update (the optimizer on ``Σ cᵢgᵢ`` for the usual faults' ``c``)."""
  if ref.explained is None:
    ref.explained = _explain(s, ref, out)
  return ref.explained


def _explain(s: run.Setup, ref: Any, out: run.Run) -> tuple[Check, Check]:
  names = ("every micro-batch counted", "weighting")
  if ref.not_sum:
    return na(names[0], "see 'decomposable'"), na(names[1], "see 'decomposable'")
  bad = [j for j, w in enumerate(out.windows) if w.through and ref.through(w)[1] > ref.tol]
  threshold = f"your optimizer on Σ cᵢgᵢ {ref.threshold}"
  if not bad:
    figure = "every update is your optimizer's on the large batch's gradient (see 'equivalence')"
    blind = _scale_blind(s, ref, out)
    if blind:
      return Check(names[0], "ok", figure, threshold), na(names[1], blind, threshold)
    return Check(names[0], "ok", figure, threshold), Check(names[1], "ok", figure, threshold)
  j = bad[0]
  w = out.windows[j]
  for kind, c, pieces, what in _faults(s, ref, out, j):
    if ref.tol >= compare_through(w, c @ pieces, ref)[1]:
      figure = (
        f"update {j + 1} is your optimizer's on Σ cᵢgᵢ with c = {coefficients(c)} over the "
        f"micro-batches{' of this window and the one before' if len(c) > s.k else ''}: {what}"
      )
      if kind == "counted":
        return Check(names[0], "FAIL", figure, threshold), na(names[1], f"see '{names[0]}'")
      counted = Check(names[0], "ok", "all counted (see 'weighting')", threshold)
      return counted, Check(names[1], "FAIL", figure, threshold)
  why = (
    "the gradient cannot be read back through your optimizer, and no micro-batch left out, "
    "counted again or weighed wrong explains the update (see 'equivalence: gradient')"
  )
  return na(names[0], why), na(names[1], why)


def _scale_blind(s: run.Setup, ref: Any, out: run.Run) -> str:
  """Why the weighting cannot be judged through the optimizer, or "": where every window's
  update and state are also the optimizer's on the large batch's gradient times k or 1/k (a
  clip that acts before a stateless update, a sign), a loop off by that factor (a sum for a
  mean, a division by k done twice) makes the same updates: the scale is invisible there."""
  judged = [w for w in out.windows if w.through]
  if not judged or s.k == 1:
    return ""
  for factor, fault in ((s.k, "a sum of the micro-batches' means"), (1 / s.k, "k divided twice")):
    if all(ref.tol >= compare_through(w, factor * flat(ref.large(w.params)), ref)[1]
           for w in judged):  # fmt: skip
      return (
        f"your optimizer makes the same updates and state from the large batch's gradient "
        f"times {coefficient(factor)} at these parameters (a clip that "
        f"acts, a sign, a normalisation), so a loop off by that factor ({fault}) would pass: "
        "the scale is not judged; audit where the optimizer does not normalise it (a loss "
        "scaled down below the clip, or the optimizer without the clip) to judge it"
      )
  return ""


def compare_through(w: run.Window, vec: np.ndarray, ref: Any) -> tuple[str, float]:
  grads = jax.tree.unflatten(jax.tree.structure(w.params), _split(vec, w.params))
  return through_compare(w.through, grads, ref.tol)


def _split(vec: np.ndarray, like: Any) -> list[np.ndarray]:
  """A flat vector (`flat`'s order) as arrays shaped as the leaves of `like`."""
  out, i = [], 0
  for leaf in jax.tree.leaves(like):
    n = int(np.prod(np.shape(leaf)))
    out.append(vec[i : i + n].reshape(np.shape(leaf)))
    i += n
  return out


def _faults(s: run.Setup, ref: Any, out: run.Run, j: int) -> list[tuple[str, Any, Any, str]]:
  """The usual faults as ``(row, c, pieces, what)``: the loop's gradient ``c @ pieces``."""
  k, want = s.k, ref.implied
  pieces, total = ref.pieces(out.windows[j].params), float(ref.implied.sum())
  faults = []
  for i in range(k):
    faults.append(("counted", total * np.eye(k)[i], pieces, f"only micro-batch {i} counted"))
  for i in range(k):
    c = want.copy()
    c[i] = 0.0
    for scaled in (c, c * total / c.sum()):
      faults.append(("counted", scaled, pieces, f"micro-batch {i} not counted"))
  if j > 0:
    both = np.concatenate([pieces, ref.pieces(out.windows[j - 1].params)])
    again = "micro-batches of an earlier window counted again (an accumulator not zeroed?)"
    faults.append(("counted", np.concatenate([want, want]), both, again))
  faults.append(("weighting", k * want, pieces, "a division by k forgotten (a sum of means)"))
  faults.append(("weighting", want / k, pieces, "a division by k done twice"))
  uniform = np.full(k, total / k)
  if rel(uniform, want) > SAME_PROPORTIONS:
    what = "a mean of the micro-batches' means (weight each by its real rows or tokens)"
    faults.append(("weighting", uniform, pieces, what))
  return faults


def randomness(s: run.Setup, ref: Any, draws: list[tuple[int, ...]] | None, out: run.Run) -> Check:
  name = "randomness: a key per micro-batch"
  threshold = "each micro-batch its own keys"
  if s.rng is None:
    return na(name, "no rng given", threshold)
  if out.across and not s.keys_known:
    why = (
      "one key given: pass the keys your loop gives its micro-steps (rng=lambda i: key of "
      "micro-step i, or a sequence of them) to check them"
    )
    return na(name, why, threshold)
  if draws is None:
    return na(
      name, "TrainStep(axis_name=...) splits every argument: no key can be passed", threshold
    )
  per, distinct_per = ref.draws_per_micro_batch
  if per == 0:
    return na(name, "your loss made no random draw with its key", threshold)
  if out.across:
    micro = sum(w.calls for w in out.windows)
  else:  # a whole step is called once per update: with the keys known, each its own
    micro = s.k * (len(out.windows) if s.step is not None and s.keys_known else 1)
  # Inside a map over the data axis (shard_map) each device draws for its own rows of every
  # micro-batch: a key per device and micro-batch (the same key on two devices draws the same
  # dropout mask for different examples). Under plain jit a draw covers the global array.
  devices = len(set(getattr(draws, "devices", ()))) or 1
  want = micro * distinct_per * devices
  distinct = len(set(draws))
  figure = (
    f"{len(draws)} draws from {distinct} distinct keys over {micro} micro-batches"
    + (f" on each of {devices} devices of the data axis" if devices > 1 else "")
    + f" (your loss draws with {distinct_per} key{'s' if distinct_per > 1 else ''} per "
    "micro-batch)"
  )
  return Check(name, "ok" if distinct >= want else "FAIL", figure, f">= {want} distinct keys")


def accumulator(out: run.Run) -> tuple[Check, int]:
  name = "accumulator"
  threshold = "dtype at least float32"
  if out.accumulator is None:
    return na(name, "your own accumulator is not visible to the audit", threshold), 0
  leaves = jax.tree.leaves(out.accumulator)
  size = sum(_device_bytes(x) for x in leaves)
  dtypes = sorted({jnp.dtype(x.dtype).name for x in leaves})
  narrow = [d for d in dtypes if jnp.issubdtype(d, jnp.floating) and jnp.dtype(d).itemsize < 4]
  figure = f"{size / 2**20:.3f} MiB per device, {'/'.join(dtypes)}"
  return Check(name, "FAIL" if narrow else "ok", figure, threshold), size


def _device_bytes(x: Any) -> int:
  if isinstance(x, jax.Array) and x.addressable_shards:
    return x.addressable_shards[0].data.nbytes
  return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def memory(s: run.Setup, in_step: bool, acc_bytes: int) -> Check:
  name = "peak memory"
  micro, large = run.peak_bytes(s, "step" if in_step else "micro")
  if micro is None or large is None:
    return na(name, "this backend reports no memory analysis")
  micro += 0 if in_step else acc_bytes
  figure = f"{micro / 2**20:.3f} MiB accumulated vs {large / 2**20:.3f} MiB large batch"
  return Check(name, "info", f"{figure} ({micro / large:.2f}×)", "compiled peak")


def loss_draws(s: run.Setup) -> tuple[int, int]:
  """Draws and distinct keys of the loss's gradient on one micro-batch with one key."""
  with keys.recording() as draws:
    jax.block_until_ready(s.grad(s.params, s.micro[0]))
  return len(draws), len(set(draws))
