"""The scan loop of `microbatch`: its carry, one micro-batch, and what comes out after it.

`_microbatch` resolves the call (where the batch, keys and state sit), splits the batch
arguments and traces `fun` once for the output plan (`_outputs.Plan`); then `run` here does
the rest: the initial carry (`_init`: zeros with the device variance and sharding of what the
body writes), one body per micro-batch (`_body`: read micro-batch ``i`` in place, call `fun`
on it, add its outputs with the shared `_core.add`, so XLA updates the sums in place, and its
gradient's ``Σ|g|²`` to the noise statistics), and once after the loop the one all-reduce
and the normalisation (`_finish`).

The loop is `lax.fori_loop`: with a trip count known when tracing (``k``, or a Python-int
number of real micro-batches) it is one `lax.scan`, compiled to a loop of known trip count;
with a traced count it is a while loop that stops after the real micro-batches. A `lax.scan`
over all ``k`` with a `lax.cond` skipping the padding would run ``k`` iterations whatever the
count, and on GPU XLA reads a conditional's predicate back to the host on each of them (as it
reads a while loop's condition): the while loop does the least work and the fewest reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from optax_accum.batch_size import _noise
from optax_accum.core import _batch, _checks, _core, _outputs
from optax_accum.core._typing import AxisName, Split
from optax_accum.parallel import _collectives, _fsdp, _gspmd


class MicrobatchInfo(NamedTuple):
  """What a `microbatch` call saw besides its outputs (``return_info=True``); global values."""

  num_skipped: jax.Array  # shape=(), dtype=jnp.int32: micro-batches dropped for NaN/Inf
  total_weight: jax.Array  # shape=(), dtype=jnp.float32: Σ wᵢ over the kept micro-batches
  # With `noise_scale`: this step's window statistics of the gradient (`noise_scale`'s
  # `NoiseScale`: window_trace_cov T, window_grad_sq Q, and b_simple = T / Q); else None.
  noise: _noise.NoiseScale | None = None


class Options(NamedTuple):
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
  skip_nonfinite: bool | int | Callable[[Any], Any]  # True, False, or the deciding outputs
  return_info: bool
  noise: int | Callable[[Any], Any] | None  # noise_scale: selects the gradient output
  axis_name: AxisName | None
  mesh: Any  # the mesh whose `axis_name` to bind under plain jit; None: the one in effect
  unroll: int | bool = 1  # micro-batches per loop iteration (`lax.scan`'s unroll); True: all
  axis: _gspmd.Axis = _gspmd.Axis(None, "none")  # resolved per call
  keep_unsharded: _fsdp.Request | None = None  # FSDP: what stays unsharded (`_fsdp`)
  fsdp: _fsdp.Fsdp | None = None  # its plan for this call (where the axis is bound here)


class Carry(NamedTuple):
  """What the loop carries from one micro-batch to the next."""

  means: list[jax.Array]  # Σ wᵢ fᵢ of the "mean" leaves, in the accumulation dtype
  sums: list[jax.Array]  # Σ wᵢ fᵢ of the "sum" leaves
  total: jax.Array  # Σ wᵢ of the kept micro-batches; shape=(), dtype=jnp.float32
  # Counts in float32, the sums' dtype, so that they ride in their one all-reduce (XLA keeps
  # collectives of different dtypes apart): weights that were negative, NaN or ±Inf (the
  # weighted outputs are NaN then: never a finite wrong number), and micro-batches dropped for
  # non-finite values (skip_nonfinite).
  invalid: jax.Array  # shape=(), dtype=jnp.float32
  skipped: jax.Array  # shape=(), dtype=jnp.float32
  noise: _noise.NoiseState  # Σ wᵢ|gᵢ|² and the kept count of the gradient (noise_scale)
  last: list[jax.Array]  # the latest value of the "last" leaves
  rows: list[jax.Array]  # every micro-batch's "concat" and "stack" values (zeros until written)
  state: tuple[Any, ...]  # the threaded state arguments
  # The call's (args, kwargs), batch arguments split: loop-invariant operands XLA neither
  # copies nor moves (values enter the loop as operands, not closures).
  operands: tuple[list[Any], dict[str, Any]]


# ----------------------------------------------------------------------------------------------
# One micro-batch.


def _take(tree: Any, i: Any, split: Split, axis: int) -> Any:
  return jax.tree.map(lambda v: _batch.take(v, i, split, axis), tree)


def _fold_keys(keys: Any, i: jax.Array, axis: _gspmd.Axis) -> Any:
  """Micro-batch ``i``'s keys: ``fold_in(key, i)``, after the device index with an axis."""
  if axis.bound:
    # A replicated key would give every device the same masks on different examples.
    index = axis.index()
    keys = jax.tree.map(lambda key: jax.random.fold_in(key, index), keys)
  return jax.tree.map(lambda key: jax.random.fold_in(key, i), keys)


def call(
  opts: Options, pos: _batch.Positions, operands: tuple, state: tuple, i: Any
) -> tuple[Any, jax.Array | None]:
  """`fun` and `weight_fn` on micro-batch ``i``: ``(output, weight or None)``."""
  args, kwargs = operands
  a, kw = list(args), dict(kwargs)
  for key, axis in pos.axis_of().items():
    if isinstance(key, str):
      kw[key] = _take(kwargs[key], i, opts.split, axis)
    else:
      a[key] = _take(args[key], i, opts.split, axis)
  for j in pos.rngs:
    a[j] = _fold_keys(args[j], i, opts.axis)
  for j, s in zip(pos.states, state, strict=True):
    a[j] = s
  if opts.fsdp is not None:  # keep_unsharded="nothing": the parameters gathered for this one
    a, kw = opts.fsdp.in_microbatch(a, kw, i)
  a, kw = _batch.show_static((a, kw))
  out = opts.fun(*a, **kw)
  if opts.weight_fn is None:
    return out, None
  w = opts.weight_fn(*a, **kw)
  return out, _checks.weight(w, f"microbatch: weight_fn returned {_describe(w)}")


def _describe(value: Any) -> str:
  """A weight as an error shows it: its value where known, else its dtype and shape."""
  for show in (lambda v: repr(float(np.asarray(v))), lambda v: f"{v.dtype}{list(v.shape)}"):
    try:
      return show(value)
    except Exception:  # traced, not a scalar, not an array
      pass
  return repr(value)


# ----------------------------------------------------------------------------------------------
# The loop: its carry, its body, and what comes out of it.


def run(opts: Options, pos, plan: _outputs.Plan, state0: tuple, operands: tuple, trips) -> Any:
  """The loop over the micro-batches and what comes out of it: `microbatch`'s result.

  `trips`: how many micro-batches to run, a Python int (one `lax.scan`; 1: the body alone, no
  loop) or a traced count (a while loop that stops after the real micro-batches).
  """
  carry = _init(opts, plan, state0, operands)
  body = functools.partial(_body, opts=opts, pos=pos, plan=plan)
  if isinstance(trips, int) and trips == 1:
    carry = body(jnp.int32(0), carry)  # one micro-batch (k = 1 among others): no loop
  elif isinstance(trips, int):
    # A static trip count: `fori_loop` is a `lax.scan`, unrolled by `unroll` (True: all).
    carry = lax.fori_loop(0, trips, body, carry, unroll=opts.unroll)
  else:
    if opts.unroll is True or opts.unroll != 1:
      raise ValueError(UNROLL_TRACED.format(unroll=opts.unroll))
    carry = lax.fori_loop(0, trips, body, carry)  # a while loop: no unrolling
  return _finish(opts, plan, carry)


UNROLL_TRACED = (
  "microbatch: unroll={unroll!r} needs a trip count known when tracing, but "
  "num_real_microbatches is traced (the loop is a while loop that stops after the real "
  "micro-batches, which cannot be unrolled). Use unroll=1 (the default), or pass "
  "num_real_microbatches as a Python int (one compiled program per value)."
)


def check_unroll(value: Any) -> int | bool:
  """`unroll`, as `lax.scan` takes it: a positive int, or a bool (True: every micro-batch
  in one iteration; False: as 1)."""
  if isinstance(value, bool | np.bool_):
    return True if value else 1
  if not isinstance(value, int | np.integer):
    raise TypeError(
      "microbatch: unroll must be a positive int (micro-batches per loop iteration) or True "
      f"(all of them: no loop), got {value!r} of type {type(value).__name__}."
    )
  if value < 1:
    raise ValueError(
      f"microbatch: unroll must be a positive int or True, got {value}; 1 (the default) runs "
      "one micro-batch per loop iteration."
    )
  return int(value)


def _layout(kind: str, split: Split) -> Split:
  """How a rows buffer is laid out: "concat" rows as the batch is split (so that joining them
  is a free reshape back to the batch's order), "stack" entries one per micro-batch."""
  return split if kind == "concat" else "contiguous"


def _init(opts: Options, plan: _outputs.Plan, state0: tuple, operands: tuple) -> Carry:
  """The initial carry, with the device variance of what the loop writes into it.

  A loop carry must keep its type: zeros built from constants are invariant, while what the
  body writes varies wherever the micro-batch values (or the weights) do.
  """
  like, weighted = plan.like, opts.weight_fn is not None
  means_t, sums_t, last_t = (plan.pick(like, r) for r in ("mean", "sum", "last"))

  def vary(x, t, k_axis=None):
    return _match_sharding(_collectives.match_variance(x, t), t, k_axis)

  def weighted_sums(zeros, t):  # Σ wᵢ fᵢ varies wherever fᵢ or wᵢ does
    return vary(vary(zeros, t), [plan.total] * len(t))

  # The weight and the counts vary wherever the weights or the finite checks do: per device.
  varying = opts.axis.collectives.to_varying
  scalar = varying(jnp.zeros((), jnp.float32))
  rows = []
  for n in plan.where("concat", "stack"):
    layout = _layout(plan.kinds[n], opts.split)
    rows.append(vary(_batch.zeros_split(like[n], opts.k, layout), like[n], _k_axis(layout)))
  means = weighted_sums(_core.zeros(means_t, opts.accum_dtype, mean=True), means_t)
  # A weighted sum of integer counts is not an integer: accumulated as a float then.
  sums = weighted_sums(_core.zeros(sums_t, opts.accum_dtype, mean=weighted), sums_t)
  return Carry(
    means=_fsdp.shard_carry(opts.fsdp, means, plan.where("mean")),  # FSDP: a gradient's shard
    sums=_fsdp.shard_carry(opts.fsdp, sums, plan.where("sum")),
    total=scalar,
    invalid=scalar,
    skipped=scalar,
    noise=varying(_noise.init()),
    last=vary([jnp.zeros(t.shape, t.dtype) for t in last_t], last_t),
    rows=rows,
    state=vary(state0, _state_like(plan, state0)),
    operands=operands,
  )


def _k_axis(layout: Split) -> int:
  """The axis of a rows buffer that numbers the micro-batches (see `_batch.zeros_split`)."""
  return int(layout == "strided")


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


def _state_like(plan: _outputs.Plan, state: tuple) -> tuple:
  """The output leaves that are the new state, in the state arguments' structure."""
  return tuple(
    jax.tree.unflatten(jax.tree.structure(s), [plan.like[n] for n in leaves])
    for s, leaves in zip(state, plan.state, strict=True)
  )


def _body(i: jax.Array, carry: Carry, *, opts: Options, pos, plan: _outputs.Plan) -> Carry:
  """Micro-batch ``i``: call `fun`, add its outputs to the sums, keep its state."""
  out, w = call(opts, pos, carry.operands, carry.state, i)
  leaves = [jnp.asarray(x) for x in plan.tree.flatten_up_to(out)]  # Python constants too
  means, sums = plan.pick(leaves, "mean"), plan.pick(leaves, "sum")
  if sums:  # a "sum" `fun` already reduced over the axis: warn, or raise if weights vary
    opts.axis.collectives.warn_if_reduced(sums, w, "microbatch")
  # One add for both: one weight, one finite check, one decision to drop the micro-batch.
  check = None if plan.decide is None else [leaves[n] for n in plan.decide]
  # FSDP (keep_unsharded): a gradient reduce-scattered per micro-batch is weighted and checked
  # whole, on each device, then scattered and added to its shard (`_fsdp.add_outputs`).
  where = plan.where("mean") + plan.where("sum")
  acc, total, dropped = _core.add(
    _fsdp.add_inputs(opts.fsdp, carry.means + carry.sums, means + sums, where),
    carry.total,
    means + sums,
    w,
    skip_nonfinite=opts.skip_nonfinite is not False,
    agree=opts.axis.collectives.agree,
    check=check,
  )
  acc = _fsdp.add_outputs(opts.fsdp, carry.means + carry.sums, acc, where)
  invalid = jnp.asarray(False) if w is None else ~_checks.valid_weight(w)
  rows = [
    _batch.put(r, leaves[n], i, _layout(plan.kinds[n], opts.split))
    for r, n in zip(carry.rows, plan.where("concat", "stack"), strict=True)
  ]
  new = Carry(
    means=acc[: len(means)],
    sums=acc[len(means) :],
    total=total,
    invalid=carry.invalid + invalid.astype(jnp.float32),
    skipped=carry.skipped + (dropped & ~invalid).astype(jnp.float32),
    noise=_add_noise(opts, plan, carry.noise, leaves, w, dropped),
    last=plan.pick(leaves, "last"),
    rows=rows,
    state=_new_state(plan, leaves, carry.state),
    operands=carry.operands,
  )
  return _collectives.match_variance(new, carry)


def _add_noise(opts: Options, plan: _outputs.Plan, noise, leaves: list, w, dropped):
  """The micro-batch's gradient into the noise statistics, in units of one global micro-batch
  by default (each device adds its share: `_noise.piece_weight`)."""
  if not plan.noise:
    return noise
  grads = [leaves[n] for n in plan.noise]
  pieces = 1 if _noise_reduced(opts, plan) else opts.axis.collectives.size()
  sq = _noise.sq_norm(grads, _over_shards(opts))
  return _noise.add(noise, grads, _noise.piece_weight(w, pieces), ~dropped, sq=sq)


def _over_shards(opts: Options) -> Any:
  """Inside a map whose other axes shard the parameters, how per-leaf squares make the whole
  gradient's (`_collectives.Axis.sum_over_shards`); None without a bound axis."""
  collectives = opts.axis.collectives
  return None if collectives.name is None else collectives.sum_over_shards


def _noise_reduced(opts: Options, plan: _outputs.Plan) -> bool:
  """The gradient `fun` returns is already reduced over the axis (the same on every device)."""
  return any(_already_reduced(plan.like[n], opts.axis) for n in plan.noise)


def _new_state(plan: _outputs.Plan, leaves: list[Any], state: tuple) -> tuple:
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


def _check_bound_outputs(opts: Options, plan: _outputs.Plan, carry: Carry) -> None:
  """With the axis bound here, the threaded state, "stack" and "last" outputs must be the same
  on every device (outputs of a plain-jit function are global); "concat" rows are joined."""
  if opts.axis.mode != "bound_here":
    return
  name = opts.axis.name
  for i, s in enumerate(carry.state):
    if any(_collectives.is_varying(x, name) for x in jax.tree.leaves(s)):
      raise ValueError(BOUND_VARIES.format(axis=name, what=f"the threaded state (entry {i})"))
  per_mb = zip(plan.where("concat", "stack"), carry.rows, strict=True)
  outputs = [(n, x) for n, x in per_mb if plan.kinds[n] == "stack"]
  outputs += list(zip(plan.where("last"), carry.last, strict=True))
  for n, x in outputs:
    if _collectives.is_varying(x, name):
      what = f"output leaf {n} (reduction {plan.kinds[n]!r})"
      raise ValueError(BOUND_VARIES.format(axis=name, what=what))


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _already_reduced(like: Any, axis: _gspmd.Axis) -> bool:
  """A value `fun` returned the same on every device (its type carries no varying axis): it was
  reduced over the axis inside `fun` already (`_collectives.already_reduced`)."""
  return axis.bound and _collectives.already_reduced([like], axis.name)


def _finish(opts: Options, plan: _outputs.Plan, carry: Carry) -> Any:
  """Once, after the loop: the sums, weight and counts in one all-reduce, then normalised.

  A "sum" that `fun` already reduced (the same on every device) is global as it is: it stays
  out of the all-reduce, which would count it once per device.
  """
  _check_bound_outputs(opts, plan, carry)
  # FSDP (keep_unsharded): the gradients of sharded parameters are reduced apart (`_fsdp.pull`).
  carry_means, fsdp_means = _fsdp.pull(opts.fsdp, carry.means, plan.where("mean"))
  carry_sums, fsdp_sums = _fsdp.pull(opts.fsdp, carry.sums, plan.where("sum"))
  sum_like = [t for i, t in enumerate(plan.pick(plan.like, "sum")) if i not in fsdp_sums]
  done = [_already_reduced(t, opts.axis) for t in sum_like]
  local = [s for s, d in zip(carry_sums, done, strict=True) if not d]
  # The noise scale's |Σ wᵢgᵢ|² of the FSDP gradients: their shards' squares, on the all-reduce.
  shards_sq = _fsdp.shards_sq(opts.fsdp, fsdp_means, plan.where("mean"), plan.noise)
  partials = _noise.partials(carry.noise)
  reduced = opts.axis.collectives.reduce(
    (carry_means, local, carry.total, carry.invalid, carry.skipped, partials, shards_sq)
  )
  means, local, total, invalid, skipped, partials, shards_sq = reduced
  means = _fsdp.put_back(means, fsdp_means)
  if plan.noise and _noise_reduced(opts, plan):  # n copies of the same gradients: once
    partials = _noise.once(partials, opts.axis.collectives.size())
  local = iter(local)
  sums = [s if d else next(local) for s, d in zip(carry_sums, done, strict=True)]
  sums = _fsdp.put_back(sums, fsdp_sums)
  sum_like = plan.pick(plan.like, "sum")
  # NaN, never a finite wrong number: for invalid weights, and for a step whose micro-batches
  # were all dropped for NaN/Inf (its sums hold nothing; zeros would look like a result).
  void = (invalid > 0) | ((skipped > 0) & (total == 0))
  nan = lambda x: jnp.where(void, jnp.full_like(x, jnp.nan), x)  # noqa: E731
  # An integer or bool "sum" comes back in its accumulator's dtype: at least int32, exact (cast
  # back to int8 or bool it would wrap); weighted by weight_fn it is a float.
  sum_like = [s if not _is_float(t) else t for s, t in zip(sums, sum_like, strict=True)]
  values = {
    "mean": [nan(m) for m in _core.normalise(means, total, plan.pick(plan.like, "mean"), "mean")],
    "sum": [nan(s) if _is_float(s) else s for s in _core.normalise(sums, total, sum_like, "sum")],
    "last": carry.last,
  }
  results: list[Any] = [None] * len(plan.like)
  for kind, vals in values.items():
    for n, v in zip(plan.where(kind), vals, strict=True):
      results[n] = v
  for n, y in zip(plan.where("concat", "stack"), carry.rows, strict=True):
    results[n] = _batch.unsplit(y) if plan.kinds[n] == "concat" else y
  for s, leaves in zip(carry.state, plan.state, strict=True):
    for n, x in zip(leaves, jax.tree.leaves(s), strict=True):
      # (No cast where none is needed: a PRNG key, e.g. an nnx.Rngs stream's, has no astype.)
      results[n] = x if x.dtype == plan.like[n].dtype else x.astype(plan.like[n].dtype)
  out = jax.tree.unflatten(plan.tree, results)
  if not opts.return_info:
    return out
  if not plan.noise:
    return out, MicrobatchInfo(skipped.astype(jnp.int32), total, None)
  noise = _window_noise(opts, plan, means, total, partials, invalid, shards_sq)
  return out, MicrobatchInfo(skipped.astype(jnp.int32), total, noise)


def _window_noise(
  opts: Options, plan: _outputs.Plan, means: list, total, partials, invalid, shards_sq=None
) -> _noise.NoiseScale:
  """The step's window as a `NoiseScale`, from the global sums ``Σ wᵢgᵢ`` (``means``, before
  normalising) of the gradient's leaves: ``|ḡ|² = |Σ wᵢgᵢ|² / W²``; those of FSDP gradients
  (sharded, `keep_unsharded`) are in `shards_sq` already. An invalid traced weight makes the
  weighted outputs NaN, and the figures too (never a finite wrong number)."""
  index = {n: i for i, n in enumerate(plan.where("mean"))}
  sharded = () if opts.fsdp is None else opts.fsdp.outputs
  picked = [means[index[n]] for n in plan.noise if n not in sharded]
  sq = _noise.sq_norm(picked, _over_shards(opts)) + (0.0 if shards_sq is None else shards_sq)
  mean_sq = sq / jnp.square(total)
  sq_sum, count, weight = partials
  trace, grad_sq = _noise.window_stats(sq_sum, count, weight, mean_sq)
  nan = jnp.full((), jnp.nan, jnp.float32)
  trace, grad_sq = (jnp.where(invalid > 0, nan, x) for x in (trace, grad_sq))
  return _noise.NoiseScale(grad_sq, trace, trace / grad_sq, grad_sq, trace)  # nothing to smooth
