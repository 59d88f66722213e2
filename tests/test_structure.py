"""Guards on the compiled structure that makes accumulation fast (no timings here).

Speed is measured in benchmarks/; these tests pin down, in the optimised HLO of small
programs, the properties the speed comes from:

* the accumulating program (`accumulate` with ``emit=False``, `TrainStep`'s accumulating
  program) runs no inner update (no `sqrt` of Adam's second moment), has no conditional, and
  copies no parameter- or state-sized buffer (params, accumulator and inner state are donated
  and updated in place);
* the state holds one accumulator (none for ``every_k=1``), and ``every_k=1`` without skipping
  compiles to the inner optimizer;
* `microbatch` compiles its body once: one while loop, a program whose size does not grow with
  k, and no per-iteration copy of the accumulator;
* with `axis_name`, one all-reduce per update: on the emitting step (in the emitting branch of
  the dynamic program) / after the loop, never inside it.

Each property has a positive control (a program that does have it), so a blind HLO parser
cannot make these tests pass.

Every test here carries the `structure` mark: they read XLA's optimised programs, so a jaxlib
release that compiles differently can trip one without any change here. Such a failure is a
performance question (re-run the benchmarks), not a wrong result: the equivalence tests say
whether the numbers are right. Select them with ``-m structure``.
"""

from __future__ import annotations

import functools
import re

import _reference as ref
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import count_collectives
from optax_accum.batch_size import _noise
from optax_accum.core import _hlo
from optax_accum.core._hlo import compile_fn, hlo_stats
from optax_accum.front_ends import _window

pytestmark = pytest.mark.structure

PARAMS = ref.mlp_params(0, (16, 32, 32, 4))
BATCH = ref.regression_data(1, 8, 16, 4)
ADAM = ref.ADAM


def _smallest_leaf_bytes(tree) -> int:
  return min(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim)


def _compile_step(tx, state, **update_kw):
  """`ref.step` of `tx` on PARAMS and BATCH, params and state donated."""
  step = functools.partial(ref.step, tx, ref.mlp_loss, **update_kw)
  return compile_fn(step, PARAMS, state, BATCH, donate_argnums=(0, 1))


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


def test_multisteps_control_copies_state():
  # optax.MultiSteps selects between old and new states on every step: the parser must see
  # those state-sized copies, or the "no copy" assertions below prove nothing.
  tx = optax.MultiSteps(ADAM, 4).gradient_transformation()
  stats = _compile_step(tx, tx.init(PARAMS)).hlo
  assert stats.sqrt_ops > 0
  assert stats.copy_bytes >= _smallest_leaf_bytes(PARAMS)


def _accumulating_and_emitting(front_end, k):
  """HLO stats of the accumulating and the emitting program of a front end."""
  if front_end == "accumulate":
    tx = optax_accum.accumulate(ADAM, k)
    state = tx.init(PARAMS)
    return [_compile_step(tx, state, emit=emit).hlo for emit in (False, True)]
  step = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=k)
  state = step.init(PARAMS)
  texts = [
    step.lower(PARAMS, state, BATCH, emit=emit).compile().as_text() for emit in (False, True)
  ]
  return [hlo_stats(text) for text in texts]


@pytest.mark.parametrize("front_end, k", [("accumulate", 2), ("accumulate", 4), ("train_step", 4)])
def test_accumulating_program_runs_no_inner_update_and_copies_no_state(front_end, k):
  accumulating, emitting = _accumulating_and_emitting(front_end, k)
  assert accumulating.sqrt_ops == 0, "Adam's update was compiled into the accumulating program"
  assert accumulating.conditionals == 0
  # Params, accumulator and Adam's moments are donated: updated or passed through in place.
  assert accumulating.copy_bytes < _smallest_leaf_bytes(PARAMS), accumulating
  assert emitting.sqrt_ops > 0  # positive control: the emitting program does run Adam


@pytest.mark.parametrize("skip_nonfinite", [True, "window", False])
def test_accumulate_runs_one_conditional_per_micro_step(skip_nonfinite):
  # Issue 42's window sums check (an overflowing window dropped) is read inside the closing
  # conditional, not in one of its own: on a GPU every conditional that runs makes the host
  # wait for its predicate, so a second top-level one would add a wait to every micro-step.
  tx = optax_accum.accumulate(ADAM, 4, skip_nonfinite=skip_nonfinite)
  text = compile_fn(
    functools.partial(ref.step, tx, ref.mlp_loss), PARAMS, tx.init(PARAMS), BATCH,
    donate_argnums=(0, 1),
  ).text  # fmt: skip
  comps, entry = _hlo.computations(text)
  placement, _ = _hlo.placements(comps, entry)
  top = [i for c, w in placement.items() if w == "step" for i in comps[c] if i.op == "conditional"]
  assert len(top) == 1, f"{len(top)} conditionals run on every micro-step"


def _reductions_where(hlo_text: str, min_bytes: int) -> dict[str, int]:
  """{placement: count} of the reductions (not dots) of a buffer of at least `min_bytes` to
  fewer bytes."""
  found: dict[str, int] = {}
  for where, instr in _hlo.narrowing_ops(hlo_text, min_bytes, min_bytes):
    if instr.op != "dot":
      found[where] = found.get(where, 0) + 1
  return found


def test_noise_scale_on_device_emission_copies_no_state_regression_issue_22(monkeypatch):
  # The protocol path decides emission on the device: a conditional closes the window. Its
  # |Σ wᵢgᵢ|², read inside that conditional, kept XLA from updating the sums in place, and the
  # branch that keeps the window open copied weight matrices on every accumulating micro-step
  # (1.13-1.18x the step without the statistics on the bench's MLPs). It is read in a
  # conditional of its own now, on the closing micro-step only.
  def compiled(read):
    monkeypatch.setattr(_window, "SUMS_SQ_READ", read)
    tx = optax_accum.accumulate(ADAM, 4, noise_scale=True)
    return _compile_step(tx, tx.init(PARAMS))

  leaf = _smallest_leaf_bytes(PARAMS)
  closing, every, inside = (compiled(read) for read in ("closing", "every", "inside"))
  assert closing.hlo.copy_bytes < leaf, closing.hlo.copies_where
  assert inside.hlo.copies_where.get("cond", 0) >= leaf, inside.hlo  # control: the copies
  # Not read on every micro-step: one reduction of the sums fewer at the top level than the
  # spelling that reads them before the conditionals (control, which copies nothing either),
  # and one more in a conditional branch.
  assert every.hlo.copy_bytes < leaf, every.hlo.copies_where
  at_closing, at_every = (_reductions_where(p.text, leaf) for p in (closing, every))
  assert at_closing.get("step", 0) < at_every.get("step", 0), (at_closing, at_every)
  assert at_closing.get("cond", 0) > at_every.get("cond", 0), (at_closing, at_every)


_SQUARE_WINDOWS = re.compile(r"window=\{size=32x32 ")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU form of the squared norm")
@pytest.mark.parametrize("front_end", ["accumulate", "train_step"])
def test_noise_sq_norm_is_not_rewritten_into_square_windows_regression_issue_22(
  front_end, monkeypatch
):
  # XLA:CPU's tree-reduction pass rewrote each micro-batch's Σ|g|² of a weight (whose gradient
  # autodiff lays out transposed) into 32x32 reduce-windows, which read it 3-4x slower than the
  # finite check's matrix-vector product: most of noise_scale=True's cost on the bench's MLPs.
  # Summed over its rows first (`_noise._sum`), it is left alone; the plain sum is
  # the control. Layers wider than 32: narrower ones are never rewritten.
  params = ref.mlp_params(0, (48, 96, 96, 4))
  batch = ref.regression_data(1, 8, 48, 4)

  def accumulating(rows_first):
    monkeypatch.setattr(_noise, "SUM_ROWS_FIRST", rows_first)
    if front_end == "accumulate":
      tx = optax_accum.accumulate(ADAM, 4, noise_scale=True)
      step = functools.partial(ref.step, tx, ref.mlp_loss, emit=False)
      return compile_fn(step, params, tx.init(params), batch, donate_argnums=(0, 1)).text
    step = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=4, noise_scale=True)
    return step.lower(params, step.init(params), batch, emit=False).compile().as_text()

  assert _SQUARE_WINDOWS.search(accumulating(False))  # control
  assert not _SQUARE_WINDOWS.search(accumulating(True))


def test_noise_sq_norm_of_sharded_leaves_gathers_nothing():
  # The rows-first window is for leaves whole on each device: across a sharded axis the
  # partitioner would gather the leaf (the control), and an Explicit mesh refuses it. A leaf
  # a mesh may shard takes the plain sum: partial sums and one scalar all-reduce.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.device_put(
    jnp.arange(256 * 64, dtype=jnp.float32).reshape(256, 64) / 1e4,
    jax.sharding.NamedSharding(mesh, P("d", None)),
  )
  want = float(np.sum(np.asarray(x, np.float64) ** 2))
  text = jax.jit(_noise.sq_norm).lower(x).compile().as_text()
  assert count_collectives(text, "all-gather") == 0, text
  assert count_collectives(text, "all-reduce") == 1
  gathers = jax.jit(_noise._sum_rows_first).lower(jnp.square(x)).compile().as_text()
  assert count_collectives(gathers, "all-gather") == 1  # control
  np.testing.assert_allclose(jax.jit(_noise.sq_norm)(x), want, rtol=1e-6)
  explicit = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(explicit):
    y = jax.device_put(x, jax.sharding.NamedSharding(explicit, P("d", None)))
    np.testing.assert_allclose(jax.jit(_noise.sq_norm)(y), want, rtol=1e-6)
  # Whole on each device, so the rows-first form: outside any mesh, and inside a shard_map
  # over every axis; not where an Auto or Explicit axis may shard it.
  seen = []

  def record(v):
    seen.append(_noise._local(v))
    return v

  jax.jit(record).trace(np.ones((4, 4), np.float32))
  jax.jit(jax.shard_map(record, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).trace(x)
  jax.jit(record).trace(x)
  with jax.set_mesh(explicit):
    jax.jit(record).trace(y)
  assert seen == [True, True, False, False]


@pytest.mark.parametrize("k, max_ops", [(1, None), (4, None), (4, 0)])
def test_trainstep_emitting_program_copies_no_more_than_plain_adam(k, max_ops, monkeypatch):
  # The accumulator is reset lazily (by the next window's first add), so emitting neither
  # copies the sums out of the donated buffer nor fills it with zeros: two parameter-sized
  # copies that an eager reset costs.
  # `lower(emit=True)`: with k = 1, and for this small model, the one program that adds and
  # closes; beyond a small model (FUSED_EMIT_MAX_OPS=0 makes this one so) the closing program
  # (the emitting micro-step runs the accumulating program, then it).
  if max_ops is not None:
    monkeypatch.setattr(optax_accum.front_ends._train_step, "FUSED_EMIT_MAX_OPS", max_ops)
  step = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=k)
  text = step.lower(PARAMS, step.init(PARAMS), BATCH, emit=True).compile().as_text()
  emit = hlo_stats(text)
  floor = _compile_step(ADAM, ADAM.init(PARAMS)).hlo
  assert emit.copy_bytes <= floor.copy_bytes, (emit.copies_where, floor.copies_where)


def _dots(hlo_text: str) -> int:
  """Matrix products (a result of 2 or more dimensions, none of them 1): a forward or backward
  pass's. Not the matrix-vector products (``[n,1]``) of the finite check (`_core._leaf_finite`),
  which the closing program runs on the window's sums (an overflowing window is dropped)."""
  shapes = re.findall(r"= \w+\[([\d,]+)\]\S* dot\(", hlo_text)
  return sum(1 for s in shapes if "," in s and all(int(d) > 1 for d in s.split(",")))


@pytest.mark.parametrize("noise_scale", [False, True])
def test_trainstep_closing_program_computes_no_gradient(noise_scale, monkeypatch):
  # Beyond a small model (`FUSED_EMIT_MAX_OPS`; 0 here: every model is beyond it) the emitting
  # micro-step runs the accumulating program, then the closing program (`lower(emit=True)`),
  # which takes (params, state) only: the backward pass is compiled once, in the accumulating
  # program (positive control: its forward and backward dots).
  monkeypatch.setattr(optax_accum.front_ends._train_step, "FUSED_EMIT_MAX_OPS", 0)
  step = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=4, noise_scale=noise_scale)
  state = step.init(PARAMS)
  accumulating = step.lower(PARAMS, state, BATCH, emit=False)
  closing = step.lower(PARAMS, state, BATCH, emit=True)
  assert len(closing.args_info[0]) == 2  # params, state: no gradient buffer, no batch
  n_layers = len(jax.tree.leaves(PARAMS)) // 2
  assert _dots(accumulating.compile().as_text()) >= 2 * n_layers
  assert _dots(closing.compile().as_text()) == 0
  # every_k=1: no accumulator to close from; the one program still adds and closes.
  fused = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=1)
  lowered = fused.lower(PARAMS, fused.init(PARAMS), BATCH, emit=True)
  assert _dots(lowered.compile().as_text()) >= 2 * n_layers


@pytest.mark.parametrize("max_ops", [None, 0])
def test_trainstep_small_model_runs_one_program_per_micro_step(max_ops, monkeypatch):
  # A small model (issue 42, item 7): the accumulating program has at most FUSED_EMIT_MAX_OPS
  # operations, so the emitting micro-step is one program (grad → add → close) that takes a
  # micro-batch and computes the gradient, not the accumulating program then the closing one:
  # one dispatch fewer per window. The control (max_ops=0): the same model over the limit.
  if max_ops is not None:
    monkeypatch.setattr(optax_accum.front_ends._train_step, "FUSED_EMIT_MAX_OPS", max_ops)
  step = optax_accum.TrainStep(ref.mlp_loss, ADAM, every_k=4)
  state = step.init(PARAMS)
  accumulating = step.lower(PARAMS, state, BATCH)
  ops = optax_accum.front_ends._host.ops(accumulating)
  assert ops <= optax_accum.front_ends._train_step.FUSED_EMIT_MAX_OPS or max_ops == 0, ops
  emitting = step.lower(PARAMS, state, BATCH, emit=True)
  one = max_ops is None
  # a micro-batch in (the lean calling convention: params, reads, part, buffer, batch, weight),
  # or (params, state)
  assert len(emitting.args_info[0]) == (6 if one else 2)
  assert (_dots(emitting.compile().as_text()) > 0) == one  # the gradient, or none


@pytest.mark.parametrize("k", [1, 4])
def test_accumulate_state_holds_one_accumulator_no_buffer_for_every_k_1(k):
  state = optax_accum.accumulate(ADAM, k).init(PARAMS)
  assert jax.tree.structure(state.grad_sum) == jax.tree.structure(PARAMS)  # the same tree
  if k == 1:  # one boolean scalar per leaf
    assert all(a.nbytes == 1 for a in jax.tree.leaves(state.grad_sum))
  adam_bytes = sum(x.nbytes for x in jax.tree.leaves(ADAM.init(PARAMS)))
  accumulator_bytes = 0 if k == 1 else sum(x.nbytes for x in jax.tree.leaves(PARAMS))
  extra = sum(x.nbytes for x in jax.tree.leaves(state)) - adam_bytes - accumulator_bytes
  assert 0 <= extra <= 64, f"state holds {extra} bytes beyond Adam's and {accumulator_bytes}"


def test_accumulate_every_k_1_without_skipping_compiles_to_the_inner_optimizer():
  # every_k == 1 costs no accumulator and no extra time. With nothing that could empty the
  # window (no NaN check, no weights) the program is plain Adam: no conditional and the same
  # temporary bytes. (With skip_nonfinite=True it pays for the check and a cond.)
  floor = _compile_step(ADAM, ADAM.init(PARAMS))
  tx = optax_accum.accumulate(ADAM, 1, skip_nonfinite=False)
  ours = _compile_step(tx, tx.init(PARAMS))
  assert ours.hlo.conditionals == 0
  assert ours.memory["temp"] == floor.memory["temp"], (ours.memory, floor.memory)


def _microbatch_fn(k, traced_num_real):
  """`microbatch(value_and_grad(loss), k)`; with `traced_num_real`, ``num_real_microbatches``
  is a traced int32 argument (the padded-last-batch program: a while loop, not a scan)."""
  vg = jax.value_and_grad(ref.mlp_loss)
  if not traced_num_real:
    return optax_accum.microbatch(vg, k)
  return lambda p, d, n: optax_accum.microbatch(vg, k, split="strided", num_real_microbatches=n)(
    p, d
  )


def _microbatch_args(k, traced_num_real, batch_size=64):
  data = ref.regression_data(3, batch_size, 16, 4)
  return (PARAMS, data, jnp.int32(k)) if traced_num_real else (PARAMS, data)


def _count_eqns(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _count_eqns(sub)
  return n


@pytest.mark.parametrize("traced_num_real", [False, True])
def test_microbatch_body_compiled_once_whatever_k(traced_num_real):
  # The one place the suite asserts "the program size is flat in k" (static and traced
  # `num_real_microbatches`).
  c2, c64 = (
    compile_fn(_microbatch_fn(k, traced_num_real), *_microbatch_args(k, traced_num_real))
    for k in (2, 64)
  )
  for c in (c2, c64):
    assert c.hlo.whiles == 1, "the micro-batches must run in one loop"
    # No per-iteration copy of the accumulator (the scan carry is updated in place).
    assert c.hlo.copies_where.get("loop", 0) < _smallest_leaf_bytes(PARAMS), c.hlo
  # The program does not grow with k: an unrolled loop would be ~32 times larger. (XLA fuses
  # size-1 micro-batches a little differently, hence a margin rather than equality.)
  n2 = sum(1 for line in c2.text.splitlines() if " = " in line)
  n64 = sum(1 for line in c64.text.splitlines() if " = " in line)
  assert n64 <= 1.5 * n2, (n2, n64)
  # `fun` is traced once: the traced program has the same equations for every k.
  counts = {}
  for k in (2, 8, 64):
    args = _microbatch_args(k, traced_num_real, batch_size=128)  # micro-batches of >= 2 rows
    counts[k] = _count_eqns(jax.make_jaxpr(_microbatch_fn(k, traced_num_real))(*args).jaxpr)
  assert len(set(counts.values())) == 1, counts
  # Positive control: a Python loop over the micro-batches (what the loop replaces) grows.
  unrolled = {k: _count_eqns(jax.make_jaxpr(_unrolled(k))(PARAMS, args[1]).jaxpr) for k in (2, 8)}
  assert unrolled[8] > 2 * unrolled[2], unrolled


def _unrolled(k):
  """The gradient of k micro-batches summed in a Python loop: a program that grows with k."""
  vg = jax.value_and_grad(ref.mlp_loss)

  def f(params, data):
    parts = [vg(params, jax.tree.map(lambda x, i=i: x[i::k], data)) for i in range(k)]
    return jax.tree.map(lambda *xs: sum(xs) / k, *parts)

  return f


# ----------------------------------------------------------------------------------------------
# Collectives with axis_name (8 host devices).

AX = ref.AXIS


def _token_batch(rows_per_device):
  data = ref.regression_data(4, 8 * rows_per_device, 16, 4)
  return {**data, "mask": np.ones(8 * rows_per_device, np.float32)}


def test_count_collectives_finds_loops_and_branches():
  # Positive control: a psum inside a scan is found, and counted as inside the loop.
  mesh = ref.mesh()

  def body(x):
    def loop(c, _):
      return c + lax.psum(c, AX), None

    return lax.scan(loop, x, None, length=3)[0]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
  text = f.lower(ref.shard(np.ones(8, np.float32), mesh, P(AX))).compile().as_text()
  assert count_collectives(text, where="loop") == count_collectives(text) >= 1
  with pytest.raises(ValueError, match="kind must be one of"):
    count_collectives(text, "allreduce")


def _accumulate_program(k, emit=None):
  """The compiled data-parallel micro-step of `accumulate(..., axis_name)`, token-weighted."""
  tx = optax_accum.accumulate(ADAM, k, axis_name=AX)
  mesh = ref.mesh()
  dp = ref.data_parallel(tx, PARAMS, mesh, weight_fn=ref.token_count, emit=emit)
  batch = ref.shard(_token_batch(4), mesh, P(AX))
  return dp.step.lower(PARAMS, dp.init(PARAMS), batch).compile().as_text()


@pytest.mark.parametrize("k", [1, 4, 16])
def test_accumulate_all_reduces_once_per_update(k):
  text = _accumulate_program(k)
  assert count_collectives(text, "all-reduce") == 1
  assert count_collectives(text, "all-reduce", where="loop") == 0
  if k > 1:
    # lax.cond(emitting, close, keep): the all-reduce is in the emitting branch only.
    branches = _hlo.conditional_branches(text, "all-reduce")
    assert sorted(map(sorted, branches))[-1] == [0, 1]
    assert all(0 in b for b in branches)
  # The static programs: accumulating has no collective, emitting has the one.
  if k == 4:
    assert count_collectives(_accumulate_program(k, emit=False)) == 0
    assert count_collectives(_accumulate_program(k, emit=True)) == 1


@pytest.mark.parametrize("k", [1, 4, 16])
def test_microbatch_all_reduces_once_after_the_loop(k):
  mesh = ref.mesh()
  f = optax_accum.microbatch(
    jax.value_and_grad(ref.mlp_loss),
    k,
    weight_fn=lambda params, batch: ref.token_count(batch),
    axis_name=AX,
  )
  mapped = jax.shard_map(
    lambda p, b: jax.tree.map(lambda a: a[None], f(p, b)),
    mesh=mesh,
    in_specs=(P(), P(AX)),
    out_specs=P(AX),
  )
  stats = compile_fn(mapped, PARAMS, ref.shard(_token_batch(16), mesh, P(AX))).hlo
  assert stats.collective_where.get("loop", 0) == 0, stats.collective_where
  # XLA's all-reduce combiner fuses the reductions after the loop (value, gradients, weights)
  # into one.
  assert stats.collectives.get("all-reduce", 0) == 1, stats.collectives
