"""`microbatch`: one training step's batch as k micro-batches under one `lax.scan`.

Reads top-down: check the arguments → reshape the batch arguments (free, no copy) → trace `fun`
once abstractly for its output types → one scan body that reads micro-batch ``i`` in place,
calls `fun` on it and adds its outputs to sums kept in the carry (with the shared `_core`, so
XLA updates them in place) → one `lax.scan(length=k)` → reduce across devices and normalise,
once, after the loop.

Which rows go into micro-batch ``i`` (batch size ``B = k·b``):

* ``split="strided"`` (default): rows ``i, i+k, i+2k, …`` — ``x.reshape(b, k, ...)``, axis 1.
  The leading axis of every micro-batch is a slice of the full batch's leading axis, so a batch
  sharded over devices stays sharded the same way (no reshard inside the loop).
* ``split="contiguous"``: rows ``i·b, …, (i+1)·b - 1`` — ``x.reshape(k, b, ...)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _batch, _checks, _collectives, _core
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


# ----------------------------------------------------------------------------------------------
# Trace-time checks and helpers.


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


# ----------------------------------------------------------------------------------------------
# The transform.


def microbatch(
  fun: Callable[..., Any],
  num_microbatches: int,
  *,
  batch_argnums: ArgNums = 1,
  reduction: Any = "mean",
  weight_fn: Callable[..., Any] | None = None,
  rng_argnums: ArgNums = (),
  state_argnums: ArgNums = (),
  state_out: Callable[[Any], Any] | None = None,
  accum_dtype: DType | None = jnp.float32,
  split: Split = "strided",
  axis_name: AxisName | None = None,
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
  * ``"concat"``: the per-micro-batch values joined along their leading (example) axis, in the
    original example order for both splits (with "strided" that axis must have one row per
    example of the micro-batch);
  * ``"last"``: micro-batch ``k-1``'s value.

  "mean" and "sum" are accumulated in `accum_dtype` and cast back to the output's dtype once,
  at the end.

  Mutable state (Flax ``batch_stats``): name the state arguments in `state_argnums` and say
  where `fun`'s output holds their new value with `state_out`. Micro-batch ``i`` sees the state
  that micro-batch ``i-1`` produced, as ``k`` sequential small steps would; the output leaves
  that `state_out` returns (it should *select* them, e.g. ``lambda out: out[0][1]``) come out as
  the final state whatever `reduction` says for them.

  Args:
    fun: the function to run per micro-batch, e.g. ``jax.value_and_grad(loss, has_aux=True)``.
    num_microbatches: ``k``, a positive int dividing the batch size. 1 calls `fun` directly.
    batch_argnums: the positional arguments (pytrees) whose leaves' leading axis is the batch.
      Every leaf must have the same leading size ``B``, divisible by ``k``. Other arguments
      (and keyword arguments) are passed to every micro-batch unchanged.
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
      it is a sequence), with the structure and shapes of those arguments (dtypes are cast to
      theirs). Required with `state_argnums`.
    accum_dtype: the dtype in which floating "mean"/"sum" outputs are accumulated; None means
      each output's own dtype.
    split: "strided" (micro-batch ``i`` takes rows ``i, i+k, …``; keeps the batch sharding) or
      "contiguous" (consecutive blocks of ``B/k`` rows).
    axis_name: inside `shard_map`/`pmap`, the mapped axis: "mean" and "sum" outputs (and the
      weights) are reduced over it once, after the loop, to the global large-batch result.
      The non-batch arguments are made device-varying first, so gradients taken inside `fun`
      stay local (no collective in the loop). "concat" and "last" outputs stay per device.

  Returns:
    A function with `fun`'s signature returning `fun`'s output structure, reduced as above.

  Raises:
    TypeError, ValueError: for a bad `num_microbatches`, argnums, `reduction`, `split` or
      `weight_fn` (when called here), and at trace time for a batch size not divisible by ``k``,
      batch arguments that disagree on the batch size, positions out of range, or a
      `reduction` that does not fit the output.

  >>> import jax, jax.numpy as jnp, optax_accum
  >>> def loss(w, x):
  ...   return jnp.mean((x @ w) ** 2)
  >>> w, x = jnp.ones(3), jnp.arange(24.0).reshape(8, 3)
  >>> step = optax_accum.microbatch(jax.value_and_grad(loss), 4)
  >>> value, grad = step(w, x)
  >>> bool(jnp.allclose(value, loss(w, x))), bool(jnp.allclose(grad, jax.grad(loss)(w, x)))
  (True, True)
  """
  if not callable(fun):
    raise TypeError(f"microbatch: fun must be callable, got {fun!r}.")
  k = _checks.positive_int(num_microbatches, "num_microbatches", "microbatch")
  batch_argnums = _batch.check_argnums("batch_argnums", batch_argnums)
  if not batch_argnums:
    raise ValueError("microbatch: batch_argnums must name at least one argument, got ().")
  rng_argnums = _batch.check_argnums("rng_argnums", rng_argnums)
  single_state = isinstance(state_argnums, int | np.integer)
  state_argnums = _batch.check_argnums("state_argnums", state_argnums)
  reduction = _check_reduction(reduction)
  if split not in SPLITS:
    raise ValueError(f"microbatch: split must be one of {SPLITS}, got {split!r}.")
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(f"microbatch: weight_fn must be callable or None, got {weight_fn!r}.")
  if state_argnums and state_out is None:
    raise ValueError(STATE_OUT_MISSING.format(argnums=state_argnums[0]))
  if state_out is not None and not state_argnums:
    raise ValueError(
      "microbatch: state_out is given but state_argnums is empty; name the "
      "state arguments with state_argnums."
    )
  accum_dtype = _checks.accum_dtype(accum_dtype)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    nargs = len(args)
    batch = _batch.resolve("batch_argnums", batch_argnums, nargs)
    rngs = _batch.resolve("rng_argnums", rng_argnums, nargs)
    states = _batch.resolve("state_argnums", state_argnums, nargs)
    for name, other in (("rng_argnums", rngs), ("state_argnums", states)):
      both = sorted(set(batch) & set(other))
      if both:
        raise ValueError(f"microbatch: argument {both[0]} is in both batch_argnums and {name}.")
    if set(rngs) & set(states):
      raise ValueError("microbatch: an argument is in both rng_argnums and state_argnums.")
    size = _batch.batch_size(args, batch, k)
    _batch.check_keys(args, rngs)
    if axis_name is not None:
      _collectives.check_bound(axis_name, "microbatch")

    if k == 1 and axis_name is None:
      out = fun(*args, **kwargs)
      _leaf_reductions(reduction, jax.eval_shape(lambda: out))  # same checks as for k > 1
      return out

    # Non-batch arguments become device-varying so that `jax.grad` inside `fun` stays local.
    args = [
      a if i in batch or i in rngs else _collectives.to_varying(a, axis_name)
      for i, a in enumerate(args)
    ]
    kwargs = _collectives.to_varying(kwargs, axis_name)
    return _run(args, kwargs, batch, rngs, states, size)

  def _call(args, kwargs, batch, rngs, states, i, mb, state):
    """`fun` and `weight_fn` on micro-batch `i` (`mb`: the batch arguments' slices)."""
    a = list(args)
    for j, x in zip(batch, mb, strict=True):
      a[j] = x
    for j in rngs:
      keys = args[j]
      if axis_name is not None:
        # A replicated key would give every device the same masks on different examples.
        keys = jax.tree.map(
          functools.partial(jax.random.fold_in, data=lax.axis_index(axis_name)), keys
        )
      if k > 1:
        keys = jax.tree.map(lambda key: jax.random.fold_in(key, i), keys)
      a[j] = keys
    for j, s in zip(states, state, strict=True):
      a[j] = s
    out = fun(*a, **kwargs)
    w = None
    if weight_fn is not None:
      w = _checks.weight(weight_fn(*a, **kwargs), "microbatch: weight_fn")
    new_state = ()
    if states:
      new_state = state_out(out)
      new_state = (new_state,) if single_state else tuple(new_state)
    return out, w, new_state

  def _check_state(new_state, state, states):
    if len(new_state) != len(state):
      raise ValueError(
        f"microbatch: state_out returned {len(new_state)} states for state_argnums={states}."
      )
    for j, n, s in zip(states, new_state, state, strict=True):
      if jax.tree.structure(n) != jax.tree.structure(s):
        raise ValueError(
          f"microbatch: state_out's new state for argument {j} has another tree than the "
          f"argument:\n  new:      {jax.tree.structure(n)}\n  argument: {jax.tree.structure(s)}"
        )
      bad = [
        f"  argument {j}{jax.tree_util.keystr(p)}: new {jnp.shape(x)}, argument {jnp.shape(y)}"
        for (p, x), y in zip(jax.tree.leaves_with_path(n), jax.tree.leaves(s), strict=True)
        if jnp.shape(x) != jnp.shape(y)
      ]
      if bad:
        raise ValueError("microbatch: state_out's new state changes shapes:\n" + "\n".join(bad))

  def _run(args, kwargs, batch, rngs, states, size):
    b = size // k
    parts = [
      jax.tree.map(lambda x: _batch.split_batch(jnp.asarray(x), k, split), args[j]) for j in batch
    ]

    def micro(parts, i):
      return [jax.tree.map(lambda x: _batch.take(x, i, split), p) for p in parts]

    state0 = tuple(jax.tree.map(jnp.asarray, args[j]) for j in states)

    # Trace `fun` once abstractly for its output types, and find the output leaves that are the
    # threaded state (they come out as the final state, not reduced).
    state_leaf = {}  # output leaf index -> (state position, leaf index in that state)

    def probe(parts, state):
      out, w, new_state = _call(args, kwargs, batch, rngs, states, 0, micro(parts, 0), state)
      if states:
        _check_state(new_state, state, states)
        ids = {
          id(x): (p, q) for p, s in enumerate(new_state) for q, x in enumerate(jax.tree.leaves(s))
        }
        for n, x in enumerate(jax.tree.leaves(out)):
          if id(x) in ids:
            state_leaf[n] = ids[id(x)]
      return out, w, new_state

    out_t, w_t, state_t = jax.eval_shape(probe, parts, state0)
    out_leaves, out_tree = jax.tree.flatten(out_t)
    kinds = _leaf_reductions(reduction, out_t)
    kinds = ["state" if n in state_leaf else r for n, r in enumerate(kinds)]
    idx = {r: [n for n, kind in enumerate(kinds) if kind == r] for r in (*OUT_REDUCTIONS, "state")}
    bad = [
      f"  output leaf {n}: shape {out_leaves[n].shape}"
      for n in idx["concat"]
      if not out_leaves[n].shape or (split == "strided" and out_leaves[n].shape[0] != b)
    ]
    if bad:
      need = (
        f"a leading axis of size {b} (one row per example)"
        if split == "strided"
        else ("a leading axis to concatenate along")
      )
      raise ValueError(
        f"microbatch: reduction 'concat' needs {need}; with {k} micro-batches of {b} examples "
        "these outputs have none:\n"
        + "\n".join(bad)
        + "\nUse 'mean'/'sum'/'last' for them, or (for outputs with several rows per example) "
        "split='contiguous'."
      )

    def pick(tree_leaves, r):
      return [tree_leaves[n] for n in idx[r]]

    # The carry: weighted sums ("mean"), plain sums ("sum"), the total weight, the latest
    # values ("last"), and the threaded state. Its initial values get the device-variance of
    # what the loop writes into it, or the scan would change the carry's type.
    total_t = jax.ShapeDtypeStruct((), jnp.float32)
    if w_t is not None:
      total_t = jax.eval_shape(lambda w: jnp.zeros((), jnp.float32) + w.astype(jnp.float32), w_t)
    means_t, sums_t, last_t = (pick(out_leaves, r) for r in ("mean", "sum", "last"))
    carry0 = (
      # Σ wᵢ fᵢ varies wherever fᵢ or wᵢ does.
      _collectives.match_variance(
        _collectives.match_variance(_core.zeros(means_t, accum_dtype), means_t),
        [total_t] * len(means_t),
      ),
      _collectives.match_variance(_core.zeros(sums_t, accum_dtype), sums_t),
      _collectives.match_variance(jnp.zeros((), jnp.float32), total_t),
      _collectives.match_variance([jnp.zeros(t.shape, t.dtype) for t in last_t], last_t),
      _collectives.match_variance(state0, state_t),
    )

    def body(carry, i):
      (means, sums, total, _, state), parts = carry
      out, w, new_state = _call(args, kwargs, batch, rngs, states, i, micro(parts, i), state)
      leaves = out_tree.flatten_up_to(out)
      means, total, _ = _core.add(means, total, pick(leaves, "mean"), w, skip_nonfinite=False)
      # "sum" leaves are unweighted: the same core `add` with weight None (its total unused).
      sums, _, _ = _core.add(sums, total, pick(leaves, "sum"), None, skip_nonfinite=False)
      last = pick(leaves, "last")
      new_state = jax.tree.map(lambda n, s: n.astype(s.dtype), new_state, state)
      new = _collectives.match_variance((means, sums, total, last, new_state), carry[0])
      return (new, parts), pick(leaves, "concat")

    # The batch rides in the carry unchanged (a loop-invariant operand XLA does not copy).
    steps = jnp.arange(k, dtype=jnp.int32)
    if k == 1:  # only with axis_name: one call, no loop
      (carry, _), ys = body((carry0, parts), steps[0])
      ys = [y[None] for y in ys]
    else:
      (carry, _), ys = lax.scan(body, (carry0, parts), steps)
    means, sums, total, last, state = carry

    # Once, after the loop: the sums and the weight in one all-reduce.
    means, sums, total = _collectives.reduce((means, sums, total), axis_name)
    results = [None] * len(out_leaves)
    for r, values in (
      ("mean", _core.normalise(means, total, means_t, "mean")),
      ("sum", _core.normalise(sums, total, sums_t, "sum")),
      ("last", last),
      ("concat", [_batch.unsplit(y, split) for y in ys]),
    ):
      for n, v in zip(idx[r], values, strict=True):
        results[n] = v
    state_leaves = [jax.tree.leaves(s) for s in state]
    for n in idx["state"]:
      p, q = state_leaf[n]
      results[n] = state_leaves[p][q].astype(out_leaves[n].dtype)
    return jax.tree.unflatten(out_tree, results)

  return wrapped
