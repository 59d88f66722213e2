"""The DP section: memory of one micro-step against the logical batch, and time per example
against jax_privacy's clipped gradient at the same micro-batch size.

* memory: XLA's accounting of the compiled programs (`memory_analysis()`): `TrainStep`'s
  accumulating program of `clipped_loss` at micro-batch ``b`` for two window lengths (two
  logical batch sizes), and the in-step ``microbatch(clipped_grad, k)`` for two ``k`` at the
  same ``b``; the temp must be the same, growing with ``b`` only.
* time: ``clipped_grad(loss, C)`` against ``jax_privacy.clipped_grad(loss, l2_clip_norm=C)`` on
  one micro-batch, and our in-step ``microbatch(clipped_grad, k)`` against jax_privacy's own
  ``microbatch_size=b`` on the logical batch, side by side in one run (after checking that
  they compute the same sum).

Writes ``dp.md`` and ``dp.json`` beside the other sections' results (``bench.py --only dp``).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa
from benchmarks import _harness

CONFIG = {
  "quick": {"mlp": (64, 128, 128, 10), "micros": (8, 16), "ks": (4, 16), "rounds": 5},
  "cpu": {"mlp": (784, 256, 256, 10), "micros": (16, 64), "ks": (8, 32), "rounds": 15},
  "gpu": {"mlp": (784, 2048, 2048, 10), "micros": (64, 256), "ks": (8, 32), "rounds": 30},
}
CLIP = 1.0


def _mlp(sizes):
  rng = np.random.default_rng(0)
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
    params[f"w{i}"] = jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32)
    params[f"b{i}"] = jnp.zeros(b, jnp.float32)

  def loss(params, x, y):
    n = len(params) // 2
    for i in range(n):
      x = x @ params[f"w{i}"] + params[f"b{i}"]
      x = jax.nn.relu(x) if i < n - 1 else x
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

  return params, loss


def _data(n, sizes, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, sizes[0])), jnp.float32)
  return x, jnp.asarray(rng.integers(0, sizes[-1], n), jnp.int32)


def memory_rows(cfg: dict) -> list[dict]:
  """Compiled temp and peak bytes of one micro-step (TrainStep) and of the in-step form."""
  params, loss = _mlp(cfg["mlp"])
  rows = []
  for b in cfg["micros"]:
    for k in cfg["ks"]:
      noise = oa.privacy.dp_noise(1.0, CLIP, float(k * b), jax.random.key(0), allow_key_reuse=True)
      step = oa.TrainStep(
        oa.privacy.clipped_loss(loss, CLIP, batch_argnums=(1, 2), mask_argnum=None),
        optax.chain(noise, optax.sgd(0.1)),
        every_k=k,
        reduction="sum",
      )
      mb = _data(b, cfg["mlp"])
      m = _harness.memory(step.lower(params, step.init(params), *mb, emit=False).compile())
      rows.append({"form": "TrainStep micro-step", "b": b, "k": k, "logical": k * b, **m})
      summed = oa.microbatch(
        oa.privacy.clipped_grad(loss, CLIP, batch_argnums=(1, 2), mask_argnum=None),
        k,
        batch_argnums=(1, 2),
        reduction="sum",
      )
      m = _harness.compile_fn(summed, params, *_data(k * b, cfg["mlp"])).memory
      rows.append({"form": "microbatch (in-step)", "b": b, "k": k, "logical": k * b, **m})
  return rows


def time_rows(cfg: dict, progress: Any = None) -> list[dict]:
  """Time per example: ours against jax_privacy's clipped gradient, side by side."""
  import jax_privacy  # noqa: PLC0415  (the test-only peer, in the dev extra)

  params, loss = _mlp(cfg["mlp"])
  rows = []
  for b in cfg["micros"]:
    k = cfg["ks"][0]
    one, big = _data(b, cfg["mlp"]), _data(k * b, cfg["mlp"], seed=1)
    ours = jax.jit(oa.privacy.clipped_grad(loss, CLIP, batch_argnums=(1, 2), mask_argnum=None))
    theirs = jax.jit(jax_privacy.clipped_grad(loss, l2_clip_norm=CLIP, batch_argnums=(1, 2)))
    ours_k = jax.jit(
      oa.microbatch(
        oa.privacy.clipped_grad(loss, CLIP, batch_argnums=(1, 2), mask_argnum=None),
        k,
        batch_argnums=(1, 2),
        reduction="sum",
      )
    )
    theirs_k = jax.jit(
      jax_privacy.clipped_grad(loss, l2_clip_norm=CLIP, batch_argnums=(1, 2), microbatch_size=b)
    )
    for a, c, data in ((ours, theirs, one), (ours_k, theirs_k, big)):
      _, rel = _harness.max_diff(a(params, *data), c(params, *data))
      if rel > 1e-5:
        raise AssertionError(f"clipped sums disagree with jax_privacy: relative {rel:.2e}")
    timings = _harness.run_side_by_side(
      {
        "ours": lambda f=ours, d=one: f(params, *d),
        "jax_privacy": lambda f=theirs, d=one: f(params, *d),
        "ours_k": lambda f=ours_k, d=big: f(params, *d),
        "jax_privacy_k": lambda f=theirs_k, d=big: f(params, *d),
      },
      rounds=cfg["rounds"],
      units={"ours": b, "jax_privacy": b, "ours_k": k * b, "jax_privacy_k": k * b},
      progress=progress,
    )
    forms = (
      ("one micro-batch", "ours", "jax_privacy", b),
      (f"logical batch (k={k})", "ours_k", "jax_privacy_k", k * b),
    )
    for form, a, c, n in forms:
      rows.append({
        "form": form, "b": b, "examples": n,
        "ours_us": 1e6 * timings[a].median, "ours_iqr": timings[a].spread,
        "peer_us": 1e6 * timings[c].median, "peer_iqr": timings[c].spread,
        "ratio": _harness.paired_ratio(timings[a], timings[c]),
      })  # fmt: skip
  return rows


def markdown(res: dict) -> str:
  mem, times = res["memory"], res["time"]
  lines = [
    "# DP: per-example clipping, memory and time",
    "",
    f"MLP {'-'.join(map(str, res['mlp']))}, clip norm {CLIP}, {res['backend']} "
    f"({res['device']}), jax {res['jax']}, jax_privacy {res['jax_privacy']}.",
    "",
    f"`{res['command']}`, {res['date']}, scale {res['scale']}, {res['seconds']:.0f} s; load "
    f"average {res['load'][0]:.1f} at the start, {res['load'][1]:.1f} at the end (a shared "
    "machine: the ratios are medians of back-to-back pairs, the spreads are the IQR).",
    "",
    "## Compiled memory of one micro-step vs the logical batch",
    "",
    "| form | b | k | logical batch | argument | temp | peak |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in mem:
    lines.append(
      f"| {r['form']} | {r['b']} | {r['k']} | {r['logical']} | "
      f"{_harness.fmt_bytes(r['argument'])} | {_harness.fmt_bytes(r['temp'])} | "
      f"{_harness.fmt_bytes(r['peak'])} |"
    )
  lines += [
    "",
    "## Time per example vs jax_privacy's clipped gradient (side by side, one run)",
    "",
    "| form | b | examples per call | ours µs/example | jax_privacy µs/example "
    "| ours / jax_privacy |",
    "| --- | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in times:
    lines.append(
      f"| {r['form']} | {r['b']} | {r['examples']} | {r['ours_us']:.2f} (±{r['ours_iqr']:.0%}) | "
      f"{r['peer_us']:.2f} (±{r['peer_iqr']:.0%}) | {r['ratio']:.3f} |"
    )
  lines += ["", "## Targets", ""] + [f"- {t}" for t in targets(res)]
  return "\n".join(lines) + "\n"


def targets(res: dict) -> list[str]:
  out = []
  for form in ("TrainStep micro-step", "microbatch (in-step)"):
    for b in sorted({r["b"] for r in res["memory"]}):
      temps = {r["k"]: r["temp"] for r in res["memory"] if r["form"] == form and r["b"] == b}
      same = len(set(temps.values())) == 1
      out.append(
        f"{form}, b={b}: temp bytes equal for logical batches {sorted(k * b for k in temps)} "
        f"(target: equal) — {'met' if same else 'NOT met'}"
      )
  for r in res["time"]:
    met = "met" if r["ratio"] <= 1.0 else "NOT met"
    out.append(
      f"time per example, {r['form']}, b={r['b']}: {r['ratio']:.3f} × jax_privacy "
      f"(target ≤ 1.00) — {met}"
    )
  return out


def run(scale: str, out: Path, progress: Any = None, log=print) -> dict:
  """Measures the section and writes ``dp.md``/``dp.json`` into `out`; returns the figures."""
  import jax_privacy  # noqa: PLC0415

  cfg = CONFIG[scale]
  device = jax.devices()[0]
  t0, load0 = time.perf_counter(), os.getloadavg()[0]
  res = {
    "command": f"python benchmarks/bench.py --only dp --scale {scale}",
    "scale": scale,
    "date": datetime.date.today().isoformat(),
    "mlp": list(cfg["mlp"]),
    "backend": jax.default_backend(),
    "device": getattr(device, "device_kind", str(device)),
    "jax": jax.__version__,
    "jax_privacy": jax_privacy.__version__,
    "memory": memory_rows(cfg),
    "time": time_rows(cfg, progress),
  }
  res["seconds"], res["load"] = time.perf_counter() - t0, [load0, os.getloadavg()[0]]
  out.mkdir(parents=True, exist_ok=True)
  (out / "dp.json").write_text(json.dumps(res, indent=1))
  (out / "dp.md").write_text(markdown(res))
  log(markdown(res))
  return res
