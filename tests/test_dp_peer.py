"""The peer check: `clipped_grad` against jax_privacy's `clipped_grad` on the same data and clip
norm — the same clipped sum (float32, 2e-6 of its scale) and the same sensitivity."""

import _reference as ref
import dp_accounting
import jax.numpy as jnp
import jax_privacy
import numpy as np
import pytest
from test_dp_clipping import N, assert_close, median_norm

import optax_accum as oa


@pytest.fixture(scope="module")
def problem():
  params, batch = ref.mlp_params(0), ref.regression_data(1, N)
  return params, batch, median_norm(params, batch)


# jax_privacy 2.0.0 still calls optax.global_norm, which optax 0.2.8 deprecates: the peer's
# warning, not ours.
@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
def test_clipped_grad_peer_jax_privacy_same_sum_and_sensitivity(problem):
  params, batch, clip = problem
  ours = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=None)
  theirs = jax_privacy.clipped_grad(
    ref.mlp_loss, argnums=0, l2_clip_norm=clip, batch_argnums=1, keep_batch_dim=True
  )
  assert_close(ours(params, batch), theirs(params, batch))
  relations = dp_accounting.NeighboringRelation
  for relation in (relations.ADD_OR_REMOVE_ONE, relations.REPLACE_ONE, relations.REPLACE_SPECIAL):
    assert ours.sensitivity(relation) == theirs.sensitivity(relation)
  # Padding: their `is_padding_example` against our mask.
  mask = np.arange(N) % 4 != 1
  masked = oa.privacy.clipped_grad(ref.mlp_loss, clip, mask_argnum=2)(params, batch, mask)
  assert_close(masked, theirs(params, batch, is_padding_example=jnp.asarray(~mask)))


@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated:DeprecationWarning")
def test_item19_peer_jax_privacy_rescale_values_aux_and_replace_one(problem):
  """Issue 34, item 19 against the peer: rescale_to_unit_norm gives jax_privacy's rescaled sum
  and sensitivities (1, 2 under REPLACE_ONE); has_aux/return_values give its per-example values
  and aux (a per-example (1, 2) output as (B, 2) rows)."""
  params, batch, clip = problem

  def loss_aux(p, b):
    out = ref.mlp_apply(p, b["x"])
    return jnp.mean(jnp.sum((out - b["y"]) ** 2, axis=-1)), out

  ours = oa.privacy.clipped_grad(
    loss_aux, clip, has_aux=True, return_values=True, rescale_to_unit_norm=True, mask_argnum=None
  )
  theirs = jax_privacy.clipped_grad(
    loss_aux, argnums=0, has_aux=True, l2_clip_norm=clip, batch_argnums=1, keep_batch_dim=True,
    rescale_to_unit_norm=True, return_values=True,
  )  # fmt: skip
  (g, aux), (tg, taux) = ours(params, batch), theirs(params, batch)
  assert_close(g, tg)
  np.testing.assert_allclose(aux.values, taux.values, rtol=2e-6)
  assert aux.aux.shape == taux.aux.shape
  np.testing.assert_allclose(aux.aux, taux.aux, rtol=2e-6)
  relations = dp_accounting.NeighboringRelation
  for relation in (relations.ADD_OR_REMOVE_ONE, relations.REPLACE_ONE, relations.REPLACE_SPECIAL):
    assert ours.sensitivity(relation) == theirs.sensitivity(relation)
