"""Plain `jax.jit` at scale: `data_parallel` binds the data axis, one gradient reduction per update.

Every equivalence test compares with the large batch computed independently (a direct
`jax.value_and_grad` of the token-weighted loss on the whole batch, then a plain optax step,
`_reference.run_steps`). Structure is read from the compiled HLO (`count_collectives`, where
``"loop"`` means inside a while body: once per micro-batch) and XLA's memory analysis. The 8
devices are conftest's host CPU devices; meshes are made with Auto and Explicit axis types.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import warnings

import _reference as ref
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import count_collectives, data_parallel, launch, microbatch, state_partition_specs
from optax_accum.core._hlo import callees, compile_fn, computations, placements, reachable

AX = "data"
D = 8  # devices
ROWS = 2  # rows per device per micro-batch
AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]
SIZES = (3, 8, 2)
# Adam's first steps are ~lr * g / |g|: where a gradient entry is tiny, rounding of g in the last
# bits (device sums in another order than the large batch's) moves its update by ~1e-5 relative.
ADAM_TOL = dict(rtol=2e-5, atol=2e-6)
EMITS = (None, False, True)  # the device conditional, the accumulating and the emitting program


def _mesh(axis_type, shape=(D,), names=(AX,)):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _batch(seed, n, devices=D):
  """`n` rows of the token-weighted regression problem: a mask of real rows (1) and padding.

  Every micro-batch of every device holds a real row (an empty one's mean loss is 0/0): the
  first ``n / (devices * ROWS)`` rows of each device's block are real, i.e. row i of micro-batch
  i under the strided split.
  """
  batch = ref.regression_data(seed, n, d_in=SIZES[0], d_out=SIZES[-1])
  mask = np.random.default_rng(seed + 1).random(n) < 0.7
  mask |= np.arange(n) % (n // devices) < n // (devices * ROWS)
  return {**batch, "mask": mask.astype(np.float32)}


def _weight(params, batch):
  del params
  return ref.token_count(batch)


def _large_batch_grad(params, batch):
  return jax.value_and_grad(ref.mlp_loss)(params, batch)


def _bound_microbatch(k, **kw):
  """The unit under test: `microbatch(axis_name=AX)` under plain jit, which binds the axis over
  the mesh itself; with `data_parallel` options (`sync=`), bound by `data_parallel` instead."""
  step = microbatch(
    jax.value_and_grad(ref.mlp_loss), k, batch_argnums=1, weight_fn=_weight, axis_name=AX
  )
  return data_parallel(step, AX, batch_argnums=1, **kw) if kw else step


def _array_reductions(text: str, branches: bool = True) -> dict[str, int]:
  """Gradient-sized reductions in compiled HLO: all-reduces and reduce-scatters with an array
  (not only scalars) in their result, {"all": n, "loop": n inside a while body}.

  Scalar ones are bookkeeping (a total weight, a count of micro-batches) and are not counted.
  `branches=False`: those inside a conditional's branches (run only when taken) neither.
  """
  comps, entry = computations(text)
  loops = reachable(
    comps, [c for ins in comps.values() for i in ins if i.op == "while" for c in callees(i)]
  )
  where = placements(comps, entry)[0]
  out = {"all": 0, "loop": 0}
  for name in reachable(comps, [entry]):
    if not branches and where.get(name) == "cond":
      continue
    for i in comps[name]:
      kind = i.op.removesuffix("-start")
      if kind in ("all-reduce", "reduce-scatter") and re.search(r"\[\d", i.shape):
        out["all"] += 1
        out["loop"] += name in loops
  return out


def _reductions(text, where="all"):
  """All-reduces plus reduce-scatters, scalar ones included."""
  return count_collectives(text, "all-reduce", where=where) + count_collectives(
    text, "reduce-scatter", where=where
  )


# ----------------------------------------------------------------------------------------------
# microbatch bound under plain jit.


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_microbatch_under_plain_jit_reduces_once_and_matches_large_batch(axis_type, k):
  params = ref.mlp_params(0, SIZES)
  batch = _batch(1, D * k * ROWS)
  with jax.set_mesh(_mesh(axis_type)):
    f = jax.jit(_bound_microbatch(k))
    text = f.lower(params, batch).compile().as_text()
    value, grads = f(params, batch)
  chex.assert_trees_all_close((value, grads), _large_batch_grad(params, batch), **ref.TOL)
  # One gradient-sized all-reduce (gradients, loss and weight fused), after the loop; nothing
  # per micro-batch.
  assert _array_reductions(text) == {"all": 1, "loop": 0}
  assert count_collectives(text, "all-reduce", where="loop") == 0
  assert grads["w0"].sharding.is_fully_replicated


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_sync_microbatch_leaves_gspmd_to_reduce_every_micro_batch(axis_type):
  """The positive control of the loop count: unbound, GSPMD reduces inside the loop body."""
  params = ref.mlp_params(0, SIZES)
  batch = _batch(1, D * 4 * ROWS)
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    batch = ref.shard(batch, mesh, P(AX))
    f = jax.jit(_bound_microbatch(4, sync="microbatch"))
    text = f.lower(params, batch).compile().as_text()
    got = f(params, batch)
  chex.assert_trees_all_close(got, _large_batch_grad(params, jax.device_get(batch)), **ref.TOL)
  assert _array_reductions(text)["loop"] >= 1


def test_microbatch_concat_outputs_come_back_in_global_order():
  params = ref.mlp_params(0, SIZES)
  batch = _batch(1, D * 4 * ROWS)

  def loss_and_predictions(p, b):
    return ref.mlp_loss(p, b), ref.mlp_apply(p, b["x"])

  step = microbatch(
    loss_and_predictions,
    4,
    weight_fn=_weight,
    reduction=("mean", "concat"),
    axis_name=AX,
  )
  with jax.set_mesh(_mesh(AxisType.Explicit)):
    loss, predictions = jax.jit(step)(params, batch)
  chex.assert_trees_all_close(
    (loss, predictions), (ref.mlp_loss(params, batch), ref.mlp_apply(params, batch["x"])), **ref.TOL
  )


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_keyword_batch_on_a_sequence_major_axis(axis_type):
  """`batch_argnames` and `batch_axes` as `microbatch` takes them: ``(T, B, ...)`` data split
  over the devices along B."""
  lengths = np.random.default_rng(7).integers(1, 4, size=D * 4 * ROWS)  # >= 1 real token each
  batch = jax.tree.map(lambda x: np.swapaxes(x, 0, 1), ref.token_data(7, lengths, tokens=3))

  def loss(params, *, batch):
    return ref.mlp_loss(params, batch)

  step = microbatch(
    jax.value_and_grad(loss),
    4,
    batch_argnames="batch",
    batch_axes=1,
    weight_fn=lambda params, *, batch: ref.token_count(batch),
    axis_name=AX,
  )
  params = ref.mlp_params(0, (3, 8, 1))
  with jax.set_mesh(_mesh(axis_type)):
    f = jax.jit(step)
    text = f.lower(params, batch=batch).compile().as_text()
    got = f(params, batch=batch)
  chex.assert_trees_all_close(got, jax.value_and_grad(loss)(params, batch=batch), **ref.TOL)
  assert _array_reductions(text) == {"all": 1, "loop": 0}
  assert count_collectives(text, where="loop") == 0


class _DenseLayerNorm(nn.Module):
  """A stock Flax Linen model, unchanged: Dense, LayerNorm, relu, Dense."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.LayerNorm()(nn.Dense(16)(x)))
    return nn.Dense(SIZES[-1])(x)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_flax_linen_model_unchanged(axis_type):
  model = _DenseLayerNorm()
  params = model.init(jax.random.key(0), jnp.ones((1, SIZES[0])))
  batch = _batch(2, D * 4 * ROWS)

  def loss(p, b):
    err = jnp.sum((model.apply(p, b["x"]) - b["y"]) ** 2, axis=-1)
    return jnp.sum(err * b["mask"]) / jnp.sum(b["mask"])

  step = microbatch(jax.value_and_grad(loss), 4, weight_fn=_weight, axis_name=AX)
  with jax.set_mesh(_mesh(axis_type)):
    f = jax.jit(step)
    text = f.lower(params, batch).compile().as_text()
    got = f(params, batch)
  chex.assert_trees_all_close(got, jax.value_and_grad(loss)(params, batch), **ref.TOL)
  assert _array_reductions(text) == {"all": 1, "loop": 0}
  assert count_collectives(text, "all-reduce", where="loop") == 0


def test_microbatch_binds_over_an_explicit_mesh_argument():
  """`mesh=` instead of the mesh in effect; no mesh at all is the clear unbound-axis error."""
  params = ref.mlp_params(0, SIZES)
  batch = _batch(3, D * 2 * ROWS)
  mesh = _mesh(AxisType.Explicit)
  step = microbatch(jax.value_and_grad(ref.mlp_loss), 2, weight_fn=_weight, axis_name=AX, mesh=mesh)
  got = jax.jit(step)(params, batch)
  chex.assert_trees_all_close(got, _large_batch_grad(params, batch), **ref.TOL)
  unbound = microbatch(jax.value_and_grad(ref.mlp_loss), 2, axis_name=AX)
  with pytest.raises(ValueError, match="(?s)microbatch: axis_name='data' is not bound here"):
    jax.jit(unbound)(params, batch)


def test_microbatch_bound_here_rejects_per_device_state_and_last_outputs():
  """Outputs of a plain-jit function are global: a threaded state (BatchNorm statistics of each
  device's rows) or a "last" value that differs per device has none; made the same on every
  device (`pmean`, as `nn.BatchNorm(axis_name=...)` does), it is fine."""
  x = np.arange(D * 4 * 2, dtype=np.float32).reshape(-1, 2)

  def running_mean(stats, x, sync):
    mean = jnp.mean(x, axis=0)
    mean = lax.pmean(mean, AX) if sync else mean
    return jnp.sum(mean), 0.9 * stats + 0.1 * mean

  with jax.set_mesh(_mesh(AxisType.Explicit)):
    for sync in (False, True):
      step = microbatch(
        functools.partial(running_mean, sync=sync), 4, batch_argnums=1, state_argnums=0,
        state_out=lambda out: out[1], axis_name=AX,
      )  # fmt: skip
      if sync:
        _, stats = jax.jit(step)(np.zeros(2, np.float32), x)
        assert stats.shape == (2,)
      else:
        with pytest.raises(ValueError, match=r"the threaded state .* differs per device"):
          jax.jit(step)(np.zeros(2, np.float32), x)
    last = microbatch(lambda x: jnp.sum(x), 4, batch_argnums=0, reduction="last", axis_name=AX)
    with pytest.raises(ValueError, match=r"output leaf 0 \(reduction 'last'\) differs per device"):
      jax.jit(last)(x)
    stack = microbatch(lambda x: jnp.sum(x), 4, batch_argnums=0, reduction="stack", axis_name=AX)
    with pytest.raises(ValueError, match=r"output leaf 0 \(reduction 'stack'\) differs per dev"):
      jax.jit(stack)(x)


# ----------------------------------------------------------------------------------------------
# accumulate in the user's own jitted step (the optax protocol).


def _recipe(tx, params_shardings):
  """The documented recipe: init and step bound by `data_parallel`, shardings pinned by jit."""
  state_shardings = state_partition_specs(tx, params_shardings, AX)
  init = jax.jit(data_parallel(tx.init, AX), out_shardings=state_shardings)

  def train_step(params, state, batch, emit=None):
    local = lax.pcast(params, AX, to="varying")  # per-device gradients: no collective here
    grads = jax.grad(ref.mlp_loss)(local, batch)
    updates, state = tx.update(grads, state, params, weight=ref.token_count(batch), emit=emit)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    data_parallel(train_step, AX, batch_argnums=2),
    static_argnames="emit",
    out_shardings=(params_shardings, state_shardings),
  )
  return init, step


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_accumulate_recipe_reduces_once_per_update_and_matches_large_batch(axis_type, k):
  params = ref.mlp_params(0, SIZES)
  batches = [_batch(10 + i, D * ROWS) for i in range(2 * k)]  # two windows of k micro-steps
  mesh = _mesh(axis_type)
  tx = optax_accum.accumulate(ref.ADAM, k, axis_name=AX)
  with jax.set_mesh(mesh):
    init, step = _recipe(tx, jax.tree.map(lambda _: NamedSharding(mesh, P()), params))
    p, state = params, init(params)
    # every_k=1 has no accumulating program: emit=False raises there (accumulate's contract).
    emits = EMITS if k > 1 else (None, True)
    programs = {e: step.lower(p, state, batches[0], emit=e).compile() for e in emits}
    for b in batches:  # the device conditional decides
      p, state = programs[None](p, state, b)
  texts = {e: c.as_text() for e, c in programs.items()}
  want, _ = ref.run_steps(ref.ADAM, params, ref.mlp_loss, ref.windows(batches, k))
  chex.assert_trees_all_close(p, want, **ADAM_TOL)
  assert int(state.gradient_step) == 2
  assert state.acc_weight.shape == (D,) and state.acc_weight.sharding.spec == P(AX)
  if k > 1:  # per-device sums, stacked over the data axis
    assert state.grad_sum["w0"].shape == (D, *params["w0"].shape)
  # The device conditional: one all-reduce, in the emitting branch; none in a loop.
  assert count_collectives(texts[None]) == 1
  assert count_collectives(texts[None], where="loop") == 0
  # Static emission: the accumulating program has none (k > 1), the emitting program one.
  assert count_collectives(texts[True]) == 1
  if k > 1:
    assert count_collectives(texts[False]) == 0


def test_accumulate_recipe_already_reduced_gradients_warn_or_raise():
  """Gradients taken w.r.t. replicated parameters arrive all-reduced: never a silent k-fold
  reduction — a warning naming the fix, or an error when per-device weights cannot apply."""
  params = ref.mlp_params(0, SIZES)
  batch = _batch(3, D * ROWS)
  tx = optax_accum.accumulate(ref.SGD, 2, axis_name=AX)

  def forgot_pcast(params, state, batch, weight):
    grads = jax.grad(ref.mlp_loss)(params, batch)  # replicated params: reduced by autodiff
    w = ref.token_count(batch) if weight else None
    return tx.update(grads, state, params, weight=w)[1]

  with jax.set_mesh(_mesh(AxisType.Explicit)):
    state = jax.jit(data_parallel(tx.init, AX))(params)
    step = jax.jit(data_parallel(forgot_pcast, AX, batch_argnums=2), static_argnums=3)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      step(params, state, batch, False)
    assert any("already reduced over 'data'" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="`weight` differs per device but the gradients were"):
      step(params, state, batch, True)


def test_unbound_axis_without_a_mesh_names_the_mesh_route():
  tx = optax_accum.accumulate(ref.SGD, 2, axis_name=AX)
  params = ref.mlp_params(0, SIZES)
  # (?s): the message spans lines (it shows code).
  route = r"axis_name='data' is not bound here.*No mesh is in effect.*data_parallel"
  with pytest.raises(ValueError, match="(?s)(accumulate.init|optax_accum): " + route):
    jax.jit(tx.init)(params)
  with jax.set_mesh(_mesh(AxisType.Auto)):
    state = jax.jit(data_parallel(tx.init, AX))(params)
  with pytest.raises(ValueError, match="(?s)accumulate.update: " + route):
    jax.jit(tx.update)(params, state, params)
  with pytest.raises(ValueError, match="(?s)data_parallel: " + route):
    data_parallel(lambda x: x, AX)(np.ones(8))


def test_mesh_without_the_axis_names_its_axes():
  with (
    jax.set_mesh(_mesh(AxisType.Auto, names=("batch",))),
    pytest.raises(
      ValueError,
      match=r"axis_name='data' is not an axis of the mesh, whose axes are \('batch',\)",
    ),
  ):
    data_parallel(lambda x: x, AX, batch_argnums=0)(np.ones(8))


# ----------------------------------------------------------------------------------------------
# Two mesh axes: data x model (tensor-parallel parameters).

_TP = {"w0": P(None, "model"), "b0": P("model"), "w1": P("model", None), "b1": P()}


def _tp_loss(params, batch, explicit=False):
  """The MLP with its hidden layer split over "model": the second matmul sums partial products
  over "model" (an all-reduce the model needs, per micro-batch)."""
  h = jnp.tanh(batch["x"] @ params["w0"] + params["b0"])
  kw = {"out_sharding": P()} if explicit else {}  # Explicit axes: say where the sum goes
  out = jnp.matmul(h, params["w1"], **kw) + params["b1"]
  err = jnp.sum((out - batch["y"]) ** 2, axis=-1)
  return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def _all_reduces_by_axis(text: str, mesh) -> dict[tuple[str, str], int]:
  """{(mesh axis, "loop" | "step"): gradient-sized all-reduces} of a program on a 2-D mesh."""
  comps, entry = computations(text)
  loops = reachable(
    comps, [c for ins in comps.values() for i in ins if i.op == "while" for c in callees(i)]
  )
  ids = np.arange(mesh.size).reshape(mesh.devices.shape)  # logical ids, in mesh order
  axes = {
    frozenset(frozenset(g) for g in np.moveaxis(ids, a, -1).reshape(-1, ids.shape[a]).tolist()): n
    for a, n in enumerate(mesh.axis_names)
  }
  out: dict[tuple[str, str], int] = {}
  for name in reachable(comps, [entry]):
    for i in comps[name]:
      if i.op in ("all-reduce", "all-reduce-start") and re.search(r"\[\d", i.shape):
        axis = axes[frozenset(ref.replica_groups(i.rest))]
        key = (axis, "loop" if name in loops else "step")
        out[key] = out.get(key, 0) + 1
  return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_data_by_model_mesh_microbatch_reduces_data_once_model_where_needed(axis_type, weighted):
  mesh = _mesh(axis_type, (4, 2), (AX, "model"))
  params = ref.mlp_params(0, (SIZES[0], 8, SIZES[-1]))
  batch = _batch(4, 4 * 4 * ROWS, devices=4)
  if not weighted:  # every row real: equal weights give the large batch's mean
    batch["mask"] = np.ones_like(batch["mask"])
  explicit = axis_type == AxisType.Explicit
  step = microbatch(
    jax.value_and_grad(lambda p, b: _tp_loss(p, b, explicit)),
    4,
    weight_fn=_weight if weighted else None,
    axis_name=AX,
  )
  with jax.set_mesh(mesh):
    p = jax.device_put(params, {n: NamedSharding(mesh, s) for n, s in _TP.items()})
    f = jax.jit(data_parallel(step, AX, batch_argnums=1))
    text = f.lower(p, batch).compile().as_text()
    value, grads = f(p, batch)
  chex.assert_trees_all_close(
    (value, grads), jax.value_and_grad(_tp_loss)(params, batch), **ref.TOL
  )
  counts = _all_reduces_by_axis(text, mesh)
  assert counts.get((AX, "loop"), 0) == 0 and counts.get((AX, "step"), 0) == 1, counts
  assert counts.get(("model", "loop"), 0) >= 1, counts  # the model's own sum, per micro-batch
  for n, spec in _TP.items():  # the gradients keep the parameters' model sharding
    assert grads[n].sharding.is_equivalent_to(NamedSharding(mesh, spec), grads[n].ndim), n


@pytest.mark.parametrize(
  "axis_type",
  [AxisType.Auto, AxisType.Explicit],
)
def test_data_by_model_mesh_accumulate_recipe(axis_type):
  mesh = _mesh(axis_type, (4, 2), (AX, "model"))
  params = ref.mlp_params(0, (SIZES[0], 8, SIZES[-1]))
  batches = [_batch(20 + i, 4 * ROWS, devices=4) for i in range(2)]
  explicit = axis_type == AxisType.Explicit
  tx = optax_accum.accumulate(ref.SGD, 2, axis_name=AX)
  shardings = {n: NamedSharding(mesh, s) for n, s in _TP.items()}
  state_shardings = state_partition_specs(tx, shardings, AX)

  def train_step(params, state, batch, emit):
    grads = jax.grad(_tp_loss)(lax.pcast(params, AX, to="varying"), batch, explicit)
    updates, state = tx.update(grads, state, params, weight=ref.token_count(batch), emit=emit)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    init = jax.jit(data_parallel(tx.init, AX), out_shardings=state_shardings)
    step = jax.jit(
      data_parallel(train_step, AX, batch_argnums=2),
      static_argnums=3,
      out_shardings=(shardings, state_shardings),
    )
    p = jax.device_put(params, shardings)
    state = init(p)
    for i, b in enumerate(batches):
      p, state = step(p, state, b, i == 1)
    texts = [step.lower(p, state, batches[0], e).compile().as_text() for e in (False, True)]
  want, _ = ref.run_steps(ref.SGD, params, _tp_loss, ref.windows(batches, 2))
  chex.assert_trees_all_close(p, want, **ref.TOL)
  accumulating, emitting = (_all_reduces_by_axis(t, mesh) for t in texts)
  assert accumulating.get((AX, "step"), 0) == 0, accumulating
  assert emitting.get((AX, "step"), 0) == 1, emitting
  assert accumulating.get(("model", "step"), 0) >= 1, accumulating  # the model's own sums
  assert state.grad_sum["w0"].sharding.spec == P(AX, None, "model")


# ----------------------------------------------------------------------------------------------
# FSDP: parameters sharded over the data axis. Two choices, by `sync`.

FSDP_SIZES = (8, 64, 64, 8)  # every weight's leading size divides over the 8 devices


def _fsdp_shardings(params, mesh):
  return {n: NamedSharding(mesh, P(AX) if v.shape[0] % D == 0 else P()) for n, v in params.items()}


def _per_device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _fsdp_batch(seed, n):
  batch = _batch(seed, n)
  rng = np.random.default_rng(seed + 2)
  batch["x"] = rng.standard_normal((n, FSDP_SIZES[0])).astype(np.float32)
  batch["y"] = rng.standard_normal((n, FSDP_SIZES[-1])).astype(np.float32)
  return batch


def _fsdp_within_step(axis_type, sync):
  """One SGD step on FSDP parameters with `microbatch` bound by `data_parallel(sync=sync)`:
  ``(new params, the large batch's, the compiled step)``."""
  mesh = _mesh(axis_type)
  params = ref.mlp_params(0, FSDP_SIZES)
  shardings = _fsdp_shardings(params, mesh)
  batch = _fsdp_batch(5, D * 4 * ROWS)
  grad_fn = _bound_microbatch(4, sync=sync)

  def train_step(params, batch):
    _, grads = grad_fn(params, batch)
    return optax.apply_updates(params, ref.SGD.update(grads, ref.SGD.init(params))[0])

  with jax.set_mesh(mesh):
    p = jax.device_put(params, shardings)
    compiled = compile_fn(train_step, p, batch, out_shardings=shardings)
    got = compiled(p, batch)
  want, _ = ref.run_steps(ref.SGD, params, ref.mlp_loss, [batch])
  return got, want, compiled


@pytest.mark.parametrize(
  ("axis_type", "sync"),
  [(AxisType.Auto, "update"), (AxisType.Explicit, "update"), (AxisType.Auto, "microbatch")],
)
def test_fsdp_within_step_defer_or_reduce_per_micro_batch(axis_type, sync):
  """sync="update": parameters gathered once, a full-size accumulator per device, ONE
  reduction; sync="microbatch": GSPMD reduces every micro-batch into a sharded accumulator
  (on CPU an all-reduce + dynamic-slice). Same result: the large batch's SGD step.

  (The unbound GSPMD path on an Explicit mesh needs a model annotated for Explicit FSDP, with
  `out_sharding` on its matmuls: the model's business, not tested here.)
  """
  got, want, compiled = _fsdp_within_step(axis_type, sync)
  chex.assert_trees_all_close(got, want, **ref.TOL)
  assert got["w1"].sharding.spec == P(AX)
  if sync == "update":
    assert _array_reductions(compiled.text) == {"all": 1, "loop": 0}
    assert _reductions(compiled.text, "loop") == 0
    # The parameters are gathered once, on entry, not per micro-batch.
    assert count_collectives(compiled.text, "all-gather", where="loop") == 0
  else:
    assert _reductions(compiled.text, "loop") >= 1


@pytest.mark.parametrize("choice", ["defer", "per_micro_step"])
def test_fsdp_across_steps_defer_or_reduce_per_micro_step(choice):
  """accumulate across steps: defer = axis_name + data_parallel (full-size per-device sums, which
  `state_partition_specs` infers); per micro-step = axis_name=None under plain jit (the
  accumulator sharded like the parameters). One decision: the axis name."""
  mesh = _mesh(AxisType.Auto)
  params = ref.mlp_params(0, FSDP_SIZES)
  shardings = _fsdp_shardings(params, mesh)
  axis = AX if choice == "defer" else None
  k = 2
  tx = optax_accum.accumulate(ref.SGD, k, axis_name=axis)
  state_shardings = state_partition_specs(tx, shardings, axis)
  batches = [_fsdp_batch(30 + i, D * ROWS) for i in range(k)]

  def train_step(params, state, batch, emit):
    local = lax.pcast(params, AX, to="varying") if axis else params
    grads = jax.grad(ref.mlp_loss)(local, batch)
    updates, state = tx.update(grads, state, params, weight=ref.token_count(batch), emit=emit)
    return optax.apply_updates(params, updates), state

  bind = (lambda f, **kw: data_parallel(f, AX, **kw)) if axis else (lambda f, **kw: f)
  with jax.set_mesh(mesh):
    p = jax.device_put(params, shardings)
    state = jax.jit(bind(tx.init), out_shardings=state_shardings)(p)
    step = jax.jit(
      bind(train_step, batch_argnums=2),
      static_argnums=3,
      out_shardings=(shardings, state_shardings),
    )
    for i, b in enumerate(batches):
      p, state = step(p, state, b, i == k - 1)
    accumulating = step.lower(p, state, batches[0], False).compile().as_text()
    emitting = step.lower(p, state, batches[0], True).compile().as_text()
  want, _ = ref.run_steps(ref.SGD, params, ref.mlp_loss, ref.windows(batches, k))
  chex.assert_trees_all_close(p, want, **ref.TOL)
  acc = state.grad_sum["w1"]
  if choice == "defer":
    assert acc.shape == (D, *params["w1"].shape) and acc.sharding.spec == P(AX, None)
    assert _per_device_bytes(acc) == params["w1"].nbytes  # full size on every device
    assert _reductions(accumulating) == 0 and _reductions(emitting) == 1
  else:
    assert acc.shape == params["w1"].shape and acc.sharding.spec == P(AX)
    assert _per_device_bytes(acc) == params["w1"].nbytes // D
    assert _reductions(accumulating) >= 1  # every micro-step


def test_state_partition_specs_fsdp_is_one_decision_regression_issue_24_item_6():
  """FSDP is decided once, by accumulate's axis_name: with it the accumulator is per device and
  full-size (the parameter gathered); without it, sharded like the parameter. The specs follow
  from the optimizer alone: no `gathered=` to keep in agreement."""
  spec = {"w": P(AX, "model")}
  deferred = optax_accum.accumulate(optax.adam(0.1), 4, axis_name=AX)
  specs = state_partition_specs(deferred, spec, AX)
  assert specs.grad_sum == {"w": P(AX, None, "model")}
  assert specs.inner_state[0].mu == {"w": P(AX, "model")}
  assert state_partition_specs(deferred, spec, AX, gathered=True) == specs  # the same, stated
  per_step = state_partition_specs(optax_accum.accumulate(optax.adam(0.1), 4), spec, None)
  assert per_step.grad_sum == {"w": P(AX, "model")}
  with pytest.raises(ValueError, match=r"gathered=False.*leave gathered unset"):
    state_partition_specs(deferred, spec, AX, gathered=False)


# ----------------------------------------------------------------------------------------------
# data_parallel's own contract and bad input.


def test_data_parallel_inside_a_map_calls_fun_unchanged():
  mesh = _mesh(AxisType.Explicit)
  f = data_parallel(lambda x: lax.psum(x, AX), AX, batch_argnums=0)
  x = np.arange(D, dtype=np.float32)
  inner = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AX), out_specs=P()))
  chex.assert_trees_all_equal(inner(ref.shard(x, mesh, P(AX))), np.float32(x.sum()))
  with jax.set_mesh(mesh):
    chex.assert_trees_all_equal(jax.jit(f)(x), np.float32(x.sum()))


def test_data_parallel_keeps_python_arguments_static():
  def f(x, scale, *, square):
    y = x * scale  # a Python float, not a traced value
    return lax.psum(jnp.sum(y**2 if square else y), AX)

  x = np.arange(2.0 * D, dtype=np.float32)
  with jax.set_mesh(_mesh(AxisType.Auto)):
    got = data_parallel(f, AX, batch_argnums=0)(x, 2.0, square=True)
  np.testing.assert_allclose(got, np.sum((2 * x) ** 2), rtol=1e-6)


def test_data_parallel_rejects_bad_input():
  with pytest.raises(TypeError, match="data_parallel: fun must be callable, got 3"):
    data_parallel(3, AX)
  with pytest.raises(ValueError, match=r"varying must be one of \('error', 'concat'\), got 'x'"):
    data_parallel(jnp.sum, AX, varying="x")
  with pytest.raises(ValueError, match=r"sync must be one of \('update', 'microbatch'\), got 'k'"):
    data_parallel(jnp.sum, AX, sync="k")
  with pytest.raises(ValueError, match=r"data_parallel: batch_axes has 1 entries, \(0,\), but"):
    data_parallel(jnp.sum, AX, batch_argnums=(0, 1), batch_axes=(0,))
  # One batch-argument parser for every front end: these were accepted by data_parallel.
  with pytest.raises(TypeError, match=r"data_parallel: batch_argnums must be an int or a seq"):
    data_parallel(jnp.sum, AX, batch_argnums=True)
  with pytest.raises(ValueError, match=r"data_parallel: batch_argnums has repeated positions"):
    data_parallel(jnp.sum, AX, batch_argnums=(1, 1))
  with pytest.raises(TypeError, match="axis_name must be a mesh axis name or a tuple of them"):
    data_parallel(jnp.sum, 0)
  with jax.set_mesh(_mesh(AxisType.Auto)):
    with pytest.raises(
      ValueError,
      match=r"argument 0\['x'\] has batch size 12 \(axis 0\), which does not divide over the 8",
    ):
      data_parallel(lambda b: b, AX, batch_argnums=0)({"x": np.ones((12, 2))})
    with pytest.raises(ValueError, match="data_parallel: batch_argnums contains 3, but the"):
      data_parallel(lambda b: b, AX, batch_argnums=3)(np.ones(8))
    with pytest.raises(ValueError, match=r"data_parallel: batch_argnames names 'b', but the"):
      data_parallel(lambda b: b, AX, batch_argnames="b")(np.ones(8))
    with pytest.raises(ValueError, match=r"argument 0 has shape \(8,\), which has no batch axis 1"):
      data_parallel(lambda b: b, AX, batch_argnums=0, batch_axes=1)(np.ones(8))
    with pytest.raises(ValueError, match=r"output\[1\] differs per device over axis_name='data'"):
      data_parallel(lambda b: (lax.psum(b, AX), b), AX, batch_argnums=0)(np.ones(8))
    with pytest.raises(ValueError, match=r"output is a scalar that differs per device"):
      data_parallel(lambda b: b[0], AX, batch_argnums=0, varying="concat")(np.ones(8))
    tx = optax_accum.accumulate(ref.SGD, 2, axis_name=AX)
    state = data_parallel(tx.init, AX)({"w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="sync='microbatch' reduces every micro-step"):
      data_parallel(lambda s: s, AX, sync="microbatch")(state)


def test_data_parallel_varying_concat_joins_devices_along_the_leading_axis():
  x = np.arange(4.0 * D, dtype=np.float32).reshape(2 * D, 2)
  with jax.set_mesh(_mesh(AxisType.Explicit)):
    got = jax.jit(data_parallel(lambda b: b * 2, AX, batch_argnums=0, varying="concat"))(x)
  chex.assert_trees_all_equal(got, x * 2)


# ----------------------------------------------------------------------------------------------
# TrainStep(axis_name=...) under plain jit.


def _train_step_windows(step, params, micro):
  state = step.init(params)
  for b in micro:
    params, state, value = step(params, state, b)
  return params, state, value


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_train_step_data_parallel_reduces_once_per_window_and_matches_large_batch(axis_type, k):
  """Token-weighted across devices (`weight_fn` on each device's rows): the accumulating program
  has no gradient all-reduce, the emitting one one; two windows equal two large-batch steps."""
  params = ref.mlp_params(0, SIZES)
  micro = [_batch(40 + i, D * ROWS) for i in range(2 * k)]
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    step = optax_accum.TrainStep(
      ref.mlp_loss, ref.MOMENTUM, k, axis_name=AX, weight_fn=ref.token_count
    )
    state = step.init(params)
    if k > 1:  # one partial sum per device (every_k=1 keeps none)
      assert state.grad_sum["w0"].shape == (D, *params["w0"].shape)
    for emit in (False, True) if k > 1 else (True,):
      text = step.lower(params, state, micro[0], emit=emit).compile().as_text()
      # the emitting program: one (XLA:CPU combines the per-leaf all-reduces), plus, in a
      # conditional taken only if a device dropped the last micro-batch, the exact one
      assert _array_reductions(text, branches=False) == {"all": int(emit), "loop": 0}, emit
      assert _array_reductions(text) == {"all": 2 * int(emit), "loop": 0}, emit
    got, state, _ = _train_step_windows(step, params, micro)
  want, _ = ref.run_steps(ref.MOMENTUM, params, ref.mlp_loss, ref.windows(micro, k))
  chex.assert_trees_all_close(jax.device_get(got), want, **ref.TOL)
  assert int(state.gradient_step) == 2


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_train_step_fsdp_keeps_the_parameters_sharded(axis_type):
  """Parameters (and Adam's moments) sharded over the data axis: gathered inside, a full-size
  accumulator per device, and they leave every program sharded as they came in."""
  params = ref.mlp_params(0, SIZES)
  micro = [_batch(60 + i, D * ROWS) for i in range(4)]
  mesh = _mesh(axis_type)
  specs = {n: P(*([None] * (x.ndim - 1)), AX) if x.shape[-1] % D == 0 else P()
           for n, x in params.items()}  # fmt: skip
  with jax.set_mesh(mesh):
    sharded = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in params.items()}
    step = optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 2, axis_name=AX, weight_fn=ref.token_count)
    got, state, _ = _train_step_windows(step, sharded, micro)
    for n, x in got.items():
      assert x.sharding.is_equivalent_to(NamedSharding(mesh, specs[n]), x.ndim), n
      mu = state.inner_state[0].mu[n]
      assert mu.sharding.is_equivalent_to(NamedSharding(mesh, specs[n]), mu.ndim), n
  want, _ = ref.run_steps(ref.ADAM, params, ref.mlp_loss, ref.windows(micro, 2))
  chex.assert_trees_all_close(jax.device_get(got), want, **ADAM_TOL)


def test_train_step_axis_name_errors():
  params = ref.mlp_params(0, SIZES)
  step = optax_accum.TrainStep(ref.mlp_loss, ref.SGD, 2, axis_name=AX)
  with pytest.raises(ValueError, match="(?s)TrainStep: axis_name='data' is not bound here"):
    step.init(params)
  with pytest.raises(ValueError, match="grad_buffer=True needs axis_name=None"):
    optax_accum.TrainStep(ref.mlp_loss, ref.SGD, 2, axis_name=AX, grad_buffer=True)
  both = optax_accum.TrainStep(ref.mlp_loss, ref.SGD, 2, weight_fn=ref.token_count)
  with pytest.raises(TypeError, match="pass weight= or give weight_fn, not both"):
    both(params, both.init(params), _batch(1, D * ROWS), weight=1.0)


# ----------------------------------------------------------------------------------------------
# Two processes.

WORKER = os.path.join(os.path.dirname(__file__), "_gspmd_worker.py")
sys.path.insert(0, os.path.dirname(__file__))
import _gspmd_worker as worker  # noqa: E402
from test_multihost import needs_loopback_hostname  # noqa: E402


@pytest.mark.slow
@needs_loopback_hostname
@pytest.mark.parametrize("front", ["recipe", "train_step"])
def test_two_processes_plain_jit_train_like_one(tmp_path, front):
  codes = launch.launch(
    [sys.executable, WORKER, str(tmp_path), front],
    num_processes=2,
    local_devices=4,
    timeout=180,
    log_dir=str(tmp_path),
  )
  logs = "\n".join((tmp_path / f"process_{i}.log").read_text() for i in range(2))
  assert codes == [0, 0], logs
  want = worker.train(jax.devices(), front)  # one process, the same number of devices
  # Not bit for bit: across processes the all-reduce (gloo) adds the devices' sums in another
  # order than within one process (measured on a bare psum of 8 float32 vectors: 57% of the
  # elements differ in the last bits), so the parameters agree to float32 rounding.
  for i in range(2):
    got = dict(np.load(tmp_path / f"params_{i}.npz"))
    chex.assert_trees_all_close(got, want, **ref.TOL)
  chex.assert_trees_all_equal(*(dict(np.load(tmp_path / f"params_{i}.npz")) for i in range(2)))


def test_binder_does_not_import_the_optimizer_state():
  # Issue 17: the generic binder imported `_accumulate` to recognise its state; the front end
  # (`data_parallel`, `TrainStep`) now hands it a hook instead.
  import ast
  import pathlib

  source = (pathlib.Path(optax_accum.__file__).parent / "parallel" / "_gspmd.py").read_text()
  top = [n for n in ast.parse(source).body if isinstance(n, ast.Import | ast.ImportFrom)]
  names = {a.name for n in top for a in n.names}
  names |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
  state = {"_accumulate", "_state", "_sharding", "optax_accum.front_ends._accumulate"}
  state |= {"optax_accum.core._state", "optax_accum.parallel._sharding"}
  assert not names & state, names


def test_train_step_loss_over_the_devices_follows_the_reduction():
  """With `axis_name` the returned loss is the whole micro-batch's: the devices' mean for a mean
  loss, their sum with reduction="sum" (a sum loss, such as a clipped one, whose gradient is the
  sum over the devices too), not the mean of per-device sums (1/8 of it)."""
  params = ref.mlp_params(0, SIZES)
  batch = ref.regression_data(3, D * ROWS, d_in=SIZES[0], d_out=SIZES[-1])  # no padding rows
  summed = lambda p, b: ref.mlp_loss(p, b) * b["x"].shape[0]  # noqa: E731
  with jax.set_mesh(_mesh(AxisType.Auto)):
    for reduction, loss in (("mean", ref.mlp_loss), ("sum", summed)):
      step = optax_accum.TrainStep(loss, ref.SGD, 2, axis_name=AX, reduction=reduction)
      for emit in (False, True):  # the accumulating program, then the emitting one
        p = jax.tree.map(jnp.asarray, params)
        state = step.init(p)
        if emit:
          p, state, _ = step(p, state, batch)
        want = loss(jax.device_get(p), batch)
        value = step(p, state, batch)[2]
        np.testing.assert_allclose(float(value), float(want), rtol=2e-6, err_msg=reduction)


def test_train_step_integer_aux_over_the_devices_is_refused_with_the_fix():
  """An integer aux (a count) differs per device and TrainStep averages only float values: the
  error says to reduce it inside the loss, where the axis is bound; doing so returns the count
  of the whole micro-batch."""
  params = ref.mlp_params(0, SIZES)
  batch = ref.regression_data(4, D * ROWS, d_in=SIZES[0], d_out=SIZES[-1])
  count = lambda b: jnp.sum(b["x"][:, 0] > 0).astype(jnp.int32)  # noqa: E731
  local = lambda p, b: (ref.mlp_loss(p, b), count(b))  # noqa: E731
  reduced = lambda p, b: (ref.mlp_loss(p, b), lax.psum(count(b), AX))  # noqa: E731
  with jax.set_mesh(_mesh(AxisType.Auto)):
    step = optax_accum.TrainStep(local, ref.SGD, 2, axis_name=AX, has_aux=True)
    p = jax.tree.map(jnp.asarray, params)
    said = r"TrainStep: output\[2\]\[1\] differs per device.*jax\.lax\.psum\(x, 'data'\)"
    with pytest.raises(ValueError, match=said):
      step(p, step.init(p), batch)
    step = optax_accum.TrainStep(reduced, ref.SGD, 2, axis_name=AX, has_aux=True)
    _, _, (_, n) = step(p, step.init(p), batch)
    assert int(n) == int(np.sum(batch["x"][:, 0] > 0))
