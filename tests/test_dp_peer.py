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
  ours = oa.privacy.clipped_grad(ref.mlp_loss, clip)
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
