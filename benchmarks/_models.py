"""The benchmark models: plain-JAX MLP and a small causal transformer, with synthetic data.

No Flax: each model is an `init(key) -> params` and a `loss(params, batch) -> scalar` (the mean
over the batch, so the loss of k equal micro-batches averaged is the loss of their union).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class Model:
  name: str
  init: Any  # key -> params
  loss: Any  # (params, batch) -> scalar mean loss
  batch: Any  # (key, n) -> batch pytree with leading axis n
  shape: str = ""  # what it is, for the report: "MLP 784-2048-2048-2048-10"


def mlp(sizes: tuple[int, ...], name: str = "mlp") -> Model:
  """A ReLU MLP classifier; `sizes` = (inputs, hidden..., classes)."""

  def init(key):
    params = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
      key, k = jax.random.split(key)
      params.append({"w": jax.random.normal(k, (a, b), jnp.float32) / a**0.5, "b": jnp.zeros(b)})
    return params

  def loss(params, batch):
    x, y = batch
    for i, p in enumerate(params):
      x = x @ p["w"] + p["b"]
      if i < len(params) - 1:
        x = jax.nn.relu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

  teacher = jax.random.normal(jax.random.key(99), (sizes[0], sizes[-1]))

  def batch(key, n):
    x = jax.random.normal(key, (n, sizes[0]), jnp.float32)
    y = jnp.argmax(x @ teacher, axis=-1).astype(jnp.int32)
    return x, y

  return Model(name, init, loss, batch, f"MLP {'-'.join(map(str, sizes))}")


def transformer(
  vocab: int, d: int, layers: int, heads: int, seq: int, name: str = "transformer"
) -> Model:
  """A pre-LayerNorm causal transformer LM (next-token cross-entropy)."""

  def dense(key, a, b):
    return jax.random.normal(key, (a, b), jnp.float32) / a**0.5

  def init(key):
    keys = iter(jax.random.split(key, 4 + 4 * layers))
    params = {
      "embed": jax.random.normal(next(keys), (vocab, d)) * 0.02,
      "pos": jax.random.normal(next(keys), (seq, d)) * 0.02,
      "ln_f": jnp.ones(d),
      "blocks": [],
    }
    for _ in range(layers):
      params["blocks"].append(
        {
          "ln1": jnp.ones(d),
          "qkv": dense(next(keys), d, 3 * d),
          "proj": dense(next(keys), d, d),
          "ln2": jnp.ones(d),
          "up": dense(next(keys), d, 4 * d),
          "down": dense(next(keys), 4 * d, d),
        }
      )
    return params

  def norm(x, g):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t = inputs.shape[1]
    x = params["embed"][inputs] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in params["blocks"]:
      h = norm(x, blk["ln1"]) @ blk["qkv"]
      q, k, v = jnp.split(h.reshape(*h.shape[:2], 3 * heads, d // heads), 3, axis=2)
      att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
      att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
      o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
      x = x + o @ blk["proj"]
      x = x + jax.nn.gelu(norm(x, blk["ln2"]) @ blk["up"]) @ blk["down"]
    logits = norm(x, params["ln_f"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def batch(key, n):
    # A learnable sequence: each token is the previous one plus a fixed stride, with noise.
    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (n, 1), 0, vocab)
    noise = jax.random.bernoulli(k2, 0.1, (n, seq + 1)).astype(jnp.int32)
    return ((start + 3 * jnp.arange(seq + 1)[None] + noise) % vocab).astype(jnp.int32)

  shape = f"transformer: vocab {vocab}, width {d}, {layers} layers, {heads} heads, {seq} tokens"
  return Model(name, init, loss, batch, shape)


def num_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def split(batch, k: int):
  """(k, n/k, ...) micro-batches of a batch with leading axis n (contiguous blocks)."""
  return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
