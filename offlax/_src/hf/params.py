"""An NNX model's params as a checkpoint fills them: where each lives, how to put and read it.

A param is a `Param` (an `nnx.Param`: on the device, in ``pinned_host`` after
`offlax.offload_params`, or abstract under `nnx.eval_shape`) or a `Stored`
one (a layer's leaf in a `LayerStore`, after ``offload_params(store=)``).
Paths are the model's attribute path joined by dots (``layers.0.attn.q_proj.w``),
as Tunix's mappings name them.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offlax._src import errors
from offlax._src import nnx_layer_store as stored_lib


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
  variable: Any  # its `StoredParam`, holding a one-element placeholder


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


def concrete_placeholder(param: Stored) -> None:
  """A stored param's placeholder as an array: an `nnx.eval_shape` model's was abstract."""
  value = param.variable.get_value()
  if isinstance(value, jax.ShapeDtypeStruct):
    param.variable.set_value(jnp.zeros(value.shape, param.dtype))


_QUEUED = 2  # leaves queued for the writer: enough to overlap, few enough for a flat RAM


class LayerWriter:
  """A load's stored params written into the store behind it, on a thread of their own.

  Through the store's `LayerStore.rewrite`: each leaf written as it comes
  (direct I/O, its checksum), each layer's fresh optimizer state once its
  last leaf has come, in the order given; at most `_QUEUED` leaves queued (the
  load's RAM stays flat), a failed write raised at the next `put`. `commit`
  waits for them all and commits; `close` ends the thread (a failure: what is
  queued is dropped, nothing committed).
  """

  def __init__(self, store: Any):
    self._rewrite = store.rewrite()
    self._leaves = len(store.records)
    self._keep = store.optimizer is not None  # the layer's params, for its state's init
    self._layer: dict[int, np.ndarray] = {}
    self._count = 0
    self._pool = concurrent.futures.ThreadPoolExecutor(1, "offlax-write")
    self._pending: collections.deque[concurrent.futures.Future] = collections.deque()

  def empty(self, target: Stored) -> np.ndarray:
    """An array for `target`'s values that its write takes uncopied (`Rewrite.empty`)."""
    return self._rewrite.empty(target.leaf)

  def put(self, target: Stored, x: np.ndarray) -> None:
    """Queues leaf `target.leaf` of layer `target.layer` (leaves come in order, layer by layer).

    Nothing reads `x` after this: its slot serves the next layer's leaf.
    """
    self._pending.append(self._pool.submit(self._write, target.layer, target.leaf, x))
    self._count += 1
    if self._keep:
      self._layer[target.leaf] = x
    if self._count == self._leaves:  # the layer's last leaf
      if self._keep:
        params = [self._layer[k] for k in range(self._leaves)]
        self._pending.append(self._pool.submit(self._init_state, target.layer, params))
      self._layer, self._count = {}, 0
    self._wait(_QUEUED)

  def _write(self, i: int, k: int, x: np.ndarray) -> None:
    self._rewrite.write_params(i, [x], k)
    if not self._keep:  # else the state's init reads it first
      self._rewrite.release(x)

  def _init_state(self, i: int, params: list[np.ndarray]) -> None:
    self._rewrite.init_state(i, params)
    for x in params:
      self._rewrite.release(x)

  def _wait(self, most: int) -> None:
    """Takes the finished writes (raising a failed one); waits until at most `most` are left."""
    while self._pending and (len(self._pending) > most or self._pending[0].done()):
      self._pending.popleft().result()

  def commit(self) -> None:
    """Waits for every write, then commits the store's new values (`Rewrite.commit`)."""
    self._wait(0)
    self._rewrite.commit()

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
