"""FSDP with accumulation: what stays unsharded for a window, traded against communication.

Where the parameters are sharded over a data-parallel axis (FSDP, ZeRO-3), a micro-batch needs
them whole for its forward and backward pass and gives a whole-size gradient on each device,
which the devices must sum. Across a window of ``k`` micro-batches there are three sensible
points (``keep_unsharded``), each holding more memory for less communication:

* ``"nothing"``: gather the parameters for every micro-batch and reduce-scatter its gradient
  into an accumulator sharded like the parameters: ``k`` all-gathers + ``k`` reduce-scatters
  per update (2k all-gathers where the backward pass gathers again, as under rematerialisation:
  MaxText's and PyTorch FSDP2's default), no whole-size buffer kept between micro-batches;
* ``"params"``: gather the parameters once per window and keep them, reduce-scatter each
  micro-batch's gradient into the sharded accumulator: 1 all-gather + ``k`` reduce-scatters,
  one whole parameter copy held for the window (PyTorch FSDP2's
  ``set_reshard_after_backward(False)``; no JAX library offered it);
* ``"params_and_grads"``: gathered parameters and a whole-size accumulator on each device for
  the window, one reduce-scatter when it closes: 1 all-gather + 1 reduce-scatter, two whole
  copies held (PyTorch FSDP2's ``set_requires_gradient_sync(False)`` with unsharded
  parameters; MaxText's ZeRO-1 ``ZeroOneTransformer`` gathers once and all-reduces once).

The data-parallel axes are bound by the front end (`_gspmd`), and a parameter is *FSDP* where
its placement names one of them: it enters the bound function as its local shard (not gathered
on entry, as other arguments are), and this module gathers it (`Layout.gather`: a tiled
``all_gather`` over those axes, along those dimensions) and reduce-scatters its gradient
(`Layout.scatter`: a tiled ``psum_scatter``), where the chosen point says. Axes that shard the
parameters but not the batch (a tensor-parallel ``"model"`` axis) stay automatic. The gradient
of a parameter is the output of `fun` whose subtree has that argument's structure and shapes
(``jax.value_and_grad`` returns it so), found once per trace (`match_outputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum.batch_size import _noise

KEEP_UNSHARDED: tuple[str, ...] = ("nothing", "params", "params_and_grads")

NOT_VISIBLE = (
  "{caller}: keep_unsharded={keep!r} needs to see which parameters are sharded over "
  "axis_name={axis!r}, but argument {where} is traced under jax.jit on a mesh whose axes "
  "{axes} are Auto: its placement is not part of its type there (XLA decides it later). Say "
  "it: pass the shardings you give jax.jit as in_shardings= here too, e.g.\n\n"
  "    shardings = ({{'w': NamedSharding(mesh, P('data'))}}, NamedSharding(mesh, P('data')))\n"
  "    step = jax.jit(microbatch(..., keep_unsharded={keep!r}, in_shardings=shardings),\n"
  "                   in_shardings=shardings)\n\n"
  "or use Explicit axes for the mesh (`jax.make_mesh(..., axis_types=(AxisType.Explicit,) * n)`), "
  "or call the function on placed arrays outside jax.jit."
)

NO_FSDP = (
  "{caller}: keep_unsharded={keep!r} chooses what stays unsharded of parameters sharded over "
  "the data-parallel axes axis_name={axis!r}, but no argument is sharded over them{found}. If "
  "another mesh axis is an FSDP axis (the batch is split over it too), name it in axis_name, "
  "e.g. axis_name={hint!r}; if it is a tensor-parallel axis there is nothing to gather: drop "
  "keep_unsharded."
)

NO_GRADIENT = (
  "{caller}: keep_unsharded={keep!r}: none of fun's outputs is the gradient of the sharded "
  "argument {where} (an output subtree with its structure and shapes, as jax.value_and_grad "
  "and jax.grad return it), so there is nothing to reduce-scatter. Return the gradient with "
  "respect to the sharded parameters, or drop keep_unsharded."
)

AMBIGUOUS = (
  "{caller}: keep_unsharded={keep!r}: fun's outputs {paths} all have the structure and shapes "
  "of the sharded argument {where}, so which one is its gradient is ambiguous. Return the "
  "gradient once (e.g. jax.value_and_grad's (value, grads)) and compute the other output "
  "outside the micro-batched function."
)


def check_keep(value: Any, caller: str) -> str | None:
  """`keep_unsharded`: None (as before: no FSDP treatment) or one of `KEEP_UNSHARDED`."""
  if value is None or (isinstance(value, str) and value in KEEP_UNSHARDED):
    return value
  raise ValueError(
    f"{caller}: keep_unsharded must be None or one of {KEEP_UNSHARDED}, got {value!r}: what "
    "stays unsharded for a window of micro-batches (more memory held, less communication)."
  )


KEEP_IN_MAP = (
  "microbatch: keep_unsharded is the choice of what microbatch gathers and reduce-scatters where "
  "it binds axis_name={axis!r} itself (under plain jax.jit); inside a map that binds it "
  "(jax.shard_map, data_parallel), the parameters arrive as the map splits them and your "
  "function gathers them. Call microbatch under plain jax.jit with the mesh in effect "
  "(jax.set_mesh), without data_parallel around it, or drop keep_unsharded."
)

DATA_PARALLEL = (
  "data_parallel: keep_unsharded={keep!r} is not an option of data_parallel: it binds the axis "
  "around a function that runs its own micro-batches, so it holds nothing across them. Its "
  "sync= gives two of the points already: sync='microbatch' (GSPMD gathers the parameters and "
  "reduce-scatters each micro-batch's gradient: 'nothing') and sync='update' (gathered once per "
  "call, a whole accumulator all-reduced once). For the choice of all three, with "
  "reduce-scatters, use the front end that owns the window: "
  "jax.jit(microbatch(..., axis_name=..., keep_unsharded={keep!r})) under plain jax.jit (no "
  "data_parallel around it), or TrainStep(..., axis_name=..., keep_unsharded={keep!r})."
)


class Request(NamedTuple):
  """`microbatch`'s FSDP options, checked: the point, and the placements it was told
  (``in_shardings``: one entry per positional argument, as `jax.jit` takes them) or None."""

  keep: str
  in_shardings: tuple | None


def check_options(keep: Any, axis_name: Any, in_shardings: Any) -> Request | None:
  """`keep_unsharded` (FSDP) and `in_shardings`: checked, with what they need (an axis)."""
  keep = check_keep(keep, "microbatch")
  if keep is None:
    if in_shardings is not None:
      raise ValueError(
        "microbatch: in_shardings tells keep_unsharded where the parameters are placed; "
        f"without keep_unsharded it is not read, got in_shardings={in_shardings!r}. Drop it, "
        "or choose a keep_unsharded point."
      )
    return None
  if axis_name is None:
    raise ValueError(
      f"microbatch: keep_unsharded={keep!r} needs axis_name: the data-parallel mesh axes the "
      "batch is split over, some of which shard the parameters (FSDP), e.g. "
      "axis_name='data' for parameters sharded over 'data', or ('data', 'fsdp')."
    )
  if in_shardings is not None:
    if not isinstance(in_shardings, tuple | list):
      raise TypeError(
        "microbatch: in_shardings must be a tuple with one entry per positional argument (as "
        f"jax.jit's in_shardings), got {type(in_shardings).__name__}: {in_shardings!r}."
      )
    for path, s in jax.tree_util.tree_leaves_with_path(in_shardings, is_leaf=_is_spec):
      if not _is_spec(s):
        raise TypeError(
          f"microbatch: in_shardings{jax.tree_util.keystr(path)} is {s!r}; each entry must "
          "be None, a PartitionSpec, a NamedSharding or a pytree prefix of them."
        )
    in_shardings = tuple(in_shardings)
  return Request(keep, in_shardings)


def check_unmapped(axis: Any, request: Request | None) -> None:
  """Raises `KEEP_IN_MAP` for `keep_unsharded` where an enclosing map binds the axis."""
  if request is not None and axis.mode == "mapped":
    raise ValueError(KEEP_IN_MAP.format(axis=axis.name))


def _is_spec(x: Any) -> bool:
  return isinstance(x, P | NamedSharding)


def _given_specs(request: Request, args: tuple, caller: str) -> dict[tuple[Any, str], P]:
  """The specs `in_shardings` gives, by ``(argument index, leaf path)``."""
  given = request.in_shardings
  if given is None:
    return {}
  if len(given) != len(args):
    raise ValueError(
      f"{caller}: in_shardings has {len(given)} entries but the function was called with "
      f"{len(args)} positional arguments: give one entry per argument (None where the "
      "placement can be read, or for the batch), as jax.jit's in_shardings."
    )
  out: dict[tuple[Any, str], P] = {}
  for j, (entry, arg) in enumerate(zip(given, args, strict=True)):

    def one(path, s, sub, j=j):
      for p, _ in jax.tree_util.tree_leaves_with_path(sub):
        out[(j, jax.tree_util.keystr((*path, *p)))] = s.spec if isinstance(s, NamedSharding) else s

    try:
      jax.tree_util.tree_map_with_path(one, entry, arg, is_leaf=lambda x: x is None or _is_spec(x))
    except ValueError as e:
      raise ValueError(
        f"{caller}: in_shardings[{j}] is not a pytree prefix of argument {j}: {e}"
      ) from None
  return out


# ----------------------------------------------------------------------------------------------
# One parameter's layout over the bound axes.


class Layout(NamedTuple):
  """Where one parameter is sharded over the bound (data-parallel) axes."""

  dims: tuple[tuple[int, tuple[str, ...]], ...]  # (dimension, its bound axes, major first)
  ndim: int
  other: P = P()  # its spec over the other mesh axes (tensor-parallel "model"), if any

  @property
  def axes(self) -> tuple[str, ...]:
    return tuple(a for _, names in self.dims for a in names)

  @property
  def spec(self) -> P:
    """The spec of the local shard over the bound axes (shard_map's in and out spec)."""
    entries: list[Any] = [None] * self.ndim
    for d, names in self.dims:
      entries[d] = names[0] if len(names) == 1 else names
    return P(*entries)

  def gather(self, x: jax.Array) -> jax.Array:
    """The whole parameter from its local shard: one tiled all-gather per sharded dimension."""
    for d, names in self.dims:
      x = lax.all_gather(x, names if len(names) > 1 else names[0], axis=d, tiled=True)
    return x

  def scatter(self, x: jax.Array) -> jax.Array:
    """This device's shard of the sum over the devices: one tiled reduce-scatter each."""

    def scatter(y):
      for d, names in self.dims:
        y = lax.psum_scatter(y, names if len(names) > 1 else names[0], scatter_dimension=d,
                             tiled=True)  # fmt: skip
      return y

    # On mesh axes other than the bound ones (a tensor-parallel "model"), run it manual over
    # those axes too, on the local blocks (no data moves over them): on Explicit axes the
    # value's type carries their sharding, which JAX (0.10) cannot lower a reduce-scatter of;
    # on Auto axes GSPMD would otherwise scatter the whole gradient, gathered over "model"
    # (twice the bytes, measured on data × model).
    spec = _explicit_spec(x)
    if spec is None and any(_names(e) for e in self.other):
      spec = self.other
    if spec is None:
      return scatter(x)
    axes = {a for e in spec for a in _names(e)}
    return jax.shard_map(scatter, in_specs=spec, out_specs=spec, axis_names=axes)(x)

  def shard_shape(self, shape: tuple[int, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    out = list(shape)
    for d, names in self.dims:
      out[d] //= int(np.prod([sizes[a] for a in names]))
    return tuple(out)


def _explicit_spec(x: jax.Array) -> P | None:
  """The spec of `x`'s type where it names mesh axes (Explicit ones), else None."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  return spec if spec is not None and any(_names(e) for e in spec) else None


def _names(entry: Any) -> tuple[str, ...]:
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def placed_spec(x: Any, explicit: bool) -> P | None:
  """`x`'s partition spec where it can be read: a placed array's (or a struct's) sharding, the
  type of a traced array where the bound axes are Explicit; None where its placement is not
  visible (traced, Auto axes); ``P()`` for host values."""
  if isinstance(x, jax.core.Tracer):
    return getattr(jax.typeof(x).sharding, "spec", P()) if explicit else None
  sharding = getattr(x, "sharding", None)
  return sharding.spec if isinstance(sharding, NamedSharding) else P()


def layout_of(spec: P, ndim: int, axes: tuple[str, ...], where: str, caller: str) -> Layout | None:
  """The `Layout` of a parameter placed with `spec` over the bound `axes`; None when none of
  them shards it. A dimension split over a bound axis and another one raises."""
  dims, other = [], []
  for d, entry in enumerate(tuple(spec) + (None,) * (ndim - len(spec))):
    names = _names(entry)
    bound = tuple(a for a in names if a in axes)
    other.append(None if bound or not names else entry)
    if not bound:
      continue
    if len(bound) != len(names):
      raise ValueError(
        f"{caller}: {where} is sharded along dimension {d} over {entry!r}: both data-parallel "
        f"axes {bound} and other axes. keep_unsharded gathers and reduce-scatters whole "
        "dimensions over the data-parallel axes: split each dimension over those or over the "
        "others, not both (e.g. P('data', 'model') for a matrix, not P(('data', 'model'), None))."
      )
    dims.append((d, bound))
  return Layout(tuple(dims), ndim, P(*other)) if dims else None


# ----------------------------------------------------------------------------------------------
# Which argument leaves are FSDP parameters; their gradients among fun's outputs.


class Fsdp(NamedTuple):
  """The FSDP plan of one call: the chosen point, the bound axes and their sizes, the layout of
  each sharded argument leaf (by ``(argument key, leaf path)``) and of each output leaf that is
  a gradient of one (by leaf index in fun's output, filled by `match_outputs`)."""

  keep: str
  axes: tuple[str, ...]
  sizes: dict[str, int]
  params: dict[tuple[Any, str], Layout]
  whole: dict[Any, Any]  # each argument holding FSDP leaves, as structs of its whole shapes
  outputs: dict[int, Layout]
  caller: str

  @property
  def gathers_in_loop(self) -> bool:
    return self.keep == "nothing"

  @property
  def scatters_in_loop(self) -> bool:
    return self.keep != "params_and_grads"

  def rest(self, layout: Layout) -> tuple[str, ...]:
    """The bound axes a gradient's shard still varies over after its scatter: a plain sum."""
    return tuple(a for a in self.axes if a not in layout.axes)

  def map_args(self, f: Callable[[jax.Array, Layout], Any], args: tuple, kwargs: dict) -> Any:
    """`f(leaf, layout)` on every FSDP leaf of ``(args, kwargs)``; other leaves as they are."""

    def one(key, tree):
      def leaf(path, x):
        layout = self.params.get((key, jax.tree_util.keystr(path)))
        return x if layout is None else f(x, layout)

      return jax.tree_util.tree_map_with_path(leaf, tree)

    return (
      tuple(one(j, a) for j, a in enumerate(args)),
      {name: one(name, a) for name, a in kwargs.items()},
    )

  def gather(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return self.map_args(lambda x, layout: layout.gather(x), args, kwargs)

  def in_microbatch(self, args: list, kwargs: dict, i: Any) -> tuple[list, dict]:
    """The arguments micro-batch `i` sees: with ``"nothing"`` the FSDP leaves gathered here,
    for this micro-batch alone. The barrier ties the gather to the loop counter, so XLA cannot
    hoist it out of the loop (it is loop-invariant) and keep the whole parameters alive across
    micro-batches, which is the other point."""
    if not self.gathers_in_loop:
      return args, kwargs

    def gather(x, layout):
      x, _ = lax.optimization_barrier((x, i))
      return layout.gather(x)

    a, kw = self.map_args(gather, tuple(args), kwargs)
    return list(a), kw

  def out_specs(self, n_leaves: int) -> list[P | None]:
    """Each output leaf's spec over the bound axes: a gradient's shard, else None."""
    return [self.outputs[n].spec if n in self.outputs else None for n in range(n_leaves)]


def plan(request: Request, axis: Any, args: tuple, kwargs: dict, batch: dict, caller: str) -> Fsdp:
  """The FSDP leaves of a call's non-batch arguments (`batch`: the batch arguments' keys) over
  the axis `axis` (a `_gspmd.Axis` to bind): as ``request.in_shardings`` says, else read from
  their placements.

  Raises:
    ValueError: `NOT_VISIBLE` for a traced argument on Auto axes that `in_shardings` does not
      place; `NO_FSDP` when no argument is sharded over the axes.
  """
  keep, given = request.keep, _given_specs(request, args, caller)
  axes, mesh = axis.names, axis.mesh
  sizes = {a: int(mesh.shape[a]) for a in axes}
  explicit = all(t == AxisType.Explicit for n, t in zip(mesh.axis_names, mesh.axis_types,
                                                         strict=True) if n in axes)  # fmt: skip
  params: dict[tuple[Any, str], Layout] = {}
  others: set[str] = set()
  shapes: dict[Any, Any] = {}
  items = [*enumerate(args), *kwargs.items()]
  for key, tree in items:
    if key in batch:
      continue
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
      if not hasattr(x, "shape") or not np.ndim(x):
        continue
      spec = given.get((key, jax.tree_util.keystr(path)))
      spec = placed_spec(x, explicit) if spec is None else spec
      where = f"{key}{jax.tree_util.keystr(path)}"
      if spec is None:
        raise ValueError(
          NOT_VISIBLE.format(caller=caller, keep=keep, axis=axis.name, where=where, axes=axes)
        )
      layout = layout_of(spec, np.ndim(x), axes, f"argument {where}", caller)
      others |= {a for e in spec for a in _names(e) if a not in axes}
      if layout is not None:
        params[(key, jax.tree_util.keystr(path))] = layout
        shapes.setdefault(key, tree)
  if not params:
    found = f" (they are sharded over {tuple(sorted(others))} only)" if others else ""
    hint = tuple(axes) + tuple(sorted(others))[:1]
    raise ValueError(
      NO_FSDP.format(caller=caller, keep=keep, axis=axis.name, found=found, hint=hint)
    )
  whole = {key: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), t)
           for key, t in shapes.items()}  # fmt: skip
  return Fsdp(keep, tuple(axes), sizes, params, whole, {}, caller)


def match_outputs(fsdp: Fsdp, plan: Any, record: Callable | None = None) -> Fsdp:
  """`fsdp` with the layout of each output leaf that is the gradient of an FSDP leaf: the
  output subtree with the structure and the (whole) shapes of the argument holding it (`plan`:
  the call's `_outputs.Plan`); handed to `record` too (the binding's output specs read it).

  Raises:
    ValueError: `AMBIGUOUS` when two output subtrees match one argument; `NO_GRADIENT` when
      none matches any FSDP argument.
  """
  out_leaves = jax.tree_util.tree_leaves_with_path(plan.tree.unflatten(plan.like))
  out_paths = [tuple(p) for p, _ in out_leaves]
  index = {p: n for n, p in enumerate(out_paths)}
  outputs: dict[int, Layout] = {}
  for key in sorted({k for k, _ in fsdp.params}, key=str):
    leaves = [(tuple(p), x) for p, x in jax.tree_util.tree_leaves_with_path(fsdp.whole[key])]
    if not leaves:
      continue
    found = _subtrees(leaves, out_leaves, index)
    if len(found) > 1:
      paths = [jax.tree_util.keystr(q) or "(the whole output)" for q in found]
      raise ValueError(AMBIGUOUS.format(caller=fsdp.caller, keep=fsdp.keep, paths=paths,
                                        where=key))  # fmt: skip
    if not found:
      continue
    prefix = found[0]
    for p, _ in leaves:
      layout = fsdp.params.get((key, jax.tree_util.keystr(p)))
      if layout is not None:
        outputs[index[prefix + p]] = layout
  if not outputs:
    where = ", ".join(str(k) for k in sorted({k for k, _ in fsdp.params}, key=str))
    raise ValueError(NO_GRADIENT.format(caller=fsdp.caller, keep=fsdp.keep, where=where))
  fsdp = fsdp._replace(outputs=outputs)
  if record is not None:
    record(fsdp)
  return fsdp


def _subtrees(leaves: list, out_leaves: list, index: dict) -> list[tuple]:
  """The output path prefixes under which every leaf of an argument (`leaves`: its paths and
  values) appears with its whole shape, and nothing else."""
  first, rest = leaves[0], leaves[1:]
  found = []
  for path, t in out_leaves:
    path = tuple(path)
    if len(path) < len(first[0]) or path[len(path) - len(first[0]) :] != first[0]:
      continue
    prefix = path[: len(path) - len(first[0])]
    if np.shape(t) != tuple(first[1].shape):
      continue
    if all(
      prefix + p in index and np.shape(out_leaves[index[prefix + p]][1]) == tuple(x.shape)
      for p, x in rest
    ):
      under = sum(1 for q in index if q[: len(prefix)] == prefix)
      if under == len(leaves):
        found.append(prefix)
  return found


# ----------------------------------------------------------------------------------------------
# The loop's side (`_scan`): the accumulator of a gradient, sharded or whole, and its reduction.


def _positions(fsdp: Fsdp | None, where: tuple[int, ...]) -> list[Layout | None]:
  """The layout of each accumulated output leaf (`where`: their indices in fun's output)."""
  return [None if fsdp is None else fsdp.outputs.get(n) for n in where]


def shard_carry(fsdp: Fsdp | None, zeros: list, where: tuple[int, ...]) -> list:
  """The initial sums: a gradient that is reduce-scattered in the loop accumulates as this
  device's shard (its bound dimensions divided), every other leaf as it was made."""
  if fsdp is None or not fsdp.scatters_in_loop:
    return zeros
  out = []
  for z, layout in zip(zeros, _positions(fsdp, where), strict=True):
    if layout is not None:
      z = lax.slice(z, (0,) * z.ndim, layout.shard_shape(z.shape, fsdp.sizes))
    out.append(z)
  return out


def add_inputs(fsdp: Fsdp | None, sums: list, values: list, where: tuple[int, ...]) -> list:
  """What `_core.add` adds each micro-batch into: zeros of the whole gradient where it is
  reduce-scattered in the loop (`add_outputs` then scatters the weighted, checked micro-batch
  and adds its shard), the sums themselves elsewhere."""
  if fsdp is None or not fsdp.scatters_in_loop:
    return sums
  layouts = _positions(fsdp, where)
  return [
    s if layout is None else jnp.zeros_like(v, dtype=s.dtype)
    for s, v, layout in zip(sums, values, layouts, strict=True)
  ]


def add_outputs(fsdp: Fsdp | None, old: list, added: list, where: tuple[int, ...]) -> list:
  """The new sums: ``old + scatter(w·g)`` for a gradient reduce-scattered in the loop. The
  weight and the finite check were applied per device before the scatter, so each device's
  piece of the micro-batch counts (or is dropped) as without keep_unsharded."""
  if fsdp is None or not fsdp.scatters_in_loop:
    return added
  layouts = _positions(fsdp, where)
  return [
    a if layout is None else o + layout.scatter(a)
    for o, a, layout in zip(old, added, layouts, strict=True)
  ]


def pull(fsdp: Fsdp | None, sums: list, where: tuple[int, ...]) -> tuple[list, dict[int, Any]]:
  """Splits the loop's sums into those the usual all-reduce takes and the gradients of FSDP
  parameters, reduced here once, after the loop: a shard already reduced over its axes is
  summed over the other bound axes only; a whole gradient (``"params_and_grads"``) is
  reduce-scattered, then summed over the others. Returns ``(rest, {position: reduced})``."""
  if fsdp is None:
    return sums, {}
  rest, done = [], {}
  for i, (s, layout) in enumerate(zip(sums, _positions(fsdp, where), strict=True)):
    if layout is None:
      rest.append(s)
      continue
    if not fsdp.scatters_in_loop:
      s = layout.scatter(s)
    others = fsdp.rest(layout)
    done[i] = lax.psum(s, others) if others else s
  return rest, done


def shards_sq(fsdp: Fsdp | None, done: dict[int, Any], where: tuple[int, ...], picked) -> Any:
  """The noise scale's ``|Σ wᵢgᵢ|²`` part of the FSDP gradients among `picked` (the gradient's
  output indices), as one device's term of the one all-reduce after the loop (`_scan._finish`):
  its shards' squared norms (`done`: `pull`'s reduced shards, by position in `where`), divided
  by the devices of the bound axes that hold the same shard (the all-reduce counts it once per
  device). A scalar; None without FSDP gradients among them (no parameter-sized memory: each
  shard is read once)."""
  if fsdp is None or not picked:
    return None
  parts = []
  for i, n in enumerate(where):
    if n in picked and i in done and n in fsdp.outputs:
      copies = int(np.prod([fsdp.sizes[a] for a in fsdp.rest(fsdp.outputs[n])]))
      parts.append(_noise.sq_norm(done[i]) / copies)
  return sum(parts) if parts else None


def put_back(rest: list, done: dict[int, Any]) -> list:
  """The inverse of `pull`: the reduced leaves back in their positions."""
  others = iter(rest)
  return [done[i] if i in done else next(others) for i in range(len(rest) + len(done))]


# ----------------------------------------------------------------------------------------------
# The binding (`_gspmd`): sharded parameters in as shards, their gradients out as shards.


def binding(binding, fsdp: Fsdp, args, kwargs, plans: list, info: bool):
  """The binding of an FSDP call: its sharded parameters enter as their local shards (the other
  non-batch arguments whole, as always), and their gradients leave as shards."""
  specs = {}
  fsdp.map_args(lambda x, layout: specs.setdefault(id(x), layout.spec), args, kwargs)

  def in_spec(x, entry):
    del entry
    return specs.get(id(x)) if not isinstance(x, jax.ShapeDtypeStruct) else None

  def out_specs(types):
    # `_run` recorded the plan, then the FSDP plan with its gradients (`_fsdp.match_outputs`).
    plan, matched = plans[0], plans[-1]
    main = types[0] if info else types
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(main)]
    prefix = "[0]" if info else ""
    out = matched.out_specs(len(plan.like))
    return {prefix + q: s for q, s in zip(paths, out, strict=True) if s is not None}

  return binding._replace(state_specs=in_spec, out_specs=out_specs)
