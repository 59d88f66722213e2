"""What a JAX user's habits would do to the printed ε, refused before training.

The privacy contract's checks that need the privacy package's knowledge: which arguments a
clipped function splits per example, where the noise stands in the inner chain, whether a
padded batch keeps its mask, whether device variance is visible, whether `TrainStep` holds both
halves of the mechanism, and whether sums stay at least float32 until the noise. They are
installed into `optax_accum.core._checks.PRIVATE_CHECKS` (the front ends call them by name with one
line each: the core never imports this package), and the clipped functions and `dp_noise` call
them directly. Each raises `REFUSED[key]`, which names the option, why it voids the guarantee
and the fix; the rows of `_contract.CONTRACT` name these keys.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum.core import _checks
from optax_accum.front_ends import _config
from optax_accum.parallel import _collectives

_ON = "on a private path"

REFUSED: dict[str, str] = {
  "batch_statistic": (
    "{caller}: the loss has a `{prim}` over {axes}, an axis the examples are split over (the "
    "batch varies over it): its value on one device depends on the examples of every other "
    "device of that axis (a batch statistic shared across devices, as BatchNorm with "
    "`axis_name=` computes), so one example reaches every device's 'per-example' gradients and "
    "clipping each does not bound its contribution. A private loss must compute each example's "
    "value from that example alone: normalise per example (LayerNorm, GroupNorm) or with "
    "statistics that are not the batch's."
  ),
  "unsplit_argument": (
    "{caller}: argument {n} has leading size {size} (at {where}), the size of the batch being "
    "split per {unit}, but it is not among batch_argnums={nums}: it is passed whole to every "
    "{unit}, so every {unit}'s loss sees all of it (e.g. the labels y of `loss(params, x, y)` "
    "broadcast against one example's x) and one example reaches every other's clipped "
    "gradient: clipping no longer bounds its contribution, and the printed (ε, δ) is false "
    "(batch_argnums={fix} would split it). Use batch_argnums with every argument that holds "
    "the examples (e.g. (1, 2) for loss(params, x, y)); if an argument really is the same for "
    "every example and only happens to have that size, declare it with "
    "privacy.clipped_grad/clipped_loss(..., shared_argnums=...)."
  ),
  "captured_batch": (
    "{caller}: the loss holds an array with leading size {size}, the size of the batch being "
    "split per {unit}, that is not one of its arguments ({where}, shape {shape}): a closure, "
    "a functools.partial or a global passes it whole to every {unit}, so every {unit}'s loss "
    "sees all of it (e.g. the labels y captured by `lambda params, x: loss(params, x, y)` or "
    "bound by `functools.partial(loss, y=y)`) and one example reaches every other's clipped "
    "gradient: clipping no longer bounds its contribution, and the printed (ε, δ) is false. "
    "Use an argument for it, split with the examples (e.g. clipped_grad(loss, C, "
    "batch_argnums=(1, 2)) for loss(params, x, y)); if it really is the same for every "
    "example and only happens to have that size, pass it as an argument declared with "
    "shared_argnums=..."
  ),
  "noise_not_first": (
    "{caller}: the inner optimizer {ON} has {what} before dp_noise (or dp_noise sees only part "
    "of the gradients): that transformation acts on the un-noised clipped sums, a statistic of "
    "the data or a change of their scale that the noise does not cover (scale_by_adam first "
    "moved the update by 2·C/B, scale(10.) by 10·C/B), so the printed (ε, δ) is false. Use "
    "optax.chain(privacy.dp_noise(...), ...) with dp_noise first (anything after it is "
    "post-processing), or privacy.Mechanism(...).optimizer(tx), which puts it there."
  ),
  "mask_not_said": (
    "{caller}: mask_argnum is not given: a clipped function must say how its batches are "
    "padded. PoissonSampler pads every batch with copies of example 0, and a clipped function "
    "that does not take the mask counts each padding row as a real example: example 0 enters "
    "updates it was not sampled for (19·C measured through microbatch, TrainStep and a "
    "hand-written accumulate loop), and the printed (ε, δ) is false. Use mask_argnum=n, the "
    "position of the batch's (B,) mask among the clipped function's arguments (right after the "
    "batch arguments, e.g. mask_argnum=3 for loss(params, x, y); PoissonBatch.take(x, y) "
    "returns the rows and the mask together), or privacy.Mechanism, whose clipped functions "
    "always take it; or mask_argnum=None to declare batches without padding (every row a real "
    "example)."
  ),
  "unmasked_padding": (
    "{caller}: {option} {ON} means padded batches (PoissonSampler pads each one with copies of "
    "example 0), but the clipped function was built with mask_argnum=None (batches without "
    "padding): every padding row counts as a real example, so example 0 enters updates it was "
    "not sampled for (3·C measured) and the printed (ε, δ) is false. Use "
    "privacy.clipped_grad/clipped_loss(..., mask_argnum=n) and pass the batch's mask "
    "(PoissonBatch.take(x, y) returns the rows and the mask together), or privacy.Mechanism, "
    "whose clipped functions always take it."
  ),
  "no_variance": (
    "{caller}: {ON} inside a map that does not track device variance (jax.shard_map(..., "
    "check_vma=False), or jax.pmap): a model-sharded parameter looks replicated, so each "
    "example would be clipped per model shard (√2·C for 2 shards), every model shard would "
    "draw the same noise (correlation 1), and a layout that mixes examples across devices "
    "could not be detected: the printed (ε, δ) is false. Use jax.shard_map with "
    "check_vma=True (the default)."
  ),
  "half_clipped": (
    "{caller}: the loss is clipped (privacy.clipped_loss) but the inner optimizer holds no "
    "privacy.dp_noise: TrainStep would apply the clipped sums with no noise at all, and no ε "
    "holds for that. Use inner=optax.chain(privacy.dp_noise(σ, C, B, key), ...), or "
    "privacy.Mechanism(...).train_step(tx), which builds both halves together."
  ),
  "half_noise": (
    "{caller}: the inner optimizer holds privacy.dp_noise but the loss is not a clipped one: "
    "each example's gradient reaches the sum unbounded (62·C/B measured), so noise scaled to C "
    "bounds nothing and the printed (ε, δ) is false. Use loss_fn=privacy.clipped_loss(loss, C, "
    "...) (a wrapper of it keeps the mark through functools.wraps), or "
    "privacy.Mechanism(...).train_step(tx)."
  ),
  "narrow_sums": (
    "{caller}: the clipped sums reach the accumulator as {dtype} {ON}: clipped_loss's gradient "
    "has the parameters' dtype (a custom VJP must), so each micro-step's clipped sum is rounded "
    "to {dtype} before the noise, and one example moves the update by more than C/B (1.05·C/B "
    "measured for bfloat16): the printed (ε, δ) is false. Use float32 parameters (cast them "
    "to the low-precision dtype inside the loss for its compute), or the in-step "
    "microbatch(privacy.clipped_grad(...)), whose sums stay float32 until the noise."
  ),
  "key_traced": (
    "{caller}: the key is traced ({kind}): dp_noise was built under jax.jit, jax.vmap or "
    "another transformation from a key passed or made inside it (a whole run jitted, "
    "`jax.jit(train)(key)`; a sweep, `jax.vmap(train)(keys)`). The registry of keys drawn "
    "from in this process sees only a key's value, so it cannot tell two such runs on one "
    "key apart: they would draw the same noise without a word (difference 0.0 measured), "
    "and the printed (ε, δ) would be false. Use a concrete key: build dp_noise (or "
    "privacy.Mechanism) outside jax.jit/jax.vmap, e.g. noise = dp_noise(σ, C, B, "
    "jax.random.key(seed)), and jit the step that uses it; for a sweep, one dp_noise per "
    "run, each on its own key (jax.random.split(key, runs))."
  ),
  "key_reused": (
    "{caller}: this key (data {data}) was already given to a dp_noise in this process (a run "
    "that may be gone: a re-run notebook cell, an earlier run of a sweep). Two noise streams "
    "from one key draw the same noise: releasing both gives an adversary the difference of the "
    "updates without noise, and the printed (ε, δ) is false. Use a fresh key for each run, "
    "e.g. `jax.random.fold_in(key, run_id)` or `jax.random.split(key)`; if this run resumes "
    "the same stream from a checkpoint (its state restored at its update count, so no noise "
    "is drawn twice), pass allow_key_reuse=True. A dp_noise built inside a factory that optax "
    "calls on every update (optax.inject_hyperparams(lambda lr: optax.chain(dp_noise(...), "
    "...))) is built once per call: build it once, outside (noise = dp_noise(...); "
    "optax.inject_hyperparams(lambda lr: optax.chain(noise, optax.sgd(lr))))."
  ),
}


def refuse(key: str, caller: str, **fields: Any) -> None:
  raise ValueError(REFUSED[key].format(caller=caller, ON=_ON, **fields))


# ----------------------------------------------------------------------------------------------
# Arguments passed whole to every example (or micro-batch) that have the batch's leading size.


def _leading(x: Any) -> int | None:
  return int(jnp.shape(x)[0]) if _is_array(x) and jnp.ndim(x) >= 1 else None


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | jax.ShapeDtypeStruct) or hasattr(x, "__array__")


def _sizes(size: int, batch_leaves: list, arg_leaf: Any) -> set[int]:
  """The leading sizes that mean "the batch": its own, and (inside a map) times the size of
  each mapped axis the batch is split over and the argument is not (a global batch passed
  whole to every device's shard)."""
  axes = frozenset().union(*(_collectives.vma(x) for x in batch_leaves)) - _collectives.vma(
    arg_leaf
  )
  sizes, total = {size}, size
  for a in sorted(axes):
    sizes.add(size * lax.axis_size(a))
    total *= lax.axis_size(a)
  return sizes | {total}


def check_unsplit(
  caller: str,
  unit: str,
  args: tuple,
  split: tuple[int, ...],
  exempt: set[int],
  size: int,
  batch_leaves: list,
  nums_shown: tuple[int, ...],
) -> None:
  """Raises ``unsplit_argument`` for a positional argument (a position of `args`, the
  parameters at 0) that is neither split (`split`) nor `exempt` and holds an array whose
  leading size is the batch's `size` (or that times the mapped axes the batch is split over)."""
  for n, arg in enumerate(args):
    if n == 0 or n in split or n in exempt:
      continue
    for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
      lead = _leading(leaf)
      if lead is not None and lead in _sizes(size, batch_leaves, leaf):
        where = f"{jax.tree_util.keystr(path) or 'the array'}, shape {tuple(jnp.shape(leaf))}"
        fix = tuple(sorted((*nums_shown, n)))
        refuse(
          "unsplit_argument", caller, n=n, size=lead, where=where, unit=unit, nums=nums_shown,
          fix=fix,
        )  # fmt: skip


def _captured(fun: Any, depth: int = 6) -> list[tuple[str, Any]]:
  """``(where, leaf)`` for each array a function holds besides its arguments: the arguments and
  keywords a `functools.partial` binds, the cells of a closure and the globals its code reads,
  through the functions they hold (a helper that captures the labels; a global one from the
  same module), `__wrapped__` (`jax.grad`) and a private callable's own function
  (`ClippedGrad.fun`), `depth` functions deep."""
  found: list[tuple[str, Any]] = []
  seen: set[int] = set()

  def value(v: Any, where: str, depth: int) -> None:
    if isinstance(v, functools.partial) or hasattr(v, "__code__") or _checks._declares_private(v):
      function(v, where, depth - 1)
      return
    if v is None or isinstance(v, str | bytes | int | float | type | types.ModuleType):
      return
    for path, leaf in jax.tree_util.tree_leaves_with_path(v):
      if _leading(leaf) is not None:
        found.append((f"{where}{jax.tree_util.keystr(path)}", leaf))

  def function(f: Any, where: str, depth: int) -> None:
    if depth < 0 or id(f) in seen:
      return
    seen.add(id(f))
    if isinstance(f, functools.partial):
      value(f.func, where, depth)
      for i, a in enumerate(f.args):
        value(a, f"{where}: functools.partial's argument {i}", depth)
      for name, a in f.keywords.items():
        value(a, f"{where}: functools.partial's {name}=", depth)
      return
    inner = getattr(f, "__wrapped__", None)
    if inner is None and _checks._declares_private(f):
      inner = getattr(f, "fun", None)
    if inner is not None:
      value(inner, where, depth)
    code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells, strict=False):
      try:
        held = cell.cell_contents
      except ValueError:  # a cell not filled yet
        continue
      value(held, f"{where}: {getattr(f, '__qualname__', 'a function')} captures {name}", depth)
    # The globals it reads (a notebook's `y_batch`); functions only from its own module.
    names, module = getattr(code, "co_names", ()), getattr(f, "__module__", None)
    for name in names:
      held = getattr(f, "__globals__", {}).get(name)
      if hasattr(held, "__code__") and getattr(held, "__module__", None) != module:
        continue
      value(held, f"{where}: {getattr(f, '__qualname__', 'a function')} reads global {name}", depth)

  value(fun, "the loss", depth + 1)
  return found


def check_captured(
  caller: str, unit: str, fun: Any, size: int, batch_leaves: list, exempt: Any = ()
) -> None:
  """Raises ``captured_batch`` for an array that `fun` holds in a closure, a
  `functools.partial` or a global it reads (not an argument) whose leading size is the batch's
  `size` (or that times the mapped axes the batch is split over); `exempt` are arrays passed as
  arguments too (the same object: declared, not captured)."""
  ids = {id(x) for x in jax.tree.leaves(exempt)}
  for where, leaf in _captured(fun):
    if id(leaf) not in ids and _leading(leaf) in _sizes(size, batch_leaves, leaf):
      refuse(
        "captured_batch", caller, size=_leading(leaf), unit=unit, where=where,
        shape=tuple(jnp.shape(leaf)),
      )  # fmt: skip


def shared_argnums(fun: Any) -> tuple[int, ...]:
  """The positions a private function declares passed whole to every example
  (``shared_argnums`` of `clipped_grad`/`clipped_loss`, found through its wrappers; a
  `functools.partial`'s bound positional arguments shift them)."""
  shift = 0
  for f in _checks._unwrapped(fun):
    nums = getattr(f, "shared_argnums", None)
    if isinstance(nums, tuple) and _checks._declares_private(f):
      return tuple(n - shift for n in nums if n >= shift)
    if isinstance(f, functools.partial):
      shift += len(f.args)
  return ()


def _microbatch_unsplit(fun: Any, positions: Any, args: tuple) -> None:
  """`microbatch` on a private function: a non-batch argument with the batch's leading size
  (the labels left out of batch_argnums) is refused, naming microbatch's batch_argnums."""
  batch = [args[j] for j in positions.batch if j < len(args)]
  leaves = [
    (x, a) for tree, a in zip(batch, positions.axes, strict=False) for x in jax.tree.leaves(tree)
  ]
  sized = [jnp.shape(x)[a] for x, a in leaves if _is_array(x) and jnp.ndim(x) > a]
  if not sized:
    return
  exempt = set(positions.rngs) | set(positions.states) | set(shared_argnums(fun))
  check_unsplit(
    "microbatch", "micro-batch", args, positions.batch, exempt, int(sized[0]),
    [x for x, _ in leaves], positions.batch,
  )  # fmt: skip
  # The whole batch captured by the loss (a closure, a functools.partial), not split either.
  check_captured("microbatch", "micro-batch", fun, int(sized[0]), [x for x, _ in leaves], args)


# ----------------------------------------------------------------------------------------------
# The noise first in the inner chain, over every gradient.


# `optax.inject_hyperparams`' states: their inner transformation sees the updates first.
_INJECTED = ("InjectHyperparamsState", "InjectStatefulHyperparamsState")


def _first_node(state: Any, path: str = "") -> tuple[Any, str]:
  """The state of the inner optimizer's first transformation: through `optax.chain` (a plain
  tuple: its first element), `optax.named_chain` (a dict: its first entry) and
  `optax.inject_hyperparams` (its inner state: `InjectHyperparamsState`, or
  `InjectStatefulHyperparamsState`, the one optax 0.2.8 makes)."""
  if _checks._private_node(state):
    return state, path
  if type(state) is tuple and state:
    return _first_node(state[0], f"{path}[0]")
  if isinstance(state, dict) and state:
    name = next(iter(state))
    return _first_node(state[name], f"{path}[{name!r}]")
  if type(state).__name__ in _INJECTED:
    return _first_node(state.inner_state, f"{path}.inner_state")
  return state, path


def check_inner(caller: str, inner_state: Any) -> None:
  """Raises ``noise_not_first`` unless the inner optimizer's first transformation is
  `dp_noise`, on every gradient leaf."""
  node, path = _first_node(inner_state)
  if _checks._private_node(node):
    return
  name = type(node).__name__
  what = "a stateless transformation (e.g. optax.scale)" if name == "EmptyState" else name
  refuse("noise_not_first", caller, what=f"{what} (the state at inner_state{path})")


# ----------------------------------------------------------------------------------------------
# Padded batches keep their mask.


def check_mask(caller: str, fun: Any, option: str) -> None:
  """Raises ``unmasked_padding`` if `option` (which means padded batches) is used with a
  private function that takes no mask."""
  if _checks.private_mask_argnum(fun) is None:
    refuse("unmasked_padding", caller, option=option)


# ----------------------------------------------------------------------------------------------
# Device variance must be visible.


def check_variance(caller: str) -> None:
  """Raises ``no_variance`` inside a map whose manual axes carry no device-variance types
  (``shard_map(check_vma=False)``, ``pmap``): called while tracing a clipped function or the
  noise."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  if manual and not all(_collectives.vma(lax.axis_index(a)) for a in manual):
    refuse("no_variance", caller)


# ----------------------------------------------------------------------------------------------
# TrainStep holds both halves, and the sums stay at least float32 until the noise.


def check_grads(caller: str, grads: Any) -> None:
  """Raises ``narrow_sums`` for a gradient leaf narrower than float32 reaching a private
  accumulator (the clipped sum rounded before the noise)."""
  for g in jax.tree.leaves(grads):
    if _checks.narrow_float(jnp.result_type(g)):
      refuse("narrow_sums", caller, dtype=jnp.dtype(jnp.result_type(g)).name)


def check_train_step(caller: str, clipped: bool, cfg: Any, params: Any) -> None:
  """`TrainStep` sees the loss and the chain: it needs both halves of the mechanism (a clipped
  loss and dp_noise), and a clipped loss's gradient (the parameters' dtype) at least float32.
  The options the inner chain's dp_noise makes refused are refused first (`check_private`)."""
  inner_state = jax.eval_shape(cfg.inner.init, params)
  noised = _checks.holds_private_state(inner_state)
  if noised:
    _config.check_private(cfg, caller, params, inner_state)
  if clipped and not noised:
    refuse("half_clipped", caller)
  if noised and not clipped:
    refuse("half_noise", caller)
  if clipped:
    check_grads(caller, params)


def install() -> None:
  """Installs the checks the front ends call by name (`_checks.private_check`)."""
  _checks.PRIVATE_CHECKS.update(
    inner=check_inner,
    grads=check_grads,
    train_step=check_train_step,
    padding=check_mask,
    microbatch_args=_microbatch_unsplit,
  )
