"""`microbatch`: one training step's batch as k micro-batches, run one after another in one loop.

Reads top-down (`_run`): resolve where the batch, keys and state sit → reshape the batch
arguments (free, no copy; which rows go into micro-batch ``i`` is `_batch`'s business) → trace
`fun` once abstractly for its output plan (which leaf is reduced how, which leaves are the
threaded state) → one loop whose body reads micro-batch ``i`` in place, calls `fun` on it and
adds its outputs to sums kept in a named carry (with the shared `_core`, so XLA updates them in
place) → reduce across devices and normalise, once, after the loop.

The loop is `lax.fori_loop`: with a trip count known when tracing (``k``, or a Python-int
number of real micro-batches) it is one `lax.scan`, compiled to a loop of known trip count;
with a traced count it is a while loop that stops after the real micro-batches. A `lax.scan`
over all ``k`` with a `lax.cond` skipping the padding would run ``k`` iterations whatever the
count, and on GPU XLA reads a conditional's predicate back to the host on each of them (as it
reads a while loop's condition): the while loop does the least work and the fewest reads.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from optax_accum import _batch, _checks, _collectives, _core, _gspmd
from optax_accum._typing import OUT_REDUCTIONS, SPLITS, ArgNums, AxisName, DType, Split

_HINTS = {
  "avg": "mean",
  "average": "mean",
  "concatenate": "concat",
  "stack": "concat",
  "cat": "concat",
  "final": "last",
  "total": "sum",
}

STATE_OUT_MISSING = (
  "microbatch: state_argnums={argnums} needs `state_out`, a function that picks the new state "
  "out of `fun`'s output, e.g. for `jax.value_and_grad(loss, has_aux=True)` whose aux is the "
  "new batch_stats:\n\n"
  "    step = microbatch(jax.value_and_grad(loss, has_aux=True), k, state_argnums=2,\n"
  "                      state_out=lambda out: out[0][1])\n"
)

STATE_OUT_NOT_SELECTION = (
  "microbatch: state_out must *select* the new state out of fun's output (indexing, attribute "
  "access), so that those output leaves come back as the final state. Applied to fun's output "
  "with every leaf replaced by an integer marker of its position, it {what}. Return the "
  "output's own leaves, e.g. `state_out=lambda out: out[0][1]`, not a value computed from them."
)


class _Options(NamedTuple):
  """`microbatch`'s arguments, checked once when it is called."""

  fun: Callable[..., Any]
  k: int | None  # num_microbatches; None when given as microbatch_size (then set per call)
  microbatch_size: int | None
  num_real: int | jax.Array | None  # num_real_microbatches: a host int, or a device scalar
  positions: _batch.Positions  # as given; resolved per call
  reduction: Any  # a reduction string, or a pytree prefix of fun's output of them
  weight_fn: Callable[..., Any] | None
  state_out: Callable[[Any], Any] | None
  accum_dtype: jnp.dtype | None
  split: Split
  axis_name: AxisName | None
  mesh: Any  # the mesh whose `axis_name` to bind under plain jit; None: the one in effect
  bound_here: bool = False  # this call bound `axis_name` itself (no enclosing map did)


class _Outputs(NamedTuple):
  """The output plan: what becomes of each leaf of `fun`'s output."""

  tree: Any  # the PyTreeDef of fun's output
  like: tuple[jax.ShapeDtypeStruct, ...]  # one micro-batch's value, per leaf
  kinds: tuple[str, ...]  # per leaf: "mean", "sum", "concat", "last" or "state"
  # Per "concat" leaf, the layout of its rows buffer: the split's for per-example values (one
  # row per example: original example order), "contiguous" otherwise (micro-batch order).
  layouts: tuple[Split, ...]
  state: tuple[tuple[int, ...], ...]  # per state argument: the output leaves of its new value
  total: jax.ShapeDtypeStruct  # the accumulated weight's type (its device variance)

  def pick(self, leaves: Any, kind: str) -> list[Any]:
    """The entries of `leaves` (one per output leaf) whose leaf is reduced by `kind`."""
    return [x for x, r in zip(leaves, self.kinds, strict=True) if r == kind]


class _Carry(NamedTuple):
  """What the loop carries from one micro-batch to the next."""

  means: list[jax.Array]  # Σ wᵢ fᵢ of the "mean" leaves, in the accumulation dtype
  sums: list[jax.Array]  # Σ fᵢ of the "sum" leaves
  total: jax.Array  # Σ wᵢ; shape=(), dtype=jnp.float32
  # How many weights were negative, NaN or ±Inf; shape=(), dtype=jnp.float32 (a count in the
  # sums' dtype, so that it rides in their one all-reduce: XLA keeps collectives of different
  # dtypes apart). The weighted means are NaN then: never a finite wrong number.
  invalid: jax.Array
  last: list[jax.Array]  # the latest value of the "last" leaves
  rows: list[jax.Array]  # every micro-batch's "concat" values (zeros until written)
  state: tuple[Any, ...]  # the threaded state arguments
  # The call's (args, kwargs), batch arguments split: loop-invariant operands XLA neither
  # copies nor moves (values enter the loop as operands, not closures).
  operands: tuple[list[Any], dict[str, Any]]


# ----------------------------------------------------------------------------------------------
# Argument checks (factory time).


def _check_reduction(reduction: Any) -> Any:
  paths = jax.tree.leaves_with_path(reduction)
  bad = [(p, r) for p, r in paths if not (isinstance(r, str) and r in OUT_REDUCTIONS)]
  if not paths or bad:
    lines = []
    for p, r in bad:
      hint = f" Maybe you meant {_HINTS[r]!r}." if isinstance(r, str) and r in _HINTS else ""
      lines.append(f"  reduction{jax.tree_util.keystr(p)} = {r!r}.{hint}")
    raise ValueError(
      f"microbatch: reduction must be one of {OUT_REDUCTIONS} or a pytree prefix of fun's "
      f"output with those strings at its leaves, got {reduction!r}"
      + (":\n" if lines else ".")
      + "\n".join(lines)
    )
  return reduction


def _check_callables(fun: Any, weight_fn: Any, state_out: Any, states: tuple[int, ...]) -> None:
  if not callable(fun):
    raise TypeError(f"microbatch: fun must be callable, got {fun!r}.")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"microbatch: weight_fn must be callable or None, got {weight_fn!r}.")
  if states and state_out is None:
    raise ValueError(STATE_OUT_MISSING.format(argnums=states[0]))
  if state_out is not None and not states:
    raise ValueError(
      "microbatch: state_out is given but state_argnums is empty; name the "
      "state arguments with state_argnums."
    )


def _check_sizes(num_microbatches: Any, microbatch_size: Any) -> tuple[int | None, int | None]:
  """``(k, None)`` or ``(None, microbatch_size)``: exactly one of the two is given."""
  if (num_microbatches is None) == (microbatch_size is None):
    got = "neither" if num_microbatches is None else "both"
    raise TypeError(
      "microbatch: give exactly one of num_microbatches (how many micro-batches) and "
      f"microbatch_size (examples per micro-batch), got {got}."
    )
  if microbatch_size is None:
    return _checks.positive_int(num_microbatches, "num_microbatches", "microbatch"), None
  return None, _checks.positive_int(microbatch_size, "microbatch_size", "microbatch")


def _check_num_real(value: Any, k: int | None) -> int | jax.Array | None:
  """A host int in ``[0, k]`` (checked), or an integer scalar array (clamped when it is used)."""
  if value is None:
    return None
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]  # a 0-d NumPy array is a host value too
  if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
    if value < 0 or (k is not None and value > k):
      upper = f"num_microbatches={k}" if k is not None else "num_microbatches"
      raise ValueError(f"microbatch: num_real_microbatches must be in [0, {upper}], got {value}.")
    return int(value)
  if (
    isinstance(value, jax.Array) and value.shape == () and jnp.issubdtype(value.dtype, jnp.integer)
  ):
    return value
  what = f"{value.dtype}{list(value.shape)}" if isinstance(value, jax.Array) else repr(value)
  raise TypeError(
    "microbatch: num_real_microbatches must be None, an int, or an integer scalar array (e.g. "
    f"traced under jax.jit), got {what} of type {type(value).__name__}."
  )


def _trips(num_real: int | jax.Array | None, k: int) -> int | jax.Array:
  """How many micro-batches run: k, a checked host int, or a device scalar clamped into [0, k]."""
  if num_real is None:
    return k
  if isinstance(num_real, int):
    if num_real > k:
      raise ValueError(
        f"microbatch: num_real_microbatches={num_real} is more than the {k} micro-batches this "
        "batch holds (batch size / microbatch_size)."
      )
    return num_real
  return jnp.clip(num_real, 0, k).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# The transform.


def microbatch(
  fun: Callable[..., Any],
  num_microbatches: int | None = None,
  *,
  microbatch_size: int | None = None,
  batch_argnums: ArgNums | None = None,
  batch_argnames: str | Sequence[str] = (),
  batch_axes: int | Sequence[int] = 0,
  num_real_microbatches: int | jax.Array | None = None,
  reduction: Any = "mean",
  weight_fn: Callable[..., Any] | None = None,
  rng_argnums: ArgNums = (),
  state_argnums: ArgNums = (),
  state_out: Callable[[Any], Any] | None = None,
  accum_dtype: DType | None = jnp.float32,
  split: Split = "strided",
  axis_name: AxisName | None = None,
  mesh: Any = None,
) -> Callable[..., Any]:
  """Runs `fun` on a batch as `num_microbatches` sequential micro-batches under one `lax.scan`.

  The returned function has `fun`'s signature and output structure. It splits the batch
  arguments into ``k`` micro-batches (see `split`), calls `fun` on each in turn inside one
  `lax.scan` (program size and compile time do not grow with ``k``) and combines the outputs
  leaf by leaf. With ``fun = jax.value_and_grad(loss)`` and a loss that is a mean over the
  batch, the result is the large batch's loss and gradient at the memory of one micro-batch.

  Reductions, per output leaf (``fᵢ`` is micro-batch ``i``'s value, ``wᵢ`` its weight):

  * ``"mean"``: ``Σ wᵢ fᵢ / Σ wᵢ`` (equal weights without `weight_fn`);
  * ``"sum"``: ``Σ fᵢ``, unweighted (for quantities already summed over examples: counts,
    summed losses);
  * ``"concat"``: the per-micro-batch values joined along their leading axis. Per-example
    values (a leading axis of one row per example of the micro-batch) come back in the
    original example order, for both splits. Other values (a scalar, another leading size)
    are joined in micro-batch order: micro-batch 0's rows first; a scalar becomes a ``(k,)``
    vector;
  * ``"last"``: the last micro-batch's value.

  "mean" and "sum" are accumulated in `accum_dtype` and cast back to the output's dtype once,
  at the end.

  Mutable state (Flax ``batch_stats``): name the state arguments in `state_argnums` and say
  where `fun`'s output holds their new value with `state_out`. Micro-batch ``i`` sees the state
  that micro-batch ``i-1`` produced, as ``k`` sequential small steps would; the output leaves
  that `state_out` selects (e.g. ``lambda out: out[0][1]``) come out as the final state whatever
  `reduction` says for them.

  A padded batch (the last, partly empty batch of an epoch at the usual shape): pass
  `num_real_microbatches` ``n`` and only the first ``n`` micro-batches run — the loop stops
  after them. "mean" and "sum" cover the real micro-batches only, "last" and the state come
  from the last real one, and "concat" rows of the others are zeros. With ``n = 0`` nothing
  runs: "mean" and "sum" give zeros (as all-zero weights do) and the state comes back as given.

  Args:
    fun: the function to run per micro-batch, e.g. ``jax.value_and_grad(loss, has_aux=True)``.
    num_microbatches: ``k``, a positive int dividing the batch size. 1 calls `fun` directly.
      Give this or `microbatch_size`, not both.
    microbatch_size: the number of examples per micro-batch, ``b``, instead of ``k``
      (then ``k = B / b`` at each call; ``B`` must be a multiple of ``b``).
    batch_argnums: the positional arguments (pytrees) whose leaves have the batch axis.
      Default: argument 1, or none when `batch_argnames` is given. Every batch leaf must have
      the same size ``B`` along its batch axis, divisible by ``k``. Other arguments are passed
      to every micro-batch unchanged.
    batch_argnames: keyword arguments (a name or a sequence of names) that hold batch pytrees,
      like `batch_argnums`; calls must pass them by keyword.
    batch_axes: the batch axis: one int for every batch argument, or one per argument in the
      order ``batch_argnums + batch_argnames``, e.g. 1 for sequence-major ``(T, B, ...)``
      data. It stays where it is: `fun` sees ``(T, b, ...)``.
    num_real_microbatches: how many micro-batches run (the first ``n``, in `split` order):
      None (all ``k``), a Python int in ``[0, k]``, or an integer scalar array — typically
      traced under `jax.jit`, so that one compiled program serves every ``n``; it is clamped
      into ``[0, k]``. A traced count runs as a while loop whose trip count is data-dependent:
      it cannot be differentiated in reverse mode (take gradients inside `fun`, as
      `jax.value_and_grad` does), and on GPU XLA reads its condition back to the host once
      per micro-batch (a Python int keeps a fixed trip count, one compile per value). With
      `axis_name` each device may hold its own count; "mean" and "sum" then cover every
      device's real micro-batches.
    reduction: "mean", "sum", "concat" or "last", or a pytree prefix of `fun`'s output with
      those strings at its leaves, e.g. ``("mean", "concat")`` for ``(loss, logits)``.
    weight_fn: called like `fun` (the batch arguments replaced by one micro-batch, the same
      PRNG keys and state), returns that micro-batch's non-negative scalar weight, e.g. its
      number of real (non-padding) tokens. Default: equal weights.
    rng_argnums: positional arguments that are PRNG keys (typed ``jax.random.key`` or raw
      ``jax.random.PRNGKey``), or pytrees of them. Micro-batch ``i`` gets
      ``jax.random.fold_in(key, i)``: a different key each, derived deterministically.
      With `axis_name` the key is first folded with the device's `lax.axis_index`, so
      devices never share masks either.
    state_argnums: positional arguments threaded through the micro-batches in order.
    state_out: ``output -> new state`` (one value when `state_argnums` is an int, a tuple when
      it is a sequence) that *selects* leaves of `fun`'s output (indexing, attribute access),
      with the structure and shapes of those arguments (dtypes are cast to theirs). It is
      applied once, to the output's structure, to find those leaves. Required with
      `state_argnums`.
    accum_dtype: the dtype in which floating "mean"/"sum" outputs are accumulated; None means
      each output's own dtype.
    split: "strided" (micro-batch ``i`` takes rows ``i, i+k, …``; keeps the batch sharding) or
      "contiguous" (consecutive blocks of ``B/k`` rows).
    axis_name: the data-parallel axis: "mean" and "sum" outputs (and the weights) are reduced
      over it once, after the loop, to the global large-batch result. The non-batch arguments
      are made device-varying first, so gradients taken inside `fun` stay local (no
      collective in the loop). Inside `shard_map`/`pmap` (which bind the axis), "concat" and
      "last" outputs stay per device. Under plain `jax.jit` with a mesh in effect
      (`jax.set_mesh`, Auto or Explicit axes) or given as `mesh`, `microbatch` binds the axis
      itself over that mesh axis only (`optax_accum.data_parallel`; other mesh axes stay
      automatic): each device runs the micro-batches of its share of the batch, the outputs
      are global ("concat" rows joined in the batch's order; a threaded state or "last"
      output that differs per device is an error), and `microbatch_size` counts each
      device's rows.
    mesh: the mesh whose `axis_name` to bind under plain `jax.jit`; default: the one in
      effect. Ignored inside a map that binds the axis.

  Returns:
    A function with `fun`'s signature returning `fun`'s output structure, reduced as above.

  Raises:
    TypeError, ValueError: here, for a bad `num_microbatches`/`microbatch_size` (or both, or
      neither), argnums, argnames, `batch_axes`, `num_real_microbatches`, `reduction`,
      `split` or `weight_fn`; at trace time, for a batch size not divisible by ``k`` (or
      `microbatch_size`), batch arguments that disagree on the batch size, positions out of
      range, a missing keyword batch argument, a `reduction` that does not fit the output,
      or a `state_out` that does not select output leaves.

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> def loss(w, x):
  ...   return jnp.mean((x @ w) ** 2)
  >>> w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
  >>> step = optax_accum.microbatch(jax.value_and_grad(loss), 4)
  >>> value, grad = step(w, x)
  >>> bool(jnp.allclose(value, loss(w, x))), bool(jnp.allclose(grad, jax.grad(loss)(w, x)))
  (True, True)

  The last batch of an epoch, padded: one compiled program for any number of real rows.

  >>> @jax.jit
  ... def padded_step(w, x, n):
  ...   return optax_accum.microbatch(jax.value_and_grad(loss), 4, num_real_microbatches=n)(w, x)
  >>> value, grad = padded_step(w, x, 2)  # micro-batches 0 and 1: rows 0, 1, 4, 5
  >>> bool(jnp.allclose(value, loss(w, x[jnp.array([0, 1, 4, 5])])))
  True
  """
  pos = _batch.positions(batch_argnums, batch_argnames, batch_axes, rng_argnums, state_argnums)
  _check_callables(fun, weight_fn, state_out, pos.states)
  if split not in SPLITS:
    raise ValueError(f"microbatch: split must be one of {SPLITS}, got {split!r}.")
  k, size = _check_sizes(num_microbatches, microbatch_size)
  opts = _Options(
    fun=fun,
    k=k,
    microbatch_size=size,
    num_real=_check_num_real(num_real_microbatches, k),
    positions=pos,
    reduction=_check_reduction(reduction),
    weight_fn=weight_fn,
    state_out=state_out,
    accum_dtype=_checks.accum_dtype(accum_dtype),
    split=split,
    axis_name=axis_name,
    mesh=mesh,
  )

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    if axis_name is None or _collectives.is_bound(axis_name):
      return _run(opts, args, kwargs)
    return _bind(opts, args, kwargs)

  return wrapped


def _bind(opts: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """`axis_name` under plain `jax.jit`, bound here over the mesh (`_gspmd.bind`): each device
  runs the micro-batches of its rows, and `_finish` reduces once, after the loop. "concat"
  outputs come back joined across devices in the batch's order."""
  pos = _batch.resolve(opts.positions, len(args), kwargs)
  bound = _gspmd.bind(
    functools.partial(_run_kw, opts._replace(bound_here=True)),
    opts.axis_name,
    batch_argnums=pos.batch,
    batch_argnames=pos.names,
    batch_axes=pos.axes,
    mesh=opts.mesh,
    varying="concat",
    caller="microbatch",
  )
  return bound(*args, **kwargs)


def _run_kw(opts: _Options, *args: Any, **kwargs: Any) -> Any:
  return _run(opts, args, kwargs)


def _run(opts: _Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """The whole transformed call: every call of a `microbatch` function comes through here."""
  pos = _batch.resolve(opts.positions, len(args), kwargs)
  size, k = _batch.num_microbatches(pos, args, kwargs, opts.k, opts.microbatch_size)
  opts = opts._replace(k=k)
  trips = _trips(opts.num_real, k)
  _batch.check_keys(args, pos.rngs)
  _collectives.check_bound(opts.axis_name, "microbatch")
  if k == 1 and isinstance(trips, int) and trips == 1 and opts.axis_name is None:
    out = opts.fun(*args, **kwargs)
    _leaf_reductions(opts.reduction, jax.eval_shape(lambda: out))  # the checks of k > 1
    return out
  operands = _operands(args, kwargs, pos, opts)
  state0 = tuple(jax.tree.map(jnp.asarray, args[j]) for j in pos.states)
  plan = _plan(opts, pos, operands, state0, size // k)
  carry = _init(opts, plan, state0, operands)
  body = functools.partial(_body, opts=opts, pos=pos, plan=plan)
  if isinstance(trips, int) and trips == 1:
    carry = body(jnp.int32(0), carry)  # one micro-batch: one call, no loop
  else:
    # A Python trip count makes this one lax.scan; a traced one a while loop that stops after
    # the real micro-batches (its trip count is data-dependent).
    carry = lax.fori_loop(0, trips, body, carry)
  return _finish(opts, plan, carry)


# ----------------------------------------------------------------------------------------------
# One micro-batch.


def _operands(args, kwargs, pos: _batch.Positions, opts: _Options) -> tuple[list, dict]:
  """The call's arguments as the loop reads them: batch ones split, the others made local.

  Non-batch arguments become device-varying so that `jax.grad` inside `fun` stays local.
  """
  axes = dict(zip(pos.batch, pos.axes[: len(pos.batch)], strict=True))
  names = dict(zip(pos.names, pos.axes[len(pos.batch) :], strict=True))
  a = []
  for j, x in enumerate(args):
    if j in axes:
      x = _split(x, opts.k, opts.split, axes[j])
    elif j not in pos.rngs:
      x = _collectives.to_varying(x, opts.axis_name)
    a.append(x)
  kw = {
    n: _split(x, opts.k, opts.split, names[n])
    if n in names
    else _collectives.to_varying(x, opts.axis_name)
    for n, x in kwargs.items()
  }
  return a, kw


def _split(tree: Any, k: int, split: Split, axis: int) -> Any:
  return jax.tree.map(lambda v: _batch.split_batch(jnp.asarray(v), k, split, axis), tree)


def _take(tree: Any, i: Any, split: Split, axis: int) -> Any:
  return jax.tree.map(lambda v: _batch.take(v, i, split, axis), tree)


def _fold_keys(keys: Any, i: jax.Array, k: int, axis_name: AxisName | None) -> Any:
  """Micro-batch ``i``'s keys: ``fold_in(key, i)``, after the device index with `axis_name`."""
  if axis_name is not None:
    # A replicated key would give every device the same masks on different examples.
    index = lax.axis_index(axis_name)
    keys = jax.tree.map(lambda key: jax.random.fold_in(key, index), keys)
  if k > 1:
    keys = jax.tree.map(lambda key: jax.random.fold_in(key, i), keys)
  return keys


def _call(
  opts: _Options, pos: _batch.Positions, operands: tuple, state: tuple, i: Any
) -> tuple[Any, jax.Array | None]:
  """`fun` and `weight_fn` on micro-batch ``i``: ``(output, weight or None)``."""
  args, kwargs = operands
  a, kw = list(args), dict(kwargs)
  for j, axis in zip(pos.batch, pos.axes[: len(pos.batch)], strict=True):
    a[j] = _take(args[j], i, opts.split, axis)
  for n, axis in zip(pos.names, pos.axes[len(pos.batch) :], strict=True):
    kw[n] = _take(kwargs[n], i, opts.split, axis)
  for j in pos.rngs:
    a[j] = _fold_keys(args[j], i, opts.k, opts.axis_name)
  for j, s in zip(pos.states, state, strict=True):
    a[j] = s
  out = opts.fun(*a, **kw)
  if opts.weight_fn is None:
    return out, None
  return out, _checks.weight(opts.weight_fn(*a, **kw), "microbatch: weight_fn")


# ----------------------------------------------------------------------------------------------
# The output plan (trace time).


def _leaf_reductions(reduction: Any, out: Any) -> list[str]:
  """One reduction string per leaf of `out` (reduction is a prefix of out's structure)."""
  if isinstance(reduction, str):
    return [reduction] * len(jax.tree.leaves(out))
  try:
    full = jax.tree.broadcast(reduction, out)
  except ValueError as e:
    raise ValueError(
      "microbatch: reduction is not a pytree prefix of fun's output.\n"
      f"  reduction: {jax.tree.structure(reduction)}\n"
      f"  output:    {jax.tree.structure(out)}\n"
      "Give one string, or a tree with fun's output structure (same container types: a tuple "
      "for a tuple, a dict with the same keys) cut off at any depth."
    ) from e
  return jax.tree.leaves(full)


def _plan(opts: _Options, pos, operands, state0: tuple, b: int) -> _Outputs:
  """Traces `fun` once, abstractly, on micro-batch 0 and decides what becomes of each leaf."""
  out_t, total = jax.eval_shape(functools.partial(_probe, opts, pos), operands, state0)
  like, tree = jax.tree.flatten(out_t)
  kinds = _leaf_reductions(opts.reduction, out_t)
  state = _state_leaves(opts.state_out, pos, tree, like, state0)
  for leaves in state:
    for n in leaves:
      kinds[n] = "state"  # the threaded state comes out as the final state, not reduced
  layouts = tuple(
    opts.split if x.shape and x.shape[0] == b else "contiguous"
    for x, r in zip(like, kinds, strict=True)
    if r == "concat"
  )
  return _Outputs(tree, tuple(like), tuple(kinds), layouts, state, total)


def _probe(opts: _Options, pos, operands, state0: tuple) -> tuple[Any, jax.Array]:
  """Micro-batch 0's output, and the accumulated weight's type (its device variance).

  One trace for both: the weight's type is found from the weight itself, never by feeding an
  `eval_shape` result back into another trace (inside a partly manual `shard_map`, such a
  round trip can lose the type's varying axes).
  """
  out, w = _call(opts, pos, operands, state0, 0)
  total = jnp.zeros((), jnp.float32)
  return out, total if w is None else total + w.astype(jnp.float32)


# `state_out` is applied to integer markers ``n * _STRIDE + _OFFSET`` in place of output leaf
# ``n``: a selection keeps a marker as it is, while arithmetic on one (``out[1] * 2``, ``+ 1``)
# lands between markers (the stride is prime, the offset not a multiple of it) and is caught
# instead of silently picking another leaf. Markers stay below 2**31 (they may become int32).
_STRIDE, _OFFSET = 8191, 1009


def _markers(num_leaves: int) -> tuple[int, int]:
  """(stride, offset) of the markers for `num_leaves` leaves (plain positions for huge trees)."""
  return (_STRIDE, _OFFSET) if num_leaves * _STRIDE < 2**31 - _STRIDE else (1, 0)


def _position(x: Any, num_leaves: int) -> int | None:
  """The output leaf whose marker `x` is, or None if `x` is not a marker."""
  if isinstance(x, bool | np.bool_) or not isinstance(x, int | np.integer | jax.Array):
    return None
  try:
    m = operator.index(x)
  except TypeError:
    return None
  stride, offset = _markers(num_leaves)
  n, rest = divmod(m - offset, stride)
  return n if rest == 0 and 0 <= n < num_leaves else None


def _state_leaves(state_out, pos, tree, like, state0: tuple) -> tuple[tuple[int, ...], ...]:
  """Which output leaves are each state argument's new value, found by position, not identity.

  `state_out` is applied to `fun`'s output structure with integer markers of the leaf positions
  in place of the leaves, so a selection (``out[0][1]``, even wrapped in `stop_gradient`) says
  exactly which leaves it picked.
  """
  if not pos.states:
    return ()
  num = tree.num_leaves
  stride, offset = _markers(num)
  try:
    with jax.ensure_compile_time_eval():  # so that e.g. stop_gradient(marker) stays concrete
      picked = state_out(jax.tree.unflatten(tree, [n * stride + offset for n in range(num)]))
  except Exception as e:
    what = f"raised {type(e).__name__}: {e}"
    raise ValueError(STATE_OUT_NOT_SELECTION.format(what=what)) from e
  picked = (picked,) if pos.single_state else tuple(picked)
  if len(picked) != len(state0):
    raise ValueError(
      f"microbatch: state_out returned {len(picked)} states for state_argnums={pos.states}."
    )
  found = []
  for j, p, s in zip(pos.states, picked, state0, strict=True):
    _check_state_tree(j, p, s)
    for path, x in jax.tree.leaves_with_path(p):
      if _position(x, num) is None:
        what = f"returned {x!r} at state {j}{jax.tree_util.keystr(path)}, not a marker"
        raise ValueError(STATE_OUT_NOT_SELECTION.format(what=what))
    found.append(tuple(_position(x, num) for x in jax.tree.leaves(p)))
  _check_state_shapes(pos.states, [[like[n] for n in f] for f in found], state0)
  return tuple(found)


def _check_state_tree(j: int, picked: Any, state: Any) -> None:
  if jax.tree.structure(picked) != jax.tree.structure(state):
    raise ValueError(
      f"microbatch: state_out's new state for argument {j} has another tree than the "
      f"argument:\n  new:      {jax.tree.structure(picked)}\n"
      f"  argument: {jax.tree.structure(state)}"
    )


def _check_state_shapes(states: tuple[int, ...], new: list[list[Any]], state0: tuple) -> None:
  bad = [
    f"  argument {j}{jax.tree_util.keystr(p)}: new {jnp.shape(x)}, argument {jnp.shape(y)}"
    for j, n, s in zip(states, new, state0, strict=True)
    for x, (p, y) in zip(n, jax.tree.leaves_with_path(s), strict=True)
    if jnp.shape(x) != jnp.shape(y)
  ]
  if bad:
    raise ValueError("microbatch: state_out's new state changes shapes:\n" + "\n".join(bad))


# ----------------------------------------------------------------------------------------------
# The loop: its carry, its body, and what comes out of it.


def _init(opts: _Options, plan: _Outputs, state0: tuple, operands: tuple) -> _Carry:
  """The initial carry, with the device variance of what the loop writes into it.

  A loop carry must keep its type: zeros built from constants are invariant, while what the
  body writes varies wherever the micro-batch values (or the weights) do.
  """
  like = plan.like
  means_t, sums_t, last_t = (plan.pick(like, r) for r in ("mean", "sum", "last"))

  def vary(x, t, k_axis=None):
    return _match_sharding(_collectives.match_variance(x, t), t, k_axis)

  return _Carry(
    # Σ wᵢ fᵢ varies wherever fᵢ or wᵢ does.
    means=vary(
      vary(_core.zeros(means_t, opts.accum_dtype, mean=True), means_t), [plan.total] * len(means_t)
    ),
    sums=vary(_core.zeros(sums_t, opts.accum_dtype), sums_t),
    total=vary(jnp.zeros((), jnp.float32), plan.total),
    invalid=vary(jnp.zeros((), jnp.float32), plan.total),
    last=vary([jnp.zeros(t.shape, t.dtype) for t in last_t], last_t),
    rows=[
      vary(_batch.zeros_split(t, opts.k, layout), t, int(layout == "strided"))
      for t, layout in zip(plan.pick(like, "concat"), plan.layouts, strict=True)
    ],
    state=vary(state0, _state_like(plan, state0)),
    operands=operands,
  )


def _match_sharding(tree: Any, like: Any, k_axis: int | None = None) -> Any:
  """Gives each leaf of `tree` the Explicit sharding of its leaf in `like`, where it has one.

  Under a mesh with Explicit axes a loop carry's type includes its sharding: zeros built from
  constants are unsharded, while what the body writes is sharded like the micro-batch values.
  `k_axis`: the leaves of `tree` have one more axis than `like`'s, there (a rows buffer).
  """

  def one(x, t):
    spec = _batch.explicit_spec(t)
    if spec is None:
      return x
    if k_axis is not None:
      spec = PartitionSpec(*spec[:k_axis], None, *spec[k_axis:])
    if jnp.ndim(x) != len(spec) or jax.typeof(x).sharding.spec == spec:
      return x
    return jax.sharding.reshard(x, spec)

  return jax.tree.map(one, tree, like)


def _state_like(plan: _Outputs, state: tuple) -> tuple:
  """The output leaves that are the new state, in the state arguments' structure."""
  return tuple(
    jax.tree.unflatten(jax.tree.structure(s), [plan.like[n] for n in leaves])
    for s, leaves in zip(state, plan.state, strict=True)
  )


def _body(i: jax.Array, carry: _Carry, *, opts: _Options, pos, plan: _Outputs) -> _Carry:
  """Micro-batch ``i``: call `fun`, add its outputs to the sums, keep its state."""
  out, w = _call(opts, pos, carry.operands, carry.state, i)
  leaves = [jnp.asarray(x) for x in plan.tree.flatten_up_to(out)]  # Python constants too
  # With a weight, `add` drops a micro-batch whose weight is invalid; here it is remembered.
  means, total, invalid = _core.add(
    carry.means, carry.total, plan.pick(leaves, "mean"), w, skip_nonfinite=False
  )
  # "sum" leaves are unweighted: the same core `add` with weight None (its total unused).
  sums, _, _ = _core.add(carry.sums, total, plan.pick(leaves, "sum"), None, skip_nonfinite=False)
  rows = [
    _batch.put(r, y, i, layout)
    for r, y, layout in zip(carry.rows, plan.pick(leaves, "concat"), plan.layouts, strict=True)
  ]
  state = _new_state(plan, leaves, carry.state)
  invalid = carry.invalid + invalid.astype(jnp.float32)
  last = plan.pick(leaves, "last")
  new = _Carry(means, sums, total, invalid, last, rows, state, carry.operands)
  return _collectives.match_variance(new, carry)


def _new_state(plan: _Outputs, leaves: list[Any], state: tuple) -> tuple:
  """The selected output `leaves` as the new state, in the state's structure and dtypes."""
  new = []
  for s, positions in zip(state, plan.state, strict=True):
    old = jax.tree.leaves(s)
    values = [leaves[n].astype(x.dtype) for n, x in zip(positions, old, strict=True)]
    new.append(jax.tree.unflatten(jax.tree.structure(s), values))
  return tuple(new)


BOUND_VARIES = (
  "microbatch: axis_name={axis!r} was bound over the mesh here (plain jax.jit), and {what} "
  "differs per device: each device computed it from its own rows, so it has no single value "
  "to return. Make it the same everywhere inside `fun` (e.g. `nn.BatchNorm(axis_name={axis!r})`"
  " for batch statistics, or `jax.lax.pmean(x, {axis!r})`), use reduction 'mean'/'sum' for "
  "it, or call microbatch inside your own `jax.shard_map` to keep per-device values."
)


def _check_bound_outputs(opts: _Options, plan: _Outputs, carry: _Carry) -> None:
  """With the axis bound here, the threaded state and "last" outputs must be the same on every
  device (outputs of a plain-jit function are global); "concat" rows are joined instead."""
  if not opts.bound_here:
    return
  for i, s in enumerate(carry.state):
    if any(_collectives.is_varying(x, opts.axis_name) for x in jax.tree.leaves(s)):
      what = f"the threaded state (state_argnums entry {i})"
      raise ValueError(BOUND_VARIES.format(axis=opts.axis_name, what=what))
  lasts = [n for n, r in enumerate(plan.kinds) if r == "last"]
  for n, x in zip(lasts, carry.last, strict=True):
    if _collectives.is_varying(x, opts.axis_name):
      what = f"output leaf {n} (reduction 'last')"
      raise ValueError(BOUND_VARIES.format(axis=opts.axis_name, what=what))


def _finish(opts: _Options, plan: _Outputs, carry: _Carry) -> Any:
  """Once, after the loop: the sums and the weight in one all-reduce, then normalised."""
  _check_bound_outputs(opts, plan, carry)
  reduced = _collectives.reduce(
    (carry.means, carry.sums, carry.total, carry.invalid), opts.axis_name
  )
  means, sums, total, invalid = reduced
  means = _core.normalise(means, total, plan.pick(plan.like, "mean"), "mean")
  values = {
    "mean": [jnp.where(invalid > 0, jnp.full_like(m, jnp.nan), m) for m in means],
    "sum": _core.normalise(sums, total, plan.pick(plan.like, "sum"), "sum"),
    "last": carry.last,
    "concat": [_batch.unsplit(y) for y in carry.rows],
  }
  results: list[Any] = [None] * len(plan.like)
  for kind, vals in values.items():
    indices = [n for n, r in enumerate(plan.kinds) if r == kind]
    for n, v in zip(indices, vals, strict=True):
      results[n] = v
  for s, leaves in zip(carry.state, plan.state, strict=True):
    for n, x in zip(leaves, jax.tree.leaves(s), strict=True):
      results[n] = x.astype(plan.like[n].dtype)
  return jax.tree.unflatten(plan.tree, results)
