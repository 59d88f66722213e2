"""Accounting: `dp_epsilon` and `dp_noise_multiplier` against `dp_accounting` called directly,
and the update count the library gives the accountant (updates, never micro-steps)."""

import _reference as ref
import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa


def direct_epsilon(steps, q, sigma, delta, accountant="rdp"):
  """ε straight from dp_accounting: Poisson-sampled Gaussian, self-composed `steps` times."""
  acc = (
    dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else dp_accounting.pld.PLDAccountant()
  )
  event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
  acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
  return acc.get_epsilon(delta)


@pytest.mark.parametrize(
  "steps, q, sigma, delta", [(1, 1.0, 2.0, 1e-5), (100, 0.01, 1.1, 1e-5), (2500, 0.004, 0.8, 1e-6)]
)
def test_dp_epsilon_equals_dp_accounting_rdp(steps, q, sigma, delta):
  assert oa.privacy.dp_epsilon(steps, q, sigma, delta) == direct_epsilon(steps, q, sigma, delta)


def test_dp_epsilon_equals_dp_accounting_pld():
  got = oa.privacy.dp_epsilon(50, 0.02, 1.0, 1e-5, accountant="pld")
  assert got == direct_epsilon(50, 0.02, 1.0, 1e-5, "pld")
  assert got < oa.privacy.dp_epsilon(50, 0.02, 1.0, 1e-5)  # PLD is the tighter of the two


def test_dp_epsilon_edge_cases():
  assert oa.privacy.dp_epsilon(0, 0.1, 1.0, 1e-5) == 0.0
  assert oa.privacy.dp_epsilon(5, 0.1, 0.0, 1e-5) == np.inf
  assert oa.privacy.dp_epsilon(np.int32(7), 0.1, 1.0, 1e-5) == oa.privacy.dp_epsilon(
    7, 0.1, 1.0, 1e-5
  )


def _run(k, updates, every_step):
  """`updates` windows of `k` micro-steps through accumulate or TrainStep with dp_noise."""
  params, batch = ref.mlp_params(0), ref.regression_data(1, 4)
  seed = 1000 + k + 10 * updates + every_step
  inner = optax.chain(oa.privacy.dp_noise(1.0, 1.0, 64.0, jax.random.key(seed)), optax.sgd(0.1))
  loss = oa.privacy.clipped_loss(ref.mlp_loss, 1.0, mask_argnum=None)
  if every_step:
    step = oa.TrainStep(loss, inner, every_k=k, reduction="sum")
    state = step.init(params)
    for _ in range(k * updates):
      params, state, _ = step(params, state, batch)
    return state
  tx = oa.accumulate(inner, k, reduction="sum")
  update = jax.jit(lambda g, s, p: tx.update(g, s, p))
  grad = jax.jit(jax.grad(loss))
  state = tx.init(params)
  for _ in range(k * updates):
    u, state = update(grad(params, batch), state, params)
    params = optax.apply_updates(params, u)
  return state


@pytest.mark.parametrize("train_step", [False, True])
def test_dp_updates_four_updates_with_k16_are_four_steps(train_step):
  state = _run(16, 4, train_step)
  assert int(oa.privacy.dp_updates(state)) == 4  # 64 micro-steps, 4 updates
  eps = oa.privacy.dp_epsilon(oa.privacy.dp_updates(state), 0.01, 1.0, 1e-5)
  assert eps == direct_epsilon(4, 0.01, 1.0, 1e-5)
  assert eps < direct_epsilon(64, 0.01, 1.0, 1e-5)  # what counting micro-steps would claim


def test_dp_updates_counts_in_step_updates():
  tx = oa.privacy.dp_noise(1.0, 1.0, 8.0, jax.random.key(4242))
  state = tx.init(jnp.zeros(3))
  for _ in range(3):
    _, state = tx.update(jnp.ones(3), state)
  assert int(oa.privacy.dp_updates(state)) == 3


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_dp_noise_multiplier_reaches_target_epsilon(accountant):
  target, steps, q, delta = 2.0, 200, 0.02, 1e-5
  sigma = oa.privacy.dp_noise_multiplier(target, steps, q, delta, accountant=accountant)
  eps = oa.privacy.dp_epsilon(steps, q, sigma, delta, accountant=accountant)
  assert eps <= target
  assert eps > 0.95 * target  # the smallest σ that reaches it, not any σ
  assert oa.privacy.dp_epsilon(steps, q, 0.97 * sigma, delta, accountant=accountant) > eps


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"num_updates": -1}, r"num_updates must be an int >= 0, got -1"),
    ({"num_updates": 2.5}, r"num_updates must be an int >= 0, got 2.5"),
    ({"sampling_rate": 0.0}, r"sampling_rate must be in \(0, 1\] .* got 0.0"),
    ({"sampling_rate": 1.5}, r"sampling_rate must be in \(0, 1\] .* got 1.5"),
    ({"delta": 0.0}, r"delta must be in \(0, 1\), got 0.0"),
    ({"delta": 1.0}, r"delta must be in \(0, 1\), got 1.0"),
    ({"noise_multiplier": -1.0}, r"noise_multiplier must be >= 0, got -1.0"),
    ({"accountant": "moments"}, r"accountant must be 'rdp' or 'pld', got 'moments'"),
  ],
)
def test_dp_epsilon_rejects_out_of_range_arguments(kwargs, match):
  args = dict(num_updates=10, sampling_rate=0.1, noise_multiplier=1.0, delta=1e-5) | kwargs
  with pytest.raises(ValueError, match=rf"dp_epsilon: {match}"):
    oa.privacy.dp_epsilon(**args)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"target_epsilon": 0.0}, r"target_epsilon must be > 0, got 0.0"),
    ({"num_updates": 0}, r"num_updates must be >= 1, got 0"),
    ({"sampling_rate": 2.0}, r"sampling_rate must be in \(0, 1\]"),
    ({"delta": -1e-5}, r"delta must be in \(0, 1\)"),
  ],
)
def test_dp_noise_multiplier_rejects_out_of_range_arguments(kwargs, match):
  args = dict(target_epsilon=1.0, num_updates=10, sampling_rate=0.1, delta=1e-5) | kwargs
  with pytest.raises(ValueError, match=rf"dp_noise_multiplier: {match}"):
    oa.privacy.dp_noise_multiplier(**args)


# ----------------------------------------------------------------------------------------------
# Issue 34, item 19: replace-one adjacency.


def _gaussian_epsilon(mu: float, delta: float) -> float:
  """ε of the Gaussian mechanism whose neighbouring outputs are `mu` standard deviations apart,
  from the exact privacy profile (Balle & Wang 2018, Theorem 8), in float64:
  δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ), solved for ε by bisection (δ falls with ε)."""
  from scipy.stats import norm  # noqa: PLC0415

  def profile(eps):
    return norm.cdf(mu / 2 - eps / mu) - np.exp(eps) * norm.cdf(-mu / 2 - eps / mu)

  lo, hi = 0.0, 100.0
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if profile(mid) > delta else (lo, mid)
  return hi


@pytest.mark.parametrize("steps, sigma", [(1, 2.0), (4, 3.0)])
def test_item19_replace_one_epsilon_matches_dp_accounting_and_the_gaussian_formula(steps, sigma):
  """Replace-one: dp_noise draws σ·C, one example replaced moves the clipped sum by up to 2C
  (`sensitivity("replace_one")`), so the outputs are 2/σ standard deviations apart per update,
  2·√steps/σ over `steps` full-batch (q = 1) updates. `dp_epsilon` with the same σ gives
  dp-accounting's PLD ε for REPLACE_ONE exactly, and that is the exact Gaussian ε of μ =
  2·√steps/σ from the float64 formula, from above (PLD's pessimistic discretisation: within
  0.5%); and it is not add-or-remove's ε (μ = √steps/σ), which it exceeds."""
  delta = 1e-5
  ours = oa.privacy.dp_epsilon(
    steps, 1.0, sigma, delta, accountant="pld", neighboring_relation="replace_one"
  )
  acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
  event = dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(sigma))
  acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
  assert ours == acc.get_epsilon(delta)
  exact = _gaussian_epsilon(2 * np.sqrt(steps) / sigma, delta)
  assert exact <= ours <= exact * 1.005, (ours, exact)
  add_remove = oa.privacy.dp_epsilon(steps, 1.0, sigma, delta, accountant="pld")
  assert add_remove < 0.7 * ours
  assert _gaussian_epsilon(np.sqrt(steps) / sigma, delta) <= add_remove
  # The relation as dp_accounting's enum; replace-special is add-or-remove's ε.
  relation = dp_accounting.NeighboringRelation.REPLACE_ONE
  assert oa.privacy.dp_epsilon(
    steps, 1.0, sigma, delta, accountant="pld", neighboring_relation=relation
  ) == ours  # fmt: skip
  assert oa.privacy.dp_epsilon(
    steps, 0.1, sigma, delta, neighboring_relation="replace_special"
  ) == oa.privacy.dp_epsilon(steps, 0.1, sigma, delta)  # fmt: skip


def test_item19_replace_one_poisson_epsilon_equals_dp_accounting():
  """With Poisson sampling (q < 1): dp-accounting's PLD under REPLACE_ONE, called directly."""
  ours = oa.privacy.dp_epsilon(
    50, 0.05, 1.5, 1e-5, accountant="pld", neighboring_relation="replace_one"
  )
  acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
  event = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.5))
  acc.compose(dp_accounting.SelfComposedDpEvent(event, 50))
  assert ours == acc.get_epsilon(1e-5)
  assert ours > oa.privacy.dp_epsilon(50, 0.05, 1.5, 1e-5, accountant="pld")


@pytest.mark.slow
def test_item19_replace_one_noise_multiplier_round_trip():
  """σ for a target ε under replace-one (PLD): its ε is at most the target and close to it, and
  it is at most twice add-or-remove's σ (the outputs are 2C apart rather than C)."""
  kw = {"accountant": "pld", "neighboring_relation": "replace_one"}
  sigma = oa.privacy.dp_noise_multiplier(3.0, 1, 1.0, 1e-5, **kw)
  assert 2.9 <= oa.privacy.dp_epsilon(1, 1.0, sigma, 1e-5, **kw) <= 3.0
  add_remove = oa.privacy.dp_noise_multiplier(3.0, 1, 1.0, 1e-5, accountant="pld")
  assert add_remove < sigma <= 2.0 * add_remove * 1.001


@pytest.mark.parametrize("fn", ["dp_epsilon", "dp_noise_multiplier"])
def test_item19_replace_one_refuses_rdp_and_unknown_relations(fn):
  call = getattr(oa.privacy, fn)
  args = (10, 0.1, 1.0, 1e-5) if fn == "dp_epsilon" else (1.0, 10, 0.1, 1e-5)
  with pytest.raises(ValueError, match=rf"{fn}: neighboring_relation='replace_one' with "):
    call(*args, neighboring_relation="replace_one")
  with pytest.raises(ValueError, match=rf"{fn}: neighboring_relation must be one of "):
    call(*args, neighboring_relation="swap_one")
