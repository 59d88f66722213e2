"""``python -m optax_accum.demo lm [--quick]``: the command line of the language-model task."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence

import jax

from optax_accum.demo import NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, Phases
from optax_accum.demo.lm import budget, data, methods, model, report, require

# (model, batch of sequences per optimizer step, optimizer steps, training documents, budget MiB)
PRESETS = {
  "full": (model.Config(seq_len=128, width=64, heads=4, layers=2), 32, 60, 8192, 12.0),
  "quick": (model.Config(seq_len=64, width=32, heads=2, layers=1), 4, 8, 1024, 1.5),
  # `benchmarks/gpu.sh --dry-run`: every path of the run (planned k=2 included), nothing measured.
  "dry": (model.Config(seq_len=16, width=8, heads=1, layers=1), 4, 2, 64, 0.2),
  # One GPU (benchmarks/gpu.sh): a model and batch that keep it busy, a minute or two.
  "gpu": (model.Config(seq_len=256, width=512, heads=8, layers=6), 256, 30, 16384, 4096.0),
}
EVAL_DOCS = 256


def _writable_dir(p: argparse.ArgumentParser, flag: str, path: str) -> None:
  """Fails the parse unless `path` is a directory this process can create and write to."""
  if not path.strip():
    p.error(f"{flag} must name a directory, got {path!r}")
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    with open(probe, "w"):
      pass
    os.remove(probe)
  except OSError as e:
    p.error(f"{flag} {path!r} is not a directory this process can write to: {e.strerror}")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m optax_accum.demo lm",
    description="Train a byte-level transformer on the standard library's source four ways "
    "(large batch, TrainStep, microbatch, naive mean of means) on the same micro-batches; "
    "with --checkpoint-dir, TrainStep alone, checkpointed and resumable.",
  )
  p.add_argument("--quick", action="store_true", help="a small model and run (tests, CI)")
  p.add_argument(
    "--size", choices=sorted(PRESETS), help="model and run sizes (default full; --quick: quick)"
  )
  p.add_argument("--batch-size", type=POSITIVE_INT, help="sequences per optimizer step")
  p.add_argument("--steps", type=POSITIVE_INT, help="optimizer steps")
  p.add_argument(
    "--memory-budget-mib", type=POSITIVE, help="the budget plan_microbatches meets (MiB)"
  )
  p.add_argument(
    "--k", type=POSITIVE_INT, help="micro-batches per step (default: plan_microbatches' k)"
  )
  p.add_argument("--lr", type=POSITIVE, default=3e-3, help="Adam learning rate (default 3e-3)")
  p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="seed for init and data order")
  p.add_argument("--out", help="folder for results.md and lm_loss.png (default lm_results)")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  p.add_argument("--checkpoint-dir", help="train TrainStep only, checkpointing and resuming here")
  p.add_argument(
    "--checkpoint-every", type=POSITIVE_INT, default=3, help="micro-steps between checkpoints"
  )
  p.add_argument(
    "--distributed", action="store_true", help="with --checkpoint-dir: jax.distributed (launch)"
  )
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The flags, each checked: a bad one exits with argparse's usage and a message naming it."""
  p = _parser()
  args = p.parse_args(argv)
  given = sys.argv[1:] if argv is None else list(argv)
  args.command = " ".join(["python -m optax_accum.demo lm", *given])
  if args.quick and args.size not in (None, "quick"):
    p.error(f"--quick contradicts --size {args.size}")
  args.size = "quick" if args.quick else (args.size or "full")
  args.quick = args.size == "quick"
  cfg, batch, steps, docs, mib = PRESETS[args.size]
  args.cfg, args.num_docs = cfg, docs
  args.batch_size = batch if args.batch_size is None else args.batch_size
  args.steps = steps if args.steps is None else args.steps
  args.memory_budget_mib = mib if args.memory_budget_mib is None else args.memory_budget_mib
  if args.k is not None and args.batch_size % args.k:
    p.error(f"--batch-size must be a multiple of --k={args.k}, got {args.batch_size}")
  if args.checkpoint_dir is None:
    if args.distributed:
      p.error("--distributed needs --checkpoint-dir (only the checkpointed run is distributed)")
    args.out = "lm_results" if args.out is None else args.out
    _writable_dir(p, "--out", args.out)
  else:
    if args.out is not None:
      p.error("--out is for the four-way run; with --checkpoint-dir the run writes there")
    _writable_dir(p, "--checkpoint-dir", args.checkpoint_dir)
  return args


def corpus(args):
  """The training rows and a held-out batch (the documents after them), encoded."""
  docs = data.documents(args.num_docs + EVAL_DOCS)
  tokens, mask = data.encode(docs, args.cfg.seq_len)
  n = args.num_docs
  return (tokens[:n], mask[:n]), {"tokens": tokens[n:], "mask": mask[n:]}


def noise_scale_hook(results) -> str | None:
  """The line on the gradient noise scale that the `TrainStep` run measured, in tokens.

  Args:
    results: the runs; the `TrainStep` one carries ``b_simple`` (None: nothing to say).

  Returns:
    One line (B_simple at the end in tokens, against the real tokens of one optimizer step's
    batch), or None when no run measured it.
  """
  noisy = next((r for r in results if r.b_simple is not None), None)
  if noisy is None:
    return None
  per_step = noisy.tokens / len(noisy.losses)
  return (
    f"B_simple (gradient noise scale, {noisy.name}, token weights): {noisy.b_simple[-1]:,.0f} "
    f"tokens at the last step (smoothed over windows); a batch holds {per_step:,.0f} real tokens"
  )


def train_all(args, loss, params0, windows, held_out):
  """The four runs and the float32 floor, evaluated and compared with the large batch."""
  evaluate = jax.jit(loss)
  names = (*methods.METHODS, methods.FLOOR)
  results = methods.train(names, loss, params0, windows, args.lr, progress=not args.no_progress)
  for r in results:
    r.final_loss = float(evaluate(r.params, held_out))
    r.max_param_diff = methods.max_diff(r.params, results[0].params) if r is not results[0] else 0.0
  return results


def main(argv: Sequence[str] | None = None) -> list[methods.Result]:
  """Runs the task; returns the `Result`s (large batch first, the float32 floor last)."""
  start = time.perf_counter()
  args = parse_args(argv)
  for module in ("flax", "grain", "tqdm", "matplotlib"):
    require(module)
  if args.checkpoint_dir:
    from optax_accum.demo.lm import resume  # noqa: PLC0415

    return resume.main(args)
  phases = Phases(3, "setup", progress=not args.no_progress)
  phases("the model")
  graphdef, params0 = model.init(args.cfg, args.seed)
  loss = model.loss_fn(graphdef)
  phases("the corpus")
  (tokens, mask), held_out = corpus(args)
  phases("planning under the memory budget: compiling the gradient program for each k")
  plan = budget.plan(loss, params0, args.batch_size, args.cfg.seq_len,
                     int(args.memory_budget_mib * budget.MIB))  # fmt: skip
  phases.close()
  k = args.k or plan.num_microbatches
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  print(
    f"lm: {len(tokens)} documents of the standard library (seq_len {args.cfg.seq_len}, "
    f"{mask.mean():.0%} real tokens), {dataclasses.astuple(args.cfg)[1:]} (width, heads, "
    f"layers): {n_params:,} params; {args.steps} steps of {args.batch_size} sequences, k={k}"
    + ("" if args.k else " (planned)")
  )
  print(budget.describe(plan, args.batch_size))
  it = iter(data.dataset(tokens, mask, args.batch_size // k, seed=args.seed))
  results = train_all(args, loss, params0, data.windows(it, k, args.steps), held_out)
  print(report.table(results))
  print(budget.step_peaks(plan, results))
  line = noise_scale_hook(results)
  if line:
    print(line)
  write(args, results, plan, k, time.perf_counter() - start)
  return results


def write(args, results, plan, k: int, seconds: float) -> None:
  """results.md (command, budget line, table), results.json (the figures the guide quotes)
  and lm_loss.png under ``--out``."""
  os.makedirs(args.out, exist_ok=True)
  png = os.path.join(args.out, "lm_loss.png")
  title = f"Byte LM on the stdlib, batch {args.batch_size} = {k} x {args.batch_size // k}"
  report.plot(results, png, title)
  floor = results[-1].max_param_diff
  naive = next(r for r in results if r.name == "naive")
  text = [
    "# Language model: large batch, accumulation, naive mean of means",
    "",
    f"Made by `{args.command}`.",
    "",
    f"{budget.describe(plan, args.batch_size)}.",
    "",
    report.markdown(results),
    "",
    f"{budget.step_peaks(plan, results)}. Held-out loss: the token-mean loss of the "
    f"{EVAL_DOCS} documents after the training ones, after training (the progress bars show "
    "each step's training loss). tokens/s: the median over windows, after a warm-up window.",
    "",
    f"{noise_scale_hook(results) or 'B_simple: not measured'}. {report.NOISE_NOTE}",
    "",
    f"float32 floor (the large batch with its rows reordered): max |Δθ| {floor:.2e}; "
    f"naive: {naive.max_param_diff:.2e}, held-out loss "
    f"{naive.final_loss - results[0].final_loss:+.5f} vs the large batch.",
    "",
    f"Wall time {seconds:.0f} s on {platform.machine()} ({os.cpu_count()} cores), "
    f"jax {jax.__version__}, {jax.devices()[0].platform}, load average {os.getloadavg()[0]:.1f} "
    "at the end; tokens/s excludes compilation.",
  ]
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write("\n".join(text) + "\n")
  quoted = report.figures(results, plan, args.batch_size, k, seconds)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"command": args.command, "figures": quoted}, f, indent=1, ensure_ascii=False)
  print(f"table and loss curves written to {args.out}/ (results.md, lm_loss.png)")
