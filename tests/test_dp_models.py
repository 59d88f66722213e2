"""DP-SGD on every model library (issue 31): Flax Linen, Flax NNX and Equinox modules.

Each model (a 3 → 8 → 2 tanh MLP) goes through every private front end with `dp_noise` at
σ = 0: `clipped_grad`, the gradient of `clipped_loss`, ``microbatch(clipped_grad, K,
reduction="sum")``, `accumulate(dp_noise, K, reduction="sum")` fed the gradients of
`clipped_loss`, and ``TrainStep(clipped_loss, chain(dp_noise, ...), K, reduction="sum")``. The
update must be the large-batch private update Σᵢ clip_C(∇ℓᵢ) / B computed directly: one
gradient per example (the library's own `jax.grad`, `eqx.filter_grad`), clipped and summed in
float64; to 2e-6 of its scale (float32 sums of 16 terms). C is the median per-example norm, so
half the examples are clipped. NNX modules go through as their `nnx.split` state, merged back in
the loss; Equinox modules whole (their activation functions are leaves that are not arrays).
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_dp_clipping import assert_close
from test_dp_layouts import Record, recorded

import optax_accum as oa
from optax_accum import privacy

N, K = 16, 2  # the logical batch B, and micro-batches (or micro-steps) per update


def _data():
  rng = np.random.default_rng(7)
  x = rng.standard_normal((N, 3)).astype(np.float32)
  y = rng.standard_normal((N, 2)).astype(np.float32)
  return x, y


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(jnp.tanh(nn.Dense(8)(x)))


def _sq_error(out, y):
  return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


@functools.cache
def model(kind):
  """``(params, loss, grad)``: what the front ends take, ``loss(params, x, y)``, and the
  library's own gradient of it (for the per-example reference)."""
  x, _ = _data()
  if kind == "linen":
    net = _Linen()
    params = net.init(jax.random.key(0), x)["params"]
    return params, lambda p, x, y: _sq_error(net.apply({"params": p}, x), y), jax.grad
  if kind == "nnx":
    rngs = nnx.Rngs(0)
    net = nnx.Sequential(nnx.Linear(3, 8, rngs=rngs), nnx.tanh, nnx.Linear(8, 2, rngs=rngs))
    graphdef, state = nnx.split(net)
    return state, lambda s, x, y: _sq_error(nnx.merge(graphdef, s)(x), y), jax.grad
  net = eqx.nn.MLP(3, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
  return net, lambda m, x, y: _sq_error(jax.vmap(m)(x), y), eqx.filter_grad


def _arrays(tree):
  return eqx.filter(tree, eqx.is_array)


def _flat(tree):
  """The floating arrays of a tree (a module, a state, a gradient with None holes) as float64."""
  return [np.asarray(v, np.float64) for v in jax.tree.leaves(_arrays(tree))]


@functools.cache
def reference(kind):
  """``(clip, Σᵢ clip_C(gᵢ) / B)``: a gradient per example, clipped and summed in float64."""
  params, loss, grad = model(kind)
  x, y = _data()
  g = jax.jit(grad(loss)) if kind != "equinox" else eqx.filter_jit(grad(loss))
  per = [_flat(g(params, x[i : i + 1], y[i : i + 1])) for i in range(N)]
  norms = [np.sqrt(sum(np.sum(v**2) for v in leaves)) for leaves in per]
  clip = float(np.median(norms))
  total = [np.zeros_like(v) for v in per[0]]
  for leaves, n in zip(per, norms, strict=True):
    for t, v in zip(total, leaves, strict=True):
      t += min(1.0, clip / n) * v
  return clip, [t / N for t in total]


def _noise(clip):
  return privacy.dp_noise(0.0, clip, float(N), jax.random.key(0), allow_key_reuse=True)


def _check(kind, update):
  _, expected = reference(kind)
  got = _flat(update)
  assert len(got) == len(expected) == 4  # two weights, two biases: nothing left out
  assert_close(got, expected)


def _filter_jit(kind, f):
  return eqx.filter_jit(f) if kind == "equinox" else jax.jit(f)


KINDS = ["linen", "nnx", "equinox"]


@pytest.mark.parametrize("kind", KINDS)
def test_dp_model_clipped_grad(kind):
  params, loss, _ = model(kind)
  clip, _ = reference(kind)
  tx = _noise(clip)
  f = privacy.clipped_grad(loss, clip, batch_argnums=(1, 2), mask_argnum=None)

  def step(p, x, y):
    g = f(p, x, y)
    return tx.update(_arrays(g), tx.init(_arrays(p)))[0]

  update = _filter_jit(kind, step)(params, *_data())
  _check(kind, update)
  grads = f(params, *_data())  # eager too; the structure of the parameters, None for functions
  assert jax.tree.structure(_arrays(grads)) == jax.tree.structure(_arrays(params))


@pytest.mark.parametrize("kind", KINDS)
def test_dp_model_clipped_loss_gradient(kind):
  params, loss, grad = model(kind)
  clip, _ = reference(kind)
  tx = _noise(clip)
  f = privacy.clipped_loss(loss, clip, batch_argnums=(1, 2), mask_argnum=None)

  def step(p, x, y):
    return tx.update(_arrays(grad(f)(p, x, y)), tx.init(_arrays(p)))[0]

  _check(kind, _filter_jit(kind, step)(params, *_data()))


@pytest.mark.parametrize("kind", KINDS)
def test_dp_model_microbatch_sum(kind):
  params, loss, _ = model(kind)
  clip, _ = reference(kind)
  tx = _noise(clip)
  summed = oa.microbatch(
    privacy.clipped_grad(loss, clip, batch_argnums=(1, 2), mask_argnum=None), K,
    batch_argnums=(1, 2), reduction="sum",
  )  # fmt: skip

  def step(p, x, y):
    return tx.update(_arrays(summed(p, x, y)), tx.init(_arrays(p)))[0]

  _check(kind, _filter_jit(kind, step)(params, *_data()))


@pytest.mark.parametrize("kind", KINDS)
def test_dp_model_accumulate_sum(kind):
  params, loss, grad = model(kind)
  clip, _ = reference(kind)
  tx = oa.accumulate(_noise(clip), K, reduction="sum")
  f = privacy.clipped_loss(loss, clip, batch_argnums=(1, 2), mask_argnum=None)

  def step(p, s, x, y):
    return tx.update(_arrays(grad(f)(p, x, y)), s, _arrays(p))

  step = _filter_jit(kind, step)
  state = tx.init(_arrays(params))
  x, y = _data()
  b = N // K
  for i in range(K):
    update, state = step(params, state, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
  _check(kind, update)
  assert int(privacy.dp_updates(state)) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_dp_model_train_step_sum(kind):
  params, loss, _ = model(kind)
  clip, _ = reference(kind)
  inner = optax.chain(_noise(clip), Record())
  step = oa.TrainStep(
    privacy.clipped_loss(loss, clip, batch_argnums=(1, 2), mask_argnum=None), inner, every_k=K,
    reduction="sum", donate=False,
  )  # fmt: skip
  state = step.init(params)
  x, y = _data()
  b = N // K
  p = params
  for i in range(K):
    p, state, _ = step(p, state, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
  _check(kind, recorded(state))
  assert int(privacy.dp_updates(state)) == 1
