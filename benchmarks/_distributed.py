"""Distributed: all-reduces per optimizer update in the compiled programs, and bytes moved.

Runs in its own process (`bench.py` starts it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on CPU) because the device count is fixed
when JAX starts. Data-parallel over one mesh axis ``"d"``: parameters replicated, batch sharded.

Counted from the optimised HLO, each collective placed where it runs: on every call ("step"),
inside a conditional branch ("cond", only on the emitting step) or inside a loop body ("loop",
once per micro-batch). Per update = what runs over one window of k micro-steps.

Contenders:

* cross-step `accumulate(adam, k, axis_name="d")`, gradients local (taken w.r.t. params made
  device-varying): static programs (`emit=False` / `emit=True`) and the device conditional;
* cross-step naive: `accumulate(adam, k)` without `axis_name`, gradients w.r.t. replicated
  params (autodiff all-reduces every micro-batch) — what one gets without deferral;
* within-step `microbatch(..., axis_name="d")` vs `optax.microbatching.microbatch` on
  replicated params (an all-reduce inside the loop body).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optax_accum  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from benchmarks import _models  # noqa: E402


def _lead(x):
  return jax.tree.map(lambda a: a[None], x)


def cross_programs(model, params, batch, mesh, k: int):
  """{name: {program: Compiled}} for the cross-step contenders."""
  adam = optax.adam(1e-3)
  out = {}

  def deferred(emit):
    tx = optax_accum.accumulate(adam, k, axis_name="d")

    def f(params, batch, mini_step):
      # The window position comes in as an argument, so XLA cannot fold the device conditional.
      state = tx.init(params)._replace(mini_step=mini_step)
      local = jax.lax.pcast(params, "d", to="varying")
      grads = jax.grad(model.loss)(local, batch)
      updates, state = tx.update(grads, state, params, emit=emit)
      return _lead((updates, state.acc_grads, state.acc_weight))

    return f

  def naive(emit):
    tx = optax_accum.accumulate(adam, k)

    def f(params, batch, mini_step):
      state = tx.init(params)._replace(mini_step=mini_step)
      grads = jax.grad(model.loss)(params, batch)  # replicated params: psum on every call
      updates, state = tx.update(grads, state, params, emit=emit)
      return _lead((updates, state.acc_grads))

    return f

  def compile_mapped(f):
    mapped = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d"), P()), out_specs=P("d"))
    return H.compile_fn(mapped, params, batch, jnp.zeros((), jnp.int32))

  out["accumulate(axis_name), local grads, static"] = {
    "accumulate": compile_mapped(deferred(False)),
    "emit": compile_mapped(deferred(True)),
  }
  out["accumulate(axis_name), local grads, device cond"] = {"step": compile_mapped(deferred(None))}
  out["naive: grads of replicated params, static"] = {
    "accumulate": compile_mapped(naive(False)),
    "emit": compile_mapped(naive(True)),
  }
  return out


def within_programs(model, params, batch, mesh, k: int):
  vg = jax.value_and_grad(model.loss)
  per_device = jax.tree.leaves(batch)[0].shape[0] // mesh.size
  ours = optax_accum.microbatch(vg, k, axis_name="d")
  theirs = optax.microbatching.microbatch(
    vg,
    argnums=1,
    microbatch_size=per_device // k,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )

  def compile_mapped(f):
    mapped = jax.shard_map(
      lambda p, b: _lead(f(p, b)), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")
    )
    return H.compile_fn(mapped, params, batch)

  return {
    "microbatch(axis_name)": {"step": compile_mapped(ours)},
    "optax.microbatching.microbatch, replicated params": {"step": compile_mapped(theirs)},
  }


def per_update(programs: dict[str, H.Compiled], k: int, kind: str) -> dict[str, float]:
  """All-reduce ops and bytes executed over one update (a window of k micro-steps)."""
  ops = 0.0
  nbytes = 0.0
  for name, c in programs.items():
    where, by = c.hlo.collective_where, c.hlo.collective_bytes
    if kind == "cross":
      calls = {"accumulate": k - 1, "emit": 1, "step": k}[name]
      # inside a conditional: runs once per window (the emitting call)
      ops += calls * where.get("step", 0) + where.get("cond", 0) + calls * k * where.get("loop", 0)
      nbytes += calls * by.get("step", 0) + by.get("cond", 0) + calls * k * by.get("loop", 0)
    else:
      ops += where.get("step", 0) + k * where.get("loop", 0) + where.get("cond", 0)
      nbytes += by.get("step", 0) + k * by.get("loop", 0) + by.get("cond", 0)
  return {"all_reduce_ops": ops, "bytes": nbytes}


def run(cfg: dict) -> list[dict]:
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("d",))
  model = _models.mlp(tuple(cfg["dist_mlp"]), name="mlp")
  params = model.init(jax.random.key(0))
  param_bytes = H.tree_bytes(params)
  rows = []
  for k in cfg["dist_ks"]:
    for kind, make, per_dev in (
      ("cross", cross_programs, cfg["dist_micro"]),
      ("within", within_programs, cfg["dist_micro"] * k),
    ):
      batch = model.batch(jax.random.key(1), per_dev * n)
      batch = jax.device_put(batch, NamedSharding(mesh, P("d")))
      for name, programs in make(model, params, batch, mesh, k).items():
        for c in programs.values():  # two independent HLO readers must agree
          ours = c.hlo.collectives.get("all-reduce", 0)
          lib = optax_accum.count_collectives(c.text, "all-reduce")
          assert ours == lib, f"{name}: all-reduce count {ours} here, {lib} by the library"
        rows.append(
          {
            "section": kind,
            "k": k,
            "devices": n,
            "contender": name,
            **per_update(programs, k, kind),
            "param_bytes": param_bytes,
            "programs": {
              p: {
                "collectives": c.hlo.collectives,
                "where": c.hlo.collective_where,
                "bytes": c.hlo.collective_bytes,
              }
              for p, c in programs.items()
            },
          }
        )
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", required=True, help="JSON config")
  ap.add_argument("--out", required=True, help="where to write the rows (JSON)")
  args = ap.parse_args()
  cfg = json.loads(args.config)
  rows = run(cfg)
  Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
  main()
