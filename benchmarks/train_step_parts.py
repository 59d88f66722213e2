"""Where `TrainStep`'s time goes on the optax notebook's MLP, against the hand-written loop.

Issue 42, item 7 asks for `TrainStep` within 1.10× of the hand loop per micro-step on that MLP
(784-32-32-10, b = 3, k = 3). This splits the gap, side by side in one run (medians over
rotating rounds, µs per micro-step):

* the whole contenders: `TrainStep`, the hand loop (`small_models.HandLoop`), and `TrainStep`
  with ``skip_nonfinite=False`` (what the per-micro-batch NaN/Inf check costs);
* a minimal driver: `TrainStep`'s own dispatch of its compiled programs, with no
  `TrainStep.__call__` (its checks) around it (what its Python costs);
* each program alone, called back to back on its own outputs: `TrainStep`'s accumulating and
  emitting programs (in the lean calling convention of `optax_accum.front_ends._lean`: only the
  state's arrays each reads or writes), the hand loop's ``acc + grad`` and closing ones (what
  the programs cost apart from the order they run in); and the accumulating program called
  through `jax.stages.Compiled.__call__`, whose Python frame `TrainStep` skips
  (`TrainStep._direct`);
* the hand loop made NaN-safe as `TrainStep` is (`small_models.NanSafeHandLoop`: a
  micro-batch with a NaN or Inf gradient adds nothing and is counted, the mean divides by the
  micro-batches kept), with the library's own finite check: the floor for what `TrainStep`
  promises; and the same with 4 more scalar counters carried through every call (what a
  state's scalars cost).

    python benchmarks/train_step_parts.py            # writes results/cpu/train_step_parts.md

About a minute on 2 CPUs with the default 9 rounds; the committed run used ``ROUNDS=201``
(5 minutes): this machine's noise needs them.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optax_accum  # noqa: E402
from benchmarks import _harness as H  # noqa: E402
from benchmarks import small_models as sm  # noqa: E402
from optax_accum.front_ends import _lean  # noqa: E402

REPEATS = 300  # windows per sample


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def contenders(s, params, micro):
  cross = sm.cross_runners(s, params, micro)
  ts, hand = cross["TrainStep"], cross["hand loop"]
  plain = sm.Train(params, s.model.loss, s.k, micro, skip_nonfinite=False)
  # A TrainStep of its own for the minimal driver (it moves that object's window position).
  step = optax_accum.TrainStep(s.model.loss, sm.adam(), s.k)
  own = {"p": _copy(params), "s": step.init(_copy(params))}
  own["p"], own["s"], _ = step(own["p"], own["s"], micro[0])  # compiled, the programs chosen
  own["p"], own["s"], _ = step(own["p"], own["s"], micro[1])
  own["p"], own["s"], _ = step(own["p"], own["s"], micro[2])
  assert step._lean  # the lean calling convention (`front_ends._lean`)
  # What TrainStep calls: each compiled program's own C++ call (`TrainStep._direct`)
  accumulating, emitting = step._direct(False), step._direct(True)

  def minimal():  # TrainStep's dispatch of its programs, without TrainStep.__call__'s checks
    for i, mb in enumerate(micro):
      emit = i == len(micro) - 1
      own["p"], own["s"], _, value = step._dispatch(emit, own["p"], own["s"], (), (mb,), None)
      step._position = 0 if emit else step._position + 1
    return value

  # Each program alone on its own outputs (the state's other fields as the first call left them).
  reads, part = _lean.operands(False, step.init(_copy(params)), step._layout)

  def accumulating_alone(program):
    acc = {"part": _copy(part)}

    def run():
      for mb in micro:
        acc["part"], _, value = program(params, reads, acc["part"], (), (mb,), None)
      return value

    return run

  reads_e, part_e = _lean.operands(True, step.init(_copy(params)), step._layout)
  closing = {"p": _copy(params), "part": part_e}

  def emitting_alone():
    for mb in micro:
      out = emitting(closing["p"], reads_e, closing["part"], (), (mb,), None)
      closing["p"], written, _, value = out
      closing["part"] = written[:5] + written[6:]  # (less `updated`, which it only writes)
    return value

  add = {"a": jax.tree.map(jnp.zeros_like, params)}

  def add_alone():
    for mb in micro:
      add["a"], value = hand.add(add["a"], params, mb)
    return value

  close = {"a": jax.tree.map(jnp.zeros_like, params), "p": _copy(params), "s": _copy(hand.state)}

  def close_alone():
    for mb in micro:
      close["a"], close["p"], close["s"], value = hand.close(close["a"], close["p"], close["s"], mb)
    return value

  safe = sm.NanSafeHandLoop(params, s.model.loss, s.k, micro)
  counted = sm.NanSafeHandLoop(params, s.model.loss, s.k, micro, counters=4)
  return {
    "hand loop": hand.window,
    "hand loop, NaN-safe (drops and counts)": safe.window,
    "hand loop, NaN-safe, 4 more scalars per call": counted.window,
    "TrainStep": ts.window,
    "TrainStep, skip_nonfinite=False": plain.window,
    "TrainStep's programs, minimal driver": minimal,
    "TrainStep accumulating program alone": accumulating_alone(accumulating),
    "the same through jax.stages.Compiled.__call__": accumulating_alone(step._pair[False]),
    "TrainStep emitting program alone": emitting_alone,
    "hand acc + grad program alone": add_alone,
    "hand closing program alone": close_alone,
  }


def main() -> None:
  rounds = int(os.environ.get("ROUNDS", 9))
  s = sm.models()["notebook_mlp"]
  params, _, micro = sm.inputs(s)
  runs = {n: sm._repeated(f, REPEATS) for n, f in contenders(s, params, micro).items()}
  load = os.getloadavg()[0]
  timed = H.run_side_by_side(runs, rounds=rounds, units=s.k * REPEATS)
  hand = timed["hand loop"]
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  lines = [
    "# TrainStep on the notebook MLP: where the time goes (issue 42, item 7)",
    "",
    f"`ROUNDS={rounds} python benchmarks/train_step_parts.py`; {when}, {jax.default_backend()}, "
    f"{os.cpu_count()} CPUs, jax {jax.__version__}; load average {load:.1f} at the start. "
    f"{s.what}. µs per micro-step (a program alone: per call), median of {rounds} rotating "
    f"rounds of {REPEATS} windows; ratio: median of per-round ratios to the hand loop.",
    "",
    "| contender | µs | / hand loop |",
    "|---|---:|---:|",
  ]
  for n, t in timed.items():
    lines.append(f"| {n} | {t.median * 1e6:.1f} | {H.paired_ratio(t, hand):.2f} |")
  text = "\n".join(lines) + "\n"
  print(text)
  out = sm.OUT / "train_step_parts.md"
  out.write_text(text)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
