"""Accounting: ε of Poisson-sampled DP-SGD with Google's ``dp-accounting`` (RDP or PLD).

One event per *update*: ``SelfComposed(PoissonSampled(q, Gaussian(σ)), updates)``. The count
comes from `dp_updates(state)`, so micro-steps are never counted as steps (the mistake of
several libraries once accumulation is on).

Neighbouring relations follow dp-accounting's convention: σ is the noise std over the bound
``C`` on one example's contribution (what `dp_noise` draws) for every relation; under
"replace_one" the accountant itself analyses the two outputs shifted by ``±C`` (distance
``2C``, the clipped sum's sensitivity, `ClippedGrad.sensitivity`), so the same σ is given
whatever the relation. dp-accounting's RDP accountant has no Poisson-sampled replace-one
analysis: that combination raises (use the PLD accountant). ``dp-accounting`` is the ``dp`` extra
(``pip install optax-accum[dp]``); it is imported when an accountant is first asked.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from optax_accum.core import _checks
from optax_accum.privacy._clipping import check_relation

Accountant = Literal["rdp", "pld"]

NO_DP_ACCOUNTING = (
  "{caller} needs Google's dp-accounting package: pip install 'optax-accum[dp]' (or "
  "pip install dp-accounting)."
)


def _dp_accounting(caller: str) -> Any:
  try:
    import dp_accounting
  except ImportError as e:  # an optional dependency: say how to install it
    raise ImportError(NO_DP_ACCOUNTING.format(caller=caller)) from e
  return dp_accounting


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  """dp-accounting's RDP accountant logs a warning (through absl, i.e. the "absl" logger) for
  each Rényi order whose series does not converge, and drops that order: ε stays an upper bound
  over the others. Keep them off the user's console while we compute."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _number(value: Any, name: str, caller: str) -> float:
  if isinstance(value, bool) or not isinstance(value, int | float | np.number | np.ndarray):
    raise TypeError(f"{caller}: {name} must be a number, got {value!r}.")
  return float(value)


def _check(
  caller: str, num_updates: Any, sampling_rate: Any, delta: Any
) -> tuple[int, float, float]:
  value = np.asarray(num_updates)  # a device count from `dp_updates` is welcome
  if value.shape != () or not np.issubdtype(value.dtype, np.integer) or value < 0:
    raise ValueError(f"{caller}: num_updates must be an int >= 0, got {num_updates!r}.")
  q = _number(sampling_rate, "sampling_rate", caller)
  if not 0 < q <= 1:
    raise ValueError(
      f"{caller}: sampling_rate must be in (0, 1] (q = expected batch size / data set size), "
      f"got {sampling_rate!r}."
    )
  d = _number(delta, "delta", caller)
  if not 0 < d < 1:
    raise ValueError(f"{caller}: delta must be in (0, 1), got {delta!r}.")
  return int(value), q, d


def _accountant(dp_accounting: Any, accountant: Any, caller: str, relation: str) -> Any:
  """A fresh accountant of that kind for that relation (a `check_relation` name)."""
  rel = getattr(dp_accounting.NeighboringRelation, relation.upper())
  if accountant == "rdp":
    if relation == "replace_one":
      _checks.refuse_private("rdp_replace_one", caller)
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=rel)
  if accountant == "pld":
    return dp_accounting.pld.PLDAccountant(neighboring_relation=rel)
  raise ValueError(f"{caller}: accountant must be 'rdp' or 'pld', got {accountant!r}.")


def dp_event(num_updates: int, sampling_rate: float, noise_multiplier: float) -> Any:
  """The ``dp_accounting`` event of `num_updates` Poisson-sampled Gaussian updates."""
  dp_accounting = _dp_accounting("dp_event")
  step = dp_accounting.PoissonSampledDpEvent(
    sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
  )
  return dp_accounting.SelfComposedDpEvent(step, num_updates)


def dp_epsilon(
  num_updates: int,
  sampling_rate: float,
  noise_multiplier: float,
  delta: float,
  *,
  accountant: Accountant = "rdp",
  neighboring_relation: Any = "add_or_remove_one",
) -> float:
  """ε of DP-SGD after `num_updates` updates with Poisson sampling rate ``q`` and noise σ.

  One Poisson-sampled Gaussian event per update. Count updates, not micro-steps: pass
  `dp_updates(state)`.

  Args:
    num_updates: the number of noisy updates (an int >= 0, or `dp_updates`'s scalar).
    sampling_rate: ``q = B / N``, each example's probability of being in a logical batch.
    noise_multiplier: σ >= 0 (the noise std is σ·C; 0 gives ε = inf).
    delta: δ in (0, 1), e.g. below 1/N.
    accountant: ``"rdp"`` (Rényi DP, fast, slightly loose) or ``"pld"`` (privacy loss
      distributions, tighter, slower).
    neighboring_relation: "add_or_remove_one" (default), "replace_special" (one example
      replaced by a zero one: the same ε) or "replace_one" (by any other: ``"pld"`` only),
      or a ``dp_accounting.NeighboringRelation``. σ means the same in each (the noise std
      over one example's bound ``C``, as `dp_noise` draws it); the accountant counts
      replace-one's ``±C`` shift itself, so do not double σ or C for it.

  Returns:
    ε, a Python float (0.0 for no updates, inf for σ = 0 with updates).

  Raises:
    TypeError, ValueError: for arguments out of range (naming the argument), an unknown
      accountant or relation, or "replace_one" with ``"rdp"``; ImportError: without
      ``dp-accounting`` (``pip install optax-accum[dp]``).

  >>> import pytest, optax_accum
  >>> _ = pytest.importorskip("dp_accounting")  # the dp extra; without it, a skip
  >>> eps = optax_accum.privacy.dp_epsilon(1000, 0.01, 1.1, 1e-5)
  >>> 1.0 < eps < 3.0
  True
  """
  n, q, d = _check("dp_epsilon", num_updates, sampling_rate, delta)
  sigma = _number(noise_multiplier, "noise_multiplier", "dp_epsilon")
  if not (np.isfinite(sigma) and sigma >= 0):
    raise ValueError(f"dp_epsilon: noise_multiplier must be >= 0, got {noise_multiplier!r}.")
  relation = check_relation(neighboring_relation, "dp_epsilon")
  dp_accounting = _dp_accounting("dp_epsilon")
  acc = _accountant(dp_accounting, accountant, "dp_epsilon", relation)
  if n == 0:
    return 0.0
  if sigma == 0:
    return math.inf
  with _quiet():
    acc.compose(dp_event(n, q, sigma))
    return float(acc.get_epsilon(d))


def dp_noise_multiplier(
  target_epsilon: float,
  num_updates: int,
  sampling_rate: float,
  delta: float,
  *,
  accountant: Accountant = "rdp",
  neighboring_relation: Any = "add_or_remove_one",
) -> float:
  """The smallest σ whose `dp_epsilon` after `num_updates` updates is at most `target_epsilon`.

  ``dp_accounting.calibrate_dp_mechanism`` (a bracketed search) with the same event as
  `dp_epsilon`.

  Args:
    target_epsilon: the ε to reach, > 0.
    num_updates: as for `dp_epsilon` (>= 1 here).
    sampling_rate: as for `dp_epsilon`.
    delta: as for `dp_epsilon`.
    accountant: as for `dp_epsilon`.
    neighboring_relation: as for `dp_epsilon`: give `dp_noise` the σ returned, as it is.

  Returns:
    σ, a Python float with ``dp_epsilon(num_updates, q, σ, δ) <= target_epsilon`` (with the
    same accountant and relation).

  Raises:
    TypeError, ValueError: for arguments out of range; ImportError: without ``dp-accounting``.

  >>> import pytest, optax_accum
  >>> _ = pytest.importorskip("dp_accounting")  # the dp extra; without it, a skip
  >>> sigma = optax_accum.privacy.dp_noise_multiplier(2.0, 1000, 0.01, 1e-5)
  >>> optax_accum.privacy.dp_epsilon(1000, 0.01, sigma, 1e-5) <= 2.0
  True
  """
  n, q, d = _check("dp_noise_multiplier", num_updates, sampling_rate, delta)
  eps = _number(target_epsilon, "target_epsilon", "dp_noise_multiplier")
  if not (np.isfinite(eps) and eps > 0):
    raise ValueError(f"dp_noise_multiplier: target_epsilon must be > 0, got {target_epsilon!r}.")
  if n < 1:
    raise ValueError(f"dp_noise_multiplier: num_updates must be >= 1, got {num_updates!r}.")
  relation = check_relation(neighboring_relation, "dp_noise_multiplier")
  dp_accounting = _dp_accounting("dp_noise_multiplier")
  _accountant(dp_accounting, accountant, "dp_noise_multiplier", relation)  # checks first

  def calibrate(name: str, rel: str, bracket: Any) -> float:
    return dp_accounting.calibrate_dp_mechanism(
      lambda: _accountant(dp_accounting, name, "dp_noise_multiplier", rel),
      lambda s: dp_event(n, q, s),
      eps,
      d,
      bracket_interval=bracket,
    )

  with _quiet():
    # RDP's add-or-remove σ first (replace-special has the same ε; RDP cannot do replace-one).
    sigma = calibrate("rdp", "add_or_remove_one", dp_accounting.LowerEndpointAndGuess(1e-3, 1.0))
    if accountant == "pld":
      # RDP is looser, so its σ bounds PLD's from above; a bracket below it keeps PLD away
      # from tiny σ, whose privacy loss distributions are huge. Replace-one needs up to twice
      # add-or-remove's σ (its outputs are 2C apart, not C).
      top = 2.0 * sigma if relation == "replace_one" else sigma
      sigma = calibrate("pld", relation, dp_accounting.ExplicitBracketInterval(0.25 * sigma, top))
  return float(sigma)
