"""Tables (Markdown, JSON), target verdicts and plots (PNG) from the benchmark rows."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks._harness import MMAP_THRESHOLD, fmt_bytes

# Names the targets refer to.
ADAM = "adam (floor)"
ACC = "accumulate"
MULTI = "optax.MultiSteps"
FAST = "TrainStep"  # the fastest documented path
OURS_WITHIN = "optax_accum.microbatch"
OPTAX_WITHIN = "optax.microbatching.microbatch"


def _ms(s):
  return f"{s * 1e3:.2f}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
  out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(out)


def _verdict(ok: bool | None) -> str:
  return "–" if ok is None else ("met" if ok else "**missed**")


def _extra_state(r) -> int:
  """State bytes beyond Adam's and (for k > 1) one float32 accumulator of the parameters."""
  return r["state_minus_adam"] - (r["param_bytes"] if r["k"] > 1 else 0)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
  """Each BENCHMARKS.md target with the figure measured in this run and met/missed."""
  out = []
  cross = [r for r in res.get("cross", []) if r["k"] > 1]
  for model in dict.fromkeys(r["model"] for r in cross):

    def ratio_target(name, key, limit, what, model=model):
      rs = [r for r in cross if r["model"] == model and r["contender"] == name]
      if not rs:
        return
      worst = max(rs, key=lambda r: r[key])
      out.append(
        {
          "figure": f"cross-step ({model}, k>1): {what}",
          "target": f"≤ {limit:.2f}",
          "measured": f"{worst[key]:.2f} (worst: k={worst['k']})",
          "ok": all(r[key] <= limit for r in rs),
        }
      )

    ratio_target(
      ACC, "ratio_vs_adam", 1.10, "accumulate(adam,k) defaults / plain adam, optax protocol"
    )
    ratio_target(ACC, "ratio_vs_multisteps", 0.65, "accumulate(adam,k) defaults / MultiSteps")
    ratio_target(FAST, "ratio_vs_adam", 0.95, "fastest path, TrainStep defaults / plain adam")
    ratio_target(FAST, "ratio_vs_multisteps", 0.65, "TrainStep defaults / optax.MultiSteps")
  ones = [r for r in res.get("cross", []) if r["contender"] == ACC and r["k"] == 1]
  if ones:
    worst = max(ones, key=lambda r: r["ratio_vs_adam"])
    out.append(
      {
        "figure": "cross-step: accumulate(adam, 1) / plain adam (DESIGN: k=1 costs no extra time)",
        "target": "≤ 1.10",
        "measured": f"{worst['ratio_vs_adam']:.2f} (worst: {worst['model']})",
        "ok": all(r["ratio_vs_adam"] <= 1.10 for r in ones),
      }
    )
  if cross:
    for name in (ACC, FAST):
      # every k, k=1 included: "every_k == 1 must cost no accumulator and no extra time"
      rs = [r for r in res["cross"] if r["contender"] == name]
      if not rs:
        continue
      worst = max(rs, key=lambda r: r["temp_minus_adam"] / r["param_bytes"])
      out.append(
        {
          "figure": f"cross-step: compiled temp bytes of {name} − adam's (donated)",
          "target": "≤ one parameter-sized buffer",
          "measured": f"{worst['temp_minus_adam'] / worst['param_bytes']:+.2f} param buffers "
          f"({fmt_bytes(worst['temp_minus_adam'])}; {worst['model']}, k={worst['k']})",
          "ok": all(r["temp_minus_adam"] <= r["param_bytes"] for r in rs),
        }
      )
  all_cross = [r for r in res.get("cross", []) if r["contender"] == ACC]
  if all_cross:
    # The accumulator holds float32 sums of float32 params: exactly param_bytes, plus a few
    # scalars (counters, the weight); at k=1 none.
    def ok(r):
      return 0 <= _extra_state(r) <= 64

    out.append(
      {
        "figure": "cross-step: optimizer-state bytes of accumulate − adam's",
        "target": "one accumulator (k>1), none at k=1 (+ scalars)",
        "measured": "; ".join(
          f"{r['model']} k={r['k']}: {_extra_state(r)} B beyond"
          + (" 1 accumulator" if r["k"] > 1 else " none")
          for r in all_cross
        ),
        "ok": all(ok(r) for r in all_cross),
      }
    )
  within = [r for r in res.get("within", []) if r["contender"] == OURS_WITHIN]
  if within:
    big = [r for r in within if r["micro_batch"] >= 128 and r["k"] > 1]
    if big:
      worst = max(big, key=lambda r: r["ratio_vs_large"])
      out.append(
        {
          "figure": "within-step: time per example / single large batch (micro-batch ≥ 128 rows)",
          "target": "≤ 1.10",
          "measured": f"{worst['ratio_vs_large']:.2f} (worst, k={worst['k']}); median over k "
          f"{statistics.median(r['ratio_vs_large'] for r in big):.2f}",
          "ok": all(r["ratio_vs_large"] <= 1.10 for r in big),
        }
      )
    rs = [r for r in within if r["k"] > 1]
    worst = max(rs, key=lambda r: r["ratio_vs_optax"])
    out.append(
      {
        "figure": "within-step: time per example / optax.microbatching.microbatch",
        "target": "≤ 1.00",
        "measured": f"{worst['ratio_vs_optax']:.2f} (worst, k={worst['k']}); median over k "
        f"{statistics.median(r['ratio_vs_optax'] for r in rs):.2f}",
        "ok": all(r["ratio_vs_optax"] <= 1.00 for r in rs),
      }
    )
    worst = max(rs, key=lambda r: r["peak_vs_large"] - r["peak_target"])
    out.append(
      {
        "figure": "within-step: peak bytes at k / large batch",
        "target": "≤ 1/k + grad/peak + 5%",
        "measured": f"{worst['peak_vs_large']:.3f} vs {worst['peak_target']:.3f} "
        f"(tightest, k={worst['k']}); met at k = "
        + ", ".join(str(r["k"]) for r in rs if r["peak_vs_large"] <= r["peak_target"]),
        "ok": all(r["peak_vs_large"] <= r["peak_target"] for r in rs),
      }
    )
    ct = res.get("within_compile")
    if ct:
      ours = ct[OURS_WITHIN]
      out.append(
        {
          "figure": f"within-step: compile time at k={ct['k_hi']} / k={ct['k_lo']} (median of "
          "interleaved compiles)",
          "target": "≤ 1.5",
          "measured": f"{ours['ratio']:.2f} ({ours['hi_s']:.2f} s / {ours['lo_s']:.2f} s; "
          f"optax.microbatching {ct[OPTAX_WITHIN]['ratio']:.2f})",
          "ok": ours["ratio"] <= 1.5,
        }
      )
  ours = ("accumulate(axis_name)", "microbatch(axis_name)")
  plain = ("plain jit: microbatch(axis_name)", "plain jit: TrainStep(axis_name)",
           "plain jit: accumulate(axis_name)")  # fmt: skip
  dist = [
    (r, r["all_reduce_ops"]) for r in res.get("distributed", []) if r["contender"].startswith(ours)
  ] + [
    (r, r["gradient_reductions"])
    for r in res.get("distributed", [])
    if r["contender"].startswith(plain) and "gradient_reductions" in r
  ]
  if dist:
    out.append(
      {
        "figure": "distributed: gradient all-reduces per update (8 host devices; shard_map "
        "and plain jit)",
        "target": "one (fused) per gradient, independent of k",
        "measured": ", ".join(f"{r['contender']} k={r['k']}: {n:.0f}" for r, n in dist),
        "ok": all(n == 1 for _, n in dist),
      }
    )
  return out


def markdown(res: dict[str, Any]) -> str:
  meta = res["meta"]
  parts = [
    f"# optax_accum benchmarks — {meta['backend']} ({meta['device']})",
    "",
    f"`{meta['command']}` · {meta['date']} · jax {meta['jax']}, optax {meta['optax']} · "
    f"scale `{meta['scale']}` · {meta['cpu_count']} host CPUs · total {meta['seconds']:.0f} s",
    "",
    "Times are medians over rounds that alternate the contenders; spread is the inter-quartile "
    "range relative to the median; ratios are medians of per-round ratios (contenders measured "
    "back to back). Memory is XLA's `compiled.memory_analysis()` with params and optimizer "
    "state donated. Every equivalent contender was checked against the large-batch result "
    "before it was timed.",
    "",
  ]
  if res.get("targets"):
    parts += [
      "## Targets",
      "",
      _table(
        ["figure", "target", "measured", "verdict"],
        [[t["figure"], t["target"], t["measured"], _verdict(t["ok"])] for t in res["targets"]],
      ),
      "",
    ]
  cross = res.get("cross", [])
  for model in dict.fromkeys(r["model"] for r in cross):
    rs = [r for r in cross if r["model"] == model]
    info = res["meta"]["models"].get(model, {})
    parts += [
      f"## Cross-step: {model} ({info.get('params', '?'):,} params, micro-batch "
      f"{info.get('micro', '?')})",
      "",
      _table(
        [
          "k",
          "contender",
          "ms / micro-step",
          "spread",
          "× adam",
          "× MultiSteps",
          "temp",
          "temp − adam (param bufs)",
          "faults / step",
          "opt state",
          "state − adam",
          "copy bytes",
          "conds",
          "compile s",
        ],
        [
          [
            r["k"],
            r["contender"],
            _ms(r["time"]["median_s"]),
            f"±{r['time']['iqr_rel'] * 50:.0f}%",
            f"{r['ratio_vs_adam']:.2f}",
            f"{r['ratio_vs_multisteps']:.2f}",
            fmt_bytes(r["temp_bytes"]) + (" ⚠" if r["temp_bytes"] > MMAP_THRESHOLD else ""),
            f"{r['temp_minus_adam'] / r['param_bytes']:+.2f}",
            f"{r['faults_per_step']:.0f}",
            fmt_bytes(r["state_bytes"])
            + (f" (+{fmt_bytes(r['extra_bytes'])} buffer)" if r.get("extra_bytes") else ""),
            fmt_bytes(r["state_minus_adam"]),
            fmt_bytes(r["copy_bytes"]),
            r["conditionals"],
            f"{r['compile_s']:.2f}",
          ]
          for r in rs
        ],
      ),
      "",
      "Two-program contenders: temp is the larger of the two programs; copies and conditionals "
      "are summed over both (see `results.json` for each program, with its own page faults). "
      "⚠: temp above glibc's mmap threshold (32 MiB): on CPU such a program gets fresh pages "
      "on every call and faults each one in — *faults / step* (minor page faults per "
      "micro-step, `getrusage`) is that cost, which `cost_analysis()` does not see. TrainStep's "
      "opt state shows its gradient buffer separately: it lives in the helper (on CPU), not in "
      "the optimizer state.",
      "",
    ]
  disp = [r for r in cross if r.get("dispatch")]
  if disp:
    parts += [
      "## Emission strategies",
      "",
      "Device conditional (`accumulate`, `lax.cond` on the step counter), static two-program "
      "emission (host counter: `TrainStep`, hand-built), select (`optax.MultiSteps`, inner "
      "update on every step). *dispatch share* = time to dispatch a window of steps without "
      "blocking / time until it finished: near 1 means the host waited for the device (a sync "
      "per step); small means asynchronous dispatch ran ahead."
      + (
        " On CPU a conditional is decided on the host thread that runs the program, so no "
        "strategy stalls dispatch here; the GPU behaviour (a predicate copied back per "
        "conditional) needs `--scale gpu` on a GPU."
        if res["meta"]["backend"] == "cpu"
        else ""
      ),
      "",
      _table(
        ["model", "k", "contender", "× adam", "dispatch share", "conds", "copy bytes"],
        [
          [
            r["model"],
            r["k"],
            r["contender"],
            f"{r['ratio_vs_adam']:.2f}",
            f"{r['dispatch']['dispatch_frac']:.2f}",
            r["conditionals"],
            fmt_bytes(r["copy_bytes"]),
          ]
          for r in disp
        ],
      ),
      "",
    ]
  within = [r for r in res.get("within", []) if "case" not in r]
  padded = [r for r in res.get("within", []) if r.get("case") == "padded"]
  if within:
    info = res["meta"].get("within_model", {})
    parts += [
      f"## Within-step: global batch {info.get('global_batch', '?')}, {info.get('name', '')} "
      f"({info.get('params', '?'):,} params)",
      "",
      _table(
        [
          "k",
          "micro-batch",
          "contender",
          "µs / example",
          "spread",
          "× large",
          "× optax",
          "peak",
          "peak / large",
          "target",
          "compile s",
          "while loops",
        ],
        [
          [
            r["k"],
            r["micro_batch"],
            r["contender"],
            f"{r['time_per_example']['median_s'] * 1e6:.2f}",
            f"±{r['time_per_example']['iqr_rel'] * 50:.0f}%",
            f"{r['ratio_vs_large']:.2f}",
            f"{r['ratio_vs_optax']:.2f}",
            fmt_bytes(r["peak_bytes"]),
            f"{r['peak_vs_large']:.3f}",
            f"{r['peak_target']:.3f}",
            f"{r['compile_s']:.2f}",
            r["hlo"]["whiles"],
          ]
          for r in within
        ],
      ),
      "",
      "The Python loop's peak is its micro-step program's; its compile time does not grow "
      "with k either (one program, k dispatches).",
      "",
    ]
  if padded:
    parts += [
      "## Within-step: a padded last batch (n of k micro-batches real)",
      "",
      "The same global batch, of which only the first n micro-batches hold real rows (the last, "
      "partly empty batch of an epoch). `num_real_microbatches=n` is traced: one compiled "
      "program serves every n, for both libraries (optax with `RUNNING_MEAN`, the mean over "
      "the micro-batches that ran — its `MEAN` divides by k). Both agreed with the large batch "
      "of the real rows before timing. *call / all real* is the time of one call at n over the "
      "same program with all k real: n/k when the loop stops early.",
      "",
      _table(
        [
          "n/k",
          "contender",
          "µs / real example",
          "× large (real rows)",
          "× optax",
          "call / all real",
        ],
        [
          [
            f"{r['num_real']}/{r['k']}",
            r["contender"].split(",")[0],
            f"{r['time_per_example']['median_s'] * 1e6:.2f}",
            f"{r['ratio_vs_large']:.2f}",
            f"{r['ratio_vs_optax']:.2f}",
            "–" if r.get("call_vs_all_real") is None else f"{r['call_vs_all_real']:.2f}",
          ]
          for r in padded
        ],
      ),
      "",
    ]
  prec = res.get("precision", [])
  if prec:
    parts += [
      "## Precision: bf16 gradients, mean of k micro-batches",
      "",
      "Relative L2 error of the (bf16) result against the float64 mean of the same bf16 "
      "gradients; the floor is that exact mean rounded to bf16.",
      "",
      _table(
        ["k", "contender", "rel. L2 error", "max abs error", "× floor"],
        [
          [
            r["k"],
            r["contender"],
            f"{r['rel_l2']:.2e}",
            f"{r['max_abs']:.2e}",
            f"{r['vs_floor']:.2f}" if "vs_floor" in r else "1",
          ]
          for r in prec
        ],
      ),
      "",
    ]
  dist = res.get("distributed", [])
  if dist:
    parts += [
      f"## Distributed: {dist[0]['devices']} devices, all-reduces per optimizer update",
      "",
      "Counted in the optimised HLO; an all-reduce inside a conditional branch runs once per "
      "window, one inside a loop body once per micro-batch, one in a per-micro-step program "
      "on every micro-step. *gradient-sized*: reductions whose result holds at least 1 KiB "
      "(a loss or a total weight is a few bytes; `TrainStep(axis_name)` averages its loss "
      "over the devices on every micro-step). Plain-jit rows (GSPMD, no hand-written "
      "`shard_map`) name the mesh's axis type; FSDP rows shard the parameters over the data "
      "axis.",
      "",
      _table(
        [
          "section",
          "k",
          "contender",
          "all-reduces / update",
          "of them gradient-sized",
          "all-gathers / update",
          "bytes all-reduced / update",
          "ms / update",
          "param bytes",
        ],
        [
          [
            r["section"],
            r["k"],
            r["contender"],
            f"{r['all_reduce_ops']:.0f}",
            "–" if r.get("gradient_reductions") is None else f"{r['gradient_reductions']:.0f}",
            "–" if r.get("all_gather_ops") is None else f"{r['all_gather_ops']:.0f}",
            fmt_bytes(r.get("bytes")),
            "–" if r.get("time_per_update_s") is None else _ms(r["time_per_update_s"]),
            fmt_bytes(r["param_bytes"]),
          ]
          for r in dist
        ],
      ),
      "",
    ]
  fsdp = [r for r in dist if r["section"] == "fsdp"]
  if fsdp:
    parts += [
      "### FSDP: memory per device of the two choices",
      "",
      "Parameters and Adam state sharded over the data axis. *defer*: one reduction per "
      "update, a full-size accumulator on every device; *per micro-batch/step*: GSPMD reduces "
      "every micro-batch into an accumulator sharded like the parameters (on CPU an all-reduce "
      "and a slice, not a true reduce-scatter). XLA's memory analysis, per device.",
      "",
      _table(
        ["k", "choice", "params / device", "state / device", "temp", "peak"],
        [
          [
            r["k"],
            r["contender"],
            fmt_bytes(r.get("param_bytes_per_device")),
            fmt_bytes(r.get("state_bytes_per_device")),
            fmt_bytes(r.get("temp_bytes")),
            fmt_bytes(r.get("peak_bytes")),
          ]
          for r in fsdp
        ],
      ),
      "",
    ]
  return "\n".join(parts)


def plots(res: dict[str, Any], out: Path) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = []
  backend = res["meta"]["backend"]
  cross = res.get("cross", [])
  for model in dict.fromkeys(r["model"] for r in cross):
    rs = [r for r in cross if r["model"] == model]
    ks = sorted({r["k"] for r in rs})
    names = list(dict.fromkeys(r["contender"] for r in rs))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
      for ax, key, scale in ((axes[0], "ratio_vs_adam", 1), (axes[1], "temp_bytes", 1e-6)):
        vals = [
          next((r[key] * scale for r in rs if r["k"] == k and r["contender"] == n), 0) for k in ks
        ]
        ax.bar([j + i * width for j in range(len(ks))], vals, width, label=n)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhline(0.95, color="g", lw=0.8, ls="--")
    axes[0].set_ylabel("time per micro-step / plain adam")
    axes[1].set_ylabel("compiled temp MB (donated)")
    for ax in axes:
      ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ks))], [f"k={k}" for k in ks])
    axes[0].legend(fontsize=7)
    fig.suptitle(f"cross-step, {model} ({backend})")
    fig.tight_layout()
    f = out / f"cross_{model}.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f.name)
  within = [r for r in res.get("within", []) if "case" not in r]
  if within:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for n in dict.fromkeys(r["contender"] for r in within):
      rs = [r for r in within if r["contender"] == n]
      ks = [r["k"] for r in rs]
      axes[0].plot(ks, [r["time_per_example"]["median_s"] * 1e6 for r in rs], "o-", label=n)
      axes[1].plot(ks, [r["peak_bytes"] / 1e6 for r in rs], "o-", label=n)
      axes[2].plot(ks, [r["compile_s"] for r in rs], "o-", label=n)
    axes[0].set_ylabel("µs per example")
    axes[1].set_ylabel("compiled peak MB")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("compile s")
    for ax in axes:
      ax.set_xscale("log", base=2)
      ax.set_xlabel("k micro-batches (fixed global batch)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"within-step ({backend})")
    fig.tight_layout()
    f = out / "within.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f.name)
  prec = res.get("precision", [])
  if prec:
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ks = sorted({r["k"] for r in prec})
    names = list(dict.fromkeys(r["contender"] for r in prec))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
      vals = [
        next((r["rel_l2"] for r in prec if r["k"] == k and r["contender"] == n), 0) for k in ks
      ]
      ax.bar([j + i * width for j in range(len(ks))], vals, width, label=n)
    ax.set_yscale("log")
    ax.set_ylabel("relative L2 error vs float64")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ks))], [f"k={k}" for k in ks])
    ax.legend(fontsize=7)
    ax.set_title(f"bf16 gradients: accumulator precision ({backend})")
    fig.tight_layout()
    f = out / "precision.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f.name)
  return files


def write(res: dict[str, Any], out: Path) -> list[str]:
  out.mkdir(parents=True, exist_ok=True)
  res["targets"] = targets(res)
  (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
  files = ["results.json", "results.md"]
  try:
    files += plots(res, out)
  except Exception as e:  # a missing matplotlib must not lose the tables
    print(f"[report] plots skipped: {type(e).__name__}: {e}")
  md = markdown(res)
  if len(files) > 2:
    md += "\n## Plots\n\n" + "\n".join(f"![{f}]({f})" for f in files[2:]) + "\n"
  (out / "results.md").write_text(md)
  return files
