"""`TrainStep`: the fastest cross-step path — two compiled programs, chosen on the host.

With a static `every_k` the host knows which micro-step closes a window, so there is no need
for a device conditional (`lax.cond`), which on CPU makes the zero updates and their
application real memory passes and on GPU makes the host wait for the predicate
(openxla/xla `xla/backends/gpu/runtime/conditional_thunk.cc`). `TrainStep` compiles

* the accumulating program: ``grad → add → advance`` (`_window`'s pieces) on the state
  with its inner state hollow (`_host.hollow`; in the lean convention below, none): it only
  reads the parameters and never sees the inner state, so neither is passed in and handed back
  (every array a call passes costs it dispatch time), and no update is computed at all;
* the closing program, on ``(params, state)`` only: ``close_window(finish = apply the
  updates) → advance`` from the state's accumulator (`_window.close_from_state`). The
  emitting micro-step runs the accumulating program, then this one: the backward pass is
  compiled once (two programs compile in about the time of the protocol path's one), for one
  more dispatch per window. With every_k = 1 (no accumulator) one program does
  ``grad → add → close_window → advance``;
* for a small model (`FUSED_EMIT_MAX_OPS`: compiling the backward pass twice is cheap), the
  emitting program instead of the closing one: ``grad → add → close_window → advance``, one
  dispatch per micro-step; its two programs then take and hand back only the state's arrays
  each reads or writes, the host filling in what it knows (`_lean`: the position, the window's
  length), since on CPU each array a call returns costs it about 2 µs;
* with `axis_name`, the emitting program instead of the closing one: ``grad → acc + g →
  all-reduce, leaf by leaf → inner update → apply → advance``. Each leaf's all-reduce depends on
  that leaf only (`_window.close_leafwise`), so XLA's scheduler can start it while the backward pass
  still computes the gradients of earlier layers (what PyTorch DDP's buckets do after
  ``no_sync``), instead of all-reducing the whole window after the whole backward pass. The
  price: the backward pass is compiled twice (`benchmarks/accel.py`'s `overlap` section);

and keeps the window position on the host, so dispatch never waits for the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent import futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum.batch_size import _noise
from optax_accum.core import _batch, _checks, _state
from optax_accum.core._typing import AxisName, DType, Reduction
from optax_accum.front_ends import _accumulate, _config, _host, _lean, _window
from optax_accum.front_ends._fsdp_train_step import FsdpSteps
from optax_accum.parallel import _gspmd, _sharding
from optax_accum.parallel._sharding import state_partition_specs

_NO_BUFFER = ()  # `grad_buffer=False`: an empty pytree, nothing donated or returned
_HOST_NUMBERS = int | float | np.number | np.ndarray  # a weight given as a host value
# grad_buffer=None on CPU: the buffer for parameters of at least this many bytes in all. glibc
# serves a temporary above its mmap threshold (dynamic, at most 32 MiB) with fresh pages on every
# call, and XLA:CPU's temporaries are one allocation; below it the buffer saves nothing, and its
# arrays cost every call a dispatch per leaf (in and out).
GRAD_BUFFER_BYTES = 32 * 2**20

# Without `axis_name`: where compiling the backward pass twice is cheap, the emitting micro-step
# runs one program (grad → add → close, `_step(emit=True)`) instead of the accumulating program
# and then the closing one: one dispatch fewer per window (on CPU ~60 µs for a small model's
# parameters and Adam state, 1/3 of the optax notebook MLP's micro-step), for a second compiled
# backward pass. Cheap means a small accumulating program, by its lowered size: at most this many
# operations (`_host.ops`), and parameters below `GRAD_BUFFER_BYTES`, where a micro-step's own
# work is small enough for a dispatch to show. Measured (`benchmarks/small_models.py`, CPU
# seconds to compile the accumulating program): the notebook MLP's 325 operations 0.7 s, the two
# CNNs' 370 1.1-1.4 s, the two transformers' 1053 1.9-2.4 s; the 10M-parameter MLP of
# `benchmarks/_cross.py` (about 330 operations, 40 MB of parameters) keeps two programs, and its
# compile time.
FUSED_EMIT_MAX_OPS = 400

# With `axis_name`: the emitting micro-step runs one program that computes the last gradient and
# all-reduces the window leaf by leaf (True), or the accumulating program and then the closing
# program, which all-reduces the state's sums in one collective (False: the control of
# `tests/test_accel.py` and `benchmarks/accel.py`; it compiles the backward pass once).
OVERLAP_WITH_AXIS = True


# TrainStep's `has_aux` against a clipped loss's own (`privacy.clipped_loss(..., has_aux=)`),
# by whether the loss returns an aux.
AUX_MISMATCH = {
  True: (
    "TrainStep: loss_fn is privacy.clipped_loss(..., has_aux=True), which returns (loss, aux), "
    "but has_aux={has_aux!r}. Pass has_aux=True to TrainStep (it then returns (loss, aux), the "
    "aux one row per example), or build the loss with has_aux=False."
  ),
  False: (
    "TrainStep: has_aux={has_aux!r}, but loss_fn is privacy.clipped_loss without has_aux: it "
    "returns the loss alone. For each example's aux build it with clipped_loss(loss, C, "
    "has_aux=True, ...) (loss returning (value, aux)); else leave has_aux=False."
  ),
}


class TrainStep:
  """A jitted micro-step ``grad → accumulate → (every k-th call) update → apply``.

  Each call takes one micro-batch. The window position lives on the host, so the right
  compiled programs run without a device conditional and without a host sync: every call runs
  the accumulating program (gradient → add), and a window's last call then runs the closing
  program (inner update → apply, on the parameters and the state only), so the backward pass
  is compiled once, at the price of one more dispatch per window (every_k=1: one program).
  With `axis_name` the window's last call instead runs one emitting program (gradient → add →
  all-reduce leaf by leaf → update → apply), so the reduction can overlap the backward pass.
  So does a small model (a small accumulating program: compiling the backward pass twice is
  cheap, and a dispatch is a large part of its micro-step), decided once, from the first
  programs' lowered size; the choice changes no result, bit for bit (of the state, only the sums
  after a window closes differ: stale either way).

  Args:
    loss_fn: ``loss_fn(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux=True``),
      the loss of one micro-batch.
    inner: the optimizer applied once per window.
    every_k: the window length, a positive int (the host must know it), or a
      `FollowNoiseScale` policy: each window's length is then decided on the device when the
      window before it closes, from the noise statistics, and read back by the host once per
      update (a scalar; that read waits for the closing program).
    has_aux: whether `loss_fn` returns ``(loss, aux)`` (for ``privacy.clipped_loss`` it must
      match the loss's own `has_aux`, else ValueError).

      The parameters may hold non-array leaves (an Equinox module's activation functions and
      static fields): they pass through as `eqx.filter_jit` holds them, the state is made from
      the arrays only (as ``tx.init(eqx.filter(model, eqx.is_array))``), and the returned
      parameters are the same kind of object. With `optax.lookahead` the parameters are
      ``LookaheadParams(fast, slow)`` and `loss_fn` is evaluated at the fast weights.
    donate: donate what each call updates (the default): the state on every call, the
      parameters on the call that updates them (a window's last; an accumulating call only
      reads them and returns the ones you gave it). Donated arrays are invalid afterwards, as
      with any donating training step: rebind what every call returns, ``params, state, loss
      = step(params, state, batch)``. An Equinox module passed to an updating call is deleted
      with them: reading its arrays afterwards raises JAX's
      ``RuntimeError: Array has been deleted``, and passing it again raises this class's
      `ValueError` naming the leaf and ``donate=False``. ``donate=False`` keeps your arrays,
      at a price: each update then writes the new parameters and optimizer state beside the
      old ones (twice their memory).
    reduction: as for `accumulate`: "mean" (``Σ wᵢ gᵢ / Σ wᵢ``) or "sum" (``Σ wᵢ gᵢ``, weighted).
    accum_dtype: as for `accumulate`: the accumulator's dtype (floating or complex; never
      narrower than a gradient). None: the parameters' dtypes at `init`; a wider gradient then
      raises rather than being narrowed.
    skip_nonfinite: as for `accumulate`: drop (and count) micro-batches with NaN/Inf gradients;
      "window": check each window's sums once, at emission, so that the accumulating program
      reads each gradient once (on CPU with parameters of 32 MiB or more, where the default
      keeps a gradient buffer, pass ``grad_buffer=False`` too: the buffer is a second reader).
      With `noise_scale`, ``|g|²`` then comes from the window's last micro-batch only, read by
      the emitting micro-step, which then runs one program (gradient → add → close) instead
      of the accumulating and the closing ones.
    grad_buffer: keep a persistent, donated gradient-sized buffer that each program writes its
      gradients into, instead of allocating them as temporary memory on every call. None (the
      default) means True on CPU for parameters of 32 MiB or more in all, else False: glibc
      serves temporaries above its mmap threshold (32 MiB) with fresh pages on every call, so
      there it saves thousands of page faults per step; below it the buffer's arrays only add
      to each call's dispatch; GPU and TPU allocators cache their memory, so there it would
      only hold memory between steps. The buffer lives in this object, not in the optimizer
      state. Not with `axis_name` (the gradients are per device there).
    weight_fn: ``weight_fn(*args)`` (the micro-batch arguments) returns the micro-batch's
      weight, e.g. its number of real tokens, computed inside the program; with `axis_name`,
      each device's weight of its own rows, which is what a token-weighted mean across devices
      needs. Instead of passing ``weight=`` to each call.
    axis_name: the data-parallel mesh axis, under plain `jax.jit` with a mesh in effect
      (`jax.set_mesh`) or given as `mesh`: each device takes its share of every micro-batch
      (every array of `args` is split along axis 0), keeps its gradients local and adds them
      to its own partial sums; the emitting micro-step runs one program that computes the
      last gradient and all-reduces the window leaf by leaf, once per window, so that each
      leaf's all-reduce can overlap the rest of the backward pass (the closing program is not
      used: the backward pass is compiled into both programs).
      `init` places the per-device accumulator (`state_partition_specs`). The returned loss
      (and float aux) is the mean over the devices (with ``reduction="sum"`` their sum: the
      whole micro-batch's, as the gradient is); the per-example aux of
      ``privacy.clipped_loss(..., has_aux=True)``, the devices' rows joined. Parameters sharded
      over the axis (FSDP) are gathered, with a full-size accumulator on every device; without
      `axis_name`, GSPMD reduces every micro-step instead, into an accumulator sharded like the
      parameters.
    mesh: the mesh whose `axis_name` to bind; default the one in effect.
    noise_scale: as for `accumulate`: keep the gradient noise-scale statistics in the state
      (read them with `optax_accum.noise_scale(state)`); implied by `FollowNoiseScale`.
    rounding: as for `accumulate`: None, or "nearest"/"stochastic" for an accumulator in
      `accum_dtype` itself (``accum_dtype=jnp.bfloat16, rounding="stochastic"``: 2 bytes per
      parameter, unbiased).
    keep_unsharded: FSDP (parameters sharded over `axis_name`, under plain `jax.jit`): what
      stays unsharded for a window of ``k`` calls, as for `microbatch` (``L`` sharded
      parameters). ``"nothing"``: each call gathers them and reduce-scatters its gradient into
      an accumulator sharded like them (``L·k`` + ``L·k`` per update). ``"params"``: the
      window's first call gathers them once and this object holds the whole copy until the
      window closes (``L`` + ``L·k``). ``"params_and_grads"``: the held copy and a whole
      accumulator per device, reduce-scattered once by the window's last call (``L`` + ``L``).
      The update runs on the sharded parameters, gradients and optimizer state (under GSPMD:
      a global-norm clip sees the whole gradient). With the first two, ``step.tx`` is
      ``accumulate`` without axis (the state is global, its sums sharded like the
      parameters). Not with every_k=1, the noise statistics, or ``rounding="stochastic"``.

  ``step(params, state, *args, weight=None, force_emit=False)`` returns
  ``(params, state, loss)``, or ``(params, state, (loss, aux))`` with `has_aux`. The state
  is the `AccumulateState` that ``step.tx`` (an `accumulate` transformation) makes, so
  checkpoints are interchangeable. A state whose window was opened with another `every_k`
  (restored from a run with another window length) finishes that window at the length it
  opened with; the next window takes this `every_k` (the host reads the state's position and
  window length once, for a state it did not make).

  `TrainStep` is a host-side driver: call it from Python, not inside `jax.jit` (it compiles
  its own programs); inside your own jitted step use `accumulate` (with ``emit=``).

  Raises:
    TypeError, ValueError: for a bad `every_k` (which must be a static int here), `reduction`,
      `accum_dtype` or `weight_fn`; at call time, for a bad host `weight` (before anything is
      dispatched) or a host value from `weight_fn` (naming it), a state made with every_k=1
      for every_k > 1 (or the reverse) or with another `accum_dtype`, traced arguments
      (called inside `jax.jit`), or, with `axis_name`, no mesh.

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

  # Whether a call that follows one of this object's own (the parameters and the state it
  # handed back) may take `_lean_call`; set by each call that takes the full path.
  _steady = False

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    inner: optax.GradientTransformation,
    every_k: int | _noise.FollowNoiseScale,
    *,
    has_aux: bool = False,
    donate: bool = True,
    reduction: Reduction = "mean",
    accum_dtype: DType | None = jnp.float32,
    skip_nonfinite: bool = True,
    grad_buffer: bool | None = None,
    weight_fn: Callable[..., Any] | None = None,
    axis_name: AxisName | None = None,
    mesh: Any = None,
    noise_scale: bool = False,
    rounding: str | None = None,
    keep_unsharded: str | None = None,
  ):
    if callable(every_k):
      raise TypeError(
        "TrainStep: every_k must be a positive int known on the host (or a FollowNoiseScale), "
        f"got {every_k!r}. For a schedule of window lengths use `accumulate` directly."
      )
    if not isinstance(every_k, _noise.FollowNoiseScale):
      every_k = _checks.positive_int(every_k, "every_k", "TrainStep", maximum=_checks.MAX_WINDOW)
    if weight_fn is not None and not callable(weight_fn):
      raise TypeError(f"TrainStep: weight_fn must be callable or None, got {weight_fn!r}.")
    self._cfg = _config.make_config(
      inner, every_k, reduction, accum_dtype, skip_nonfinite, axis_name, noise_scale, rounding
    )
    self._cfg = self._cfg._replace(front="TrainStep", weighted=weight_fn is not None)
    # A clipped loss (privacy.clipped_loss) is a private path: its options are checked against
    # the privacy contract now; a dp_noise in `inner` is found by `init`.
    self._private, self._loss_fn = _checks.private_fun(loss_fn), loss_fn
    if self._private:
      _config.check_private(self._cfg, "TrainStep")
    # clipped_loss(..., has_aux=True): its aux holds one row per example (joined over the axis).
    self._aux_rows = self._private and _checks.private_aux_rows(loss_fn)
    if self._private and self._aux_rows != bool(has_aux):
      raise ValueError(AUX_MISMATCH[self._aux_rows].format(has_aux=has_aux))
    axis = self._cfg.axis
    if grad_buffer and axis.stacks:
      raise ValueError("TrainStep: grad_buffer=True needs axis_name=None (per-device gradients).")
    self.every_k = every_k
    self.tx = _accumulate.transformation(self._cfg)
    # Non-array leaves of the parameters (an Equinox module's activation functions) ride as
    # `_batch.Static` nodes, as `eqx.filter_jit` holds them; the loss sees them unwrapped.
    # `optax.lookahead`'s parameters are LookaheadParams(fast, slow): the loss is evaluated at
    # the fast weights (its gradients are theirs).
    self._grad = jax.value_and_grad(
      lambda p, *a: loss_fn(_state.gradient_like(_batch.show_static(p)), *a),
      has_aux=has_aux,
    )
    self._weight_fn, self._mesh = weight_fn, mesh
    if grad_buffer is None:
      grad_buffer = None if jax.default_backend() == "cpu" and not axis.stacks else False
    # None until the first call or `compile` makes the buffer; `_NO_BUFFER` without one.
    self._grad_buffer: Any = _NO_BUFFER if grad_buffer is False else None
    self._buffer_auto = grad_buffer is None  # on CPU: only for large enough parameters
    self._donate_argnums = (0, 1, 2) if donate else (2,)
    # Whether the emitting micro-step is one program (grad → add → close) rather than the
    # accumulating program followed by the closing one: with every_k = 1; with an axis, whose
    # window it reduces leaf by leaf (`_window.close_leafwise`); with skip_nonfinite="window"
    # and the noise statistics, which it reads from the window's last gradient
    # (`_window.sampled_sq_norm`); and for a small model (`FUSED_EMIT_MAX_OPS`), decided once,
    # when the first programs are lowered (`_choose_emitting`).
    self._leafwise = axis.stacks and OVERLAP_WITH_AXIS
    sampled = self._cfg.window_check and self._cfg.noise
    self._fused_emit = self._cfg.unaccumulated or self._leafwise or sampled
    self._chosen = self._fused_emit or axis.stacks  # whether `_choose_emitting` has decided
    # The lean calling convention (`_lean`: a program takes and returns only the state's arrays
    # it reads or writes) for a small model's programs (`_choose_emitting`) or every_k = 1,
    # where no output sharding is pinned (no axis, no FSDP; `_pin` rules out a mesh), off a
    # private path, for an int every_k and with donation (the state a call is given is spent).
    lean = donate and not (axis.stacks or self._private or keep_unsharded)
    self._lean_ok = lean and isinstance(every_k, int)
    # (whether its emitting program writes the sums too is decided with it: `_choose_emitting`)
    self._take_lean(self._cfg.unaccumulated and self._lean_ok, sums=False)
    # The host-known scalars of the states it hands back, and those of the next ones (`_host_known`)
    self._constants, self._known = _lean.Constants(), {}
    self._compiled: dict[tuple, Any] = {}  # by `_host.signature`: both programs, compiled together
    self._key: tuple | None = None  # the last call's `_host.signature`
    self._pair = self._calls = None  # its programs, `_compiled[_key]`, and `_direct`'s calls
    self._hollows: dict[Any, Any] = {}  # `_host.hollow` by the inner state's tree structure
    self._hollow_of: tuple = (None, None)  # the last inner state and its `_host.hollow`
    self._programs = self._jit()
    # Whether the programs' output shardings are set (`_pin`): with axis_name, or without one
    # for parameters placed on a mesh (the accumulator sharded like them).
    self._pinned = False
    self._position: int | None = None  # micro-steps taken in the open window
    # The open window's length (a restored state's may differ; FollowNoiseScale's changes).
    self._window_k = getattr(every_k, "min_k", every_k)
    self._last_state: Any = None
    # Whether only force_emit may close a window (`privacy.Mechanism.train_step`: a window is one
    # Poisson batch; every_k a cap above any).
    self._batch_windows = False
    self._last_params: Any = None  # the parameters the last call returned
    self._arrays = True  # whether every leaf of those parameters is an array (`_host.all_arrays`)
    self._donates = donate
    # FSDP: what stays unsharded for a window, with programs of its own (`_fsdp_train_step`).
    self._fsdp = None
    if keep_unsharded is not None:
      self._fsdp = FsdpSteps(self, keep_unsharded)
      self.tx = self._fsdp.tx
      self._chosen = True  # (its programs are its own: no emitting program to choose)

  def _jit(self, out_shardings: Any = None) -> dict[bool, Any]:
    """The two programs, by `emit`: the accumulating one (False) and the emitting one (True):
    with every_k = 1 (then the only one) or with `axis_name` (`_fused_emit`), the one that
    computes the last gradient, adds and closes the window; else the closing program, which
    the emitting micro-step runs after the accumulating one (`_close`)."""
    self._compiled, self._key = {}, None
    donated = 0 in self._donate_argnums
    kw = lambda i: {} if out_shardings is None else {"out_shardings": out_shardings[i]}
    if self._lean:  # (params, reads, part, grad_buffer, args, weight): `_lean.operands`
      lean = lambda emit, donate: jax.jit(  # noqa: E731
        functools.partial(self._lean_step, emit=emit), donate_argnums=donate, keep_unused=True
      )
      programs = {True: lean(True, (0, 2, 3) if donated else (3,))}
      if not self._cfg.unaccumulated:
        programs[False] = lean(False, (2, 3) if donated else (3,))
      return programs
    if self._fused_emit:
      step = functools.partial(self._step, emit=True)
      emitting = jax.jit(step, donate_argnums=self._donate_argnums, keep_unused=True, **kw(1))
    else:
      donate = (0, 1) if donated else ()
      emitting = jax.jit(self._close, donate_argnums=donate, keep_unused=True, **kw(1))
    if self._cfg.unaccumulated:
      return {True: emitting}
    # The accumulating program neither takes nor returns the parameters (it only reads them:
    # not donated) and takes the state with its inner state hollow (`_host.hollow`).
    donate = (1, 2) if donated else (2,)
    accumulating = jax.jit(self._accumulating, donate_argnums=donate, keep_unused=True, **kw(0))
    return {False: accumulating, True: emitting}

  def _binds_here(self) -> bool:
    """With `axis_name` under plain jit: the programs bind the axis themselves."""
    return self._cfg.axis.unbound()

  def _state_shardings(self, params: Any) -> tuple[Any, Any]:
    """The parameters' shardings and the state's (`state_partition_specs`)."""
    params = _batch.none_for_static(_batch.hide_static(params))
    shardings = _host.param_shardings(self._cfg.axis_name, self._mesh, params)
    axis = self._cfg.axis.name
    specs = state_partition_specs(self.tx, shardings, axis, params=params)
    return shardings, specs

  def _pin(self, params: Any) -> None:
    """Pins the programs' output shardings to the parameters' own and the state's: the
    closing program updates replicated (gathered) parameters on every device, and FSDP
    parameters and their optimizer state must leave it sharded as they came in. Without
    `axis_name`, for parameters placed on a mesh (`_host.on_mesh`): the accumulator and the inner
    state sharded like the parameters (GSPMD reduces every micro-step into it)."""
    if self._pinned or self._fsdp is not None:  # (FSDP: its programs pin their own)
      return
    if not self._cfg.axis.stacks:
      self._pinned = True
      specs = _host.mesh_state_shardings(self.tx, params)
      if specs is not None:
        self._chosen = True  # parameters on a mesh: the programs' shardings pinned as they are
        self._lean_ok = False  # (their outputs: whole states, placed; sharded: no pooled check)
        self._take_lean(False, sums=False)
        shardings, state = specs
        hollow = state._replace(inner_state=None)
        emitting = (shardings, state, None, None) if self._fused_emit else (shardings, state)
        self._programs = self._jit(out_shardings=((hollow, None, None), emitting))
      return
    if not self._binds_here():
      return
    _, specs = self._state_shardings(params)
    shardings = _host.param_shardings(self._cfg.axis_name, self._mesh, _batch.hide_static(params))
    rep = P() if self._mesh is None else NamedSharding(self._mesh, P())
    hollow = (specs._replace(inner_state=None), _NO_BUFFER, rep)
    emitting = (shardings, specs, _NO_BUFFER, rep) if self._fused_emit else (shardings, specs)
    self._programs = self._jit(out_shardings=(hollow, emitting))
    self._pinned = True

  def init(self, params: Any) -> _state.AccumulateState:
    """The initial `AccumulateState` for `params` (with `axis_name`: placed on the mesh, the
    accumulator per device, as `state_partition_specs` says)."""
    self._position, self._last_state = 0, None
    arrays = _batch.none_for_static(_batch.hide_static(params))
    if self._private:  # a clipped loss: the accumulator made for these parameters (≥ float32)
      _config.check_private(self._cfg, "TrainStep.init", arrays)
    # Both halves of the mechanism or neither (the privacy package's check).
    _checks.private_check("train_step", "TrainStep.init", self._private, self._cfg, arrays)
    fsdp = None if self._fsdp is None else self._fsdp.init(params)  # None: the state below
    if fsdp is not None:
      return fsdp
    if not self._cfg.axis.stacks:
      self._pin(params)
      specs = _host.mesh_state_shardings(self.tx, params)
      params = _batch.none_for_static(_batch.hide_static(params))  # arrays only, as eqx.filter
      if specs is None:
        return self.tx.init(params)
      # Made on the mesh, each leaf where the programs keep it: the accumulator and the inner
      # state sharded like the parameters from the start (never a replicated copy per device).
      return jax.jit(self.tx.init, out_shardings=specs[1])(params)
    params = _batch.none_for_static(_batch.hide_static(params))  # arrays only, as eqx.filter
    if not self._binds_here():
      return self.tx.init(params)
    self._pin(params)
    _, specs = self._state_shardings(params)
    init = self._bind(self.tx.init)
    return jax.jit(init, out_shardings=specs)(params)

  def _bind(self, fun: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """`fun` with the axis bound under plain jit; the state is per device (`_sharding`)."""
    return _gspmd.bind(
      fun,
      self._cfg.axis_name,
      mesh=self._mesh,
      state_specs=_sharding.per_device_specs,
      caller="TrainStep",
      **kwargs,
    )

  def _lean_step(self, params, reads, part, grad_buffer, args, weight, *, emit: bool):
    """A program in the lean calling convention (`_lean`): the state rebuilt from what it
    reads and what it writes, the micro-step, and only the written fields handed back."""
    state = _lean.whole(emit, reads, part, self._layout)
    params, state, grad_buffer, value = self._step(
      params, state, grad_buffer, args, weight, emit=emit
    )
    part = _lean.written(emit, state, self._layout)
    if emit:
      return params, part, grad_buffer, value
    return part, grad_buffer, value

  def _accumulating(self, params, state, grad_buffer, args, weight):
    """The accumulating program: gradient → add. It takes the state with its inner state
    hollow (`_host.hollow`) and returns ``(state, grad_buffer, value)``: the parameters are only
    read (not donated, not returned), the inner state never seen."""
    _, state, grad_buffer, value = self._step(params, state, grad_buffer, args, weight, emit=False)
    return state, grad_buffer, value

  def _step(self, params, state, grad_buffer, args, weight, *, emit: bool):
    axis = self._cfg.axis
    if not axis.unbound():
      return self._micro_step(params, state, grad_buffer, args, weight, emit=emit)
    # Data parallel under plain jit: the micro-step runs per device (`_gspmd.bind`); the
    # accumulating program's state comes hollow (an FSDP-sharded inner state is never gathered
    # for nothing), and the parameters stay outside the bound region (only read).
    run = functools.partial(self._bound_step, emit=emit)
    new_params, state, value = self._bind(run, batch_argnums=2)(params, state, args, weight)
    return (new_params if emit else params), state, grad_buffer, value

  def _bound_step(self, params, state, args, weight, *, emit: bool):
    axis = self._cfg.axis
    local = axis.to_varying(params)  # per-device gradients: no all-reduce here
    new_params, state, _, value = self._micro_step(
      local, state, _NO_BUFFER, args, weight, emit=emit, replicated=params
    )
    return (new_params if emit else None), state, self._over_devices(value)

  def _over_devices(self, value: Any) -> Any:
    """The returned loss (and float aux) over the devices: averaged, or with
    ``reduction="sum"`` summed (a sum loss's value for the whole micro-batch, as its gradient
    is; a clipped loss is one); a clipped loss's per-example aux rows (`_aux_rows`) joined
    instead, in the batch's order (each device holds a contiguous block of the rows)."""
    axis = self._cfg.axis
    over = lax.psum if self._cfg.reduction == "sum" else lax.pmean
    floats = lambda t: jax.tree.map(lambda x: over(x, axis.name) if _host.is_float(x) else x, t)  # noqa: E731
    if not self._aux_rows:
      return floats(value)
    loss, aux = value
    return floats(loss), axis.join_rows(aux)

  def _micro_step(self, params, state, grad_buffer, args, weight, *, emit: bool, replicated=None):
    """grad → add → (emit: close_window, apply) → advance. With data parallelism `params` are
    the device-varying view to differentiate, `replicated` the parameters to update."""
    cfg = self._cfg
    value, grads = self._grad(params, *args)
    # optax.lookahead's parameters are LookaheadParams(fast, slow); its gradients the fast ones.
    grads = _batch.none_for_static(_state.gradient_like(grads))
    hidden = params if replicated is None else replicated
    params = _batch.none_for_static(hidden)
    # Returning the gradients as the (donated) buffer's new value makes XLA compute them
    # straight into it: they stop being temporary memory.
    grad_buffer = _NO_BUFFER if grad_buffer is _NO_BUFFER else grads
    if self._weight_fn is not None:
      weight = _checks.weight(self._weight_fn(*args), "TrainStep", name="weight_fn(*args)")
    try:
      weight = _config.check_update(cfg, grads, state, params, weight, False, emit, "TrainStep")
    except (TypeError, ValueError) as e:
      raise _host.in_trainstep_words(e) from None
    sq = _window.sq_norm(cfg, grads, state, emit)  # with noise_scale: also the finite check
    sums, total, dropped = _window.add(cfg, grads, state, weight, sq)
    noise = _window.add_noise(cfg, grads, state, weight, dropped, sq)
    window = _window.Window(sums, total, state.inner_state, params, {}, noise)
    if emit:
      can_be_empty = _window.can_be_empty(cfg, weight)
      if self._leafwise:
        closed = _window.close_leafwise(cfg, grads, state, weight, window, dropped, can_be_empty)
      else:
        closed = _window.close_window(cfg, grads, _window.APPLY, can_be_empty, window)
      params, sums = closed.out
      params = _batch.restore_static(params, hidden)
    else:
      closed = _window.keep_open(_window.APPLY, window)
    state = _window.advance(cfg, state, sums, total, dropped, closed, emit)
    return (params if emit else hidden), state, grad_buffer, value

  def _close(self, params: Any, state: Any) -> tuple[Any, Any]:
    """The closing program: the window the accumulating program has just added the last
    micro-batch to, closed from the state (`_window.close_from_state`: the one all-reduce
    with `axis_name`, the inner update, the application). No batch and no gradient: the
    emitting micro-step compiles the backward pass once, in the accumulating program."""
    if not self._cfg.axis.unbound():
      return self._close_window(params, state)
    # Data parallel under plain jit: bound like `_step` (the state per device), no batch.
    return self._bind(self._close_window, batch_argnums=())(params, state)

  def _close_window(self, params: Any, state: Any) -> tuple[Any, Any]:
    hidden = params
    params = _batch.none_for_static(hidden)
    # The gradients' types, for `_window.close_window`'s dtypes and device variance: `jax.grad`
    # gives each gradient its parameter's dtype, and per-device gradients vary over the axis.
    like = self._cfg.axis.to_varying(_state.gradient_like(params))
    new_params, state = _window.close_from_state(self._cfg, state, params, like)
    return _batch.restore_static(new_params, hidden), state

  def _grads_of(self, params: Any, args: tuple) -> Any:
    """The gradients as `_micro_step` takes them (arrays only; lookahead's fast weights')."""
    grads = self._grad(params, *args)[1]
    return _batch.none_for_static(_state.gradient_like(grads))

  def _buffer(self, params: Any, args: tuple) -> Any:
    """The gradient buffer, made on first use with the gradients' shapes and dtypes, placed
    like the parameters (a gradient has its parameter's sharding)."""
    if self._grad_buffer is None:
      types = self._buffer_types(params, args)
      if types is not _NO_BUFFER:
        types = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype, device=t.sharding), types)
      self._grad_buffer = types
    return self._grad_buffer

  def _buffer_types(self, params: Any, args: tuple) -> Any:
    """`_types`, or `_NO_BUFFER` where the default (``grad_buffer=None``) decides, from the
    first parameters, that they are too small for the buffer to pay (`GRAD_BUFFER_BYTES`)."""
    if self._buffer_auto:
      self._buffer_auto = False
      arrays = jax.tree.leaves(_batch.none_for_static(params))
      if sum(np.size(x) * jnp.result_type(x).itemsize for x in arrays) < GRAD_BUFFER_BYTES:
        self._grad_buffer = _NO_BUFFER
        return _NO_BUFFER
    return self._types(params, args)

  def _types(self, params: Any, args: tuple) -> Any:
    """The gradient buffer's `jax.ShapeDtypeStruct`s, placed like the parameters (what
    `compile` and `lower` compile for, so that the buffer `_buffer` makes fits them)."""
    types = jax.eval_shape(self._grads_of, params, args)
    params = _state.gradient_like(_batch.none_for_static(params))
    return jax.tree.map(
      lambda t, p: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=_host.placed(p)), types, params
    )

  def __call__(
    self,
    params: Any,
    state: _state.AccumulateState,
    *args: Any,
    weight: Any = None,
    force_emit: bool = False,
  ):
    """One micro-step; `force_emit=True` (a host boolean scalar) closes a short last window."""
    steady = self._steady and weight is None and force_emit is False
    if steady and state is self._last_state and params is self._last_params:
      out = self._lean_call(params, state, args)  # (the call that follows one of its own)
      if out is not None:
        return out
    if force_emit is not False:  # (the default, checked without a call)
      force_emit = _checks.host_bool(force_emit, "force_emit", "TrainStep")
    if weight is not None and self._weight_fn is not None:
      raise TypeError("TrainStep: pass weight= or give weight_fn, not both.")
    if weight is not None and (self._private or _checks.holds_private_state(state)):
      _checks.refuse_private("weight", "TrainStep")
    if force_emit and self._private:  # windows of a padded sampler: the mask must be used
      _checks.private_check("padding", "TrainStep", self._loss_fn, "force_emit=True")
    if weight is not None and isinstance(weight, _HOST_NUMBERS):
      # A host value is checked here, before dispatch (reading a device array back would make
      # the host wait; a device weight that is invalid drops its micro-batch instead).
      _checks.weight(weight, "TrainStep")
    fresh = state is not self._last_state  # a state this object did not make
    if self._lean and fresh:  # a host-known scalar deleted through another state: a live one
      state = self._constants.revive(state)  # (in the last state handed back: `_dispatch_lean`)
    if fresh or params is not self._last_params:
      self._arrays = _host.all_arrays(params, state)
      self._known = {}  # (`_host_known`: the placement of what it caches may change)
    arrays = self._arrays  # (what the last call returned is alive, its kinds of leaves known)
    if self._position is None or fresh:
      self._read_position(params, state, args)
    if self._donates and (fresh or params is not self._last_params):
      params, state = _host.distinct(params, state)  # never one buffer donated twice
    emit = force_emit or self._position + 1 >= self._window_k
    if emit and not force_emit and self._batch_windows:
      text = _checks.PRIVATE_REFUSED["window_not_batch"]
      raise ValueError(text.format(caller="TrainStep", k=self._window_k))
    if not self._pinned:
      self._pin(params)
    if not self._chosen:  # the first call: the programs compiled, the emitting one chosen
      self.compile(params, state, *args, weight=weight)
    hidden = params if arrays else _batch.hide_static(params)
    hidden, state, self._grad_buffer, value = self._dispatch(
      emit, hidden, state, self._buffer(hidden, args), args, weight
    )
    if emit:  # (an accumulating micro-step only reads the parameters)
      params = hidden if arrays else _batch.show_static(hidden)
    self._moved(emit, params, state)
    self._steady = self._lean and arrays and not self._batch_windows and self._key is not None
    return params, state, value

  def _lean_call(self, params: Any, state: Any, args: tuple) -> tuple | None:
    """`__call__` where nothing needs looking at: the parameters and the state are the ones
    this object handed back (their arrays alive and distinct, the window position known), no
    weight and no `force_emit`, the lean convention (`_lean`; one device, every leaf an array,
    windows of an int `every_k`). On a small model the full path's checks cost a measurable
    share of the micro-step (`benchmarks/train_step_parts.py`). None where the program refuses
    its inputs before running (other micro-batch types, a deleted array): the full path then
    runs the call, as it did before this path existed. A failure while running that left
    every input alive is raised here, never run again."""
    emit = self._position + 1 >= self._window_k
    reads, part = _lean.operands(emit, state, self._layout)
    try:
      out = self._direct(emit)(params, reads, part, self._grad_buffer, args, None)
    except (TypeError, ValueError):
      return None
    except RuntimeError:  # (a deleted array, with several devices; else it failed running)
      leaves = jax.tree.leaves((params, state))
      if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        return None
      raise
    params, state, self._grad_buffer, value = self._lean_state(emit, params, state, out)
    self._moved(emit, params, state)
    return params, state, value

  def _direct(self, program: bool) -> Callable[..., Any]:
    """`_pair[program]`'s own call: JAX's C++ dispatch, which `jax.stages.Compiled.__call__`
    wraps in a Python frame (a few percent of a small model's call on CPU:
    `benchmarks/train_step_parts.py` calls the notebook MLP's accumulating program both ways).
    The compiled program itself until its first call has made that call, or where JAX keeps
    none (`_call` is JAX's attribute, not its API: without it this is the public call)."""
    call = self._calls.get(program)
    if call is None:
      call = getattr(self._pair[program], "_call", None)
      if call is None:
        return self._pair[program]
      self._calls[program] = call
    return call

  def _moved(self, emit: bool, params: Any, state: Any) -> None:
    """After a call: the window position, the next window's length once one closes, and what
    the call handed back (which the call that follows is checked against)."""
    self._position = 0 if emit else self._position + 1
    if emit:
      self._window_k = self._next_window_k(state)
    self._last_state, self._last_params = state, params

  def _read_position(self, params: Any, state: Any, args: tuple) -> None:
    """A state we did not produce (restored, or from `init` of another object): read its window
    position once (and the length its open window was opened with, which it keeps). Every other
    call is dispatched without waiting for the device."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, state, args))):
      raise TypeError(_host.INSIDE_JIT)
    _config.check_state(state, "TrainStep")
    _host.check_live(params, state)
    position, window_k = jax.device_get((state.mini_step, state.window_k))
    self._position = int(position)
    self._window_k = int(window_k) if self._position else self._next_window_k(state)

  def _next_window_k(self, state: Any) -> int:
    """The length of the window that opens next: `every_k`, or under `FollowNoiseScale` the
    one the closing program decided from the noise statistics (read back: one device-to-host
    read of a scalar per update, which waits for that program)."""
    if isinstance(self.every_k, _noise.FollowNoiseScale):
      # Clipped like the device clips it (`_config.window_length`): a restored state's
      # decision may come from a policy with other bounds.
      return int(self.every_k.clip(int(jax.device_get(state.window_k))))
    return self.every_k

  def _dispatch(self, emit: bool, params, state, grad_buffer, args, weight):
    """Runs the accumulating program, and on an emitting micro-step the closing one after it
    (with every_k = 1, `axis_name`, or the sampled noise statistics, the one emitting program
    that adds and closes instead). Returns ``(params, state, grad_buffer, value)``."""
    if self._fsdp is not None:  # FSDP: its own programs (`_fsdp_train_step`)
      return self._fsdp.dispatch(emit, params, state, args, weight)
    whole = (params, state, grad_buffer, args, weight)
    if self._lean:
      return self._dispatch_lean(emit, whole)
    if emit and self._fused_emit:
      return self._first(True, whole, whole)
    inner = state.inner_state
    hollow = state._replace(inner_state=self._hollow(inner))
    operands = (params, hollow, grad_buffer, args, weight)
    state, grad_buffer, value = self._first(False, operands, whole)
    state = state._replace(inner_state=inner)
    if emit:
      params, state = self._run(self._key, True, (params, state), (params, state))
    return params, state, grad_buffer, value

  def _dispatch_lean(self, emit: bool, whole: tuple) -> tuple:
    """`_dispatch` in the lean calling convention (`_lean`): the program's operands from the
    state, and the state after the call from what it wrote and what the host knows."""
    params, state, grad_buffer, args, weight = whole
    reads, part = _lean.operands(emit, state, self._layout)
    try:
      out = self._first(emit, (params, reads, part, grad_buffer, args, weight), whole)
    except ValueError:  # (refused before it ran: nothing donated)
      # A host-known scalar of the last state handed back, deleted through another state that
      # shares it (donated to a user's function): the call again with a live one.
      revived = self._constants.revive(state)
      if revived is state:
        raise
      return self._dispatch_lean(emit, (params, revived, grad_buffer, args, weight))
    return self._lean_state(emit, params, state, out)

  def _lean_state(self, emit: bool, params: Any, state: Any, out: tuple) -> tuple:
    """``(params, state, grad_buffer, value)`` after a lean program's call that was given
    `params` and `state` and handed back `out` (`_lean.merged`)."""
    if emit:
      params, part, grad_buffer, value = out
      position, window_k = 0, self.every_k
    else:
      part, grad_buffer, value = out
      position, window_k = self._position + 1, self._window_k
    state = _lean.merged(emit, state, part, self._host_known(emit, state, position, window_k))
    return params, state, grad_buffer, value

  def _host_known(self, emit: bool, state: Any, position: int, window_k: int) -> tuple:
    """`_lean.merged`'s host-known scalars after this call (`_lean.Constants`), kept by value
    for the calls that follow while the parameters and the state are the ones this object
    handed back (their placement then stays); made again if deleted."""
    key = (emit, position, window_k)
    known = self._known.get(key)
    if known is None or known[0].is_deleted() or known[1].is_deleted() or known[-1].is_deleted():
      get = self._constants.get
      known = (get("mini_step", position, state.mini_step),)
      known += (get("window_k", window_k, state.window_k),)
      if not emit:
        known += (get("updated", False, state.updated),)
      self._known[key] = known
    return known

  def _hollow(self, inner_state: Any) -> Any:
    """`_host.hollow` of the inner state, made once per tree structure (and not looked up again for
    the inner state of the last call: the accumulating calls of a window pass the same one)."""
    if inner_state is self._hollow_of[0]:
      return self._hollow_of[1]
    tree = jax.tree.structure(inner_state)
    hollow = self._hollows.get(tree)
    if hollow is None:
      hollow = self._hollows[tree] = _host.hollow(inner_state)
    self._hollow_of = (inner_state, hollow)
    return hollow

  def _first(self, program: bool, operands: tuple, whole: tuple) -> Any:
    """A call's first program (`_jit`'s key), compiled for these micro-batch types: tried
    first as compiled for the last call's (the compiled program checks its inputs before it
    runs or donates anything, so the per-call cost has no signature to compute); for others,
    looked up by `_host.signature` (both programs compiled on the first call with new types,
    `_compile_both`). `whole`: the call's ``(params, state, grad_buffer, args, weight)``, the
    state whole. Refusals are `_run`'s."""
    params, state, grad_buffer, args, weight = whole
    if self._key is not None:
      try:
        return self._direct(program)(*operands)  # (`_compiled[_key]`: no key to hash)
      except (TypeError, ValueError, RuntimeError) as e:
        # A deleted array (RuntimeError with several devices), other micro-batch types
        # (looked up below), or a refusal that `_run` explains. Any other RuntimeError came
        # from running the program: raised, never run again.
        _host.check_live(params, state)
        if isinstance(e, RuntimeError):
          raise
    key = _host.signature(args, weight)
    if key not in self._compiled:
      self._compiled[key] = self._compile_both(params, state, grad_buffer, args, weight)
    self._key, self._pair, self._calls = key, self._compiled[key], {}
    return self._run(key, program, operands, (params, state))

  def _run(self, key: tuple, program: bool, operands: tuple, live: tuple) -> Any:
    """One program (`_jit`'s key), compiled for `key`; inputs unlike those it was compiled
    for (other parameter or state types, or placements: `_host.unlike` compares them) run through
    `jax.jit`, this call only: the compiled pair stays for the inputs it was made for, so
    nothing is recompiled unless the inputs really changed. Any other refusal is raised.
    `live`: the call's ``(params, state)``, whose deleted arrays are named first."""
    compiled = self._compiled[key][program]
    try:
      return compiled(*operands)
    except (TypeError, ValueError, RuntimeError) as e:
      # The compiled programs check their inputs before running (nothing donated yet).
      _host.check_live(*live)
      if isinstance(e, RuntimeError):
        raise
      if not _host.unlike(compiled, operands):
        raise type(e)(
          "TrainStep: the compiled program refused inputs of the types and placements it was "
          f"compiled for: {e}"
        ) from e
    return self._programs[program](*operands)

  def _compile_both(self, params, state, grad_buffer, args, weight) -> dict[bool, Any]:
    """Both programs for these arguments: traced one after the other, compiled concurrently
    (XLA compiles without holding Python's lock). That helps where cores are free: XLA:CPU
    already spreads one compile over two cores. What makes the pair cheap is the closing
    program, which compiles no backward pass (or, for a small model, `_choose_emitting`)."""
    if self._cfg.unaccumulated:
      lowered = {True: self._lower(True, params, state, grad_buffer, args, weight)}
    else:
      accumulating = self._lower(False, params, state, grad_buffer, args, weight)
      lean = self._lean
      self._choose_emitting(accumulating, params, grad_buffer)
      if self._lean and not lean:  # chosen now: the programs in the lean convention (`_lean`)
        accumulating = self._lower(False, params, state, grad_buffer, args, weight)
      emitting = self._lower(True, params, state, grad_buffer, args, weight)
      lowered = {False: accumulating, True: emitting}
    with futures.ThreadPoolExecutor(len(lowered)) as pool:
      compiling = {e: pool.submit(low.compile) for e, low in lowered.items()}
      return {e: job.result() for e, job in compiling.items()}

  def _take_lean(self, lean: bool, *, sums: bool) -> None:
    """Whether the programs take the lean calling convention (`_lean`; `sums`: whether its
    emitting program writes the sums), and with it one pooled finite check (`Config.pool_check`:
    its programs run on one device, nothing sharded)."""
    self._lean = lean
    self._layout = _lean.Layout(sums, self._cfg.rounding == "stochastic")
    self._cfg = self._cfg._replace(pool_check=lean)

  def _choose_emitting(self, accumulating: Any, params: Any, grad_buffer: Any) -> None:
    """Decides, once, whether the emitting micro-step runs one program (grad → add → close)
    rather than the accumulating program and the closing one: for a small model, where
    compiling the backward pass twice is cheap (`FUSED_EMIT_MAX_OPS`; `accumulating`: the
    lowered accumulating program). Then its programs take the lean calling convention
    (`_lean`), whose emitting program writes the sums only with a gradient buffer."""
    if self._chosen:
      return
    self._chosen = True
    arrays = jax.tree.leaves(_batch.none_for_static(params))
    nbytes = sum(np.size(x) * jnp.result_type(x).itemsize for x in arrays)
    if nbytes < GRAD_BUFFER_BYTES and _host.ops(accumulating) <= FUSED_EMIT_MAX_OPS:
      self._fused_emit = True
      self._take_lean(self._lean_ok, sums=grad_buffer is not _NO_BUFFER)
      self._programs = self._jit()  # (no compiled program yet: the first lowering decides)

  def compile(self, params, state, *args, weight=None) -> TrainStep:
    """Compiles both programs now, concurrently, for arguments like these (else the first call
    does it); returns this `TrainStep`.

    Args:
      params, state, args, weight: as for a call (only their types and placements matter).

    Returns:
      ``self``, whose calls with arguments of these types run the programs compiled here.

    Raises:
      TypeError, ValueError: as a first call would (bad arguments, a state from elsewhere).

    >>> import jax.numpy as jnp, optax, optax_accum
    >>> step = optax_accum.TrainStep(lambda p, x: jnp.sum(p * x), optax.sgd(0.1), every_k=2)
    >>> params = jnp.ones(3)
    >>> state = step.init(params)
    >>> step = step.compile(params, state, jnp.ones(3))
    >>> params, state, loss = step(params, state, jnp.ones(3))
    >>> float(loss)
    3.0
    """
    if self._fsdp is not None:  # FSDP: the window's programs (`_fsdp_train_step`)
      self._fsdp.compile(params, state, args, weight)
      return self
    self._pin(params)
    params = _batch.hide_static(params)
    buffer = self._grad_buffer
    if buffer is None:
      buffer = self._buffer_types(params, args)
    key = _host.signature(args, weight)
    self._compiled[key] = self._compile_both(params, state, buffer, args, weight)
    self._key, self._pair, self._calls = key, self._compiled[key], {}
    return self

  def lower(self, params, state, *args, weight=None, emit: bool = False):
    """Lowers one of the two programs (for inspection: ``.compile().as_text()``, memory):
    ``emit=False`` the accumulating program; ``emit=True`` the closing program, which takes
    ``(params, state)`` only: the emitting step runs the accumulating program, then this one
    (with every_k = 1 either gives the one program, which adds and closes each window). With
    `axis_name`, or for a small model (`FUSED_EMIT_MAX_OPS`), ``emit=True`` gives the emitting
    program, which takes a micro-batch like the accumulating one: it computes the last
    gradient, adds it and closes the window (with `axis_name`, all-reducing it leaf by leaf);
    for a small model both programs then take the state's arrays in two parts, those they only
    read and those they write (`_lean`). With `keep_unsharded`, the accumulating program as a
    window's calls run it (on the held whole copy, except with "nothing"), or the closing
    program. Lowering decides, like a first call, which programs this object runs."""
    if self._fsdp is not None:  # FSDP: the accumulating or the closing program
      return self._fsdp.lower(emit, params, state, args, weight)
    self._pin(params)
    params = _batch.hide_static(params)
    grad_buffer = self._grad_buffer
    if grad_buffer is None:
      grad_buffer = self._buffer_types(params, args)
    if not self._chosen:  # (the choice decides both programs' calling convention, `_lean`)
      accumulating = self._lower(False, params, state, grad_buffer, args, weight)
      self._choose_emitting(accumulating, params, grad_buffer)
    return self._lower(emit, params, state, grad_buffer, args, weight)

  def _lower(self, emit: bool, params, state, grad_buffer, args, weight):
    if self._lean:  # `_lean.operands`
      reads, part = _lean.operands(emit, state, self._layout)
      return self._programs[emit].lower(params, reads, part, grad_buffer, args, weight)
    if self._cfg.unaccumulated or (emit and self._fused_emit):  # grad → add → close
      return self._programs[True].lower(params, state, grad_buffer, args, weight)
    if emit:
      return self._programs[True].lower(params, state)  # the closing program
    hollow = state._replace(inner_state=_host.hollow(state.inner_state))
    return self._programs[False].lower(params, hollow, grad_buffer, args, weight)
