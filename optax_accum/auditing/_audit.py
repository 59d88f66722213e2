"""`audit`: a pre-flight check of gradient accumulation on the user's own model.

It runs the large batch and the loop under test on the same data and reports, check by check,
what differs (`AuditReport`). The reference side is computed here directly (``jax.grad`` of the
loss on the whole batch and on each micro-batch, at the parameters each update started from);
the side under test is the user's loop or the public front ends, run as a user runs them
(`_run`, `_step`); the rows are `_checks` and `_collectives`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum.auditing import _checks as checks
from optax_accum.auditing import _collectives as collectives
from optax_accum.auditing import _keys as keys
from optax_accum.auditing import _run as run
from optax_accum.auditing import _step
from optax_accum.auditing import _through as through
from optax_accum.auditing._checks import TOL_UNITS, tolerance
from optax_accum.auditing._report import AuditReport, fit, flat, fmt, rel

__all__ = ["TOL_UNITS", "audit", "tolerance"]

FrontEnd = Literal["microbatch", "accumulate", "TrainStep", "data_parallel"]
_FRONT_ENDS = ("microbatch", "accumulate", "TrainStep", "data_parallel")
_IN_STEP_NOTE = "accumulate runs in your own step: audit front_end='TrainStep'"


def _check_args(loss_fn, k, front_end, optimizer, weight_fn, num_updates, wrap, reduction) -> None:
  if not callable(loss_fn):
    raise TypeError(f"audit: loss_fn must be callable, got {loss_fn!r}.")
  if isinstance(k, bool) or not isinstance(k, int) or k < 2:
    raise ValueError(f"audit: k must be an int >= 2 (the micro-batches per update), got {k!r}.")
  if not (front_end is None or callable(front_end) or front_end in _FRONT_ENDS):
    raise ValueError(
      f"audit: front_end must be one of {_FRONT_ENDS} or a callable "
      f"``fn(loss_fn, params, batch, *keys) -> grads``, got {front_end!r}."
    )
  if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
      f"audit: optimizer must be an optax GradientTransformation (the one applied once per "
      f"update), got {optimizer!r}."
    )
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"audit: weight_fn must be callable or None, got {weight_fn!r}.")
  if isinstance(num_updates, bool) or not isinstance(num_updates, int) or num_updates < 1:
    raise ValueError(f"audit: num_updates must be a positive int, got {num_updates!r}.")
  if wrap is not None and front_end != "accumulate":
    raise ValueError(f"audit: wrap is for front_end='accumulate', got front_end={front_end!r}.")
  if reduction not in ("mean", "sum"):
    raise ValueError(f"audit: reduction must be 'mean' or 'sum', got {reduction!r}.")


def _check_step(step, micro_step, front_end, optimizer, opt_state) -> None:
  if step is not None and micro_step is not None:
    raise ValueError(
      "audit: pass step= (one call per update) or micro_step= (one per micro-batch), not both."
    )
  user = step if step is not None else micro_step
  if user is None:
    if opt_state is not None:
      raise ValueError("audit: opt_state is for step= or micro_step=.")
    return
  what = "step" if step is not None else "micro_step"
  if not callable(user):
    raise TypeError(f"audit: {what} must be callable, got {user!r}.")
  if front_end is not None:
    raise ValueError(
      f"audit: {what}= is the loop under test: leave front_end unset, got {front_end!r}."
    )
  if optimizer is None:
    raise ValueError(
      f"audit: {what}= needs optimizer=, the optimizer your step applies once per update (the "
      "audit reads the gradient it received back through it)."
    )
  if micro_step is not None and opt_state is None:
    raise ValueError(
      "audit: micro_step= needs opt_state=, the state your loop starts from, e.g. "
      "tx.init(params) for tx = optax.MultiSteps(optimizer, k)."
    )


def _check_rng(rng: Any) -> None:
  if rng is None or callable(rng) or keys.is_key(rng):
    return
  listed = isinstance(rng, Sequence) or (hasattr(rng, "shape") and np.ndim(rng) >= 1)
  if listed and all(keys.is_key(x) for x in rng):
    return
  raise TypeError(
    "audit: rng must be a PRNG key, a sequence of keys (the key your loop passes on each call) "
    f"or a function of the call's index returning one, got {rng!r}."
  )


def _check_loss(s: run.Setup, loss_fn: Callable[..., Any]) -> None:
  """Refuses, before anything is compiled, a loss the audit cannot differentiate: one that
  fails when called as ``loss_fn(params, micro_batch[, key])``, or returns anything but a
  scalar."""
  call = "loss_fn(params, batch, key)" if s.keyed is not None else "loss_fn(params, batch)"
  try:
    out = jax.eval_shape(s.loss, s.params, s.micro[0])
  except TypeError as e:
    key = "" if s.keyed is not None else " (does it take a key? pass rng=, the key your loop uses)"
    raise TypeError(f"audit: loss_fn raised TypeError when called as {call}{key}: {e}") from None
  if isinstance(out, jax.ShapeDtypeStruct) and out.shape == ():
    return
  got = f"shape {out.shape}" if isinstance(out, jax.ShapeDtypeStruct) else type(out).__name__
  aux = " (a loss with aux: pass loss_fn=lambda p, b: f(p, b)[0])" if isinstance(out, tuple) else ""
  raise TypeError(
    f"audit: loss_fn must return a scalar, the loss of the batch it is given (a mean or a sum "
    f"over its examples), got {got} from {call}{aux}."
  )


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


class Reference:
  """The large batch's gradient and each micro-batch's, at any window's parameters; the large
  batch's own weights of the micro-batches (``implied``), and whether there are any."""

  DATA_DEPENDENT = "the weights depend on the data"
  TOO_FEW = (
    "too few parameters to tell a sum over examples from any other loss (at most 2k: any "
    "gradient fits a weighted sum of k micro-batches'); audit a model with more parameters"
  )

  def __init__(self, s: run.Setup):
    self.s = s
    self._large: dict[int, Any] = {}
    self._pieces: dict[int, np.ndarray] = {}
    self.pieces0 = self.pieces(s.params)
    self.g = flat(self.large(s.params))
    self.declared = s.weights / s.weights.sum()
    leaves = jax.tree.leaves(self.large(s.params))
    dtypes = [x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    self.dtype = jnp.result_type(*dtypes) if dtypes else jnp.float32
    computed = compute_dtype(s)
    self.threshold = ""
    if computed is not None and jnp.finfo(computed).eps > jnp.finfo(self.dtype).eps:
      self.dtype, self.threshold = computed, f", the loss computing in {jnp.dtype(computed).name}"
    self.tol = tolerance(self.dtype, s.k)
    name = jnp.dtype(self.dtype).name
    self.threshold = f"<= {fmt(self.tol)} ({TOL_UNITS}·k·eps({name}){self.threshold})"
    self.same_pieces = self._same_pieces()
    self.moved = 0.0
    self.not_sum = self._decompose()
    self.draws_per_micro_batch = (0, 0) if s.keyed is None else checks.loss_draws(s)
    self._fits: dict[bytes, checks.Fitted] = {}
    self._through: dict[tuple[int, bool], tuple[str, float]] = {}
    self.explained: Any = None  # the rows a whole step judged through its optimizer gets

  def large(self, params: Any) -> Any:
    if id(params) not in self._large:
      self._large[id(params)] = self.s.grad(params, self.s.batch)
    return self._large[id(params)]

  def through(self, w: run.Window, from_start: bool = False) -> tuple[str, float]:
    """A window judged through its optimizer (`_through.compare`) against the large
    batch's gradient: from the state before its updating call, or from its window's start."""
    key = (id(w.through), from_start)
    if key not in self._through:
      grads = self.large(w.params)
      self._through[key] = through.compare(w.through, grads, self.tol, from_start=from_start)
    return self._through[key]

  def pieces(self, params: Any) -> np.ndarray:
    """The micro-batches' gradients at `params`, ``(k, n)``; a non-finite one (an all-padding
    micro-batch's 0/0) as zeros: it counts for nothing in the large batch either."""
    if id(params) not in self._pieces:
      rows = np.stack([flat(self.s.grad(params, b)) for b in self.s.micro])
      self._pieces[id(params)] = np.where(np.isfinite(rows), rows, 0.0)
    return self._pieces[id(params)]

  def fitted(self, got: np.ndarray, allowed: float) -> checks.Fitted:
    """The loop's gradient `got` as a weighted sum over the micro-batches, or where that does
    not fit to `allowed` and the batch is split over devices, over each device's share of each
    micro-batch (a loop that weighs per device)."""
    key = got.tobytes()
    if key not in self._fits:
      fitted = checks.Fitted(got, self.pieces0, self.implied, "micro-batches")
      shares = self.shares() if fitted.residual > allowed else None
      if shares is not None:
        want, _ = fit(shares, self.g)
        finer = checks.Fitted(got, shares, want, "devices' shares of the micro-batches")
        fitted = finer if finer.residual <= allowed else fitted
      self._fits[key] = fitted
    return self._fits[key]

  def shares(self) -> np.ndarray | None:
    """The gradient of each device's share of each micro-batch, ``(k·D, n)`` (micro-batch
    ``i`` of device ``d``: the rows of device d's block with ``row % k == i``, as `microbatch`
    splits each device's rows), where the loop splits the batch over D > 1 devices."""
    s = self.s
    axis = collectives.data_axis(s)
    if s.mesh is None or axis is None:
      return None
    axes = axis if isinstance(axis, tuple) else (axis,)
    devices = int(np.prod([s.mesh.shape[a] for a in axes]))
    size = jax.tree.leaves(s.batch)[0].shape[0]
    if devices < 2 or size % (devices * s.k):
      return None
    block = size // devices
    host = jax.tree.map(np.asarray, s.batch)
    rows = [
      np.arange(d * block + i, (d + 1) * block, s.k) for i in range(s.k) for d in range(devices)
    ]
    params = jax.device_get(s.params)
    grad = lambda b: s.aot("share", run.grad_of(s.loss), params, b)(params, b)
    try:  # on one device: a loss that names mesh axes (out_sharding=) cannot run there
      pieces = np.stack([flat(grad(jax.tree.map(lambda x, r=r: x[r], host))) for r in rows])
    except Exception:  # noqa: BLE001  # then the rows say the loop is no sum of micro-batches
      return None
    return np.where(np.isfinite(pieces), pieces, 0.0)

  def _same_pieces(self) -> bool:
    eps = float(jnp.finfo(self.dtype).eps)
    p, k = self.pieces0, self.s.k
    return any(rel(p[i], p[j]) <= checks.SAME_EPS * eps for i in range(k) for j in range(i))

  def _decompose(self) -> str | None:
    """None when the large batch's gradient is ``Σ Wᵢgᵢ`` over the micro-batches' (``W`` the
    declared weights times a scale, else fitted: `implied`), else the reason it is not."""
    base = self.declared @ self.pieces0
    scale = float(base @ self.g / (base @ base)) if base @ base > 0 else 1.0
    self.implied, self.residual = scale * self.declared, rel(scale * base, self.g)
    if self.residual <= self.tol:
      return None
    if self.pieces0.shape[1] <= 2 * self.pieces0.shape[0]:
      return self.TOO_FEW
    self.implied, self.residual = fit(self.pieces0, self.g)
    if self.residual > self.tol:
      return "the loss is not a sum over examples"
    return self.DATA_DEPENDENT if self._data_dependent() else None

  def _data_dependent(self) -> bool:
    """Whether fitted weights fail to follow the data: with the heaviest micro-batch's rows
    replaced by the lightest's, the large batch must weigh the others as before (as a sum, or
    as a mean renormalised by the new total)."""
    s, w = self.s, self.implied
    heavy, light = int(np.argmax(np.abs(w))), int(np.argmin(np.abs(w)))
    batch = jax.tree.map(lambda x: _swapped(x, heavy, light, s.k), s.batch)
    got = flat(s.grad(s.params, batch))
    w2 = w.copy()
    w2[heavy] = w[light]
    pieces = self.pieces0.copy()
    pieces[heavy] = pieces[light]
    as_sum = w2 @ pieces
    as_mean = as_sum * (w.sum() / w2.sum()) if w2.sum() else as_sum
    self.moved = min(rel(as_sum, got), rel(as_mean, got))
    return self.moved > self.tol


def compute_dtype(s: run.Setup) -> Any:
  """The least precise floating dtype the gradient of one micro-batch is computed in (the
  output of any operation but a cast), or None: a loss that casts float32 parameters to
  bfloat16 rounds every product to bfloat16, and the large batch and the micro-batches then
  differ by bfloat16's rounding whatever the gradients' own dtype."""
  jaxpr = jax.make_jaxpr(run.grad_of(s.loss))(s.params, s.micro[0])
  found: list[Any] = []

  def visit(j: Any) -> None:
    for eqn in j.eqns:
      if eqn.primitive.name != "convert_element_type":
        for v in eqn.outvars:
          dtype = getattr(getattr(v, "aval", None), "dtype", None)
          if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            found.append(dtype)
      for sub in _sub_jaxprs(eqn.params.values()):
        visit(sub)

  visit(jaxpr.jaxpr)
  return max(found, key=lambda d: jnp.finfo(d).eps) if found else None


def _sub_jaxprs(values: Any) -> list[Any]:
  """The jaxprs among an equation's parameters (a scan's body, a cond's branches, a pjit's)."""
  out = []
  for v in values:
    for x in v if isinstance(v, (tuple, list)) else (v,):
      inner = getattr(x, "jaxpr", x)
      if hasattr(inner, "eqns"):
        out.append(inner)
  return out


def _swapped(x: Any, heavy: int, light: int, k: int) -> Any:
  """`x` with micro-batch `heavy`'s rows replaced by micro-batch `light`'s, placed as `x` (on
  the host: a scatter into a sharded array needs an output sharding of its own)."""
  y = np.array(x)
  y[heavy::k] = y[light::k]
  return jax.device_put(y, x.sharding) if isinstance(x, jax.Array) else y


def _setup(loss_fn, params, batch, k, rng, weight_fn, optimizer, wrap, mesh, axis_name, accum_dtype,
           reduction, num_updates, step, micro_step, opt_state) -> run.Setup:  # fmt: skip
  arrays = run.arrays_of(params)
  static = jax.tree.map(lambda a, p: p if a is None else None, arrays, params, is_leaf=_none)
  full = lambda p: jax.tree.map(lambda a, s: a if s is None else s, p, static, is_leaf=_none)
  if rng is None:
    loss, keyed = (lambda p, b: loss_fn(full(p), b)), None
  else:  # every draw zero bits: the numbers do not depend on which key the loop passes
    fixed = keys.audit_key(jax.random.key(0), keys.RECORDING)
    keyed = lambda p, b, key: loss_fn(full(p), b, key)
    loss = lambda p, b: keyed(p, b, fixed)
  micro = run.strided(batch, k)
  weights = np.ones(k)
  if weight_fn is not None:
    weights = np.array([float(weight_fn(b)) for b in micro])
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
      raise ValueError(f"audit: weight_fn must give finite weights >= 0, not all 0; got {weights}.")
  user_step = step if step is not None else micro_step
  if user_step is not None and opt_state is None:
    opt_state = optimizer.init(arrays)
  return run.Setup(
    loss, keyed, arrays, static, batch, k, micro, weights, weight_fn, optimizer, wrap, mesh,
    axis_name, accum_dtype, reduction, num_updates, rng, user_step, micro_step is not None,
    opt_state,
  )  # fmt: skip


def _none(x: Any) -> bool:
  return x is None


def _programs(s: run.Setup, out: run.Run) -> list[tuple[str, str]] | None:
  """The loop's compiled programs where the collectives row reads them (with a mesh or an
  axis): compiling a step again costs seconds, for nothing on one device."""
  if out.programs is None or (s.mesh is None and s.axis_name is None):
    return None
  return out.programs()


def _run(s: run.Setup, front_end: Any) -> run.Run:
  if s.step is not None:
    return _step.run_step(s)
  if front_end in (None, "microbatch"):
    return run.run_in_step(s, None)
  if callable(front_end):
    return run.run_in_step(s, front_end)
  if front_end == "data_parallel" and (s.axis_name is None or s.mesh is None):
    raise ValueError("audit: front_end='data_parallel' needs mesh= and axis_name= (the data axis).")
  return {"accumulate": run.run_accumulate, "TrainStep": run.run_train_step,
          "data_parallel": run.run_data_parallel}[front_end](s)  # fmt: skip


def audit(
  loss_fn: Callable[..., Any],
  params: Any,
  batch: Any,
  k: int,
  *,
  step: Callable[..., Any] | None = None,
  micro_step: Callable[..., Any] | None = None,
  front_end: FrontEnd | Callable[..., Any] | None = None,
  optimizer: optax.GradientTransformation | None = None,
  opt_state: Any = None,
  weight_fn: Callable[[Any], Any] | None = None,
  rng: Any = None,
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None,
  mesh: Any = None,
  axis_name: Any = None,
  accum_dtype: Any = jnp.float32,
  reduction: Literal["mean", "sum"] = "mean",
  num_updates: int = 3,
) -> AuditReport:
  """Checks gradient accumulation on your model against the large batch, before a long run.

  Runs `batch` once as one large batch and as `k` micro-batches through the loop under test
  (micro-batch ``i`` holds rows ``i, i+k, …``, `microbatch`'s default split): your whole
  training step (`step` or `micro_step`), your own in-step accumulation (`front_end` a
  function) or one of this library's front ends. The large batch is the ground truth: every
  update's gradient is compared with the large batch's at the parameters that update started
  from; where they differ, the loop's gradient is fitted as ``Σ cᵢgᵢ`` over the micro-batches'
  own gradients, and its coefficients say which row failed. One row per check, each with its
  verdict ("ok", "FAIL", "info", "n/a: <reason>" or "not judged: <reason>"), the measured
  figure and the threshold
  (``TOL_UNITS · k · eps`` of the gradients' dtype, or of the least precise dtype the loss
  computes in, at most 1e-2: float64 under ``jax.enable_x64``, then tight):

  * equivalence: each update's gradient against its own window's large batch, per leaf
    ``max|Δ| / max|large|``, the worst leaf named;
  * first update (with `optimizer`, where the loop applies it): the update against the optimizer
    applied once to the loop's gradient;
  * every micro-batch counted: each micro-batch is in the loop's gradient (not the first's or
    the last's alone), no micro-batch of an earlier window is (an accumulator not zeroed), and
    an update comes every `k` micro-batches (the window length is measured);
  * weighting: the loop's weights of the micro-batches against the large batch's, with the
    cause (a mean of means, a scale k× off); declared weights only feed the message;
  * randomness (with `rng`): every micro-batch drew with keys of its own (the keys the loss
    drew with are recorded, however the loop derived them);
  * schedule: the `num_updates`-th update, the same way (a schedule counting micro-steps);
  * decomposable: whether the large batch's gradient is a weighted sum of the micro-batches' at
    all, with weights that follow the data; if not (BatchNorm, in-batch negatives, a max over
    the batch), the rows above say "n/a", not FAIL;
  * collectives (with `mesh` or `axis_name`): the elements reduced over the data axis per
    update in the compiled programs, FAIL above one gradient's (a reduction per micro-batch,
    even an exact one, or k of them combined into one collective); with parameters sharded over
    the data axis (FSDP), reduce-scatters per micro-batch are "info" (the least-memory points of
    ``keep_unsharded``), all-reduces above one gradient still FAIL;
  * accumulator (dtype and bytes per device; FAIL below float32) and peak memory.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the loss of a batch (a mean, a
      token-weighted mean, or with ``reduction="sum"`` a sum). With `rng`:
      ``loss_fn(params, batch, key)``. The audit's keys split and fold in like JAX's, but every
      draw is zero bits (a uniform is 0; dropout keeps every unit), so the numbers do not depend
      on the keys and the numeric checks stay exact with dropout on.
    params: the parameters (a pytree; non-array leaves, as in an Equinox module, pass through).
    batch: one logical batch, a pytree whose leaves share the leading batch axis.
    k: the number of micro-batches, an int >= 2 dividing the batch size.
    step: your whole training step, ``step(params, opt_state, batch[, key]) -> (params,
      opt_state, ...)`` (or ``((params, opt_state), metrics)``), as you jit it (donated
      arguments included: it is given copies): one call takes the whole batch and makes one
      update (its accumulation inside). Needs `optimizer`, the optimizer it applies, through
      which the audit reads back the gradient it received (from its first moment, momentum or
      update; its state is found in your step's by structure and shapes, part by part for a
      chain). Behind an optimizer not elementwise affine in the gradient (clipping that acts,
      Adafactor, Muon, schedule-free) the step is judged end to end instead: your step's new
      optimizer state and parameters against the optimizer applied to the large batch's
      gradient from the step's own state, each entry allowed the optimizer's measured response
      to a gradient error within the tolerance. Where neither is possible the equivalence row
      says "not judged" and the report is not ok. `opt_state` defaults to
      ``optimizer.init(params)``.
    micro_step: the same for a step your loop calls once per micro-batch (``optax.MultiSteps``,
      `accumulate`, a `TrainStep`): the audit feeds it micro-batch after micro-batch and an
      update is where the parameters change. Needs `optimizer` (the inner one) and `opt_state`
      (the state your loop starts from, e.g. ``optax.MultiSteps(optimizer, k).init(params)``).
    front_end: instead of a step, "microbatch" (the default), "accumulate", "TrainStep" or
      "data_parallel" (``accumulate(axis_name=)`` in a step bound by `data_parallel`, as the
      sharding guide writes it; needs `mesh` and `axis_name`), run as a user would; or your own
      in-step accumulation ``fn(loss_fn, params, batch, *keys) -> grads`` (it splits the batch
      into `k` itself; with `rng` it gets a key).
    optimizer: the optimizer applied once per update: for `step`/`micro_step` the one your step
      applies; for the across-steps front ends the inner one (the update rows); None skips the
      update rows.
    opt_state: with `step`/`micro_step`: your step's initial optimizer state.
    weight_fn: ``weight_fn(micro_batch) -> scalar``, e.g. its count of real tokens: given to
      the library's front ends; for your own loop, what you meant it to weigh (the message says
      whether the loop does).
    rng: a PRNG key for the randomness check: given to an in-step loop or step (each update);
      for a loop that spans calls, the keys it passes: a sequence (one per call) or a function
      of the call's index (``lambda i: jax.random.fold_in(key, i)``).
    wrap: with front_end="accumulate": your accumulating transformation as a function of the
      inner optimizer (default ``accumulate(inner, k)``); called with ``weight=`` when
      `weight_fn` is given.
    mesh, axis_name: the mesh and data axis, as the front ends take them.
    accum_dtype, reduction: the library front ends' accumulation dtype and reduction ("sum":
      ``Σ wᵢgᵢ``, for a loss that sums over examples).
    num_updates: the updates run (each compared with its own window's large batch).

  Returns:
    An `AuditReport`: ``print(report)`` shows the table, ``report.assert_ok()`` raises
    `AssertionError` with it when a check failed or could not be judged (``report.ok`` is
    then False), ``report[name]`` is one row.

  Raises:
    TypeError, ValueError: for a bad argument (named), before anything runs; TypeError when
      your step cannot be called as above or returns something else (with how it was called
      and the usual fixes: a Flax TrainState step, an NNX step, a key, the optimizer).

  >>> import jax, jax.numpy as jnp, optax, optax_accum
  >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
  >>> batch = {"x": jnp.arange(24.0).reshape(8, 3) / 10, "y": jnp.arange(8.0)}
  >>> opt = optax.sgd(0.1)
  >>> @jax.jit
  ... def step(w, opt_state, batch):  # a mean of k = 4 micro-batch gradients
  ...   grads = sum(jax.grad(loss)(w, jax.tree.map(lambda x: x[i::4], batch)) for i in range(4))
  ...   updates, opt_state = opt.update(grads / 4, opt_state, w)
  ...   return optax.apply_updates(w, updates), opt_state
  >>> optax_accum.audit(loss, jnp.ones(3), batch, 4, step=step, optimizer=opt).ok
  True
  """
  _check_args(loss_fn, k, front_end, optimizer, weight_fn, num_updates, wrap, reduction)
  _check_step(step, micro_step, front_end, optimizer, opt_state)
  _check_rng(rng)
  if step is not None or micro_step is not None:
    what = "step" if step is not None else "micro_step"
    _step.check_signature(step or micro_step, what, rng is not None)
  _batch_size(batch, k)
  s = _setup(loss_fn, params, batch, k, rng, weight_fn, optimizer, wrap, mesh, axis_name,
             accum_dtype, reduction, num_updates, step, micro_step, opt_state)  # fmt: skip
  _check_loss(s, loss_fn)
  ref = Reference(s)
  draws = None
  with keys.recording(collectives.data_axis(s)) as recorded:
    out = _run(s, front_end)
  if s.keyed is not None and not (front_end == "TrainStep" and not run.train_step_passes_keys(s)):
    draws = recorded
  accumulator, acc_bytes = checks.accumulator(out)
  first, last = checks.updates(s, ref, out)
  in_step = not out.across and s.step is None
  rows = (
    checks.equivalence(ref, out),
    first,
    checks.counted(s, ref, out),
    checks.weighting(s, ref, out),
    checks.randomness(s, ref, draws, out),
    last,
    checks.decomposable(ref),
    collectives.check(s, _programs(s, out), _IN_STEP_NOTE),
    accumulator,
    checks.memory(s, in_step, acc_bytes),
  )
  user = s.step if s.step is not None else front_end
  name = user if isinstance(user, str) else getattr(user, "__name__", None)
  name = name or ("microbatch" if user is None else type(user).__name__)
  return AuditReport(name, k, rows)
