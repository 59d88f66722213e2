"""The audit's PRNG keys: every draw the same, and every key that drew recorded.

The audit gives the user's code real keys (it may split them, fold into them, index them), of
two PRNG implementations of its own (`jax.extend.random.define_prng_impl`). Both split and fold
in as threefry does, so distinct keys stay distinct; neither draws random bits:

* `CONSTANT`: every draw returns zero bits, whatever the key — a uniform is 0, a Bernoulli
  draw with p > 0 is True (dropout keeps every unit and rescales it), a normal is the same
  constant everywhere. The loss is then a deterministic function of its batch that does not
  depend on how the keys were derived, so the large batch, each micro-batch and the loop under
  test compute the same numbers and the numeric checks stay exact with dropout in the model;
* `RECORDING`: the same zero bits, and each draw reports the key it was made with to the host
  (`jax.debug.callback`, once per draw at run time: inside a `lax.scan` once per iteration,
  under `vmap` once per key), so the audit can count which keys the micro-batches drew with,
  however the loop derived them.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _threefry(data: jax.Array) -> jax.Array:
  return jax.random.wrap_key_data(data, impl="threefry2x32")


def _seed(seed: jax.Array) -> jax.Array:
  return jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))


def _split(data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return jax.random.key_data(jax.random.split(_threefry(data), shape))


def _fold_in(data: jax.Array, value: jax.Array) -> jax.Array:
  return jax.random.key_data(jax.random.fold_in(_threefry(data), value))


def _zero_bits(data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
  del data
  return jnp.zeros(shape, _UINT[bit_width])


class _Recorder:
  """The keys drawn with while `recording()` is open (one tuple of key words per draw)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.draws: Draws | None = None
    self.axis: Any = None  # the data axis, whose index each draw inside a map over it records

  def add(self, data: np.ndarray, device: np.ndarray) -> None:
    with self.lock:
      if self.draws is not None:
        self.draws.append(tuple(int(w) for w in np.asarray(data).reshape(-1)))
        self.draws.devices.append(int(device))


class Draws(list):
  """The keys drawn with (a tuple of key words per draw), and in `devices` the index along the
  data axis of the device that drew each (0 for a draw outside a map over that axis: under
  plain `jax.jit` a draw is one, for the whole global array)."""

  def __init__(self):
    super().__init__()
    self.devices: list[int] = []


RECORDER = _Recorder()


def _device_index() -> jax.Array:
  """The drawing device's index along the data axis inside a map over it (`shard_map`), else 0."""
  if RECORDER.axis is None:
    return jnp.int32(0)
  try:
    return jax.lax.axis_index(RECORDER.axis)
  except NameError:  # not inside a map over the axis
    return jnp.int32(0)


def _recorded_bits(data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
  jax.debug.callback(RECORDER.add, data, _device_index())
  return _zero_bits(data, bit_width, shape)


CONSTANT = define_prng_impl(
  key_shape=(2,), seed=_seed, split=_split, random_bits=_zero_bits, fold_in=_fold_in,
  name="optax_accum.audit.constant",
)  # fmt: skip
RECORDING = define_prng_impl(
  key_shape=(2,), seed=_seed, split=_split, random_bits=_recorded_bits, fold_in=_fold_in,
  name="optax_accum.audit.recording",
)  # fmt: skip


def is_key(x: Any) -> bool:
  """Whether `x` is one PRNG key: a typed key array of shape (), or a raw ``uint32[2]``."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return np.shape(x) == ()
  return np.shape(x) == (2,) and dtype == np.uint32


def audit_key(key: Any, impl: Any) -> jax.Array:
  """The audit's key of `impl` standing for the user's `key`: the same key words for a threefry
  key (typed or raw), else 64 bits drawn from it, so that distinct keys stay distinct."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    if jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0, impl="threefry2x32")):
      data = jax.random.key_data(key)
    else:
      data = jax.random.bits(key, (2,), jnp.uint32)
  else:
    data = jnp.asarray(key, jnp.uint32)
  return jax.random.wrap_key_data(data, impl=impl)


def constant_key() -> jax.Array:
  """A key whose every draw is zero bits (`CONSTANT`)."""
  return jax.random.key(0, impl=CONSTANT)


class recording:  # noqa: N801  # used as a context manager, like `jax.enable_x64`
  """``with recording(axis) as draws:`` collects in `draws` (`Draws`) the key of every draw made
  with a `RECORDING` key while it is open (each a tuple of key words), after the programs
  finished, and the index along the data axis `axis` (None: none) of the device that drew."""

  def __init__(self, axis: Any = None):
    self.axis = axis

  def __enter__(self) -> Draws:
    with RECORDER.lock:
      if RECORDER.draws is not None:
        raise RuntimeError("audit: recordings of keys do not nest.")
      RECORDER.draws = self.draws = Draws()
      RECORDER.axis = self.axis
    return self.draws

  def __exit__(self, *exc: Any) -> None:
    jax.effects_barrier()
    with RECORDER.lock:
      RECORDER.draws, RECORDER.axis = None, None
