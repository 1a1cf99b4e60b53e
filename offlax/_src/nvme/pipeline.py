"""The Python side of a step's callbacks (`Reader`): reads ahead, writes behind, the commit."""

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
from offlax._src.nvme.slice_buffers import SliceBuffers
from offlax._src.nvme.store import Store


class ReadAhead:
  """Slices read before the step asks for them: up to `depth` after the one being read.

  Each slice is read once a step: keyed by step, since XLA may run the callbacks
  of one step out of order, and a prefetch of a slice already read must not be
  consumed by the next step.
  """

  def __init__(self, store: Store, buffers: SliceBuffers, depth: int):
    self.store, self.buffers, self.depth = store, buffers, depth
    self._nonempty = [k for k, r in enumerate(buffers.reads) if r]
    self._futures: dict[tuple[int, int], tuple[Any, np.ndarray]] = {}
    # Slices of this step already handed to XLA: when XLA runs slice k+1's read
    # before slice k's, k's prefetch of k+1 must not read it a second time.
    self._consumed: set[tuple[int, int]] = set()
    self._lock = threading.Lock()  # XLA may run callbacks on several threads

  @property
  def first(self) -> int:
    """The first slice that reads from the store: its read checks the state's step."""
    return self._nonempty[0]

  def issue(self, k: int, prefetch: bool = True) -> None:
    """Starts reading slice k into a pooled buffer, unless it is read (or, if `prefetch`, was)."""
    with self._lock:
      key = (self.store.step, k)
      if key in self._futures or (prefetch and key in self._consumed):
        return
      views, buffer = self.buffers.views(k)
      outs = [
        (self.store.read(index, a, b, out=out), shape)
        for (index, a, b, shape), out in zip(self.buffers.reads[k], views, strict=True)
      ]
      self._futures[key] = (outs, buffer)

  def take(self, k: int) -> tuple[list[tuple[Any, tuple[int, ...]]], np.ndarray]:
    """Slice k's reads (future, shape) and its buffer; starts reading the `depth` after it."""
    with self._lock:
      outs, buffer = self._futures.pop((self.store.step, k))
      self._consumed.add((self.store.step, k))
    position = self._nonempty.index(k)
    for nxt in self._nonempty[position + 1 : position + 1 + self.depth]:
      self.issue(nxt)  # overlaps the update of slice k
    return outs, buffer

  def forget(self) -> None:
    """Drops the reads started (a step committed, or refused)."""
    with self._lock:
      self._futures.clear()
      self._consumed.clear()


class WriteBehind:
  """Slices' writes on the store's I/O threads; the writes of a failed step, waited for.

  Writes run behind the step: at most `depth` slices of them in flight before a
  write callback waits. A failed callback ends its step's epoch (`fail`): writes
  of an earlier epoch target the generation the next step writes, so it waits
  for them (`settle`).
  """

  def __init__(self, store: Store, buffers: SliceBuffers, depth: int):
    self.store, self.buffers, self.depth = store, buffers, depth
    self._writes: list[tuple[int, concurrent.futures.Future]] = []  # (epoch, write), oldest first
    self._epoch = 0
    self._lock = threading.Lock()  # XLA may run callbacks on several threads

  def fail(self) -> None:
    """Ends the epoch of a step whose callback failed."""
    with self._lock:
      self._epoch += 1

  def settle(self) -> None:
    """Waits for the writes of failed steps (their errors were those steps')."""
    with self._lock:
      old = [f for e, f in self._writes if e < self._epoch]
      self._writes = [(e, f) for e, f in self._writes if e == self._epoch]
    concurrent.futures.wait(old)

  def submit(self, writes, buffer: np.ndarray) -> concurrent.futures.Future | None:
    """Starts `writes` (item, first, values) from `buffer`; returns the oldest write to wait
    for, if more than `depth` are in flight."""
    future = self.store.submit(self._write, writes, buffer)
    with self._lock:
      self._writes.append((self._epoch, future))
      return self._writes.pop(0)[1] if len(self._writes) > self.depth else None

  def _write(self, writes, buffer: np.ndarray) -> None:
    try:
      for index, a, view in writes:
        self.store.write(index, a, view)
    finally:
      self.buffers.release(buffer)

  def take_all(self) -> list[concurrent.futures.Future]:
    """The writes in flight, handed to the caller (the commit waits for them)."""
    with self._lock:
      writes, self._writes = self._writes, []
    return [w for _, w in writes]


class Reader:
  """The Python side of one traced step's callbacks; reused by every call.

  Slice k is read into one buffer (`SliceBuffers`), ahead of its callback
  (`ReadAhead`). The new values of slice k go into the same buffer, once XLA
  has copied it out (they depend on it): `write` copies them, or the native copy
  has before `submit`. Either leaves the writes to the I/O threads
  (`WriteBehind`), so no XLA thread waits on the disk; the buffer returns to the
  pool when they are done, and the commit waits for all of them.
  """

  def __init__(self, store: Store, reads, readahead: int):
    self.store = store
    self.buffers = SliceBuffers(store.records, reads, readahead)
    self.ahead = ReadAhead(store, self.buffers, readahead)
    self.behind = WriteBehind(store, self.buffers, readahead)

  @property
  def reads(self):
    """Per slice, its items' reads: (item, first, end, shape)."""
    return self.buffers.reads

  @property
  def offsets(self) -> list[np.ndarray]:
    """Per slice, where its items lie in its buffer (bytes)."""
    return self.buffers.offsets

  def _check(self, step) -> None:
    if not self.store.locked:  # no store behind the records (`tier_init.abstract_store`)
      self.ahead.forget()
      raise errors.StoreError(
        f"{self.store.path}: the step reads a store that is not open: its state came from "
        "an init of abstract params (jax.ShapeDtypeStructs, or under jax.eval_shape), which "
        "writes no store and is for a compile only, or the tier was closed. Init the tier "
        "with the params' arrays to train."
      )
    if int(step) != self.store.step:
      self.ahead.forget()
      raise errors.StaleStateError(_stale(self.store, int(step)))

  @contextlib.contextmanager
  def _failing_bumps_epoch(self):
    """Around each callback: a failure ends its step's epoch; Ctrl-C waits for the step.

    A Ctrl-C meanwhile is raised once the step's call has returned (`interrupts`).
    """
    try:
      with interrupts.deferred():
        yield
    except BaseException:
      self.behind.fail()
      raise

  # `k`, the slice, is a callback operand (traced inside a `DiskIO.loop`): an array here.

  def read(self, k, step, after) -> list[np.ndarray]:
    with self._failing_bumps_epoch():
      return self._read(int(k), step)

  def locate(self, k, step, after) -> np.ndarray:
    """Reads slice k like `read`, but returns where it lies: its buffer's address and size.

    The native copy (`step_io._read_slice`) takes the values from there. The
    buffer stays in use until `submit(k)` has written the slice back.
    """
    k = int(k)
    with self._failing_bumps_epoch():
      self._read(k, step)
      buffer = self.buffers.held(k)
    words = [buffer.ctypes.data, buffer.nbytes]
    return np.array([w >> s & 0xFFFFFFFF for w in words for s in (0, 32)], np.uint32)

  def _read(self, k: int, step) -> list[np.ndarray]:
    self.store.telemetry.begin()
    self.behind.settle()
    if k == self.ahead.first:
      self._check(step)
    self.ahead.issue(k, prefetch=False)  # a retried step reads it again
    outs, buffer = self.ahead.take(k)
    self.buffers.hold(k, buffer)
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

  def write(self, k, *values) -> np.ndarray:
    with self._failing_bumps_epoch():
      return self._write_slice(int(k), values)

  def submit(self, k, copied) -> np.ndarray:
    """Writes slice k back from its buffer, where the native copy put the new values.

    `copied` is that copy's ticket: XLA runs this only after it.
    """
    with self._failing_bumps_epoch():
      return self._write_slice(int(k), None)

  def _write_slice(self, k: int, values) -> np.ndarray:
    self.behind.settle()
    buffer = self.buffers.unhold(k)
    views, _ = self.buffers.views(k, buffer)
    if values is not None:  # else the native copy has filled the buffer
      for view, v in zip(views, values, strict=True):
        np.copyto(view, np.asarray(v).reshape(-1))  # XLA owns `v` only during this call
    writes = [(index, a, view) for (index, a, _, _), view in zip(self.reads[k], views, strict=True)]
    oldest = self.behind.submit(writes, buffer)
    if oldest is not None:
      with self._waiting():
        oldest.result()  # bounds the buffers in flight; raises the write's error
    return np.asarray(k, np.int32)

  def commit(self, hot: list[int], n_tickets: int, step, *args) -> None:
    with self._failing_bumps_epoch():
      self._commit(hot, n_tickets, step, *args)

  def _commit(self, hot: list[int], n_tickets: int, step, *args) -> None:
    telemetry = self.store.telemetry
    telemetry.begin()
    self.behind.settle()
    writes = self.behind.take_all()
    with self._waiting():
      for w in writes:
        w.result()
      self._check(step)
      for j, v in zip(hot, args[n_tickets:], strict=True):
        self.store.write(j, 0, v)
      self.store.commit(int(step) + 1)
    nbytes = [r.nbytes for r in self.store.records]
    hit = sum(nbytes[j] for j in hot)
    telemetry.end(int(step) + 1, hit, sum(nbytes) - hit)
    self.ahead.forget()
    self.buffers.drop_held()


def _stale(store: Store, step: int) -> str:
  """The message for a state of `step`, not the store's committed step."""
  kept = sorted(s for s, _ in store.kept)
  if step > store.step:
    return _missing(store, step, kept)
  return (
    f"this state is from step {step}, but {store.path} has committed step "
    f"{store.step}: an NVMe-tier state can be updated once; use the state the "
    "last update returned. If that update's result was lost (an interrupt or an error "
    "after its commit), go back to the step of your params: tier.close(), then "
    f"NVMeTier(path, resume=True, step=<your params' step>) (it keeps steps {kept}) "
    "and init again; or continue from the committed step with the params of that step."
  )


def _missing(store: Store, step: int, kept: list[int]) -> str:
  """The message for a state ahead of its store: the store never held its arrays."""
  fresh = " (a new store)" if kept == [0] else ""
  return (
    f"this state is from step {step}, but the store at {store.path}{fresh} has "
    f"committed only step {store.step} (it keeps steps {kept}): the arrays of step "
    f"{step} are not in this store. The state was most likely restored from a checkpoint "
    "that does not hold the store (a save of the state's small leaves alone, e.g. "
    "nnx.state(optimizer) filtered to leave its OnDiskVariables out) beside a store that "
    "is not the one it was trained with. "
    "Open that store (NVMeTier(its path, resume=True)), or restore a checkpoint saved "
    "with offlax.checkpoint.NVMeStoreSave(tier) (offlax.checkpoint.NVMeStoreRestore(path), then "
    "NVMeTier(path, resume=True)); a checkpoint without the store cannot bring the "
    "optimizer's arrays back."
  )


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

  def read(self, k, shard, step, after) -> list[np.ndarray]:
    return self._of(shard).read(k, step, after)

  def write(self, k, shard, *values) -> np.ndarray:
    return self._of(shard).write(k, *values)

  def locate(self, k, shard, step, after) -> np.ndarray:
    return self._of(shard).locate(k, step, after)

  def submit(self, k, shard, copied) -> np.ndarray:
    return self._of(shard).submit(k, copied)

  def commit(self, hot: list[int], n_tickets: int, shard, step, *args) -> None:
    self._of(shard).commit(hot, n_tickets, step, *args)
