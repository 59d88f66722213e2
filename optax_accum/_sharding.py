"""`state_partition_specs`: where every leaf of an optimizer state lives across devices.

With ``axis_name`` set, `accumulate` keeps per-device partial sums: inside the mapped function
each device's ``acc_grads`` leaves, ``acc_weight`` and ``num_skipped`` carry a leading axis of
length 1, so that outside the map they are stacked ``(num_devices, ...)`` arrays sharded over
the axis. Everything else (step counters, the inner optimizer's state) is the same on every
device. `state_partition_specs` writes this down for any optimizer state that holds an
`AccumulateState` (an `optax.chain`, `optax.inject_hyperparams`, ...), so the state can be the
output of one jitted `shard_map` and the input of the next.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from optax_accum import _collectives
from optax_accum._accumulate import AccumulateState
from optax_accum._typing import AxisName


@jax.tree_util.register_pytree_node_class
class _Params:
  """Stands for the parameter tree while the optimizer's state structure is traced."""

  def tree_flatten(self):
    return (), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux, children
    return cls()


def _is_spec(x) -> bool:
  return isinstance(x, (PartitionSpec, NamedSharding))


def _axes(axis_name) -> tuple[str, ...]:
  return () if axis_name is None else _collectives.axis_names(axis_name)


_NEEDS_AXIS = (
  "state_partition_specs: the optimizer state holds per-device sums (accumulate was given an "
  "axis_name), so axis_name must be given here too, got None."
)


def _structure(tx, axes: tuple[str, ...]):
  """``tx.init`` on a placeholder for the parameters, with `axes` bound (vmap of size 1)."""

  def init():
    return tx.init(_Params())

  for a in reversed(axes):
    init = jax.vmap(init, axis_size=1, axis_name=a)
  try:
    return jax.eval_shape(init)
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


def _names(part) -> tuple:
  return () if part is None else part if isinstance(part, tuple) else (part,)


def _stacked(path, spec: PartitionSpec, axes: tuple[str, ...], gathered: bool) -> PartitionSpec:
  """The spec of a per-device accumulator: the parameter's spec, stacked over `axes`."""
  stack_axis = axes[0] if len(axes) == 1 else axes
  used = {a for part in spec for a in _names(part)}
  if used & set(axes):
    if not gathered:
      raise ValueError(
        f"state_partition_specs: the parameter at {jax.tree_util.keystr(path)} is sharded over "
        f"axis_name={stack_axis!r} (spec {spec}), so its per-device accumulator cannot be stacked "
        "over that axis too. With `optax_accum.data_parallel` (sync='update') such a parameter "
        "is gathered on every device and its accumulator is full-size: pass gathered=True. "
        "For an accumulator sharded like the parameter, use accumulate(..., axis_name=None) "
        "(one reduction per micro-step)."
      )
    parts = [tuple(a for a in _names(part) if a not in axes) for part in spec]
    spec = PartitionSpec(*(None if not p else p[0] if len(p) == 1 else p for p in parts))
  return PartitionSpec(stack_axis, *spec)


def state_partition_specs(
  tx: Any, params_specs: Any, axis_name: AxisName | None, *, gathered: bool = False
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
  * Everything else (step counters, hyperparameters): ``P()``, replicated.

  Args:
    tx: the optimizer whose state to describe: an optax transformation (or anything with
      ``init``), possibly a chain holding an `accumulate`.
    params_specs: a tree of `PartitionSpec` (use ``P()`` for replicated parameters) or of
      `NamedSharding`, shaped like the parameters.
    axis_name: the ``axis_name`` given to `accumulate` (the mapped data-parallel axis), or None
      when the optimizer has none.
    gathered: whether parameters sharded over `axis_name` (FSDP) are gathered on every device
      where the gradients are taken, as `optax_accum.data_parallel` does: their per-device
      accumulators are then full-size, ``P(axis_name, *spec without axis_name)``. Without it
      such a parameter is an error.

  Returns:
    A tree shaped like ``tx.init(params)`` with a `PartitionSpec` (or a `NamedSharding`, when
    `params_specs` holds shardings) at every leaf.

  Raises:
    ValueError: if a parameter's spec already uses `axis_name` (without `gathered`), if the
      state holds per-device fields but `axis_name` is None, or if the optimizer reduces over
      another axis.

  >>> import jax, optax, optax_accum
  >>> from jax.sharding import PartitionSpec as P
  >>> tx = optax_accum.accumulate(optax.adam(1e-3), every_k=4, axis_name="data")
  >>> specs = optax_accum.state_partition_specs(tx, {"w": P(None, "model")}, "data")
  >>> specs.acc_grads, specs.acc_weight, specs.mini_step
  ({'w': P('data', None, 'model')}, P('data',), P())
  >>> specs.inner_state[0].mu
  {'w': P(None, 'model')}
  >>> fsdp = optax_accum.state_partition_specs(tx, {"w": P("data")}, "data", gathered=True)
  >>> fsdp.acc_grads, fsdp.inner_state[0].mu
  ({'w': P('data', None)}, {'w': P('data',)})
  """
  axes = _axes(axis_name)
  stack_axis = None if not axes else axes[0] if len(axes) == 1 else axes
  template = _structure(tx, axes)
  params_specs = jax.tree.map(lambda s: s, params_specs, is_leaf=_is_spec)
  for path, s in jax.tree.leaves_with_path(params_specs, is_leaf=_is_spec):
    if not _is_spec(s):
      raise TypeError(
        "state_partition_specs: params_specs must hold a PartitionSpec or NamedSharding at "
        f"every leaf, got {s!r} at {jax.tree_util.keystr(path)}."
      )
  leaves = jax.tree.leaves(params_specs, is_leaf=_is_spec)
  mesh = next((s.mesh for s in leaves if isinstance(s, NamedSharding)), None)

  def out(spec: PartitionSpec):
    return spec if mesh is None else NamedSharding(mesh, spec)

  def spec_of(s) -> PartitionSpec:
    return s.spec if isinstance(s, NamedSharding) else s

  def params_like(fn):
    return jax.tree.map_with_path(fn, params_specs, is_leaf=_is_spec)

  def node(x):
    if isinstance(x, _Params):
      return params_like(lambda _, s: out(spec_of(s)))
    if isinstance(x, AccumulateState):
      per_device = x.acc_weight.ndim > x.mini_step.ndim
      if per_device and stack_axis is None:
        raise ValueError(_NEEDS_AXIS)
      dev = out(PartitionSpec(stack_axis)) if per_device else out(PartitionSpec())
      rep = out(PartitionSpec())
      if x.acc_grads is None:
        acc = None
      elif per_device:
        acc = params_like(lambda p, s: out(_stacked(p, spec_of(s), axes, gathered)))
      else:
        acc = params_like(lambda _, s: out(spec_of(s)))
      return AccumulateState(
        mini_step=rep,
        gradient_step=rep,
        acc_grads=acc,
        acc_weight=dev,
        num_skipped=dev,
        inner_state=jax.tree.map(node, x.inner_state, is_leaf=_is_node),
        updated=rep,
      )
    return out(PartitionSpec())

  return jax.tree.map(node, template, is_leaf=_is_node)


def _is_node(x) -> bool:
  return isinstance(x, (_Params, AccumulateState))
