"""The one-run privacy audit: an ε lower bound from guesses about canaries included at random.

Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023,
https://arxiv.org/abs/2305.08846). Each of ``m`` canaries is included in the training data
independently with probability ½. After one training run the auditor scores every canary from
the trained model, guesses "in" for the ``k+`` highest scores and "out" for the ``k-`` lowest,
and counts its correct guesses ``v`` among ``r = k+ + k-``. If the training is (ε, δ)-DP,
the guesses behave no better than ε-randomised response, up to δ (the paper's Theorem 5.2):

    P[v correct or more] ≤ f(v) + 2·m·δ · max_{i=1..v} (f(v - i) - f(v)) / i,
    f(u) = P[Binomial(r, e^ε / (1 + e^ε)) ≥ u].

At confidence ``1 - β`` the audit's ε lower bound is the largest ε for which that p-value is
below β: a larger observed ``v`` would be a β-unlikely accident under an (ε, δ)-DP mechanism.
Everything here is float64 NumPy (log-space binomial terms, sums without cancellation), so the
bound is the theorem's exactly, to float64 rounding.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np


class AuditResult(NamedTuple):
  """`audit_epsilon`'s result: the bound and the counts it came from."""

  epsilon: float  # the ε lower bound at `confidence` (0.0 when nothing is shown)
  num_correct: int  # v: correct guesses
  num_guesses: int  # r: guesses made (k+ "in" and k- "out")
  num_canaries: int  # m
  delta: float
  confidence: float


def _int(value: Any, name: str, caller: str, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
    raise ValueError(f"{caller}: {name} must be an int >= {low}, got {value!r}.")
  return int(value)


def _unit(value: Any, name: str, caller: str, *, closed_low: bool) -> float:
  """A number in [0, 1) (`closed_low`) or (0, 1)."""
  if isinstance(value, bool) or not isinstance(value, int | float | np.number):
    raise TypeError(f"{caller}: {name} must be a number, got {value!r}.")
  value = float(value)
  ok = (0 <= value < 1) if closed_low else (0 < value < 1)
  if not ok:
    need = "[0, 1)" if closed_low else "(0, 1)"
    raise ValueError(f"{caller}: {name} must be in {need}, got {value!r}.")
  return value


def _log_choose(r: int) -> np.ndarray:
  """``log C(r, j)`` for j = 0..r, in float64."""
  return np.array(
    [math.lgamma(r + 1) - math.lgamma(j + 1) - math.lgamma(r - j + 1) for j in range(r + 1)]
  )


def _binomial_pmf(log_choose: np.ndarray, epsilon: float) -> np.ndarray:
  """``P[Binomial(r, e^ε/(1+e^ε)) = j]`` for j = 0..r, in float64 through log space."""
  j = np.arange(len(log_choose))
  r = j[-1]
  log_q = -math.log1p(math.exp(-epsilon))  # log(e^ε / (1 + e^ε))
  log_1mq = -epsilon + log_q  # log(1 / (1 + e^ε))
  return np.exp(log_choose + j * log_q + (r - j) * log_1mq)


def _p_value(v: int, log_choose: np.ndarray, m: int, epsilon: float, delta: float) -> float:
  """The theorem's bound on P[v or more correct guesses of r] under (ε, δ)-DP."""
  pmf = _binomial_pmf(log_choose, epsilon)
  tail = math.fsum(pmf[v:])  # f(v)
  if delta == 0 or v == 0:
    return min(tail, 1.0)
  # (f(v - i) - f(v)) / i = P[v - i <= W < v] / i: partial sums of pmf[v-1], pmf[v-2], ...
  below = np.cumsum(pmf[v - 1 :: -1])
  alpha = float(np.max(below / np.arange(1, v + 1)))
  return min(tail + 2 * m * delta * alpha, 1.0)


def epsilon_lower_bound(
  num_correct: int,
  num_guesses: int,
  num_canaries: int,
  *,
  delta: float = 0.0,
  confidence: float = 0.95,
) -> float:
  """The one-run audit's ε lower bound from the count of correct guesses (Steinke et al. 2023).

  The largest ε such that an (ε, δ)-DP training run would give `num_correct` or more correct
  guesses out of `num_guesses` with probability below ``1 - confidence`` (Theorem 5.2 of
  https://arxiv.org/abs/2305.08846, with δ; Theorem 3.1 for δ = 0), found by bisection to 1e-9.
  The canaries must have been included independently with probability ½ each and the guesses
  made from the trained model alone.

  Args:
    num_correct: v, correct guesses, ``0 <= v <= num_guesses``.
    num_guesses: r, the guesses made (abstentions excluded), ``r <= num_canaries``.
    num_canaries: m, the canaries (each in the training data with probability ½).
    delta: the δ of the (ε, δ) claim being audited, in [0, 1).
    confidence: the audit's confidence ``1 - β``, in (0, 1).

  Returns:
    ε >= 0, a Python float: with probability at least `confidence` (over the canaries'
    inclusion and the training's randomness) the run is not (ε', δ)-DP for any ε' below it.
    0.0 when the guesses show nothing at that confidence.

  Raises:
    TypeError, ValueError: for counts that are not ints or are inconsistent
      (``v <= r <= m``), or `delta`/`confidence` out of range.

  >>> from optax_accum import privacy
  >>> round(privacy.epsilon_lower_bound(1000, 1000, 10_000, confidence=0.95), 3)  # all right
  5.809
  >>> privacy.epsilon_lower_bound(520, 1000, 10_000)  # 52 %: chance at 95 % confidence
  0.0
  """
  caller = "epsilon_lower_bound"
  m = _int(num_canaries, "num_canaries", caller, 1)
  r = _int(num_guesses, "num_guesses", caller, 0)
  v = _int(num_correct, "num_correct", caller, 0)
  if not v <= r <= m:
    raise ValueError(
      f"{caller}: need num_correct <= num_guesses <= num_canaries, got {v}, {r}, {m}."
    )
  d = _unit(delta, "delta", caller, closed_low=True)
  beta = 1.0 - _unit(confidence, "confidence", caller, closed_low=False)

  log_choose = _log_choose(r)

  def rejected(eps: float) -> bool:  # is (eps, δ)-DP refuted at this confidence?
    return _p_value(v, log_choose, m, eps, d) < beta

  if r == 0 or not rejected(0.0):
    return 0.0
  low, high = 0.0, 1.0
  while rejected(high):  # ends: as ε grows, f(v) -> 1
    low, high = high, 2 * high
  while high - low > 1e-9:
    mid = (low + high) / 2
    low, high = (mid, high) if rejected(mid) else (low, mid)
  return low


def audit_epsilon(
  scores: Any,
  included: Any,
  *,
  num_positive: int,
  num_negative: int = 0,
  delta: float = 0.0,
  confidence: float = 0.95,
) -> AuditResult:
  """The one-run audit of one training run: guesses from canary scores, then the ε lower bound.

  Guesses "in" for the `num_positive` canaries with the highest scores and "out" for the
  `num_negative` with the lowest (ties broken by canary index, which knows nothing of the
  inclusion), counts the correct ones against `included` and returns `epsilon_lower_bound`.
  Fix the guess counts before the run (choosing them after seeing the scores voids the
  confidence).

  Args:
    scores: ``(m,)`` real scores, larger meaning "more likely included", e.g. for a gradient
      canary ``⟨final params - initial params, canary direction⟩``.
    included: ``(m,)`` booleans, which canaries were in the training data (each drawn with
      probability ½ before training).
    num_positive: k+, the "in" guesses.
    num_negative: k-, the "out" guesses; ``k+ + k- <= m``.
    delta: as for `epsilon_lower_bound`.
    confidence: as for `epsilon_lower_bound`.

  Returns:
    An `AuditResult`: the ε lower bound and the counts behind it.

  Raises:
    ValueError: for scores and inclusions that are not matching 1-D arrays, non-finite
      scores, or guess counts that are negative or sum to more than m; as
      `epsilon_lower_bound` otherwise.

  >>> import numpy as np
  >>> from optax_accum import privacy
  >>> included = np.random.default_rng(0).random(2000) < 0.5
  >>> res = privacy.audit_epsilon(included * 10.0, included, num_positive=300, num_negative=300)
  >>> res.num_correct, res.num_guesses, round(res.epsilon, 2)  # a mechanism with no noise
  (600, 600, 5.3)
  """
  caller = "audit_epsilon"
  s = np.asarray(scores, np.float64)
  inc = np.asarray(included)
  if s.ndim != 1 or inc.shape != s.shape:
    raise ValueError(
      f"{caller}: scores and included must be 1-D arrays of one length (one per canary), got "
      f"shapes {s.shape} and {inc.shape}."
    )
  if inc.dtype != bool:
    raise ValueError(f"{caller}: included must be booleans, got dtype {inc.dtype}.")
  if not np.all(np.isfinite(s)):
    raise ValueError(f"{caller}: scores must be finite, got {int(np.sum(~np.isfinite(s)))} not.")
  m = s.size
  kp = _int(num_positive, "num_positive", caller, 0)
  kn = _int(num_negative, "num_negative", caller, 0)
  if kp + kn > m:
    raise ValueError(
      f"{caller}: num_positive + num_negative must be at most the {m} canaries, got {kp} + {kn}."
    )
  order = np.argsort(-s, kind="stable")  # highest first; ties by index
  guessed_in, guessed_out = order[:kp], order[m - kn :]
  correct = int(np.sum(inc[guessed_in])) + int(np.sum(~inc[guessed_out]))
  eps = epsilon_lower_bound(correct, kp + kn, m, delta=delta, confidence=confidence)
  return AuditResult(eps, correct, kp + kn, m, float(delta), float(confidence))
