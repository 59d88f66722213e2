"""The language-model task's table (text and Markdown) and figure (loss curves, PNG)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optax_accum.demo.lm.methods import FLOOR, Result

MIB = 2.0**20

_COLUMNS = (
  "method", "held-out loss", "max |Δθ| vs large", "tokens/s", "peak memory", "B_simple"
)  # fmt: skip
NOISE_NOTE = (
  "B_simple = tr Σ / |G|², the gradient noise scale (McCandlish et al. 2018), is measured by "
  "`TrainStep(..., noise_scale=True)` from the token-weighted micro-batches of each window, in "
  "tokens; it predicts the critical batch and grows as the loss falls"
)


def rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
  """One tuple of formatted cells per run, in `_COLUMNS` order."""
  return [
    (
      r.name,
      f"{r.final_loss:.5f}",
      "0 (reference)" if r is results[0] else f"{r.max_param_diff:.2e}",
      f"{r.tokens_per_s:,.0f}",
      f"{r.peak_bytes / 2**20:.1f} MiB" if r.peak_bytes else "n/a",
      "—" if r.b_simple is None else f"{r.b_simple[-1]:,.0f} tokens",
    )
    for r in results
  ]


def table(results: Sequence[Result]) -> str:
  """A fixed-width text table for the terminal."""
  widths = (24, 15, 20, 12, 13, 16)
  fmt = lambda cells: "".join(  # noqa: E731
    f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
    for i, (c, w) in enumerate(zip(cells, widths, strict=True))
  )
  head = fmt(_COLUMNS)
  return "\n".join([head, "-" * len(head)] + [fmt(r) for r in rows(results)])


def figures(results: Sequence[Result], plan, batch_size: int, k: int, seconds: float) -> dict:
  """The figures the language-model guide quotes, formatted as it prints them, by name: the
  docs build substitutes them from the committed run's results.json (``{{ lm_<name> }}``)."""
  by = {r.name: r for r in results}
  large, naive, noisy = results[0], by["naive"], by["TrainStep"]
  ours = [by["TrainStep"], by["microbatch"]]
  dist = lambda r: np.abs(r.losses - large.losses)  # noqa: E731
  known = noisy.b_simple[np.isfinite(noisy.b_simple)]
  return {
    "k": str(k),
    "micro_rows": str(batch_size // k),
    "steps": str(len(large.losses)),
    "batch_size": str(batch_size),
    "budget_mib": f"{plan.memory_limit / MIB:.1f}",
    "large_peak_mib": f"{large.peak_bytes / MIB:.1f}",
    "trainstep_peak_mib": f"{by['TrainStep'].peak_bytes / MIB:.1f}",
    "microbatch_peak_mib": f"{by['microbatch'].peak_bytes / MIB:.1f}",
    "ours_diff_min": f"{min(r.max_param_diff for r in ours):.1e}",
    "ours_diff_max": f"{max(r.max_param_diff for r in ours):.1e}",
    "floor_diff": f"{by[FLOOR].max_param_diff:.1e}",
    "ours_loss_dist_max": f"{max(dist(r).max() for r in ours):.0e}",
    # from its first update on (before it, every run has the same parameters)
    "naive_loss_dist_min": f"{dist(naive)[1:].min():.0e}",
    "naive_loss_dist_max": f"{dist(naive).max():.0e}",
    "naive_diff": f"{naive.max_param_diff:.1e}",
    "naive_heldout_gap": f"{naive.final_loss - large.final_loss:.4f}",
    "b_simple_first": f"{known[0]:,.0f}" if known.size else "n/a",
    "b_simple_last": f"{known[-1]:,.0f}" if known.size else "n/a",
    "batch_tokens": f"{noisy.tokens / len(noisy.losses):,.0f}",
    "loss_first": f"{large.losses[0]:.1f}",
    "loss_last": f"{large.losses[-1]:.1f}",
    "wall_s": f"{seconds:.0f}",
  }


def markdown(results: Sequence[Result]) -> str:
  """The same table in Markdown."""
  lines = ["| " + " | ".join(_COLUMNS) + " |", "|---" + "|---:" * (len(_COLUMNS) - 1) + "|"]
  lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
  lines[0] = lines[0].replace("|Δθ|", "\\|Δθ\\|")  # a literal bar inside a cell
  return "\n".join(lines)


_STYLE = {
  "large batch": dict(ls="-", lw=3.0, color="0.6"),
  "TrainStep": dict(ls="--", lw=1.6, color="C0"),
  "microbatch": dict(ls=":", lw=1.8, color="C2"),
  "naive": dict(ls="-", lw=1.2, color="C3"),
  FLOOR: dict(ls="-", lw=1.0, color="0.3", label=f"{FLOOR} (float32 alone)"),
}


def _zoom(ax, results, steps, said) -> None:
  """An inset on the last fifth of the run: the naive curves apart, ours on the reference."""
  tail = slice(len(steps) - max(len(steps) // 5, 2), None)
  # Upper right: above the curves, which fall from the upper left to the lower right.
  inset = ax.inset_axes([0.5, 0.5, 0.47, 0.42])
  for r in results:
    if r.name != FLOOR:
      inset.plot(steps[tail], r.losses[tail], **_STYLE.get(r.name, {}))
  inset.plot(steps[tail], next(r for r in results if r.name == "naive").reported[tail], **said)
  inset.set_title("last steps, zoomed", fontsize=9)
  inset.tick_params(labelsize=8)
  inset.grid(alpha=0.3)


def _noise_panel(ax, results, steps) -> None:
  """B_simple in tokens over training (the smoothed curve and each window's own estimate),
  against the real tokens of one optimizer step's batch."""
  noisy = next((r for r in results if r.b_simple is not None), None)
  if noisy is None:
    ax.set_axis_off()
    return
  window, batch = noisy.window_b_simple, noisy.tokens / len(steps)
  # A window whose Q is not positive (the noise swamps the gradient at this k) has no ratio to
  # draw on a log scale: counted in the legend instead.
  shown = np.where(window > 0, window, np.nan)
  unshown = int(np.sum(~(window > 0)))
  ax.plot(steps, shown, ".", ms=4, color="0.55",
          label=f"one window's T / Q ({unshown} with Q ≤ 0 not drawn)")  # fmt: skip
  ax.plot(steps, noisy.b_simple, "-", lw=2.0, color="C0", label="B_simple (EMAs of T and Q)")
  ax.axhline(batch, ls=":", color="C3", label="the batch's real tokens")
  positive = noisy.b_simple[noisy.b_simple > 0]
  low = min(positive.min(), batch) / 3 if positive.size else batch / 100
  ax.set_yscale("log")
  ax.set_ylim(low, 10 * max(positive.max() if positive.size else batch, batch))
  ax.set(
    xlabel="optimizer step",
    ylabel="tokens",
    title=f"Gradient noise scale, measured by {noisy.name}",
  )
  ax.grid(alpha=0.3)
  ax.legend(fontsize=9)


def plot(results: Sequence[Result], out: str, title: str) -> None:
  """Loss curves (top), each run's distance to the large batch's curve (middle), and the
  gradient noise scale B_simple in tokens that the `TrainStep` run measured (bottom): one
  column, so that the figure stays legible at a page's width."""
  from optax_accum.demo.lm import require  # noqa: PLC0415

  matplotlib = require("matplotlib")
  matplotlib.use("Agg")
  plt = require("matplotlib.pyplot")
  plt.rcParams.update({"font.size": 11})
  fig, (ax, ax_diff, ax_noise) = plt.subplots(3, 1, figsize=(9, 13))
  ref = results[0].losses
  steps = np.arange(1, len(ref) + 1)
  for r in results:
    if r.name != FLOOR:
      ax.plot(steps, r.losses, label=r.name, **_STYLE.get(r.name, {}))
    if r is not results[0]:
      style = {"label": r.name, **_STYLE.get(r.name, {})}
      ax_diff.semilogy(steps, np.maximum(np.abs(r.losses - ref), 1e-9), **style)
  naive = next(r for r in results if r.name == "naive")
  said = dict(ls="-", lw=0.8, color="C3", alpha=0.45, label="naive, as it reports (mean of means)")
  ax.plot(steps, naive.reported, **said)
  ax_diff.semilogy(steps, np.maximum(np.abs(naive.reported - ref), 1e-9), **said)
  _zoom(ax, results, steps, said)
  ax.set(xlabel="optimizer step", ylabel="loss per real token (nats)", title=title)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower left", fontsize=9)
  ax_diff.set(
    xlabel="optimizer step",
    ylabel="|loss − large-batch loss| (floor 1e-9)",
    title="Distance to the large batch's loss, per step",
  )
  ax_diff.grid(alpha=0.3)
  ax_diff.legend(fontsize=9, loc="best")
  _noise_panel(ax_noise, results, steps)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
