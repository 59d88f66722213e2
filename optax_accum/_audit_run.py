"""The audit's runs: the accumulated gradient, and the first updates of the across-steps front ends.

Every run uses the public front ends as a user would, on the same strided micro-batches
(micro-batch ``i`` holds rows ``i, i+k, …``, `microbatch`'s default split): what is measured is
the library's behaviour on the user's model, not a re-implementation of it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _hlo
from optax_accum._accumulate import AccumulateState, accumulate, holds_sums
from optax_accum._microbatch import microbatch
from optax_accum._train_step import TrainStep

# Collectives whose result holds fewer bytes than this are scalars (loss, weight, finite flags)
# and are not counted as gradient reductions.
GRAD_MIN_BYTES = 32
REDUCTIONS = ("all-reduce", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class Setup:
  """What every run shares, resolved once by `optax_accum.audit`."""

  loss: Callable[..., Any]  # loss(params, batch), deterministic (key None), params arrays only
  keyed_loss: Callable[..., Any] | None  # loss(params, batch, key) when `rng` was given
  params: Any  # the array leaves of the user's parameters (non-arrays as None)
  batch: Any
  k: int
  micro: tuple[Any, ...]  # the k strided micro-batches
  weights: np.ndarray  # (k,) the user's weight of each micro-batch (ones without weight_fn)
  weight_fn: Callable[[Any], Any] | None
  optimizer: optax.GradientTransformation | None
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None
  mesh: Any
  axis_name: Any
  accum_dtype: Any
  num_updates: int
  # Compiled programs by name, each compiled once and used for its runs and its memory and
  # collectives (`jax.jit(f).lower(...).compile()` does not share `jax.jit(f)`'s cache).
  compiled: dict[str, Any] = dataclasses.field(default_factory=dict)

  def aot(self, name: str, fun: Callable[..., Any], *args: Any) -> Any:
    """`fun` compiled for `args` (once per `name`)."""
    if name not in self.compiled:
      self.compiled[name] = jax.jit(fun).lower(*args).compile()
    return self.compiled[name]

  def grad(self, batch: Any) -> Any:
    """The gradient of the loss on `batch` (the large batch or one micro-batch)."""
    name = "large" if batch is self.batch else "micro"
    return self.aot(name, jax.grad(self.loss), self.params, batch)(self.params, batch)


class Run(NamedTuple):
  """What one front end produced."""

  grads: Any  # the accumulated gradient at the initial parameters
  windows: list[Window] | None  # the first `num_updates` updates (None without an optimizer)
  accumulator: Any  # the accumulator's arrays (or their shapes), None where not visible


class Window(NamedTuple):
  """One update of an across-steps front end, as the inner optimizer saw it."""

  params: Any  # the parameters the update was computed at
  grads: Any  # the gradient the inner optimizer received
  updates: Any  # the update it returned


def strided(batch: Any, k: int) -> tuple[Any, ...]:
  """The k micro-batches of `microbatch`'s default split: rows ``i, i+k, …`` in micro-batch i
  (host arrays on the host; device arrays in one program: eager slicing would compile one
  program per slice)."""
  cut = lambda b: tuple(jax.tree.map(lambda x, i=i: x[i::k], b) for i in range(k))
  if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(batch)):
    return cut(batch)
  return jax.jit(cut)(batch)


def _microbatch_fn(s: Setup) -> Callable[..., Any]:
  weight_fn = None if s.weight_fn is None else (lambda p, b: s.weight_fn(b))
  kw = dict(weight_fn=weight_fn, accum_dtype=s.accum_dtype, axis_name=s.axis_name, mesh=s.mesh)
  return s.aot("step", microbatch(jax.grad(s.loss), s.k, **kw), s.params, s.batch)


def run_microbatch(s: Setup) -> Run:
  f = _microbatch_fn(s)
  grads = f(s.params, s.batch)
  acc = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape, _acc_dtype(s, g.dtype)), grads)
  return Run(grads, None, acc)


def _custom_fn(s: Setup, fn: Callable[..., Any]) -> Callable[..., Any]:
  """The user's accumulation; with keys, given the keyed loss and the key None (no dropout)."""
  if s.keyed_loss is None:
    call = lambda p, b: fn(s.loss, p, b)
  else:
    call = lambda p, b: fn(s.keyed_loss, p, b, None)
  return s.aot("step", call, s.params, s.batch)


def run_custom(s: Setup, fn: Callable[..., Any]) -> Run:
  f = _custom_fn(s, fn)
  return Run(f(s.params, s.batch), None, None)


def _acc_dtype(s: Setup, dtype: Any) -> Any:
  """The dtype `microbatch` accumulates a gradient of `dtype` in (its contract)."""
  return dtype if s.accum_dtype is None else jnp.promote_types(s.accum_dtype, dtype)


def _make_tx(s: Setup, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  if s.wrap is not None:
    return s.wrap(inner)
  return accumulate(inner, s.k, accum_dtype=s.accum_dtype)


class Tapped(NamedTuple):
  """The state of `tap`: the inner state, and the inner optimizer's last input and output."""

  inner_state: Any
  grads: Any
  updates: Any


def tap(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """`inner`, keeping its last gradient and update in its state, where the audit reads them
  (whatever transformation wraps it: a `Tapped` is found anywhere in a state)."""
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    zeros = optax.tree.zeros_like(params)
    return Tapped(inner.init(params), zeros, zeros)

  def update_fn(updates, state, params=None, **extra):
    out, inner_state = inner.update(updates, state.inner_state, params, **extra)
    return out, Tapped(inner_state, updates, out)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def tapped(state: Any) -> Tapped:
  found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Tapped))
  found = [x for x in found if isinstance(x, Tapped)]
  if len(found) != 1:
    raise ValueError("audit: wrap(inner) must keep the inner optimizer's state in its own state.")
  return found[0]


def _drive(s: Setup, tx: optax.GradientTransformation, windows: int) -> tuple[list[Window], Any]:
  """`windows` windows of k micro-steps through ``tx`` (which wraps a `tap`): each window's
  parameters, and the gradient and update of its k-th micro-step; the last state."""

  def micro_step(params, state, batch, weight):
    kw = {} if weight is None else {"weight": weight}
    return tx.update(jax.grad(s.loss)(params, batch), state, params, **kw)

  step = jax.jit(micro_step)
  params, state, out = s.params, tx.init(s.params), []
  for _ in range(windows):
    start = params
    for i, batch in enumerate(s.micro):
      w = None if s.weight_fn is None else jnp.asarray(s.weights[i], jnp.float32)
      u, state = step(params, state, batch, w)
      params = optax.apply_updates(params, u)
    out.append(Window(start, tapped(state).grads, u))
  return out, state


def run_accumulate(s: Setup) -> Run:
  (window,), state = _drive(s, _make_tx(s, tap(optax.identity())), 1)
  windows = None
  if s.optimizer is not None:
    windows, _ = _drive(s, _make_tx(s, tap(s.optimizer)), s.num_updates)
  acc = _accumulator(state)
  return Run(window.updates, windows, acc)


def _accumulator(state: Any) -> Any:
  """The state's accumulator, or None where it keeps none (every_k == 1) or is not ours."""
  if not isinstance(state, AccumulateState) or not holds_sums(state):
    return None
  return state.grad_sum


def train_step(s: Setup, inner: optax.GradientTransformation) -> TrainStep:
  weight_fn = None if s.weight_fn is None else (lambda b: s.weight_fn(b))
  return TrainStep(
    s.loss, tap(inner), s.k, donate=False, weight_fn=weight_fn, accum_dtype=s.accum_dtype,
    axis_name=s.axis_name, mesh=s.mesh,
  )  # fmt: skip


def _windows(s: Setup, step: TrainStep, windows: int) -> tuple[list[Window], Any]:
  params, state, out = s.params, step.init(s.params), []
  for _ in range(windows):
    start = params
    for batch in s.micro:
      params, state, _ = step(params, state, batch)
    out.append(Window(start, state.inner_state.grads, state.inner_state.updates))
  return out, state


def run_train_step(s: Setup) -> Run:
  (window,), state = _windows(s, train_step(s, optax.identity()), 1)
  windows = None
  if s.optimizer is not None:
    windows, _ = _windows(s, train_step(s, s.optimizer), s.num_updates)
  return Run(window.updates, windows, _accumulator(state))


def _groups(rest: str) -> list[list[int]] | None:
  """The replica groups of one collective (its HLO line after the opcode), in the explicit or
  the iota spelling; None for any other spelling (then the op is counted as a gradient one)."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
  if m:
    return [list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
  if not m:
    return None
  dims = [int(d) for d in m.group(3).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(4):
    ids = ids.transpose([int(d) for d in m.group(4).split(",")])
  return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()


def _crosses(groups: list[list[int]] | None, mesh: Any, axis: Any) -> bool:
  """Whether a collective with these groups reduces across the data axis of `mesh` (device
  ids are positions in ``mesh.devices.flat``, the programs' device assignment)."""
  if groups is None or mesh is None or axis not in mesh.axis_names:
    return True
  dim = mesh.axis_names.index(axis)
  coord = lambda d: np.unravel_index(d, mesh.devices.shape)[dim]
  return any(len({coord(d) for d in g}) > 1 for g in groups)


def data_axis(s: Setup) -> Any:
  """The data axis: `axis_name`, else the mesh axis the batch's rows are sharded over, else
  the mesh's first axis."""
  if s.axis_name is not None or s.mesh is None:
    return s.axis_name
  spec = getattr(getattr(jax.tree.leaves(s.batch)[0], "sharding", None), "spec", None)
  return spec[0] if spec and isinstance(spec[0], str) else s.mesh.axis_names[0]


def reductions(s: Setup, text: str, where: str = "all") -> int:
  """Gradient reductions of a compiled program: all-reduces and reduce-scatters of at least
  `GRAD_MIN_BYTES` across the data axis (a model axis's reductions of activations are not
  counted); ``where="loop"``: only those inside a while loop; ``"unconditional"``: not those
  in a conditional's branches (run only when taken)."""
  comps, entry = _hlo.computations(text)
  roots = [entry]
  if where == "loop":
    roots = [c for ops in comps.values() for i in ops if i.op == "while" for c in _hlo.callees(i)]
  placed = _hlo.placements(comps, entry)[0] if where == "unconditional" else {}
  axis = data_axis(s)
  return sum(
    _hlo.shape_bytes(i.shape) >= GRAD_MIN_BYTES and _crosses(_groups(i.rest), s.mesh, axis)
    for c in _hlo.reachable(comps, roots)
    if placed.get(c) != "cond"
    for i in comps[c]
    if i.op in REDUCTIONS or i.op.removesuffix("-start") in REDUCTIONS and i.op.endswith("-start")
  )


def gathers(text: str) -> int:
  return _hlo.count_collectives(text, "all-gather", min_bytes=GRAD_MIN_BYTES)


def programs(s: Setup, front_end: Any) -> dict[str, str] | None:
  """The compiled programs' HLO text: ``{"step": …}`` for an in-step front end (its loop is
  the micro-batch loop), ``{"accumulating": …, "closing": …}`` for `TrainStep`; None for
  `accumulate`, whose step is the user's own program."""
  if front_end == "microbatch":
    return {"step": _microbatch_fn(s).as_text()}
  if callable(front_end):
    return {"step": _custom_fn(s, front_end).as_text()}
  if front_end == "TrainStep":
    step = train_step(s, s.optimizer or optax.identity())
    state = step.init(s.params)
    return {
      "accumulating": step.lower(s.params, state, s.micro[0], emit=False).compile().as_text(),
      "closing": step.lower(s.params, state, s.micro[0], emit=True).compile().as_text(),
    }
  return None


def peak_bytes(s: Setup, front_end: Any) -> tuple[int | None, int | None]:
  """Compiled peak bytes of the accumulated step (the in-step program, or one micro-step's
  gradient for the across-steps front ends) and of the large batch's gradient."""
  s.grad(s.batch), s.grad(s.micro[0])  # compiled here if not yet
  name = "step" if front_end == "microbatch" or callable(front_end) else "micro"
  return _hlo.memory(s.compiled[name]).get("peak"), _hlo.memory(s.compiled["large"]).get("peak")
