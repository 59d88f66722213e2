"""`microbatch`: one training step's batch as k micro-batches, run one after another in one loop.

Reads top-down (`_run`): resolve where the batch, keys and state sit → reshape the batch
arguments (free, no copy; which rows go into micro-batch ``i`` is `_batch`'s business) → trace
`fun` once abstractly for its output plan (`_outputs`: which leaf is reduced how, which leaves
are the threaded state) → the loop, a module of its own (`_scan.run`): its body reads
micro-batch ``i`` in place, calls `fun` on it and adds its outputs to sums kept in a named
carry (with the shared `_core`, so XLA updates them in place); after it, one reduction across
devices and the normalisation.

Every ``k`` takes this one path, ``k = 1`` included (its loop is one call of the body): the same
weights, the same dropping of non-finite micro-batches, the same output shapes and dtypes.

The data-parallel axis is resolved once per call into a `_gspmd.Axis` and handed down: no
axis, bound by the caller's map, or bound here (plain `jax.jit`) through `_gspmd.run_bound`.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum.core import _batch, _checks, _outputs
from optax_accum.core._typing import SPLITS, ArgNums, AxisName, DType, Split
from optax_accum.front_ends import _nnx, _scan
from optax_accum.front_ends._microbatch_checks import (
  DEFAULT_SPLIT,
  check_bool,
  check_callables,
  check_noise,
  check_noise_once,
  check_num_real,
  check_sizes,
  check_skip,
  check_split,
  loop_trips,
  private_options,
)
from optax_accum.parallel import _collectives, _fsdp, _gspmd

UNNAMED_BATCH = (
  "microbatch: fun failed on one micro-batch ({b} of the batch's {size} rows; batch arguments: "
  "{named}): {error}\n{suspects} passed whole to every micro-batch, but its leading size is the "
  "batch size {size}: if it holds batch data, name it, e.g. batch_argnums={hint} (positions) or "
  "batch_argnames=(...) (keywords)."
)

CONTIGUOUS_IN_MAP = (
  "microbatch: split='contiguous' with num_real_microbatches inside a map that binds "
  "axis_name={axis!r}: each device holds its own block of rows, so its first n micro-batches "
  "are not pieces of the batch's first n contiguous micro-batches. Use split='strided' (each "
  "device's micro-batch i is then its piece of the batch's micro-batch i, with no data "
  "movement), or call microbatch under plain jax.jit with axis_name (it lays the rows out "
  "itself)."
)

AVERAGED_ROWS = (
  "microbatch: fun's output {paths} has shape {shape}, one row per example of a micro-batch "
  "({b} of the batch's {size} rows), and the default reduction='mean' averages it over the {k} "
  "micro-batches: it comes back as {shape}, not the batch's ({size}, ...). If it holds "
  "per-example values (logits, per-example losses), ask for their rows in the batch's order "
  "with reduction='concat' there, e.g. reduction=(('mean', 'concat'), 'mean') for "
  "jax.value_and_grad(loss, has_aux=True) whose aux is the logits; if the average is what you "
  "want, pass reduction='mean' to say so (and silence this warning)."
)


class _DefaultReduction(str):
  """The default "mean", told apart from a "mean" the caller asked for (`_warn_averaged_rows`)."""

  __slots__ = ()


DEFAULT_MEAN = _DefaultReduction("mean")


LAYOUT_MISMATCH = (
  "microbatch: {lost} of the batch's {real} real rows (argument {at}, the mask, nonzero) sit "
  "in micro-batches that never run: num_real_microbatches={n} of {k} with split={split!r} runs "
  "micro-batches 0 to {last} only, so their clipped gradients would be left out of the sum "
  "silently (and the accountant assumes every sampled example is used). The rows were laid "
  "out for another split{guess}: a privacy.PoissonSampler(..., split=...) lays out its batch "
  "for microbatch(..., split=...) of the same value. Give both the same split= (both default "
  "to 'strided'): PoissonSampler(..., split={split!r}) for this microbatch, or "
  "microbatch(..., split={other!r}) for a batch from PoissonSampler(..., split={other!r}). "
  "Under jax.jit (a traced mask or count) the same mismatch makes the summed outputs NaN."
)


# ----------------------------------------------------------------------------------------------
# Argument checks (factory time).


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
  reduction: Any = None,
  weight_fn: Callable[..., Any] | None = None,
  rng_argnums: ArgNums = (),
  state_argnums: ArgNums = (),
  state_out: Callable[[Any], Any] | None = None,
  accum_dtype: DType | None = jnp.float32,
  split: Split = DEFAULT_SPLIT,
  skip_nonfinite: bool = True,
  return_info: bool = False,
  noise_scale: int | Callable[[Any], Any] | None = None,
  axis_name: AxisName | None = None,
  mesh: Any = None,
  unroll: int | bool = 1,
  keep_unsharded: str | None = None,
  in_shardings: Any = None,
) -> Callable[..., Any]:
  """Runs `fun` on a batch as `num_microbatches` sequential micro-batches under one `lax.scan`.

  The returned function has `fun`'s signature and output structure. It splits the batch
  arguments into ``k`` micro-batches (see `split`), calls `fun` on each in turn inside one
  `lax.scan` (program size and compile time do not grow with ``k``) and combines the outputs
  leaf by leaf. With ``fun = jax.value_and_grad(loss)`` and a loss that is a mean over the
  batch, the result is the large batch's loss and gradient at the memory of one micro-batch.
  ``k = 1`` is no special case: one call of `fun` through the same path, with the same
  weights, non-finite handling, output shapes and dtypes as any ``k``.

  Reductions, per output leaf (``fᵢ`` is micro-batch ``i``'s value, ``wᵢ`` its weight):

  * ``"mean"``: ``Σ wᵢ fᵢ / Σ wᵢ`` (equal weights without `weight_fn`); the mean of an integer
    output is a float;
  * ``"sum"``: ``Σ wᵢ fᵢ``, weighted as in `accumulate` (with the default weights 1, the plain
    sum, exact in at least int32 for integer and bool outputs: an int8 sum does not wrap; with
    `weight_fn`, an integer output's weighted sum is a float);
  * ``"concat"``: per-example rows: the output must have one row per example of the
    micro-batch (leading size ``b = B/k``), and the rows come back as ``(B, ...)`` in the
    batch's own example order, for both splits. Any other shape raises (use "stack");
  * ``"stack"``: one entry per micro-batch: a new leading axis of length ``k``, in micro-batch
    order (a scalar becomes ``(k,)``);
  * ``"last"``: the last micro-batch's value.

  "mean" and "sum" are accumulated in `accum_dtype` and cast back to the output's dtype once,
  at the end. Nothing is inferred from shapes: which outputs are rows and which are one per
  micro-batch is what `reduction` says.

  Non-finite micro-batches (`skip_nonfinite`, default True, as in `accumulate`): a micro-batch
  with a NaN or ±Inf in any of its "mean" or "sum" outputs — or in those `skip_nonfinite`
  names — is dropped: neither its values nor its weight enter the sums. The other outputs are
  not read ("concat", "stack" and "last" keep what `fun` returned; a threaded state advances).
  ``return_info=True`` returns the count. A step whose micro-batches were all dropped returns
  NaN for its "mean" and "sum" outputs: never zeros that look like a result. With
  `axis_name`, the unit dropped is one device's piece of a micro-batch (its rows of it): the
  other devices' pieces stay, and the result is the weighted mean over the kept pieces;
  without an axis the whole micro-batch goes.

  A private function (`privacy.clipped_grad`'s `ClippedGrad`, ``jax.value_and_grad`` or
  ``jax.grad`` of `privacy.clipped_loss`, or any function with ``__dp_private__ = True``) is
  held to the privacy contract (`optax_accum.privacy.CONTRACT`): "mean" anywhere in
  `reduction`, `weight_fn`, `noise_scale`, `state_argnums` and an `accum_dtype` narrower than
  float32 raise here; the default reduction is the function's own; and no micro-batch is ever
  dropped, whatever `skip_nonfinite` says (a non-finite per-example gradient already counts 0
  in clipping; a NaN loss value gives a NaN loss, never a lost micro-batch of gradients).

  Mutable state (Flax ``batch_stats``): name the state arguments in `state_argnums` and say
  where `fun`'s output holds their new value with `state_out`. Micro-batch ``i`` sees the state
  that micro-batch ``i-1`` produced, as ``k`` sequential small steps would; the output leaves
  that `state_out` selects (e.g. ``lambda out: out[0][1]``) come out as the final state whatever
  `reduction` says for them.

  Flax NNX objects (an ``nnx.Module``, ``nnx.Rngs`` or other ``nnx.Pytree``, passed as an
  argument of its own, positional or keyword) need no `state_argnums`: they are split once as
  ``nnx.scan`` splits them, their parameters (``nnx.Param``) read by every micro-batch and the
  rest of their state (BatchNorm statistics, the Rngs counters) threaded through the
  micro-batches in order, and the final state is written back into the objects after the loop
  (so each micro-batch draws its own dropout mask, and the caller's Rngs advance as ``k``
  sequential calls would advance them). An NNX object inside a container, or named as a batch
  argument, raises; so does a `fun` that changes the objects' structure.

  A padded batch (the last, partly empty batch of an epoch at the usual shape): pass
  `num_real_microbatches` ``n`` and only the first ``n`` micro-batches run — the loop stops
  after them. Which rows those are is the split's business, so name it: a batch padded at
  its end (real rows first, as ``np.pad`` gives) needs ``split="contiguous"``; the strided
  split runs rows ``r`` with ``r % k < n`` (a layout made for it, as
  `privacy.PoissonSampler`'s default). Left at its default, the split raises here, naming
  both (except for a private function with a mask, whose real rows are checked instead).
  "mean" and "sum" cover the real micro-batches only, "last" and the state come from the last
  real one, and "concat"/"stack" entries of the others are zeros. With ``n = 0`` nothing runs:
  "mean" and "sum" give zeros (as all-zero weights do) and the state comes back as given.

  Args:
    fun: the function to run per micro-batch, e.g. ``jax.value_and_grad(loss, has_aux=True)``.
    num_microbatches: ``k``, a positive int dividing the batch size. Give this or
      `microbatch_size`, not both.
    microbatch_size: the number of examples per micro-batch, ``b``, instead of ``k``
      (then ``k = B / b`` at each call; ``B`` must be a multiple of ``b``).
    batch_argnums: the positional arguments (pytrees) whose leaves have the batch axis.
      Default: argument 1, or none when `batch_argnames` is given. Every batch leaf must have
      the same size ``B`` along its batch axis, divisible by ``k``. Other arguments are passed
      to every micro-batch unchanged (if `fun` fails and one of them has the batch's leading
      size, the error says so: name it here).
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
      per micro-batch (a Python int keeps a fixed trip count, one compile per value). Inside
      a map that binds `axis_name` each device may hold its own count; "mean" and "sum" then
      cover every device's real micro-batches (split "strided" only: see `axis_name`).
    reduction: "mean", "sum", "concat", "stack" or "last", or a pytree prefix of `fun`'s
      output with those strings at its leaves, e.g. ``("mean", "concat")`` for
      ``(loss, per_example_logits)``. Default "mean"; for a private function (see below) its
      own ``.reduction`` (`privacy.ClippedGrad`'s), else "sum".
    weight_fn: called like `fun` (the batch arguments replaced by one micro-batch, the same
      PRNG keys and state), returns that micro-batch's non-negative scalar weight, e.g. its
      number of real (non-padding) tokens. Default: equal weights (1). A host value that is
      negative, NaN or ±Inf raises, naming `weight_fn`; a traced one makes the weighted
      outputs ("mean", "sum") NaN, never a finite wrong number.
    rng_argnums: positional arguments that are PRNG keys (typed ``jax.random.key`` or raw
      ``jax.random.PRNGKey``), or pytrees of them. Micro-batch ``i`` gets
      ``jax.random.fold_in(key, i)`` (for every ``k``, 1 included): a different key each,
      derived deterministically, never the given key itself. With `axis_name` the key is
      first folded with the device's `lax.axis_index`, so devices never share masks either.
    state_argnums: positional arguments threaded through the micro-batches in order.
    state_out: ``output -> new state`` (one value when `state_argnums` is an int, a tuple when
      it is a sequence) that *selects* leaves of `fun`'s output (indexing, attribute access),
      with the structure and shapes of those arguments (dtypes are cast to theirs). It is
      applied once, to the output's structure, to find those leaves. Required with
      `state_argnums`.
    accum_dtype: the dtype in which floating "mean"/"sum" outputs are accumulated; None means
      each output's own dtype.
    split: "strided" (the default: micro-batch ``i`` takes rows ``i, i+k, …``; keeps the
      batch sharding) or "contiguous" (consecutive blocks of ``B/k`` rows). With
      `num_real_microbatches` give it explicitly (see "A padded batch" above).
    skip_nonfinite: True: drop a micro-batch whose "mean" or "sum" outputs hold a NaN or ±Inf
      (see above). An int ``j`` (the output's ``j``-th entry, e.g. 1 for `jax.value_and_grad`'s
      gradient) or a selector ``lambda out: out[1]`` (as `state_out`): only those outputs
      decide, so a NaN in a monitoring metric stays a NaN metric and does not remove the
      gradient. False: NaN/Inf enter the sums (and the results are non-finite).
    return_info: return ``(output, info)``, where ``info`` is a `MicrobatchInfo`:
      ``num_skipped`` (micro-batches dropped by `skip_nonfinite`; with `axis_name`, each
      device's piece counts) and ``total_weight`` (Σ wᵢ of the kept ones), both global.
    noise_scale: measure the gradient noise scale of this step's micro-batches (implies
      `return_info`): which output is the gradient, as an int ``j`` (the output's ``j``-th
      entry: 1 for ``jax.value_and_grad``'s ``(value, grad)``) or a selector
      ``lambda out: out[0][1]`` (as `state_out`); its leaves must be reduced by "mean".
      ``info.noise`` is then a `NoiseScale` (as `optax_accum.noise_scale` returns for
      `accumulate`) of this one window: ``window_trace_cov`` ``T = (Σ wᵢ|gᵢ|² − W|ḡ|²) /
      (n − 1)``, ``window_grad_sq`` ``Q = |ḡ|² − T/W`` over the ``n`` kept micro-batches
      (``ḡ`` their weighted mean, ``W`` the total weight), ``grad_sq``/``trace_cov`` the same
      (one window: nothing to smooth) and ``b_simple = T / Q``, in units of the weight; NaN
      with fewer than two kept micro-batches. Costs one squared-norm reduction per
      micro-batch and two scalars in the loop, no parameter-sized memory. With `axis_name`,
      each device's micro-batches are further pieces of the window (2 devices × k count as
      2k micro-batches); the two scalars ride on the one all-reduce after the loop.
    axis_name: the data-parallel axis: "mean" and "sum" outputs (and the weights) are reduced
      over it once, after the loop, to the global large-batch result. The non-batch arguments
      are made device-varying first, so gradients taken inside `fun` stay local (no
      collective in the loop). A "sum" output that `fun` already reduced over the axis (the
      same on every device) is not reduced again, with a warning (or an error when the
      weights differ per device). Inside `shard_map`/`pmap` (which bind the axis) each
      device's rows are its batch: "concat", "stack" and "last" outputs stay per device, and
      the strided split's micro-batch ``i`` is the device's piece of the whole batch's
      micro-batch ``i`` (a contiguous split with `num_real_microbatches` raises there). Under
      plain `jax.jit` with a mesh in effect (`jax.set_mesh`, Auto or Explicit axes) or given as
      `mesh`, `microbatch` binds the axis itself over that mesh axis only (other mesh axes
      stay automatic) and gives the result of the same call without `axis_name`: micro-batch
      ``i`` is the whole batch's micro-batch ``i`` for both splits (each device runs its piece;
      "contiguous" moves rows between devices once to lay the pieces out), "concat" rows come
      back in the batch's order, a threaded state, "stack" or "last" output that differs per
      device is an error, and `microbatch_size` counts each device's rows.
    mesh: the mesh whose `axis_name` to bind under plain `jax.jit`; default: the one in
      effect. Ignored inside a map that binds the axis.
    unroll: how many micro-batches each iteration of the loop runs, as `jax.lax.scan` takes
      it: a positive int, or True for all ``k`` (no loop: the body is copied into the program
      ``k`` times). The results are the same. Default 1: one micro-batch per iteration, so
      the program, its compile time and its memory stay those of one micro-batch whatever
      ``k``. Unrolling trades those for speed where a loop body runs slower than the same
      code outside a loop: on CPU, XLA runs convolutions' weight gradients inside a loop in a
      slow form (jax-ml/jax#12868), and a small conv net's step (the Flax NNX MNIST CNN, k =
      4) ran about 7 times faster with ``unroll=True``. But XLA then keeps every micro-batch's
      activations alive: that step's temporary memory grew from 15 MB to 46 MB, more than
      the large batch's 42 MB (``benchmarks/small_models.py``), and its compile time doubled.
      Check with ``jax.jit(step).lower(...).compile().memory_analysis()``. A partial unroll
      (``1 < unroll < k``) still runs a loop, convolutions as slow. Needs a trip count known
      when tracing: a traced `num_real_microbatches` (a while loop) raises with any unroll
      but 1.
    keep_unsharded: FSDP (parameters sharded over axes of `axis_name`, under plain `jax.jit`):
      what stays unsharded for the window (``L`` such parameters). None: as without it.
      ``"nothing"``: gathered and reduce-scattered per micro-batch (``L·k`` + ``L·k``, least
      memory); ``"params"``: gathered once, reduce-scattered per micro-batch (``L`` + ``L·k``);
      ``"params_and_grads"``: a whole accumulator too, reduce-scattered once (``L`` + ``L``).
      Their gradients (the output shaped like them, as ``jax.value_and_grad``'s) come back
      sharded like them; everything else as without it. Name every axis the batch is split
      over (``("data", "fsdp")``); see the sharding guide and `plan_microbatches`.
    in_shardings: with `keep_unsharded` on Auto mesh axes under `jax.jit` (where a traced
      argument's placement is not known): the tuple given to `jax.jit`'s ``in_shardings``.

  Returns:
    A function with `fun`'s signature returning `fun`'s output structure, reduced as above
    (with `return_info`, ``(output, MicrobatchInfo)``).

  Raises:
    TypeError, ValueError: here, for a bad `num_microbatches`/`microbatch_size` (or both, or
      neither), argnums, argnames, `batch_axes`, `num_real_microbatches` (also: given with
      `split` left at its default), `reduction`, `split`, `weight_fn` or `unroll`; at trace
      time, for `unroll` other than 1 with a traced `num_real_microbatches`, for a batch size
      not divisible by ``k`` (or `microbatch_size`), batch arguments that disagree on the
      batch size, positions out of range, a missing keyword batch argument, a `reduction`
      that does not fit the output, a "concat" output without one row per example, a host
      weight from `weight_fn` that is invalid, or a `state_out` that does not select output
      leaves.

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
  ...   f = optax_accum.microbatch(
  ...     jax.value_and_grad(loss), 4, split="contiguous", num_real_microbatches=n
  ...   )
  ...   return f(w, x)
  >>> value, grad = padded_step(w, x, 2)  # micro-batches 0 and 1: rows 0 to 3, real rows first
  >>> bool(jnp.allclose(value, loss(w, x[:4])))
  True
  """
  pos = _batch.positions(batch_argnums, batch_argnames, batch_axes, rng_argnums, state_argnums)
  check_callables(fun, weight_fn, state_out, pos.states)
  private = _checks.private_fun(fun)
  if private:
    reduction, skip_nonfinite = private_options(
      fun, reduction, weight_fn, noise_scale, pos.states, accum_dtype
    )
    if num_real_microbatches is not None:  # padded batches: the mask must be used
      _checks.private_check("padding", "microbatch", fun, "num_real_microbatches")
  elif reduction is None:
    reduction = DEFAULT_MEAN
  if split not in SPLITS:
    raise ValueError(f"microbatch: split must be one of {SPLITS}, got {split!r}.")
  k, size = check_sizes(num_microbatches, microbatch_size)
  keep_unsharded = _fsdp.check_options(keep_unsharded, axis_name, in_shardings)
  num_real = check_num_real(num_real_microbatches, k)
  check_split(fun, split, num_real, k)
  opts = _scan.Options(
    fun=fun,
    k=k,
    microbatch_size=size,
    num_real=num_real,
    positions=pos,
    reduction=_outputs.check_reduction(reduction),
    weight_fn=weight_fn,
    state_out=state_out,
    accum_dtype=_checks.accum_dtype(accum_dtype, "microbatch"),
    split=split,
    skip_nonfinite=check_skip(skip_nonfinite),
    return_info=check_bool(return_info, "return_info") or noise_scale is not None,
    noise=check_noise(noise_scale),
    axis_name=axis_name,
    mesh=mesh,
    unroll=_scan.check_unroll(unroll),
    keep_unsharded=keep_unsharded,
  )

  @_checks.wraps(fun)
  def wrapped(*args, **kwargs):
    if private:  # every argument with the batch's size split (the privacy package's check)
      _checks.private_check("microbatch_args", fun, pos, args)
    # NNX objects among the arguments: split, their state threaded, merged back (`_nnx`).
    return _nnx.call(_call, opts, args, kwargs)

  return wrapped


def _call(opts: _scan.Options, args: tuple, kwargs: dict[str, Any]) -> Any:
  """One call of a `microbatch` function on arrays: the axis resolved, then bound or run."""
  axis = _gspmd.resolve_axis(opts.axis_name, opts.mesh, "microbatch")
  _fsdp.check_unmapped(axis, opts.keep_unsharded)
  if axis.mode == "unbound":
    return _bind(opts._replace(axis=axis), args, kwargs)
  return _run(opts._replace(axis=axis), args, kwargs)


def _bind(opts: _scan.Options, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """`axis_name` under plain `jax.jit`, bound here over the mesh (`_gspmd.run_bound`): each
  device runs its piece of every micro-batch, and `_finish` reduces once, after the loop. The
  result is that of the same call without the axis: with the contiguous split the batch is first
  interleaved (`_batch.interleave`) so that each device's strided micro-batch ``i`` is its piece
  of the batch's contiguous micro-batch ``i``, and the "concat" rows are put back in order."""
  pos = _batch.resolve(opts.positions, len(args), kwargs)
  inner = opts._replace(axis=opts.axis._replace(mode="bound_here"))
  k = _global_k(opts, pos, args, kwargs)
  plans: list[_outputs.Plan] = []
  if k is not None and opts.split == "contiguous" and k > 1:
    args, kwargs = _interleave(pos, args, kwargs, k)
    inner = inner._replace(split="strided")
  binding = _gspmd.Binding(opts.axis, _gspmd.no_state, "concat", "microbatch")
  if opts.keep_unsharded is not None:  # FSDP: sharded parameters enter as their shards
    fsdp = _fsdp.plan(opts.keep_unsharded, opts.axis, args, kwargs, pos.axis_of(), "microbatch")
    inner = inner._replace(fsdp=fsdp)
    binding = _fsdp.binding(binding, fsdp, args, kwargs, plans, opts.return_info)
  fun = functools.partial(_run_kw, inner, plans.append)
  out = _gspmd.run_bound(fun, binding, pos, args, kwargs)
  if inner.split == opts.split:
    return out
  # The "concat" rows came back in the interleaved order: undo it (rows j·k + i -> i·b + j).
  main, info = (out, None) if not opts.return_info else out
  leaves = plans[0].tree.flatten_up_to(main)
  for n in plans[0].where("concat"):
    leaves[n] = _batch.interleave(leaves[n], leaves[n].shape[0] // k)
  main = jax.tree.unflatten(plans[0].tree, leaves)
  return main if not opts.return_info else (main, info)


def _global_k(opts: _scan.Options, pos, args, kwargs) -> int | None:
  """The number of micro-batches of the whole batch's call (``B / (devices · microbatch_size)``
  when sized per device), or None where the sizes do not divide (the bound call then raises)."""
  size, devices = _batch.batch_size(pos, args, kwargs), opts.axis.size()
  k = opts.k if opts.k is not None else size // (devices * opts.microbatch_size) or None
  return k if k and size % (devices * k) == 0 else None


def _interleave(pos, args, kwargs, k: int) -> tuple[tuple, dict]:
  """The batch arguments with `_batch.interleave` applied along their batch axes."""
  a, kw = list(args), dict(kwargs)
  for key, axis in pos.axis_of().items():
    tree = kw[key] if isinstance(key, str) else a[key]
    new = jax.tree.map(lambda x, axis=axis: _batch.interleave(jnp.asarray(x), k, axis), tree)
    if isinstance(key, str):
      kw[key] = new
    else:
      a[key] = new
  return tuple(a), kw


def _run_kw(opts: _scan.Options, record: Callable, *args: Any, **kwargs: Any) -> Any:
  return _run(opts, args, kwargs, record)


def _run(opts: _scan.Options, args: tuple, kwargs: dict[str, Any], record=None) -> Any:
  """The whole transformed call: every call of a `microbatch` function comes through here."""
  pos = _batch.resolve(opts.positions, len(args), kwargs)
  size, k = _batch.num_microbatches(pos, args, kwargs, opts.k, opts.microbatch_size)
  opts = opts._replace(k=k)
  trips = loop_trips(opts.num_real, k, sized=opts.microbatch_size is not None)
  _batch.check_keys(args, pos.rngs)
  if opts.fsdp is not None and not opts.fsdp.gathers_in_loop:  # gathered once, for the window
    args, kwargs = opts.fsdp.gather(tuple(args), kwargs)
  if opts.axis.mode == "mapped" and opts.split == "contiguous" and opts.num_real is not None:
    raise ValueError(CONTIGUOUS_IN_MAP.format(axis=opts.axis.name))
  misplaced = _misplaced_rows(opts, pos, args, trips)
  operands = _operands(args, kwargs, pos, opts)
  state0 = tuple(jax.tree.map(jnp.asarray, args[j]) for j in pos.states)
  plan = _plan(opts, pos, operands, state0, size)
  if record is not None:
    record(plan)
  if opts.fsdp is not None:  # FSDP: which outputs are the sharded parameters' gradients
    opts = opts._replace(fsdp=_fsdp.match_outputs(opts.fsdp, plan, record))
  return _poison(opts, plan, _scan.run(opts, pos, plan, state0, operands, trips), misplaced)


def _row_microbatch(size: int, k: int, split: Split) -> np.ndarray:
  """The micro-batch each row of a batch of `size` rows falls in (`_batch.split_batch`)."""
  rows = np.arange(size)
  return rows % k if split == "strided" else rows // (size // k)


def _misplaced_rows(opts: _scan.Options, pos, args: tuple, trips: Any) -> jax.Array | None:
  """A private function's real rows (its mask's nonzero entries) that `num_real_microbatches`
  leaves out: a batch laid out for the other split (item 11 of issue 34). Raises where the mask
  and the count are host values; otherwise returns a traced "any misplaced" flag (None where
  there is nothing to check) with which `_poison` makes the summed outputs NaN."""
  at = _checks.private_mask_argnum(opts.fun) if opts.num_real is not None else None
  axis = pos.axis_of().get(at) if at is not None and at < len(args) else None
  if axis is None or jnp.ndim(args[at]) != 1:
    return None  # no mask, or not a batch argument (clipped_grad's own check says so)
  mask, k = args[at], opts.k
  where = _row_microbatch(jnp.shape(mask)[0], k, opts.split)
  if isinstance(mask, jax.core.Tracer) or not isinstance(trips, int):
    bad = jnp.any((jnp.asarray(mask) != 0) & (jnp.asarray(where) >= trips))
    # Each device judges its rows; one scalar all-reduce makes the verdict the same everywhere
    # (the outputs it poisons are reduced over those axes: they must stay replicated).
    axes = tuple(sorted(_collectives.vma(bad)))
    return lax.psum(bad.astype(jnp.int32), axes) > 0 if axes else bad
  real = np.asarray(mask) != 0
  lost = int(np.sum(real & (where >= trips)))
  if lost:
    other = "contiguous" if opts.split == "strided" else "strided"
    fits = np.all(_row_microbatch(real.size, k, other)[real] < trips)
    raise ValueError(
      LAYOUT_MISMATCH.format(
        lost=lost, real=int(real.sum()), at=at, n=trips, k=k, split=opts.split, last=trips - 1,
        other=other, guess=f" (split={other!r}: there they all fit)" if fits else "",
      )
    )  # fmt: skip
  return None


def _poison(opts: _scan.Options, plan: _outputs.Plan, out: Any, bad: jax.Array | None) -> Any:
  """The "sum" and "mean" outputs NaN where `bad` (a traced flag) holds: never a finite wrong
  number (as a traced invalid weight)."""
  if bad is None:
    return out
  main, info = out if opts.return_info else (out, None)
  leaves = plan.tree.flatten_up_to(main)
  for n in plan.where("sum", "mean"):
    if jnp.issubdtype(jnp.result_type(leaves[n]), jnp.inexact):
      leaves[n] = jnp.where(bad, jnp.asarray(jnp.nan, leaves[n].dtype), leaves[n])
  main = jax.tree.unflatten(plan.tree, leaves)
  return (main, info) if opts.return_info else main


# ----------------------------------------------------------------------------------------------
# One micro-batch.


def _operands(args, kwargs, pos: _batch.Positions, opts: _scan.Options) -> tuple[list, dict]:
  """The call's arguments as the loop reads them: batch ones split, the others made local.

  Non-batch arguments become device-varying so that `jax.grad` inside `fun` stays local.
  """
  axes = pos.axis_of()
  # Non-array leaves (an Equinox module's functions) are held as they are (`_batch.Static`).
  local = lambda x: opts.axis.collectives.to_varying(_batch.hide_static(x))  # noqa: E731
  a = []
  for j, x in enumerate(args):
    if j in axes:
      x = _split(x, opts.k, opts.split, axes[j])
    elif j not in pos.rngs:
      x = local(x)
    a.append(x)
  kw = {
    n: _split(x, opts.k, opts.split, axes[n]) if n in axes else local(x) for n, x in kwargs.items()
  }
  return a, kw


def _split(tree: Any, k: int, split: Split, axis: int) -> Any:
  return jax.tree.map(lambda v: _batch.split_batch(jnp.asarray(v), k, split, axis), tree)


# ----------------------------------------------------------------------------------------------
# The output plan (trace time).


def _plan(opts: _scan.Options, pos, operands, state0: tuple, size: int) -> _outputs.Plan:
  """Traces `fun` once, abstractly, on micro-batch 0 and decides what becomes of each leaf."""
  try:
    out_t, total = jax.eval_shape(functools.partial(_probe, opts, pos), operands, state0)
  except (TypeError, ValueError) as e:
    _raise_unnamed_batch(e, pos, operands, size, size // opts.k)
    raise
  like, tree = jax.tree.flatten(out_t)
  kinds = _outputs.leaf_reductions(opts.reduction, out_t)
  state = _outputs.state_leaves(opts.state_out, pos, tree, like, state0)
  for leaves in state:
    for n in leaves:
      kinds[n] = "state"  # the threaded state comes out as the final state, not reduced
  _outputs.check_rows(tree, like, kinds, size // opts.k, size, _named(pos))
  _warn_averaged_rows(opts, pos, operands, out_t, kinds, size)
  noise = _outputs.noise_leaves(opts.noise, tree, kinds)
  check_noise_once(noise)
  decide = _outputs.deciding_leaves(opts.skip_nonfinite, tree, kinds)
  return _outputs.Plan(tree, tuple(like), tuple(kinds), state, noise, total, decide)


def _warn_averaged_rows(opts: _scan.Options, pos, operands, out_t, kinds, size: int) -> None:
  """Warns when the *default* "mean" averages what looks like per-example rows: an output of
  leading size ``b`` (the micro-batch's rows, ``b < B``) whose shape is no non-batch argument's
  (a gradient has its parameter's shape). Downstream such an output fails with a shape error
  that cannot mention `reduction` (e.g. ``(8, 10)`` logits against ``(32,)`` labels): say it
  here. An explicit `reduction` is never second-guessed."""
  default = any(isinstance(r, _DefaultReduction) for r in jax.tree.leaves(opts.reduction))
  b = size // opts.k
  if not default or b == size:
    return
  args, kwargs = operands
  batch = pos.axis_of()
  others = [x for key, x in [*enumerate(args), *kwargs.items()] if key not in batch]
  known = {jnp.shape(y) for y in jax.tree.leaves(others)}
  paths = jax.tree.leaves_with_path(out_t)
  if getattr(opts.fun, "nnx_pure", False):  # `_nnx`'s (output, state): name fun's own paths
    paths = [(p[1:], t) for p, t in paths]
  rows = [
    (jax.tree_util.keystr(p), t.shape)
    for (p, t), kind in zip(paths, kinds, strict=True)
    if kind == "mean" and t.ndim and t.shape[0] == b and t.shape not in known
  ]
  if rows:
    names = ", ".join(f"out{p}" for p, _ in rows)
    message = AVERAGED_ROWS.format(paths=names, shape=rows[0][1], b=b, size=size, k=opts.k)
    warnings.warn(message, UserWarning, stacklevel=_caller_level())


def _caller_level() -> int:
  """The `stacklevel` of the first frame outside this package (the caller's call)."""
  here = os.path.dirname(os.path.dirname(__file__))  # the package: front_ends/ is one folder
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(here):
    frame, level = frame.f_back, level + 1
  return level


def _named(pos: _batch.Positions) -> str:
  return f"batch_argnums={pos.batch}" + (f", batch_argnames={pos.names}" if pos.names else "")


def _raise_unnamed_batch(error: Exception, pos, operands, size: int, b: int) -> None:
  """If `fun` failed on a micro-batch while a non-batch argument has the batch's leading size,
  raises the error that says so (the usual cause: a batch argument that was not named)."""
  args, kwargs = operands
  batch = pos.axis_of()
  others = [*enumerate(args), *kwargs.items()]
  suspects = [key for key, x in others if key not in batch and _looks_like_batch(x, size)]
  if size == b or not suspects:
    return
  names = [f"keyword argument {s!r}" if isinstance(s, str) else f"argument {s}" for s in suspects]
  raise ValueError(
    UNNAMED_BATCH.format(
      b=b,
      size=size,
      named=_named(pos),
      error=f"{type(error).__name__}: {error}",
      suspects=", ".join(names).capitalize() + (" is" if len(names) == 1 else " are"),
      hint=tuple(sorted({*pos.batch, *(s for s in suspects if isinstance(s, int))})),
    )
  ) from error


def _looks_like_batch(tree: Any, size: int) -> bool:
  """Every array of `tree` (rank 1 or more) has the batch's leading size: batch data left
  unnamed. A model or its parameters (one kernel of leading size `size` among biases and other
  layers, an NNX module) do not."""
  shapes = [jnp.shape(y) for y in jax.tree.leaves(tree) if _batch.is_array(y) and jnp.ndim(y)]
  return bool(shapes) and all(s[0] == size for s in shapes)


def _probe(opts: _scan.Options, pos, operands, state0: tuple) -> tuple[Any, jax.Array]:
  """Micro-batch 0's output, and the accumulated weight's type (its device variance).

  One trace for both: the weight's type is found from the weight itself, never by feeding an
  `eval_shape` result back into another trace (inside a partly manual `shard_map`, such a
  round trip can lose the type's varying axes).
  """
  out, w = _scan.call(opts, pos, operands, state0, 0)
  total = jnp.zeros((), jnp.float32)
  return out, total if w is None else total + w.astype(jnp.float32)
