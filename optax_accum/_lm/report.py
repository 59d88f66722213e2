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
  return "\n".join(lines)


_STYLE = {
  "large batch": dict(ls="-", lw=3.0, color="0.6"),
  "TrainStep": dict(ls="--", lw=1.6, color="C0"),
  "microbatch": dict(ls=":", lw=1.8, color="C2"),
  "naive": dict(ls="-", lw=1.2, color="C3"),
}


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
    if r.name in _STYLE:
      ax.plot(steps, r.losses, label=r.name, **_STYLE[r.name])
    if r is not results[0]:
      style = _STYLE.get(r.name, dict(ls="-", lw=1.0, color="0.3"))
      diff = np.maximum(np.abs(r.losses - ref), 1e-9)
      ax_diff.semilogy(steps, diff, label=r.name, **style)
  naive = next(r for r in results if r.name == "naive")
  ax.plot(steps, naive.reported, ls="-", lw=0.8, color="C3", alpha=0.5,
          label="naive, as it reports (mean of means)")  # fmt: skip
  ax.set(xlabel="optimizer step", ylabel="loss per real token (nats)", title=title)
  ax.grid(alpha=0.3)
  ax.legend()
  ax_diff.set(
    xlabel="optimizer step",
    ylabel="|loss − large-batch loss| (floor 1e-9)",
    title=f"Distance to the large batch ('{FLOOR}': float32 alone)",
  )
  ax_diff.grid(alpha=0.3)
  ax_diff.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
