"""Flax NNX objects passed straight into `microbatch`: split, threaded, merged back.

An ``nnx.Module`` or ``nnx.Rngs`` is a Python object whose `Variable`s change in place: a
BatchNorm's running statistics, an ``nnx.Rngs`` stream's counter. Flattened as a plain pytree
into a loop they would come out as copies, and every change made inside would be lost (the
same dropout mask for every micro-batch and every step). So, as ``nnx.scan`` and ``nnx.jit``
do, `call` splits the NNX arguments of a call once (``nnx.split``: one graph definition, the
parameters, and the rest of the state), runs a pure function in their place — it merges fresh
objects from the state, calls `fun`, and splits the state again — with the rest of the state
threaded through the micro-batches as the loop's state (`state_argnums`): micro-batch ``i``
sees what micro-batch ``i-1`` left, as ``k`` sequential calls would. After the loop the final
state is written back into the caller's objects (``nnx.update``).

The parameters (``nnx.Param``) are read, never threaded: a gradient function does not change
them. Flax is imported by the caller, never here: with no ``flax.nnx`` loaded there is
nothing to find.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

from optax_accum.core import _batch, _checks
from optax_accum.front_ends import _scan

NESTED = (
  "microbatch: {where} holds an NNX object ({kind}) inside a container. NNX objects change in "
  "place (BatchNorm statistics, the Rngs counter), and microbatch can thread their state "
  "through the micro-batches and write it back only when each is an argument of its own: pass "
  "it as a positional or keyword argument of its own, e.g. fun(model, x, y, rngs=rngs)."
)

IN_BATCH = (
  "microbatch: {where} is an NNX object ({kind}), but it is named as a batch argument "
  "(batch_argnums={batch}): a model is passed whole to every micro-batch. Name the data "
  "arguments only, e.g. batch_argnums={hint}."
)

CHANGED = (
  "microbatch: fun changed the structure of the NNX objects it was given (it added or removed "
  "Variables or changed a static attribute, e.g. nnx.sow, lazy initialisation or "
  "model.train()/model.eval() inside fun). Inside microbatch each micro-batch must leave the "
  "objects' structure as it found it: switch modes before the call, and return intermediates "
  "from fun instead of sowing them.\n  before: {before}\n  after:  {after}"
)

PARAM_CHANGED = (
  "microbatch: fun assigned a new value to an nnx.Param of the NNX objects it was given. "
  "Inside microbatch every micro-batch reads the same parameters (they are not threaded from "
  "one micro-batch to the next, and a change would be lost): return the gradients and update "
  "the parameters after the call (nnx.Optimizer.update), or keep a value that changes per "
  "micro-batch in a Variable of another type (nnx.BatchStat, nnx.Variable), which is threaded."
)


def _nnx() -> Any:
  """``flax.nnx`` if the program imported it, else None (then no argument is an NNX object)."""
  return sys.modules.get("flax.nnx")


def _is_node(x: Any) -> bool:
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Pytree)


def _describe(key: int | str) -> str:
  return f"keyword argument {key!r}" if isinstance(key, str) else f"argument {key}"


def find(pos: _batch.Positions, args: tuple, kwargs: dict) -> list[int | str]:
  """The positions and keywords of the arguments that are NNX objects (none without flax).

  Raises for an NNX object inside a container (its state could not be written back) or named as
  a batch argument.
  """
  found = []
  batch = pos.axis_of()
  for key, x in [*enumerate(args), *kwargs.items()]:
    if _is_node(x):
      if key in batch:
        data = tuple(j for j in pos.batch if j != key)
        where, kind = _describe(key), type(x).__name__
        raise ValueError(IN_BATCH.format(where=where, kind=kind, batch=pos.batch, hint=data))
      found.append(key)
      continue
    nested = [y for y in jax.tree.leaves(x, is_leaf=_is_node) if _is_node(y)]
    if nested:
      raise ValueError(NESTED.format(where=_describe(key), kind=type(nested[0]).__name__))
  return found


def call(run: Callable[[Any, tuple, dict], Any], opts: _scan.Options, args: tuple, kwargs: dict):
  """`run(opts, args, kwargs)` (the transformed call), with every NNX argument split, its state
  threaded through the micro-batches, and the final state written back into it."""
  nnx = _nnx()
  if nnx is None:  # the program never imported flax.nnx: no argument can be an NNX object
    return run(opts, args, kwargs)
  pos = _batch.resolve(opts.positions, len(args), kwargs)
  keys = find(pos, args, kwargs)
  if not keys:
    return run(opts, args, kwargs)
  nodes = tuple(kwargs[j] if isinstance(j, str) else args[j] for j in keys)
  if _checks.private_fun(opts.fun) and jax.tree.leaves(nnx.state(nodes, nnx.BatchStat)):
    # The privacy contract's row for a threaded state (an Rngs counter alone is harmless).
    _checks.refuse_private("state_argnums", "microbatch (an NNX model's BatchStat, threaded)")
  graphdef, params, rest = nnx.split(nodes, nnx.Param, ...)
  a = [None if j in keys else x for j, x in enumerate(args)]
  kw = {n: x for n, x in kwargs.items() if n not in keys}
  p = len(a)  # the parameters go in argument p, the threaded state in argument p + 1
  opts = _pure_options(opts, pos, keys, graphdef, p)
  out = run(opts, (*a, params, rest), kw)
  main, info = out if opts.return_info else (out, None)
  result, new_rest = main
  nnx.update(nodes, new_rest)
  return (result, info) if opts.return_info else result


def _pure_options(opts: _scan.Options, pos, keys: list, graphdef: Any, p: int) -> _scan.Options:
  """`opts` for the pure function: state argument ``p + 1`` added, every output option moved
  to entry 0 of the pure function's ``(output, new state)``."""
  user_out, single = opts.state_out, pos.single_state

  def state_out(out):
    if not pos.states:
      return (out[1],)
    mine = user_out(out[0])
    return (*((mine,) if single else tuple(mine)), out[1])

  def entry0(option):  # an output selector of `fun` as one of the pure function's
    if option is None or isinstance(option, bool):
      return option
    if isinstance(option, int):
      return lambda out: out[0][option]
    return lambda out: option(out[0])

  weight_fn = opts.weight_fn
  return opts._replace(
    fun=_pure(opts.fun, keys, graphdef, p, write=True),
    weight_fn=None if weight_fn is None else _pure(weight_fn, keys, graphdef, p, write=False),
    positions=pos._replace(states=(*pos.states, p + 1), single_state=False),
    reduction=(opts.reduction, "last"),
    state_out=state_out,
    skip_nonfinite=entry0(opts.skip_nonfinite),
    noise=entry0(opts.noise),
  )


def _pure(fun: Callable, keys: list, graphdef: Any, p: int, *, write: bool) -> Callable:
  """`fun` on arrays: merges fresh NNX objects from arguments ``p`` (parameters) and ``p + 1``
  (the rest of the state), calls `fun` with them in their places, and (`write`) returns
  ``(output, the objects' new state)``; else `fun`'s output alone (`weight_fn`)."""
  nnx = _nnx()

  def pure(*args, **kwargs):
    *a, params, rest = args
    nodes = nnx.merge(graphdef, params, rest, copy=True)
    kw = dict(kwargs)
    for j, node in zip(keys, nodes, strict=True):
      if isinstance(j, str):
        kw[j] = node
      else:
        a[j] = node
    out = fun(*a, **kw)
    if not write:
      return out
    after, new_params, new_rest = nnx.split(nodes, nnx.Param, ...)
    if after != graphdef:
      raise ValueError(CHANGED.format(before=_short(graphdef), after=_short(after)))
    pairs = zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True)
    if any(new is not old for new, old in pairs):
      raise ValueError(PARAM_CHANGED)
    return out, new_rest

  pure.nnx_pure = True  # its output is (fun's output, state): `microbatch` names fun's paths
  return pure


def _short(graphdef: Any) -> str:
  text = " ".join(str(graphdef).split())
  return text if len(text) < 300 else text[:297] + "..."
