"""Where each parameter's state lives inside an optax state."""

from __future__ import annotations

import dataclasses
import numbers
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from offlax._src import coupling as coupling_lib
from offlax._src import errors

MASKED = optax.MaskedNode
MASK = object()  # a state item left out of a slice


def is_masked(x: Any) -> bool:
  return isinstance(x, MASKED)


_nnx_registered = False


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class OnDisk:
  """Stands in the state for an array that lives in an NVMe store, not in RAM.

  A pytree node without leaves: `jax.tree.leaves(state)` skips it and `jit`
  treats it as static. `index` names the array in the store's metadata.
  """

  index: int
  shape: tuple[int, ...]
  dtype: str

  def __post_init__(self):
    # Flax NNX would drop a leafless node from `nnx.state`, and orbax save the
    # state without these arrays: `flax_on_disk` makes NNX keep it, where orbax
    # refuses it. Registered once NNX is imported, before it can see a placeholder.
    global _nnx_registered
    if not _nnx_registered and "flax.nnx" in sys.modules:
      from offlax._src import flax_on_disk

      flax_on_disk.register(OnDisk)
      _nnx_registered = True

  def __reduce__(self):
    # Without what Flax NNX binds to a placeholder (`flax_on_disk`): its fields only.
    return (OnDisk, (self.index, self.shape, self.dtype))


def is_slot(x: Any) -> bool:
  """A position of a parameter-shaped subtree: a leaf, masked or on disk."""
  return isinstance(x, (MASKED, OnDisk))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class ParamSpec:
  """The parameter tree a state was built for: a pytree node with no leaves.

  Kept in `OffloadState` so `update` can name the leaf that differs when it is
  handed updates of another tree. Being static, it is part of the state's
  treedef and costs nothing at run time.

  Any two `ParamSpec`s compare equal (and hash alike), so the state's pytree
  structure is that of the inner state: optax's tree utilities that re-init
  the transformation on a placeholder (`optax.tree.map_params`) and map it
  together with the state work as on plain optax state. Nothing is lost in a
  jit cache key: the params' tree, shapes and shardings that a spec records
  are also in the types of the updates and the state.
  """

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ParamSpec)

  def __hash__(self) -> int:
    return hash(ParamSpec)

  def same(self, other: ParamSpec) -> bool:
    """Field-by-field equality (`==` is always true, see above), `nbytes` aside."""
    fields = ("treedef", "shapes", "mesh", "specs")
    return all(getattr(self, f) == getattr(other, f) for f in fields)

  @property
  def placeholder(self) -> bool:
    """Whether this is the spec of a tree without arrays (optax's params placeholder)."""
    return not self.shapes

  treedef: jax.tree_util.PyTreeDef
  shapes: tuple[tuple[int, ...] | None, ...]  # None: an optax.MaskedNode slot
  # Bytes of the tree's arrays, for `offlax.stats`; not compared: gradients
  # may come in another dtype than the params.
  nbytes: int = dataclasses.field(default=0, compare=False)
  # The params' mesh when they are sharded on one (None otherwise), and each
  # slot's PartitionSpec: static, so a jitted update sees them in any mode.
  mesh: Any = None
  specs: tuple[Any, ...] = ()

  @property
  def paths(self) -> list[str]:
    dummy = self.treedef.unflatten([0] * self.treedef.num_leaves)
    flat = jax.tree_util.tree_flatten_with_path(dummy, is_leaf=is_masked)[0]
    return [jax.tree_util.keystr(p) for p, _ in flat]

  @classmethod
  def of(cls, tree: Any, what: str = "params") -> ParamSpec:
    """The spec of the params tree `tree` (or of updates of its structure).

    Args:
      tree: a pytree of arrays (`jax.Array`, numpy arrays, Python numbers or
        `jax.ShapeDtypeStruct`s); `optax.MaskedNode` slots are kept as slots.
      what: what `tree` is, for the error message ("params", "updates").

    Returns:
      Its `ParamSpec`: treedef, shapes, bytes, and the mesh and each leaf's
      `PartitionSpec` where the leaves are sharded on one.

    Raises:
      LeafTypeError: a leaf is not an array.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from offlax._src.layout import ParamSpec
      >>> spec = ParamSpec.of({"b": jnp.zeros(3), "w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
      >>> spec.shapes, spec.nbytes, spec.paths
      (((3,), (2, 3)), 36, ["['b']", "['w']"])
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)
    shapes: list[tuple[int, ...] | None] = []
    n = 0
    for path, leaf in flat:
      if is_masked(leaf):
        shapes.append(None)
      elif is_array(leaf) and not isinstance(leaf, (str, bytes)):
        shapes.append(tuple(np.shape(leaf)))
        n += nbytes(leaf)
      else:
        raise errors.LeafTypeError(
          f"{what} leaf {jax.tree_util.keystr(path) or '<root>'} is a "
          f"{type(leaf).__name__} ({leaf!r:.60}); expected an array (jax.Array, "
          "numpy array, Python number or jax.ShapeDtypeStruct)."
        )
    mesh, specs = mesh_of(flat, what)
    return cls(treedef, tuple(shapes), n, mesh, specs)


class StateLayout:
  """Where each parameter's state lives inside an inner state.

  An optax state holds per-parameter state in subtrees shaped like the params
  (`mu`, `nu`, ...; `optax.MaskedNode` where a mask drops a leaf) and global
  leaves (`count`, hyperparameters). `split` lists the state's arrays with the
  leaf each belongs to (`GLOBAL` for none); `merge` rebuilds the state from
  such a list, with `optax.MaskedNode` for items given as `MASK`.
  """

  def __init__(self, state: Any, spec: ParamSpec):
    self.spec = spec
    single = spec.treedef.num_nodes == 1

    def is_param_tree(node):
      if single:  # params is one array: match arrays of its shape only
        return hasattr(node, "shape") and tuple(node.shape) == spec.shapes[0]
      return jax.tree.structure(node, is_leaf=is_slot) == spec.treedef

    tops, treedef = jax.tree.flatten(
      state, is_leaf=lambda n: isinstance(n, OnDisk) or is_param_tree(n)
    )
    self.treedef: Any = treedef
    self.tops = [
      tuple(not is_masked(s) for s in self._slots(t)) if is_param_tree(t) else None for t in tops
    ]
    self.owners = [
      owner
      for top in self.tops
      for owner in ([coupling_lib.GLOBAL] if top is None else [i for i, p in enumerate(top) if p])
    ]

  def _slots(self, tree):
    return jax.tree.leaves(tree, is_leaf=is_slot) if self.spec.treedef.num_nodes > 1 else [tree]

  def split(self, state: Any) -> list[Any]:
    items = []
    for top, present in zip(self.treedef.flatten_up_to(state), self.tops, strict=True):
      if present is None:
        items.append(top)
      else:
        slots = self._slots(top)
        items.extend(MASK if is_masked(s) else s for s, p in zip(slots, present, strict=True) if p)
    return items

  def merge(self, items: Sequence[Any]) -> Any:
    it = iter(items)
    tops = []
    for present in self.tops:
      if present is None:
        tops.append(next(it))
        continue
      slots = [MASKED() if not p else next(it) for p in present]
      slots = [MASKED() if s is MASK else s for s in slots]
      tops.append(self.spec.treedef.unflatten(slots))
    return self.treedef.unflatten(tops)


def shape_of(x: Any) -> tuple[int, ...]:
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def dtype_of(x: Any) -> Any:
  """The dtype of `x`: a numpy dtype, a JAX extended dtype (PRNG keys) or a name."""
  return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def nbytes(x: Any) -> int:
  """Bytes of an array, `ShapeDtypeStruct`, `OnDisk` or Python number."""
  dtype = dtype_of(x)
  itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize
  return int(np.prod(shape_of(x), dtype=np.int64)) * itemsize


def leaf_bytes(items: Sequence[Any], owners: Sequence[int], n_leaves: int, counted) -> list[int]:
  """Bytes of the items `counted(item)` selects, summed per owning leaf."""
  total = [0] * n_leaves
  for x, owner in zip(items, owners, strict=True):
    if owner != coupling_lib.GLOBAL and counted(x):
      total[owner] += nbytes(x)
  return total


def is_array(x: Any) -> bool:
  """Whether `x` is an array leaf: a `jax.Array`, numpy array, number or `ShapeDtypeStruct`."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, numbers.Number))


def mesh_of(
  flat: Sequence[tuple[Any, Any]], what: str = "params"
) -> tuple[Mesh | None, tuple[PartitionSpec | None, ...]]:
  """The mesh of (key path, leaf) pairs sharded on one, and each leaf's spec.

  Leaves without a `NamedSharding` (numbers, numpy arrays, tracers, masked
  slots) get None. A mesh of one device counts as no mesh: nothing changes.
  """
  mesh: Any = None
  specs: list[PartitionSpec | None] = []
  for path, leaf in flat:
    sharding = _named(leaf)
    if sharding is None or sharding.mesh.size == 1:
      specs.append(None)
      continue
    if mesh is None:
      mesh = sharding.mesh
    elif sharding.mesh != mesh:
      raise errors.TreeMismatchError(
        f"{what} leaf {jax.tree_util.keystr(path)} is on mesh {sharding.mesh}, other leaves on "
        f"{mesh}: offload needs every sharded {what} leaf on one mesh."
      )
    specs.append(sharding.spec)
  if mesh is None:
    return None, ()
  return mesh, tuple(specs)


def _named(leaf: Any) -> NamedSharding | None:
  if isinstance(leaf, jax.core.Tracer):
    return None
  sharding = getattr(leaf, "sharding", None)
  return sharding if isinstance(sharding, NamedSharding) else None
