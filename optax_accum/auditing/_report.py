"""The audit's report: one row per check, printed as a table, and the comparisons it is made of.

A check's verdict is "ok", "FAIL", "info" (a measurement with nothing to pass or fail) or
"n/a: <reason>" (the check cannot be made on this model or front end, and says why). Every
figure is a deterministic function of the computed values: no verdict depends on timing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Check:
  """One row of an `AuditReport`: what was checked, the verdict, the figure and the threshold."""

  name: str
  verdict: str  # "ok", "FAIL", "info", "n/a: <reason>" or "not judged: <reason>"
  figure: str  # the measured figure, e.g. "3.1e-07 (worst leaf ['w1'])"
  threshold: str  # what the figure was held to, e.g. "<= 3.8e-05 (64·k·eps(float32))"

  @property
  def failed(self) -> bool:
    return self.verdict == "FAIL"

  @property
  def unjudged(self) -> bool:
    """The audit could not judge what this row checks on this loop (and says why): the
    report is then not ok, since a loop it cannot see may be broken."""
    return self.verdict.startswith("not judged")

  def __str__(self) -> str:
    threshold = f" (threshold {self.threshold})" if self.threshold else ""
    return f"{self.name}: {self.verdict}; {self.figure}{threshold}"


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The result of `optax_accum.audit`: one `Check` per row.

  ``str(report)`` is the table; ``report.ok`` is False when any row says FAIL or "not judged"
  (the audit could not see what the loop did, and says why); ``report.assert_ok()`` raises
  `AssertionError` with the table in that case; ``report[name]`` is the row of that name.
  """

  front_end: str
  k: int
  checks: tuple[Check, ...]

  @property
  def ok(self) -> bool:
    return not self.failures

  @property
  def failures(self) -> tuple[Check, ...]:
    """The rows that say FAIL or "not judged"."""
    return tuple(c for c in self.checks if c.failed or c.unjudged)

  def __getitem__(self, name: str) -> Check:
    for c in self.checks:
      if c.name == name:
        return c
    raise KeyError(f"no check named {name!r}; the checks are {[c.name for c in self.checks]}.")

  def assert_ok(self) -> AuditReport:
    """Raises `AssertionError` with the table when any check failed or could not be judged;
    returns the report."""
    if not self.ok:
      names = ", ".join(c.name for c in self.failures)
      what = "failed" if all(c.failed for c in self.failures) else "failed or could not judge"
      raise AssertionError(f"accumulation audit {what} ({names}):\n{self}")
    return self

  def __str__(self) -> str:
    head = ("check", "verdict", "figure", "threshold")
    rows = [head] + [(c.name, c.verdict, c.figure, c.threshold) for c in self.checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"audit of {self.front_end}, k={self.k}"]
    for j, r in enumerate(rows):
      lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
      if j == 0:
        lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(head[3]))
    return "\n".join(lines)

  def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython / MyST-NB cells print the table
    p.text(str(self))


def leaf_rel_diffs(got: Any, want: Any, slack: Any = None) -> list[tuple[str, float]]:
  """Per leaf ``max|got - want| / max|want|`` (float64, on the host), with the leaf's path;
  with `slack` (a tree like `want`), each entry's difference less its allowance (at least 0).

  Relative to the leaf's largest entry rather than entry by entry: an entry near zero would
  turn rounding into an arbitrarily large ratio.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(want)
  got_leaves = jax.tree.leaves(got)
  if len(got_leaves) != len(flat):
    raise ValueError(
      f"audit: the accumulated tree has {len(got_leaves)} leaves, the large batch's {len(flat)}."
    )
  slacks = [0.0] * len(flat) if slack is None else jax.tree.leaves(slack)
  out = []
  for (path, w), g, a in zip(flat, got_leaves, slacks, strict=True):
    w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
    scale = np.max(np.abs(w)) if w.size else 0.0
    err = np.max(np.maximum(np.abs(g - w) - a, 0.0)) if w.size else 0.0
    rel = err / scale if scale > 0 else (0.0 if err == 0 else np.inf)
    out.append((jax.tree_util.keystr(path) or "<root>", float(rel)))
  return out


def worst(diffs: list[tuple[str, float]]) -> tuple[str, float]:
  """The leaf with the largest relative difference (NaN counts as the largest)."""
  return max(diffs, key=lambda d: np.inf if np.isnan(d[1]) else d[1])


def flat(tree: Any) -> np.ndarray:
  """All leaves of a tree as one float64 vector, on the host."""
  leaves = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)]
  return np.concatenate(leaves) if leaves else np.zeros(0)


def rel(got: np.ndarray, want: np.ndarray) -> float:
  """``max|got - want| / max|want|`` of two flat vectors."""
  scale = float(np.max(np.abs(want))) if want.size else 0.0
  err = float(np.max(np.abs(got - want))) if want.size else 0.0
  return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def fit(pieces: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
  """The coefficients ``c`` that make ``pieces.T @ c`` closest to `target` (least squares), and
  the relative residual ``rel(pieces.T @ c, target)``. `pieces` is ``(k, n)``."""
  c, *_ = np.linalg.lstsq(pieces.T, target, rcond=None)
  return c, rel(pieces.T @ c, target)


def fmt(x: float) -> str:
  return f"{x:.1e}"


def coefficient(v: float) -> str:
  """One coefficient to three significant digits (a clip factor of 0.0042 is not 0.00)."""
  return "0" if v == 0 else f"{v:.3g}"


def coefficients(c: np.ndarray) -> str:
  """The first 8 coefficients; those below 1e-9 of the largest (a fit's rounding) as 0."""
  top = float(np.max(np.abs(c), initial=0.0))
  shown = ", ".join(coefficient(float(v) if abs(v) > 1e-9 * top else 0.0) for v in c[:8])
  return f"[{shown}{', …' if len(c) > 8 else ''}]"
