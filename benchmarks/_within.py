"""Within-step contenders: the gradient of one global batch, computed in k micro-batches.

* `optax_accum.microbatch(value_and_grad(loss), k)` — one `lax.scan`;
* `optax.microbatching.microbatch(..., accumulator=MEAN)` — a `fori_loop`;
* a Python loop of k jitted micro-steps (accumulator donated), the hand-written baseline;
* the single large batch — the limit for speed and the reference for correctness and memory.

Time per example, XLA's compiled peak bytes (argument + output + temp - alias) and compile
time, for k = 1, 2, 4, … at a fixed global batch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_accum
from benchmarks import _harness as H


def _large(loss, params, batch):
  f = jax.value_and_grad(loss)
  return H.compile_fn(f, params, batch)


def _ours(loss, params, batch, k):
  f = optax_accum.microbatch(jax.value_and_grad(loss), k)
  return H.compile_fn(f, params, batch)


def _optax(loss, params, batch, k):
  size = jax.tree.leaves(batch)[0].shape[0] // k
  f = optax.microbatching.microbatch(
    jax.value_and_grad(loss),
    argnums=1,
    microbatch_size=size,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )
  return H.compile_fn(f, params, batch)


class PythonLoop:
  """k dispatches of a jitted ``acc + value_and_grad(loss)(params, micro-batch)``."""

  def __init__(self, loss, params, batch, k):
    self.k = k
    n = jax.tree.leaves(batch)[0].shape[0]
    # The micro-batches arrive as separate arrays, as a data loader would hand them over.
    self.micro = [
      jax.tree.map(lambda x, i=i: x[i * (n // k) : (i + 1) * (n // k)], batch) for i in range(k)
    ]
    vg = jax.value_and_grad(loss)

    def add(params, acc, mb):
      return jax.tree.map(jnp.add, acc, vg(params, mb))

    def finish(acc):
      return jax.tree.map(lambda a: a / k, acc)

    out = jax.eval_shape(vg, params, self.micro[0])
    self.zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)
    self.add = H.compile_fn(add, params, self.zeros, self.micro[0], donate_argnums=(1,))
    self.finish = H.compile_fn(finish, self.zeros, donate_argnums=(0,))
    self.params = params

  @property
  def compile_s(self) -> float:
    return self.add.compile_s + self.finish.compile_s

  @property
  def memory(self) -> dict[str, int]:
    return self.add.memory

  def __call__(self, params, batch):
    del batch  # pre-split in __init__
    acc = jax.tree.map(jnp.zeros_like, self.zeros)
    for mb in self.micro:
      acc = self.add(params, acc, mb)
    return self.finish(acc)


def run(model, cfg: dict, progress=None, log=print) -> list[dict[str, Any]]:
  params = model.init(jax.random.key(0))
  batch_size = cfg["global_batch"]
  batch = model.batch(jax.random.key(1), batch_size)
  grad_bytes = H.tree_bytes(params)
  large = _large(model.loss, params, batch)
  ref = large(params, batch)
  rows = []
  for k in cfg["ks"]:
    t0 = time.perf_counter()
    progs = {
      "optax_accum.microbatch": _ours(model.loss, params, batch, k),
      "optax.microbatching.microbatch": _optax(model.loss, params, batch, k),
      "python loop of jitted micro-steps": PythonLoop(model.loss, params, batch, k),
    }
    # Every contender must return the large batch's loss and gradient (float32; sums in
    # another order, so agreement to ~1e-6 relative is expected; 1e-4 leaves margin).
    agreement = {}
    for name, p in progs.items():
      out = H.block(p(params, batch))
      _, rel = H.max_diff(out, ref)
      agreement[name] = rel
      assert rel <= 1e-4, f"within k={k}: {name} differs from the large batch by {rel:.3g} (rel)"
    contenders = {"large batch": lambda: large(params, batch)}
    contenders.update({n: (lambda p=p: p(params, batch)) for n, p in progs.items()})
    timings = H.run_side_by_side(
      contenders, rounds=cfg["within_rounds"], units=float(batch_size), progress=progress
    )
    for name, t in timings.items():
      p = large if name == "large batch" else progs[name]
      mem = p.memory
      rows.append(
        {
          "model": model.name,
          "k": k,
          "micro_batch": batch_size // k,
          "contender": name,
          "time_per_example": t.as_dict(),
          "ratio_vs_large": H.paired_ratio(t, timings["large batch"]),
          "ratio_vs_optax": H.paired_ratio(t, timings["optax.microbatching.microbatch"]),
          "peak_bytes": mem.get("peak"),
          "temp_bytes": mem.get("temp"),
          "peak_vs_large": mem.get("peak", 0) / large.memory["peak"] if mem else None,
          "peak_target": 1 / k + grad_bytes / large.memory["peak"] + 0.05,
          "compile_s": p.compile_s,
          "hlo": p.hlo.as_dict() if hasattr(p, "hlo") else p.add.hlo.as_dict(),
          "agreement_rel": agreement.get(name, 0.0),
        }
      )
    log(
      f"[within] k={k} ({time.perf_counter() - t0:.0f}s): "
      + ", ".join(f"{n} {t.median * 1e6:.2f}us/ex" for n, t in timings.items())
    )
  return rows


def compile_times(model, cfg: dict, repeats: int = 3, log=print) -> dict[str, Any]:
  """Compile seconds at the smallest k > 1 and the largest k, alternating, median of repeats.

  One compile is a noisy sample on a shared machine; the target (k=64 / k=2 ≤ 1.5) is checked
  on medians of compiles interleaved in time.
  """
  params = model.init(jax.random.key(0))
  batch = model.batch(jax.random.key(1), cfg["global_batch"])
  ks = [k for k in cfg["ks"] if k > 1]
  lo, hi = min(ks), max(ks)
  makers = {"optax_accum.microbatch": _ours, "optax.microbatching.microbatch": _optax}
  samples = {(n, k): [] for n in makers for k in (lo, hi)}
  for _ in range(repeats):
    for n, make in makers.items():
      for k in (lo, hi):
        samples[(n, k)].append(make(model.loss, params, batch, k).compile_s)
  out = {"k_lo": lo, "k_hi": hi}
  for n in makers:
    a, b = statistics.median(samples[(n, lo)]), statistics.median(samples[(n, hi)])
    out[n] = {
      "lo_s": a,
      "hi_s": b,
      "ratio": b / a,
      "samples": {str(k): samples[(n, k)] for k in (lo, hi)},
    }
  log(f"[within] compile k={hi}/k={lo}: " + ", ".join(f"{n} {out[n]['ratio']:.2f}" for n in makers))
  return out
