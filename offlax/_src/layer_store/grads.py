"""The gradients' hand-off (`GradientWriter`): copied out of the backward pass, written behind.

The backward pass hands each layer's gradients to the store by a callback
(`LayerStore.put_grads`); they are copied into aligned slots and written by
one writer thread while compute goes on, at most ``pool_layers`` layers
queued. With ``accumulate`` each is added into the store's. `flush` waits for
the steps dispatched so far and their writes: `update` and the read helpers
call it first.

With ``norm`` (a global-norm clip), as it writes a gradient slot the writer
notes its sum of squares (`squares`:
float32, per layer per leaf, of what the slot holds, in the layers' dtype), so a
global-norm clip knows the norm at `update` without reading the gradients again.

A store with an ``accumulator_dtype`` (float32 slots for bf16 layers) holds the
gradients in it: each is cast to it as it is copied out (exactly, to a wider
float), sums and means run in it, and the update casts them back to the layers'
dtype, as `optax.MultiSteps` casts its accumulator for the optimizer
(`seen`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from offlax._src import errors
from offlax._src.layer_store import clip as clip_lib
from offlax._src.layer_store import files, guards, micro
from offlax._src.layer_store.slots import Slots
from offlax._src.nvme.pipeline import wait_for_dispatched_steps

SPENT = "spent"  # grads/spent: the accumulated sum was written over (`GradientWriter.spend`)


class GradientWriter:
  """The gradients of the layers, written behind compute into a store's slots.

  Args:
    slots: the store's open files.
    queued: the most layers' gradients queued in RAM.
    step: the store's committed step (for the ledger's warning).
    watch: warn where unused gradients are overwritten (`guards.GradientsLedger`).
    norm: note each slot's sum of squares (`squares`), for a global-norm clip.

  Attributes:
    queued: the most layers' gradients queued in RAM.
  """

  def __init__(
    self, slots: Slots, queued: int, step: Callable[[], int], watch: bool, norm: bool = False
  ):
    self._slots, self.queued, self._step, self._norm = slots, queued, step, norm
    self._ledger = guards.GradientsLedger(slots.path, watch=watch)
    self._writer = concurrent.futures.ThreadPoolExecutor(1, "offlax-grads")
    self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
    # The writes `keep` queued (the worker of update="backward"'s), waited for by it alone:
    # `flush`, from the training loop's thread, never takes (or raises) the worker's.
    self._kept: collections.deque[concurrent.futures.Future] = collections.deque()
    self._lock = threading.Lock()  # `_drain`'s pops, from two threads
    # NaN: the slot's sum of squares is unknown (a store just opened): `squares` reads it
    self._squares = np.full((slots.n_layers, len(slots.records)), np.nan, np.float32)
    # A dropped step wrote its kept gradients (sum and last micro-step) over the sum: `spend`.
    # Marked on disk too, so a store closed and opened again still refuses the sum.
    self._spent_mark = os.path.join(slots.path, "grads", SPENT)
    self._spent = os.path.exists(self._spent_mark)

  def put(self, mode: micro.Micro, i: Any, *grads: np.ndarray) -> np.ndarray:
    """Layer `i`'s gradients (a callback): copied out, written behind compute."""
    i = int(i)
    # warns where unused ones are overwritten
    self._ledger.written(i, mode.accumulate, self._step())
    records = self._slots.grad_records
    slots = [files.to_slot(g, r["slot"], r["dtype"]) for g, r in zip(grads, records, strict=True)]
    self._drain(self._pending, self.queued - 1)  # bounds the RAM queued; raises a failed write
    self._pending.append(self._writer.submit(self._store, mode, i, slots))
    return np.zeros((), np.float32)

  def flush(self) -> None:
    """Waits for the steps dispatched so far and their gradient writes; raises a failed write."""
    wait_for_dispatched_steps()  # a jitted backward pass returns before its callbacks run
    self.wait_writes()

  def wait_writes(self) -> None:
    """Waits for the gradient writes queued (not for the steps: from a callback too)."""
    self._drain(self._pending, 0)

  def used(self) -> None:
    """The gradients were used by an `update`: a backward pass may overwrite them."""
    self._ledger.used()

  def zero(self) -> None:
    """Sets every gradient to zero (before accumulating anew); the sum is no longer spent."""
    self.flush()
    # A dropped step's kept writes land first, not after the zeros. Their errors can go: every
    # slot is written again here, and such a step was said when it was dropped.
    self.settle_kept()
    self._spent = False
    if os.path.exists(self._spent_mark):
      os.remove(self._spent_mark)
    self._ledger.used()
    self._slots.zero_grads()
    self._squares[...] = 0

  def keep(self, i: int, k: int, grad: np.ndarray) -> None:
    """Writes leaf `k` of layer `i`'s gradient behind (the update in the backward pass keeps
    what a clip's redo reads), at most ``queued`` leaves queued; its squares noted."""
    record = self._slots.grad_records[k]
    slot = files.to_slot(grad, record["slot"], record["dtype"])
    self._drain(self._kept, self.queued - 1)
    self._kept.append(self._writer.submit(self._write, k, i, slot, grad))

  def settle_kept(self) -> BaseException | None:
    """Waits for the writes `keep` queued; returns the first failed one's error, or None (the
    caller, dropping a step, says it: the slot's squares are unknown, read again if needed)."""
    with self._lock:
      kept = list(self._kept)
      self._kept.clear()
    concurrent.futures.wait(kept)
    return next((e for e in (f.exception() for f in kept) if e is not None), None)

  def spend(self) -> None:
    """A step was dropped after writing kept gradients over an accumulated sum: until `zero`,
    micro-steps are refused (`check_sum`), here and after the store is opened again."""
    self._spent = True
    with open(self._spent_mark, "w") as f:
      f.write("The accumulated sum was written over by a dropped step: call zero_grads().\n")

  def check_sum(self, path: str) -> None:
    """Raises `IncompleteStepError` where the accumulated sum on disk was spent (`spend`)."""
    if self._spent:
      raise errors.IncompleteStepError(
        f"LayerStore {path}: a gradient accumulation's step was dropped after its last "
        "micro-step had written its gradients (the sum and its own, kept for the global-norm "
        "clip's redo) over the accumulated ones on disk: the sum is gone, and running the last "
        "micro-step again would count it twice. Call store.zero_grads() and run the step's "
        "micro-steps again, from the first."
      )

  def squares(self) -> np.ndarray:
    """The sum of squares of each gradient slot, float32 [layer, leaf], as the slots hold
    them now (the writes waited for; a slot not written since the store was opened: read)."""
    self.wait_writes()
    self._drain(self._kept, 0)
    for i, k in zip(*np.nonzero(np.isnan(self._squares)), strict=True):
      self._squares[i, k] = clip_lib.sum_squares(
        self.seen(k, self._slots.read_slot("grads", 0, k, i))
      )
    return self._squares.copy()

  def kept_squares(self) -> np.ndarray:
    """The sums of squares of the gradients `keep` wrote (float32 [layer, leaf]), its writes
    waited for, not taken: the worker takes them (and their errors). `StoreError` where one
    failed (its squares unknown): the worker's step fails too, said at `update()`."""
    with self._lock:
      kept = list(self._kept)
    concurrent.futures.wait(kept)
    squares = self._squares.copy()
    if np.isnan(squares).any():
      raise errors.StoreError(
        errno.EIO,
        f"LayerStore {self._slots.path}: a gradient kept for the global-norm clip was not "
        "written, so the whole model's norm is not known; store.update() says which.",
      )
    return squares

  def close(self) -> None:
    """Waits for the writes queued."""
    self._writer.shutdown(wait=True)

  def _drain(self, queue: collections.deque, most: int) -> None:
    """Waits until at most `most` writes of `queue` are in flight; raises a failed write."""
    while True:
      with self._lock:
        if len(queue) <= most:
          return
        done = queue.popleft()
      done.result()

  def _store(self, mode: micro.Micro, i: int, slots: list[np.ndarray]) -> None:
    for k, slot in enumerate(slots):
      r = self._slots.grad_records[k]
      count = int(np.prod(r["shape"], dtype=np.int64)) * np.dtype(r["dtype"]).itemsize
      new = slot[:count].view(np.dtype(r["dtype"]))
      if mode.accumulate:  # (a trainer's micro-step: its mean, or sum)
        old = lambda: self._slots.read_slot("grads", 0, k, i).reshape(-1)  # noqa: B023
        new[...] = micro.combine(mode, old, new)
      self._write(k, i, slot, new)

  def _write(self, k: int, i: int, slot: np.ndarray, values: np.ndarray) -> None:
    self._squares[i, k] = np.nan  # unknown until written: a failed write leaves it unknown
    self._slots.write_raw("grads", 0, k, i, slot)
    if self._norm:  # for a global-norm clip only: a pass over the gradient
      self._squares[i, k] = clip_lib.sum_squares(self.seen(k, values))

  def seen(self, k: int, grad: np.ndarray) -> np.ndarray:
    """Leaf `k`'s gradient `grad` (a slot's) as the optimizer sees it: in the layers' dtype."""
    return grad.astype(np.dtype(self._slots.records[k]["dtype"]), copy=False)
