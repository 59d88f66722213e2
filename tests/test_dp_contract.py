"""The privacy contract (`optax_accum.privacy.CONTRACT`), enumerated row by row.

Each row that is kept (or made right) is measured as an adversary would: two neighbouring data
sets, D and D' = D plus one example, run through the front end with the row's option, with the
same noise key (σ > 0: the noise cancels in the difference); the released update may move by
at most C/B, i.e. ``‖Δupdate‖·B/C ≤ 1 + 1e-5`` (float32 rounding of sums of a few dozen terms
of size ~C/B: well under 1e-5). The added example's gradient norm is ~3000·C, so it is clipped
to exactly C and the bound is reached: the ratio must also be ≥ 0.99, so a test that measured
nothing would fail. Each refused row must raise its error (the full text of
`_checks.PRIVATE_REFUSED`) at construction or ``init`` — for a per-call argument at the first
call, before anything runs.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from optax_accum.core import _checks
from optax_accum.privacy import CONTRACT
from optax_accum.privacy._contract import MESSAGES

C, N, REAL, SIGMA, AX = 1.0, 48, 16, 0.5, "data"
B = float(N)  # the public expected batch size dp_noise divides by
STEPS = 3  # micro-steps (or micro-batches) of N / STEPS = 16 rows: one update

_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, 3)).astype(np.float32)
Y = _rng.normal(size=(N,)).astype(np.float32)
X[REAL], Y[REAL] = [30.0, -20.0, 10.0], 50.0  # the added example: gradient norm ~3000·C
P0 = {"w": np.array([0.1, -0.2, 0.3], np.float32), "b": np.zeros((), np.float32)}


def loss(p, x, y):
  r = x @ p["w"] + p["b"] - y
  return jnp.sum(0.5 * r**2)


def nan_valued_loss(p, x, y):
  """`loss` whose value is NaN where x[:, 0] < 0 (about half the rows); its gradient is
  `loss`'s (the NaN term does not depend on the parameters)."""
  return loss(p, x, y) + 0.0 * jnp.sum(jnp.log(x[:, 0]))


CLIPPED_LOSS = oa.privacy.clipped_loss(loss, C, batch_argnums=(1, 2), mask_argnum=3)
CLIPPED_GRAD = oa.privacy.clipped_grad(loss, C, batch_argnums=(1, 2), mask_argnum=3)
CLIPPED_SUM = jax.jit(lambda m: CLIPPED_GRAD(P0, X, Y, m))  # the whole batch at once


def mask(neighbour: bool, real: int = REAL) -> np.ndarray:
  """D: the first `real` rows are examples, the rest padding; D': also row `REAL`."""
  m = np.zeros(N, np.float32)
  m[:real] = 1
  m[REAL] = float(neighbour)
  return m


def noise(l2_clip=C):
  """σ > 0 with one key for both neighbours (allowed: the same run, rebuilt); `l2_clip` a
  number or the clipped function whose bound the noise follows. The key is concrete even where
  this is called under jax.jit (dp_noise refuses a traced one)."""
  with jax.ensure_compile_time_eval():
    key = jax.random.key(7)
  return oa.privacy.dp_noise(SIGMA, l2_clip, B, key, allow_key_reuse=True)


def inner(*middle, l2_clip=C):
  return optax.chain(noise(l2_clip), *middle, optax.sgd(1.0))


def micro_rows(steps: int = STEPS):
  return np.array_split(np.arange(N), steps)


def ratio(run) -> float:
  """‖run(D') − run(D)‖ · B / C, in float64 (`run` maps a mask to the released update, or to
  the parameters after it: sgd(1.0) on P0, which cancels in the difference)."""
  a, b = (run(mask(n)) for n in (False, True))
  leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  diff = [np.float64(u) - np.float64(v) for u, v in leaves]
  return float(np.sqrt(sum(np.sum(d**2) for d in diff))) * B / C


def _once(run):
  """`run` (jitted: one compilation serves both neighbours), checking that it made exactly one
  noisy update, counted for the accountant."""

  def checked(m):
    out, updates = run(m)
    assert int(updates) == 1, f"{int(updates)} noisy updates, not 1"
    return out

  return checked


# ----------------------------------------------------------------------------------------------
# The front ends, one update each, as functions of the mask.


def accumulate_run(*, k=STEPS, tx_kw=None, update_kw=None, grads=None, inner_tx=None, saved=False):
  """One window through a hand-written accumulate loop (`saved`: release the parameters and the
  whole state saved after the update, a checkpoint at the window boundary)."""
  tx = oa.accumulate(inner_tx or inner(), k, **{"reduction": "sum", **(tx_kw or {})})
  grad = grads or jax.grad(CLIPPED_LOSS)

  @jax.jit
  def window(m):
    state, p = tx.init(P0), P0
    for i, rows in enumerate(micro_rows()):
      g = grad(p, X[rows], Y[rows], m[rows])
      u, state = tx.update(g, state, p, **(update_kw(i) if update_kw else {}))
      p = optax.apply_updates(p, u)
    return ((p, state) if saved else p), oa.privacy.dp_updates(state)

  return _once(window)


def train_step_run(
  *, loss_fn=CLIPPED_LOSS, step_kw=None, call_kw=None, k=STEPS, l2_clip=C, saved=False
):
  """One TrainStep for both neighbours (its programs compile once); so it does not donate: a
  donated state would take dp_noise's own key buffer with it (`init` reuses it)."""
  kw = {"reduction": "sum", "donate": False, **(step_kw or {})}
  fresh = kw["donate"]  # a donating step: one per neighbour
  step = None if fresh else oa.TrainStep(loss_fn, inner(l2_clip=l2_clip), every_k=k, **kw)

  def window(m):
    s = oa.TrainStep(loss_fn, inner(l2_clip=l2_clip), every_k=k, **kw) if fresh else step
    state, p = s.init(P0), jax.tree.map(jnp.array, P0)
    for i, rows in enumerate(micro_rows()):
      p, state, _ = s(p, state, X[rows], Y[rows], m[rows], **(call_kw(i) if call_kw else {}))
    return ((p, state) if saved else p), oa.privacy.dp_updates(state)

  return _once(window)


def released(grads, l2_clip=C):
  """dp_noise's update of a clipped sum: the private release of `microbatch`'s output."""
  tx = noise(l2_clip)
  return tx.update(grads, tx.init(grads))[0]


def microbatch_run(*, fun=CLIPPED_GRAD, kw=None, pick=lambda out: out, k=STEPS):
  step = oa.microbatch(fun, k, batch_argnums=(1, 2, 3), **(kw or {}))
  return jax.jit(lambda m: released(pick(step(P0, X, Y, m))))


def mesh8(auto: bool = False):
  """8 host devices; `auto` for an Auto axis (jax.shard_map then lays out unplaced inputs)."""
  types = (jax.sharding.AxisType.Auto,) if auto else None
  return jax.make_mesh((8,), (AX,), axis_types=types)


def accumulate_shard_map_run():
  """accumulate(dp_noise, k, axis_name) inside jax.shard_map over 8 devices."""
  mesh = mesh8(auto=True)
  tx = oa.accumulate(inner(), STEPS, reduction="sum", axis_name=AX)
  grad = jax.grad(CLIPPED_LOSS)

  def micro(p, state, x, y, mk):
    u, state = tx.update(grad(lax.pcast(p, AX, to="varying"), x, y, mk), state, p)
    return optax.apply_updates(p, u), state

  pspec = jax.tree.map(lambda _: P(), P0)
  sspec = oa.state_partition_specs(tx, pspec, AX)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=(pspec,), out_specs=sspec)
  specs = (pspec, sspec, P(AX), P(AX), P(AX))
  step = jax.shard_map(micro, mesh=mesh, in_specs=specs, out_specs=(pspec, sspec))

  @jax.jit
  def window(m):
    p = P0
    state = init(p)
    for rows in micro_rows():
      p, state = step(p, state, X[rows], Y[rows], m[rows])
    return p, oa.privacy.dp_updates(state)

  return _once(window)


def microbatch_shard_map_run():
  summed = oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), axis_name=AX)
  pspec = jax.tree.map(lambda _: P(), P0)
  specs = (pspec, P(AX), P(AX), P(AX))
  f = jax.shard_map(summed, mesh=mesh8(auto=True), in_specs=specs, out_specs=pspec)
  return jax.jit(lambda m: released(f(P0, X, Y, m)))


def microbatch_bound_here_run():
  step = oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), axis_name=AX, mesh=mesh8())
  return jax.jit(lambda m: released(step(P0, X, Y, m)))


def data_parallel_run(**kw):
  concat = kw.get("varying") == "concat"
  clipped = oa.privacy.clipped_grad(
    loss, C, batch_argnums=(1, 2), mask_argnum=3, return_stats=concat
  )
  summed = oa.microbatch(clipped, STEPS, batch_argnums=(1, 2, 3), axis_name=AX)
  step = jax.jit(oa.data_parallel(summed, AX, batch_argnums=(1, 2, 3), mesh=mesh8(), **kw))

  def run(m):
    out = step(P0, X, Y, m)
    if concat:
      out, stats = out
      assert stats.norms.shape == (N,)  # the devices' per-example norms, joined (monitoring)
      assert float(stats.num_examples) == float(m.sum())
    return released(out)

  return run


def _model_sharded(run) -> float:
  """‖Δupdate‖·B/C on a (data, model) layout of `test_dp_layouts` (a tensor-parallel MLP, its
  hidden layer split over "model"): D has an example whose residual is zero (its gradient is
  0 up to rounding: absent), D' the same example with its target moved by 1e3 (its gradient is
  clipped to exactly C). The same noise key (σ = 0.5) for both: the noise cancels. `run` maps
  the two batches to their two updates (one compilation)."""
  import test_dp_layouts as lay  # noqa: PLC0415  (8-device tests only)

  params, batch, clip, expected = lay.problem()
  x = batch["x"][:1]
  h = np.tanh(np.float64(x) @ params["w0"] + params["b0"])
  target = (h @ params["w1"] + params["b1"]).astype(np.float32)
  neighbours = []
  for shift in (0.0, 1e3):
    y = batch["y"].copy()
    y[:1] = target + shift
    neighbours.append({**batch, "y": y})
  updates = run(neighbours)
  diff = [
    np.float64(a) - np.float64(b)
    for a, b in zip(jax.tree.leaves(updates[1]), jax.tree.leaves(updates[0]), strict=True)
  ]
  return float(np.sqrt(sum(np.sum(d**2) for d in diff))) * lay.N / clip


def _model_layouts(runs) -> float:
  """The largest ratio of several front ends on one layout; each must reach ≥ 0.99."""
  measured = [_model_sharded(run) for run in runs]
  assert min(measured) >= 0.99, measured
  return max(measured)


@functools.cache
def shard_map_data_model() -> float:
  import test_dp_layouts as lay  # noqa: PLC0415

  return _model_layouts([
    lambda batches, front=front: [
      update for update, _ in lay.run_shard_map((4, 2), front, 0.5, batches=batches)
    ]
    for front in ("microbatch", "accumulate")
  ])  # fmt: skip


@functools.cache
def jit_data_model() -> float:
  import test_dp_layouts as lay  # noqa: PLC0415

  return _model_layouts([
    lambda batches, kind=kind, front=front: lay.run_jit(kind, front, 0.5, batches=batches)
    for kind in ("auto", "explicit")
    for front in ("microbatch", "TrainStep")
  ])  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Rows that are kept or made right: what each measures (a configuration shared by several rows
# is measured once).


@functools.cache
def plain_accumulate() -> float:
  return ratio(accumulate_run())


@functools.cache
def plain_train_step() -> float:
  return ratio(train_step_run())


@functools.cache
def plain_microbatch() -> float:
  return ratio(microbatch_run(kw={"reduction": "sum"}))


@functools.cache
def shard_map_accumulate() -> float:
  return ratio(accumulate_shard_map_run())


@functools.cache
def shard_map_microbatch() -> float:
  return ratio(microbatch_shard_map_run())


@functools.cache
def train_step_data_parallel() -> float:
  return ratio(train_step_run(step_kw={"axis_name": AX, "mesh": mesh8()}))


@functools.cache
def microbatch_bound_here() -> float:
  return ratio(microbatch_bound_here_run())


@functools.cache
def data_parallel(**kw) -> float:
  return ratio(data_parallel_run(**kw))


def _empty_window():
  """accumulate: a window whose every micro-batch was dropped (non-finite gradients) still
  makes its noisy update, counted: the update of a window of zero gradients, the same noise."""
  updates = []
  for fill in (np.nan, 0.0):
    run = accumulate_run(grads=lambda p, x, y, m, f=fill: jax.tree.map(lambda a: a * 0 + f, p))
    updates.append(run(mask(True)))
  leaves = [jax.tree.leaves(u) for u in updates]
  assert all(np.all(np.isfinite(x)) for x in leaves[0])
  for a, b in zip(leaves[0], leaves[1], strict=True):
    np.testing.assert_array_equal(a, b)
  moved = [
    np.float64(a) - np.float64(b) for a, b in zip(leaves[0], jax.tree.leaves(P0), strict=True)
  ]
  assert max(np.max(np.abs(d)) for d in moved) > 0.1 * SIGMA * C / B  # the noise is there
  # ... and an all-padding window (D holds no example at all) against one example:
  run = accumulate_run()
  return ratio(lambda m: run(m * (np.arange(N) >= REAL)))


def _nan_valued_clipped_loss():
  return oa.privacy.clipped_loss(nan_valued_loss, C, batch_argnums=(1, 2), mask_argnum=3)


def _train_step_nan_loss_value():
  """A NaN loss value (half the rows) drops nothing: the update is the clean loss's."""
  run = train_step_run(loss_fn=_nan_valued_clipped_loss())
  clean = train_step_run()(mask(True))
  for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(run(mask(True))), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  return ratio(run)


def _microbatch_nan_loss_value():
  """microbatch(value_and_grad(clipped_loss)) with NaN loss values (default skip_nonfinite):
  every clipped gradient is kept (the value is NaN: honest); no micro-batch is dropped."""
  fun = jax.value_and_grad(_nan_valued_clipped_loss())
  step = jax.jit(oa.microbatch(fun, STEPS, batch_argnums=(1, 2, 3), return_info=True))
  (value, grads), info = step(P0, X, Y, mask(True))
  assert np.isnan(value) and int(info.num_skipped) == 0
  clean = CLIPPED_SUM(mask(True))
  for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(grads), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  return ratio(lambda m: released(step(P0, X, Y, m)[0][1]))


def _microbatch_default_reduction():
  """No reduction given: ClippedGrad's own ("sum"), not microbatch's "mean" (÷ k)."""
  step = jax.jit(oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3)))
  out, want = step(P0, X, Y, mask(True)), CLIPPED_SUM(mask(True))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(out), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  return ratio(lambda m: released(step(P0, X, Y, m)))


def num_real_run(reduction="sum"):
  """The last batch of an epoch, padded: D fills 1 micro-batch of 16, D' spills into a 2nd
  (a traced count: one compilation for both)."""

  def summed(m, n):
    step = oa.microbatch(
      CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), split="contiguous", reduction=reduction,
      num_real_microbatches=n,
    )  # fmt: skip
    return released(step(P0, X, Y, m))

  jitted = jax.jit(summed)
  return lambda m: jitted(m, jnp.int32(1 + int(m[REAL])))


def _keyed_run():
  def keyed_loss(p, x, y, key):
    return loss(p, x, y) + 0.0 * jax.random.normal(key)

  fun = oa.privacy.clipped_grad(keyed_loss, C, batch_argnums=(1, 2), mask_argnum=3)
  step = oa.microbatch(fun, STEPS, batch_argnums=(1, 2, 3), rng_argnums=4)
  return jax.jit(lambda m: released(step(P0, X, Y, m, jax.random.key(3))))


def _sized_contiguous_run():
  step = oa.microbatch(
    CLIPPED_GRAD, microbatch_size=16, batch_argnums=(1, 2, 3), split="contiguous"
  )
  return jax.jit(lambda m: released(step(P0, X, Y, m)))


def nan_grad_loss(p, x, y):
  """`loss` plus a term whose gradient (w.r.t. b) is NaN where x[:, 0] < 0 (about half the
  rows): those examples' clipped gradients count 0; the added example (x0 = 30) is finite."""
  return loss(p, x, y) + jnp.sum(jnp.sqrt(x[:, 0]) * p["b"])


def _window_skip_runs():
  """skip_nonfinite="window" on a private path, with examples whose gradients are NaN: the
  window's clipped sums are finite, so it is never dropped (`_once`: one noisy update)."""
  clipped = oa.privacy.clipped_loss(nan_grad_loss, C, batch_argnums=(1, 2), mask_argnum=3)
  skip = {"skip_nonfinite": "window"}
  acc = accumulate_run(tx_kw=skip, grads=jax.grad(clipped))
  step = train_step_run(loss_fn=clipped, step_kw=skip)
  return acc, step


def _rescaled(front: str) -> float:
  """rescale_to_unit_norm with C_r = 0.25 and dp_noise given the function: the update moves by
  at most 1/B (the bound 1), reached by the added example: ‖Δ‖·B/1 (`ratio` divides by C = 1)."""
  c_r = 0.25
  if front == "TrainStep":
    fn = oa.privacy.clipped_loss(
      loss, c_r, batch_argnums=(1, 2), mask_argnum=3, rescale_to_unit_norm=True
    )
    return ratio(train_step_run(loss_fn=fn, l2_clip=fn))
  fn = oa.privacy.clipped_grad(
    loss, c_r, batch_argnums=(1, 2), mask_argnum=3, rescale_to_unit_norm=True
  )
  step = oa.microbatch(fn, STEPS, batch_argnums=(1, 2, 3))
  return ratio(jax.jit(lambda m: released(step(P0, X, Y, m), fn)))


def _aux_values():
  """has_aux and return_values: the clipped sum released as before, the per-example values
  and aux beside it (monitoring), one row per example."""

  def aux_loss(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return jnp.sum(0.5 * r**2), r

  fn = oa.privacy.clipped_grad(
    aux_loss, C, batch_argnums=(1, 2), mask_argnum=3, has_aux=True, return_values=True
  )
  step = oa.microbatch(fn, STEPS, batch_argnums=(1, 2, 3))
  _, extra = step(P0, X, Y, mask(True))
  assert extra.values.shape == (N,) and extra.aux.shape == (N,)
  return ratio(jax.jit(lambda m: released(step(P0, X, Y, m)[0])))


def aux_loss(p, x, y):
  """`loss`, with each example's residual as its aux."""
  r = x @ p["w"] + p["b"] - y
  return jnp.sum(0.5 * r**2), r


def _clipped_aux_loss():
  return oa.privacy.clipped_loss(aux_loss, C, batch_argnums=(1, 2), mask_argnum=3, has_aux=True)


def _train_step_aux():
  """TrainStep(clipped_loss(..., has_aux=True), has_aux=True): the update is the plain clipped
  loss's, each micro-batch's aux (its residuals, padding 0) returned beside it."""
  fn = _clipped_aux_loss()
  step = oa.TrainStep(fn, inner(), STEPS, reduction="sum", has_aux=True, donate=False)
  state, p = step.init(P0), jax.tree.map(jnp.array, P0)
  rows = micro_rows()[0]
  _, _, (_, r) = step(p, state, X[rows], Y[rows], mask(True)[rows])
  want = np.where(mask(True)[rows] > 0, X[rows] @ P0["w"] + P0["b"] - Y[rows], 0)
  np.testing.assert_allclose(r, want, rtol=1e-6, atol=1e-6)
  return ratio(train_step_run(loss_fn=fn, step_kw={"has_aux": True}))


def _microbatch_aux_loss():
  """microbatch(value_and_grad(clipped_loss(..., has_aux=True), has_aux=True)) with the aux
  rows "concat": the clipped sum released as before, the rows beside it in batch order."""
  fun = jax.value_and_grad(_clipped_aux_loss(), has_aux=True)
  kw = {"reduction": (("sum", "concat"), "sum")}
  (_, r), _ = oa.microbatch(fun, STEPS, batch_argnums=(1, 2, 3), **kw)(P0, X, Y, mask(True))
  want = np.where(mask(True) > 0, X @ P0["w"] + P0["b"] - Y, 0)
  np.testing.assert_allclose(r, want, rtol=1e-6, atol=1e-6)
  return ratio(microbatch_run(fun=fun, kw=kw, pick=lambda out: out[1]))


def _layout_mismatch():
  """A contiguous layout (D' spills into micro-batch 1) under the strided split: the real rows
  of contiguous micro-batch 1 sit in strided micro-batches 1 and 2 — raises with host values,
  NaN traced; the agreeing split is `num_real_run`'s, measured."""
  strided = lambda n: oa.microbatch(  # noqa: E731
    CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), num_real_microbatches=n
  )
  with pytest.raises(ValueError, match="split="):
    strided(1)(P0, X, Y, mask(False))
  poisoned = jax.jit(lambda m, n: strided(n)(P0, X, Y, m))(mask(True), jnp.int32(2))
  assert all(np.all(np.isnan(v)) for v in jax.tree.leaves(poisoned))
  return ratio(num_real_run())


def _replace_one() -> float:
  """Replace-one neighbours: D' is D with example REAL replaced by one whose clipped gradient
  points (almost) the other way (x negated): the update moves by up to 2C/B, the relation's
  sensitivity; measured ‖Δ‖·B/(2C) (the b component keeps the two from being exactly opposite:
  1 − 1/(2‖x‖²) ≈ 0.9996 of the bound)."""
  x2 = X.copy()
  x2[REAL] = -X[REAL]
  summed = oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3))
  step = jax.jit(lambda x, m: released(summed(P0, x, Y, m)))
  a, b = (jax.tree.leaves(step(x, mask(True))) for x in (X, x2))
  diff = [np.float64(u) - np.float64(v) for u, v in zip(a, b, strict=True)]
  return float(np.sqrt(sum(np.sum(d**2) for d in diff))) * B / (2 * C)


def _bf16_microbatch():
  """bfloat16 parameters through microbatch(clipped_grad): the sums stay float32 until the
  noise, so the released update moves by at most C/B."""
  summed = oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3))
  out = summed(BF16, X, Y, mask(True))
  assert {v.dtype for v in jax.tree.leaves(out)} == {jnp.dtype(jnp.float32)}
  return ratio(jax.jit(lambda m: released(summed(BF16, X, Y, m))))


def _shared_table():
  """clipped_grad(..., shared_argnums=(3,)): a public table of the batch's size, the same for
  every example (declared), passed whole; the labels split: the sensitivity is kept."""
  table = np.linspace(0.0, 1.0, N).astype(np.float32)

  def table_loss(p, x, y, t):
    return loss(p, x, y) + jnp.mean(t) * jnp.sum(p["w"] ** 2)

  fn = oa.privacy.clipped_grad(
    table_loss, C, batch_argnums=(1, 2), shared_argnums=(3,), mask_argnum=4
  )
  step = oa.microbatch(fn, STEPS, batch_argnums=(1, 2, 4))
  return ratio(jax.jit(lambda m: released(step(P0, X, Y, table, m))))


def _mechanism_take():
  """privacy.Mechanism with a PoissonSampler: a batch in which example 0 is sampled, the host
  loop feeding ``batch.take(x, y, microbatch=i)`` (rows and mask) to mech.train_step; D' has
  example 0 (an outlier), D has it absent (a zero row): ‖Δ‖·B/C with the sampler's B."""
  n, b = 64, 8
  sampler = oa.privacy.PoissonSampler(n, 0.25, b, seed=5)
  batch = next(
    sampler.batch(t) for t in range(100) if 0 in sampler.batch(t).indices[sampler.batch(t).mask]
  )
  rng = np.random.default_rng(6)
  xs, ys = rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n,)).astype(np.float32)
  params = []
  for present in (False, True):
    x, y = xs.copy(), ys.copy()
    x[0], y[0] = ([30.0, -20.0, 10.0], 50.0) if present else (0.0, 0.0)
    mech = oa.privacy.Mechanism(
      loss, C, sampler=sampler, key=jax.random.key(5005), noise_multiplier=SIGMA,
      batch_argnums=(1, 2), allow_key_reuse=True,
    )  # fmt: skip
    step = mech.train_step(optax.sgd(1.0), every_k=8, donate=False)
    state, p = step.init(P0), jax.tree.map(jnp.array, P0)
    for i in range(batch.num_microbatches):
      last = i == batch.num_microbatches - 1
      p, state, _ = step(p, state, *batch.take(x, y, microbatch=i), force_emit=last)
    assert int(oa.privacy.dp_updates(state)) == 1
    params.append(p)
  diff = [np.float64(u) - np.float64(v) for u, v in zip(*map(jax.tree.leaves, params), strict=True)]
  return float(np.sqrt(sum(np.sum(d**2) for d in diff))) * mech.expected_batch_size / C


def _window_by_every_k():
  """Mechanism.train_step fed a Poisson batch's micro-batches without force_emit: the window
  every_k would close is refused before it runs."""
  sampler = oa.privacy.PoissonSampler(N, 1 / 6, 4, seed=0)
  mech = oa.privacy.Mechanism(loss, C, sampler=sampler, key=jax.random.key(5006),
                              noise_multiplier=SIGMA, batch_argnums=(1, 2))  # fmt: skip
  step = mech.train_step(optax.sgd(1.0), every_k=1, donate=False)
  step(P0, step.init(P0), *sampler.batch(0).take(X, Y, microbatch=0))


def _batch_statistic():
  """A loss normalising with the mean over the data axis (sync BatchNorm), clipped per device
  in shard_map over 8 devices."""

  def synced(p, x, y):
    return loss(p, x - lax.pmean(jnp.mean(x, axis=0), AX), y)

  clipped = oa.privacy.clipped_grad(synced, C, batch_argnums=(1, 2), mask_argnum=3)
  pspec = jax.tree.map(lambda _: P(), P0)
  mesh = jax.make_mesh((8,), (AX,), axis_types=(jax.sharding.AxisType.Auto,))
  run = jax.shard_map(clipped, mesh=mesh, in_specs=(pspec, P(AX), P(AX), P(AX)), out_specs=pspec)
  jax.jit(run)(P0, X, Y, mask(True))


def _resumed():
  """Two updates uninterrupted, and the same two with the state saved after the first and
  dp_noise rebuilt on the same key (allow_key_reuse=True): identical; the saved state holds no
  key (the count only); the resumed second update moves by at most C/B."""
  key = jax.random.key(6006)

  def two_updates(m, resume):
    tx = oa.privacy.dp_noise(SIGMA, C, B, key, allow_key_reuse=True)
    g = CLIPPED_SUM(m)
    _, state = tx.update(g, tx.init(g))
    saved = jax.device_get(state)
    assert saved._fields == ("count",) and int(saved.count) == 1
    if resume:
      tx = oa.privacy.dp_noise(SIGMA, C, B, key, allow_key_reuse=True)
    return tx.update(g, saved)[0]

  first, second = (jax.tree.leaves(two_updates(mask(True), r)) for r in (False, True))
  for a, b in zip(first, second, strict=True):
    np.testing.assert_array_equal(a, b)
  return ratio(lambda m: two_updates(m, True))


def _saved_at_boundary(front: str) -> float:
  """The parameters and the whole optimizer state saved right after the update (a checkpoint at
  a window boundary), released together: accumulate's device conditional and update(emit=),
  TrainStep. Before: TrainStep's state kept the window's un-noised clipped sums (48.0 here),
  accumulate's a copy of the update it wrote over them (1.41 by this measure); each must reach
  the bound, the largest is returned."""
  if front == "TrainStep":
    runs = [train_step_run(saved=True)]
  else:
    emit = {"update_kw": lambda i: {"emit": i == STEPS - 1}}
    runs = [accumulate_run(saved=True), accumulate_run(saved=True, **emit)]
  measured = [ratio(run) for run in runs]
  assert min(measured) >= 0.99, measured
  return max(measured)


def _unpadded() -> float:
  """clipped_grad(..., mask_argnum=None) on batches without padding: D holds the real rows
  only, D' one row more."""
  clipped = oa.privacy.clipped_grad(loss, C, batch_argnums=(1, 2), mask_argnum=None)
  return ratio(lambda m: released(clipped(P0, X[m > 0], Y[m > 0])))


def _injected():
  """The learning rate injected around the noise-first chain (the noise built once, outside the
  factory, which optax calls again on every update)."""
  built = noise()
  tx = optax.inject_hyperparams(lambda learning_rate: optax.chain(built, optax.sgd(learning_rate)))
  return ratio(accumulate_run(inner_tx=tx(learning_rate=1.0)))


SENSITIVITY = {
  "microbatch:fun=clipped_grad(...), bfloat16 parameters": _bf16_microbatch,
  "clipped_grad:shared_argnums": _shared_table,
  "PoissonSampler:Mechanism: batch.take(x, y), the mask with the rows": _mechanism_take,
  "dp_noise:the state saved, dp_noise rebuilt with allow_key_reuse=True": _resumed,
  "accumulate:inner=chain(dp_noise(...), ...)": plain_accumulate,
  "accumulate:inner=inject_hyperparams(lambda lr: chain(dp_noise(...), ...))": _injected,
  "accumulate:every_k=int": plain_accumulate,
  "accumulate:every_k=schedule": lambda: ratio(
    accumulate_run(k=lambda step: jnp.where(step == 0, STEPS, 5))
  ),
  'accumulate:reduction="sum"': plain_accumulate,
  "accumulate:accum_dtype=float32": lambda: ratio(accumulate_run(tx_kw={"accum_dtype": None})),
  "accumulate:skip_nonfinite=True": plain_accumulate,
  "accumulate:skip_nonfinite=False": lambda: ratio(accumulate_run(tx_kw={"skip_nonfinite": False})),
  'accumulate:skip_nonfinite="window"': lambda: ratio(_window_skip_runs()[0]),
  'TrainStep:skip_nonfinite="window"': lambda: ratio(_window_skip_runs()[1]),
  "TrainStep:loss_fn=clipped_loss(..., rescale_to_unit_norm=True)": lambda: _rescaled("TrainStep"),
  "microbatch:fun=clipped_grad(..., rescale_to_unit_norm=True)": lambda: _rescaled("microbatch"),
  "microbatch:fun=clipped_grad(..., has_aux=True, return_values=True)": _aux_values,
  "microbatch:fun=value_and_grad(clipped_loss(..., has_aux=True), has_aux=True)": (
    _microbatch_aux_loss
  ),
  "TrainStep:loss_fn=clipped_loss(..., has_aux=True), has_aux=True": _train_step_aux,
  "microbatch:num_real_microbatches, rows laid out for the other split": _layout_mismatch,
  'dp_epsilon:neighboring_relation="replace_one"': _replace_one,
  "accumulate:empty window": _empty_window,
  'accumulate:axis_name="data"': shard_map_accumulate,
  "accumulate:update(force_emit=...)": lambda: ratio(
    accumulate_run(k=STEPS + 2, update_kw=lambda i: {"force_emit": i == STEPS - 1})
  ),
  "accumulate:the state saved right after an update (a window boundary)": lambda: (
    _saved_at_boundary("accumulate")
  ),
  "TrainStep:the state saved right after an update (a window boundary)": lambda: _saved_at_boundary(
    "TrainStep"
  ),
  "clipped_grad:mask_argnum=None": _unpadded,
  "accumulate:update(emit=...)": lambda: ratio(
    accumulate_run(update_kw=lambda i: {"emit": i == STEPS - 1})
  ),
  "TrainStep:loss_fn=clipped_loss(...)": plain_train_step,
  "TrainStep:skip_nonfinite=True": _train_step_nan_loss_value,
  "TrainStep:step(..., force_emit=True)": lambda: ratio(
    train_step_run(k=STEPS + 2, call_kw=lambda i: {"force_emit": i == STEPS - 1})
  ),
  "TrainStep:donate=True, grad_buffer=True": lambda: ratio(
    train_step_run(step_kw={"donate": True, "grad_buffer": True})
  ),
  'TrainStep:axis_name="data", mesh': train_step_data_parallel,
  "microbatch:fun=clipped_grad(...)": plain_microbatch,
  "microbatch:fun=value_and_grad(clipped_loss(...))": lambda: ratio(
    microbatch_run(fun=jax.value_and_grad(CLIPPED_LOSS), pick=lambda out: out[1])
  ),
  "microbatch:reduction omitted": _microbatch_default_reduction,
  'microbatch:reduction="sum"': plain_microbatch,
  'microbatch:reduction="stack" / "last"': lambda: min(
    ratio(microbatch_run(kw={"reduction": "stack"})), ratio(num_real_run("last"))
  ),
  "microbatch:num_real_microbatches": lambda: ratio(num_real_run()),
  "microbatch:skip_nonfinite": _microbatch_nan_loss_value,
  'microbatch:split="contiguous", microbatch_size': lambda: ratio(_sized_contiguous_run()),
  "microbatch:batch_argnums": plain_microbatch,
  "microbatch:rng_argnums": lambda: ratio(_keyed_run()),
  "microbatch:return_info=True": lambda: ratio(
    microbatch_run(kw={"return_info": True}, pick=lambda out: out[0])
  ),
  'microbatch:axis_name="data"': lambda: min(shard_map_microbatch(), microbatch_bound_here()),
  'data_parallel:sync="update"': lambda: data_parallel(sync="update"),
  'data_parallel:sync="microbatch"': lambda: data_parallel(sync="microbatch"),
  'data_parallel:varying="concat"': lambda: data_parallel(varying="concat"),
  "layout:one device": lambda: min(plain_accumulate(), plain_train_step(), plain_microbatch()),
  'layout:shard_map over ("data",)': lambda: min(shard_map_accumulate(), shard_map_microbatch()),
  'layout:plain jit, mesh ("data",)': lambda: min(
    train_step_data_parallel(), microbatch_bound_here(), data_parallel(sync="update")
  ),
  'layout:shard_map over ("data", "model")': shard_map_data_model,
  'layout:plain jit, mesh ("data", "model")': jit_data_model,
  'layout:plain jit, FSDP: keep_unsharded="nothing" / "params" / "params_and_grads"': (
    lambda: fsdp_keep_unsharded()
  ),
}


@functools.cache
def fsdp_keep_unsharded() -> float:
  """microbatch and TrainStep with each keep_unsharded point on 8 devices (1-D FSDP, Explicit):
  the weight (padded to 8 entries with zero features, so the loss is the same) sharded over
  "data". Each run must reach the bound (≥ 0.99); the largest is returned."""
  mesh = jax.make_mesh((8,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,))
  x8 = np.pad(X, ((0, 0), (0, 5)))
  rows = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P(AX)))  # noqa: E731
  measured = []
  with jax.set_mesh(mesh):
    params = {"w": rows(np.pad(P0["w"], (0, 5))), "b": jax.device_put(P0["b"])}
    for keep in ("nothing", "params", "params_and_grads"):
      step = jax.jit(oa.microbatch(
        CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), axis_name=AX, keep_unsharded=keep
      ))  # fmt: skip
      measured.append(
        ratio(lambda m, step=step: released(step(params, rows(x8), rows(Y), rows(m))))
      )

      def window(m, keep=keep):
        s = oa.TrainStep(CLIPPED_LOSS, inner(), every_k=STEPS, reduction="sum", donate=False,
                         axis_name=AX, keep_unsharded=keep)  # fmt: skip
        state, p = s.init(params), params
        for r in micro_rows():
          p, state, _ = s(p, state, rows(x8[r]), rows(Y[r]), rows(m[r]))
        return p, oa.privacy.dp_updates(state)

      measured.append(ratio(_once(window)))
  assert min(measured) >= 0.99, measured
  return max(measured)


# ----------------------------------------------------------------------------------------------
# Refused rows: what each builds (it must raise before anything runs).

BF16 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), P0)


def _gain():
  return oa.scale_by_gain(1.0, base_weight=16.0)


def _accumulate_weight():
  tx = oa.accumulate(inner(), STEPS, reduction="sum")
  tx.update(P0, tx.init(P0), P0, weight=2.0)


def _train_step_weight():
  step = oa.TrainStep(CLIPPED_LOSS, inner(), every_k=STEPS, reduction="sum")
  rows = micro_rows()[0]
  step(jax.tree.map(jnp.array, P0), step.init(P0), X[rows], Y[rows], mask(True)[rows], weight=2.0)


def _microbatch(**kw):
  return lambda: oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), **kw)


def _train_step(**kw):
  kw = {"every_k": STEPS, "reduction": "sum", **kw}
  return lambda: oa.TrainStep(CLIPPED_LOSS, inner(), **kw)


def _rescaled_clip_noise():
  rescaled = oa.privacy.clipped_grad(loss, 0.41, rescale_to_unit_norm=True, mask_argnum=None)
  try:
    oa.privacy.dp_noise(SIGMA, 0.41, B, jax.random.key(41))
  finally:
    del rescaled


def _raise_each(*runs):
  """Runs each `run`; each must raise a ValueError (one row refused on several front ends);
  re-raises the last (the row's own test matches it)."""
  last = None
  for run in runs:
    try:
      run()
    except ValueError as e:
      last = e
    else:
      raise AssertionError(f"{run} was not refused")
  raise last


def _before_noise(front):
  """Something before dp_noise: scale_by_adam, scale_by_rms, scale(10.), masked, inside
  inject_hyperparams' chain — each refused at init."""
  firsts = [optax.scale_by_adam(), optax.scale_by_rms(), optax.scale(10.0)]
  inners = [optax.chain(f, noise(), optax.sgd(1.0)) for f in firsts]
  inners.append(optax.chain(optax.masked(noise(), {"w": True, "b": False}), optax.sgd(1.0)))
  if front == "accumulate":
    runs = [lambda i=i: oa.accumulate(i, STEPS, reduction="sum").init(P0) for i in inners]
  else:
    runs = [
      lambda i=i: oa.TrainStep(CLIPPED_LOSS, i, STEPS, reduction="sum").init(P0) for i in inners
    ]
  _raise_each(*runs)


def _accumulate_bf16_grads():
  tx = oa.accumulate(inner(), STEPS, reduction="sum")
  tx.update(BF16, tx.init(BF16), BF16)


def _force_emit_unmasked():
  unmasked = oa.privacy.clipped_loss(loss, C, batch_argnums=(1, 2), mask_argnum=None)
  step = oa.TrainStep(unmasked, inner(), STEPS + 2, reduction="sum", donate=False)
  rows = micro_rows()[0]
  step(jax.tree.map(jnp.array, P0), step.init(P0), X[rows], Y[rows], force_emit=True)


def _unsplit_microbatch():
  """microbatch(..., batch_argnums=(1, 3)) leaves the labels whole: refused; inside
  data_parallel (the labels replicated, the global batch) too."""
  alone = lambda: oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 3))(P0, X, Y, mask(True))  # noqa: E731
  summed = oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), axis_name=AX)
  dp = oa.data_parallel(summed, AX, batch_argnums=(1, 3), mesh=mesh8())
  _raise_each(lambda: dp(P0, X, Y, mask(True)), alone)


def _captured():
  """The labels bound by functools.partial, and captured by a closure under jit."""
  bound = oa.privacy.clipped_grad(functools.partial(loss, y=Y), C, mask_argnum=2)
  closure = jax.jit(
    lambda x, y, m: oa.privacy.clipped_grad(lambda p, xb: loss(p, xb, y), C, mask_argnum=2)(
      P0, x, m
    )
  )
  _raise_each(lambda: bound(P0, X, mask(True)), lambda: closure(X, Y, mask(True)))


def _captured_microbatch():
  """The logical batch's labels captured by the loss of the clipped function microbatch runs
  (its micro-batches are a third of their size)."""
  clipped = oa.privacy.clipped_grad(lambda p, x: loss(p, x, Y), C, mask_argnum=2)
  oa.microbatch(clipped, STEPS, batch_argnums=(1, 2))(P0, X, mask(True))


def _unsplit_clipped_loss():
  """clipped_loss(loss, C, mask_argnum=3): the labels (argument 2) not split, through TrainStep
  and accumulate."""
  fn = oa.privacy.clipped_loss(loss, C, mask_argnum=3)
  rows = micro_rows()[0]
  train = oa.TrainStep(fn, inner(), STEPS, reduction="sum", donate=False)
  tx = oa.accumulate(inner(), STEPS, reduction="sum")
  _raise_each(
    lambda: tx.update(jax.grad(fn)(P0, X[rows], Y[rows], mask(True)[rows]), tx.init(P0), P0),
    lambda: train(jax.tree.map(jnp.array, P0), train.init(P0), X[rows], Y[rows], mask(True)[rows]),
  )


def _unchecked_map(fn, specs, out):
  mesh = jax.make_mesh((4, 2), (AX, "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False))


def _clipped_without_variance():
  summed = oa.microbatch(CLIPPED_GRAD, STEPS, batch_argnums=(1, 2, 3), axis_name=AX)
  pspec = jax.tree.map(lambda _: P(), P0)
  run = _unchecked_map(summed, (pspec, P(AX), P(AX), P(AX)), pspec)
  pmapped = jax.pmap(lambda x, y, m: CLIPPED_GRAD(P0, x, y, m), axis_name=AX)
  _raise_each(
    lambda: pmapped(X.reshape(8, 6, 3), Y.reshape(8, 6), mask(True).reshape(8, 6)),
    lambda: run(P0, X, Y, mask(True)),
  )


def _noise_without_variance():
  tx = noise()
  run = _unchecked_map(lambda g: tx.update(g, tx.init(g))[0], P("model"), P("model"))
  run(jnp.zeros(8))


def _key_drawn_before():
  """A "notebook cell" run twice: the first run's dp_noise is gone (collected), the key not."""
  import gc  # noqa: PLC0415

  def cell():
    tx = oa.privacy.dp_noise(SIGMA, C, B, jax.random.key(40_005))
    return tx.update(P0, tx.init(P0))[0]

  cell()
  gc.collect()
  cell()


def _key_traced():
  """A whole run jitted with the key an argument, and a sweep vmapped over keys."""

  def run(key):
    tx = oa.privacy.dp_noise(SIGMA, C, B, key)
    return tx.update(P0, tx.init(P0))[0]

  keys = jax.random.split(jax.random.key(40_006))
  _raise_each(lambda: jax.jit(run)(keys[0]), lambda: jax.vmap(run)(keys))


REFUSALS = {
  "accumulate:inner=chain(<anything>, dp_noise(...), ...)": lambda: _before_noise("accumulate"),
  "TrainStep:inner=chain(<anything>, dp_noise(...), ...)": lambda: _before_noise("TrainStep"),
  "accumulate:gradients narrower than float32 (bfloat16 parameters)": _accumulate_bf16_grads,
  "TrainStep:loss_fn=clipped_loss(...), no dp_noise in inner": lambda: oa.TrainStep(
    CLIPPED_LOSS, optax.sgd(1.0), STEPS, reduction="sum"
  ).init(P0),
  "TrainStep:dp_noise in inner, loss_fn not clipped": lambda: oa.TrainStep(
    loss, inner(), STEPS, reduction="sum"
  ).init(P0),
  "TrainStep:bfloat16 parameters": lambda: oa.TrainStep(
    CLIPPED_LOSS, inner(), STEPS, reduction="sum"
  ).init(BF16),
  "TrainStep:step(..., force_emit=True), loss_fn with mask_argnum=None": _force_emit_unmasked,
  "microbatch:an argument with the batch's size not in batch_argnums": _unsplit_microbatch,
  "microbatch:num_real_microbatches, fun with mask_argnum=None": lambda: oa.microbatch(
    oa.privacy.clipped_grad(loss, C, batch_argnums=(1, 2), mask_argnum=None),
    STEPS,
    batch_argnums=(1, 2),
    num_real_microbatches=2,
  ),
  "clipped_grad:an argument with the batch's size not in batch_argnums": lambda: oa.microbatch(
    oa.privacy.clipped_grad(loss, C, mask_argnum=3), STEPS, batch_argnums=(1, 2, 3)
  )(P0, X, Y, mask(True)),
  "clipped_loss:an argument with the batch's size not in batch_argnums": _unsplit_clipped_loss,
  "clipped_grad:a loss capturing an array with the batch's size (closure, partial)": _captured,
  "microbatch:fun whose loss captures the whole batch (closure, partial)": _captured_microbatch,
  "clipped_loss:differentiated for parameters narrower than float32": lambda: jax.grad(
    CLIPPED_LOSS
  )(BF16, X[:16], Y[:16], mask(True)[:16]),
  "clipped_grad:inside shard_map(check_vma=False) or pmap": _clipped_without_variance,
  "clipped_grad:a psum or pmean over the batch's axis in the loss (sync BatchNorm)": (
    _batch_statistic
  ),
  "TrainStep:Mechanism.train_step: a window that every_k closes, not force_emit": (
    _window_by_every_k
  ),
  "dp_noise:inside shard_map(check_vma=False) or pmap": _noise_without_variance,
  "dp_noise:a key drawn from before in this process": _key_drawn_before,
  "dp_noise:a traced key (built under jax.jit or jax.vmap)": _key_traced,
  "clipped_grad:mask_argnum not given": lambda: oa.privacy.clipped_grad(
    loss, C, batch_argnums=(1, 2)
  ),
  "clipped_loss:mask_argnum not given": lambda: oa.privacy.clipped_loss(
    loss, C, batch_argnums=(1, 2)
  ),
  "dp_noise:l2_clip=C for clipped_grad/clipped_loss(..., rescale_to_unit_norm=True)": (
    _rescaled_clip_noise
  ),
  'dp_epsilon:neighboring_relation="replace_one", accountant="rdp"': lambda: oa.privacy.dp_epsilon(
    10, 0.1, 1.0, 1e-5, neighboring_relation="replace_one"
  ),
  "accumulate:inner holding scale_by_gain": lambda: oa.accumulate(
    inner(_gain()), STEPS, reduction="sum"
  ).init(P0),
  "accumulate:every_k=FollowNoiseScale(...)": lambda: oa.accumulate(
    inner(), oa.FollowNoiseScale(min_k=2), reduction="sum"
  ).init(P0),
  'accumulate:reduction="mean"': lambda: oa.accumulate(inner(), STEPS).init(P0),
  "accumulate:accum_dtype narrower than float32": lambda: oa.accumulate(
    inner(), STEPS, reduction="sum", accum_dtype=None
  ).init(BF16),
  "accumulate:noise_scale=True": lambda: oa.accumulate(
    inner(), STEPS, reduction="sum", noise_scale=True
  ).init(P0),
  "accumulate:update(weight=...)": _accumulate_weight,
  "TrainStep:inner holding scale_by_gain": lambda: oa.TrainStep(
    CLIPPED_LOSS, inner(_gain()), STEPS, reduction="sum", noise_scale=False
  ).init(P0),
  "TrainStep:every_k=FollowNoiseScale(...)": _train_step(every_k=oa.FollowNoiseScale(min_k=2)),
  'TrainStep:reduction="mean"': lambda: oa.TrainStep(CLIPPED_LOSS, inner(), STEPS),
  "TrainStep:accum_dtype narrower than float32": lambda: oa.TrainStep(
    CLIPPED_LOSS, inner(), STEPS, reduction="sum", accum_dtype=jnp.bfloat16
  ).init(BF16),
  "TrainStep:weight_fn": _train_step(weight_fn=lambda x, y, m: jnp.sum(m)),
  "TrainStep:step(..., weight=...)": _train_step_weight,
  "TrainStep:noise_scale=True": _train_step(noise_scale=True),
  'microbatch:reduction="mean"': _microbatch(reduction="mean"),
  "microbatch:weight_fn": _microbatch(weight_fn=lambda p, x, y, m: jnp.sum(m)),
  "microbatch:noise_scale": _microbatch(noise_scale=0),
  "microbatch:state_argnums": _microbatch(state_argnums=4, state_out=lambda out: out),
  "microbatch:accum_dtype narrower than float32": _microbatch(accum_dtype=jnp.bfloat16),
}


def _error_text(row) -> str:
  """The row's full error, less the caller (`accumulate.init`, `TrainStep`, ...), as a regular
  expression: the template's text exactly, each of its fields (a dtype, an argument's
  position, a key's data) any text."""
  text = MESSAGES[row.error].split("{caller}: ", 1)[1].replace("{ON}", "on a private path")
  parts = re.split(r"\{[a-z_]+\}", text)
  return ".+?".join(re.escape(part) for part in parts)


# ----------------------------------------------------------------------------------------------
# The tests.


def test_every_row_of_the_contract_has_its_test():
  ids = [row.id for row in CONTRACT]
  assert len(ids) == len(set(ids)), "two rows with the same front end and option"
  refused = {row.id for row in CONTRACT if row.verdict == "refused"}
  others = {row.id for row in CONTRACT if row.verdict in ("kept", "made right")}
  assert {row.verdict for row in CONTRACT} <= {"kept", "made right", "refused"}
  assert set(REFUSALS) == refused
  assert set(SENSITIVITY) == others
  assert all((row.error is None) == (row.verdict != "refused") for row in CONTRACT)
  assert {row.front for row in CONTRACT} >= {"accumulate", "TrainStep", "microbatch"}
  assert {row.front for row in CONTRACT} >= {"data_parallel", "layout"}


# Rows measured on 8 devices (a few compilations each): slow tier, still run by CI.
MULTI_DEVICE = ("axis_name", "data_parallel", "layout:shard_map", "layout:plain jit")


@pytest.mark.parametrize(
  "row",
  [
    pytest.param(r, marks=[pytest.mark.slow] if any(m in r.id for m in MULTI_DEVICE) else [])
    for r in CONTRACT
    if r.verdict != "refused"
  ],
  ids=lambda r: r.id,
)
def test_kept_row_moves_the_update_by_at_most_c_over_b(row):
  measured = SENSITIVITY[row.id]()
  assert measured <= 1 + 1e-5, f"{row.id}: one example moved the update by {measured:.4f}·C/B"
  assert measured >= 0.99, f"{row.id}: the added example did not reach the update ({measured})"


@pytest.mark.parametrize("row", [r for r in CONTRACT if r.verdict == "refused"], ids=lambda r: r.id)
def test_refused_row_raises_before_training(row):
  with pytest.raises(ValueError, match=_error_text(row)) as caught:
    REFUSALS[row.id]()
  assert str(caught.value).split(":")[0].split(".")[0] == row.front  # the front end named


def test_mean_on_a_private_path_would_have_leaked():
  """Why "mean" is refused: the same neighbours through microbatch's "mean", forced past the
  check by hiding the function's privacy, move the update by far more than C/B."""
  hidden = lambda *args: CLIPPED_GRAD(*args)  # noqa: E731 — not recognised as private

  @jax.jit
  def run(m, n):
    step = oa.microbatch(
      hidden, STEPS, batch_argnums=(1, 2, 3), split="contiguous", num_real_microbatches=n
    )
    return released(jax.tree.map(lambda g: g * STEPS, step(P0, X, Y, m)))  # "mean"·k

  assert ratio(lambda m: run(m, jnp.int32(1 + int(m[REAL])))) > 3.0


def test_train_step_finds_dp_noise_at_init_whatever_the_loss():
  """A loss that is not recognised as clipped: the dp_noise in the inner chain is found by
  init (before any step), and "mean" is refused there."""
  step = oa.TrainStep(lambda p, x, y, m: CLIPPED_LOSS(p, x, y, m), inner(), STEPS)
  with pytest.raises(ValueError, match=re.escape("TrainStep.init: reduction='mean'")):
    step.init(P0)
  weighted = oa.TrainStep(
    lambda p, x, y, m: CLIPPED_LOSS(p, x, y, m), inner(), STEPS, reduction="sum",
    weight_fn=lambda x, y, m: jnp.sum(m),
  )  # fmt: skip
  with pytest.raises(ValueError, match=re.escape("TrainStep.init: weight_fn on a private")):
    weighted.init(P0)


def test_a_path_without_dp_noise_or_clipping_keeps_every_option():
  """The contract binds private paths only: the same options elsewhere are untouched."""
  tx = oa.accumulate(optax.sgd(1.0), STEPS, noise_scale=True)
  _, state = tx.update(P0, tx.init(P0), P0, weight=2.0)
  assert float(state.acc_weight) == 2.0 and int(state.noise.count) == 1  # weighed and measured
  step = oa.microbatch(
    jax.grad(loss), STEPS, batch_argnums=(1, 2), weight_fn=lambda p, x, y: 1.0,
    noise_scale=lambda out: out,
  )  # fmt: skip
  grads, info = step(P0, X, Y)  # a sum loss: each micro-batch's sum, averaged (equal weights)
  whole = jax.grad(loss)(P0, X, Y)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(whole), strict=True):
    np.testing.assert_allclose(got, want / STEPS, rtol=1e-5, atol=1e-5)
  assert float(info.total_weight) == STEPS and info.noise is not None


def test_private_recognition_is_one_way_and_sees_through_wrappers():
  import functools

  assert _checks.private_fun(CLIPPED_GRAD) and _checks.private_fun(CLIPPED_LOSS)
  assert _checks.private_fun(jax.value_and_grad(CLIPPED_LOSS))
  assert _checks.private_fun(functools.partial(jax.grad(CLIPPED_LOSS)))
  assert not _checks.private_fun(jax.grad(loss))

  def declared(p, x):
    return x

  declared.__dp_private__ = True
  assert _checks.private_fun(declared)
  assert _checks.holds_private_state(jax.eval_shape(inner().init, P0))
  assert not _checks.holds_private_state(optax.adam(1.0).init(P0))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_clipped_loss_refuses_a_2_byte_accumulator_without_dp_noise_in_the_chain(rounding):
  """A clipped loss alone makes the path private: `TrainStep.init` refuses a bfloat16
  accumulator (`rounding=` takes `accum_dtype` literally) even when `dp_noise` is not in the
  inner chain (it may be applied elsewhere)."""
  step = oa.TrainStep(
    CLIPPED_LOSS, optax.sgd(1.0), STEPS, reduction="sum", accum_dtype=jnp.bfloat16,
    rounding=rounding,
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"TrainStep\.init: accum_dtype=bfloat16 on a private"):
    step.init(P0)
