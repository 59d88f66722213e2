"""`TrainStep`'s lean calling convention: each program takes and hands back only the arrays of
the state that it reads or writes, and the host fills in the rest.

On CPU every array a call passes costs it dispatch time (0.63 µs an array in and out on average,
`benchmarks/results/cpu/small_models.md`; an output more than an input), and a small model's
micro-step is a few tens of microseconds. Of an `AccumulateState`'s fields, the host already
knows several after a call, because it keeps the window position: ``mini_step`` (its position),
``window_k`` (the open window's length; the next one's, an int `every_k`, once a window closes)
and, after an accumulating micro-step, ``updated`` (False). So

* the accumulating program reads ``mini_step`` (with stochastic rounding ``gradient_step`` too,
  its key; not donated, not returned: the same arrays go into the state it makes) and writes the
  sums, the window's weight, the dropped count and the noise statistics;
* the emitting program reads ``mini_step`` and the sums (not donated: once the window closes
  its sums are stale, and the state keeps the ones it had, as the contract allows) and writes
  the window's weight (the closed window's, as `accumulate` leaves it), the step count, the
  dropped count, the inner state, ``updated`` and the noise statistics. The window's last sums
  are then a temporary of the program, as large as the parameters; with a gradient buffer
  (``grad_buffer=True``: memory first) it writes the sums too, in place;
* neither reads ``window_k``: the host decides when a window closes, and no lean program writes
  it (inside, the field holds a stand-in, `whole`). A scalar passed costs a small
  model's micro-step more than its size suggests (`benchmarks/train_step_parts.py`: the NaN-safe
  hand loop with 4 more int32 scalars per call);
* the host-known scalars are device arrays made once (`Constants`), never donated by these
  programs, and made again if anything else deleted them.

Only with ``donate=True``, where the state a call is given is spent: the fields a program only
reads go into the state it hands back as they are, so the two share them; with
``donate=False`` each state keeps arrays of its own, and a user may give an old one away.

Per window of k micro-steps on the optax notebook's MLP: 17 inputs and 9 outputs per
accumulating call, 31 and 24 for the emitting one (the NaN-safe hand-written loop's: 16 and 9,
29 and 28).
For a small model's programs (`TrainStep`'s choice of one emitting program) and every_k = 1;
only where no output sharding is pinned (one device, no axis, no FSDP), not on a private path
(whose closing program zeroes the spent sums), and for an int `every_k`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.core._state import AccumulateState

_tuple_new = tuple.__new__

# The fields `merged` fills in from `Constants`: each holds a value the host knows.
CONSTANT_FIELDS = ("mini_step", "window_k", "updated")


def _never_deleted() -> bool:  # (`is_deleted` of a leaf that is not a device array)
  return False


class Constants:
  """The host-known scalars of the states a `TrainStep` hands back, as device arrays placed
  like the field they stand for, made once per (field, value, placement). They are shared by
  the states it hands back (as a jitted step shares the leaves it returns unchanged), so one
  deleted through any of them (a state donated to a user's own jitted function) is made again:
  never handed out dead (`get`), and replaced in a state passed back (`revive`)."""

  def __init__(self) -> None:
    self._made: dict[tuple, jax.Array] = {}  # (field, value, placement) -> the live one
    self._placements: dict[Any, int] = {}  # sharding -> its number, a placement
    self._shardings: list[Any] = []  # placement -> sharding (None: a host array's `like`)
    # id -> (array, field, value, placement): every one made. A constant's placement is known
    # without asking the array (`.sharding` and a sharding's hash run Python: ~1 µs a field)
    self._known: dict[int, tuple] = {}

  def get(self, field: str, value: Any, like: Any) -> jax.Array:
    """The constant `value` for `field`, placed like `like` (a host array: the default
    device)."""
    known = self._known.get(id(like))
    if known is not None and known[0] is like:
      place = known[3]
    else:
      sharding = getattr(like, "sharding", None)
      place = self._placements.get(sharding)
      if place is None:
        place = self._placements[sharding] = len(self._shardings)
        self._shardings.append(sharding)
    key = (field, value, place)
    x = self._made.get(key)
    if x is None or x.is_deleted():
      host, sharding = np.asarray(value, like.dtype), self._shardings[place]
      x = jnp.asarray(host) if sharding is None else jax.device_put(host, sharding)
      self._made[key], self._known[id(x)] = x, (x, field, value, place)
    return x

  def revive(self, state: AccumulateState) -> AccumulateState:
    """`state` with each host-known field that holds a deleted constant of this object
    replaced by a live one of the same value and placement (the state itself if none)."""
    revived = {}
    for field in CONSTANT_FIELDS:
      x = getattr(state, field)
      if not getattr(x, "is_deleted", _never_deleted)():  # (a live array first: one call each)
        continue
      known = self._known.get(id(x))
      if known is not None and known[0] is x:
        revived[field] = self.get(field, known[2], x)
    return state._replace(**revived) if revived else state


class Layout(NamedTuple):
  """What a `TrainStep`'s lean programs read of the state besides ``mini_step``: static,
  decided with the programs."""

  sums: bool = False  # the emitting program writes the sums (a gradient buffer), else reads them
  step: bool = False  # the accumulating program reads ``gradient_step`` (stochastic rounding)


# What crosses a program's boundary: plain tuples of the state's fields (unpacking a tuple
# costs a call nothing, while a state handed back as an `AccumulateState` is built by a Python
# constructor, and the accumulating program's inner state, all None, was 2.6 µs of flattening
# per call on the notebook MLP). `reads`: never donated; `part`: donated, what the program
# writes; `out`: what it hands back.
#   accumulating  reads (mini_step[, gradient_step])   (the step: with stochastic rounding)
#                 part  (grad_sum, acc_weight, num_skipped, noise)         out: the same fields
#   emitting      reads (mini_step[, grad_sum])  (the sums: when not written)
#                 part  (gradient_step, grad_sum | None, acc_weight, num_skipped, inner_state,
#                        noise)                            out: part with `updated` before noise


def operands(emit: bool, state: AccumulateState, layout: Layout) -> tuple[tuple, tuple]:
  """``(reads, part)`` of `state` for one program."""
  s = state
  if emit:
    reads = (s.mini_step,) if layout.sums else (s.mini_step, s.grad_sum)
    part = (s.gradient_step, s.grad_sum if layout.sums else None, s.acc_weight, s.num_skipped)
    return reads, (*part, s.inner_state, s.noise)
  reads = (s.mini_step, s.gradient_step) if layout.step else (s.mini_step,)
  return reads, (s.grad_sum, s.acc_weight, s.num_skipped, s.noise)


def whole(emit: bool, reads: tuple, part: tuple, layout: Layout) -> AccumulateState:
  """Inside a program: the state `_window` takes, from `operands`. Fields it neither reads
  nor writes hold stand-ins that no written field depends on (`test_train_step` runs them with
  other stand-ins and gets the same bits): ``window_k`` 0, ``updated`` False, and in the
  accumulating program ``gradient_step`` 0 without stochastic rounding and the inner state
  None (as it is off the private paths, the only ones that look at it there)."""
  not_updated = jnp.zeros((), jnp.bool_)
  window_k = jnp.zeros((), jnp.int32)
  if emit:
    mini_step, *read_sums = reads
    gradient_step, grad_sum, acc_weight, num_skipped, inner_state, noise = part
    grad_sum = read_sums[0] if read_sums else grad_sum
  else:
    mini_step, *read_step = reads
    gradient_step = read_step[0] if read_step else jnp.zeros((), jnp.int32)
    grad_sum, acc_weight, num_skipped, noise = part
    inner_state = None
  return AccumulateState(
    mini_step,
    gradient_step,
    window_k,
    grad_sum,
    acc_weight,
    num_skipped,
    inner_state,
    not_updated,
    noise,
  )


def written(emit: bool, state: AccumulateState, layout: Layout) -> tuple:
  """Inside a program: what it hands back of the state it made (`out` above)."""
  s = state
  if emit:
    out = s.grad_sum if layout.sums else None
    return s.gradient_step, out, s.acc_weight, s.num_skipped, s.inner_state, s.updated, s.noise
  return (s.grad_sum, s.acc_weight, s.num_skipped, s.noise)


def merged(emit: bool, state: AccumulateState, out: tuple, known: tuple) -> AccumulateState:
  """On the host: the state after the call, from the one given (`state`), what the program
  wrote (`out`) and what the host knows (`known`: `Constants` for ``mini_step``, the position
  after the call, and ``window_k``, the open window's length, after an emitting call the next
  one's; and after an accumulating call ``updated``, False)."""
  if emit:
    mini_step, length = known
    gradient_step, sums, acc_weight, num_skipped, inner_state, updated, noise = out
    sums = state.grad_sum if sums is None else sums
  else:
    mini_step, length, updated = known
    sums, acc_weight, num_skipped, noise = out
    gradient_step, inner_state = state.gradient_step, state.inner_state
  # (`tuple.__new__`: a NamedTuple's own `__new__` is a Python frame, and this runs every call)
  return _tuple_new(
    AccumulateState,
    (mini_step, gradient_step, length, sums, acc_weight, num_skipped, inner_state, updated, noise),
  )
