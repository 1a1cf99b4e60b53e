"""An NNX model's params as a checkpoint fills them: where each lives, how to put and read it.

A param is a `Param` (an `nnx.Param`: on the device, in ``pinned_host`` after
`offlax.offload_params`, or abstract under `nnx.eval_shape`) or a `Stored`
one (a layer's leaf in a `LayerStore`, after ``offload_params(store=)``).
Paths are the model's attribute path joined by dots (``layers.0.attn.q_proj.w``),
as Tunix's mappings name them.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offlax._src import errors
from offlax._src import nnx_layer_store as stored_lib
from offlax._src.layer_store import files as layer_files


class Param(NamedTuple):
  """An `nnx.Param` of the model: its value's shape, dtype and (where known) sharding."""

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  variable: Any


class Stored(NamedTuple):
  """Leaf `leaf` of layer `layer` of a `LayerStore` (the model's stored layer)."""

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  layer: int
  leaf: int
  variable: Any  # its `StoredParam`, holding an empty placeholder


def of_model(model: Any, store: Any) -> dict[str, Param | Stored]:
  """Every param of `model` by path; a stored layer's leaves located in `store`.

  Raises:
    InvalidOptionError: `model` has layers in a store and `store` is None, or
      `store` is not the one they read.
  """
  found: dict[str, Param | Stored] = {}
  for path, node in nnx.graph.iter_graph(model):
    if isinstance(node, stored_lib.LayerToken):
      continue
    name = ".".join(str(k) for k in path)
    if isinstance(node, stored_lib.StoredParam):
      found[name] = _stored(model, path, name, store, node)
    elif isinstance(node, nnx.Param):
      x = node.get_value()
      found[name] = Param(name, tuple(x.shape), np.dtype(x.dtype), node)
  return found


def _stored(model: Any, path: tuple[Any, ...], name: str, store: Any, variable: Any) -> Stored:
  if store is None:
    raise errors.InvalidOptionError(
      f"the model's param {name} is in a LayerStore (offload_params(model, store=store)); "
      "pass the same store= here."
    )
  layer, rest = model, list(path)
  while rest and not hasattr(layer, stored_lib.INDEX):
    key = rest.pop(0)
    layer = layer[key] if isinstance(key, int) else getattr(layer, key)
  i = getattr(layer, stored_lib.INDEX)
  key = "".join(f"[{k}]" if isinstance(k, int) else f"['{k}']" for k in rest)
  for k, r in enumerate(store.records):
    if r["path"].removesuffix(".value") == key:
      return Stored(name, tuple(r["shape"]), np.dtype(r["dtype"]), i, k, variable)
  raise errors.InvalidOptionError(
    f"the model's param {name} is stored, but store {store.path} has no leaf {key}: pass the "
    "store its layers read (offload_params(model, store=store))."
  )


def model_store(model: Any, store: Any, where: str) -> Any:
  """The `LayerStore` `model`'s layers read (None: none); a `store` given must be that one.

  Raises:
    InvalidOptionError: `store` is given and is not the store the model's
      layers read (another store with the same leaves would be written while
      the model reads its own), or the model reads several stores.
  """
  stores = stored_lib.stores_of(model)
  if len(stores) > 1:
    raise errors.InvalidOptionError(
      f"{where}: the model's layers read {len(stores)} LayerStores "
      f"({', '.join(s.path for s in stores)}); one is supported."
    )
  own = stores[0] if stores else None
  if store is None or store is own:
    return own
  if own is None:
    raise errors.InvalidOptionError(
      f"{where}: store= was given ({store.path}), but the model's layers read no store; "
      "pass store=None, or offload_params(model, store=store) first."
    )
  raise errors.InvalidOptionError(
    f"{where}: store= is {store.path}, but the model's layers read the store at {own.path} "
    "(another LayerStore object); pass that one, or leave store= out."
  )


def place(param: Param, x: np.ndarray) -> jax.Array:
  """`x` placed as `param` is: in its memory and sharding (host `x` straight to ``pinned_host``).

  The param itself is left as it is (the load sets it at the end).
  """
  old = param.variable.get_value()
  sharding = getattr(old, "sharding", None)
  if sharding is None:  # abstract (nnx.eval_shape) without a sharding: JAX's default device
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.device_put(x, sharding)


def has_value(param: Param | Stored) -> bool:
  """Whether `param` holds values (not a `jax.ShapeDtypeStruct` of `nnx.eval_shape`)."""
  return isinstance(param, Stored) or not isinstance(
    param.variable.get_value(), jax.ShapeDtypeStruct
  )


def get(param: Param) -> np.ndarray:
  """`param`'s values, in host RAM."""
  return np.asarray(jax.device_get(param.variable.get_value()))


def check_store(store: Any, where: str) -> None:
  """Refuses a store open without the optimizer its state is of: the load makes that state afresh.

  Raises:
    InvalidOptionError: the store holds optimizer state and is open without an optimizer.
  """
  if store is not None and store.manifest.get("state") is not None and store.optimizer is None:
    raise errors.InvalidOptionError(
      f"{where}: {store.path} holds optimizer state, but is open without an optimizer: the "
      "loaded layers' state is made by its init; open it with LayerStore.open(..., "
      "optimizer=...) as it was created."
    )


def free_generation(store: Any) -> int:
  """A generation no kept step is in, its checksums reset: where a load writes."""
  kept = {g for _, g in store.kept}
  gen = next(g for g in range(store.generations) if g not in kept)
  store.manifest["crc"][str(gen)] = layer_files.no_crcs(store.manifest)
  return gen


def write_layer(store: Any, gen: int, i: int, leaves: list[np.ndarray]) -> None:
  """Layer `i`'s params into generation `gen` of the store, with fresh optimizer state.

  The optimizer's ``init`` of the layer (the fp32 master of `master_weights`
  from the same values, zero moments), as `LayerStore.create` makes a layer.
  Each slot's crc32c goes into the manifest (in memory, until `commit`).
  """
  store.write_slots("params", gen, i, leaves)
  if store.optimizer is not None:
    state = jax.jit(store.optimizer.init)(store.treedef.unflatten(leaves))
    store.write_slots("state", gen, i, [np.asarray(x) for x in jax.tree.leaves(state)])


def concrete_placeholder(param: Stored) -> None:
  """A stored param's placeholder as an empty array: an `nnx.eval_shape` model's was abstract."""
  if isinstance(param.variable.get_value(), jax.ShapeDtypeStruct):
    param.variable.set_value(jnp.zeros((0,), param.dtype))


def commit(store: Any, gen: int) -> None:
  """Makes generation `gen` (every layer written) the committed step's, atomically.

  As `LayerStore.update` commits: its files flushed, then the manifest naming
  `gen` (and the checksums of its slots) replaces the old one by a rename. A
  kill before the rename leaves the step as it was, whole; after it, the loaded
  one. The step keeps its number; the generation it was in is free again, and
  the rest committed with it (`LayerStore.read_rest`) is not the loaded model's.
  """
  if store.fsync:
    for name, _ in layer_files.store_files(store.path, store.manifest):
      if os.path.basename(os.path.dirname(os.path.dirname(name))) == f"gen{gen}":
        fd = os.open(name, os.O_RDONLY)
        try:
          os.fsync(fd)
        finally:
          os.close(fd)
  store.manifest.setdefault("rest", {})[str(gen)] = None
  kept = [(store.step, gen)] + store.kept[1:]
  manifest = dict(store.manifest, generation=gen, kept=kept)
  layer_files.write_manifest(store.path, manifest, fsync=store.fsync)
  store.manifest.update(generation=gen, kept=kept)
  store.generation, store.kept = gen, kept
  store.drop_read_ahead()  # layers read ahead are of the generation replaced
