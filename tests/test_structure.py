"""Guards on the compiled structure that makes accumulation fast (no timings here).

Speed is measured in benchmarks/; these tests pin down, in the optimised HLO of small
programs, the properties the speed comes from:

* the non-emitting step (`emit=False`, `TrainStep`'s accumulating program) runs no inner update
  (no `sqrt` of Adam's second moment), has no conditional, and copies no parameter- or
  state-sized buffer (params, accumulator and inner state are donated and updated in place);
* `microbatch` compiles its body once: one while loop, a program whose size does not grow with
  k, and no per-iteration copy of the accumulator;
* with `axis_name`, one all-reduce per update, on the emitting step / after the loop only.

Each property has a positive control (a program that does have it), so a blind HLO parser
cannot make these tests pass.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum._hlo import compile_fn, hlo_stats


def _mlp(sizes=(16, 32, 32, 4)):
  keys = jax.random.split(jax.random.key(0), len(sizes))
  params = [
    {"w": jax.random.normal(k, (a, b)) / a**0.5, "b": jnp.zeros(b)}
    for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=False)
  ]

  def loss(params, batch):
    x, y = batch
    for i, p in enumerate(params):
      x = x @ p["w"] + p["b"]
      if i < len(params) - 1:
        x = jnp.tanh(x)
    return jnp.mean((x - y) ** 2)

  x = jax.random.normal(jax.random.key(1), (8, sizes[0]))
  y = jax.random.normal(jax.random.key(2), (8, sizes[-1]))
  return params, loss, (x, y)


def _smallest_leaf_bytes(tree) -> int:
  return min(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim)


def _protocol_step(loss, tx, **kw):
  def step(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params, **kw)
    return optax.apply_updates(params, updates), state

  return step


def test_hlo_stats_sees_conditionals_loops_sqrt_and_copies():
  # Positive controls for the parser the other tests rely on.
  def f(x, p):
    y = lax.cond(p, jnp.sqrt, jnp.exp, x)
    return lax.fori_loop(0, 3, lambda i, c: c * 2.0, y)

  stats = compile_fn(f, jnp.ones(4), True).hlo
  assert stats.conditionals == 1
  assert stats.whiles == 1
  assert stats.sqrt_ops >= 1
  text = "\n".join(
    [
      "HloModule m",
      "ENTRY %main (p: f32[8,4]) -> f32[8,4] {",
      "  %p = f32[8,4]{1,0} parameter(0)",
      "  ROOT %copy.1 = f32[8,4]{1,0} copy(%p)",
      "}",
    ]
  )
  assert hlo_stats(text).copy_bytes == 8 * 4 * 4


@pytest.mark.parametrize("k", [2, 4])
def test_accumulate_nonemitting_step_runs_no_inner_update_and_copies_no_state(k):
  params, loss, batch = _mlp()
  tx = optax_accum.accumulate(optax.adam(1e-3), k)
  state = tx.init(params)
  step = _protocol_step(loss, tx, emit=False)
  stats = compile_fn(step, params, state, batch, donate_argnums=(0, 1)).hlo
  assert stats.sqrt_ops == 0, "Adam's update was compiled into the non-emitting step"
  assert stats.conditionals == 0
  # Params, accumulator and Adam's moments are donated: updated or passed through in place.
  assert stats.copy_bytes < _smallest_leaf_bytes(params), stats
  # Positive control: the emitting step does run Adam.
  emit = compile_fn(
    _protocol_step(loss, tx, emit=True), params, state, batch, donate_argnums=(0, 1)
  )
  assert emit.hlo.sqrt_ops > 0


def test_multisteps_control_copies_state():
  # optax.MultiSteps selects between old and new states on every step: the parser must see
  # those state-sized copies, or the "no copy" assertions above prove nothing.
  params, loss, batch = _mlp()
  tx = optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation()
  stats = compile_fn(
    _protocol_step(loss, tx), params, tx.init(params), batch, donate_argnums=(0, 1)
  ).hlo
  assert stats.sqrt_ops > 0
  assert stats.copy_bytes >= _smallest_leaf_bytes(params)


def test_trainstep_accumulating_program_runs_no_inner_update_and_copies_no_state():
  params, loss, batch = _mlp()
  step = optax_accum.TrainStep(loss, optax.adam(1e-3), every_k=4)
  state = step.init(params)
  text = step.lower(params, state, batch, emit=False).compile().as_text()
  stats = hlo_stats(text)
  assert stats.sqrt_ops == 0
  assert stats.conditionals == 0
  assert stats.copy_bytes < _smallest_leaf_bytes(params), stats
  emit = hlo_stats(step.lower(params, state, batch, emit=True).compile().as_text())
  assert emit.sqrt_ops > 0


@pytest.mark.parametrize("k", [1, 4])
def test_trainstep_emitting_program_copies_no_more_than_plain_adam(k):
  # The accumulator is reset lazily (by the next window's first add), so emitting neither
  # copies the sums out of the donated buffer nor fills it with zeros: two parameter-sized
  # copies that an eager reset costs.
  params, loss, batch = _mlp()
  step = optax_accum.TrainStep(loss, optax.adam(1e-3), every_k=k)
  emit = hlo_stats(step.lower(params, step.init(params), batch, emit=True).compile().as_text())
  adam = optax.adam(1e-3)
  floor = compile_fn(
    _protocol_step(loss, adam), params, adam.init(params), batch, donate_argnums=(0, 1)
  ).hlo
  assert emit.copy_bytes <= floor.copy_bytes, (emit.copies_where, floor.copies_where)


def test_accumulate_every_k_1_holds_no_accumulator():
  params, _, _ = _mlp()
  state = optax_accum.accumulate(optax.adam(1e-3), 1).init(params)
  assert state.acc_grads is None
  adam_bytes = sum(x.nbytes for x in jax.tree.leaves(optax.adam(1e-3).init(params)))
  extra = sum(x.nbytes for x in jax.tree.leaves(state)) - adam_bytes
  assert extra <= 64, f"k=1 state holds {extra} bytes beyond Adam's"


def test_accumulate_every_k_1_without_skipping_compiles_to_the_inner_optimizer():
  # DESIGN.md: every_k == 1 costs no accumulator and no extra time. With nothing that could
  # empty the window (no NaN check, no weights) the program is plain Adam: no conditional and
  # the same temporary bytes. (With skip_nonfinite=True it pays for the check and a cond.)
  params, loss, batch = _mlp()
  adam = optax.adam(1e-3)
  tx = optax_accum.accumulate(adam, 1, skip_nonfinite=False)
  floor = compile_fn(
    _protocol_step(loss, adam), params, adam.init(params), batch, donate_argnums=(0, 1)
  )
  ours = compile_fn(_protocol_step(loss, tx), params, tx.init(params), batch, donate_argnums=(0, 1))
  assert ours.hlo.conditionals == 0
  assert ours.memory["temp"] == floor.memory["temp"], (ours.memory, floor.memory)


@pytest.mark.parametrize("k", [4])
def test_accumulate_state_holds_exactly_one_accumulator(k):
  params, _, _ = _mlp()
  state = optax_accum.accumulate(optax.adam(1e-3), k).init(params)
  adam_bytes = sum(x.nbytes for x in jax.tree.leaves(optax.adam(1e-3).init(params)))
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  extra = sum(x.nbytes for x in jax.tree.leaves(state)) - adam_bytes - param_bytes
  assert 0 <= extra <= 64, f"state holds {extra} bytes beyond Adam's and one accumulator"


def _microbatch_stats(k, batch_size=64):
  params, loss, _ = _mlp()
  x = jax.random.normal(jax.random.key(3), (batch_size, 16))
  y = jax.random.normal(jax.random.key(4), (batch_size, 4))
  f = optax_accum.microbatch(jax.value_and_grad(loss), k)
  return params, compile_fn(f, params, (x, y))


def _count_eqns(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _count_eqns(sub)
  return n


def test_microbatch_body_compiled_once_whatever_k():
  params, c2 = _microbatch_stats(2)
  _, c64 = _microbatch_stats(64)
  for c in (c2, c64):
    assert c.hlo.whiles == 1, "the micro-batches must run in one loop"
    # No per-iteration copy of the accumulator (the scan carry is updated in place).
    assert c.hlo.copies_where.get("loop", 0) < _smallest_leaf_bytes(params), c.hlo
  # The program does not grow with k: an unrolled loop would be ~32 times larger. (XLA fuses
  # size-1 micro-batches a little differently, hence a margin rather than equality.)
  n2 = sum(1 for line in c2.text.splitlines() if " = " in line)
  n64 = sum(1 for line in c64.text.splitlines() if " = " in line)
  assert n64 <= 1.5 * n2, (n2, n64)
  # `fun` is traced once: the traced program has the same equations for every k.
  _, loss, _ = _mlp()
  x, y = jnp.ones((128, 16)), jnp.ones((128, 4))  # micro-batches of >= 2 rows
  counts = {}
  for k in (2, 8, 64):
    f = optax_accum.microbatch(jax.value_and_grad(loss), k)
    counts[k] = _count_eqns(jax.make_jaxpr(f)(params, (x, y)).jaxpr)
  assert len(set(counts.values())) == 1, counts


def _mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS for 8 host devices)")
  return jax.make_mesh((8,), ("d",))


@pytest.mark.parametrize("emit", [False, True])
def test_accumulate_axis_name_all_reduces_once_on_the_emitting_step(emit):
  mesh = _mesh()
  params, loss, _ = _mlp()
  tx = optax_accum.accumulate(optax.adam(1e-3), 4, axis_name="d")

  def f(params, batch, mini_step):
    state = tx.init(params)._replace(mini_step=mini_step)
    grads = jax.grad(loss)(lax.pcast(params, "d", to="varying"), batch)
    updates, state = tx.update(grads, state, params, emit=emit)
    return jax.tree.map(lambda a: a[None], (updates, state.acc_grads))

  x = jax.random.normal(jax.random.key(3), (32, 16))
  y = jax.random.normal(jax.random.key(4), (32, 4))
  batch = jax.device_put((x, y), NamedSharding(mesh, P("d")))
  mapped = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d"), P()), out_specs=P("d"))
  stats = compile_fn(mapped, params, batch, jnp.zeros((), jnp.int32)).hlo
  assert stats.collectives.get("all-reduce", 0) == (1 if emit else 0), stats.collectives


def test_microbatch_axis_name_all_reduces_once_after_the_loop():
  mesh = _mesh()
  params, loss, _ = _mlp()
  f = optax_accum.microbatch(jax.value_and_grad(loss), 4, axis_name="d")
  x = jax.random.normal(jax.random.key(3), (64, 16))
  y = jax.random.normal(jax.random.key(4), (64, 4))
  batch = jax.device_put((x, y), NamedSharding(mesh, P("d")))
  mapped = jax.shard_map(
    lambda p, b: jax.tree.map(lambda a: a[None], f(p, b)),
    mesh=mesh,
    in_specs=(P(), P("d")),
    out_specs=P("d"),
  )
  stats = compile_fn(mapped, params, batch).hlo
  assert stats.collective_where.get("loop", 0) == 0, stats.collective_where
  assert stats.collectives.get("all-reduce", 0) == 1, stats.collectives
