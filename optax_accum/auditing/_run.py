"""The audit's runs: the loop under test, window by window, as a user would run it.

Every run uses the public front ends (or the user's own loop) on the same strided micro-batches
(micro-batch ``i`` holds rows ``i, i+k, …``, `microbatch`'s default split): what is measured is
the behaviour of the loop on the user's model, not a re-implementation of it. A run returns one
`Window` per update: the parameters it started from, the gradient the optimizer received and
the update it made. Across steps (`accumulate`, `TrainStep`, `data_parallel`, a transformation
of the user's, a micro-step of the user's) the loop is fed micro-batch after micro-batch and an
update is where the parameters change, so a window's length is measured, not assumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum.auditing import _keys as keys
from optax_accum.core import _hlo
from optax_accum.core._state import AccumulateState, holds_sums
from optax_accum.front_ends._accumulate import accumulate
from optax_accum.front_ends._microbatch import microbatch
from optax_accum.front_ends._train_step import TrainStep
from optax_accum.parallel._data_parallel import data_parallel
from optax_accum.parallel._sharding import state_partition_specs


@dataclasses.dataclass(frozen=True)
class Setup:
  """What every run shares, resolved once by `optax_accum.audit`."""

  loss: Callable[..., Any]  # loss(params, batch) on the array leaves, draws from `CONSTANT`
  keyed: Callable[..., Any] | None  # keyed(params, batch, key) when `rng` was given
  params: Any  # the array leaves of the user's parameters (non-arrays as None)
  static: Any  # the other leaves (arrays as None)
  batch: Any
  k: int
  micro: tuple[Any, ...]  # the k strided micro-batches
  weights: np.ndarray  # (k,) the declared weight of each micro-batch (ones without weight_fn)
  weight_fn: Callable[[Any], Any] | None
  optimizer: optax.GradientTransformation | None
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None
  mesh: Any
  axis_name: Any
  accum_dtype: Any
  reduction: str
  num_updates: int
  rng: Any  # None, one key, a sequence of keys or a function of the call's index
  step: Callable[..., Any] | None  # the user's whole step
  per_micro_batch: bool  # whether `step` takes one micro-batch per call (else the batch)
  opt_state: Any  # the initial state of `step`'s optimizer
  # Compiled programs by name, each compiled once and used for its runs and its memory and
  # collectives (`jax.jit(f).lower(...).compile()` does not share `jax.jit(f)`'s cache).
  compiled: dict[tuple, Any] = dataclasses.field(default_factory=dict)

  def aot(self, name: str, fun: Callable[..., Any], *args: Any) -> Any:
    """`fun` compiled for `args` (once per `name` and placement of `args`: a step jitted
    with ``out_shardings`` may return its parameters placed otherwise than it was given them)."""
    placed = tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(args))
    if (name, placed) not in self.compiled:
      self.compiled[name, placed] = jax.jit(fun).lower(*args).compile()
    return self.compiled[name, placed]

  def program(self, name: str) -> Any:
    """The program first compiled under `name` (None if none was)."""
    return next((c for (n, _), c in self.compiled.items() if n == name), None)

  def grad(self, params: Any, batch: Any) -> Any:
    """The gradient of the loss on `batch` (the large batch or one micro-batch)."""
    name = (
      "large"
      if jax.tree.leaves(batch)[0].shape == jax.tree.leaves(self.batch)[0].shape
      else "micro"
    )
    return self.aot(name, grad_of(self.loss), params, batch)(params, batch)

  def full(self, arrays: Any) -> Any:
    """The user's parameters from their array leaves (non-array leaves put back)."""
    return jax.tree.map(lambda a, s: a if s is None else s, arrays, self.static, is_leaf=_none)

  def key(self, i: int) -> Any:
    """The recording key standing for the key the user's loop passes on call `i`."""
    if callable(self.rng):
      user = self.rng(i)
    elif keys.is_key(self.rng):
      user = self.rng
    else:
      user = self.rng[i]
    return keys.audit_key(user, keys.RECORDING)

  @property
  def keys_known(self) -> bool:
    """Whether `rng` says which key the loop passes on each call (not one key for all)."""
    return self.rng is not None and not keys.is_key(self.rng)


def _none(x: Any) -> bool:
  return x is None


def grad_of(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`jax.grad` of `fun` over every array leaf of its first argument: an integer or bool leaf
  (a counter, a buffer beside the weights) has no gradient, and gets zeros of its own dtype
  (`jax.grad` refuses such leaves, and ``allow_int=True`` alone gives float0 arrays)."""
  grad = jax.grad(fun, allow_int=True)

  def grads(params: Any, *args: Any) -> Any:
    zero = lambda g, p: jnp.zeros(jnp.shape(p), jnp.result_type(p))  # noqa: E731
    pick = lambda g, p: zero(g, p) if g.dtype == jax.dtypes.float0 else g  # noqa: E731
    return jax.tree.map(pick, grad(params, *args), params)

  return grads


def arrays_of(tree: Any) -> Any:
  """The array leaves of a tree (others None), as `eqx.filter(tree, eqx.is_array)`."""
  is_array = lambda x: isinstance(x, (jax.Array, np.ndarray, np.generic))
  return jax.tree.map(lambda x: x if is_array(x) else None, tree)


class Window(NamedTuple):
  """One update of the loop under test."""

  params: Any  # the parameters the window started from (array leaves)
  grads: Any  # the gradient the optimizer received (None where not visible)
  updates: Any  # the update it made (None where not visible)
  calls: int  # the calls of the loop that made it (k for an in-step loop)
  grad_slack: float = 0.0  # relative error of `grads` where read back (a whole step)
  rounded: bool = False  # `updates` is ``params_after - params`` (one rounding of the params)
  read_from: str = ""  # where `grads` was read back from (a whole step), e.g. "the update"
  through: Any = None  # a whole step's update to judge through its optimizer (`Through`)


class Run(NamedTuple):
  """What one loop produced: its windows, its accumulator, and why something is not visible."""

  windows: list[Window]
  accumulator: Any  # the accumulator's arrays (or their shapes), None where not visible
  across: bool  # the loop spans calls (the window length is measured)
  note: str = ""  # why the windows carry no gradient or update, where they do not
  # The loop's compiled programs, ``[(kind, hlo_text)]`` (kinds as `_collectives` reads
  # them), made on demand: a function of nothing, or None where the audit cannot see them.
  programs: Callable[[], list[tuple[str, str]]] | None = None


def strided(batch: Any, k: int) -> tuple[Any, ...]:
  """The k micro-batches of `microbatch`'s default split: rows ``i, i+k, …`` in micro-batch i
  (host arrays on the host; device arrays in one program: eager slicing would compile one
  program per slice)."""
  cut = lambda b: tuple(jax.tree.map(lambda x, i=i: x[i::k], b) for i in range(k))
  if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(batch)):
    return cut(batch)
  return jax.jit(cut)(batch)


# ----------------------------------------------------------------------------------------------
# In one step: `microbatch`, or the user's accumulation ``fn(loss_fn, params, batch, *keys)``.


def _in_step_args(s: Setup) -> tuple[Any, ...]:
  return (s.params, s.batch) if s.keyed is None else (s.params, s.batch, s.key(0))


def _microbatch_fn(s: Setup) -> Any:
  kw = dict(accum_dtype=s.accum_dtype, axis_name=s.axis_name, mesh=s.mesh, reduction=s.reduction)
  if s.keyed is None:
    wf = None if s.weight_fn is None else (lambda p, b: s.weight_fn(b))
    f = microbatch(grad_of(s.loss), s.k, weight_fn=wf, **kw)
  else:
    wf = None if s.weight_fn is None else (lambda p, b, key: s.weight_fn(b))
    f = microbatch(grad_of(s.keyed), s.k, weight_fn=wf, rng_argnums=2, **kw)
  return s.aot("step", f, *_in_step_args(s))


def _custom_fn(s: Setup, fn: Callable[..., Any]) -> Any:
  if s.keyed is None:
    call = lambda p, b: fn(s.loss, p, b)
  else:  # a real key, which the loop may split or fold into (its draws are all zero bits)
    call = lambda p, b, key: fn(s.keyed, p, b, key)
  return s.aot("step", call, *_in_step_args(s))


def run_in_step(s: Setup, fn: Callable[..., Any] | None) -> Run:
  f = _microbatch_fn(s) if fn is None else _custom_fn(s, fn)
  grads = f(*_in_step_args(s))
  acc = None
  if fn is None:
    acc = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, _acc_dtype(s, g.dtype)), grads)
  programs = lambda: [("update", f.as_text())]
  return Run([Window(s.params, grads, None, s.k)], acc, across=False, programs=programs)


def _acc_dtype(s: Setup, dtype: Any) -> Any:
  """The dtype `microbatch` accumulates a gradient of `dtype` in (its contract)."""
  return dtype if s.accum_dtype is None else jnp.promote_types(s.accum_dtype, dtype)


# ----------------------------------------------------------------------------------------------
# Across steps: the loop fed one micro-batch per call; an update is where the parameters move.


class Emission(NamedTuple):
  """One update of a loop that spans calls: around the call that made it."""

  start: Any  # the parameters the window started from
  before: Any  # the state before the updating call
  after: Any  # the state after it
  params: Any  # the parameters after it
  calls: int
  state0: Any = None  # the state at the window's start (what the previous update left)


def moved(new: Any, old: Any) -> bool:
  return any(
    not np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True)
  )


def drive(
  s: Setup, call: Callable[..., Any], params: Any, state: Any, updated: Callable[..., bool]
) -> list[Emission]:
  """`s.num_updates` updates of ``call(params, state, i) -> (params, state)`` (call `i` takes
  micro-batch ``i % k``), each ending at the call for which ``updated(state_before,
  state_after, params_before, params_after)``; stops early where 2k calls make none."""
  out, i = [], 0
  for _ in range(s.num_updates):
    start, state0, calls = params, state, 0
    while True:
      before = state
      new, state = call(params, state, i)
      i, calls = i + 1, calls + 1
      done = updated(before, state, params, new)
      if done or calls >= 2 * s.k:
        break
    if not done:
      return out
    out.append(Emission(start, before, state, new, calls, state0))
    params = new
  return out


def tap_updated(before: Any, after: Any, params: Any, new: Any) -> bool:
  """An update: the tapped optimizer ran on a gradient that is not all zeros (a wrapper that
  steps it with zeros between updates, as Keras 3 does, is not updating), whether or not the
  parameters moved (a learning rate of 0 at the start of a warm-up)."""
  was, now = tapped(before), tapped(after)
  if int(now.calls) == int(was.calls):
    return False
  return any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(now.grads))


def _weight(s: Setup, i: int) -> Any:
  return None if s.weight_fn is None else jnp.asarray(s.weights[i % s.k], jnp.float32)


class Tapped(NamedTuple):
  """The state of `tap`: the inner state, the inner optimizer's last input and output, and how
  many times it ran."""

  inner_state: Any
  grads: Any
  updates: Any
  calls: jax.Array  # shape=(), dtype=jnp.int32


def tap(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`inner`, keeping its last gradient and update in its state, where the audit reads them
  (whatever transformation wraps it: a `Tapped` is found anywhere in a state)."""
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    zeros = optax.tree.zeros_like(params)
    return Tapped(inner.init(params), zeros, zeros, jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra):
    out, inner_state = inner.update(updates, state.inner_state, params, **extra)
    return out, Tapped(inner_state, updates, out, optax.safe_increment(state.calls))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def tapped(state: Any) -> Tapped:
  found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Tapped))
  found = [x for x in found if isinstance(x, Tapped)]
  if len(found) != 1:
    raise ValueError("audit: wrap(inner) must keep the inner optimizer's state in its own state.")
  return found[0]


def inner_optimizer(s: Setup) -> optax.GradientTransformation:
  """The optimizer the loop applies once per update: the user's, else a small SGD step (the
  parameters must move for an update to be seen, and later windows start elsewhere)."""
  return s.optimizer if s.optimizer is not None else optax.sgd(0.01)


def _tapped_windows(s: Setup, emissions: list[Emission]) -> list[Window]:
  return [
    Window(e.start, tapped(e.after).grads, tapped(e.after).updates, e.calls) for e in emissions
  ]


def _make_tx(s: Setup, inner: optax.GradientTransformation, **kw: Any) -> Any:
  if s.wrap is not None:
    tx = s.wrap(inner)
    if not isinstance(tx, (optax.GradientTransformation, optax.GradientTransformationExtraArgs)):
      raise TypeError(
        f"audit: wrap(inner) must return an optax GradientTransformation, got {tx!r}."
      )
    return tx
  return accumulate(inner, s.k, accum_dtype=s.accum_dtype, reduction=s.reduction, **kw)


def accumulate_step(s: Setup, tx: Any) -> Callable[..., Any]:
  """A user's jitted micro-step with `tx`: grad → update (with the weight) → apply."""

  def micro_step(params, state, batch, weight, *key):
    grads = grad_of(s.loss if not key else s.keyed)(params, batch, *key)
    kw = {} if weight is None else {"weight": weight}
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state

  return jax.jit(micro_step)


def run_accumulate(s: Setup) -> Run:
  tx = _make_tx(s, tap(inner_optimizer(s)))
  step = accumulate_step(s, tx)
  extra = lambda i: () if s.keyed is None else (s.key(i),)
  call = lambda p, st, i: step(p, st, s.micro[i % s.k], _weight(s, i), *extra(i))
  state0 = tx.init(s.params)
  emissions = drive(s, call, s.params, state0, tap_updated)
  state = emissions[0].after if emissions else None
  args = (s.params, state0, s.micro[0], _weight(s, 0), *extra(0))
  programs = lambda: [("micro", step.lower(*args).compile().as_text())]
  return Run(_tapped_windows(s, emissions), _accumulator(state), True, programs=programs)


def _accumulator(state: Any) -> Any:
  """The state's accumulator, or None where it keeps none (every_k == 1) or is not ours."""
  if not isinstance(state, AccumulateState) or not holds_sums(state):
    return None
  return state.grad_sum


def train_step(s: Setup, inner: optax.GradientTransformation) -> TrainStep:
  """`TrainStep` as a user builds it; the loss takes the key where it can be passed (not with
  `axis_name`, where every argument is split over the devices)."""
  keyed = s.keyed is not None and s.axis_name is None
  weight_fn = None if s.weight_fn is None else (lambda b, *key: s.weight_fn(b))
  return TrainStep(
    s.keyed if keyed else s.loss, tap(inner), s.k, donate=False, weight_fn=weight_fn,
    accum_dtype=s.accum_dtype, reduction=s.reduction, axis_name=s.axis_name, mesh=s.mesh,
  )  # fmt: skip


def train_step_passes_keys(s: Setup) -> bool:
  return s.keyed is not None and s.axis_name is None


def run_train_step(s: Setup) -> Run:
  step = train_step(s, inner_optimizer(s))
  extra = lambda i: (s.key(i),) if train_step_passes_keys(s) else ()
  call = lambda p, st, i: step(p, st, s.micro[i % s.k], *extra(i))[:2]
  state0 = step.init(s.params)
  emissions = drive(s, call, s.params, state0, tap_updated)
  state = emissions[0].after if emissions else None

  def programs():
    lower = lambda emit: step.lower(s.params, state0, s.micro[0], *extra(0), emit=emit)
    return [
      ("micro", lower(False).compile().as_text()),
      ("closing", lower(True).compile().as_text()),
    ]

  return Run(_tapped_windows(s, emissions), _accumulator(state), True, programs=programs)


# ----------------------------------------------------------------------------------------------
# `data_parallel`: the user's micro-step with `accumulate(axis_name=...)`, bound over the axis.


def data_parallel_step(s: Setup, tx: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """The guide's recipe: per-device gradients (`pcast`), `accumulate` reducing once per update,
  `data_parallel` binding the axis under `jax.jit`; its jitted init and micro-step."""
  a = s.axis_name
  params_sh = jax.tree.map(lambda x: getattr(x, "sharding", None), s.params)
  state_sh = state_partition_specs(tx, params_sh, a)
  init = jax.jit(data_parallel(tx.init, a, mesh=s.mesh), out_shardings=state_sh)

  def micro_step(params, state, batch, *key):
    local = jax.lax.pcast(params, a, to="varying")  # per-device gradients
    # Each device draws for its own rows: the key folded with its index (as `microbatch` does).
    key = tuple(jax.random.fold_in(k, jax.lax.axis_index(a)) for k in key)
    grads = grad_of(s.loss if not key else s.keyed)(local, batch, *key)
    kw = {} if s.weight_fn is None else {"weight": s.weight_fn(batch)}
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state

  bound = data_parallel(micro_step, a, batch_argnums=2, mesh=s.mesh)
  return init, jax.jit(bound, out_shardings=(params_sh, state_sh))


def run_data_parallel(s: Setup) -> Run:
  tx = accumulate(
    tap(inner_optimizer(s)), s.k, accum_dtype=s.accum_dtype, reduction=s.reduction,
    axis_name=s.axis_name,
  )  # fmt: skip
  init, step = data_parallel_step(s, tx)
  extra = lambda i: () if s.keyed is None else (s.key(i),)
  call = lambda p, st, i: step(p, st, s.micro[i % s.k], *extra(i))
  state0 = init(s.params)
  emissions = drive(s, call, s.params, state0, tap_updated)
  state = emissions[0].after if emissions else None
  args = (s.params, state0, s.micro[0], *extra(0))
  programs = lambda: [("micro", step.lower(*args).compile().as_text())]
  return Run(_tapped_windows(s, emissions), _accumulator(state), True, programs=programs)


def peak_bytes(s: Setup, program: str) -> tuple[int | None, int | None]:
  """Compiled peak bytes of the accumulated step (`program`, or one micro-step's gradient) and
  of the large batch's gradient."""
  s.grad(s.params, s.batch), s.grad(s.params, s.micro[0])  # compiled here if not yet
  compiled = s.program(program) or s.program("micro")
  return _hlo.memory(compiled).get("peak"), _hlo.memory(s.program("large")).get("peak")
