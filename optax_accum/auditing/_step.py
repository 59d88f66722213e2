"""The audit of a user's whole training step: ``step(params, opt_state, batch[, key])``.

The step is the user's code, optimizer included: the audit sees what it returns, the new
parameters and optimizer state, not the gradient its optimizer received. It reads that gradient
back through the optimizer (`read_back`): the optimizer is given (it is the user's, applied once
per update), so its update and each gradient-shaped leaf of its new state are functions of the
gradient the audit can evaluate. Where one of them is elementwise affine in the gradient (Adam's
and Lion's first moment, a momentum trace, SGD's update), ``a + b ⊙ g`` with ``b`` nowhere zero,
the gradient is ``(leaf - a) / b``: exact up to the leaf's own rounding (for SGD's update, one
rounding of the parameters, which the audit adds to its threshold). A state leaf is preferred
over the update for that reason. Where none is (clipping that acts, Adafactor, Muon,
schedule-free), the update is kept to be judged through the optimizer (`_through`).

A step that takes the whole batch makes one update per call (the accumulation is inside it); a
step that takes one micro-batch (`optax.MultiSteps`, `accumulate`, a `TrainStep`) is fed
micro-batch after micro-batch, and an update is where the parameters or the optimizer's
moments change. Its optimizer's state is found inside the step's state by structure and
shapes (`locate`).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.auditing import _run as run
from optax_accum.auditing._through import Through, applied, placed
from optax_accum.front_ends._train_step import TrainStep

# A leaf is read as affine in the gradient when a random gradient's value is predicted by
# ``a + b ⊙ g`` to this relative error (float32 rounding of a, b and the prediction is ~1e-7).
AFFINE_RTOL = 1e-4


class ReadBack(NamedTuple):
  """The gradient an update received, read back from the step's outputs."""

  grads: Any  # float64 host arrays, the parameters' tree
  slack: float  # the reading's own error, relative to the largest gradient entry
  source: str  # what it was read from, e.g. "the update" or "state[0].mu"


def _signature(tree: Any, dtype: bool) -> tuple[Any, list[tuple[Any, Any]]]:
  leaves = [(np.shape(x), jnp.result_type(x) if dtype else None) for x in jax.tree.leaves(tree)]
  return jax.tree.structure(tree), leaves


def _matches(template: Any, *, dtype: bool = True) -> Any:
  """A predicate: a subtree with `template`'s structure and shapes (and dtypes, with `dtype`)."""
  want = _signature(template, dtype)
  return lambda x: jax.tree.structure(x) == want[0] and _signature(x, dtype) == want


def _found(state: Any, template: Any) -> list[Any]:
  """The subtrees of `state` shaped as `template`: of its dtypes, else of any (float32
  moments beside bfloat16 parameters: the optimizer runs on float32 master weights)."""
  for dtype in (True, False):
    match = _matches(template, dtype=dtype)
    found = [x for x in jax.tree.leaves(state, is_leaf=match) if match(x)]
    if found:
      return found
  return []


def locate(state: Any, template: Any) -> Any:
  """The optimizer's own state inside the state of a step that wraps it, shaped as `template`
  (``optimizer.init(params)``), or None where it is not there once.

  The one subtree of that structure and those shapes (dtypes aside: see `_found`); else, for a
  chain's state (a tuple), each part found on its own: a schedule chained outside
  ``optax.MultiSteps`` keeps its count outside the wrapper's state, beside the rest. Parts with
  no arrays (``EmptyState``) are the template's own; parts of one shape are taken in order.
  """
  return _locate(state, template, 0, 1)


def _locate(state: Any, template: Any, nth: int, twins: int) -> Any:
  if not jax.tree.leaves(template):
    return template
  found = _found(state, template)
  if found:
    return found[nth] if len(found) == twins else None
  if type(template) is not tuple:
    return None
  parts, signatures = [], [_signature(part, True) for part in template]
  for i, part in enumerate(template):
    same = [j for j, other in enumerate(signatures) if other == signatures[i]]
    parts.append(_locate(state, part, same.index(i), len(same)))
  return None if any(p is None for p in parts) else tuple(parts)


def moved_floats(new: Any, old: Any) -> bool:
  """Whether a floating leaf differs: a step count alone moving (a schedule chained outside
  ``optax.MultiSteps`` counts every micro-step) is not an update."""
  return any(
    jnp.issubdtype(jnp.result_type(a), jnp.inexact)
    and not np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True)
  )


def _gradient_shaped(tree: Any, params: Any) -> list[tuple[str, Any]]:
  """The subtrees of `tree` shaped as `params` (the gradient), with their paths."""
  match = _matches(params, dtype=False)
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=match)
  return [(jax.tree_util.keystr(path), x) for path, x in flat if match(x)]


def _ulp(x: Any) -> np.ndarray:
  """An upper bound of one rounding of each entry of `x` in its own dtype: ``eps · |x|``."""
  return float(jnp.finfo(jnp.result_type(x)).eps) * np.abs(np.asarray(x, np.float64))


def read_back(
  apply: Any,
  inner_before: Any,
  params: Any,
  inner_after: Any,
  params_after: Any,
) -> ReadBack | None:
  """The gradient for which the optimizer's step `apply` (`_through.applied`) from
  `inner_before` at `params` gives `inner_after` and `params_after`, from the first leaf (state
  first, then the update) that is elementwise affine in it; None where none is."""
  update = lambda g: apply(g, inner_before, params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  ones = jax.tree.map(jnp.ones_like, params)
  r = jax.tree.map(
    lambda x, i: placed(jax.random.normal(jax.random.key(i), x.shape, x.dtype), x),
    params, jax.tree.unflatten(jax.tree.structure(params), range(len(jax.tree.leaves(params)))),
  )  # fmt: skip
  f0, f1, fr = update(zeros), update(ones), update(r)
  delta = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                       params_after, params)  # fmt: skip
  shaped = lambda i: lambda out: _gradient_shaped(out[1], params)[i][1]
  candidates = [
    (f"the optimizer state's {path}", got, a, b, c, shaped(i))
    for i, ((path, a), (_, b), (_, c), (_, got)) in enumerate(
      zip(
        *(_gradient_shaped(t[1], params) for t in (f0, f1, fr)),
        _gradient_shaped(inner_after, params),
        strict=False,
      )
    )
  ]
  candidates.append(("your step's update", delta, f0[0], f1[0], fr[0], lambda out: out[0]))
  for source, got, a, b, c, pick in candidates:
    read = _read(got, a, b, c, r)
    if read is not None and _affine_at(read[0], update, pick, a, b, params):
      grads, slack = read
      if source == "your step's update":  # one rounding of the parameters, p + u, in each entry
        slack = _update_slack(params_after, b, grads)
      return ReadBack(grads, slack, source)
  return None


def _affine_at(grads: Any, update: Any, pick: Any, a: Any, b: Any, params: Any) -> bool:
  """Whether the leaf is still ``a + (b - a) ⊙ g`` at twice the gradient read: the probes have
  entries of order one, and a clipping whose threshold lies between their norm and the
  gradient's would pass them, the gradient read then being the clipped one."""
  twice = jax.tree.map(
    lambda g, p: placed(jnp.asarray(2 * g, jnp.result_type(p)), p), grads, params
  )
  got = pick(update(twice))
  for leaf, a0, b1, g in zip(*(jax.tree.leaves(t) for t in (got, a, b, grads)), strict=True):
    a0, b1 = np.asarray(a0, np.float64), np.asarray(b1, np.float64)
    step = (b1 - a0) * 2 * np.asarray(g, np.float64)
    scale = max(float(np.max(np.abs(step), initial=0.0)), 1e-30)
    if (
      float(np.max(np.abs(np.asarray(leaf, np.float64) - a0 - step), initial=0.0))
      > AFFINE_RTOL * scale
    ):
      return False
  return True


def _read(got: Any, a: Any, b: Any, c: Any, r: Any) -> tuple[Any, float] | None:
  """``(got - a) / (b - a)`` leaf by leaf where ``c = a + (b - a) ⊙ r`` (affine), else None;
  with the reading's rounding relative to the gradient's largest entry."""
  f64 = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]
  a_, b_, c_, r_ = map(f64, (a, b, c, r))
  grads, slack = [], 0.0
  for raw, a0, b1, cr, rr in zip(jax.tree.leaves(got), a_, b_, c_, r_, strict=True):
    g = np.asarray(raw, np.float64)
    slope = b1 - a0
    if slope.size and np.min(np.abs(slope)) == 0:
      return None
    predicted = a0 + slope * rr
    scale = max(float(np.max(np.abs(slope * rr), initial=0.0)), 1e-30)
    if float(np.max(np.abs(cr - predicted), initial=0.0)) > AFFINE_RTOL * scale:
      return None
    value = (g - a0) / slope
    grads.append(value)
    err = _ulp(raw) / np.abs(slope)
    top = float(np.max(np.abs(value), initial=0.0))
    if top > 0:
      slack = max(slack, float(np.max(err, initial=0.0)) / top)
  return jax.tree.unflatten(jax.tree.structure(got), grads), slack


def _update_slack(params_after: Any, b: Any, grads: Any) -> float:
  """The error of a gradient read from ``params_after - params``, relative to its largest
  entry: an ulp of the new parameters, divided by the update's slope."""
  worst = 0.0
  for p, slope, g in zip(
    jax.tree.leaves(params_after), jax.tree.leaves(b), jax.tree.leaves(grads), strict=True
  ):
    top = float(np.max(np.abs(g), initial=0.0))
    if top > 0:
      err = _ulp(p) / np.abs(np.asarray(slope, np.float64))
      worst = max(worst, float(np.max(err, initial=0.0)) / top)
  return worst


# ----------------------------------------------------------------------------------------------
# Running the step.


def step_args(s: run.Setup, params: Any, state: Any, batch: Any, i: int) -> tuple[Any, ...]:
  key = () if s.keyed is None else (s.key(i),)
  return (s.full(params), state, batch, *key)


def _copied(tree: Any) -> Any:
  """A copy of the device arrays of `tree`: a step jitted with ``donate_argnums`` consumes its
  inputs, and the audit keeps each window's parameters and state to compare with."""
  return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _what(s: run.Setup) -> str:
  return "micro_step" if s.per_micro_batch else "step"


def _call(s: run.Setup) -> Any:
  def call(params, state, i):
    batch = s.micro[i % s.k] if s.per_micro_batch else s.batch
    args = _copied(step_args(s, params, state, batch, i))
    try:
      out = s.step(*args)
    except Exception as e:  # the user's code: say how the audit called it, and the usual fixes
      raise TypeError(_call_failed(s, e)) from e
    return _outputs(s, out, params, state)

  return call


# What `jax.jit` says when an argument is placed otherwise than its `in_shardings`.
_PLACED_OTHERWISE = "does not match the sharding on the respective arg"


def _call_failed(s: run.Setup, e: Exception) -> str:
  what = _what(s)
  data = "one micro-batch" if s.per_micro_batch else "the whole batch"
  key = ", key" if s.keyed is not None else ""
  if _PLACED_OTHERWISE in str(e):  # a step jitted with in_shardings, given host arrays
    return (
      f"audit: your {what} is jitted with in_shardings that the arrays the audit passed do "
      f"not have: {e}\nThe audit passes your arrays as you placed them: place the parameters, "
      "opt_state and batch as your step takes them before calling the audit (e.g. params = "
      "jax.device_put(params, param_shardings), opt_state=jax.device_put(optimizer.init("
      "params), state_shardings), batch likewise): host arrays are placed before your step sees "
      "them (on one device, or replicated under jax.set_mesh)."
    )
  return (
    f"audit: your {what} raised {type(e).__name__} when the audit called it as "
    f"{what}(params, opt_state, batch{key}): {e}\nThe audit passes your parameters, your "
    f"optimizer state (opt_state=, else optimizer.init(params): is `optimizer` the one your "
    f"step applies?), {data}{' and a key (rng=)' if key else ''}. A Flax TrainState step "
    "train_step(state, batch): pass step=lambda p, s, b: (lambda t: (t.params, t.opt_state))"
    "(train_step(state.replace(params=p, opt_state=s), b)). A Flax NNX step: split the model "
    "(graphdef, params = nnx.split(model, nnx.Param)) and write the step on (params, "
    "opt_state, batch) with nnx.merge. A step called once per micro-batch (optax.MultiSteps): "
    "micro_step= with opt_state=."
  )


def _outputs(s: run.Setup, out: Any, params: Any, state: Any) -> tuple[Any, Any]:
  """The new parameters (array leaves) and state from what the step returned: ``(params,
  opt_state, ...)`` or ``((params, opt_state), aux)``, each shaped as what went in."""
  fits = lambda p, st: (
    jax.tree.structure(run.arrays_of(p)) == jax.tree.structure(params)
    and jax.tree.structure(st) == jax.tree.structure(state)
  )
  pair = lambda x: isinstance(x, (tuple, list)) and len(x) >= 2
  if pair(out) and fits(out[0], out[1]):
    return run.arrays_of(out[0]), out[1]
  if pair(out) and pair(out[0]) and len(out[0]) == 2 and fits(*out[0]):
    return run.arrays_of(out[0][0]), out[0][1]  # ((params, opt_state), metrics)
  got = type(out).__name__
  if pair(out):
    got += " of (" + ", ".join(type(x).__name__ for x in out) + ")"
  raise TypeError(
    f"audit: {_what(s)} must return (params, opt_state) or (params, opt_state, ...), the new "
    "parameters shaped as the ones passed in, then the new optimizer state shaped as "
    f"opt_state (((params, opt_state), metrics) works too); got a {got} that is not."
  )


def check_signature(step: Any, what: str, keyed: bool) -> None:
  """Refuses, before anything runs, a step whose signature cannot take what the audit passes:
  ``(params, opt_state, batch)``, and a key with `rng`."""
  try:
    sig = inspect.signature(step)
  except (TypeError, ValueError):
    return
  kinds = [p.kind for p in sig.parameters.values()]
  if inspect.Parameter.VAR_POSITIONAL in kinds:
    return
  positional = [
    p for p in sig.parameters.values()
    if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  ]  # fmt: skip
  required = sum(p.default is inspect.Parameter.empty for p in positional)
  want = 4 if keyed else 3
  if len(positional) >= want and required <= want:
    return
  names = ", ".join(p.name for p in positional)
  head = f"audit: {what}= is called as {what}(params, opt_state, batch{', key' if keyed else ''})"
  if len(positional) == 2:
    fix = (
      "; yours takes two arguments. A Flax TrainState step train_step(state, batch) is passed "
      "as step=lambda p, s, b: (lambda t: (t.params, t.opt_state))(train_step("
      "state.replace(params=p, opt_state=s), b))"
    )
  elif not keyed and required == 4:
    fix = "; yours takes a key: pass rng= (a PRNG key; the audit passes one per call)"
  elif keyed and len(positional) == 3:
    fix = "; yours takes no key: leave rng= unset, or add the key argument your loss draws with"
  else:
    fix = ""
  raise TypeError(f"{head}, got {what}({names}){fix}.")


def run_step(s: run.Setup) -> run.Run:
  """The user's step, `num_updates` updates, each read back through the optimizer (or kept to
  be judged through it, `_through`)."""
  call = _call(s)
  template = s.optimizer.init(s.params)
  if s.per_micro_batch:

    def updated(before, after, params, new):  # the parameters or the optimizer's moments moved
      inner = (locate(before, template), locate(after, template))
      return run.moved(new, params) or (None not in inner and moved_floats(*inner))

    emissions = run.drive(s, call, s.params, s.opt_state, updated)
  else:
    emissions, params, state = [], s.params, s.opt_state
    for j in range(s.num_updates):
      new, after = call(params, state, j)
      emissions.append(run.Emission(params, state, after, new, s.k, state))
      params, state = new, after
  idle = not s.per_micro_batch and not any(_updated(e, template) for e in emissions)
  emissions = [] if idle else emissions
  apply = applied(s.optimizer)
  windows = [_window(s, e, template, apply) for e in emissions]
  notes = [note for _, note in windows if note]
  note = NO_UPDATE if idle else (notes[0] if notes else "")
  accumulator = run._accumulator(emissions[0].after) if emissions else None
  return run.Run([w for w, _ in windows], accumulator, s.per_micro_batch, note=note,
                 programs=_programs(s))  # fmt: skip


def _window(s: run.Setup, e: run.Emission, template: Any, apply: Any) -> tuple[run.Window, str]:
  """One update: its gradient read back, else kept to be judged through the optimizer (a
  `Through`), else nothing, with why."""
  before, after = locate(e.before, template), locate(e.after, template)
  start = locate(e.state0, template)
  if None in (before, after, start):
    return run.Window(e.start, None, None, e.calls), _unread()
  try:
    read = read_back(apply, before, e.start, after, e.params)
  except Exception as err:  # noqa: BLE001  # the user's optimizer: say what it needs
    return run.Window(e.start, None, None, e.calls), _uncallable(err)
  if read is None:
    through = Through(apply, before, start, after, e.start, e.params)
    return run.Window(e.start, None, None, e.calls, through=through), ""
  delta = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                       e.params, e.start)  # fmt: skip
  return run.Window(e.start, read.grads, delta, e.calls, read.slack, True, read.source), ""


def _programs(s: run.Setup) -> Any:
  """The step's compiled programs, made on demand (for the collectives row)."""
  batch = s.micro[0] if s.per_micro_batch else s.batch
  args = step_args(s, s.params, s.opt_state, batch, 0)
  if isinstance(s.step, TrainStep):  # the user's TrainStep: its two programs
    lower = lambda emit: s.step.lower(*args, emit=emit).compile().as_text()
    return lambda: [("micro", lower(False)), ("closing", lower(True))]
  jitted = s.step if hasattr(s.step, "lower") else jax.jit(s.step)
  kind = "micro" if s.per_micro_batch else "update"
  return lambda: [(kind, _hlo_text(jitted.lower(*args).compile()))]


NO_UPDATE = (
  "your step changed neither the parameters nor the state of `optimizer` in any call: it made "
  "no update (a step your loop calls once per micro-batch, e.g. with optax.MultiSteps? pass "
  "it as micro_step=, with opt_state=)"
)


def _updated(e: run.Emission, template: Any) -> bool:
  """Whether a call of a whole step updated: its parameters or its optimizer's moments moved."""
  inner = (locate(e.before, template), locate(e.after, template))
  return run.moved(e.params, e.start) or (None not in inner and moved_floats(*inner))


def _hlo_text(compiled: Any) -> str:
  """The compiled program's text (`eqx.filter_jit`'s ``Compiled`` wraps JAX's as ``.compiled``)."""
  return getattr(compiled, "compiled", compiled).as_text()


def _unread() -> str:
  return (
    "the state of `optimizer` is not in your step's optimizer state once, so neither the "
    "gradient nor the update can be judged (is `optimizer` the one your step applies? pass "
    "opt_state= if your step's state is not optimizer.init(params))"
  )


def _uncallable(err: Exception) -> str:
  return (
    f"your optimizer raised {type(err).__name__} when the audit called optimizer.update(grads, "
    f"state, params): {err} (an optimizer that needs extra arguments, such as a loss value, "
    "cannot be replayed: audit the accumulation as front_end=fn(loss_fn, params, batch))"
  )
