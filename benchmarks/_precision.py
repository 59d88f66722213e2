"""Precision: k bfloat16 gradients accumulated with a bf16 vs a float32 accumulator.

The gradients are synthetic but shaped like real ones: a small mean signal under larger
per-micro-batch noise. The reference is their exact mean in float64 (numpy, from the very
bf16 values the contenders see). Every contender returns a bf16 mean, so the floor is the
rounding of the exact mean to bf16; an fp32 accumulator should sit on that floor, a bf16 one
drifts away from it as k grows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_accum


def _grads(k: int, n: int, seed: int = 0) -> jax.Array:
  key1, key2 = jax.random.split(jax.random.key(seed))
  signal = 0.1 * jax.random.normal(key1, (n,))
  noise = jax.random.normal(key2, (k, n))
  return (signal + noise).astype(jnp.bfloat16)


def _scan_updates(tx, grads):
  """Feeds the k gradients to `tx` in one scan; returns the update of the k-th step."""

  def body(state, g):
    u, state = tx.update(g, state)
    return state, u

  _, us = lax.scan(body, tx.init(grads[0]), grads)
  return us[-1]


def _accumulate(dtype):
  def f(grads):
    k = grads.shape[0]
    # identity inner optimiser: the emitted update is the normalised mean itself.
    return _scan_updates(optax_accum.accumulate(optax.identity(), k, accum_dtype=dtype), grads)

  return f


def _multisteps(grads):
  k = grads.shape[0]
  return _scan_updates(optax.MultiSteps(optax.identity(), k).gradient_transformation(), grads)


def _microbatch(dtype):
  def f(grads):
    k = grads.shape[0]
    mean = optax_accum.microbatch(
      lambda g: g.mean(0), k, batch_argnums=0, accum_dtype=dtype, split="contiguous"
    )
    return mean(grads)

  return f


def _ms_dtype() -> str:
  tx = optax.MultiSteps(optax.identity(), 2).gradient_transformation()
  return str(jax.eval_shape(tx.init, jnp.zeros(1, jnp.bfloat16)).acc_grads.dtype)


def _naive_bf16(grads):
  return (grads.sum(0, dtype=jnp.bfloat16) / grads.shape[0]).astype(jnp.bfloat16)


CONTENDERS = {
  "accumulate, fp32 accumulator": _accumulate(jnp.float32),
  "accumulate, bf16 accumulator": _accumulate(None),
  "microbatch, fp32 accumulator": _microbatch(jnp.float32),
  "microbatch, bf16 accumulator": _microbatch(None),
  f"optax.MultiSteps (its own {_ms_dtype()} accumulator)": _multisteps,
}


def run(cfg: dict, progress=None, log=print) -> list[dict[str, Any]]:
  rows = []
  for k in cfg["precision_ks"]:
    grads = _grads(k, cfg["precision_n"])
    exact = np.asarray(grads, np.float64).mean(0)
    norm = np.linalg.norm(exact)
    floor = np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float64)

    def err(x, exact=exact, norm=norm):
      x = np.asarray(x, np.float64)
      return float(np.linalg.norm(x - exact) / norm), float(np.max(np.abs(x - exact)))

    f_rel, f_max = err(floor)
    rows.append(
      {"k": k, "contender": "bf16(exact mean) — the floor", "rel_l2": f_rel, "max_abs": f_max}
    )
    for name, f in CONTENDERS.items():
      out = jax.jit(f)(grads)
      assert out.dtype == jnp.bfloat16, f"{name} returned {out.dtype}, expected bf16"
      rel, mx = err(out)
      rows.append(
        {"k": k, "contender": name, "rel_l2": rel, "max_abs": mx, "vs_floor": rel / f_rel}
      )
    rows.append(
      {
        "k": k,
        "contender": "naive bf16 sum / k",
        **dict(zip(("rel_l2", "max_abs"), err(_naive_bf16(grads)), strict=True)),
      }
    )
    rows[-1]["vs_floor"] = rows[-1]["rel_l2"] / f_rel
    if progress is not None:
      progress.update(1)
    log(
      f"[precision] k={k}: "
      + ", ".join(f"{r['contender']} {r['rel_l2']:.2e}" for r in rows if r["k"] == k)
    )
  # An fp32 accumulator must sit on the floor (it only rounds once, at the end).
  for r in rows:
    if "fp32" in r["contender"]:
      assert r["vs_floor"] < 1.05, f"{r['contender']} at k={r['k']}: {r['vs_floor']:.2f}x floor"
  return rows
