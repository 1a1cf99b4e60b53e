"""`offload`: the optax wrapper that keeps an optimizer's state in a tier."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from offlax._src import coupling as coupling_lib
from offlax._src import errors
from offlax._src import schedule as schedule_lib
from offlax._src.host_tier import HostTier

_MASKED = optax.MaskedNode
_MASK = object()  # a state item left out of a slice


def _is_masked(x: Any) -> bool:
  return isinstance(x, _MASKED)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """The parameter tree a state was built for: a pytree node with no leaves.

  Kept in `OffloadState` so `update` can name the leaf that differs when it is
  handed updates of another tree. Being static, it is part of the state's
  treedef and costs nothing at run time.
  """

  treedef: jax.tree_util.PyTreeDef
  shapes: tuple[tuple[int, ...] | None, ...]  # None: an optax.MaskedNode slot

  @property
  def paths(self) -> list[str]:
    dummy = self.treedef.unflatten([0] * self.treedef.num_leaves)
    flat = jax.tree_util.tree_flatten_with_path(dummy, is_leaf=_is_masked)[0]
    return [jax.tree_util.keystr(p) for p, _ in flat]


class OffloadState(NamedTuple):
  """State of `offload`: the inner state, placed in the tier.

  Attributes:
    inner_state: the inner transformation's state, with the inner structure
      unchanged, so `optax.tree_utils.tree_get(state, "mu")` finds it.
    spec: the parameter tree the state was built for (static, no leaves).
  """

  inner_state: Any
  spec: ParamSpec


def offload(
  inner: optax.GradientTransformation,
  tier: HostTier | None = None,
  **tier_options: Any,
) -> optax.GradientTransformationExtraArgs:
  """Keeps the state of `inner` in a memory tier off the accelerator.

  `init` places the inner state in the tier. `update` works inside the caller's
  `jax.jit`: it streams the state to the device in slices, runs the inner
  update on each slice and moves the new state back. The results are those of
  `inner` bit for bit: slices follow the data dependencies of the inner update
  (see `offlax._src.coupling`), so coupled transformations such as a global
  norm clip inside `inner` run as one slice.

  Args:
    inner: the transformation whose state is offloaded.
    tier: where the state lives; `None` means `HostTier(**tier_options)`.
    **tier_options: options of the default `HostTier` when `tier` is None.

  Returns:
    A `optax.GradientTransformationExtraArgs` whose state is an `OffloadState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    >>> tx = offlax.offload(optax.adam(1e-3))
    >>> state = tx.init(params)
    >>> state.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
    >>> updates, state = jax.jit(tx.update)(params, state)
    >>> updates["w"].shape
    (4, 3)
  """
  if tier is None:
    tier = HostTier(**tier_options)
  elif tier_options:
    raise errors.InvalidTierError(
      f"offload got both a tier and tier options {sorted(tier_options)}; "
      "set the options on the tier."
    )
  if not isinstance(tier, HostTier):
    raise errors.InvalidTierError(f"tier must be an offlax.HostTier, got {type(tier).__name__}.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    spec = _spec_of(params, "params")
    tier.check_devices(_devices_of(params))
    inner_state = inner.init(params)
    placed = jax.tree.map(lambda x: tier.to_host(x) if tier.offloads(x) else x, inner_state)
    return OffloadState(placed, spec)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, OffloadState):
      raise errors.TreeMismatchError(
        f"offload.update expects the OffloadState returned by init, got {type(state).__name__}."
      )
    _check_same(state.spec, _spec_of(updates, "updates"), "updates")
    if params is not None:
      _check_same(state.spec, _spec_of(params, "params"), "params")
    return _Step(inner, tier, updates, state.inner_state, params, extra_args).run(state.spec)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _StateLayout:
  """Where each parameter's state lives inside an inner state.

  An optax state holds per-parameter state in subtrees shaped like the params
  (`mu`, `nu`, ...; `optax.MaskedNode` where a mask drops a leaf) and global
  leaves (`count`, hyperparameters). `split` lists the state's arrays with the
  leaf each belongs to (`GLOBAL` for none); `merge` rebuilds the state from
  such a list, with `optax.MaskedNode` for items given as `_MASK`.
  """

  def __init__(self, state: Any, spec: ParamSpec):
    self.spec = spec
    single = spec.treedef.num_nodes == 1

    def is_param_tree(node):
      if single:  # params is one array: match arrays of its shape only
        return hasattr(node, "shape") and tuple(node.shape) == spec.shapes[0]
      return jax.tree.structure(node, is_leaf=_is_masked) == spec.treedef

    tops, treedef = jax.tree.flatten(state, is_leaf=is_param_tree)
    self.treedef: Any = treedef
    self.tops = [
      tuple(not _is_masked(s) for s in self._slots(t)) if is_param_tree(t) else None for t in tops
    ]
    self.owners = [
      owner
      for top in self.tops
      for owner in ([coupling_lib.GLOBAL] if top is None else [i for i, p in enumerate(top) if p])
    ]

  def _slots(self, tree):
    return jax.tree.leaves(tree, is_leaf=_is_masked) if self.spec.treedef.num_nodes > 1 else [tree]

  def split(self, state: Any) -> list[Any]:
    items = []
    for top, present in zip(self.treedef.flatten_up_to(state), self.tops, strict=True):
      if present is None:
        items.append(top)
      else:
        slots = self._slots(top)
        items.extend(
          _MASK if _is_masked(s) else s for s, p in zip(slots, present, strict=True) if p
        )
    return items

  def merge(self, items: Sequence[Any]) -> Any:
    it = iter(items)
    tops = []
    for present in self.tops:
      if present is None:
        tops.append(next(it))
        continue
      slots = [_MASKED() if not p else next(it) for p in present]
      slots = [_MASKED() if s is _MASK else s for s in slots]
      tops.append(self.spec.treedef.unflatten(slots))
    return self.treedef.unflatten(tops)


class _Step:
  """One traced `update`: the coupling analysis, the schedule, the slices."""

  def __init__(self, inner, tier, updates, inner_state, params, extra_args):
    self.inner, self.tier = inner, tier
    self.u_slots = jax.tree.leaves(updates, is_leaf=_is_masked)
    self.p_slots = None if params is None else jax.tree.leaves(params, is_leaf=_is_masked)
    self.extra_args = extra_args
    self.inner_state = inner_state

  def run(self, spec: ParamSpec):
    layout = _StateLayout(self.inner_state, spec)
    items = layout.split(self.inner_state)
    leaves = [i for i, s in enumerate(spec.shapes) if s is not None]
    shapes = [s for s in spec.shapes if s is not None]
    coupling = self._analyze(layout, items, leaves, shapes)
    offloaded = [self.tier.offloads(x) for x in items]
    leaf_bytes = [0] * len(leaves)
    position = {leaf: k for k, leaf in enumerate(leaves)}
    for x, owner, off in zip(items, layout.owners, offloaded, strict=True):
      if owner != coupling_lib.GLOBAL and off:
        leaf_bytes[position[owner]] += _nbytes(x)
    slices = [
      tuple(dataclasses.replace(p, leaf=leaves[p.leaf]) for p in pieces)
      for pieces in schedule_lib.build(coupling, shapes, leaf_bytes, self.tier.chunk_bytes)
    ]
    return self._stream(layout, items, offloaded, slices, spec)

  def _update(self, spec, u_slots, state, p_slots, extra_args):
    updates = spec.treedef.unflatten(u_slots)
    params = None if p_slots is None else spec.treedef.unflatten(p_slots)
    new_updates, new_state = self.inner.update(updates, state, params, **extra_args)
    return jax.tree.leaves(new_updates, is_leaf=_is_masked), new_state

  def _analyze(self, layout, items, leaves, shapes) -> coupling_lib.Coupling:
    """Traces the inner update on the whole tree and derives its coupling."""
    extra_leaves, extra_def = jax.tree.flatten(self.extra_args)
    arrays = [i for i, x in enumerate(extra_leaves) if _is_array(x)]
    if any(np.ndim(extra_leaves[i]) for i in arrays):
      return coupling_lib.single_group(len(leaves), "an extra argument is a non-scalar array")
    position = {leaf: k for k, leaf in enumerate(leaves)}
    spec = layout.spec

    def flat_update(u, s, p, e):
      extra_args = jax.tree.unflatten(extra_def, _fill(extra_leaves, arrays, e))
      u_slots = _fill(self.u_slots, leaves, u)
      p_slots = None if p is None else _fill(self.p_slots, leaves, p)
      new_u, new_state = self._update(spec, u_slots, layout.merge(s), p_slots, extra_args)
      return [new_u[i] for i in leaves], layout.split(new_state)

    abstract = lambda xs: [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in xs]
    u_args = abstract([self.u_slots[i] for i in leaves])
    p_args = None if self.p_slots is None else abstract([self.p_slots[i] for i in leaves])
    jaxpr = jax.make_jaxpr(flat_update)(
      u_args, abstract(items), p_args, abstract([extra_leaves[i] for i in arrays])
    )
    owner = lambda o: o if o == coupling_lib.GLOBAL else position[o]
    in_owners = (
      list(range(len(leaves)))
      + [owner(o) for o in layout.owners]
      + ([] if p_args is None else list(range(len(leaves))))
      + [coupling_lib.GLOBAL] * len(arrays)
    )
    out_owners = list(range(len(leaves))) + [owner(o) for o in layout.owners]
    return coupling_lib.analyze(jaxpr, in_owners, out_owners, shapes)

  def _stream(self, layout, items, offloaded, slices, spec):
    """Runs the inner update slice by slice; see README "The streaming schedule"."""
    tier = self.tier
    owners = layout.owners
    by_leaf: dict[int, list[int]] = {}
    for j, o in enumerate(owners):
      by_leaf.setdefault(o, []).append(j)
    globals_ = [j for j, o in enumerate(owners) if o == coupling_lib.GLOBAL]
    device_items = {j: tier.to_device(items[j]) if offloaded[j] else items[j] for j in globals_}

    # The pieces of each item that slice k reads, still in their tier.
    fetch = [
      {(j, p): p.take(items[j]) for p in pieces for j in by_leaf.get(p.leaf, [])}
      for pieces in slices
    ]
    new_u: dict[int, list[jax.Array]] = {}
    new_items: dict[int, list[jax.Array]] = {}
    results: list[Any] = []
    for k, pieces in enumerate(slices):
      if k >= 2:
        # Do not start fetching slice k before slice k-2 is computed: bounds the
        # state resident on the device to about three slices (XLA may otherwise
        # hoist every transfer to the start of the program).
        _, fetch[k] = jax.lax.optimization_barrier((results[k - 2], fetch[k]))
      slice_items: list[Any] = [_MASK] * len(items)
      for j in globals_:
        slice_items[j] = device_items[j]
      for (j, _), x in fetch[k].items():
        slice_items[j] = tier.to_device(x) if offloaded[j] else x
      u_slots: list[Any] = [_MASKED()] * len(self.u_slots)
      p_slots: list[Any] | None = None if self.p_slots is None else [_MASKED()] * len(self.u_slots)
      for p in pieces:
        u_slots[p.leaf] = p.take(self.u_slots[p.leaf])
        if p_slots is not None:
          p_slots[p.leaf] = p.take(self.p_slots[p.leaf])
      out_u, out_state = self._update(
        spec, u_slots, layout.merge(slice_items), p_slots, self.extra_args
      )
      out_items = layout.split(out_state)
      results.append(([out_u[p.leaf] for p in pieces], [out_items[j] for (j, _) in fetch[k]]))
      for p in pieces:
        new_u.setdefault(p.leaf, []).append(out_u[p.leaf])
      for j, _ in fetch[k]:
        x = out_items[j]
        new_items.setdefault(j, []).append(tier.to_host(x) if offloaded[j] else x)
      if k == 0:
        for j in globals_:
          x = out_items[j]
          new_items[j] = [tier.to_host(x) if offloaded[j] else x]

    pieces_of: dict[int, list[schedule_lib.Piece]] = {}
    for pieces in slices:
      for p in pieces:
        pieces_of.setdefault(p.leaf, []).append(p)
    out_u_slots = list(self.u_slots)
    for leaf, parts in new_u.items():
      out_u_slots[leaf] = schedule_lib.join(pieces_of[leaf], parts, spec.shapes[leaf])
    out_items = [
      new_items[j][0]
      if o == coupling_lib.GLOBAL
      else schedule_lib.join(pieces_of[o], new_items[j], np.shape(items[j]))
      for j, o in enumerate(owners)
    ]
    return spec.treedef.unflatten(out_u_slots), OffloadState(layout.merge(out_items), spec)


def _fill(slots, leaves, values):
  out = list(slots)
  for i, v in zip(leaves, values, strict=True):
    out[i] = v
  return out


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, numbers.Number))


def _dtype(x: Any):
  return x.dtype if hasattr(x, "dtype") else jax.numpy.asarray(x).dtype


def _nbytes(x: Any) -> int:
  return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(_dtype(x)).itemsize


def _spec_of(tree: Any, what: str) -> ParamSpec:
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_masked)
  shapes: list[tuple[int, ...] | None] = []
  for path, leaf in flat:
    if _is_masked(leaf):
      shapes.append(None)
    elif _is_array(leaf) and not isinstance(leaf, (str, bytes)):
      shapes.append(tuple(np.shape(leaf)))
    else:
      raise errors.LeafTypeError(
        f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} is a "
        f"{type(leaf).__name__} ({leaf!r:.60}); expected an array (jax.Array, "
        "numpy array, Python number or jax.ShapeDtypeStruct)."
      )
  return ParamSpec(treedef, tuple(shapes))


def _check_same(expected: ParamSpec, actual: ParamSpec, what: str) -> None:
  if expected.treedef != actual.treedef:
    want, got = expected.paths, actual.paths
    missing = [p for p in want if p not in got]
    extra = [p for p in got if p not in want]
    detail = (
      f"missing leaves {', '.join(missing[:5]) or 'none'}; "
      f"unexpected leaves {', '.join(extra[:5]) or 'none'}"
      if missing or extra
      else f"expected structure {expected.treedef}, got {actual.treedef}"
    )
    raise errors.TreeMismatchError(
      f"{what} do not have the structure of the params the state was initialised with: {detail}."
    )
  for path, want_shape, got_shape in zip(
    expected.paths, expected.shapes, actual.shapes, strict=True
  ):
    if want_shape != got_shape:
      raise errors.TreeMismatchError(
        f"{what} leaf {path or '<root>'} has shape {got_shape}; the state was "
        f"initialised for shape {want_shape}."
      )


def _devices_of(tree: Any) -> set[Any]:
  devices: set[Any] = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      devices |= leaf.sharding.device_set
  return devices or set(jax.local_devices()[:1])
