"""The audit's own run time on the guide's models ("Check accumulation on your model").

`optax_accum.audit` is a pre-flight check: it should take seconds. For each model of the guide
(a whole jitted training step with an in-step `lax.scan` and Adam, the same behind
`clip_by_global_norm` + AdamW (judged through the optimizer), a Flax MLP with dropout
through `microbatch`, an Equinox MLP through `TrainStep`, a model on a (data, model) mesh of 8
host devices through `microbatch` with ``axis_name="data"``), the
wall-clock seconds of whole `audit` calls, each on fresh objects (its compilations included:
the audit compiles its programs once per call), the median over rounds. Nothing here is
asserted; the verdicts are the tests' business (tests/test_audit.py).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.audit_time [--rounds 3]

writes ``benchmarks/results/cpu/audit.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_accum  # noqa: E402

K = 4
OUT = pathlib.Path(__file__).parent / "results" / "cpu" / "audit.md"


def _batch():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((32, 8)).astype(np.float32)
  return {"x": x, "y": np.sin(x[:, :2]).astype(np.float32)}


def _mse(out, y):
  return jnp.mean(jnp.sum((out - y) ** 2, -1))


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x, *, key=None):
    x = nn.tanh(nn.Dense(32)(x))
    x = nn.Dropout(0.1, deterministic=key is None)(x, rng=key)
    return nn.Dense(2)(x)


def whole_step_audit(optimizer=None):
  batch, mlp = _batch(), _MLP()
  params = mlp.init(jax.random.key(0), batch["x"][:1])
  optimizer = optax.adam(1e-3) if optimizer is None else optimizer

  @jax.jit
  def train_step(params, opt_state, batch):
    def loss(p, b):
      return _mse(mlp.apply(p, b["x"]), b["y"])

    stacked = jax.tree.map(lambda x: x.reshape(-1, K, *x.shape[1:]).swapaxes(0, 1), batch)
    add = lambda acc, b: (optax.tree.add(acc, jax.grad(loss)(params, b)), None)
    grads, _ = jax.lax.scan(add, optax.tree.zeros_like(params), stacked)
    updates, opt_state = optimizer.update(optax.tree.scale(1 / K, grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  loss = lambda p, b: _mse(mlp.apply(p, b["x"]), b["y"])
  return optax_accum.audit(loss, params, batch, K, step=train_step, optimizer=optimizer)


def clipped_step_audit():
  """The same step behind clip_by_global_norm + AdamW: judged through the optimizer, end to end
  (the gradient cannot be read back through a clipping)."""
  return whole_step_audit(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))


def flax_audit():
  batch, mlp = _batch(), _MLP()
  params = mlp.init(jax.random.key(0), batch["x"][:1])
  loss = lambda p, b, key=None: _mse(mlp.apply(p, b["x"], key=key), b["y"])
  sched = optax.linear_schedule(0.1, 0.01, 10)
  return optax_accum.audit(
    loss, params, batch, K, optimizer=optax.adam(sched), rng=jax.random.key(1)
  )


def equinox_audit():
  batch = _batch()
  model = eqx.nn.MLP(8, 2, width_size=32, depth=2, key=jax.random.key(0))
  loss = lambda m, b: _mse(jax.vmap(m)(b["x"]), b["y"])
  opt = optax.sgd(optax.linear_schedule(0.1, 0.01, 10))
  return optax_accum.audit(loss, model, batch, K, front_end="TrainStep", optimizer=opt)


def mesh_audit():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(1)
  specs = {"w0": P(None, "model"), "w1": P("model", None)}
  values = {
    "w0": rng.standard_normal((8, 32)).astype(np.float32) / np.sqrt(8),
    "w1": rng.standard_normal((32, 2)).astype(np.float32) / np.sqrt(32),
  }
  params = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in values.items()}
  batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  loss = lambda p, b: _mse(jnp.tanh(b["x"] @ p["w0"]) @ p["w1"], b["y"])
  return optax_accum.audit(
    loss, params, batch, K, optimizer=optax.sgd(0.1), mesh=mesh, axis_name="data"
  )


MODELS = {  # (model, front end): the audit call
  ("Flax MLP, your jitted step (lax.scan, Adam)", "step="): whole_step_audit,
  ("Flax MLP, your jitted step (lax.scan, clip + AdamW)", "step="): clipped_step_audit,
  ("Flax MLP with dropout", "microbatch, rng"): flax_audit,
  ("Equinox MLP", "TrainStep"): equinox_audit,
  ("MLP on a (data, model) = (4, 2) mesh", "microbatch, axis_name"): mesh_audit,
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  rows = []
  for name, fn in MODELS.items():
    seconds, cpu = [], []
    for _ in range(args.rounds):
      t0, c0 = time.perf_counter(), time.process_time()
      report = fn()
      seconds.append(time.perf_counter() - t0)
      cpu.append(time.process_time() - c0)
      assert report.ok, str(report)  # a benchmark of a failing audit would mean nothing
    med = statistics.median
    rows.append((name, med(seconds), min(seconds), max(seconds), med(cpu)))
    print(f"{name}: median {rows[-1][1]:.1f} s", flush=True)
  load = os.getloadavg()[0]
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  lines = [
    "---",
    "orphan: true  # the docs site copies this page; docs/benchmarks.md links it",
    "---",
    "",
    "# The audit's run time on the guide's models",
    "",
    "Wall-clock seconds of whole `optax_accum.audit` calls (compilation included, fresh objects",
    f"each round), median (min–max) over {args.rounds} rounds, `k = {K}`, 32 examples. Command:",
    "`XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.audit_time`.",
    "",
    "| model | front end | median | min–max | CPU seconds (median) |",
    "|---|---|---:|---:|---:|",
  ]
  for (model, front), wall, lo, hi, cpu in rows:
    lines.append(f"| {model} | {front} | {wall:.1f} s | {lo:.1f}–{hi:.1f} s | {cpu:.1f} s |")
  lines += [
    "",
    f"Measured {when} on {os.cpu_count()} CPUs, load average {load:.1f} at the end: the machine",
    "is shared, and the wall-clock figures grow with the load. The CPU seconds (the process's",
    "own, all threads) are the work the audit does, which load does not inflate: on an idle",
    "machine of this kind its wall-clock time is about that or less (compilation threads can run",
    "side by side). Most of it is XLA compilation (a few small programs per audit).",
  ]
  OUT.write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
