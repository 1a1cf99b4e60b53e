"""New values for a layer store's committed step (`Rewrite`), written aside and committed at once.

`offlax.load_safetensors` fills a store's layers from a checkpoint: each
layer's params, and its optimizer's state made afresh from them (the
optimizer's ``init``, as `LayerStore.create` makes a layer: the fp32 master
of `master_weights`, zero moments), go into a free generation; `Rewrite.commit`
flushes it and makes it the committed step's, the step's number kept, by
replacing the manifest as `LayerStore.update` commits (`commits.Commits.replace`).
Until then the step is as it was: a failure or a kill mid-way leaves it whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from offlax._src import errors
from offlax._src.layer_store import clip as clip_lib
from offlax._src.layer_store.commits import Commits
from offlax._src.layer_store.slots import Slots
from offlax._src.nvme.direct_io import aligned_empty


class Rewrite:
  """New params (and fresh optimizer state) for every layer of the committed step.

  Made by `LayerStore.rewrite`. Write each layer's params (`write_params`, a
  leaf at a time or all of them), then `init_state` of that layer (with an
  optimizer), from one thread at a time; then `commit`. A leaf made in an
  array from `empty` is written without a copy.

  Attributes:
    generation: the free generation written into.
  """

  def __init__(self, slots: Slots, commits: Commits, optimizer: Any, treedef: Any,
               on_commit: Callable[[], None]):  # fmt: skip
    self._slots, self._commits, self._treedef, self._on_commit = slots, commits, treedef, on_commit
    self._init = None if optimizer is None else jax.jit(clip_lib.state_init(optimizer))
    self.generation = commits.free_generation()  # its checksums reset
    self._written: set[tuple[int, int]] = set()
    self._slot_of: dict[int, np.ndarray] = {}  # `empty`'s arrays' slots, by their address
    self._free: dict[int, list[np.ndarray]] = {}  # released slots, by size (one each)
    self._written_slots: dict[int, np.ndarray] = {}  # written, not yet released
    self._lock = threading.Lock()  # `empty` and `write_params` may run on two threads

  def empty(self, k: int) -> np.ndarray:
    """An uninitialised array of params leaf `k`'s shape and dtype, the start of an aligned slot.

    Its slot's padding is zero; `write_params` writes the slot as it is (no copy).
    A slot `release` gave back is used again (a new one's pages cost the kernel's zeroing).
    """
    r = self._slots.records[k]
    dtype, shape = np.dtype(r["dtype"]), tuple(r["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    with self._lock:
      free = self._free.get(r["slot"])
      slot = free.pop() if free else None
    if slot is None:
      slot = aligned_empty(r["slot"])
    slot[nbytes:] = 0  # (a slot of another leaf of the same size may have other padding)
    x = slot[:nbytes].view(dtype).reshape(shape)
    with self._lock:
      self._slot_of[x.ctypes.data] = slot
    return x

  def release(self, x: np.ndarray) -> None:
    """`x`, from `empty` and written, is read no more: its slot serves an `empty` of its size."""
    with self._lock:
      slot = self._written_slots.pop(x.ctypes.data, None)
      if slot is not None and not self._free.setdefault(slot.size, []):  # one kept: RAM flat
        self._free[slot.size].append(slot)

  def write_params(self, i: int, leaves: Sequence[Any], first: int = 0) -> None:
    """Leaves `first`, `first + 1`, ... of layer `i`'s params (each checked: shape, dtype).

    Raises:
      StoreMismatchError: a leaf's shape or dtype is not the store's.
      StoreError: the write failed.
    """
    for k, x in enumerate(leaves, first):
      slot = self._own_slot(k, x)
      if slot is not None:
        self._slots.write_raw("params", self.generation, k, i, slot)
        with self._lock:
          self._written_slots[x.ctypes.data] = slot  # for `release`
      else:
        self._slots.write_slot("params", self.generation, k, i, x)
      self._written.add((i, k))

  def _own_slot(self, k: int, x: Any) -> np.ndarray | None:
    """The slot `x` starts, if `empty(k)` made it (and `x` has leaf `k`'s shape and dtype)."""
    if not isinstance(x, np.ndarray):
      return None
    with self._lock:
      slot = self._slot_of.pop(x.ctypes.data, None)
    r = self._slots.records[k]
    if slot is None or x.shape != tuple(r["shape"]) or x.dtype != np.dtype(r["dtype"]):
      return None
    return slot

  def init_state(self, i: int, params: Sequence[Any]) -> None:
    """Layer `i`'s optimizer state made afresh from its params (all its leaves), if any."""
    if self._init is not None:
      state = self._init(self._treedef.unflatten(list(params)))
      leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
      self._slots.write_slots("state", self.generation, i, leaves)

  def commit(self) -> None:
    """Flushes the generation and makes it the committed step's, atomically.

    Raises:
      InvalidOptionError: a layer's param was not written (nothing committed).
    """
    want = self._slots.n_layers * len(self._slots.records)
    if len(self._written) != want:
      missing = sorted(
        (i, k) for i in range(self._slots.n_layers) for k in range(len(self._slots.records))
        if (i, k) not in self._written
      )  # fmt: skip
      raise errors.InvalidOptionError(
        f"LayerStore.rewrite: {len(missing)} of {want} param slots were not written (layer, "
        f"leaf: {missing[:4]}); nothing was committed, {self._commits.path} holds its step as "
        "it was."
      )
    if self._commits.fsync:
      self._slots.sync(self.generation)
    self._commits.replace(self.generation, None)
    self._on_commit()  # layers read ahead are of the generation replaced
