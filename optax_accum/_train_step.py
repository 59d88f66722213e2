"""`TrainStep`: the fastest cross-step path — two compiled programs, chosen on the host.

With a static `every_k` the host knows which micro-step closes a window, so there is no need
for a device conditional (`lax.cond`), which on CPU makes the zero updates and their
application real memory passes and on GPU makes the host wait for the predicate
(openxla/xla `xla/backends/gpu/runtime/conditional_thunk.cc`). `TrainStep` compiles

* the accumulating program: ``grad → add → advance`` (`_accumulate`'s pieces); the
  parameters and the inner state pass through donated, i.e. untouched in place, and no update
  is computed at all;
* the emitting program: ``grad → add → close_window(finish = apply the updates) → advance``;

and keeps the window position on the host, so dispatch never waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _accumulate, _checks
from optax_accum._typing import DType, Reduction

_NO_BUFFER = ()  # `grad_buffer=False`: an empty pytree, nothing donated or returned


class TrainStep:
  """A jitted micro-step ``grad → accumulate → (every k-th call) update → apply``.

  Each call takes one micro-batch. The window position lives on the host, so the right one of
  two compiled programs runs without a device conditional and without a host sync.

  Args:
    loss_fn: ``loss_fn(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux=True``),
      the loss of one micro-batch.
    inner: the optimizer applied once per window.
    every_k: the window length, a positive int (the host must know it).
    has_aux: whether `loss_fn` returns ``(loss, aux)``.
    donate: donate the parameters and the optimizer state to each call (the default; the
      arrays you pass in are invalid afterwards, as with any donating training step).
    reduction: as for `accumulate`: "mean" (``Σ wᵢ gᵢ / Σ wᵢ``) or "sum".
    accum_dtype: as for `accumulate`: the accumulator's dtype; None means the gradients'.
    skip_nonfinite: as for `accumulate`: drop (and count) micro-batches with NaN/Inf gradients.
    grad_buffer: keep a persistent, donated gradient-sized buffer that each program writes its
      gradients into, instead of allocating them as temporary memory on every call. None (the
      default) means True on CPU and False elsewhere: glibc serves temporaries above its mmap
      threshold (32 MiB) with fresh pages on every call, so there it saves thousands of page
      faults per step; GPU and TPU allocators cache their memory, so there it would only hold
      memory between steps. The buffer lives in this object, not in the optimizer state.

  ``step(params, state, *args, weight=None, force_emit=False)`` returns
  ``(params, state, loss)``, or ``(params, state, (loss, aux))`` with `has_aux`. The state
  is the `AccumulateState` that ``step.tx`` (an `accumulate` transformation) makes, so
  checkpoints are interchangeable.

  Raises:
    TypeError, ValueError: for a bad `every_k` (which must be a static int here), `reduction`
      or `accum_dtype`.

  >>> import jax, jax.numpy as jnp, optax, optax_accum
  >>> loss = lambda p, x: jnp.mean((x * p) ** 2)
  >>> step = optax_accum.TrainStep(loss, optax.sgd(0.1), every_k=2)
  >>> params = jnp.ones(3)
  >>> state = step.init(params)
  >>> for i in range(4):
  ...   params, state, l = step(params, state, jnp.full(3, i + 1.0))
  >>> int(state.gradient_step)
  2
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    inner: optax.GradientTransformation,
    every_k: int,
    *,
    has_aux: bool = False,
    donate: bool = True,
    reduction: Reduction = "mean",
    accum_dtype: DType | None = jnp.float32,
    skip_nonfinite: bool = True,
    grad_buffer: bool | None = None,
  ):
    if callable(every_k):
      raise TypeError(
        "TrainStep: every_k must be a positive int known on the host, got "
        f"{every_k!r}. For a schedule of window lengths use `accumulate` directly."
      )
    every_k = _checks.positive_int(every_k, "every_k", "TrainStep", maximum=_checks.MAX_WINDOW)
    self._cfg = _accumulate.make_config(
      inner, every_k, reduction, accum_dtype, skip_nonfinite, axis_name=None
    )
    self.every_k = every_k
    self.tx = _accumulate.transformation(self._cfg)
    self._grad = jax.value_and_grad(loss_fn, has_aux=has_aux)
    if grad_buffer is None:
      grad_buffer = jax.default_backend() == "cpu"
    self._grad_buffer: Any = None if grad_buffer else _NO_BUFFER
    donate_argnums = (0, 1, 2) if donate else (2,)
    self._programs = {
      emit: jax.jit(
        self._step, static_argnames="emit", donate_argnums=donate_argnums, keep_unused=True
      )
      for emit in (False, True)
    }
    self._position: int | None = None  # micro-steps taken in the open window
    self._last_state: Any = None

  def init(self, params: Any) -> _accumulate.AccumulateState:
    """The initial `AccumulateState` for `params`."""
    self._position, self._last_state = 0, None
    return self.tx.init(params)

  def _step(self, params, state, grad_buffer, args, weight, *, emit: bool):
    cfg = self._cfg
    value, grads = self._grad(params, *args)
    # Returning the gradients as the (donated) buffer's new value makes XLA compute them
    # straight into it: they stop being temporary memory.
    grad_buffer = _NO_BUFFER if grad_buffer is _NO_BUFFER else grads
    weight = _accumulate.check_update(cfg, grads, state, params, weight, False, emit)
    sums, total, dropped = _accumulate.add(cfg, grads, state, weight)
    inner_state, applied = state.inner_state, False
    if emit:
      window = _accumulate.Window(sums, total, state.inner_state, params, {})
      can_be_empty = _accumulate.can_be_empty(cfg, weight)
      (params, sums), inner_state, applied = _accumulate.close_window(
        cfg, grads, _accumulate.APPLY, can_be_empty, window
      )
    state = _accumulate.advance(cfg, state, sums, total, dropped, inner_state, emit, applied)
    return params, state, grad_buffer, value

  def _buffer(self, params: Any, args: tuple) -> Any:
    """The gradient buffer, made on first use with the gradients' shapes and dtypes, placed
    like the parameters (a gradient has its parameter's sharding)."""
    if self._grad_buffer is None:
      types = jax.eval_shape(lambda p, a: self._grad(p, *a)[1], params, args)
      self._grad_buffer = jax.tree.map(
        lambda t, p: jnp.zeros(t.shape, t.dtype, device=getattr(p, "sharding", None)),
        types,
        params,
      )
    return self._grad_buffer

  def __call__(
    self,
    params: Any,
    state: _accumulate.AccumulateState,
    *args: Any,
    weight: Any = None,
    force_emit: bool = False,
  ):
    """One micro-step; `force_emit=True` (a Python bool) closes a short last window."""
    if not isinstance(force_emit, bool):
      raise TypeError(f"TrainStep: force_emit must be a Python bool, got {force_emit!r}.")
    if isinstance(weight, int | float | np.number | np.ndarray):
      # A host value is checked here, before dispatch (reading a device array back would make
      # the host wait; a device weight that is invalid drops its micro-batch instead).
      _checks.weight(weight, "TrainStep")
    if self._position is None or state is not self._last_state:
      # A state we did not produce (restored, or from `init` of another object): read its
      # window position once. Every other call is dispatched without waiting for the device.
      self._position = int(jax.device_get(state.mini_step))
    emit = force_emit or self._position + 1 >= self.every_k
    program = self._programs[emit]
    params, state, self._grad_buffer, value = program(
      params, state, self._buffer(params, args), args, weight, emit=emit
    )
    self._position = 0 if emit else self._position + 1
    self._last_state = state
    return params, state, value

  def lower(self, params, state, *args, weight=None, emit: bool = False):
    """Lowers one of the two programs (for inspection: ``.compile().as_text()``, memory)."""
    grad_buffer = self._grad_buffer
    if grad_buffer is None:
      grad_buffer = jax.eval_shape(lambda p, a: self._grad(p, *a)[1], params, args)
    return self._programs[emit].lower(params, state, grad_buffer, args, weight, emit=emit)
