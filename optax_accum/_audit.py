"""`audit`: a pre-flight check of gradient accumulation on the user's own model.

It runs the large batch and the accumulated path on the same data and reports, check by check,
what differs (`AuditReport`). The reference side is computed here directly (``jax.grad`` of the
loss on the whole batch and on each micro-batch, one optax update on it), the side under test
through the public front ends (`_audit_run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _audit_run as run
from optax_accum._audit_report import (
  AuditReport,
  Check,
  coefficients,
  fit,
  flat,
  fmt,
  leaf_rel_diffs,
  rel,
  worst,
)
from optax_accum._microbatch import microbatch

FrontEnd = Literal["microbatch", "accumulate", "TrainStep"]
_FRONT_ENDS = ("microbatch", "accumulate", "TrainStep")
# Float error allowed, in units of k·eps(dtype): the large batch and k micro-batches sum the
# same terms in different orders, and each of the k partial results carries its own rounding.
TOL_UNITS = 64
# The randomness probe: each micro-batch's key draws a PROBE_DIM vector; two keys are the same
# key when their (normalised) vectors agree to this cosine.
PROBE_DIM = 16
SAME_KEY_COSINE = 1 - 1e-6


def tolerance(dtype: Any, k: int) -> float:
  """The relative difference the audit allows: ``TOL_UNITS · k · eps(dtype)``."""
  return TOL_UNITS * k * float(jnp.finfo(dtype).eps)


def _split_static(params: Any) -> tuple[Any, Any]:
  """The array leaves (others None) and the other leaves (arrays None), as `eqx.partition`."""
  is_array = lambda x: isinstance(x, (jax.Array, np.ndarray, np.generic))
  arrays = jax.tree.map(lambda x: x if is_array(x) else None, params)
  static = jax.tree.map(lambda x: None if is_array(x) else x, params)
  return arrays, static


def _combine(arrays: Any, static: Any) -> Any:
  return jax.tree.map(
    lambda a, s: a if s is None else s, arrays, static, is_leaf=lambda x: x is None
  )


def _check_args(loss_fn, k, front_end, optimizer, weight_fn, num_updates, wrap) -> None:
  if not callable(loss_fn):
    raise TypeError(f"audit: loss_fn must be callable, got {loss_fn!r}.")
  if isinstance(k, bool) or not isinstance(k, int) or k < 2:
    raise ValueError(f"audit: k must be an int >= 2 (the micro-batches per update), got {k!r}.")
  if not (callable(front_end) or front_end in _FRONT_ENDS):
    raise ValueError(
      f"audit: front_end must be one of {_FRONT_ENDS} or a callable "
      f"``fn(loss_fn, params, batch, *keys) -> grads``, got {front_end!r}."
    )
  if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(f"audit: optimizer must be an optax GradientTransformation, got {optimizer!r}.")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"audit: weight_fn must be callable or None, got {weight_fn!r}.")
  if isinstance(num_updates, bool) or not isinstance(num_updates, int) or num_updates < 1:
    raise ValueError(f"audit: num_updates must be a positive int, got {num_updates!r}.")
  if wrap is not None and front_end != "accumulate":
    raise ValueError(f"audit: wrap is for front_end='accumulate', got front_end={front_end!r}.")


def _batch_size(batch: Any, k: int) -> int:
  sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(
      f"audit: every leaf of batch must have the same leading (batch) size, got sizes {sizes}."
    )
  (size,) = sizes
  if size % k:
    raise ValueError(f"audit: the batch size {size} must be a multiple of k={k}.")
  return size


class _Reference:
  """The large batch's gradient, each micro-batch's, flattened, and the user's weights."""

  def __init__(self, s: run.Setup):
    self.large = s.grad(s.batch)
    self.pieces = np.stack([flat(s.grad(b)) for b in s.micro])  # (k, n)
    self.g = flat(self.large)
    self.w = s.weights / s.weights.sum()
    dtypes = [x.dtype for x in jax.tree.leaves(self.large) if jnp.issubdtype(x.dtype, jnp.inexact)]
    self.dtype = jnp.result_type(*dtypes) if dtypes else jnp.float32
    self.tol = min(tolerance(self.dtype, s.k), 1e-2)
    self.threshold = f"<= {fmt(self.tol)} ({TOL_UNITS}·k·eps({jnp.dtype(self.dtype).name}))"
    self.not_sum = self._decompose()

  def _decompose(self) -> str | None:
    """None when the large batch's gradient is a weighted sum of the micro-batches' (with the
    user's weights, else with fitted ones: `self.implied`), else the reason it is not."""
    self.residual, self.implied = rel(self.w @ self.pieces, self.g), self.w
    if self.residual <= self.tol:
      return None
    if self.pieces.shape[1] <= 2 * self.pieces.shape[0]:
      return "too few parameters to tell a sum over examples from any other loss"
    self.implied, self.residual = fit(self.pieces, self.g)
    if self.residual <= self.tol:
      return None
    return "the loss is not a sum over examples"


def _na(name: str, reason: str, threshold: str = "") -> Check:
  return Check(name, f"n/a: {reason}", "", threshold)


def _compare(name: str, got: Any, want: Any, ref: _Reference, threshold: str = "") -> Check:
  leaf, diff = worst(leaf_rel_diffs(got, want))
  verdict = "ok" if diff <= ref.tol else "FAIL"
  return Check(name, verdict, f"{fmt(diff)} (worst leaf {leaf})", threshold or ref.threshold)


def _equivalence(ref: _Reference, out: run.Run) -> Check:
  name = "equivalence: gradient"
  if ref.not_sum:
    return _na(name, "see 'decomposable'")
  return _compare(name, out.grads, ref.large, ref)


def _replay(s: run.Setup, windows: list[run.Window]) -> list[Any]:
  """The optimizer's updates for the front end's own gradients, at its own parameters."""
  update = jax.jit(s.optimizer.update)
  state, out = s.optimizer.init(s.params), []
  for w in windows:
    u, state = update(w.grads, state, w.params)
    out.append(u)
  return out


def _updates(s: run.Setup, ref: _Reference, out: run.Run) -> list[Check]:
  """The first and the last update against the inner optimizer applied once per update to the
  gradients the front end accumulated: a step count (a schedule) advanced per micro-step, or
  an update emitted from the wrong state, shows here. (Against the large batch's updates
  instead, Adam would turn the gradient's rounding into differences of 1e-2 where a gradient
  entry is near zero; the gradient itself is held to the large batch's above.)"""
  names = ("first update", f"schedule: update {s.num_updates}")
  if s.optimizer is None:
    return [_na(n, "no optimizer given") for n in names]
  if out.windows is None:
    return [_na(n, "your step applies the optimizer, once per update") for n in names]
  want = _replay(s, out.windows)
  threshold = f"{ref.threshold} from the optimizer on the accumulated gradient"
  rows = [_compare(names[0], out.windows[0].updates, want[0], ref, threshold)]
  if s.num_updates < 2:
    return [*rows, _na(names[1], "num_updates=1")]
  return [*rows, _compare(names[1], out.windows[-1].updates, want[-1], ref, threshold)]


def _distinct_pieces(pieces: np.ndarray) -> float:
  """The smallest relative difference between two micro-batches' gradients."""
  k = len(pieces)
  return min(rel(pieces[i], pieces[j]) for i in range(k) for j in range(k) if i != j)


def _counted(ref: _Reference, out: run.Run) -> Check:
  name = "every micro-batch counted"
  threshold = f"{ref.threshold} from Σ wᵢgᵢ/Σ wᵢ"
  if _distinct_pieces(ref.pieces) <= 100 * ref.tol:
    return _na(name, "two micro-batches have the same gradient: use varied examples", threshold)
  got = flat(out.grads)
  diff = rel(got, ref.w @ ref.pieces)
  if diff <= ref.tol:
    return Check(name, "ok", f"{fmt(diff)}", threshold)
  c, residual = fit(ref.pieces, got)
  seen = (
    f"fits Σ cᵢgᵢ, c = {coefficients(c)} (residual {fmt(residual)}); want {coefficients(ref.w)}"
  )
  lone = np.flatnonzero(np.abs(c) > 0.5 * np.abs(c).max())
  if residual <= ref.tol and len(lone) == 1 and np.all(np.abs(np.delete(c, lone)) < 1e-3):
    seen += f": only micro-batch {lone[0]} counted"
  return Check(name, "FAIL", f"{fmt(diff)}; {seen}", threshold)


def _weighting(ref: _Reference, weighted: bool) -> Check:
  name = "weighting"
  if ref.not_sum:
    return _na(name, "see 'decomposable'")
  mine = rel(ref.w @ ref.pieces, ref.g)
  mom = rel(ref.pieces.mean(0), ref.g)
  yours = "your weight_fn" if weighted else "equal weights (no weight_fn)"
  figure = f"{fmt(mine)} with {yours}; a mean of means: {fmt(mom)}"
  if mine <= ref.tol:
    return Check(name, "ok", figure, ref.threshold)
  implied = ref.implied / ref.implied.sum()
  figure += f"; the large batch weighs the micro-batches {coefficients(implied)}"
  return Check(name, "FAIL", figure, ref.threshold)


def _decomposable(ref: _Reference) -> Check:
  name = "decomposable"
  threshold = f"residual {ref.threshold}"
  figure = f"large = Σ cᵢgᵢ to {fmt(ref.residual)}"
  if ref.not_sum:
    figure += (
      " at best: no weighted sum of the micro-batches' gradients makes the large batch's "
      "(batch statistics such as BatchNorm, in-batch negatives, a loss normalised by the "
      "batch's own statistics): accumulation cannot match it"
    )
    return Check(name, f"n/a: {ref.not_sum}", figure, threshold)
  return Check(name, "ok", figure, threshold)


def _probed(s: run.Setup) -> Callable[..., Any]:
  """The keyed loss plus a probe: ``probe[row] · u(key)`` for each row of the micro-batch, so
  that the gradient of the probe's row r is the direction of the key its micro-batch saw."""

  def loss(params_probe, batch_index, key):
    params, probe = params_probe
    batch, index = batch_index
    u = jax.random.normal(jax.random.fold_in(key, 0x5EED), (PROBE_DIM,), probe.dtype)
    return s.keyed_loss(params, batch, key) + jnp.sum(probe[index] * u) / index.shape[0]

  return loss


def _keys_seen(s: run.Setup, front_end: Any, rng: Any) -> tuple[int, int]:
  """How many distinct keys the micro-batches saw, and how many rows reached the gradient."""
  size = jax.tree.leaves(s.batch)[0].shape[0]
  args = ((s.params, jnp.zeros((size, PROBE_DIM), jnp.float32)), (s.batch, jnp.arange(size)), rng)
  loss = _probed(s)
  if callable(front_end):
    grads = jax.jit(lambda p, b, key: front_end(loss, p, b, key))(*args)
  else:
    wf = None if s.weight_fn is None else (lambda p, b, key: s.weight_fn(b[0]))
    kw = dict(weight_fn=wf, rng_argnums=2, axis_name=s.axis_name, mesh=s.mesh)
    grads = jax.jit(microbatch(jax.grad(loss), s.k, **kw))(*args)
  rows = np.asarray(grads[1], np.float64)
  norms = np.linalg.norm(rows, axis=1)
  seen = rows[norms > 0] / norms[norms > 0, None]
  keys: list[np.ndarray] = []
  for r in seen:
    if not any(float(r @ q) > SAME_KEY_COSINE for q in keys):
      keys.append(r)
  return len(keys), len(seen)


def _randomness(s: run.Setup, front_end: Any, rng: Any) -> Check:
  name = "randomness: a key per micro-batch"
  threshold = f">= k={s.k} distinct keys"
  if rng is None:
    return _na(name, "no rng given", threshold)
  if front_end in ("accumulate", "TrainStep"):
    return _na(name, "your loop passes each micro-step its key: fold in the step", threshold)
  distinct, rows = _keys_seen(s, front_end, rng)
  figure = f"{distinct} distinct keys over {rows} rows"
  return Check(name, "ok" if distinct >= s.k else "FAIL", figure, threshold)


def _collectives(s: run.Setup, front_end: Any) -> Check:
  name = "collectives"
  threshold = f"no reduction over the data axis per micro-batch (>= {run.GRAD_MIN_BYTES} B)"
  if s.mesh is None and s.axis_name is None:
    return _na(name, "no mesh or axis_name given", threshold)
  texts = run.programs(s, front_end)
  if texts is None:
    return _na(name, "accumulate runs in your own step: audit front_end='TrainStep'", threshold)
  if "step" in texts:
    text = texts["step"]
    loop, total = run.reductions(s, text, "loop"), run.reductions(s, text)
    figure = f"{total - loop} + {loop}×k reductions per update ({loop} in the micro-batch loop)"
    per_micro = loop
  else:
    per_micro = run.reductions(s, texts["accumulating"])
    close = run.reductions(s, texts["closing"], "unconditional")
    rare = run.reductions(s, texts["closing"]) - close  # TrainStep's exact re-reduction
    figure = f"{close} + {per_micro}×k reductions per update ({per_micro} per micro-step"
    figure += f"; {rare} more if a device drops a window's last micro-batch)" if rare else ")"
    text = texts["accumulating"] + texts["closing"]
  figure += f", {run.gathers(text)} all-gathers"
  return Check(name, "ok" if per_micro == 0 else "FAIL", figure, threshold)


def _device_bytes(x: Any) -> int:
  if isinstance(x, jax.Array) and x.addressable_shards:
    return x.addressable_shards[0].data.nbytes
  return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _accumulator(out: run.Run) -> tuple[Check, int]:
  name = "accumulator"
  threshold = "dtype at least float32"
  if out.accumulator is None:
    return _na(name, "your own accumulator is not visible to the audit", threshold), 0
  leaves = jax.tree.leaves(out.accumulator)
  size = sum(_device_bytes(x) for x in leaves)
  dtypes = sorted({jnp.dtype(x.dtype).name for x in leaves})
  narrow = [d for d in dtypes if jnp.issubdtype(d, jnp.floating) and jnp.dtype(d).itemsize < 4]
  figure = f"{size / 2**20:.3f} MiB per device, {'/'.join(dtypes)}"
  return Check(name, "FAIL" if narrow else "ok", figure, threshold), size


def _memory(s: run.Setup, front_end: Any, acc_bytes: int) -> Check:
  name = "peak memory"
  micro, large = run.peak_bytes(s, front_end)
  if micro is None or large is None:
    return _na(name, "this backend reports no memory analysis")
  micro += 0 if front_end == "microbatch" or callable(front_end) else acc_bytes
  figure = f"{micro / 2**20:.3f} MiB accumulated vs {large / 2**20:.3f} MiB large batch"
  return Check(name, "info", f"{figure} ({micro / large:.2f}×)", "compiled peak")


def _setup(loss_fn, params, batch, k, rng, weight_fn, optimizer, wrap, mesh, axis_name, accum_dtype,
           num_updates) -> run.Setup:  # fmt: skip
  arrays, static = _split_static(params)
  if rng is None:
    loss = lambda p, b: loss_fn(_combine(p, static), b)
    keyed = None
  else:
    loss = lambda p, b: loss_fn(_combine(p, static), b, None)
    keyed = lambda p, b, key: loss_fn(_combine(p, static), b, key)
  micro = run.strided(batch, k)
  weights = np.ones(k)
  if weight_fn is not None:
    weights = np.array([float(weight_fn(b)) for b in micro])
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
      raise ValueError(f"audit: weight_fn must give finite weights >= 0, not all 0; got {weights}.")
  return run.Setup(
    loss, keyed, arrays, batch, k, micro, weights, weight_fn, optimizer, wrap, mesh, axis_name,
    accum_dtype, num_updates,
  )  # fmt: skip


def audit(
  loss_fn: Callable[..., Any],
  params: Any,
  batch: Any,
  k: int,
  *,
  front_end: FrontEnd | Callable[..., Any] = "microbatch",
  optimizer: optax.GradientTransformation | None = None,
  weight_fn: Callable[[Any], Any] | None = None,
  rng: Any = None,
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None,
  mesh: Any = None,
  axis_name: Any = None,
  accum_dtype: Any = jnp.float32,
  num_updates: int = 3,
) -> AuditReport:
  """Checks gradient accumulation on your model against the large batch, before a long run.

  Runs `batch` once as one large batch and once as `k` micro-batches through `front_end`
  (micro-batch ``i`` holds rows ``i, i+k, …``, `microbatch`'s default split), and reports one
  row per check, each with its verdict ("ok", "FAIL", "info" or "n/a: <reason>"), the measured
  figure and the threshold (``TOL_UNITS · k · eps(dtype)`` of the gradients' dtype, at most
  1e-2: float64 under ``jax.enable_x64``, then tight):

  * equivalence: the accumulated gradient against the large batch's, per leaf
    ``max|Δ| / max|large|``, the worst leaf named;
  * first update (across-steps front ends, with `optimizer`): the update against the
    optimizer applied once to the accumulated gradient;
  * every micro-batch counted: the gradient equals ``Σ wᵢgᵢ / Σ wᵢ`` of the micro-batches'
    own gradients (computed one by one), not the first's or the last's alone;
  * weighting: your weights against the large batch, and what a mean of means would make;
  * randomness (with `rng`): no two micro-batches saw the same key (a probe in the loss);
  * schedule: the `num_updates`-th update, the same way (a schedule counting micro-steps
    shows here);
  * decomposable: whether the large batch's gradient is a weighted sum of the micro-batches'
    at all; if not (BatchNorm, in-batch negatives), the rows above say "n/a", not FAIL;
  * collectives (with `mesh` or `axis_name`): gradient reductions per update in the compiled
    programs, FAIL when one runs per micro-batch;
  * accumulator (dtype and bytes per device; FAIL below float32) and peak memory.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the loss of a batch (a mean, or a
      token-weighted mean). With `rng`: ``loss_fn(params, batch, key)``, deterministic (no
      dropout) when ``key`` is None, which the numeric checks use.
    params: the parameters (a pytree; non-array leaves, as in an Equinox module, pass through).
    batch: one logical batch, a pytree whose leaves share the leading batch axis.
    k: the number of micro-batches, an int >= 2 dividing the batch size.
    front_end: "microbatch", "accumulate" or "TrainStep" (this library's, run as a user would),
      or your own in-step accumulation ``fn(loss_fn, params, batch, *keys) -> grads`` (it splits
      the batch into `k` itself).
    optimizer: the inner optimizer, for the update rows of the across-steps front ends (an
      in-step front end leaves the optimizer to your step); None skips them.
    weight_fn: ``weight_fn(micro_batch) -> scalar``, e.g. its count of real tokens.
    rng: a PRNG key for the randomness check (see `loss_fn`).
    wrap: with front_end="accumulate": your accumulating transformation as a function of the
      inner optimizer (default ``accumulate(inner, k)``); called with ``weight=`` when
      `weight_fn` is given.
    mesh, axis_name: the mesh and data axis, as the front ends take them.
    accum_dtype: the library front ends' accumulation dtype.
    num_updates: the updates run for the schedule row.

  Returns:
    An `AuditReport`: ``print(report)`` shows the table, ``report.assert_ok()`` raises
    `AssertionError` with it when a check failed.

  Raises:
    TypeError, ValueError: for a bad argument (named), before anything runs.

  >>> import jax.numpy as jnp, optax, optax_accum
  >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
  >>> batch = {"x": jnp.arange(24.0).reshape(8, 3) / 10, "y": jnp.arange(8.0)}
  >>> report = optax_accum.audit(loss, jnp.ones(3), batch, 4, optimizer=optax.sgd(0.1))
  >>> report.ok
  True
  """
  _check_args(loss_fn, k, front_end, optimizer, weight_fn, num_updates, wrap)
  _batch_size(batch, k)
  s = _setup(loss_fn, params, batch, k, rng, weight_fn, optimizer, wrap, mesh, axis_name,
             accum_dtype, num_updates)  # fmt: skip
  ref = _Reference(s)
  if callable(front_end):
    out = run.run_custom(s, front_end)
  else:
    out = {"microbatch": run.run_microbatch, "accumulate": run.run_accumulate,
           "TrainStep": run.run_train_step}[front_end](s)  # fmt: skip
  accumulator, acc_bytes = _accumulator(out)
  first, last = _updates(s, ref, out)
  checks = (
    _equivalence(ref, out),
    first,
    _counted(ref, out),
    _weighting(ref, weight_fn is not None),
    _randomness(s, front_end, rng),
    last,
    _decomposable(ref),
    _collectives(s, front_end),
    accumulator,
    _memory(s, front_end, acc_bytes),
  )
  name = front_end if isinstance(front_end, str) else getattr(front_end, "__name__", "custom")
  return AuditReport(name, k, checks)
