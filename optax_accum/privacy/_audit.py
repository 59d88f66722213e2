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

import functools
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


def _rate(value: Any, caller: str) -> float:
  """A sampling rate in (0, 1]."""
  if isinstance(value, bool) or not isinstance(value, int | float | np.number):
    raise TypeError(f"{caller}: sampling_rate must be a number, got {value!r}.")
  if not 0 < value <= 1:
    raise ValueError(f"{caller}: sampling_rate must be in (0, 1], got {value!r}.")
  return float(value)


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


# ----------------------------------------------------------------------------------------------
# The white-box audit: every update observed, scored against the noise it actually drew, and
# judged against the whole tradeoff curve of DP-SGD (Mahloujifar, Melis and Chaudhuri 2025).

_MAX_PATTERNS_LOG2 = 10  # exact likelihood ratios up to 2^10 sampling patterns (10 updates)
_RIDGE = 1e-9  # the noise covariance's ridge, relative to its mean variance
_EPS_GRID = 500  # ε values in a privacy profile; fewer only weakens the claim (stays valid)
_PLD_STEP = 1e-2  # dp-accounting's loss discretization: pessimistic, so coarser stays valid
_SIGMA_RANGE = (0.05, 1e3)  # noise multipliers searched for the boundary
_SIGMA_RTOL = 1e-3  # the boundary's relative precision


def _noise_covariance(noise: np.ndarray) -> np.ndarray:
  """The updates' ``(T, T)`` noise covariance from directions no example reaches (their mean is
  0 by construction: no gradient), with a small ridge (1e-9 of the mean variance, or of one
  canary's contribution squared if larger) so that a noise-free direction (a skipped or
  repeated draw) weighs enormously instead of dividing by 0."""
  cov = noise @ noise.T / noise.shape[1]
  scale = max(float(np.trace(cov)) / len(cov), 1.0)  # units: one canary's contribution
  return cov + _RIDGE * scale * np.eye(len(cov))


def _log1m(rate: float) -> float:
  """``log(1 - rate)``, -inf at rate 1."""
  return math.log1p(-rate) if rate < 1 else -math.inf


def _log_likelihood_ratios(observed: np.ndarray, cov: np.ndarray, rate: float) -> np.ndarray:
  """Each canary's ``log p(y | in) / p(y | out)``: out, ``y ~ N(0, Σ)``; in, ``y ~ N(b, Σ)``
  with ``b ∈ {0, 1}^T`` the updates that sampled it (each with probability `rate`). Exact over
  all ``2^T`` patterns up to `_MAX_PATTERNS_LOG2` updates; beyond, the product over updates with
  Σ's diagonal (correlations between updates ignored)."""
  steps = observed.shape[0]
  if steps > _MAX_PATTERNS_LOG2:
    var = np.diag(cov)[:, None]
    sampled = math.log(rate) + (observed - 0.5) / var
    unsampled = np.full_like(sampled, _log1m(rate))
    return np.sum(np.logaddexp(sampled, unsampled), axis=0)
  patterns = (np.arange(2**steps)[:, None] >> np.arange(steps)) & 1  # (2^T, T)
  count = patterns.sum(1)
  # rate = 1: a pattern that skips an update has probability 0 (log -inf, never 0·-inf)
  log_prior = np.array(
    [c * math.log(rate) + (steps - c and (steps - c) * _log1m(rate)) for c in count]
  )
  precision = np.linalg.inv(cov)
  pb = patterns @ precision  # (2^T, T): bᵀΣ⁻¹
  quad = 0.5 * np.sum(pb * patterns, axis=1)  # ½ bᵀΣ⁻¹b
  logits = log_prior[:, None] + pb @ observed - quad[:, None]
  top = np.max(logits, axis=0)
  return top + np.log(np.sum(np.exp(logits - top), axis=0))


def _fdp_rejects(inv_blowup: Any, m: int, k: int, v: int, beta: float) -> bool:
  """Whether `v` correct "in" guesses of `k` (about `m` canaries, each in with probability ½)
  refute f-DP at significance `beta`: Mahloujifar, Melis and Chaudhuri 2025 (ICML;
  https://arxiv.org/abs/2410.22235), the algorithm that bounds the guesses' correct mass
  ``r`` and wrong mass ``h`` from below, taking one fewer correct guess at a time.

  `inv_blowup(x)` is ``f(1 - x)`` for the symmetric tradeoff function ``f``: the least
  probability an event can have without the canary when it has probability ``x`` with it.
  """
  if v == 0:
    return False
  r, h = beta * v / m, beta * (k - v) / m
  for i in range(v - 1, -1, -1):
    grown = max(h, float(inv_blowup(r)))
    if grown == h:  # a fixed point: neither mass moves again
      break
    r, h = min(r + i / (k - i) * (grown - h), 1.0), grown
  return r + h > k / m


def _profile_inv_blowup(epsilons: np.ndarray, deltas: np.ndarray) -> Any:
  """``x ↦ f(1 - x)`` for the tradeoff function of a privacy profile, every point of which the
  mechanism satisfies: ``f(α) = max(0, maxⱼ 1 - δⱼ - e^εⱼ·α, maxⱼ e^-εⱼ·(1 - δⱼ - α))``
  (symmetric; fewer profile points give a smaller f, a weaker claim)."""
  grow, shrink = np.exp(epsilons), np.exp(-epsilons)
  slack = 1.0 - deltas

  def inv_blowup(x: float) -> float:
    alpha = 1.0 - x
    return max(0.0, float(np.max(slack - grow * alpha)), float(np.max(shrink * (slack - alpha))))

  return inv_blowup


def _dp_sgd_inv_blowup(noise_multiplier: float, rate: float, updates: int) -> Any:
  """`_profile_inv_blowup` of DP-SGD: `updates` Poisson-sampled Gaussian steps, from
  dp-accounting's privacy loss distribution (pessimistic: its δ(ε) are upper bounds, so this
  f is below the mechanism's own)."""
  from optax_accum.privacy import _accounting

  dp_accounting = _accounting._dp_accounting("audit_updates")
  acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=_PLD_STEP)
  with _accounting._quiet():
    acc.compose(_accounting.dp_event(updates, rate, noise_multiplier))
    pld = acc._pld  # the composed distribution: its whole δ(ε) curve, not one point
    # Up to where δ(ε) is 1e-12 (dp-accounting truncates tails of ~1e-15): beyond, e^ε·α
    # terms of tiny δ matter only for events too rare for any audit to observe.
    tops = (pld.get_epsilon_for_delta(d) for d in (1e-12, 1e-9, 1e-6, 1e-3))
    top = next((t for t in tops if np.isfinite(t)), 0.0)
    epsilons = np.linspace(0.0, min(1.5 * top, 700.0), _EPS_GRID)  # e^ε finite in float64
    with np.errstate(over="ignore", invalid="ignore"):  # its e^ε·0 at a huge ε: NaN, dropped
      deltas = np.asarray(pld.get_delta_for_epsilon(epsilons), np.float64)
  keep = np.isfinite(deltas)  # dropping points only weakens the claim
  return _profile_inv_blowup(epsilons[keep], deltas[keep])


def _dp_sgd_boundary(v: int, k: int, m: int, rate: float, updates: int, beta: float) -> float:
  """The smallest noise multiplier whose DP-SGD (same rate and updates) the guesses refute:
  refuting a noise multiplier refutes every larger one (a more private claim). `inf` when none
  up to `_SIGMA_RANGE`'s top is refuted; its bottom when even that is."""

  @functools.cache
  def refuted(sigma: float) -> bool:
    return _fdp_rejects(_dp_sgd_inv_blowup(sigma, rate, updates), m, k, v, beta)

  floor, ceiling = _SIGMA_RANGE
  if v == 0:
    return math.inf
  low = high = 1.0  # bracket [low, high] by doubling from σ = 1, then bisect in log σ
  if refuted(high):
    while low > floor and refuted(low):
      high, low = low, max(low / 2, floor)
    if refuted(low):
      return low
  else:
    while high < ceiling and not refuted(high):
      low, high = high, min(2 * high, ceiling)
    if not refuted(high):
      return math.inf
  while high / low > 1 + _SIGMA_RTOL:
    mid = math.sqrt(low * high)
    low, high = (low, mid) if refuted(mid) else (mid, high)
  return high


def _observations(value: Any, name: str, rows: int | None) -> np.ndarray:
  caller = "audit_updates"
  arr = np.asarray(value, np.float64)
  if arr.ndim != 2 or (rows is not None and arr.shape[0] != rows):
    need = "(updates, canaries)" if rows is None else f"({rows}, probes), one row per update"
    raise ValueError(f"{caller}: {name} must be a 2-D array {need}, got shape {arr.shape}.")
  if not np.all(np.isfinite(arr)):
    raise ValueError(f"{caller}: {name} must be finite, got {int(np.sum(~np.isfinite(arr)))} not.")
  return arr


def audit_updates(
  canary_updates: Any,
  noise_updates: Any,
  included: Any,
  *,
  contribution: float,
  sampling_rate: float,
  num_positive: int,
  delta: float,
  confidence: float = 0.95,
) -> AuditResult:
  """The white-box one-run audit of DP-SGD: every update observed, gradient canaries scored.

  The auditor of a training run that it can watch (its own run of the user's code, say) plants
  ``m`` gradient canaries, each included in the data independently with probability ½, whose
  clipped gradients point along known orthogonal directions ``uᵢ`` ("Dirac" canaries: one
  parameter each, which no other example's gradient reaches), and keeps ``p`` probe
  directions that no example reaches at all. After each of the ``T`` updates it records every
  canary's and every probe's component of the update. Then:

  * the noise each update drew, and how the updates' noise is correlated, is read from the
    probes (``(T, T)`` covariance Σ), so each canary's score is its exact likelihood ratio,
    in versus out, under that noise: ``y ~ N(b, Σ)`` in units of one canary's contribution,
    with ``b`` the updates that sampled it (Poisson, probability `sampling_rate` each). Noise
    that was smaller than claimed, skipped on an update, or the same on two updates (a reused
    key) is seen as it is: the claimed σ is never assumed. Exact over the ``2^T`` sampling
    patterns up to 10 updates; beyond, each update is scored on its own with its noise
    (correlations between updates, e.g. a repeated draw, are then not used);
  * "in" is guessed for the `num_positive` highest scores (ties by index), and the correct
    guesses are judged against the tradeoff curve of DP-SGD itself (f-DP, Mahloujifar, Melis
    and Chaudhuri 2025, https://arxiv.org/abs/2410.22235; from dp-accounting's privacy loss
    distribution), not against a single (ε, δ): for a Gaussian mechanism that is what makes a
    one-run audit nearly tight. The result is the ε at `delta` of the least noisy DP-SGD
    (same sampling rate and number of updates) that the guesses refute at `confidence`.

  Observing every update is what the final model cannot give: a canary's updates sum in the
  final parameters with noise that may cancel or repeat; white-box, one noise-free update
  gives its canaries away. Scores use only the released updates (post-processing), so the
  bound holds for any score: with probability at least `confidence` over the canaries'
  inclusion and the run's randomness, a correct DP-SGD run's bound is at most its ε.

  Args:
    canary_updates: ``(T, m)``: each update's component ``⟨θₜ₊₁ - θₜ, uᵢ⟩`` along each
      canary's unit gradient direction, in update order (for Dirac canaries, the update's
      values at the canaries' parameters).
    noise_updates: ``(T, p)``: the same for ``p`` probe directions no example's gradient
      reaches, orthogonal to the canaries (their updates are the noise alone); ``p`` of a
      thousand or more.
    included: ``(m,)`` booleans, which canaries were in the data (each drawn with probability
      ½ before training).
    contribution: the shift one sampled canary makes along its direction in one update: for
      `dp_noise` then ``optax.sgd(lr)``, ``lr·C/B`` (its clip norm ``C``, expected batch size
      ``B``), the sign included (``-lr·C/B`` for a canary whose loss gradient is ``+C·uᵢ``:
      SGD steps against it).
    sampling_rate: q, each example's probability of being in an update's batch.
    num_positive: k, the "in" guesses, fixed before the run.
    delta: the δ of the claim whose ε is reported, in (0, 1).
    confidence: ``1 - β``, in (0, 1).

  Returns:
    An `AuditResult` with ``num_guesses = num_positive``: ε >= 0, 0.0 when no DP-SGD with a
    noise multiplier up to 1000 is refuted.

  Raises:
    ValueError, TypeError: for observations that are not finite 2-D arrays with one row per
      update, fewer than ``T + 1`` probes, inclusions that do not match the canaries, a zero
      or non-finite `contribution`, or arguments out of range; ImportError: without
      ``dp-accounting``.

  >>> import numpy as np, pytest, optax_accum
  >>> _ = pytest.importorskip("dp_accounting")
  >>> rng = np.random.default_rng(0)
  >>> included = rng.random(4000) < 0.5  # one noise-free update (σ = 0): every canary shows
  >>> res = optax_accum.privacy.audit_updates(
  ...   included[None] * 0.25, np.zeros((1, 1000)), included, contribution=0.25,
  ...   sampling_rate=1.0, num_positive=200, delta=1e-6)
  >>> res.num_correct, res.num_guesses, round(res.epsilon, 1)
  (200, 200, 6.8)
  """
  caller = "audit_updates"
  if isinstance(contribution, bool) or not isinstance(contribution, int | float | np.number):
    raise TypeError(f"{caller}: contribution must be a number, got {contribution!r}.")
  if not (np.isfinite(contribution) and contribution != 0):
    raise ValueError(f"{caller}: contribution must be finite and nonzero, got {contribution!r}.")
  observed = _observations(canary_updates, "canary_updates", None) / float(contribution)
  steps, m = observed.shape
  noise = _observations(noise_updates, "noise_updates", steps) / float(contribution)
  if noise.shape[1] < steps + 1:
    raise ValueError(
      f"{caller}: noise_updates needs more probes than updates to estimate the noise, got "
      f"{noise.shape[1]} probes for {steps} updates (use a thousand or more)."
    )
  inc = np.asarray(included)
  if inc.shape != (m,) or inc.dtype != bool:
    raise ValueError(
      f"{caller}: included must be {m} booleans (one per canary), got {inc.dtype}{list(inc.shape)}."
    )
  rate = _rate(sampling_rate, caller)
  k = _int(num_positive, "num_positive", caller, 1)
  if k > m:
    raise ValueError(f"{caller}: num_positive must be at most the {m} canaries, got {k}.")
  d = _unit(delta, "delta", caller, closed_low=False)
  beta = 1.0 - _unit(confidence, "confidence", caller, closed_low=False)

  scores = _log_likelihood_ratios(observed, _noise_covariance(noise), rate)
  order = np.argsort(-scores, kind="stable")  # highest first; ties by index
  correct = int(np.sum(inc[order[:k]]))
  sigma = _dp_sgd_boundary(correct, k, m, rate, steps, beta)
  eps = 0.0
  if np.isfinite(sigma):
    from optax_accum.privacy import _accounting

    eps = _accounting.dp_epsilon(steps, rate, sigma, d, accountant="pld")
  return AuditResult(float(eps), correct, k, m, d, 1.0 - beta)
