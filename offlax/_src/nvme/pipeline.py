"""The Python side of a step's callbacks: reads ahead, writes behind, the commit."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Any

import jax
import numpy as np

from offlax._src import errors
from offlax._src.nvme import interrupts
from offlax._src.nvme.direct_io import BLOCK, aligned_empty
from offlax._src.nvme.store import Store


class Reader:
  """The Python side of one traced step's callbacks; reused by every call.

  Slice k is read into one buffer (from a small pool, so the step does not
  touch fresh memory: first touches cost more than the copies here). The new
  values of slice k go into the same buffer, once XLA has copied it out (they
  depend on it): `write` copies them, or the native copy has before `submit`.
  Either leaves the writes to the I/O threads (at most `readahead` slices of
  writes in flight), so no XLA thread waits on the disk; the buffer returns
  to the pool when they are done, and the commit waits for all of them.
  """

  def __init__(self, store: Store, reads, readahead: int):
    self.store, self.reads, self.readahead = store, reads, readahead
    self._nonempty = [k for k, r in enumerate(reads) if r]
    self._futures: dict[tuple[int, int], tuple[Any, np.ndarray]] = {}
    # Slices of this step already handed to XLA: when XLA runs slice k+1's read
    # before slice k's, k's prefetch of k+1 must not read it a second time.
    self._consumed: set[tuple[int, int]] = set()
    self._buffers: list[np.ndarray] = []  # free slice buffers
    self._in_use: dict[int, np.ndarray] = {}
    self._writes: list[tuple[int, concurrent.futures.Future]] = []  # (epoch, write), oldest first
    # Bumped when a callback fails. Writes of an earlier epoch belong to a failed
    # step and target the generation the next step writes: it waits for them.
    self._epoch = 0
    self._lock = threading.Lock()  # XLA may run callbacks on several threads
    # Where slice k's items lie in its buffer (bytes); block-aligned, so whole
    # chunks move with direct I/O.
    self.offsets, self._nbytes = [], []
    for slice_reads in reads:
      offsets, total = [], 0
      for index, a, b, _ in slice_reads:
        offsets.append(total)
        total += -(-(b - a) * np.dtype(store.records[index].dtype).itemsize // BLOCK) * BLOCK
      self.offsets.append(np.array(offsets, np.int64))
      self._nbytes.append(total)

  def _buffer(self, nbytes: int) -> np.ndarray:
    for i, b in enumerate(self._buffers):
      if b.nbytes >= nbytes:
        return self._buffers.pop(i)
    return aligned_empty(nbytes)

  def _issue(self, k: int, prefetch: bool = True) -> None:
    # Keyed by step: XLA may run the callbacks of one step out of order, and a
    # prefetch of a slice already read must not be consumed by the next step.
    with self._lock:
      key = (self.store.step, k)
      if key in self._futures or (prefetch and key in self._consumed):
        return
      views, buffer = self._views(k)
      outs = [
        (self.store.read(index, a, b, out=out), shape)
        for (index, a, b, shape), out in zip(self.reads[k], views, strict=True)
      ]
      self._futures[self.store.step, k] = (outs, buffer)

  def _views(self, k: int, buffer: np.ndarray | None = None):
    """Slice k's items laid out in one buffer (a pooled one unless given)."""
    if buffer is None:
      buffer = self._buffer(self._nbytes[k])
    views = []
    for (index, a, b, _), offset in zip(self.reads[k], self.offsets[k], strict=True):
      dtype = np.dtype(self.store.records[index].dtype)
      views.append(buffer[offset : offset + (b - a) * dtype.itemsize].view(dtype))
    return views, buffer

  def _check(self, step) -> None:
    if int(step) != self.store.step:
      self._futures.clear()
      self._consumed.clear()
      kept = sorted(s for s, _ in self.store.kept)
      if int(step) > self.store.step:
        raise errors.StaleStateError(self._missing(int(step), kept))
      raise errors.StaleStateError(
        f"this state is from step {int(step)}, but {self.store.path} has committed step "
        f"{self.store.step}: an NVMe-tier state can be updated once; use the state the "
        "last update returned. If that update's result was lost (an interrupt or an error "
        "after its commit), go back to the step of your params: tier.close(), then "
        f"NVMeTier(path, resume=True, step=<your params' step>) (it keeps steps {kept}) "
        "and init again; or continue from the committed step with the params of that step."
      )

  def _missing(self, step: int, kept: list[int]) -> str:
    """The message for a state ahead of its store: the store never held its arrays."""
    fresh = " (a new store)" if kept == [0] else ""
    return (
      f"this state is from step {step}, but the store at {self.store.path}{fresh} has "
      f"committed only step {self.store.step} (it keeps steps {kept}): the arrays of step "
      f"{step} are not in this store. The state was most likely restored from a checkpoint "
      "that does not hold the store (a save of the state's small leaves alone, e.g. "
      "nnx.state(optimizer) filtered to leave its OnDiskVariables out) beside a store that "
      "is not the one it was trained with. "
      "Open that store (NVMeTier(its path, resume=True)), or restore a checkpoint saved "
      "with offlax.NVMeStoreSave(tier) (offlax.NVMeStoreRestore(path), then "
      "NVMeTier(path, resume=True)); a checkpoint without the store cannot bring the "
      "optimizer's arrays back."
    )

  def _settle(self) -> None:
    with self._lock:
      old = [f for e, f in self._writes if e < self._epoch]
      self._writes = [(e, f) for e, f in self._writes if e == self._epoch]
    concurrent.futures.wait(old)  # their errors were the failed step's

  @contextlib.contextmanager
  def _failing_bumps_epoch(self):
    """Around each callback: a failure ends its step's epoch; Ctrl-C waits for the step.

    A Ctrl-C meanwhile is raised once the step's call has returned (`interrupts`).
    """
    try:
      with interrupts.deferred():
        yield
    except BaseException:
      with self._lock:
        self._epoch += 1
      raise

  def read(self, k: int, step, after) -> list[np.ndarray]:
    with self._failing_bumps_epoch():
      return self._read(k, step)

  def locate(self, k: int, step, after) -> np.ndarray:
    """Reads slice k like `read`, but returns where it lies: its buffer's address and size.

    The native copy (`DiskIO._fetch`) takes the values from there. The buffer
    stays in use until `submit(k)` has written the slice back.
    """
    with self._failing_bumps_epoch():
      self._read(k, step)
      with self._lock:
        buffer = self._in_use[k]
    words = [buffer.ctypes.data, buffer.nbytes]
    return np.array([w >> s & 0xFFFFFFFF for w in words for s in (0, 32)], np.uint32)

  def _read(self, k: int, step) -> list[np.ndarray]:
    self.store.telemetry.begin()
    self._settle()
    if k == self._nonempty[0]:
      self._check(step)
    self._issue(k, prefetch=False)  # a retried step reads it again
    with self._lock:
      outs, buffer = self._futures.pop((self.store.step, k))
      self._consumed.add((self.store.step, k))
      self._in_use[k] = buffer
    position = self._nonempty.index(k)
    for nxt in self._nonempty[position + 1 : position + 1 + self.readahead]:
      self._issue(nxt)  # overlaps the update of slice k
    with self._waiting():
      return [self.store.result(f).reshape(shape) for f, shape in outs]

  @contextlib.contextmanager
  def _waiting(self):
    """Counts the time inside as waiting on the disk."""
    start = time.perf_counter()
    try:
      yield
    finally:
      self.store.telemetry.waited(time.perf_counter() - start)

  def write(self, k: int, *values) -> np.ndarray:
    with self._failing_bumps_epoch():
      return self._write_slice(k, values)

  def submit(self, k: int, copied) -> np.ndarray:
    """Writes slice k back from its buffer, where the native copy put the new values.

    `copied` is that copy's ticket: XLA runs this only after it.
    """
    with self._failing_bumps_epoch():
      return self._write_slice(k, None)

  def _write_slice(self, k: int, values) -> np.ndarray:
    self._settle()
    with self._lock:
      buffer = self._in_use.pop(k)
    views, _ = self._views(k, buffer)
    if values is not None:  # else the native copy has filled the buffer
      for view, v in zip(views, values, strict=True):
        np.copyto(view, np.asarray(v).reshape(-1))  # XLA owns `v` only during this call
    writes = [(index, a, view) for (index, a, _, _), view in zip(self.reads[k], views, strict=True)]
    future = self.store._submit(self._write, writes, buffer)
    with self._lock:
      self._writes.append((self._epoch, future))
      oldest = self._writes.pop(0)[1] if len(self._writes) > self.readahead else None
    if oldest is not None:
      with self._waiting():
        oldest.result()  # bounds the buffers in flight; raises the write's error
    return np.asarray(k, np.int32)

  def _write(self, writes, buffer: np.ndarray) -> None:
    try:
      for index, a, view in writes:
        self.store.write(index, a, view)
    finally:
      with self._lock:
        self._buffers.append(buffer)
        del self._buffers[: -2 * self.readahead - 2]  # more only for an odd schedule

  def commit(self, hot: list[int], n_tickets: int, step, *args) -> None:
    with self._failing_bumps_epoch():
      self._commit(hot, n_tickets, step, *args)

  def _commit(self, hot: list[int], n_tickets: int, step, *args) -> None:
    telemetry = self.store.telemetry
    telemetry.begin()
    self._settle()
    with self._lock:
      writes, self._writes = self._writes, []
    with self._waiting():
      for _, w in writes:
        w.result()
      self._check(step)
      for j, v in zip(hot, args[n_tickets:], strict=True):
        self.store.write(j, 0, v)
      self.store.commit(int(step) + 1)
    nbytes = [r.nbytes for r in self.store.records]
    hit = sum(nbytes[j] for j in hot)
    telemetry.end(int(step) + 1, hit, sum(nbytes) - hit)
    with self._lock:
      self._futures.clear()
      self._consumed.clear()
      self._in_use.clear()


def wait_for_dispatched_steps() -> None:
  """Waits until every step dispatched so far has run, its commit included.

  A step's commit is an unordered callback, which `jax.effects_barrier` does
  not wait for; a step dispatched but not yet started (a busy machine) would
  commit after a snapshot copied the store. Every live array is some
  program's output: once all are ready, every dispatched step has run.
  """
  for x in jax.live_arrays():
    try:
      x.block_until_ready()
    except RuntimeError:  # deleted since it was listed (donated by another thread)
      pass
  jax.effects_barrier()


class ByShard:
  """The callbacks of a step on a mesh: each goes to the `Reader` of its device's shard.

  The shard (a mesh position) comes first in each callback's arguments.
  """

  def __init__(self, readers: dict[int, Reader]):
    self.readers = readers
    first = next(iter(readers.values()))
    self.reads, self.offsets = first.reads, first.offsets  # the same plan for every shard

  def _of(self, shard) -> Reader:
    reader = self.readers.get(int(shard))
    if reader is None:  # the mesh puts a device of another process's stores here
      raise errors.StoreError(
        f"no store of mesh position {int(shard)} is open in process {jax.process_index()} "
        f"(it opened {sorted(self.readers)})."
      )
    return reader

  def read(self, k: int, shard, step, after) -> list[np.ndarray]:
    return self._of(shard).read(k, step, after)

  def write(self, k: int, shard, *values) -> np.ndarray:
    return self._of(shard).write(k, *values)

  def locate(self, k: int, shard, step, after) -> np.ndarray:
    return self._of(shard).locate(k, step, after)

  def submit(self, k: int, shard, copied) -> np.ndarray:
    return self._of(shard).submit(k, copied)

  def commit(self, hot: list[int], n_tickets: int, shard, step, *args) -> None:
    self._of(shard).commit(hot, n_tickets, step, *args)
