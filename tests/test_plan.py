"""Tests for `plan_microbatches`: its choice is checked against independently compiled peaks."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_accum import microbatch, plan_microbatches
from optax_accum.core._hlo import peak_bytes as compiled_peak_bytes


def _loss(w, x):
  h = x
  for _ in range(6):
    h = jnp.tanh(h @ w)
  return jnp.mean(h**2)


_VG = jax.value_and_grad(_loss)
# Activation-dominated: 2048 examples × 6 layers of width 128 against one 128×128 weight. Shapes
# only: nothing is allocated or run.
W = jax.ShapeDtypeStruct((128, 128), jnp.float32)
X = jax.ShapeDtypeStruct((2048, 128), jnp.float32)


def _peak(k, *args, **kwargs):
  compiled = jax.jit(microbatch(_VG, k, **kwargs)).lower(*(args or (W, X))).compile()
  return compiled_peak_bytes(compiled)


def test_plan_picks_smallest_k_that_fits():
  p2, p4 = _peak(2), _peak(4)
  assert p4 < p2
  limit = (p2 + p4) // 2
  plan = plan_microbatches(_VG, W, X, memory_limit=limit)
  assert plan.num_microbatches == 4
  assert plan.memory_limit == limit
  assert plan.peak_bytes[4] == p4 <= limit  # it fits ...
  assert plan.peak_bytes[2] == p2 > limit  # ... and the next smaller divisor does not
  assert len(plan.peak_bytes) < 6  # 12 divisors of 2048: it did not compile them all


def test_plan_peak_is_arguments_outputs_and_temporaries():
  compiled = jax.jit(microbatch(_VG, 8)).lower(W, X).compile()
  m = compiled.memory_analysis()
  want = (
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )
  assert compiled_peak_bytes(compiled) == want
  assert want >= X.size * 4 + W.size * 4  # at least the arguments


def test_plan_large_budget_compiles_only_k1_and_prints():
  plan = plan_microbatches(_VG, W, X, memory_limit=2**40)
  assert plan.num_microbatches == 1 and list(plan.peak_bytes) == [1]
  text = str(plan)
  assert "num_microbatches=1" in text and "k=1" in text and "fits" in text
  assert "MicrobatchPlan(num_microbatches=1" in repr(plan)


def test_plan_budget_too_small_raises_with_smallest_peak():
  x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  with pytest.raises(ValueError, match="too small for any num_microbatches") as info:
    plan_microbatches(_VG, W, x, memory_limit=1000)
  found = re.search(
    r"smallest compiled peak was (\d+) bytes .* at num_microbatches=(\d+)", str(info.value)
  )
  assert found, str(info.value)
  peak, k = int(found.group(1)), int(found.group(2))
  assert peak == _peak(k, W, x) > 1000


def _masked_loss(w, x, mask):
  h = x
  for _ in range(6):
    h = jnp.tanh(h @ w)
  return jnp.sum(jnp.mean(h**2, axis=-1) * mask) / jnp.sum(mask)


def test_plan_passes_microbatch_options_and_accepts_arrays():
  # Real arrays, and options that every compiled candidate must see: `batch_argnums=(1, 2)`
  # (without it the mask would not be split and the program would not trace) and a weight_fn
  # that records the micro-batch size it was traced with. The budget lies between the peaks of
  # k=1 and k=2, so the search must compile candidates beyond k=1.
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(128, 128)) / 12, jnp.float32)
  x = jnp.asarray(rng.normal(size=(2048, 128)), jnp.float32)
  mask = jnp.asarray(rng.random(2048) < 0.8, jnp.float32)
  seen = []

  def weight_fn(w, x, m):
    seen.append(x.shape[0])
    return jnp.sum(m)

  options = dict(batch_argnums=(1, 2), weight_fn=weight_fn)
  vg = jax.value_and_grad(_masked_loss)
  p1, p2 = (_peak_with(vg, k, (w, x, mask), options) for k in (1, 2))
  assert p2 < p1
  seen.clear()
  plan = plan_microbatches(vg, w, x, mask, memory_limit=(p1 + p2) // 2, **options)
  assert plan.num_microbatches == 2
  assert plan.peak_bytes[1] == p1 and plan.peak_bytes[2] == p2
  assert set(seen) == {2048 // k for k in plan.peak_bytes}  # weight_fn reached every candidate


def _peak_with(fun, k, args, options):
  return compiled_peak_bytes(jax.jit(microbatch(fun, k, **options)).lower(*args).compile())


def test_plan_without_limit_on_cpu_says_pass_one():
  if jax.local_devices()[0].memory_stats():
    pytest.skip("this device reports a memory limit")  # GPU/TPU: covered by the next test
  with pytest.raises(ValueError, match=r"reports none \(CPU devices never do\). Pass the budget"):
    plan_microbatches(_VG, W, X)


def test_plan_uses_device_limit_when_reported(monkeypatch):
  class Device:
    platform = "fake"

    def memory_stats(self):
      return {"bytes_limit": 2**40}

  monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
  plan = plan_microbatches(_VG, W, X)
  assert plan.memory_limit == 2**40 and plan.num_microbatches == 1


def test_plan_reads_keyword_batch_along_its_axis():
  # The batch as a keyword argument, batch-minor: the same candidates and peaks as compiling
  # microbatch(...) directly with those arguments.
  def loss(w, *, xt):
    return _loss(w, xt.T)

  vg = jax.value_and_grad(loss)
  xt = jax.ShapeDtypeStruct((128, 2048), jnp.float32)
  options = dict(batch_argnames="xt", batch_axes=1)

  def peak(k):
    step = jax.jit(microbatch(vg, k, **options))
    return compiled_peak_bytes(step.lower(W, xt=xt).compile())

  p2, p4 = peak(2), peak(4)
  assert p4 < p2
  plan = plan_microbatches(vg, W, kwargs={"xt": xt}, memory_limit=(p2 + p4) // 2, **options)
  assert plan.num_microbatches == 4
  assert plan.peak_bytes[4] == p4 and plan.peak_bytes[2] == p2


def test_plan_with_num_real_microbatches_only_tries_k_that_holds_them():
  plan = plan_microbatches(_VG, W, X, memory_limit=2**40, split="strided", num_real_microbatches=3)
  assert plan.num_microbatches == 4  # the smallest divisor of 2048 that holds 3 micro-batches
  assert list(plan.peak_bytes) == [4]
  assert plan.peak_bytes[4] == _peak(4, split="strided", num_real_microbatches=3)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(memory_limit=-1), ValueError, "memory_limit must be positive bytes, got -1"),
    (dict(memory_limit="1GB"), TypeError, "memory_limit must be a number of bytes or None"),
    (dict(memory_limit=True), TypeError, "memory_limit must be a number of bytes or None"),
    (dict(memory_limit=2**30, num_microbatches=2), TypeError, "num_microbatches is what it"),
    (dict(memory_limit=2**30, microbatch_size=8), TypeError, "microbatch_size is what it chooses"),
    (dict(memory_limit=2**30, num_real_microbatches=4096), ValueError, "more than the batch size"),
    (dict(memory_limit=2**30, batch_argnums=3), ValueError, "batch_argnums contains 3"),
  ],
)
def test_plan_rejects_bad_input(kwargs, error, match):
  with pytest.raises(error, match=match):
    plan_microbatches(_VG, W, X, **kwargs)


def test_plan_choice_of_k1_keeps_output_shapes():
  # Issue 17: k=1 was a separate path, so a plan choosing k=1 changed a per-micro-batch
  # output's shape (() instead of (k,)) and an integer mean's dtype. Every k has one contract.
  def fun(w, x):
    return _loss(w, x), jnp.sum(x > 0), jnp.tanh(x @ w), jnp.mean(x)

  kw = dict(reduction=("mean", "mean", "concat", "stack"))
  plan = plan_microbatches(fun, W, X, memory_limit=2**40, **kw)
  assert plan.num_microbatches == 1
  one, two = (jax.eval_shape(microbatch(fun, k, **kw), W, X) for k in (1, 2))
  assert [(o.shape[1:] if i == 3 else o.shape, o.dtype) for i, o in enumerate(one)] == [
    (t.shape[1:] if i == 3 else t.shape, t.dtype) for i, t in enumerate(two)
  ]
  assert one[3].shape == (1,) and one[1].dtype == jnp.float32
