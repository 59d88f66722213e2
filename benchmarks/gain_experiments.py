"""Change the batch, keep the recipe: the AdaScale gain's two experiments (issue 22).

    python benchmarks/gain_experiments.py            # both (the LM at a 2-core-CPU size)
    python benchmarks/gain_experiments.py --only convex
    python benchmarks/gain_experiments.py --only lm --lm-steps 120   # a shorter LM recipe

1. **Scale invariance on convex problems** (`convex`): the same base recipe (learning rate,
   schedule, length τ_end in base updates) at S = 1, 2, 4, 8, 16 base batches per window, with
   `scale_by_gain` (the run ends when τ reaches τ_end) and with the linear rule (lr × S, the
   run ends after τ_end / S updates). Problems: a noisy quadratic ½|w − x|², x ~ N(0, I) in
   d = 16, w₀ = 3, lr 0.2, τ_end = 100, one example per base batch, the excess loss ½|w|²
   reported; and softmax regression on scikit-learn's digits (held-out loss), batch 4, a cosine
   schedule over τ_end = 300 at a base learning rate at which the linear rule's ×16 diverges.
   Every figure is the mean over SEEDS runs (vmapped), with its standard error.
2. **The byte language model** (`lm`): the recipe (Adam, a fixed batch of K_LARGE micro-batches
   of the demo's byte LM), against the same recipe with the batch following the noise scale
   from K_SMALL (`FollowNoiseScale`, `scale_by_gain(rule="sqrt")`, schedules on τ), and a fixed
   small batch of K_SMALL micro-batches: tokens and optimizer steps each needs to reach the
   fixed large batch's final held-out loss. A fourth run is AdaScale's own premise: the small
   batch's recipe (its learning rate and schedule, W0 = K_SMALL micro-batches), the batch grown
   from it by the noise scale.

Writes results.md, results.json and PNG plots to benchmarks/results/gain/ (or --out). A part
left out by --only keeps the rows, and the command, of the run that measured it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_accum  # noqa: E402

SCALES = (1, 2, 4, 8, 16)
SEEDS = 32


# ----------------------------------------------------------------------------------------------
# The convex problems: a per-micro-batch gradient, a loss to report, a recipe.


class Problem:
  """`grad(w, key)`: one base batch's gradient; `loss(w)`: the figure reported."""

  def __init__(self, name, w0, grad, loss, lr, tau_end, schedule=None):
    self.name, self.w0, self.grad, self.loss = name, w0, grad, loss
    self.lr, self.tau_end = lr, tau_end
    self.schedule = schedule or (lambda lr: lr)  # lr -> number or optax schedule


def quadratic() -> Problem:
  d = 16

  def grad(w, key):  # ½|w − x|², x ~ N(0, I): gradient w − x
    return w - jax.random.normal(key, (d,))

  def loss(w):  # the excess expected loss E[½|w − x|²] − d/2
    return 0.5 * jnp.sum(w**2)

  return Problem("quadratic (d=16)", jnp.full((d,), 3.0), grad, loss, lr=0.2, tau_end=100)


def digits(lr: float = 1.5, batch: int = 4) -> Problem:
  from sklearn.datasets import load_digits  # noqa: PLC0415

  x, y = load_digits(return_X_y=True)
  x = (x - x.mean(0)) / (x.std(0) + 1e-6)
  rng = np.random.default_rng(0)
  order = rng.permutation(len(x))
  x, y = jnp.asarray(x[order], jnp.float32), jnp.asarray(y[order])
  train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]

  def xent(w, xs, ys):
    logits = xs @ w["w"] + w["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, ys))

  def grad(w, key):
    idx = jax.random.randint(key, (batch,), 0, len(train_x))
    return jax.grad(xent)(w, train_x[idx], train_y[idx])

  w0 = {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}
  tau_end = 300
  return Problem(
    f"digits softmax (batch {batch}, lr {lr:g})",
    w0,
    grad,
    lambda w: xent(w, test_x, test_y),
    lr=lr,
    tau_end=tau_end,
    schedule=lambda lr: optax.cosine_decay_schedule(lr, tau_end),
  )


def _runner(problem: Problem, inner, s: int):
  """A jitted, seed-vmapped window of `s` base batches through accumulate(inner)."""
  tx = optax_accum.accumulate(inner, s, noise_scale=True)

  def window(state, w, key):
    def micro(carry, key):
      state, w = carry
      u, state = tx.update(problem.grad(w, key), state, w)
      return (state, optax.apply_updates(w, u)), None

    (state, w), _ = jax.lax.scan(micro, (state, w), jax.random.split(key, s))
    tau = optax_accum.progress(state) if _has_gain(inner) else state.gradient_step
    return state, w, tau, problem.loss(w)

  init = jax.jit(jax.vmap(lambda _: tx.init(problem.w0)))
  return init, jax.jit(jax.vmap(window))


def _has_gain(inner) -> bool:
  return optax_accum.batch_size._gain.holds_gain(jax.eval_shape(inner.init, jnp.zeros(1)))


def _run(problem: Problem, rule: str, s: int, seed: int = 0) -> dict:
  """One recipe at scale `s` ("gain": scale_by_gain, or "linear": lr × s), over SEEDS runs;
  returns per update the mean τ, the mean loss and its standard error."""
  sched = problem.schedule(problem.lr)
  if rule == "gain":
    inner = optax_accum.scale_by_gain(sched, base_weight=1)
    per_update = None
  else:  # the linear rule: lr × S, the schedule at S × the update count
    lr_at = sched if callable(sched) else (lambda _: sched)
    inner = optax.scale_by_schedule(lambda c: -s * lr_at(s * c))
    per_update = s
  init, window = _runner(problem, inner, s)
  state = init(jnp.arange(SEEDS))
  w = jax.tree.map(lambda x: jnp.broadcast_to(x, (SEEDS, *x.shape)), problem.w0)
  keys = jax.random.split(jax.random.key(seed), SEEDS)
  taus, losses, errs = [0.0], [float(problem.loss(problem.w0))], [0.0]
  cap = 4 * problem.tau_end
  for _ in range(cap):
    keys = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
    state, w, tau, loss = window(state, w, step_keys)
    tau = np.asarray(tau, np.float64) * (1 if per_update is None else per_update)
    loss = np.asarray(loss, np.float64)
    taus.append(float(tau.mean()))
    losses.append(float(loss.mean()))
    errs.append(float(loss.std(ddof=1) / np.sqrt(SEEDS)))
    if tau.min() >= problem.tau_end or not np.all(np.isfinite(loss)):
      break
  diverged = not np.isfinite(losses[-1]) or losses[-1] > 10 * losses[0]
  return {
    "problem": problem.name,
    "rule": rule,
    "S": s,
    "updates": len(taus) - 1,
    "examples": (len(taus) - 1) * s,
    "tau": taus,
    "loss": losses,
    "loss_se": errs,
    "final_loss": losses[-1],
    "final_se": errs[-1],
    "peak_loss": float(np.nanmax(losses)),
    "diverged": bool(diverged),
  }


def convex(log=print) -> list[dict]:
  rows = []
  # Digits at a tuned base learning rate, and at a high one where lr × 16 is unstable.
  for make in (quadratic, digits, lambda: digits(lr=4.0)):
    problem = make()
    for rule in ("gain", "linear"):
      for s in SCALES:
        if rule == "linear" and s == 1:
          continue  # S = 1: the linear rule is the base run
        r = _run(problem, rule, s)
        rows.append(r)
        log(
          f"[convex] {problem.name} {rule} S={s}: {r['updates']} updates, loss "
          f"{r['final_loss']:.4g} ± {r['final_se']:.2g}{' (diverged)' if r['diverged'] else ''}"
        )
  return rows


# ----------------------------------------------------------------------------------------------
# The byte language model.

K_SMALL, K_LARGE, MICRO_ROWS = 2, 8, 4
PARTS = ("convex", "lm")


def lm(steps: int, log=print) -> list[dict]:
  """The recipe at K_LARGE micro-batches, the adaptive run from K_SMALL, and K_SMALL fixed."""
  from optax_accum.demo.lm import data, model  # noqa: PLC0415

  cfg = model.Config(seq_len=64, width=64, heads=4, layers=2)
  graphdef, params0 = model.init(cfg, 0)
  loss = model.loss_fn(graphdef)
  docs = data.documents(1200 + 64)
  tokens, mask = data.encode(docs, cfg.seq_len)
  held = {"tokens": jnp.asarray(tokens[1200:]), "mask": jnp.asarray(mask[1200:])}
  train = (tokens[:1200], mask[:1200])
  lr = 3e-3
  rng = np.random.default_rng(0)
  stream = rng.integers(0, len(train[0]), size=(steps * K_LARGE * 4, MICRO_ROWS))

  def micro(i):
    idx = stream[i % len(stream)]
    return {"tokens": jnp.asarray(train[0][idx]), "mask": jnp.asarray(train[1][idx])}

  micro_tokens = float(np.mean([train[1][stream[i]].sum() for i in range(64)]))
  base_tokens = micro_tokens * K_LARGE
  sched = optax.cosine_decay_schedule(lr, steps)  # the recipe: `steps` updates of K_LARGE
  small_steps = steps * K_LARGE // K_SMALL  # the small batch: the same tokens, its own length
  small_sched = optax.cosine_decay_schedule(lr, small_steps)
  runs = [
    # name, inner optimizer, every_k, the run's end: ("updates", n) or ("progress", τ_end)
    (f"fixed large (k={K_LARGE})", optax.adam(sched), K_LARGE, ("updates", steps)),
    (f"fixed small (k={K_SMALL})", optax.adam(small_sched), K_SMALL, ("updates", small_steps)),
    # The large batch's recipe, from K_SMALL: S = K_SMALL / K_LARGE < 1 at first.
    _adaptive("large batch's recipe", sched, base_tokens, steps, micro_tokens),
    # AdaScale's premise: the recipe tuned at the small batch B0, the batch grown from it.
    _adaptive(
      "small batch's recipe", small_sched, micro_tokens * K_SMALL, small_steps, micro_tokens
    ),
  ]
  out, target = [], None
  for name, inner, every_k, (until, end) in runs:
    r = _lm_run(loss, params0, inner, every_k, until, end, micro, held, target)
    r["run"] = name
    target = r["target"] if target is None else target
    r["target"] = target
    r["reached"] = next((c for c in r["curve"] if c["held_out"] <= target), None)
    out.append(r)
    log(f"[lm] {name}: {r['curve'][-1]}, reached {r['reached']} ({r['seconds']:.0f} s)")
  return out


def _adaptive(recipe: str, sched, base_weight: float, end: int, micro_tokens: float) -> tuple:
  """A run whose batch follows the noise scale from K_SMALL micro-batches, with the gain on
  a recipe (`sched`, tuned at `base_weight` tokens) and its end at τ = `end`."""
  return (
    f"adaptive, {recipe} (k={K_SMALL}→, gain)",
    optax.chain(
      optax.scale_by_adam(), optax_accum.scale_by_gain(sched, base_weight=base_weight, rule="sqrt")
    ),
    optax_accum.FollowNoiseScale(min_k=K_SMALL, max_k=4 * K_LARGE, micro_batch_weight=micro_tokens),
    ("progress", end),
  )


def _lm_run(loss, params, inner, every_k, until, end, micro, held, target) -> dict:
  """One LM run with TrainStep (token weights), evaluated on the held-out rows every 5
  updates; it stops at its end, or once it reaches `target` (when given)."""
  evaluate = jax.jit(loss)
  step = optax_accum.TrainStep(
    loss, inner, every_k, noise_scale=True, weight_fn=lambda b: jnp.sum(b["mask"])
  )
  params = jax.tree.map(jnp.copy, params)  # TrainStep donates them: keep the caller's
  state = step.init(params)
  curve, seen, i, t0 = [], 0.0, 0, time.perf_counter()
  while True:
    b = micro(i)
    params, state, _ = step(params, state, b)
    seen += float(b["mask"].sum())
    i += 1
    if not bool(optax_accum.has_updated(state)):
      continue
    n = int(state.gradient_step)
    clock = float(optax_accum.progress(state)) if until == "progress" else n
    done = clock >= end
    if n % 5 == 0 or done:
      held_loss = float(evaluate(params, held))
      curve.append({"update": n, "tokens": seen, "held_out": held_loss,
                    "k": int(state.window_k), "progress": clock})  # fmt: skip
      done = done or (target is not None and held_loss <= target)
    if done:
      break
  return {"curve": curve, "target": curve[-1]["held_out"], "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------
# Report.


def _plots(convex_rows, lm_rows, out: Path) -> list[str]:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  files = []
  for problem in dict.fromkeys(r["problem"] for r in convex_rows):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in (r for r in convex_rows if r["problem"] == problem):
      style = "-" if r["rule"] == "gain" else ":"
      label = f"{r['rule']} S={r['S']}"
      loss = np.clip(np.asarray(r["loss"]), None, 1e6)
      axes[0].semilogy(r["tau"], loss, style, label=label)
      axes[1].semilogy(np.arange(len(loss)) * r["S"], loss, style, label=label)
    axes[0].set_xlabel("progress τ (base updates)")
    axes[1].set_xlabel("examples (base batches)")
    for ax in axes:
      ax.set_ylabel("loss")
      ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(problem)
    name = "convex_" + re.sub(r"[^a-z0-9.]+", "_", problem.lower()).strip("_") + ".png"
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    files.append(name)
  if lm_rows:
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in lm_rows:
      ax.plot([c["tokens"] for c in r["curve"]], [c["update"] for c in r["curve"]], label=r["run"])
      if r["reached"]:
        ax.plot(r["reached"]["tokens"], r["reached"]["update"], "o", color=ax.lines[-1].get_color())
    ax.set_xlabel("tokens")
    ax.set_ylabel("optimizer steps")
    title = "byte LM: steps against tokens\n(dot: where a run reaches the large batch's final loss)"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lm_steps_tokens.png", dpi=110)
    plt.close(fig)
    files.append("lm_steps_tokens.png")
  return files


def _convex_md(rows) -> list[str]:
  lines = [
    "## 1. Scale invariance on convex problems",
    "",
    f"Mean over {SEEDS} seeds ± its standard error, at the end of the run (gain: when τ "
    "reaches τ_end; linear: after τ_end / S updates). *vs base*: the final loss over the base "
    "run's (S = 1); *peak loss*: the largest mean loss on the way (the start is the first "
    "point), a sign of instability where it exceeds the starting loss.",
    "",
    "| problem | rule | S | updates | examples | final loss | vs base | peak loss |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for problem in dict.fromkeys(r["problem"] for r in rows):
    base = next(r for r in rows if r["problem"] == problem and r["S"] == 1)
    for r in (r for r in rows if r["problem"] == problem):
      loss = "diverged" if r["diverged"] else f"{r['final_loss']:.4g} ± {r['final_se']:.2g}"
      ratio = "—" if r["diverged"] else f"{r['final_loss'] / base['final_loss']:.3f}"
      lines.append(
        f"| {problem} | {r['rule']} | {r['S']} | {r['updates']} | {r['examples']} | {loss} | "
        f"{ratio} | {r['peak_loss']:.3g} |"
      )
  return [*lines, ""]


def _lm_md(rows) -> list[str]:
  if not rows:
    return []
  large = rows[0]
  lines = [
    "## 2. The byte language model",
    "",
    f"Target: the fixed large batch's final held-out loss, {large['target']:.4f}. Tokens and "
    "optimizer steps to reach it (evaluated every 5 updates).",
    "",
    "| run | steps | tokens | tokens / large batch's | steps / fixed small's |",
    "| --- | --- | --- | --- | --- |",
  ]
  small = next(r for r in rows if r["run"].startswith("fixed small"))
  for r in rows:
    if r["reached"] is None:
      last = r["curve"][-1]
      lines.append(
        f"| {r['run']} | not reached ({last['update']} steps, held-out {last['held_out']:.4f}) "
        f"| {last['tokens']:,.0f} | — | — |"
      )
      continue
    tok = r["reached"]["tokens"] / large["reached"]["tokens"]
    steps = (
      f"{r['reached']['update'] / small['reached']['update']:.2f}" if small["reached"] else "—"
    )
    lines.append(
      f"| {r['run']} | {r['reached']['update']} | {r['reached']['tokens']:,.0f} | {tok:.2f} | "
      f"{steps} |"
    )
  return [*lines, ""]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--only", default="convex,lm")
  p.add_argument("--lm-steps", type=int, default=240, help="the LM recipe's updates")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gain"))
  p.add_argument("--render", action="store_true", help="measure nothing: redraw from results.json")
  args = p.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  saved = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
  # Which run measured each part: a part not run now keeps the rows (and run) it had.
  runs = saved.get("runs") or {part: saved["meta"] for part in PARTS if saved.get(part)}
  if args.render:
    convex_rows, lm_rows = saved["convex"], saved["lm"]
  else:
    only = args.only.split(",")
    start = time.perf_counter()
    convex_rows = convex() if "convex" in only else saved.get("convex", [])
    lm_rows = lm(args.lm_steps) if "lm" in only else saved.get("lm", [])
    meta = {
      "command": "python benchmarks/gain_experiments.py " + " ".join(argv or sys.argv[1:]),
      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
      "backend": jax.default_backend(),
      "seconds": round(time.perf_counter() - start, 1),
    }
    runs = {**runs, **{part: meta for part in PARTS if part in only}}
    (out / "results.json").write_text(json.dumps({"runs": runs, "convex": convex_rows,
                                                  "lm": lm_rows}, indent=1))  # fmt: skip
  files = _plots(convex_rows, lm_rows, out)
  md = [
    "# The gain's experiments (issue 22)",
    "",
    *[
      f"{part}: `{m['command'].strip()}` on {m['backend']}, {m['date']}, {m['seconds']} s."
      for part, m in runs.items()
    ],
    "",
    *_convex_md(convex_rows),
    *_lm_md(lm_rows),
    *[f"![{f}]({f})" for f in files],
    "",
  ]
  (out / "results.md").write_text("\n".join(md))
  print(f"wrote results.md, results.json, {', '.join(files)} in {out}")


if __name__ == "__main__":
  main()
