"""Within-step contenders: the gradient of one global batch, computed in k micro-batches.

* `optax_accum.microbatch(value_and_grad(loss), k)` — one `lax.scan`;
* `optax.microbatching.microbatch(..., accumulator=MEAN)` — a `fori_loop`;
* a Python loop of k jitted micro-steps (accumulator donated), the hand-written baseline;
* the single large batch — the limit for speed and the reference for correctness and memory.

Time per example, XLA's compiled peak bytes (argument + output + temp - alias) and compile
time, for k = 1, 2, 4, … at a fixed global batch.

A padded last batch (`run_padded`): the same global batch of which only the first n of k
micro-batches are real, n passed as a traced scalar so that one compiled program serves every
n, against `optax.microbatching.microbatch` with the same `num_real_microbatches`
(RUNNING_MEAN: the mean over the real micro-batches, as our "mean"; optax's MEAN divides by k)
and against the large batch of exactly the real rows. Both must agree with that large batch
before anything is timed.
"""

from __future__ import annotations

import functools
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


def _ours_padded(loss, params, batch, k):
  """One program for every number of real micro-batches ``n`` (a traced int32 argument)."""

  def f(params, batch, n):
    step = optax_accum.microbatch(
      jax.value_and_grad(loss), k, split="strided", num_real_microbatches=n
    )
    return step(params, batch)

  return H.compile_fn(f, params, batch, jnp.int32(k))


def _optax_padded(loss, params, batch, k):
  size = jax.tree.leaves(batch)[0].shape[0] // k

  def f(params, batch, n):
    step = optax.microbatching.microbatch(
      jax.value_and_grad(loss),
      argnums=1,
      microbatch_size=size,
      accumulator=optax.microbatching.AccumulationType.RUNNING_MEAN,
      num_real_microbatches=n,
    )
    return step(params, batch)

  return H.compile_fn(f, params, batch, jnp.int32(k))


def _real_rows(batch, k, n):
  """The rows of micro-batches 0..n-1 of the strided split (rows i + j·k, i < n)."""

  def take(x):
    b = x.shape[0] // k
    return x.reshape(b, k, *x.shape[1:])[:, :n].reshape(b * n, *x.shape[1:])

  return jax.tree.map(take, batch)


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


def rel_tol() -> float:
  """Relative agreement with the large batch: 1e-4 on CPU; 2e-3 on GPU/TPU, whose default
  float32 matmul precision rounds the inputs to TF32 (NVIDIA; 2^-11 relative) or bf16 passes
  (TPU), so that another grouping of the batch rounds differently beyond float32's 1e-6."""
  return 1e-4 if jax.default_backend() == "cpu" else 2e-3


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
    # another order, so agreement to ~1e-6 relative is expected; `rel_tol()` leaves margin).
    agreement = {}
    for name, p in progs.items():
      out = H.block(p(params, batch))
      _, rel = H.max_diff(out, ref)
      agreement[name] = rel
      assert rel <= rel_tol(), f"within k={k}: {name} differs from the large batch: {rel:.3g} rel"
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
  # The padded last batch: rows with "case": "padded" (see `run_padded`).
  return rows + run_padded(model, cfg, log=log)


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


OURS, OPTAX, LARGE = "optax_accum.microbatch", "optax.microbatching.microbatch", "large batch"


def _padded_k(cfg: dict) -> int:
  """The k of the padded rows: `within_padded_k` if the config sets it, else 8 (or the median)."""
  ks = [k for k in cfg["ks"] if k > 1]
  return cfg.get("within_padded_k") or (8 if 8 in ks else ks[len(ks) // 2])


def run_padded(model, cfg: dict, progress=None, log=print) -> list[dict[str, Any]]:
  """A padded last batch: n of k micro-batches real, for n = 1, k/2 and k, one program each.

  For each n, side by side: ours and optax's (both fed n as a traced scalar), the large batch of
  the n·b real rows, and — for n < k — ours and optax's with all k real, so that the per-call
  ratio n vs k (the early stop) is measured in the same rounds. Times are per real example.
  """
  params = model.init(jax.random.key(0))
  batch = model.batch(jax.random.key(1), cfg["global_batch"])
  k = _padded_k(cfg)
  b = cfg["global_batch"] // k
  progs = {OURS: _ours_padded(model.loss, params, batch, k)}
  progs[OPTAX] = _optax_padded(model.loss, params, batch, k)
  rows = []
  for n in sorted({1, k // 2, k}):
    real = _real_rows(batch, k, n)
    large = _large(model.loss, params, real)
    ref = large(params, real)
    agreement = {LARGE: 0.0}
    for name, p in progs.items():
      # The mean over real micro-batches; optax's running mean rounds differently: ~1e-6 rel.
      _, agreement[name] = H.max_diff(H.block(p(params, batch, jnp.int32(n))), ref)
      assert agreement[name] <= rel_tol(), f"padded n={n}/{k}: {name} off by {agreement[name]:.3g}"
    timings = _time_padded(progs, large, params, batch, real, n, k, cfg["within_rounds"], progress)
    for name in (LARGE, OURS, OPTAX):
      row = _padded_row(model, k, n, b, name, timings, large if name == LARGE else progs[name])
      row.update(
        peak_vs_large=row["peak_bytes"] / large.memory["peak"], agreement_rel=agreement[name]
      )
      rows.append(row)
    log(
      f"[within] padded n={n}/{k}: "
      + ", ".join(f"{m} {timings[m].median * 1e6:.2f}us/real ex" for m in (LARGE, OURS, OPTAX))
    )
  return rows


def _time_padded(progs, large, params, batch, real, n, k, rounds, progress) -> dict[str, Any]:
  """Side by side: the large batch of the real rows, each contender at n and (n < k) at k."""
  b = jax.tree.leaves(batch)[0].shape[0] // k
  count, full = jnp.int32(n), jnp.int32(k)
  contenders = {LARGE: functools.partial(large, params, real)}
  units = {LARGE: float(n * b)}
  for name, p in progs.items():
    contenders[name], units[name] = functools.partial(p, params, batch, count), float(n * b)
    if n < k:
      contenders[f"{name}, all real"] = functools.partial(p, params, batch, full)
      units[f"{name}, all real"] = float(k * b)
  return H.run_side_by_side(contenders, rounds=rounds, units=units, progress=progress)


def _padded_row(model, k, n, b, name, timings, prog) -> dict[str, Any]:
  """One row of the padded case; the within table's fields, plus case, num_real, real_examples
  and call_vs_all_real (per-call time with n real / with all k real, the same contender)."""
  t = timings[name]
  per_call = None
  if name != LARGE:
    per_call = H.paired_ratio(t, timings[f"{name}, all real"]) * n / k if n < k else 1.0
  return {
    "model": model.name,
    "case": "padded",
    "k": k,
    "num_real": n,
    "micro_batch": b,
    "real_examples": n * b,
    "contender": f"{name}, {n}/{k} real",
    "time_per_example": t.as_dict(),  # per REAL example
    "ratio_vs_large": H.paired_ratio(t, timings[LARGE]),  # the large batch of the real rows
    "ratio_vs_optax": H.paired_ratio(t, timings[OPTAX]),  # optax with the same n
    "call_vs_all_real": per_call,  # the early stop: ~n/k when the loop stops after n
    "peak_bytes": prog.memory.get("peak"),
    "temp_bytes": prog.memory.get("temp"),
    "peak_target": float("nan"),  # no target for this case
    "compile_s": prog.compile_s,  # one program for every n
    "hlo": prog.hlo.as_dict(),
  }
