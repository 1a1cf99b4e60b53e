"""A layer store's open files (`Slots`): one layer of one leaf is a slot, read and written checked.

Layer i of leaf k is the slot at ``i * slot`` of file k of its kind and
generation (`files`), one aligned transfer by direct I/O where the
filesystem has it. Each write records the slot's crc32c: in the manifest's
lists (`commits.Commits.crcs`) for params and state, in memory for the
gradients (`checks`); each read checks it.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from offlax._src import errors
from offlax._src.layer_store import checks, files
from offlax._src.layer_store import clip as clip_lib
from offlax._src.layer_store import step as layer_step
from offlax._src.layer_store.commits import Commits
from offlax._src.nvme.direct_io import aligned_empty, open_direct, pread_into, pwrite_all


class Slots:
  """The open files of a layer store, under its writer lock.

  Attributes:
    path: the store's directory.
    records: per param leaf: key path, one layer's shape, dtype and slot.
    state_records: the same per optimizer state leaf (none without an optimizer).
    n_layers: the number of layers.
    layer_bytes: one layer's param slots, in bytes.
    bytes_read: the bytes of the slots read since opened (of every kind).
    bytes_written: the same, written.
  """

  def __init__(self, path: str, records: list[dict], state_records: list[dict], commits: Commits):
    self.path, self.records, self.state_records = path, records, state_records
    self._commits = commits
    self.n_layers: int = commits.manifest["n_layers"]
    self.layer_bytes = sum(r["slot"] for r in records)
    self._fds: dict[tuple[str, int], list[int]] = {}
    self._grad_crcs: list[list[int | None]] = [[checks.UNKNOWN] * self.n_layers for _ in records]
    self._lock_fd: int | None = None
    self.bytes_read = self.bytes_written = 0
    self._tally = threading.Lock()  # the counters: reads and writes come from several threads
    try:
      self._lock_fd = files.lock_store(path)
      for kind, gen in self._files():
        names = self.file_names(kind, gen)
        self._fds[kind, gen] = [open_direct(name, os.O_RDWR | os.O_NOFOLLOW)[0] for name in names]
    except BaseException:
      self.close()
      raise

  @functools.cached_property
  def grad_records(self) -> list[dict]:
    """The records of the gradient leaves (`files.grad_records`: the store's
    ``accumulator_dtype``, recorded in its manifest, else the params')."""
    return files.grad_records(self.records, self._commits.manifest.get("accumulator_dtype"))

  def _files(self) -> list[tuple[str, int]]:
    kinds = ["params"] + (["state"] if self.state_records else [])
    return [(k, g) for g in range(self._commits.generations) for k in kinds] + [("grads", 0)]

  def records_of(self, kind: str) -> list[dict]:
    """The records of `kind`'s leaves ("params", "state" or "grads")."""
    return {"state": self.state_records, "grads": self.grad_records}.get(kind, self.records)

  def file_names(self, kind: str, gen: int) -> list[str]:
    """The files of `kind` in generation `gen`, one per leaf."""
    folder = "grads" if kind == "grads" else os.path.join(f"gen{gen}", kind)
    return [
      os.path.join(self.path, folder, f"{r.get('index', k)}.bin")
      for k, r in enumerate(self.records_of(kind))
    ]

  def close(self) -> None:
    """Closes the files and releases the lock."""
    for fds in self._fds.values():
      for fd in fds:
        os.close(fd)
    self._fds = {}
    if self._lock_fd is not None:
      os.close(self._lock_fd)  # releases the lock
      self._lock_fd = None

  def check_sizes(self) -> None:
    """Raises `StoreCorruptedError` naming the first file of a step on disk not at its size."""
    for kind, gen in self._files():
      if kind != "grads" and self._commits.is_free(gen):
        continue  # a free generation: written whole before it is committed
      names, fds = self.file_names(kind, gen), self._fds[kind, gen]
      sizes = [os.fstat(fd).st_size for fd in fds]
      files.check_sizes("LayerStore.open", kind, names, sizes, self.records_of(kind), self.n_layers)

  def sync(self, gen: int) -> None:
    """Flushes generation `gen`'s params and state (before its commit)."""
    for kind in ("params", "state"):
      for fd in self._fds.get((kind, gen), []):
        os.fdatasync(fd)

  def sync_all(self) -> None:
    """Flushes every file, data and metadata (a new store's)."""
    for fds in self._fds.values():
      for fd in fds:
        os.fsync(fd)

  def zero_grads(self) -> None:
    """Sets every gradient slot to zero, its space reserved again."""
    for k, fd in enumerate(self._fds["grads", 0]):
      size = os.fstat(fd).st_size
      os.ftruncate(fd, 0)
      os.ftruncate(fd, size)
      os.posix_fallocate(fd, 0, size)  # reserved again: a gradient write never finds the disk full
      zero = checks.crc(np.zeros(self.grad_records[k]["slot"], np.uint8))
      self._grad_crcs[k] = [zero] * self.n_layers

  def read_slot(self, kind: str, gen: int, k: int, i: int) -> np.ndarray:
    """Layer `i` of leaf `k` of `kind` in generation `gen` (the gradients have one), checked.

    Raises:
      StoreCorruptedError: the slot does not match its crc32c (`checks`).
    """
    r = self.records_of(kind)[k]
    buffer = self.read_range(kind, gen, k, i, 0, r["slot"])
    self.check(kind, gen, k, i, checks.crc(buffer))
    dtype = np.dtype(r["dtype"])
    count = int(np.prod(r["shape"], dtype=np.int64))
    return buffer[: count * dtype.itemsize].view(dtype).reshape(r["shape"])

  def read_range(self, kind: str, gen: int, k: int, i: int, start: int, nbytes: int) -> np.ndarray:
    """`nbytes` of layer `i`'s slot of leaf `k` from byte `start` (aligned), unchecked: the
    caller checks the slot's crc32c (`check`) over its ranges (`ranges.Crcs`)."""
    r = self.records_of(kind)[k]
    buffer = aligned_empty(nbytes)
    try:
      pread_into(self._fds[kind, 0 if kind == "grads" else gen][k], buffer, i * r["slot"] + start)
    except OSError as e:
      raise errors.StoreError(
        e.errno, f"LayerStore: cannot read layer {i} of {kind} leaf {r['path']}: {e}"
      ) from e
    with self._tally:
      self.bytes_read += nbytes
    return buffer

  def check(self, kind: str, gen: int, k: int, i: int, got: int) -> None:
    """Raises `StoreCorruptedError` unless `got` is the crc32c recorded for the slot (`checks`)."""
    records = self.records_of(kind)
    want = (
      self._grad_crcs[k][i]
      if kind == "grads"
      else self._commits.crcs(gen)[kind][checks.slot_at(records, k, i)]
    )
    if want is not checks.UNKNOWN and got != want:
      name, path = self.file_names(kind, gen)[k], records[k]["path"]
      step, kept = self._commits.step, self._commits.kept
      if kind == "grads":
        raise checks.grads_corrupted(name, path, i, step, got, want)
      at_step = self._commits.step_of(gen)
      raise checks.corrupted(self.path, name, kind, path, i, at_step, kept, got, want)

  def record(self, kind: str, gen: int, k: int, i: int, crc: int) -> None:
    """Records `crc` as the crc32c of layer `i`'s slot of leaf `k` (`checks`)."""
    if kind == "grads":  # in memory: see `checks`
      self._grad_crcs[k][i] = crc
    else:  # checked on every read, and by `offlax.checkpoint.inspect_store(verify=True)`
      self._commits.crcs(gen)[kind][checks.slot_at(self.records_of(kind), k, i)] = crc

  def read_slots(self, kind: str, gen: int, i: int) -> list[np.ndarray]:
    """Layer `i` of every leaf of `kind` in generation `gen`."""
    return [self.read_slot(kind, gen, k, i) for k in range(len(self.records_of(kind)))]

  def stacked(self, kind: str, gen: int, treedef: Any) -> Any:
    """Every layer of `kind` in generation `gen`, each leaf stacked (the model's size in RAM)."""
    n = len(self.records_of(kind))
    layers = [self.read_slots(kind, gen, i) for i in range(self.n_layers)]
    return jax.tree.unflatten(treedef, [np.stack([x[k] for x in layers]) for k in range(n)])

  def write_raw(self, kind: str, gen: int, k: int, i: int, slot: np.ndarray) -> None:
    """Writes `slot` (a whole aligned slot, `files.to_slot`) as layer `i` of leaf `k`."""
    self.record(kind, gen, k, i, checks.crc(slot))
    self.write_range(kind, gen, k, i, 0, slot)

  def write_range(self, kind: str, gen: int, k: int, i: int, start: int, data: np.ndarray) -> None:
    """Writes `data` (aligned) at byte `start` of layer `i`'s slot of leaf `k`; the caller
    records the slot's crc32c (`record`) over its ranges (`ranges.Crcs`)."""
    r = self.records_of(kind)[k]
    with self._tally:
      self.bytes_written += data.nbytes
    try:
      pwrite_all(self._fds[kind, 0 if kind == "grads" else gen][k], [data], i * r["slot"] + start)
    except OSError as e:
      raise errors.StoreError(
        e.errno, f"LayerStore: cannot write layer {i} of {kind} leaf {r['path']}: {e.strerror or e}"
      ) from e

  def write_slot(self, kind: str, gen: int, k: int, i: int, x: Any) -> None:
    """Writes layer `i` of leaf `k` of `kind` into generation `gen`, checked."""
    r = self.records_of(kind)[k]
    x = np.asarray(x)
    if x.shape != tuple(r["shape"]) or x.dtype != np.dtype(r["dtype"]):
      raise errors.StoreMismatchError(
        f"LayerStore: layer {i} of {kind} leaf {r['path']} is {x.dtype.name}{list(x.shape)}, "
        f"expected {r['dtype']}{r['shape']}."
      )
    self.write_raw(kind, gen, k, i, files.to_slot(x, r["slot"]))

  def write_slots(self, kind: str, gen: int, i: int, leaves: Sequence[Any]) -> None:
    """Writes layer `i` of every leaf of `kind` into generation `gen`."""
    records = self.records_of(kind)
    for k, x in enumerate(leaves):
      self.write_slot(kind, gen, k, i, x)
    if len(leaves) != len(records):
      raise errors.StoreMismatchError(
        f"LayerStore: {len(leaves)} {kind} leaves for layer {i}, expected {len(records)}."
      )


def write_initial(
  slots: Slots, treedef: Any, optimizer: Any, layer: Callable[[int], Any], progress: bool
) -> None:
  """Writes each layer's params (leaves None: left zero) and its optimizer's initial state."""
  init = None if optimizer is None else jax.jit(clip_lib.state_init(optimizer))
  nbytes = slots.n_layers * (slots.layer_bytes + sum(r["slot"] for r in slots.state_records))
  desc = f"offlax: writing {slots.path}"
  for i in layer_step.progress(range(slots.n_layers), progress, nbytes, desc):
    leaves = layer(i)
    if not isinstance(leaves, list):  # a layer's pytree, from init_layer
      leaves = files.layer_leaves(slots.records, treedef, leaves, i)
    for k, x in enumerate(leaves):
      if x is not None:
        slots.write_raw("params", 0, k, i, files.to_slot(np.asarray(x), slots.records[k]["slot"]))
    if init is not None:
      shapes = [np.zeros(r["shape"], r["dtype"]) for r in slots.records]
      params = [s if x is None else x for s, x in zip(shapes, leaves, strict=True)]
      slots.write_slots("state", 0, i, jax.tree.leaves(init(treedef.unflatten(params))))
  slots.sync_all()
