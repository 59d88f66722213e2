"""`state_partition_specs`: where every leaf of an optimizer state lives across devices.

With ``axis_name`` set, `accumulate` keeps per-device partial sums: inside the mapped function
each device's ``grad_sum`` leaves, ``acc_weight`` and ``num_skipped`` carry a leading axis of
length 1, so that outside the map they are stacked ``(num_devices, ...)`` arrays sharded over
the axis. Everything else (step counters, the inner optimizer's state) is the same on every
device. `state_partition_specs` writes this down for any optimizer state that holds an
`AccumulateState` (an `optax.chain`, `optax.inject_hyperparams`, ...), so the state can be the
output of one jitted `shard_map` and the input of the next.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax_accum.core._state import AccumulateState, holds_sums
from optax_accum.core._typing import AxisName
from optax_accum.parallel import _collectives


def _is_spec(x) -> bool:
  return isinstance(x, (PartitionSpec, NamedSharding))


_NEEDS_AXIS = (
  "state_partition_specs: the optimizer state holds per-device sums (accumulate was given an "
  "axis_name), so axis_name must be given here too, got None."
)


def _abstract_state(tx, params: Any, axes: tuple[str, ...]) -> Any:
  """``tx.init(params)`` traced abstractly, with `axes` bound (a vmap of size 1 each, whose
  leading axes of length 1 are dropped again)."""
  init = tx.init
  for a in reversed(axes):
    init = jax.vmap(init, in_axes=None, axis_size=1, axis_name=a)
  try:
    state = jax.eval_shape(init, params)
  except (NameError, ValueError) as e:
    if isinstance(e, NameError) or "is not bound here" in str(e):
      if not axes:
        raise ValueError(_NEEDS_AXIS) from e
      raise ValueError(
        f"state_partition_specs: the optimizer reduces over an axis_name that is not "
        f"axis_name={axes[0] if len(axes) == 1 else axes!r}; pass the axis_name you gave "
        "`accumulate`."
      ) from e
    raise
  n = len(axes)
  return jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[n:], t.dtype), state)


def is_per_device(state: Any) -> bool:
  """Whether `state` is an `AccumulateState` whose window sums are per device (made with an
  `axis_name`): stacked ``(num_devices, ...)`` outside the map that binds the axis."""
  return isinstance(state, AccumulateState) and np.ndim(state.acc_weight) > np.ndim(state.mini_step)


def _own_specs(state: AccumulateState, dev: Any, rep: Any, acc: Any, inner: Any) -> Any:
  """Specs of an `AccumulateState`'s fields: `dev` for the per-device scalars (its weight,
  skip count and noise partials), `acc` for its sums, `inner` for the inner state, `rep` for
  the rest."""
  noise = state.noise
  if noise is not None:
    noise = jax.tree.map(lambda _: rep, noise)._replace(sq_sum=dev, count=dev, weight=dev)
  return AccumulateState(
    mini_step=rep,
    gradient_step=rep,
    window_k=rep,
    grad_sum=acc,
    acc_weight=dev,
    num_skipped=dev,
    inner_state=inner,
    updated=rep,
    noise=noise,
  )


def per_device_specs(x: Any, entry: Any) -> AccumulateState | None:
  """The specs of a per-device `AccumulateState` over the bound axis only (`entry`: the spec
  entry of that axis): its sums and per-device scalars split over it, the rest replicated;
  None for anything else (`is_per_device`). The hook (``state_specs=``) through which
  `optax_accum.data_parallel` and `TrainStep` tell the generic axis binder which of their
  arguments and outputs are per-device state."""
  if not is_per_device(x):
    return None
  rep, dev = PartitionSpec(), PartitionSpec(entry)
  split = jax.tree.map(lambda _: dev, x.grad_sum)
  return _own_specs(x, dev, rep, split, jax.tree.map(lambda _: rep, x.inner_state))


def _names(part) -> tuple:
  return () if part is None else part if isinstance(part, tuple) else (part,)


def _stacked(path, spec: PartitionSpec, *, axes: tuple[str, ...], gathered: bool) -> PartitionSpec:
  """The spec of a per-device accumulator: the parameter's spec, stacked over `axes`."""
  stack_axis = axes[0] if len(axes) == 1 else axes
  used = {a for part in spec for a in _names(part)}
  if used & set(axes):
    if not gathered:
      raise ValueError(
        f"state_partition_specs: the parameter at {jax.tree_util.keystr(path)} is sharded over "
        f"axis_name={stack_axis!r} (spec {spec}) and gathered=False, but a per-device "
        "accumulator (accumulate(..., axis_name=...)) holds full-size gradients of the gathered "
        "parameter, as `optax_accum.data_parallel` and `TrainStep` gather it: leave gathered "
        "unset (the optimizer decides). For an accumulator sharded like the parameter, use "
        "accumulate(..., axis_name=None) (GSPMD reduces every micro-step)."
      )
    parts = [tuple(a for a in _names(part) if a not in axes) for part in spec]
    spec = PartitionSpec(*(None if not p else p[0] if len(p) == 1 else p for p in parts))
  return PartitionSpec(stack_axis, *spec)


def state_partition_specs(
  tx: Any,
  params_specs: Any,
  axis_name: AxisName | None,
  *,
  gathered: bool | None = None,
  params: Any = None,
) -> Any:
  """Partition specs (or shardings) for every leaf of ``tx.init(params)``.

  Use them as the ``out_specs`` of the `shard_map` that calls ``tx.init`` and as the
  ``in_specs``/``out_specs`` of every train step, so that the state lives across separately
  jitted calls; or, with `NamedSharding` leaves, as the ``out_shardings`` of a jitted ``init``
  and train step under GSPMD (with ``axis_name=None``, or with the axis that
  `optax_accum.data_parallel` binds).

  * Tree-shaped like the parameters (the accumulator, the inner optimizer's moments): each leaf
    gets its parameter's spec; the per-device accumulator sums get ``P(axis_name, *spec)``.
  * The per-device ``acc_weight`` and ``num_skipped`` of an `accumulate` with an ``axis_name``:
    ``P(axis_name)``.
  * Everything else (step counters, hyperparameters, factored statistics): ``P()``,
    replicated.
  * `optax.lookahead`: ``params_specs`` may be ``LookaheadParams(fast, slow)`` (as its
    parameters are) or the fast weights' specs; the accumulator and the fast optimizer's
    state get the fast weights' specs.

  The spec tree is built by mapping over the state `tx.init` makes (traced abstractly), so it
  has exactly the state's structure whatever the optimizer: masks (`optax.masked`,
  ``adamw(mask=...)``, whose masked-out leaves are `optax.MaskedNode`), label trees
  (`optax.multi_transform`), nested chains and wrappers. A leaf is recognised as belonging to a
  parameter by its tree path ending in that parameter's path (as in ``mu['w']``).

  Args:
    tx: the optimizer whose state to describe: an optax transformation (or anything with
      ``init``), possibly a chain holding an `accumulate`.
    params_specs: a tree of `PartitionSpec` (use ``P()`` for replicated parameters) or of
      `NamedSharding`, shaped like the parameters.
    axis_name: the ``axis_name`` given to `accumulate` (the mapped data-parallel axis), or None
      when the optimizer has none.
    gathered: how a parameter sharded over `axis_name` (FSDP) is accumulated. None (default):
      decided by the optimizer, once — a per-device accumulator (``accumulate(...,
      axis_name=...)``) holds full-size gradients of the gathered parameter, as
      `optax_accum.data_parallel` and `TrainStep` gather it, so it is
      ``P(axis_name, *spec without axis_name)``; without an axis name the accumulator is
      sharded like the parameter. False: such a parameter is an error (for a `shard_map`
      whose per-device gradients are of the local shard, which one reduction per update
      cannot combine). True: the default's choice, stated.
    params: the parameters, or their `jax.ShapeDtypeStruct`s (optional): `tx.init` is traced on
      them. Pass them for optimizers whose state shapes depend on the parameters' shapes,
      such as `optax.adafactor` (factored second moments): a state leaf under a parameter
      gets the parameter's spec only when it has the parameter's shape, and is replicated
      otherwise. Without them, `tx.init` is traced on stand-ins with the tree of
      `params_specs` (so masks and label trees work) and each parameter's leaves as shaped.

  Returns:
    A tree shaped like ``tx.init(params)`` with a `PartitionSpec` (or a `NamedSharding`, when
    `params_specs` holds shardings) at every leaf.

  Raises:
    ValueError: if a parameter's spec already uses `axis_name` and ``gathered=False``, if the
      state holds per-device fields but `axis_name` is None, if the optimizer reduces over
      another axis, or, without `params`, if a state leaf under a sharded parameter has a
      shape that depends on the parameter's (factored statistics: pass ``params=``).

  >>> import jax, optax, optax_accum
  >>> from jax.sharding import PartitionSpec as P
  >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4, axis_name="data")
  >>> specs = optax_accum.state_partition_specs(tx, {"w": P(None, "model")}, "data")
  >>> specs.grad_sum, specs.acc_weight, specs.mini_step
  ({'w': P('data', None, 'model')}, P('data',), P())
  >>> specs.inner_state[0].mu
  {'w': P(None, 'model')}
  >>> fsdp = optax_accum.state_partition_specs(tx, {"w": P("data")}, "data")  # FSDP: gathered
  >>> fsdp.grad_sum, fsdp.inner_state[0].mu
  ({'w': P('data', None)}, {'w': P('data',)})
  """
  axes = _collectives.resolve(axis_name).axes
  stack_axis = None if not axes else axes[0] if len(axes) == 1 else axes
  params_specs = _checked_specs(params_specs)
  leaves = jax.tree.leaves(params_specs, is_leaf=_is_spec)
  mesh = next((s.mesh for s in leaves if isinstance(s, NamedSharding)), None)
  specs = jax.tree.map(_spec_of, params_specs, is_leaf=_is_spec)
  stand_ins = params is None
  if stand_ins:  # stand-ins with the tree of the specs, one axis per spec entry
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1,) * len(s), jnp.float32), specs,
                          is_leaf=_is_spec)  # fmt: skip
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
  template = _abstract_state(tx, params, axes)
  by_path = _by_path(*_gradient_tree(specs, params))
  if stand_ins:  # every_k == 1's placeholder sums (scalars) follow no parameter's shape
    _check_shapes_known(jax.tree.map(_without_placeholders, template, is_leaf=_is_state), by_path)

  def out(spec: PartitionSpec):
    return spec if mesh is None else NamedSharding(mesh, spec)

  def leaf(path, x):
    return out(_leaf_spec(by_path, path, x, any_rank=stand_ins))

  def node(path, x):
    if not isinstance(x, AccumulateState):
      return leaf(path, x)
    per_device = is_per_device(x)
    if per_device and not axes:
      raise ValueError(_NEEDS_AXIS)
    rep = out(PartitionSpec())
    dev = out(PartitionSpec(stack_axis)) if per_device else rep
    stacked = functools.partial(_stacked, axes=axes, gathered=gathered is not False)
    acc = jax.tree.map_with_path(
      lambda p, a: out(
        stacked(p, _leaf_spec(by_path, p, a, 1)) if per_device else _leaf_spec(by_path, p, a)
      ),
      x.grad_sum,
    )
    inner = jax.tree.map_with_path(lambda p, y: node(path + p, y), x.inner_state, is_leaf=_is_state)
    return _own_specs(x, dev, rep, acc, inner)

  return jax.tree.map_with_path(node, template, is_leaf=_is_state)


def _without_placeholders(x: Any) -> Any:
  if isinstance(x, AccumulateState) and holds_sums(x) is False:
    return x._replace(grad_sum=None)
  return x


def _is_state(x) -> bool:
  return isinstance(x, AccumulateState)


def _spec_of(s) -> PartitionSpec:
  return s.spec if isinstance(s, NamedSharding) else s


def _checked_specs(params_specs: Any) -> Any:
  """`params_specs` with every leaf a spec (raising TypeError naming a leaf that is not)."""
  for path, s in jax.tree.leaves_with_path(params_specs, is_leaf=_is_spec):
    if not _is_spec(s):
      raise TypeError(
        "state_partition_specs: params_specs must hold a PartitionSpec or NamedSharding at "
        f"every leaf, got {s!r} at {jax.tree_util.keystr(path)}."
      )
  return params_specs


def _gradient_tree(specs: Any, params: Any) -> tuple[Any, Any]:
  """The specs and parameters that the state's parameter-shaped leaves follow: those of the
  fast weights for `optax.lookahead`'s ``LookaheadParams(fast, slow)`` (its accumulator and
  inner state are shaped like the fast weights), else as given."""
  if isinstance(specs, optax.LookaheadParams):
    params = params.fast if isinstance(params, optax.LookaheadParams) else params
    return specs.fast, params
  return specs, params


SHAPE_DEPENDS = (
  "state_partition_specs: the state leaf at {path} sits under the parameter {param} (spec "
  "{spec}) but has shape {shape}, not the parameter's: this optimizer's state shapes depend on "
  "the parameters' shapes (e.g. adafactor's factored statistics), and without `params` they are "
  "traced on stand-ins of shape {stand_in}, so which of its leaves follow the parameter's "
  "sharding is unknown. Pass the parameters (or their jax.ShapeDtypeStruct's): "
  "state_partition_specs(tx, params_specs, axis_name, params=params)."
)


def _check_shapes_known(template: Any, by_path: dict) -> None:
  """Without `params`: raises `SHAPE_DEPENDS` where a leaf under a sharded parameter's path
  is not parameter-shaped (its real shape, and hence its spec, cannot be known)."""

  def check(path, x):
    path = tuple(path)
    for i in range(len(path) + 1):
      found = by_path.get(path[i:])
      if found is None:
        continue
      shape, spec = found
      sharded = any(part is not None for part in spec)
      n = len(shape)  # a per-device accumulator has one more (stacking) axis in front
      fits = len(x.shape) in (n, n + 1) and tuple(x.shape[len(x.shape) - n :]) == tuple(shape)
      if sharded and not fits:
        raise ValueError(
          SHAPE_DEPENDS.format(
            path=jax.tree_util.keystr(path),
            param=jax.tree_util.keystr(path[i:]),
            spec=spec,
            shape=tuple(x.shape),
            stand_in=tuple(shape),
          )
        )
      return

  jax.tree.map_with_path(check, template)


def _by_path(specs: Any, params: Any) -> dict:
  """Each parameter's tree path -> (its shape, its spec)."""
  spec_leaves = jax.tree.leaves_with_path(specs, is_leaf=_is_spec)
  shapes = jax.tree.leaves(params)
  if len(shapes) != len(spec_leaves):
    raise ValueError(
      "state_partition_specs: params and params_specs have different trees: "
      f"{jax.tree.structure(params)} and {jax.tree.structure(specs, is_leaf=_is_spec)}."
    )
  return {tuple(path): (p.shape, s) for (path, s), p in zip(spec_leaves, shapes, strict=True)}


def _leaf_spec(
  by_path: dict, path: tuple, x: Any, skip: int = 0, any_rank: bool = False
) -> PartitionSpec:
  """The spec of a state leaf: its parameter's, if its path ends in that parameter's path
  (the longest such) and it has that parameter's shape (after `skip` stacking axes);
  otherwise replicated. `any_rank` (the shapes are stand-ins'): a parameter's spec that shards
  nothing is written ``P()``, which fits a leaf of any rank (the real leaf's rank is unknown:
  adafactor's factored ``v`` of a matrix is a vector), where ``P(None, None)`` fits rank 2 only
  and `jax.device_put` rejects it for a vector (issue 34, item 22)."""
  path = tuple(path)
  for i in range(len(path) + 1):
    found = by_path.get(path[i:])
    if found is not None:
      shape, spec = found
      if any_rank and all(part is None for part in spec):
        return PartitionSpec()
      return spec if tuple(x.shape[skip:]) == tuple(shape) else PartitionSpec()
  return PartitionSpec()
