"""Stacked layers' params and gradients on disk, streamed through `offlax.scan_layers`.

A `LayerStore` is a directory holding a stacked layer pytree (each leaf has
the layers on its first axis, as `scan_layers` takes them): a JSON manifest
(``layers.json``: the layer count and, per leaf, its key path, one layer's
shape and dtype, its file and slot size) and two files per leaf,
``params/<k>.bin`` and ``grads/<k>.bin``. Layer i of a leaf is one slot at
``i * slot``, its bytes padded to the direct-I/O block, so a layer is read or
written by one aligned transfer into an aligned buffer: O_DIRECT where the
filesystem has it (`direct_io.set_direct`), the page cache elsewhere (tmpfs).
The manifest is written last, so a directory with one holds a whole store.

`LayerStore.source()` hands out a `LayerSource`, which `scan_layers` takes in
place of the stacked arrays. The scan then runs over the layer index, and its
body reads layer i by a `jax.pure_callback` whose results (one layer's leaves)
land in device memory. The callback takes layer i from the read-ahead pool
(a thread pool) and queues the next reads (i+1, or i-1 once the layers come
last to first, as in the backward pass), at most ``pool_layers`` layers held
or in flight; a layer not read ahead is read at once.

The read is a `jax.custom_vjp`. Its backward rule writes layer i's gradient
into ``grads/<k>.bin`` by an unordered `io_callback` (added into what is there
with ``source(accumulate=True)``) and returns, as the cotangent of the
source's token (a zero per layer, the source's only pytree leaf), the zero
that callback returns: the write is a dependency of the gradient the caller
gets, so no pass drops it, and the gradients never form a model-sized buffer.
Under `jax.checkpoint` (``scan_layers``' default ``remat``) the backward pass
reads each layer again rather than saving it: a layer is read twice a step.
The gradient of the source is what must be asked for
(``jax.grad(loss)(source, ...)``): a loss differentiated only with respect to
other inputs writes no layer gradients.

Why callbacks rather than ``pinned_host`` arrays: a host-memory array exists
whole in RAM, while a callback needs only the layers in the pool, so RAM holds
a few layers whatever the model's size. `offlax.compile_for_gpu` lowers the
callbacks as XLA:GPU lowers them on a GPU (`host_callbacks`).

Milestone 1 limits: the gradient writes are synchronous in the callback (no
write-behind yet), the store has no generations or commit (the optimizer step
over on-disk params is the next step), and reads go through Python callbacks.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offlax._src import errors, host_callbacks
from offlax._src.nvme.direct_io import BLOCK, aligned_empty, pread_into, pwrite_all, set_direct

MANIFEST = "layers.json"
FORMAT = "offlax-layer-store"
VERSION = 1


def _padded(n: int) -> int:
  return -(-n // BLOCK) * BLOCK


def _leaf_records(layers: Any) -> tuple[list[dict[str, Any]], int, Any]:
  """Per leaf: key path, one layer's shape and dtype; the layer count; the treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(layers)
  if not flat:
    raise errors.InvalidOptionError("LayerStore: the layer pytree has no leaves.")
  records, n = [], None
  for path, leaf in flat:
    key = jax.tree_util.keystr(path)
    shape = tuple(getattr(leaf, "shape", ()))
    if not hasattr(leaf, "dtype") or not shape:
      raise errors.LeafTypeError(
        f"LayerStore: leaf {key} must be an array with a leading layer axis, got "
        f"{type(leaf).__name__} of shape {shape}."
      )
    if n is None:
      n = shape[0]
    elif shape[0] != n:
      raise errors.TreeMismatchError(
        f"LayerStore: leaf {key} stacks {shape[0]} layers, expected {n} (as the first leaf)."
      )
    dtype = np.dtype(leaf.dtype)
    nbytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    records.append(
      {"path": key, "shape": list(shape[1:]), "dtype": dtype.name, "slot": _padded(nbytes)}
    )
  assert n is not None
  return records, n, treedef


class LayerStore:
  """A stacked layer pytree's params and gradients on disk, a layer at a time.

  Make one with `LayerStore.create` or `LayerStore.open`; use it as a context
  manager or `close` it.

  Attributes:
    path: the store's directory.
    n_layers: the number of layers.
    pool_layers: the most layers held in RAM by reads (the one being handed to
      the device and those read ahead).
    peak_held: the most layers the reads held at once so far (for tests).
  """

  def __init__(self, path: str, records, n_layers: int, treedef, pool_layers: int | None,
               pool_bytes: int | None):  # fmt: skip
    self.path, self.records, self.n_layers, self.treedef = path, records, n_layers, treedef
    self.layer_bytes = sum(r["slot"] for r in records)
    self.pool_layers = _pool_size(self.layer_bytes, pool_layers, pool_bytes)
    self._lock = threading.Lock()
    self._ahead: dict[int, concurrent.futures.Future] = {}
    self._last: int | None = None
    self._step = 1
    self._held = 0
    self.peak_held = 0
    self._pool = concurrent.futures.ThreadPoolExecutor(
      max(1, self.pool_layers - 1), "offlax-layers"
    )
    self._fds: list[tuple[int, int]] = []
    try:
      for k, _ in enumerate(records):
        p = _open(os.path.join(path, "params", f"{k}.bin"), os.O_RDWR)
        g = _open(os.path.join(path, "grads", f"{k}.bin"), os.O_RDWR)
        self._fds.append((p, g))
    except BaseException:
      self.close()
      raise

  # -- making and opening ------------------------------------------------------

  @classmethod
  def create(cls, path: str, layers: Any, *, pool_layers: int | None = 2,
             pool_bytes: int | None = None) -> LayerStore:  # fmt: skip
    """Writes the stacked `layers` into a new store at `path` (gradients zero).

    Args:
      path: a directory that does not exist or is empty.
      layers: a pytree of arrays, the layers stacked on each leaf's first axis.
      pool_layers: layers the read-ahead pool may hold (>= 1; 2 reads one ahead).
      pool_bytes: instead of ``pool_layers``, the pool's size in bytes (at
        least one layer).

    Returns:
      The open store.

    Raises:
      NotAStoreError: `path` holds files.
      InvalidOptionError: the pool cannot hold one layer.
    """
    records, n, treedef = _leaf_records(layers)
    _pool_size(sum(r["slot"] for r in records), pool_layers, pool_bytes)  # before writing
    if os.path.isdir(path) and os.listdir(path):
      raise errors.NotAStoreError(f"LayerStore.create: {path} exists and is not empty.")
    for sub in ("params", "grads"):
      os.makedirs(os.path.join(path, sub), exist_ok=True)
    leaves = jax.tree.leaves(layers)
    for k, (r, leaf) in enumerate(zip(records, leaves, strict=True)):
      r["file"] = f"params/{k}.bin"
      fd = _open(os.path.join(path, r["file"]), os.O_RDWR | os.O_CREAT | os.O_EXCL)
      try:
        os.ftruncate(fd, n * r["slot"])  # sparse: a ShapeDtypeStruct's layers stay zero
        if not isinstance(leaf, jax.ShapeDtypeStruct):
          host = np.asarray(jax.device_get(leaf))
          for i in range(n):
            _write_slot(fd, host[i], i * r["slot"], r["slot"])
        os.fsync(fd)
      finally:
        os.close(fd)
      with open(os.path.join(path, "grads", f"{k}.bin"), "wb") as f:
        f.truncate(n * r["slot"])  # sparse: zero until written
    manifest = {"format": FORMAT, "version": VERSION, "n_layers": n, "leaves": records}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
      json.dump(manifest, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))  # the manifest last: a store is whole
    return cls(path, records, n, treedef, pool_layers, pool_bytes)

  @classmethod
  def open(cls, path: str, like: Any, *, pool_layers: int | None = 2,
           pool_bytes: int | None = None) -> LayerStore:  # fmt: skip
    """Opens the store at `path`, checked against `like`.

    Args:
      path: the store's directory.
      like: the stacked layer pytree the store must hold: arrays or
        `jax.ShapeDtypeStruct`s of the same structure, shapes and dtypes.
      pool_layers, pool_bytes: as for `create`.

    Raises:
      StoreError: no store at `path`.
      StoreCorruptedError: its manifest or files are damaged.
      StoreMismatchError: it holds another layer tree than `like`.
    """
    manifest_path = os.path.join(path, MANIFEST)
    try:
      with open(manifest_path) as f:
        manifest = json.load(f)
    except FileNotFoundError:
      raise errors.StoreError(
        f"LayerStore.open: no layer store at {path} ({MANIFEST} is missing)."
      ) from None
    except (OSError, ValueError) as e:
      raise errors.StoreCorruptedError(f"LayerStore.open: cannot read {manifest_path}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
      raise errors.StoreCorruptedError(f"LayerStore.open: {manifest_path} is not a layer store's.")
    records, n, treedef = _leaf_records(like)
    stored = manifest.get("leaves", [])
    if manifest.get("n_layers") != n:
      raise errors.StoreMismatchError(
        f"LayerStore.open: {path} holds {manifest.get('n_layers')} layers, expected {n}."
      )
    got = {r.get("path"): r for r in stored}
    want = {r["path"] for r in records}
    for r in records:
      s = got.get(r["path"])
      if s is None:
        raise errors.StoreMismatchError(
          f"LayerStore.open: {path} has no leaf {r['path']}; it holds "
          f"{', '.join(sorted(str(k) for k in got))}."
        )
      if (list(s.get("shape", [])), s.get("dtype")) != (r["shape"], r["dtype"]):
        raise errors.StoreMismatchError(
          f"LayerStore.open: leaf {r['path']} of {path} is {s.get('dtype')}{s.get('shape')} "
          f"per layer, expected {r['dtype']}{r['shape']}."
        )
    extra = sorted(str(k) for k in got if k not in want)
    if extra:
      raise errors.StoreMismatchError(
        f"LayerStore.open: {path} holds leaves the tree does not have: {', '.join(extra)}."
      )
    records = [got[r["path"]] for r in records]  # the tree's order, the store's files
    for k, r in enumerate(records):
      for name in (r["file"], f"grads/{k}.bin"):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.exists(file) else None
        if size != n * r["slot"]:
          raise errors.StoreCorruptedError(
            f"LayerStore.open: {file} (leaf {r['path']}) holds {size} bytes, expected "
            f"{n * r['slot']} ({n} layers of {r['slot']})."
          )
    return cls(path, records, n, treedef, pool_layers, pool_bytes)

  def close(self) -> None:
    """Ends the reads and closes the files."""
    self._pool.shutdown(wait=True, cancel_futures=True)
    self._ahead.clear()
    for p, g in self._fds:
      os.close(p)
      os.close(g)
    self._fds = []

  def __enter__(self) -> LayerStore:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- layers and gradients ----------------------------------------------------

  def source(self, *, accumulate: bool = False) -> LayerSource:
    """What `scan_layers` takes in place of the stacked layers.

    Differentiate with respect to it (``jax.grad(loss)(source, ...)``) to write
    the layers' gradients into the store; its own gradient is a zero token.

    Args:
      accumulate: add each gradient into the store's (gradient accumulation;
        `zero_grads` starts afresh), instead of overwriting it.
    """
    return LayerSource(jnp.zeros((self.n_layers,), jnp.float32), self, accumulate)

  def avals(self) -> list[jax.ShapeDtypeStruct]:
    """One layer's leaves, as shapes and dtypes."""
    return [jax.ShapeDtypeStruct(tuple(r["shape"]), np.dtype(r["dtype"])) for r in self.records]

  def read_layer(self, i: int) -> list[np.ndarray]:
    """Layer `i`'s params (leaves in tree order), read now."""
    return [self._read_slot(k, 0, i) for k in range(len(self.records))]

  def write_layer(self, i: int, leaves: Sequence[Any]) -> None:
    """Writes layer `i`'s params (leaves in tree order)."""
    for k, x in enumerate(leaves):
      self._write(k, 0, i, np.asarray(x))

  def read_params(self) -> Any:
    """All the params, stacked (the model's size in RAM: for tests and small models)."""
    return self._stacked(0)

  def read_grads(self) -> Any:
    """All the gradients, stacked as the params are (for tests and small models)."""
    return self._stacked(1)

  def zero_grads(self) -> None:
    """Sets every gradient to zero (before accumulating anew)."""
    for _, g in self._fds:
      size = os.fstat(g).st_size
      os.ftruncate(g, 0)
      os.ftruncate(g, size)

  def _stacked(self, which: int) -> Any:
    leaves = [
      np.stack([self._read_slot(k, which, i) for i in range(self.n_layers)])
      for k in range(len(self.records))
    ]
    return jax.tree.unflatten(self.treedef, leaves)

  def _read_slot(self, k: int, which: int, i: int) -> np.ndarray:
    r = self.records[k]
    buffer = aligned_empty(r["slot"])
    try:
      pread_into(self._fds[k][which], buffer, i * r["slot"])
    except OSError as e:
      raise errors.StoreError(f"LayerStore: cannot read layer {i} of leaf {r['path']}: {e}") from e
    dtype = np.dtype(r["dtype"])
    count = int(np.prod(r["shape"], dtype=np.int64))
    return buffer[: count * dtype.itemsize].view(dtype).reshape(r["shape"])

  def _write(self, k: int, which: int, i: int, x: np.ndarray) -> None:
    r = self.records[k]
    if x.shape != tuple(r["shape"]) or x.dtype != np.dtype(r["dtype"]):
      raise errors.StoreMismatchError(
        f"LayerStore: layer {i} of leaf {r['path']} is {x.dtype.name}{list(x.shape)}, "
        f"expected {r['dtype']}{r['shape']}."
      )
    try:
      _write_slot(self._fds[k][which], x, i * r["slot"], r["slot"])
    except OSError as e:
      raise errors.StoreError(f"LayerStore: cannot write layer {i} of leaf {r['path']}: {e}") from e

  # -- the callbacks -----------------------------------------------------------

  def _fetch(self, i: int) -> list[np.ndarray]:
    """Layer `i` for the scan: from the pool, reading the next layers ahead."""
    i = int(i)
    with self._lock:
      if self._last is not None and abs(i - self._last) == 1:
        self._step = i - self._last
      elif self._last == i:  # the backward pass starts on the layer the forward pass ended on
        self._step = -self._step
      self._last = i
      future = self._ahead.pop(i, None)
      wanted = [i + self._step * d for d in range(1, self.pool_layers)]
      wanted = [j for j in wanted if 0 <= j < self.n_layers]
      for j in [j for j in self._ahead if j not in wanted]:  # a wrong guess: drop it
        self._drop(self._ahead.pop(j))
      if future is None:
        self._held += 1
        future = concurrent.futures.Future()
        future.set_result(self.read_layer(i))
      self.peak_held = max(self.peak_held, self._held)
      for j in wanted:
        if j not in self._ahead:
          self._held += 1
          self.peak_held = max(self.peak_held, self._held)
          self._ahead[j] = self._pool.submit(self.read_layer, j)
    try:
      return future.result()
    finally:
      with self._lock:
        self._held -= 1  # the device has its copy once the callback returns

  def _drop(self, future: concurrent.futures.Future) -> None:
    if not future.cancel():
      concurrent.futures.wait([future])
    self._held -= 1

  def _write_grads(self, accumulate: bool, i: Any, *grads: np.ndarray) -> np.ndarray:
    i = int(i)
    for k, g in enumerate(grads):
      g = np.asarray(g)
      if accumulate:
        g = self._read_slot(k, 1, i) + g
      self._write(k, 1, i, g)
    return np.zeros((), np.float32)


def _pool_size(layer_bytes: int, pool_layers: int | None, pool_bytes: int | None) -> int:
  if pool_bytes is not None:
    if pool_bytes < layer_bytes:
      raise errors.InvalidOptionError(
        f"LayerStore: pool_bytes={pool_bytes} cannot hold one layer; the minimum is "
        f"{layer_bytes} bytes (one layer, its leaves padded to {BLOCK} bytes)."
      )
    return int(pool_bytes // layer_bytes)
  if not isinstance(pool_layers, int) or pool_layers < 1:
    raise errors.InvalidOptionError(
      f"LayerStore: pool_layers={pool_layers!r} cannot hold one layer; the minimum is 1 "
      f"(one layer, {layer_bytes} bytes; 2 reads one layer ahead)."
    )
  return pool_layers


def _open(path: str, flags: int) -> int:
  fd = os.open(path, flags | os.O_NOFOLLOW, 0o600)
  set_direct(fd)  # else the page cache: the slots are aligned either way
  return fd


def _write_slot(fd: int, x: np.ndarray, offset: int, slot: int) -> None:
  buffer = aligned_empty(slot)
  data = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
  buffer[: data.size] = data
  buffer[data.size :] = 0
  pwrite_all(fd, [buffer], offset)


@jax.tree_util.register_pytree_node_class
class LayerSource:
  """A `LayerStore`'s layers, as `scan_layers` takes them (`LayerStore.source`).

  A pytree with one leaf, ``token`` (a zero per layer): differentiating with
  respect to it writes the layers' gradients into the store, and its own
  gradient is zeros that depend on those writes.
  """

  def __init__(self, token: Any, store: LayerStore, accumulate: bool):
    self.token, self.store, self.accumulate = token, store, accumulate

  def tree_flatten(self):
    return (self.token,), (self.store, self.accumulate)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @property
  def n_layers(self) -> int:
    return self.store.n_layers

  def read(self, i: Any, token: Any) -> Any:
    """Layer `i` (traced) as a pytree on the device; its gradient goes to the store."""
    return _read(self.store, self.accumulate, i, token)


def _fetch_callback(store: LayerStore, i):
  return host_callbacks.call(store._fetch, store.avals(), i, side_effect=False)


def _read(store: LayerStore, accumulate: bool, i, token):
  @jax.custom_vjp
  def read(i, token):
    return _fetch_callback(store, i)

  def fwd(i, token):
    return _fetch_callback(store, i), i

  def bwd(i, grads):
    write = lambda i, *g: [store._write_grads(accumulate, i, *g)]
    [done] = host_callbacks.call(
      write, [jax.ShapeDtypeStruct((), jnp.float32)], i, *grads, side_effect=True
    )
    return None, done  # the token's cotangent: the write's result, so it cannot be dropped

  read.defvjp(fwd, bwd)
  return jax.tree.unflatten(store.treedef, read(i, token))
