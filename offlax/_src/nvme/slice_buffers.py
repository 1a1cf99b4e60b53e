"""A step's slice buffers (`SliceBuffers`): where each slice's items lie, and a pool of buffers."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from offlax._src.nvme.direct_io import BLOCK, aligned_empty
from offlax._src.nvme.format import LeafRecord


class SliceBuffers:
  """Slice k's items laid out in one buffer; the buffers free, or holding a slice.

  A slice's buffer comes from a small pool, so the step does not touch fresh
  memory (first touches cost more than the copies into it). It is held while
  XLA has the slice (`hold` to `unhold`), and goes back to the pool once the
  slice's writes are done (`release`). Thread-safe: XLA may run callbacks on
  several threads.

  Args:
    records: the store's records (each item's dtype).
    reads: per slice, its items' reads: (item, first, end, shape).
    readahead: slices read ahead; the pool keeps about twice as many buffers.

  Example:
    >>> from offlax._src.nvme.format import LeafRecord
    >>> from offlax._src.nvme.slice_buffers import SliceBuffers
    >>> r = LeafRecord(0, "['w']", (8,), "float32", 8, False)
    >>> buffers = SliceBuffers([r], [[(0, 0, 2, (2,)), (0, 2, 8, (6,))]], readahead=1)
    >>> buffers.offsets[0].tolist()  # block-aligned, so whole chunks move with direct I/O
    [0, 4096]
    >>> views, buffer = buffers.views(0)
    >>> [v.shape for v in views], buffer.nbytes
    ([(2,), (6,)], 8192)
  """

  def __init__(self, records: Sequence[LeafRecord], reads, readahead: int):
    self.reads = reads
    self._dtypes = [np.dtype(r.dtype) for r in records]
    # Where slice k's items lie in its buffer (bytes); block-aligned, so whole
    # chunks move with direct I/O.
    self.offsets: list[np.ndarray] = []
    self._nbytes: list[int] = []
    for slice_reads in reads:
      offsets, total = [], 0
      for index, a, b, _ in slice_reads:
        offsets.append(total)
        total += -(-(b - a) * self._dtypes[index].itemsize // BLOCK) * BLOCK
      self.offsets.append(np.array(offsets, np.int64))
      self._nbytes.append(total)
    self._keep = 2 * readahead + 2  # buffers kept free; more only for an odd schedule
    self._free: list[np.ndarray] = []
    self._held: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()

  def views(self, k: int, buffer: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Slice k's items as views of one buffer (a pooled one unless given), and the buffer."""
    if buffer is None:
      buffer = self._take(self._nbytes[k])
    views = []
    for (index, a, b, _), offset in zip(self.reads[k], self.offsets[k], strict=True):
      dtype = self._dtypes[index]
      views.append(buffer[offset : offset + (b - a) * dtype.itemsize].view(dtype))
    return views, buffer

  def _take(self, nbytes: int) -> np.ndarray:
    with self._lock:
      for i, b in enumerate(self._free):
        if b.nbytes >= nbytes:
          return self._free.pop(i)
    return aligned_empty(nbytes)

  def hold(self, k: int, buffer: np.ndarray) -> None:
    """Records `buffer` as slice k's while XLA has the slice."""
    with self._lock:
      self._held[k] = buffer

  def held(self, k: int) -> np.ndarray:
    """Slice k's buffer, still held."""
    with self._lock:
      return self._held[k]

  def unhold(self, k: int) -> np.ndarray:
    """Slice k's buffer, no longer held: its writes are about to start."""
    with self._lock:
      return self._held.pop(k)

  def release(self, buffer: np.ndarray) -> None:
    """Returns `buffer` to the pool: the writes from it are done."""
    with self._lock:
      self._free.append(buffer)
      del self._free[: -self._keep]

  def drop_held(self) -> None:
    """Forgets the buffers held (a step committed: none of its slices is in flight)."""
    with self._lock:
      self._held.clear()
