"""Statistical checks for tests: a tolerance of 3 standard errors, with its mutation control.

A statistical test of a privacy quantity (the noise's std) or of an estimator allows about 3
standard errors (SE) of the figure it measures, on fixed seeds, so it is not flaky; and it must
be able to fail: the same check applied to the measured figure scaled by a mis-scaling factor
(the draw 2 % low, 2 % high) must report failure. Both run in the suite, so a test whose sample
is too small to see the mutation fails on its own control rather than passing everything.
"""

from __future__ import annotations

import numpy as np

MUTATIONS = (0.98, 1.02)  # noise 2 % low, 2 % high: each must fail the check
SE_TOLERANCE = 3.0  # standard errors


def within(measured: float, expected: float, se: float) -> bool:
  """``|measured - expected| <= 3 SE``."""
  return bool(abs(measured - expected) <= SE_TOLERANCE * se)


def check(measured: float, expected: float, se: float, what: str, mutations=MUTATIONS) -> None:
  """Asserts `measured` is within 3 SE of `expected`, and that each `mutations` factor times
  `measured` is not (the control: the check can see a mis-scaled quantity)."""
  assert np.isfinite(se) and se > 0, (what, se)
  assert within(measured, expected, se), (
    f"{what}: measured {measured!r}, expected {expected!r}, more than 3 SE = "
    f"{SE_TOLERANCE * se:.3g} apart ({abs(measured - expected) / se:.1f} SE)"
  )
  for factor in mutations:
    assert not within(factor * measured, expected, se), (
      f"{what}: the control failed: {factor} x the measured {measured!r} still passes (3 SE = "
      f"{SE_TOLERANCE * se:.3g} of {expected!r}): too few samples to see that mis-scaling"
    )


def check_std(z: np.ndarray, std: float, what: str, mutations=MUTATIONS) -> None:
  """`z`'s std (about 0) against `std`: the std estimate of n independent Gaussian draws has a
  standard error of ``std / √(2n)``; its control is the same draw scaled by each factor."""
  z = np.asarray(z, np.float64).ravel()
  measured = float(np.sqrt(np.mean(z * z)))  # the mean is 0: no degree of freedom spent on it
  check(measured, std, std / np.sqrt(2 * z.size), what, mutations)


def controls(relative_se: float) -> tuple[float, float]:
  """The mutation factors for a figure whose relative standard error is `relative_se`: 2 % low
  and high where the sample can see that (6.5 SE below 2 %), else 6.5 SE low and high (what
  it can see for certain: the measured figure is within 3 SE)."""
  c = max(0.02, 6.5 * relative_se)
  return (1 - c, 1 + c)
