"""What a host-side driver (`TrainStep`) checks of the arrays a call gives it, in Python,
before it dispatches a compiled program.

A call's signature (what its compiled programs depend on: `signature`, `unlike`), the leaves it may
donate (`all_arrays`, `check_live`: an array an earlier call donated; `distinct`: two leaves sharing
a buffer), where its parameters are placed and where the state goes with them (`on_mesh`, `placed`,
`param_shardings`, `mesh_state_shardings`), the size of a lowered program (`ops`), the inner state
the accumulating program takes (`hollow`), and the checks shared with `accumulate` said in
TrainStep's words (`in_trainstep_words`).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum.core import _batch
from optax_accum.parallel import _gspmd
from optax_accum.parallel._sharding import state_partition_specs

INSIDE_JIT = (
  "TrainStep was called with traced arguments (inside `jax.jit`, `jax.lax.scan`, `jax.grad`, "
  "...). TrainStep is a host-side driver: it keeps the window position on the host and "
  "dispatches its two programs, which it compiles itself. Call it outside any "
  "transformation, from your Python training loop:\n\n"
  "    for batch in batches:\n"
  "        params, state, loss = step(params, state, batch)\n\n"
  "To accumulate inside your own jitted step, use the optax protocol instead: "
  "`tx = optax_accum.accumulate(inner, every_k)` and `updates, state = tx.update(grads, state, "
  "params)` (with `emit=True`/`False` for two programs without a device conditional)."
)


def is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def signature(args: tuple, weight: Any) -> tuple:
  """What the compiled programs depend on in a call's micro-batch and weight: the tree, each
  leaf's shape, dtype, weak type (a Python scalar) and placement."""
  leaves, tree = jax.tree.flatten((args, weight))
  return tree, tuple(
    (np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None)) for x in leaves
  )


def on_mesh(params: Any) -> Any:
  """The mesh of the first parameter placed with a `NamedSharding`, or None."""
  for p in jax.tree.leaves(params):
    sharding = getattr(p, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None


def mesh_state_shardings(tx: Any, params: Any) -> tuple[Any, Any] | None:
  """Without `axis_name`: the parameters' shardings and the state's
  (`state_partition_specs`: tree-shaped leaves like their parameter, the rest replicated)
  when some parameter is placed on a mesh (a `NamedSharding`); else None (one device: the
  default placement is right)."""
  hidden = _batch.hide_static(params)
  mesh = on_mesh(hidden)
  if mesh is None:
    return None
  shardings = jax.tree.map(
    lambda p: p.sharding if isinstance(getattr(p, "sharding", None), NamedSharding)
    else NamedSharding(mesh, P()),
    hidden,
  )  # fmt: skip
  params = _batch.none_for_static(hidden)
  specs = state_partition_specs(tx, _batch.none_for_static(shardings), None, params=params)
  return shardings, specs


def param_shardings(axis_name: Any, mesh: Any, params: Any) -> Any:
  """Each parameter's sharding: its own on the mesh, else replicated."""
  found = _gspmd.find_mesh(axis_name, mesh, "TrainStep")
  named = lambda s: s if isinstance(s, NamedSharding) else None
  specs = jax.tree.map(lambda p: named(getattr(p, "sharding", None)) or P(), params)
  if mesh is not None:
    return jax.tree.map(lambda s: s if isinstance(s, NamedSharding) else NamedSharding(found, s),
                        specs, is_leaf=lambda s: isinstance(s, P))  # fmt: skip
  return specs


def placed(x: Any) -> Any:
  """An array's sharding, if it is a concrete placement (not an abstract one), else None."""
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def unlike(compiled: Any, operands: tuple) -> bool:
  """Whether `operands` differ from the inputs `compiled` was compiled for: their tree, a
  leaf's shape, dtype or weak type, or a device array's placement."""
  avals, _ = compiled.in_avals
  shardings, _ = compiled.input_shardings
  leaves, tree = jax.tree.flatten(tuple(operands))
  if tree != jax.tree.structure(avals) or len(leaves) != len(jax.tree.leaves(shardings)):
    return True
  for x, want, placed in zip(
    leaves, jax.tree.leaves(avals), jax.tree.leaves(shardings), strict=True
  ):
    got = jax.typeof(x)
    if (got.shape, got.dtype, got.weak_type) != (want.shape, want.dtype, want.weak_type):
      return True
    sharding = x.sharding if isinstance(x, jax.Array) else None
    if sharding is not None and not sharding.is_equivalent_to(placed, len(want.shape)):
      return True
  return False


# Each leaf type's kind, decided once per type (an ABC `isinstance` is slow per leaf):
# 0 not an array (an Equinox module's static field), 1 an array that cannot be deleted (NumPy,
# a tracer), 2 a concrete `jax.Array` (donated arrays are deleted).
_KINDS: dict[type, int] = {}


def _kind(t: type) -> int:
  kind = _KINDS.get(t)
  if kind is None:
    concrete = issubclass(t, jax.Array) and not issubclass(t, jax.core.Tracer)
    kind = _KINDS[t] = 2 if concrete else int(issubclass(t, jax.Array | np.ndarray | np.generic))
  return kind


def all_arrays(params: Any, state: Any) -> bool:
  """Whether every leaf of the parameters is an array (then `_batch.hide_static` has nothing
  to hide): by leaf type, in C loops (the per-call cost). Also catches the usual mistake,
  passing again what an earlier call donated, for the price of two reads (a donated tree's
  leaves are deleted together: its first parameter, the state's `num_skipped`, which every
  program donates), so that XLA never sees a deleted buffer; `check_live` names the leaf."""
  leaves = jax.tree.leaves(params)
  for x in (*leaves[:1], getattr(state, "num_skipped", None)):
    if _kind(type(x)) == 2 and x.is_deleted():
      check_live(params, state)
  return all(_kind(t) for t in set(map(type, leaves)))


def check_live(params: Any, state: Any) -> None:
  """Raises if an array of the parameters or the state was deleted: donated to an earlier
  call, or deleted. Run when a compiled program refuses its inputs (it checks them before it
  runs or donates anything): JAX's own error names an argument number (or only a shape)."""
  for name, tree in (("params", params), ("state", state)):
    for path, x in jax.tree.leaves_with_path(tree):
      if _kind(type(x)) == 2 and x.is_deleted():
        raise ValueError(
          f"TrainStep: {name}{jax.tree_util.keystr(path)} is a deleted array: it was donated "
          "to an earlier call (TrainStep donates the state on every call and the parameters on "
          "each update, donate=True) "
          "or deleted. Pass the parameters (or module) and the state that the last call "
          "returned (`params, state, loss = step(params, state, batch)`), or build TrainStep "
          "with donate=False to keep your arrays (each update then holds the old and the new "
          "parameters and state)."
        )


def distinct(params: Any, state: Any) -> tuple[Any, Any]:
  """`params` and `state` with no two arrays sharing a buffer: a leaf whose buffer an earlier
  leaf already holds is replaced by a copy. Aliases are common in what users pass
  (``optax.LookaheadParams.init_synced(params)``, whose slow weights *are* its fast weights;
  one ``jnp.zeros`` reused for two biases; an optimizer state holding the parameters), and
  XLA refuses to donate one buffer twice, or to read a buffer it was donated, only once the
  call has started, after it has deleted some of the other donated arrays. Run for trees
  this object did not make (the programs' outputs never alias), so a call costs nothing."""
  leaves, tree = jax.tree.flatten((params, state))
  seen: set[tuple] = set()
  out, copied = [], False
  for x in leaves:
    if _kind(type(x)) == 2 and not x.is_deleted():  # a deleted one: `check_live` names it
      buffers = {(s.device.id, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}
      if buffers & seen:
        x, copied = jax.device_put(x, x.sharding, may_alias=False), True
        buffers = {(s.device.id, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}
      seen |= buffers
    out.append(x)
  return jax.tree.unflatten(tree, out) if copied else (params, state)


def ops(lowered: Any) -> int:
  """The operations of a lowered program (StableHLO): what compiling it costs."""
  return len(re.findall(r"^\s*%\S+ = ", lowered.as_text(), flags=re.M))


def hollow(inner_state: Any) -> Any:
  """The inner state's tree with no arrays (every leaf None): what the accumulating program
  takes of it. It never reads the inner state, and every array passed in and handed back
  costs each call dispatch time (0.6 µs an array on CPU, `benchmarks/small_models.py`); its
  structure stays, for the checks
  that read it (a private state, `_checks.holds_private_state`)."""
  return jax.tree.map(lambda _: None, inner_state)


def in_trainstep_words(error: Exception) -> Exception:
  """A check shared with `accumulate` (`_config.check_update`), said as TrainStep's: its
  name, and the one way it makes a state."""
  text = str(error).replace("accumulate.update:", "TrainStep:", 1)
  text = text.replace(" but is updated with ", " but this TrainStep has ")
  text = text.replace("`tx.init(params)` or `step.init(params)`", "`step.init(params)`")
  return type(error)(text)
