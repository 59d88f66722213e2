"""The language-model task's table (text and Markdown) and figure (loss curves, PNG)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optax_accum._lm.methods import FLOOR, Result

_COLUMNS = ("method", "final loss", "max |Δθ| vs large", "tokens/s", "peak memory")


def rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
  """One tuple of formatted cells per run, in `_COLUMNS` order."""
  return [
    (
      r.name,
      f"{r.final_loss:.5f}",
      "0 (reference)" if r is results[0] else f"{r.max_param_diff:.2e}",
      f"{r.tokens / r.seconds:,.0f}",
      f"{r.peak_bytes / 2**20:.1f} MiB" if r.peak_bytes else "n/a",
    )
    for r in results
  ]


def table(results: Sequence[Result]) -> str:
  """A fixed-width text table for the terminal."""
  widths = (24, 12, 20, 12, 13)
  fmt = lambda cells: "".join(  # noqa: E731
    f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
    for i, (c, w) in enumerate(zip(cells, widths, strict=True))
  )
  head = fmt(_COLUMNS)
  return "\n".join([head, "-" * len(head)] + [fmt(r) for r in rows(results)])


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
  inset = ax.inset_axes([0.38, 0.2, 0.58, 0.3])
  for r in results:
    if r.name != FLOOR:
      inset.plot(steps[tail], r.losses[tail], **_STYLE.get(r.name, {}))
  inset.plot(steps[tail], next(r for r in results if r.name == "naive").reported[tail], **said)
  inset.set_title("last steps, zoomed", fontsize=8)
  inset.tick_params(labelsize=7)
  inset.grid(alpha=0.3)


def plot(results: Sequence[Result], out: str, title: str) -> None:
  """Loss curves (left) and each run's distance to the large batch's curve (right)."""
  from optax_accum._lm import require  # noqa: PLC0415

  matplotlib = require("matplotlib")
  matplotlib.use("Agg")
  plt = require("matplotlib.pyplot")
  fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.4))
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
  ax.legend(loc="upper right", fontsize=8)
  ax_diff.set(
    xlabel="optimizer step",
    ylabel="|loss − large-batch loss| (floor 1e-9)",
    title="Distance to the large batch's loss, per step",
  )
  ax_diff.grid(alpha=0.3)
  ax_diff.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
