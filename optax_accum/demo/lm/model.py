"""A small causal byte-level transformer in Flax NNX, and its token-masked loss.

The training code is functional: `init` returns the model's graph and its parameters as a plain
nested dict of arrays (what optax, `optax_accum` and Orbax take), and `loss_fn` rebuilds the
module from them on each call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Config:
  """The transformer's shape."""

  seq_len: int = 128
  width: int = 64
  heads: int = 4
  layers: int = 2


def _modules(nnx):
  """The NNX module classes (built on first use: flax is an optional dependency)."""

  class Block(nnx.Module):
    """Pre-norm causal self-attention and a GELU MLP, each with a residual.

    No attention biases: the key bias's gradient is exactly zero (softmax ignores a constant
    shift), so float32 noise would be all Adam sees of it, turned into steps of ±lr.
    """

    def __init__(self, cfg: Config, rngs):
      d = cfg.width
      self.norm1 = nnx.LayerNorm(d, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(cfg.heads, d, use_bias=False, decode=False, rngs=rngs)
      self.norm2 = nnx.LayerNorm(d, rngs=rngs)
      self.up = nnx.Linear(d, 4 * d, rngs=rngs)
      self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, causal):
      x = x + self.attn(self.norm1(x), mask=causal)
      return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

  class ByteLM(nnx.Module):
    """Byte and position embeddings, `layers` blocks, a final norm and a 256-way head."""

    def __init__(self, cfg: Config, rngs):
      self.embed = nnx.Embed(VOCAB, cfg.width, rngs=rngs)
      self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.width)))
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
      self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
      self.head = nnx.Linear(cfg.width, VOCAB, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
      causal = nnx.make_causal_mask(tokens)
      for block in self.blocks:
        x = block(x, causal)
      return self.head(self.norm(x))

  return ByteLM


def init(cfg: Config, seed: int) -> tuple[Any, dict]:
  """The model's graph definition and its parameters (a nested dict of float32 arrays)."""
  from optax_accum.demo.lm import require  # noqa: PLC0415

  nnx = require("flax.nnx")
  build = lambda: _modules(nnx)(cfg, nnx.Rngs(seed))  # noqa: E731
  graphdef, _ = nnx.split(nnx.eval_shape(build))
  # One compiled program draws every initial value (eagerly, each draw would compile its own).
  params = jax.jit(lambda: nnx.to_pure_dict(nnx.split(build())[1]))()
  return graphdef, params


def apply(graphdef, params: dict, tokens: jax.Array) -> jax.Array:
  """The logits ``(..., seq_len, 256)`` for the input bytes `tokens` ``(..., seq_len)``."""
  from flax import nnx  # noqa: PLC0415  (init has checked it is installed)

  return nnx.merge(graphdef, params)(tokens)


def token_losses(graphdef, params, batch) -> tuple[jax.Array, jax.Array]:
  """The summed next-byte cross-entropy over the batch's real tokens, and their number."""
  tokens, mask = batch["tokens"], batch["mask"]
  logits = apply(graphdef, params, tokens[..., :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[..., 1:])
  return jnp.sum(ce * mask), jnp.sum(mask)


def loss_fn(graphdef):
  """``loss(params, batch)``: the mean cross-entropy over the batch's real (unpadded) tokens."""

  def loss(params, batch):
    total, count = token_losses(graphdef, params, batch)
    return total / jnp.maximum(count, 1.0)

  return loss


def real_tokens(*args) -> jax.Array:
  """The weight of a micro-batch: its number of real tokens (``weight_fn`` of the last arg)."""
  return jnp.sum(args[-1]["mask"])
