"""Poisson sampling: the sampler (seeded, reproducible, resumable, padded), and DP-SGD on
Poisson batches with padding, in one step and across steps, against the reference over the
sampled examples divided by the expected batch size."""

import math

import _reference as ref
import _stats as stats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_dp_clipping import assert_close, median_norm, reference_sum

import optax_accum as oa

N, Q, B = 200, 0.15, 8  # data set, sampling rate, micro-batch


def test_poisson_sampler_is_reproducible_and_resumable():
  a = oa.privacy.PoissonSampler(N, Q, B, seed=3)
  first = [next(a) for _ in range(6)]
  again = oa.privacy.PoissonSampler(N, Q, B, seed=3)
  assert all(np.array_equal(x.indices, y.indices) for x, y in zip(first, again, strict=False))
  resumed = oa.privacy.PoissonSampler(N, Q, B, seed=3, start=4)
  assert [b.step for b in (next(resumed), next(resumed))] == [4, 5]
  assert np.array_equal(resumed.batch(4).mask, first[4].mask)
  assert np.array_equal(a.batch(2).indices, first[2].indices)  # batch t: a function of t only
  other = oa.privacy.PoissonSampler(N, Q, B, seed=4).batch(0)
  assert not np.array_equal(other.indices, first[0].indices)


def test_poisson_sampler_pads_to_whole_microbatches():
  s = oa.privacy.PoissonSampler(N, Q, B, seed=0)
  for t in range(50):
    b = s.batch(t)
    assert b.indices.shape == b.mask.shape == (b.num_microbatches * B,)
    assert b.num_real == b.mask.sum()
    assert b.num_microbatches == max(1, math.ceil(b.num_real / B))
    assert len(set(b.indices[b.mask].tolist())) == b.num_real  # no example twice
    assert np.all(b.indices[~b.mask] == 0)


@pytest.mark.parametrize("split", ["contiguous", "strided"])
def test_poisson_sampler_fixed_shape_keeps_real_rows_in_first_microbatches(split):
  m = 8
  s = oa.privacy.PoissonSampler(N, Q, B, seed=1, max_microbatches=m, split=split)
  for t in range(30):
    b = s.batch(t)
    assert b.indices.shape == (m * B,)
    rows = b.mask.reshape(m, B) if split == "contiguous" else b.mask.reshape(B, m).T
    assert rows[b.num_microbatches :].sum() == 0  # micro-batch i is rows[i]
    assert rows[: b.num_microbatches].sum() == b.num_real
    assert b.num_microbatches == max(1, math.ceil(b.num_real / B))


def test_poisson_sampler_samples_at_rate_q():
  s = oa.privacy.PoissonSampler(N, Q, B, seed=5)
  steps = 3200
  counts = np.zeros(N)
  sizes = []
  for t in range(steps):
    b = s.batch(t)
    counts[b.indices[b.mask]] += 1
    sizes.append(b.num_real)
  # The mean batch size's standard error is √(Nq(1-q)/steps) = 0.30 % of qN: 3 SE, and the
  # control (the rate 2 % low or high, so the mean 2 % off) must fail the same check.
  se = math.sqrt(N * Q * (1 - Q) / steps)
  stats.check(float(np.mean(sizes)), Q * N, se, "mean batch size", stats.controls(se / (Q * N)))
  assert abs(np.var(sizes) / (N * Q * (1 - Q)) - 1) < 3 * math.sqrt(2 / steps)
  per_example_se = math.sqrt(Q * (1 - Q) / steps)
  # Every example at rate q (4.5 SE: 200 examples at once).
  assert np.all(np.abs(counts / steps - Q) < 4.5 * per_example_se)
  assert s.expected_batch_size == Q * N


def test_poisson_sampler_empty_draw_still_gives_one_microbatch():
  s = oa.privacy.PoissonSampler(10, 0.01, 4, seed=0)
  empty = next(b for b in map(s.batch, range(1000)) if b.num_real == 0)
  assert empty.num_microbatches == 1 and empty.indices.shape == (4,) and not empty.mask.any()


def test_poisson_sampler_refuses_to_truncate():
  s = oa.privacy.PoissonSampler(N, 0.5, B, seed=0, max_microbatches=2)
  with pytest.raises(ValueError, match=r"drew \d+ examples, more than max_microbatches=2 .*"):
    s.batch(0)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"num_examples": 0}, r"num_examples must be a positive int, got 0"),
    ({"sampling_rate": 0.0}, r"sampling_rate must be in \(0, 1\], got 0.0"),
    ({"sampling_rate": 1.2}, r"sampling_rate must be in \(0, 1\], got 1.2"),
    ({"sampling_rate": float("nan")}, r"sampling_rate must be in \(0, 1\], got nan"),
    ({"seed": -1}, r"seed must be an int >= 0, got -1"),
    ({"max_microbatches": 0}, r"max_microbatches must be a positive int, got 0"),
    ({"split": "random"}, r"split must be one of \('strided', 'contiguous'\), got 'random'"),
    ({"start": -2}, r"start must be an int >= 0, got -2"),
  ],
)
def test_poisson_sampler_rejects_bad_arguments(kwargs, match):
  args = dict(num_examples=N, sampling_rate=Q, microbatch_size=B, seed=0) | kwargs
  with pytest.raises(ValueError, match=rf"PoissonSampler: {match}"):
    oa.privacy.PoissonSampler(**args)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"num_examples": 200.0}, r"num_examples must be a positive int, got 200.0 of type float"),
    ({"num_examples": True}, r"num_examples must be a positive int, got True of type bool"),
    (
      {"sampling_rate": "0.1"},
      r"sampling_rate must be a number in \(0, 1\], got '0.1' of type str",
    ),
    ({"sampling_rate": True}, r"sampling_rate must be a number .* got True of type bool"),
    ({"sampling_rate": None}, r"sampling_rate must be a number .* got None of type NoneType"),
    ({"microbatch_size": 2.0}, r"microbatch_size must be a positive int, got 2.0 of type float"),
    ({"microbatch_size": "8"}, r"microbatch_size must be a positive int, got '8' of type str"),
    ({"seed": 1.5}, r"seed must be an int >= 0, got 1.5 of type float"),
    ({"seed": "0"}, r"seed must be an int >= 0, got '0' of type str"),
    ({"max_microbatches": 2.0}, r"max_microbatches must be a positive int, got 2.0 of type float"),
    ({"split": 1}, r"split must be one of \('strided', 'contiguous'\), got 1"),
    ({"start": 0.0}, r"start must be an int >= 0, got 0.0 of type float"),
  ],
)
def test_poisson_sampler_rejects_arguments_of_the_wrong_type(kwargs, match):
  args = dict(num_examples=N, sampling_rate=Q, microbatch_size=B, seed=0) | kwargs
  with pytest.raises(TypeError, match=rf"PoissonSampler: {match}"):
    oa.privacy.PoissonSampler(**args)


def test_poisson_sampler_takes_numpy_numbers():
  s = oa.privacy.PoissonSampler(np.int64(N), np.float32(0.5), np.int32(B), seed=np.int64(2))
  assert s.expected_batch_size == N * float(np.float32(0.5)) and s.batch(0).num_real > 0


# ----------------------------------------------------------------------------------------------
# DP-SGD on Poisson batches (σ = 0): the sum over the sampled examples / the expected size.


@pytest.fixture(scope="module")
def problem():
  params, data = ref.mlp_params(0), ref.regression_data(2, N)
  return params, data, median_norm(params, data)


def _expected(params, data, clip, batch):
  sampled = jax.tree.map(lambda v: v[batch.indices[batch.mask]], data)
  return jax.tree.map(lambda v: v / (Q * N), reference_sum(params, sampled, clip))


@pytest.mark.parametrize("split", ["contiguous", "strided"])
def test_dp_poisson_in_one_step_fixed_shape_matches_reference(problem, split):
  params, data, clip = problem
  m = 10
  sampler = oa.privacy.PoissonSampler(N, Q, B, seed=7, max_microbatches=m, split=split)
  tx = oa.privacy.dp_noise(
    0.0, clip, sampler.expected_batch_size, jax.random.key(77_000 + len(split))
  )
  cg = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=2)

  traces = []

  @jax.jit  # one compilation for every batch: fixed shapes, a device count of micro-batches
  def step(params, state, batch, mask, num_real):
    traces.append(1)
    summed = oa.microbatch(
      cg, m, batch_argnums=(1, 2), reduction="sum", split=split, num_real_microbatches=num_real
    )
    return tx.update(summed(params, batch, mask), state, params)

  state = tx.init(params)
  for t in range(4):
    b = sampler.batch(t)
    rows = jax.tree.map(lambda v, b=b: v[b.indices], data)
    updates, state = step(params, state, rows, b.mask, jnp.int32(b.num_microbatches))
    assert_close(updates, _expected(params, data, clip, b))
  assert len(traces) == 1
  assert int(oa.privacy.dp_updates(state)) == 4


def test_dp_poisson_across_steps_host_window_matches_reference(problem):
  params, data, clip = problem
  sampler = oa.privacy.PoissonSampler(N, Q, B, seed=8)
  inner = optax.chain(oa.privacy.dp_noise(0.0, clip, Q * N, jax.random.key(88_001)), optax.sgd(1.0))
  loss = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=2)
  # every_k: a cap above any window; the host closes each logical batch with force_emit.
  step = oa.TrainStep(loss, inner, every_k=1000, reduction="sum", donate=False)
  state = step.init(params)
  for t in range(3):
    b = sampler.batch(t)
    before = params
    for i in range(b.num_microbatches):
      idx, m = b.microbatch(i)  # micro-batch i in the batch's own layout
      mb = jax.tree.map(lambda v, idx=idx: v[idx], data)
      last = i == b.num_microbatches - 1
      params, state, _ = step(params, state, mb, m, force_emit=last)
    moved = jax.tree.map(lambda a, c: np.asarray(a, np.float64) - np.asarray(c), before, params)
    assert_close(moved, _expected(before, data, clip, b), rtol=1e-5)  # through p - (p - ĝ)
  assert int(oa.privacy.dp_updates(state)) == 3


def test_dp_poisson_two_devices_train_step_matches_reference(problem):
  params, data, clip = problem
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  sampler = oa.privacy.PoissonSampler(N, Q, B, seed=9)
  inner = optax.chain(oa.privacy.dp_noise(0.0, clip, Q * N, jax.random.key(99_001)), optax.sgd(1.0))
  loss = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=2)
  step = oa.TrainStep(
    loss, inner, every_k=1000, reduction="sum", donate=False, axis_name="data", mesh=mesh
  )
  state = step.init(params)
  for t in range(2):
    b = sampler.batch(t)
    before = params
    for i in range(b.num_microbatches):  # each device takes half of every micro-batch
      idx, m = b.microbatch(i)
      mb = jax.tree.map(lambda v, idx=idx: v[idx], data)
      last = i == b.num_microbatches - 1
      params, state, _ = step(params, state, mb, m, force_emit=last)
    moved = jax.tree.map(lambda a, c: np.asarray(a, np.float64) - np.asarray(c), before, params)
    assert_close(moved, _expected(before, data, clip, b), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Issue 34, item 11: the sampler's layout and microbatch's split must agree.

N11, Q11, B11, M11 = 520, 0.15, 8, 14  # ~78 sampled rows in up to 14 micro-batches of 8


def _item11_problem():
  params, data = ref.mlp_params(11), ref.regression_data(11, N11)
  return params, data, median_norm(params, jax.tree.map(lambda v: v[:64], data))


def _item11_step(cg, split=None):
  kw = {} if split is None else {"split": split}
  return lambda n: oa.microbatch(cg, M11, batch_argnums=(1, 2), num_real_microbatches=n, **kw)


def test_item11_old_mismatched_defaults_dropped_rows_now_raise_or_poison():
  """The issue's shape: PoissonSampler's old default layout ("contiguous") under microbatch's
  default split ("strided") runs the first n strided micro-batches, which hold only part of the
  real rows (the issue: 50 of 78, the clipped sum 53% off). Now a host mask and count raise
  naming split= on both, and a traced one (under jax.jit) gives NaN, never the partial sum."""
  params, data, clip = _item11_problem()
  old = oa.privacy.PoissonSampler(N11, Q11, B11, seed=3, max_microbatches=M11, split="contiguous")
  b = old.batch(0)
  rows = jax.tree.map(lambda v: v[b.indices], data)
  n = b.num_microbatches
  # What the mismatched run summed: the real rows of strided micro-batches 0..n-1.
  counted = b.mask & (np.arange(b.mask.size) % M11 < n)
  assert 0 < counted.sum() < b.num_real  # rows were silently left out
  full = reference_sum(params, jax.tree.map(lambda v: v[b.mask], rows), clip)
  partial = reference_sum(params, jax.tree.map(lambda v: v[counted], rows), clip)
  off = max(np.max(np.abs(full[k] - partial[k])) / np.max(np.abs(full[k])) for k in full)
  assert off > 0.2, off  # the error's shape: tens of percent (53% in the issue)

  cg = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=2)
  msg = rf"microbatch: {b.num_real - counted.sum()} of the batch's {b.num_real} real rows"
  with pytest.raises(ValueError, match=msg) as caught:
    _item11_step(cg)(n)(params, rows, b.mask)
  text = str(caught.value)
  assert "split='strided'" in text and "PoissonSampler(..., split='contiguous')" in text
  assert "there they all fit" in text  # it names the layout the batch was made for
  poisoned = jax.jit(lambda p, r, m, n: _item11_step(cg)(n)(p, r, m))(
    params, rows, b.mask, jnp.int32(n)
  )
  assert all(np.all(np.isnan(v)) for v in jax.tree.leaves(poisoned))


@pytest.mark.parametrize("split", [None, "contiguous"])
def test_item11_agreeing_splits_match_float64_clipped_sum(split):
  """Both defaults now agree ("strided"), and an explicit split given to both works: under
  jax.jit with a traced count, the clipped sum of every sampled row, against the float64
  per-example reference (2e-6 of its scale: float32 sums of ~80 terms)."""
  params, data, clip = _item11_problem()
  kw = {} if split is None else {"split": split}
  sampler = oa.privacy.PoissonSampler(N11, Q11, B11, seed=3, max_microbatches=M11, **kw)
  cg = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=2)
  step = jax.jit(lambda p, r, m, n: _item11_step(cg, split)(n)(p, r, m))
  for t in range(2):
    b = sampler.batch(t)
    assert b.split == (split or "strided")
    rows = jax.tree.map(lambda v, b=b: v[b.indices], data)
    got = step(params, rows, b.mask, jnp.int32(b.num_microbatches))
    sampled = jax.tree.map(lambda v, b=b: v[b.indices[b.mask]], data)
    assert_close(got, reference_sum(params, sampled, clip))
    # Host values: the check passes and the result is the same.
    assert_close(_item11_step(cg, split)(b.num_microbatches)(params, rows, b.mask), got)


@pytest.mark.parametrize("split", ["strided", "contiguous"])
def test_item11_poisson_batch_microbatch_rows_feed_a_host_loop(split):
  """Across steps, `PoissonBatch.microbatch(i)` gives micro-batch i in the batch's own layout:
  a TrainStep host loop over the first num_microbatches of them sums every sampled row (the
  float64 reference, through p - (p - ĝ): 1e-5)."""
  params, data, clip = _item11_problem()
  sampler = oa.privacy.PoissonSampler(N11, Q11, B11, seed=4, max_microbatches=M11, split=split)
  inner = optax.chain(
    oa.privacy.dp_noise(0.0, clip, Q11 * N11, jax.random.key(11_000 + len(split))),
    optax.sgd(1.0),
  )
  loss = oa.privacy.clipped_loss(ref.mlp_loss, clip, mask_argnum=2)
  step = oa.TrainStep(loss, inner, every_k=M11, reduction="sum", donate=False)
  state, before = step.init(params), params
  b = sampler.batch(0)
  seen = []
  for i in range(b.num_microbatches):
    idx, m = b.microbatch(i)
    seen.extend(idx[m])
    mb = jax.tree.map(lambda v, idx=idx: v[idx], data)
    params, state, _ = step(params, state, mb, m, force_emit=i == b.num_microbatches - 1)
  assert sorted(seen) == sorted(b.indices[b.mask])
  moved = jax.tree.map(lambda a, c: np.asarray(a, np.float64) - np.asarray(c), before, params)
  sampled = jax.tree.map(lambda v: v[b.indices[b.mask]], data)
  expected = jax.tree.map(lambda v: v / (Q11 * N11), reference_sum(before, sampled, clip))
  assert_close(moved, expected, rtol=1e-5)
  with pytest.raises(IndexError, match=r"PoissonBatch.microbatch: i must be an int in \[0, 14\)"):
    b.microbatch(14)


@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_item11_layout_check_inside_shard_map_over_8_devices(layout):
  """microbatch(axis_name) inside shard_map, a traced count: each device judges its own rows
  and one scalar all-reduce makes the verdict global, so the outputs stay replicated (out_specs
  P()). The sampler's default layout gives the float64 clipped sum; a contiguous one, NaN."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  params, data, clip = _item11_problem()
  sampler = oa.privacy.PoissonSampler(N11, Q11, B11, seed=5, max_microbatches=M11, split=layout)
  b = sampler.batch(0)
  rows = jax.tree.map(lambda v: v[b.indices], data)
  cg = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=2)

  def summed(p, r, m, n):
    return oa.microbatch(cg, M11, batch_argnums=(1, 2), axis_name="data", num_real_microbatches=n)(
      p, r, m
    )

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  pspec = jax.tree.map(lambda _: P(), params)
  specs = (pspec, jax.tree.map(lambda _: P("data"), rows), P("data"), P())
  step = jax.jit(jax.shard_map(summed, mesh=mesh, in_specs=specs, out_specs=pspec))
  got = step(params, rows, b.mask, jnp.int32(b.num_microbatches))
  if layout == "strided":
    sampled = jax.tree.map(lambda v: v[b.indices[b.mask]], data)
    assert_close(got, reference_sum(params, sampled, clip))
  else:
    assert all(np.all(np.isnan(v)) for v in jax.tree.leaves(got))
