"""Issue 34, items 20-21: the progress τ of `scale_by_gain` loses no gain however long the
run, and a schedule through `optax.inject_hyperparams(scale_by_gain)` (which would run on the
update count, not τ) is refused with the recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum.batch_size import _gain

# T and Q for a window twice the base batch (S = 2) whose gain is 1.028: r = (T + Q)/(T/2 + Q).
FIGURES = _gain.WindowFigures(
  trace_cov=jnp.float32(0.028 / 0.486), grad_sq=jnp.float32(1.0), weight=jnp.float32(2.0)
)
R = float(_gain.gain(FIGURES.trace_cov, FIGURES.grad_sq, FIGURES.weight, 1.0))


def _run_from(tau0: float, n: int):
  tx = optax_accum.scale_by_gain(0.1, base_weight=1)
  state = tx.init(jnp.zeros(2))._replace(progress=jnp.float32(tau0))

  @jax.jit
  def run(state):
    def body(_, state):
      _, state = tx.update(jnp.ones(2), state, None, **{_gain.WINDOW_ARG: FIGURES})
      return state

    return jax.lax.fori_loop(0, n, body, state)

  return run(state)


@pytest.mark.parametrize("tau0", [0.0, 1e6, 1e7])
def test_item20_progress_keeps_every_gain_at_1e7(tau0):
  assert abs(R - 1.028) < 1e-6
  n = 1000
  state = _run_from(tau0, n)
  want = tau0 + n * R  # float64
  exact = float(np.float64(state.progress) + np.float64(state.progress_low))
  # The pair holds the sum to float32 rounding of the gains' own sum (n·r ≈ 1028: 1e-4).
  assert abs(exact - want) < 1e-3, (exact, want)
  # progress() is τ in float32: within half a float32 step of the exact sum (0.5 at 1e7).
  tau = float(optax_accum.progress(state))
  assert abs(tau - want) <= np.spacing(np.float32(want)) / 2 + 1e-3, (tau, want)
  # The control: a plain float32 sum adds 1.028 as 1.0 from 2**23 on (28 lost at 1e7).
  naive = jax.lax.fori_loop(0, n, lambda _, t: t + jnp.float32(R), jnp.float32(tau0))
  if tau0 >= 2**23:
    assert abs(float(naive) - want) > 20


@pytest.mark.parametrize("static", [(), ("base_weight",)])
def test_item21_inject_hyperparams_of_scale_by_gain_is_refused_with_the_recipe(static):
  schedule = optax.linear_schedule(0.1, 0.0, 100)
  inner = optax.inject_hyperparams(optax_accum.scale_by_gain, static_args=static)(
    learning_rate=schedule, base_weight=1.0
  )
  tx = optax_accum.accumulate(inner, every_k=2, noise_scale=True)
  # base_weight an array (inject_hyperparams made it one): the TypeError names the recipe too.
  with pytest.raises(TypeError if not static else ValueError, match="inject_hyperparams") as err:
    tx.init(jnp.zeros(2))
  assert "scale_by_gain(schedule, base_weight=W0)" in str(err.value)
  assert "inject_hyperparams(optax.scale)" in str(err.value)


def test_item21_the_recipe_runs_the_schedule_on_tau_with_a_factor_by_hand():
  schedule = optax.linear_schedule(0.1, 0.0, 100)
  inner = optax.chain(
    optax.inject_hyperparams(optax.scale)(step_size=0.5),
    optax_accum.scale_by_gain(schedule, base_weight=1),
  )
  tx = optax_accum.accumulate(inner, every_k=2, noise_scale=True)
  params = jnp.zeros(2)
  state, update = tx.init(params), jax.jit(tx.update)
  for g in ([1.0, 1.0], [3.0, 3.0]):
    u, state = update(jnp.array(g), state, params)
  # One measured window: T = 4, Q = 6, r = (4 + 6) / (4/2 + 6) = 1.25, lr(τ = 0) = 0.1.
  np.testing.assert_allclose(u, -0.5 * 1.25 * 0.1 * 2.0 * np.ones(2), rtol=1e-6)
  np.testing.assert_allclose(optax_accum.progress(state), 1.25, rtol=1e-6)
