"""The accelerator-shaped micro-step (issue 33): FSDP accumulators sharded like the parameters in
`TrainStep` without `axis_name`, and `TrainStep` recompiling only when its inputs really change.

Placement is read from the arrays (`.sharding`, each device's shard) and from XLA's memory
analysis of the compiled accumulating program; results are compared with the large batch
(`_reference.run_steps`: a direct gradient of the whole window, then a plain optax step). The 8
devices are conftest's host CPU devices.
"""

from __future__ import annotations

import re

import _reference as ref
import _stats as stats
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import count_collectives
from optax_accum.core._hlo import ancestors, computations, placements, shape_bytes

D = 8
SIZES = (4, 16, 8)  # every weight matrix's dimensions divide by 8 (and by 4 x 2)
# Adam's first steps are ~lr * g / |g|: GSPMD's partial sums add a gradient's rows in another
# order than the large batch's single device, which moves an update by ~1e-5 relative where an
# entry of g is tiny.
ADAM_TOL = dict(rtol=2e-5, atol=2e-6)


def _fsdp(mesh: jax.sharding.Mesh, params: dict) -> dict:
  """Each parameter's spec, split 8 ways: 1-D FSDP over "data" (the last dimension), or on a
  4 x 2 mesh the matrices over ("data", "model") and the biases over both axes at once."""
  if len(mesh.axis_names) == 1:
    return {n: P(*([None] * (x.ndim - 1)), "data") for n, x in params.items()}
  return {n: P("data", "model") if x.ndim == 2 else P(("data", "model")) for n, x in params.items()}


LAYOUTS = {
  "auto_1d": ((D,), ("data",), AxisType.Auto),
  "explicit_1d": ((D,), ("data",), AxisType.Explicit),
  "auto_2d": ((4, 2), ("data", "model"), AxisType.Auto),
}


def _shard_bytes(x: jax.Array) -> int:
  return x.addressable_shards[0].data.nbytes


def _batches(n: int) -> list:
  return [ref.regression_data(70 + i, 16, d_in=SIZES[0], d_out=SIZES[-1]) for i in range(n)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_train_step_fsdp_accumulator_sharded_like_the_parameters_from_init(layout):
  shape, names, axis_type = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
  params = ref.mlp_params(0, SIZES)
  specs = _fsdp(mesh, params)
  micro = _batches(4)
  with jax.set_mesh(mesh):
    sharded = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in params.items()}
    step = optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 2)
    state = step.init(sharded)
    for when in ("init", "after"):
      for n, acc in state.grad_sum.items():
        assert acc.sharding.is_equivalent_to(NamedSharding(mesh, specs[n]), acc.ndim), (when, n)
        assert _shard_bytes(acc) * D == acc.nbytes, (when, n)  # 1/8 per device
        mu = state.inner_state[0].mu[n]
        assert mu.sharding.is_equivalent_to(NamedSharding(mesh, specs[n]), mu.ndim), (when, n)
      if when == "init":
        # The compiled accumulating program takes each operand's shard only: its arguments
        # are the sum of the shards (with a replicated accumulator, + 7/8 of it per device);
        # of the state, all but the inner state, which it never sees.
        compiled = step.lower(sharded, state, micro[0]).compile()
        hollow = state._replace(inner_state=None)
        args = (sharded, hollow, step._buffer(sharded, (micro[0],)))
        shards = sum(_shard_bytes(x) for x in jax.tree.leaves(args))
        # the batch (host arrays) as the compiler placed it
        placed = zip(
          micro[0].values(), jax.tree.leaves(compiled.input_shardings[0][3]), strict=True
        )
        batch = sum(np.prod(s.shard_shape(x.shape)) * x.itemsize for x, s in placed)
        assert compiled.memory_analysis().argument_size_in_bytes == shards + batch
        for x in micro:
          sharded, state, _ = step(sharded, state, x)
    assert len(step._compiled) == 1
  assert int(state.gradient_step) == 2
  want, _ = ref.run_steps(ref.ADAM, params, ref.mlp_loss, ref.windows(micro, 2))
  chex.assert_trees_all_close(jax.device_get(sharded), want, **ADAM_TOL)
  for n, x in sharded.items():
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, specs[n]), x.ndim), n


def _compiles(caplog: pytest.LogCaptureFixture) -> int:
  """How many XLA compilations `jax.log_compiles` has logged of TrainStep's programs."""
  said = [r.getMessage() for r in caplog.records]
  programs = ("Compiling jit(_step)", "Compiling jit(_accumulating)", "Compiling jit(_close)")
  return sum(m.startswith(programs) for m in said)


def test_train_step_recompiles_only_when_the_inputs_really_changed(caplog):
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Auto,))
  params = ref.mlp_params(0, SIZES)
  specs = _fsdp(mesh, params)
  micro = _batches(6)
  with jax.set_mesh(mesh):
    sharded = {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in params.items()}
    step = optax_accum.TrainStep(ref.mlp_loss, optax.sgd(0.1), 2, donate=False)
    state = step.init(sharded)
    caplog.set_level("WARNING")
    with jax.log_compiles(True):
      for x in micro[:4]:  # FSDP: the state from init is placed as every program leaves it
        sharded, state, _ = step(sharded, state, x)
      assert _compiles(caplog) == 2 and len(step._compiled) == 1  # the pair, once
      # Really other inputs (the parameters replicated): through jax.jit, this call only ...
      replicated = jax.device_put(sharded, NamedSharding(mesh, P()))
      step(replicated, state, micro[4])
      assert _compiles(caplog) == 3
      # ... while the compiled pair stays for the inputs it was made for: no new compile.
      for x in micro[4:]:
        sharded, state, _ = step(sharded, state, x)
    assert _compiles(caplog) == 3 and int(state.gradient_step) == 3
    assert all(v is not None for v in step._compiled.values())
  # Donated arrays passed again: a clear error naming the argument, before any program runs.
  # The state is donated on every call, the parameters on the call that updates them.
  donating = optax_accum.TrainStep(ref.mlp_loss, optax.sgd(0.1), 2)
  p = jax.tree.map(jnp.asarray, ref.mlp_params(0, SIZES))
  s = donating.init(p)
  same_p, new_s, _ = donating(p, s, micro[0])
  assert same_p is p and not any(x.is_deleted() for x in jax.tree.leaves(p))  # only read
  # (the first of the state's arrays the call donated; its position is only read)
  with pytest.raises(ValueError, match=r"TrainStep: state\.grad_sum\['b0'\] is a deleted array"):
    donating(p, s, micro[1])
  new_p, new_s, _ = donating(p, new_s, micro[1])  # the update: p donated
  with pytest.raises(ValueError, match=r"TrainStep: params\['b0'\] is a deleted array: it was"):
    donating(p, new_s, micro[2])
  assert jnp.isfinite(donating(new_p, new_s, micro[2])[2])


# ----------------------------------------------------------------------------------------------
# A 2-byte accumulator: accum_dtype=jnp.bfloat16, rounding="stochastic".

BF16_SR = dict(accum_dtype=jnp.bfloat16, rounding="stochastic")


def _window_sums(rounding, k=16, windows=8, n=4096):
  """Each window's sum in a bfloat16 accumulator (`rounding`), against float64: a first
  micro-batch of ~1, then k-1 of ~2⁻¹⁰, each below half a bfloat16 ulp of the sum (2⁻⁸), the
  case where rounding to nearest loses every addition."""
  rng = np.random.default_rng(5)
  tx = optax_accum.accumulate(optax.sgd(-1.0), k, reduction="sum", accum_dtype=jnp.bfloat16,
                              rounding=rounding)  # fmt: skip
  update = jax.jit(tx.update)
  params = jnp.zeros(n)
  state = tx.init(params)
  errors = []
  for _ in range(windows):
    grads = rng.uniform(1.0, 1.5, (k, n)).astype(np.float32)
    grads[1:] *= np.float32(2**-10)
    for g in grads:
      sums, state = update(jnp.asarray(g), state, params)
    errors.append(np.asarray(sums, np.float64) - grads.astype(np.float64).sum(0))
  return np.concatenate(errors)


def test_bf16_stochastic_rounding_accumulator_is_unbiased_against_float64():
  errors = _window_sums("stochastic")  # 8 windows x 4096 entries, independent draws
  se = errors.std() / np.sqrt(errors.size)
  tol = 3 * se  # 3 standard errors of the mean error (SE 8.3e-5); to nearest is ~70x further off
  assert abs(errors.mean()) < tol, (errors.mean(), se)
  # the control: round to nearest drops each small addition, a bias of -15 * 2⁻¹⁰ * 1.25
  nearest = _window_sums("nearest")
  assert nearest.mean() < -50 * tol, nearest.mean()


def test_bf16_stochastic_rounding_accumulator_takes_2_bytes_per_parameter(monkeypatch):
  # Both with the accumulating program on the whole state (a small model's lean convention
  # passes fewer scalars, `front_ends._lean`, and the rounding's extra operations could put
  # one model on each side of `FUSED_EMIT_MAX_OPS`).
  monkeypatch.setattr(optax_accum.front_ends._train_step, "FUSED_EMIT_MAX_OPS", 0)
  params = ref.mlp_params(0, SIZES)
  n = sum(x.size for x in jax.tree.leaves(params))
  x = _batches(1)[0]
  arguments = {}
  for name, kw in (("f32", {}), ("bf16", BF16_SR)):
    step = optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 4, **kw)
    state = step.init(params)
    assert {a.dtype for a in jax.tree.leaves(state.grad_sum)} == {
      jnp.dtype(jnp.bfloat16 if kw else jnp.float32)
    }
    arguments[name] = step.lower(params, state, x).compile().memory_analysis()
  f32, bf16 = arguments["f32"], arguments["bf16"]
  # everything else (parameters, Adam's moments, the gradient buffer, the batch) is the same
  assert f32.argument_size_in_bytes - bf16.argument_size_in_bytes == 2 * n
  assert f32.output_size_in_bytes - bf16.output_size_in_bytes == 2 * n


def test_bf16_stochastic_rounding_resumes_mid_window_bit_for_bit():
  micro = _batches(10)
  make = lambda: optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 4, **BF16_SR)  # noqa: E731
  straight = make()
  params = jax.tree.map(jnp.asarray, ref.mlp_params(0, SIZES))
  state = straight.init(params)
  for x in micro:
    params, state, _ = straight(params, state, x)
  first = make()
  p = jax.tree.map(jnp.asarray, ref.mlp_params(0, SIZES))
  s = first.init(p)
  for x in micro[:6]:  # stopped mid-window (2 of 4 micro-steps), saved to the host
    p, s, _ = first(p, s, x)
  p, s = jax.device_get((p, s))
  resumed = make()  # a new process's TrainStep, on the restored arrays
  p, s = jax.tree.map(jnp.asarray, (p, s))
  for x in micro[6:]:
    p, s, _ = resumed(p, s, x)
  chex.assert_trees_all_equal((p, s), (params, state))
  assert int(state.gradient_step) == 2 and int(state.mini_step) == 2


@pytest.mark.parametrize(
  ("kw", "said"),
  [
    (dict(rounding="up"), "rounding must be None, 'nearest' or 'stochastic', got 'up'"),
    (dict(rounding="stochastic"), "needs accum_dtype=jnp.bfloat16, got accum_dtype=float32"),
    (dict(rounding="nearest", accum_dtype=None), "must then be a real floating dtype"),
  ],
)
def test_rounding_bad_arguments(kw, said):
  with pytest.raises(ValueError, match=said):
    optax_accum.accumulate(optax.sgd(0.1), 2, **kw)
  with pytest.raises(ValueError, match=said):
    optax_accum.TrainStep(ref.mlp_loss, optax.sgd(0.1), 2, **kw)


# ----------------------------------------------------------------------------------------------
# The one-read accumulating program: skip_nonfinite="window".


def _users(instructions: list, name: str) -> list:
  """The instructions that take `name` as an operand."""
  token = re.compile(rf"%{re.escape(name)}[,)\s]")
  return [i for i in instructions if token.search(i.rest)]


def test_window_check_accumulating_program_reads_each_gradient_once():
  params = ref.mlp_params(0, SIZES)
  x = _batches(1)[0]
  shapes = {f"f32[{','.join(map(str, p.shape))}]" for p in params.values() if p.ndim == 2}
  users = {}
  for skip in (True, "window"):
    step = optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 4, skip_nonfinite=skip, grad_buffer=False)
    text = step.lower(params, step.init(params), x).compile().as_text()
    comps, entry = computations(text)
    body = comps[entry]
    grads = [i for i in body if i.op == "dot" and i.shape.split("{")[0] in shapes]
    assert len(grads) == 2, [(i.name, i.shape) for i in grads]  # the weight gradients
    users[skip] = {g.name: _users(body, g.name) for g in grads}
    if skip == "window":
      # The sums' parameters: `grad_sum`, or in the lean convention the first of the part
      # that the accumulating program writes (`front_ends._lean.operands`).
      sums = re.compile(r"grad_sum|part_0_")
      acc = {i.name: re.match(r"(\d+)\)", i.rest).group(1)
             for i in body if i.op == "parameter" and sums.search(i.name)}  # fmt: skip
      for g, (user,) in users[skip].items():  # one user: the add into the accumulator
        read = [a for a in acc if re.search(rf"%{re.escape(a)}[,)\s]", user.rest)]
        assert len(read) == 1, (g, user)
        index = acc[read[0]]  # ... which is donated: an output aliased with this input
        assert re.search(rf"\{{\d+\}}: \({index}, \{{\}}, may-alias\)", text), index
  # the control: the per-micro-batch check reads a gradient twice (its dot, then the add)
  assert any(len(u) == 2 for u in users[True].values()), users[True]


def _run_window_mode(step, micro, nan_at=None):
  params = jax.tree.map(jnp.asarray, ref.mlp_params(0, SIZES))
  state = step.init(params)
  for i, x in enumerate(micro):
    if i == nan_at:
      x = {**x, "x": x["x"].copy()}
      x["x"][0, 0] = np.nan
    params, state, _ = step(params, state, x)
  return params, state


def test_window_check_equals_the_per_micro_batch_check_and_drops_whole_windows():
  micro = _batches(8)
  make = lambda skip: optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 4, skip_nonfinite=skip)  # noqa: E731
  want, _ = _run_window_mode(make(True), micro)
  got, state = _run_window_mode(make("window"), micro)
  chex.assert_trees_all_equal(got, want)  # finite data: bit for bit
  assert int(state.num_skipped) == 0
  # A NaN in the second window: the whole window is dropped and its 4 micro-batches counted;
  # the result is the first window's update alone, and the third window goes on from it.
  got, state = _run_window_mode(make("window"), micro, nan_at=5)
  first, _ = _run_window_mode(make(True), micro[:4])
  chex.assert_trees_all_equal(got, first)
  assert (int(state.num_skipped), int(state.gradient_step)) == (4, 1)
  # The protocol path (emission decided on the device) does the same.
  tx = optax_accum.accumulate(ref.ADAM, 4, skip_nonfinite="window")
  params = jax.tree.map(jnp.asarray, ref.mlp_params(0, SIZES))
  opt = tx.init(params)
  update = jax.jit(tx.update)
  for i, x in enumerate(micro):
    grads = jax.grad(ref.mlp_loss)(params, x)
    if i == 5:
      grads = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
    updates, opt = update(grads, opt, params)
    params = optax.apply_updates(params, updates)
  chex.assert_trees_all_close(params, first, rtol=1e-6, atol=1e-7)
  assert (int(opt.num_skipped), int(opt.gradient_step)) == (4, 1)


def test_window_check_bad_value():
  with pytest.raises(ValueError, match="skip_nonfinite must be a bool or 'window', got 'x'"):
    optax_accum.TrainStep(ref.mlp_loss, optax.sgd(0.1), 2, skip_nonfinite="x")


# ----------------------------------------------------------------------------------------------
# noise_scale=True with skip_nonfinite="window": |g|² from the window's last micro-batch.

WINDOW_NOISE = dict(skip_nonfinite="window", noise_scale=True)


def _window_estimates(kw: dict, grads: jax.Array, weights: jax.Array, order: jax.Array):
  """One window's (T, Q) from `accumulate` (the device-decided protocol path), the micro-batches
  taken in `order`."""
  tx = optax_accum.accumulate(optax.identity(), grads.shape[0], **kw)

  def body(state, gw):
    return tx.update(gw[0], state, weight=gw[1])[1], None

  state, _ = lax.scan(body, tx.init(grads[0]), (grads[order], weights[order]))
  measured = optax_accum.noise_scale(state)
  return measured.window_trace_cov, measured.window_grad_sq


def test_window_noise_scale_is_unbiased_against_the_exact_estimator():
  """Over the order of a window's micro-batches (shuffled data), the one-read estimates of T and
  Q average to the exact estimator's: the last micro-batch is each one with probability 1/k."""
  k, n, seeds = 4, 256, 20000
  rng = np.random.default_rng(0)
  grads = jnp.asarray(0.3 + rng.normal(size=(k, n)), jnp.float32)  # signal 0.3, noise 1
  weights = jnp.asarray([1.0, 2.0, 3.0, 6.0])  # unequal: the estimate is n·w_k|g_k|²
  exact = _window_estimates(dict(noise_scale=True), grads, weights, jnp.arange(k))
  orders = jax.vmap(lambda key: jax.random.permutation(key, k))(
    jax.random.split(jax.random.key(1), seeds)
  )
  sampled = jax.jit(jax.vmap(lambda o: _window_estimates(WINDOW_NOISE, grads, weights, o)))(orders)
  for name, want, got in zip(("T", "Q"), exact, sampled, strict=True):
    got = np.asarray(got, np.float64)
    se = got.std() / np.sqrt(seeds)  # 3 SE of the mean, and the mean 2 % off must fail
    stats.check(got.mean(), float(want), se, name, stats.controls(se / abs(float(want))))
    assert got.std() > 0.1 * abs(float(want)), name  # a real sample, not the exact figure


def test_window_noise_scale_accumulating_program_reads_each_gradient_once():
  params = ref.mlp_params(0, SIZES)
  x = _batches(1)[0]
  shapes = {f"f32[{','.join(map(str, p.shape))}]" for p in params.values() if p.ndim == 2}
  step = optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 4, grad_buffer=False, **WINDOW_NOISE)
  state = step.init(params)
  for emit, users in ((False, 1), (True, 2)):  # the emitting program also reads |g_k|²
    body = (lambda c: c[0][c[1]])(computations(step.lower(params, state, x, emit=emit)
                                               .compile().as_text()))  # fmt: skip
    grads = [i for i in body if i.op == "dot" and i.shape.split("{")[0] in shapes]
    assert len(grads) == 2, [(i.name, i.shape) for i in grads]
    assert [len(_users(body, g.name)) for g in grads] == [users] * 2, emit
  # and it measures: the same windows as the protocol path with static emission
  micro = _batches(8)
  p = jax.tree.map(jnp.asarray, params)
  tx = optax_accum.accumulate(ref.ADAM, 4, **WINDOW_NOISE)
  update = jax.jit(tx.update, static_argnames="emit")
  opt = tx.init(p)
  for i, b in enumerate(micro):
    updates, opt = update(jax.grad(ref.mlp_loss)(p, b), opt, p, emit=i % 4 == 3)
    p = optax.apply_updates(p, updates)
  got_p, got = jax.tree.map(jnp.asarray, params), step.init(params)
  for b in micro:
    got_p, got, _ = step(got_p, got, b)
  want_ns, got_ns = optax_accum.noise_scale(opt), optax_accum.noise_scale(got)
  assert np.isfinite(float(got_ns.trace_cov))
  chex.assert_trees_all_close(got_ns, want_ns, rtol=1e-5)  # float32 rounding of two programs
  chex.assert_trees_all_close(got_p, p, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# The reduction overlapped with the last backward pass: TrainStep(axis_name=...)'s emitting
# program all-reduces the window leaf by leaf.

# XLA:CPU's own pass that merges independent all-reduces into one (`cpu-all-reduce-combiner`;
# older XLA: `all-reduce-combiner`):
# off, the compiled program shows the collectives as the library emits them, in the order the
# scheduler placed them. On by default, it makes them one all-reduce, the whole tree one bucket
# (XLA:GPU's combiner groups them up to --xla_gpu_all_reduce_combine_threshold_bytes).
UNCOMBINED = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner,all-reduce-combiner"}


def _data_parallel_step(mesh, **kw):
  with jax.set_mesh(mesh):
    step = optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, 4, axis_name="data", **kw)
    params = ref.mlp_params(0, SIZES)
    return step, params, step.init(params)


def _shape(instr) -> str:
  return instr.shape.split("{")[0]


@pytest.mark.parametrize("skip", [True, "window"])
def test_overlap_emitting_program_reduces_each_leaf_after_its_own_gradient(skip):
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Auto,))
  step, params, state = _data_parallel_step(mesh, skip_nonfinite=skip)
  x = _batches(1)[0]
  with jax.set_mesh(mesh):
    lowered = step.lower(params, state, x, emit=True)
    text = lowered.compile(compiler_options=UNCOMBINED).as_text()
    combined = lowered.compile().as_text()
  assert "is_scheduled=true" in text.splitlines()[0]  # instructions listed in their run order
  comps, entry = computations(text)
  body = comps[entry]
  leaf = {f"f32[{','.join(map(str, p.shape))}]": n for n, p in params.items()}
  # the per-device accumulator, stacked: f32[1,<leaf shape>] entry parameters, one per leaf
  acc = {i.name: leaf["f32[" + _shape(i)[6:]] for i in body
         if i.op == "parameter" and _shape(i).startswith("f32[1,")}  # fmt: skip
  assert sorted(acc.values()) == sorted(params), acc
  grads = {i.name: leaf[_shape(i)] for i in body
           if i.op == "dot" and _shape(i) in leaf and "," in _shape(i)}  # fmt: skip
  assert sorted(grads.values()) == ["w0", "w1"]  # the weight gradients' dots
  reductions = {i.name: leaf[_shape(i)] for i in body
                if i.op == "all-reduce" and _shape(i) in leaf}  # fmt: skip
  assert sorted(reductions.values()) == sorted(params)  # one per leaf, in the entry
  position = {i.name: n for n, i in enumerate(body)}
  for r, name in reductions.items():
    before = ancestors(body, r)
    # its own leaf's accumulator and gradient only: no other leaf's, no other all-reduce
    assert [acc[a] for a in before if a in acc] == [name], (name, before)
    assert all(grads[d] == name for d in before if d in grads), (name, before)
    assert not any(position[a] for a in before if a in reductions), name
  # The last layer's weight is reduced before the first layer's weight gradient (the last
  # backward op) is computed: in XLA:CPU's schedule it overlaps the rest of the backward pass.
  # (Where the scheduler puts the others is its choice: they depend on their own leaf only, as
  # checked above; with the per-micro-batch check it placed b1's just after, measured.)
  (last_backward,) = [d for d, n in grads.items() if n == "w0"]
  (w1,) = [r for r, n in reductions.items() if n == "w1"]
  assert position[w1] < position[last_backward], (position[w1], position[last_backward])
  assert last_backward not in ancestors(body, w1)
  # None in a loop; with a per-micro-batch check, the exact reduction in a conditional taken
  # only when a device dropped the last micro-batch (XLA:CPU's default compile: one bucket)
  assert count_collectives(text, where="loop") == 0
  n_branch = len(params) if skip is True else 0
  assert sum(b > 4 for b in _array_all_reduce_bytes(text, "cond")) == n_branch
  assert sum(b > 4 for b in _array_all_reduce_bytes(combined, "step")) == 1


def _array_all_reduce_bytes(text: str, where: str) -> list[int]:
  """Each all-reduce's bytes in the computations placed `where` (`_hlo.placements`)."""
  comps, entry = computations(text)
  placed = placements(comps, entry)[0]
  return [shape_bytes(i.shape) for c, instrs in comps.items() if placed.get(c) == where
          for i in instrs if i.op == "all-reduce"]  # fmt: skip


CONFIGS = {
  "default": (dict(), (3, 5)),  # NaN in the last micro-batch of window 1: the exact fallback
  "window": (dict(skip_nonfinite="window"), (5,)),  # window 2 dropped whole
  "noise_scale": (dict(noise_scale=True), (3,)),
  "bf16_stochastic": (BF16_SR, ()),
  "every_k_1": (dict(), (2,)),  # device 0 drops its piece, the 7 others' still update
  "window_noise": (WINDOW_NOISE, ()),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_overlap_is_bit_identical_to_the_closing_program(config, monkeypatch):
  kw, nan_at = CONFIGS[config]
  mesh = jax.make_mesh((D,), ("data",), axis_types=(AxisType.Auto,))
  micro = _batches(8)
  for i in nan_at:  # device 0's rows of this micro-batch: device 0 drops its piece
    micro[i] = {**micro[i], "x": micro[i]["x"].copy()}
    micro[i]["x"][0, 0] = np.nan
  k = 1 if config == "every_k_1" else 4
  runs = {}
  for overlap in (False, True):
    monkeypatch.setattr(optax_accum.front_ends._train_step, "OVERLAP_WITH_AXIS", overlap)
    with jax.set_mesh(mesh):
      step = optax_accum.TrainStep(ref.mlp_loss, ref.ADAM, k, axis_name="data", **kw)
      params = jax.tree.map(jnp.asarray, ref.mlp_params(0, SIZES))
      state = step.init(params)
      for x in micro:
        params, state, _ = step(params, state, x)
    runs[overlap] = jax.device_get((params, state))
    assert len(step._compiled[next(iter(step._compiled))]) == (1 if k == 1 else 2)
  chex.assert_trees_all_equal(runs[True], runs[False])
  state = runs[True][1]
  assert int(state.gradient_step) == {"window": 1, "every_k_1": 8}.get(config, 2)
  assert int(state.num_skipped.sum()) == {"window": 4 * D, "bf16_stochastic": 0}.get(
    config, len(nan_at)
  )  # window: every device counts the dropped window
