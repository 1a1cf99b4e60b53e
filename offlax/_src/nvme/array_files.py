"""Arrays to and from raw files at disk speed: direct I/O, several ranges at once, crc32c.

A checkpoint written through the page cache pays for every page it dirties
(on a VM whose host reclaims free memory, a cold page costs far more than its
write), and one file written after another leaves the disk idle between them.
Here each file is cut into `RANGE_BYTES` ranges and `THREADS` ranges, of any
files, are in flight at once. Writes go by direct I/O through an aligned
buffer per thread (`BLOCK_BYTES`, the array copied into it a block at a time:
direct I/O needs aligned memory, and an array's is not); reads go by direct
I/O straight into the new array, which is allocated aligned. Each range has
its crc32c, checked on reading. The last block of a file is written padded
and the file cut back to its size. Where the filesystem has no direct I/O
(tmpfs), the same code runs through the page cache.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import crc32c
import numpy as np

from offlax._src import errors
from offlax._src.nvme.direct_io import aligned_empty, open_direct, pwrite_all

RANGE_BYTES = 64 << 20  # one thread's unit of work; a multiple of the alignment
BLOCK_BYTES = 8 << 20  # a write copies this much into its aligned buffer at a time
THREADS = 4
_ALIGN = 4096  # direct I/O alignment of offsets, lengths and addresses

# A file's bytes, asked for when its first range is written (see `write_files`).
Source = Callable[[], np.ndarray]


def _padded(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


def _ranges(size: int) -> range:
  return range(0, size, RANGE_BYTES)


class _Pending:
  """A file being written: opened and its source fetched at its first range, closed at its last."""

  def __init__(self, path: str, source: Source, size: int):
    self.path, self.source, self.size = path, source, size
    self.lock = threading.Lock()
    self.fd, self.direct, self.data = -1, False, memoryview(b"")
    self.left = len(_ranges(size))

  def open(self) -> memoryview:
    with self.lock:
      if self.fd < 0:
        array = np.ascontiguousarray(self.source())
        if array.nbytes != self.size:
          raise errors.StoreError(
            f"{self.path}: the array has {array.nbytes} bytes, expected {self.size}."
          )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        self.fd, self.direct = open_direct(self.path, flags)
        self.data = array.reshape(-1).view(np.uint8).data
      return self.data

  def done_range(self) -> None:
    with self.lock:
      self.left -= 1
      if self.left > 0:
        return
      self.data = memoryview(b"")  # a copy (on a GPU, from pinned host memory) is freed here
      if self.direct and self.size % _ALIGN:
        os.ftruncate(self.fd, self.size)
      os.fsync(self.fd)
      self.close()

  def close(self) -> None:
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1


def write_files(
  items: Sequence[tuple[str, Source, int]], *, progress: bool = False, desc: str = ""
) -> dict[str, list[int]]:
  """Writes each `(path, source, nbytes)` into a new file: `source()`'s bytes, in C order.

  A file is created and its `source` called when its first range is due, and
  the array is dropped after its last range: at most about `THREADS` arrays
  are held at once, which matters where getting one copies it (from a GPU's
  pinned host memory). Each file is flushed. Returns each path's crc32c per
  `RANGE_BYTES` range. Raises `StoreError` on a failed write (files may be
  left partly written: write into a directory that is discarded on failure,
  as orbax's temporary one is).
  """
  crcs: dict[str, list[int]] = {p: [0] * len(_ranges(n)) for p, _, n in items}
  files = [_Pending(path, source, nbytes) for path, source, nbytes in items]

  def write(f: _Pending, k: int, start: int) -> int:
    data, crc = f.open(), 0
    end = min(start + RANGE_BYTES, f.size)
    with _buffer() as buffer:
      for offset in range(start, end, BLOCK_BYTES):
        n = min(BLOCK_BYTES, end - offset)
        buffer[:n] = data[offset : offset + n]
        crc = crc32c.crc32c(buffer[:n].data, value=crc)
        length = n
        if f.direct and n % _ALIGN:  # only the file's last block
          length = _padded(n)
          buffer[n:length] = 0
        pwrite_all(f.fd, [buffer[:length]], offset)
    crcs[f.path][k] = crc
    f.done_range()
    return end - start

  try:
    for f in files:
      if not f.size:  # no range to write
        f.open()
        f.close()
    jobs = ((f, k, start) for f in files for k, start in enumerate(_ranges(f.size)))
    for _ in _run(jobs, write, sum(f.size for f in files), progress, desc):
      pass
  except errors.OffloadError:
    raise
  except OSError as e:
    raise errors.StoreError(f"cannot write the checkpoint: {e}") from e
  finally:
    for f in files:
      f.close()
  return crcs


# Aligned write buffers, kept from save to save: a fresh page costs a fault (and far
# more where a VM's host has reclaimed it); at most one per thread writing at once.
_free: list[np.ndarray] = []
_free_lock = threading.Lock()


@contextlib.contextmanager
def _buffer() -> Iterator[np.ndarray]:
  with _free_lock:
    buffer = _free.pop() if _free else None
  if buffer is None or len(buffer) != BLOCK_BYTES:  # BLOCK_BYTES changed (tests do)
    buffer = aligned_empty(BLOCK_BYTES)
  try:
    yield buffer
  finally:
    with _free_lock:
      _free.append(buffer)


def read_files(
  items: Sequence[tuple[str, tuple[int, ...], np.dtype, Sequence[int]]],
  *,
  progress: bool = False,
  desc: str = "",
) -> Iterator[tuple[int, np.ndarray]]:
  """Reads each `(path, shape, dtype, crcs)` into a new array; yields `(index, array)`.

  Each array is allocated aligned, when its first range is due, and read into
  directly; it is yielded as soon as all its ranges are in, so a caller can
  hand it on and drop it. Raises `StoreCorruptedError` where a file's size or
  a range's crc32c differs from what was saved, `StoreError` where a file
  cannot be read.
  """
  sizes = [int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d, _ in items]
  fds: dict[int, int] = {}
  arrays: dict[int, np.ndarray] = {}
  left = [len(_ranges(n)) for n in sizes]

  def jobs() -> Iterator[tuple[int, int, int]]:
    for i, (path, shape, dtype, saved) in enumerate(items):
      fd, direct = open_direct(path, os.O_RDONLY | os.O_NOFOLLOW)
      fds[i] = fd
      actual = os.fstat(fd).st_size
      if actual != sizes[i] or len(saved) != left[i]:
        raise errors.StoreCorruptedError(
          f"{path} holds {actual} bytes, expected {sizes[i]} "
          f"({np.dtype(dtype).name}{list(shape)}): the checkpoint is corrupted."
        )
      arrays[i] = aligned_empty(_padded(sizes[i]) if direct else sizes[i])
      yield from ((i, k, start) for k, start in enumerate(_ranges(sizes[i])))

  def read(i: int, k: int, start: int) -> int:
    path, raw, size = items[i][0], arrays[i], sizes[i]
    end = min(start + RANGE_BYTES, size)
    view = raw[start : min(start + RANGE_BYTES, len(raw))].data  # padded: direct I/O
    got = 0
    while got < end - start:
      n = os.preadv(fds[i], [view[got:]], start + got)
      if n == 0:
        raise errors.StoreCorruptedError(f"{path} ended after {start + got} of {size} bytes.")
      got += n
    if crc32c.crc32c(raw[start:end].data) != items[i][3][k]:
      raise errors.StoreCorruptedError(
        f"{path}: bytes {start}-{end} do not match their checksum: the checkpoint is "
        "corrupted; restore another step."
      )
    return end - start

  def whole(i: int) -> tuple[int, np.ndarray]:
    _, shape, dtype, _ = items[i]
    os.close(fds.pop(i))
    return i, arrays.pop(i)[: sizes[i]].view(dtype).reshape(shape)

  try:
    for i, _ in enumerate(items):  # empty arrays have no range to read
      if not left[i]:
        fds[i] = open_direct(items[i][0], os.O_RDONLY | os.O_NOFOLLOW)[0]
        arrays[i] = aligned_empty(0)
        yield whole(i)
    for i, _, _ in _run(jobs(), read, sum(sizes), progress, desc):
      left[i] -= 1
      if not left[i]:
        yield whole(i)  # the caller holds it now
  except errors.OffloadError:
    raise
  except OSError as e:
    raise errors.StoreError(f"cannot read the checkpoint: {e}") from e
  finally:
    for fd in fds.values():
      os.close(fd)


def _run(
  jobs: Iterator[tuple],
  fn: Callable[..., int],
  total: int,
  progress: bool,
  desc: str,
) -> Iterator[tuple]:
  """Runs `fn(*job)` on `THREADS` threads; yields each job as it completes.

  Jobs are taken from `jobs` as threads free up (at most two per thread wait),
  so whatever making a job allocates is allocated when it is due. `fn`
  returns the bytes it moved, for the bar. The first error is raised after
  the jobs already running have ended.
  """
  bar = byte_bar(total, desc) if progress else None
  try:
    with concurrent.futures.ThreadPoolExecutor(THREADS, "offlax-ckpt") as pool:
      running: dict[concurrent.futures.Future, tuple] = {}
      try:
        for job in jobs:
          running[pool.submit(fn, *job)] = job
          while len(running) >= 2 * THREADS:
            yield from _completed(running, bar)
        while running:
          yield from _completed(running, bar)
      finally:
        for future in running:
          future.cancel()
  finally:
    if bar is not None:
      bar.close()


# A bar shows once its work has run this long: work done sooner (a store of a few MB)
# prints nothing.
BAR_DELAY_S = 2.0


def byte_bar(total: int, desc: str) -> Any:
  """A progress bar in bytes (tqdm), as offlax's long I/O shows them; `close()` it.

  It appears only once the work has run `BAR_DELAY_S`.
  """
  from tqdm.auto import tqdm

  return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, delay=BAR_DELAY_S)


def _completed(running: dict, bar) -> Iterator[tuple]:
  finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
  for future in finished:
    job = running.pop(future)
    moved = future.result()
    if bar is not None:
      bar.update(moved)
    yield job
