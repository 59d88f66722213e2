"""DP-SGD as one object: the clipped function and the noise handed out as a pair.

`Mechanism` holds what the guarantee depends on — the clip norm, σ (or the ε it is calibrated
for), the Poisson sampler (so the expected batch size and the rate the accountant assumes are
the sampler's), the noise key — and hands out the pieces the front ends take, consistent by
construction: a clipped loss (or gradient) that always takes the batch's padding mask, an inner
optimizer whose first transformation is the noise (scaled to that clipped function's bound,
divided by that sampler's expected batch size), a `TrainStep` built from both, and ε for the
updates a state has made. The low-level names (`clipped_grad`, `clipped_loss`, `dp_noise`,
`dp_epsilon`) remain for experts; the front ends refuse the pipelines they could be composed
into wrongly (the privacy contract).

As jax_privacy's ``DPExecutionPlan`` couples batch selection, clipping, noise and the privacy
event "by construction", and Opacus' ``PrivacyEngine.make_private`` returns the model, the
optimizer and the (Poisson) data loader together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import optax

from optax_accum.core._typing import ArgNums
from optax_accum.front_ends._train_step import TrainStep
from optax_accum.privacy import _accounting, _clipping, _noise, _poisson


def _positive(value: Any, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, int | float | np.number):
    raise TypeError(f"Mechanism: {name} must be a number, got {value!r}.")
  if not (np.isfinite(value) and value > 0):
    raise ValueError(f"Mechanism: {name} must be a positive finite number, got {value!r}.")
  return float(value)


def _sigma(noise_multiplier, epsilon, delta, updates, q, accountant, relation) -> float:
  """σ: given, or the smallest that gives `epsilon` after `updates` updates at rate `q`."""
  if (noise_multiplier is None) == (epsilon is None):
    raise ValueError(
      "Mechanism: give noise_multiplier=σ, or epsilon= (with delta= and updates=) to calibrate "
      f"σ for it; got noise_multiplier={noise_multiplier!r}, epsilon={epsilon!r}."
    )
  if noise_multiplier is not None:
    return _positive(noise_multiplier, "noise_multiplier")
  if updates is None:
    raise ValueError("Mechanism: epsilon= needs updates= (the number of noisy updates planned).")
  return _accounting.dp_noise_multiplier(
    _positive(epsilon, "epsilon"), updates, q, delta, accountant=accountant,
    neighboring_relation=relation,
  )  # fmt: skip


class Mechanism:
  """DP-SGD with Poisson sampling: one object that builds every private piece consistently.

  ``update = (Σᵢ∈𝓑 clip_C(∇ℓᵢ) + σ·C·ξ) / B``, 𝓑 a Poisson batch of `sampler`, ``B`` its
  expected size, ξ drawn once per update from `key`. The pieces:

  * `loss` (for `TrainStep`/`accumulate`) and `grad` (for `microbatch`): the clipped loss and
    gradient of `loss_fn`, which take the batch's mask after the batch arguments
    (``loss(params, x, y, mask)`` for ``batch_argnums=(1, 2)``): padding never counts;
  * `optimizer(tx)`: ``optax.chain(dp_noise(σ, C, B, key), tx)``, the noise first;
  * `train_step(tx)`: ``TrainStep(loss, optimizer(tx), every_k, reduction="sum")``, each window
    one sampled batch (closed by ``force_emit=True`` on its last micro-batch);
  * `epsilon(state)`: ε after the updates `state` has made (`dp_updates`), for δ.

  A mechanism is one run: its key draws one noise stream, so a second optimizer (or a second
  mechanism on the key) is refused unless it resumes (``allow_key_reuse=True``, with the state
  restored at its count). The key and the sampler's seed are secret; σ, C, B, q, δ, the update
  count and ε may be published (the privacy guide's "what is secret").

  Args:
    loss_fn: ``loss(params, *args) -> scalar`` (``(scalar, aux)`` with `has_aux`), written for
      a batch; it is called on one example at a time (its batch axis of size 1 kept).
    l2_clip: the clip norm ``C``.
    sampler: the `PoissonSampler` that draws the logical batches: its expected batch size is
      the divisor ``B`` and its rate ``q`` what the accountant is told.
    key: the noise key (``jax.random.key(seed)``; secret, used for nothing else).
    noise_multiplier: σ; or give `epsilon` (with `delta` and `updates`) to calibrate it.
    epsilon: the target ε after `updates` updates (`dp_noise_multiplier`).
    delta: δ (default 1e-5), for `epsilon` and `epsilon()`.
    updates: the number of updates planned (with `epsilon`).
    batch_argnums: the arguments of `loss_fn` that hold the examples (all of them: labels too).
    shared_argnums: arguments passed whole to every example on purpose (`clipped_grad`).
    has_aux: `loss_fn` returns ``(value, aux)``.
    rescale_to_unit_norm: each clipped gradient ÷ C (`clipped_grad`); the noise follows.
    accountant: "rdp" or "pld" (`dp_epsilon`).
    neighboring_relation: "add_or_remove_one" (default) or "replace_one" (`dp_epsilon`).
    allow_key_reuse: resume a run from a checkpoint (`dp_noise`).

  Raises:
    TypeError, ValueError: for a sampler that is not a `PoissonSampler`, both or neither of
      `noise_multiplier` and `epsilon`, and what `clipped_grad`, `dp_noise` and
      `dp_noise_multiplier` refuse.

  >>> import jax, jax.numpy as jnp, optax
  >>> from optax_accum import privacy
  >>> def loss(params, x, y):
  ...   return jnp.mean((x @ params - y) ** 2)
  >>> sampler = privacy.PoissonSampler(1000, 0.064, 16, seed=0)
  >>> mech = privacy.Mechanism(loss, 1.0, sampler=sampler, key=jax.random.key(271_828),
  ...                          noise_multiplier=1.1, batch_argnums=(1, 2))
  >>> step = mech.train_step(optax.sgd(0.1))
  >>> mech.expected_batch_size, mech.mask_argnum
  (64.0, 3)
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    l2_clip: float,
    *,
    sampler: _poisson.PoissonSampler,
    key: Any,
    noise_multiplier: float | None = None,
    epsilon: float | None = None,
    delta: float = 1e-5,
    updates: int | None = None,
    batch_argnums: ArgNums = 1,
    shared_argnums: ArgNums = (),
    has_aux: bool = False,
    rescale_to_unit_norm: bool = False,
    accountant: str = "rdp",
    neighboring_relation: Any = "add_or_remove_one",
    allow_key_reuse: bool = False,
  ):
    if not isinstance(sampler, _poisson.PoissonSampler):
      raise TypeError(
        f"Mechanism: sampler must be a privacy.PoissonSampler (the sampling the accountant "
        f"assumes), got {sampler!r}."
      )
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    self.sampler = sampler
    self.mask_argnum = max(nums) + 1 if nums else 1
    kw = dict(
      batch_argnums=nums, mask_argnum=self.mask_argnum, shared_argnums=shared_argnums,
      has_aux=has_aux, rescale_to_unit_norm=rescale_to_unit_norm,
    )  # fmt: skip
    self.grad = _clipping.clipped_grad(loss_fn, l2_clip, **kw)
    self.loss = _clipping.clipped_loss(loss_fn, l2_clip, **kw)
    self.delta, self.accountant = delta, accountant
    self.neighboring_relation = neighboring_relation
    self.noise_multiplier = _sigma(
      noise_multiplier, epsilon, delta, updates, sampler.sampling_rate, accountant,
      neighboring_relation,
    )  # fmt: skip
    try:  # the key checked now, not when the noise is first handed out
      _noise._key_data(key)
    except (TypeError, ValueError) as e:
      raise type(e)(str(e).replace("dp_noise:", "Mechanism:", 1)) from None
    self._key, self._allow = key, bool(allow_key_reuse)
    self._noise = None

  @property
  def expected_batch_size(self) -> float:
    """``B = q·N``, the sampler's: the public divisor of the noisy sum."""
    return self.sampler.expected_batch_size

  @property
  def l2_clip(self) -> float:
    return self.grad.l2_clip

  def noise(self) -> optax.GradientTransformationExtraArgs:
    """The mechanism's `dp_noise` (σ, the clipped function's bound, B, the key): built once; a
    second call is refused (one key, one noise stream)."""
    if self._noise is not None:
      raise ValueError(
        "Mechanism: its noise was already handed out (to an optimizer or a TrainStep): a second "
        "noise stream from the same key would draw the same noise. Build one optimizer per "
        "mechanism, and one mechanism (one key) per run."
      )
    self._noise = _noise.dp_noise(
      self.noise_multiplier, self.grad, self.expected_batch_size, self._key,
      allow_key_reuse=self._allow,
    )  # fmt: skip
    return self._noise

  def optimizer(self, tx: optax.GradientTransformation | None = None):
    """``optax.chain(noise, tx)``: the noise first, then any optax optimizer (post-processing).

    Args:
      tx: the optimizer after the noise (None: the noisy update itself, e.g. for a hand-written
        step).

    Returns:
      An optax `GradientTransformationExtraArgs`; give `accumulate` or `TrainStep` it with
      ``reduction="sum"`` (`train_step` does).
    """
    noise = self.noise()
    return noise if tx is None else optax.chain(noise, tx)

  def train_step(self, tx: optax.GradientTransformation, every_k: int | None = None, **kwargs: Any):
    """``TrainStep(self.loss, self.optimizer(tx), every_k, reduction="sum", **kwargs)``: call it
    with the batch's rows and mask, ``step(params, state, *batch.take(x, y, microbatch=i))``
    for each micro-batch, ``force_emit=True`` on a Poisson batch's last one.

    A window is one sampled batch: `force_emit` closes it, and `every_k` is only a cap above
    any window (default: the most micro-batches a batch can hold, the sampler's
    `max_microbatches` or all its examples). A window that reaches `every_k` without
    `force_emit` is refused before it runs (it would join two batches in one update: an
    example sampled in both counted twice)."""
    s = self.sampler
    most = s.max_microbatches or math.ceil(s.num_examples / s.microbatch_size)
    step = TrainStep(self.loss, self.optimizer(tx), most if every_k is None else every_k,
                     reduction="sum", **kwargs)  # fmt: skip
    step._batch_windows = True
    return step

  def epsilon(self, state_or_updates: Any, delta: float | None = None) -> float:
    """ε after the updates an optimizer state has made (`dp_updates`), or after a count."""
    n = state_or_updates
    if not isinstance(n, int | np.integer):
      n = int(_noise.dp_updates(state_or_updates))
    return _accounting.dp_epsilon(
      int(n), self.sampler.sampling_rate, self.noise_multiplier,
      self.delta if delta is None else delta, accountant=self.accountant,
      neighboring_relation=self.neighboring_relation,
    )  # fmt: skip
