"""File copies at disk speed: several files at once, large ones by direct I/O.

A copy of one file after another leaves the disk idle while each file is
opened, created and flushed: `copy_files` copies `THREADS` files at once.
Files of `DIRECT_MIN_BYTES` or more go by direct I/O between the disk and two
aligned buffers of the copying thread (`BLOCK_BYTES` each, whatever the
file's size): one is read into while the other is written out, so such a copy
takes about as long as the slower of reading and writing the file, not their
sum, and fills no page cache. Smaller files (an NVMe store's chunk files are a
few MiB) go by `sendfile`, in the kernel: measured here, direct I/O of one
block per file was slower than the kernel's read-ahead and write-back.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
from collections.abc import Sequence

from offlax._src.nvme import array_files

BLOCK_BYTES = 8 << 20  # a multiple of every logical block size (512, 4096)
# Below this a file is copied by `sendfile` (see the module docstring).
DIRECT_MIN_BYTES = 4 * BLOCK_BYTES
_ALIGN = 4096
THREADS = 4  # files copied at once: reads of some overlap writes of others


def tree_pairs(src: str, dst: str) -> list[tuple[str, str]]:
  """Makes `dst` and its subdirectories like `src`'s (owner-only); returns the files to copy."""
  pairs = []
  for root, _, files in os.walk(src):
    target = os.path.normpath(os.path.join(dst, os.path.relpath(root, src)))
    _mkdir_private(target)
    pairs += [(os.path.join(root, f), os.path.join(target, f)) for f in files]
  return pairs


def _mkdir_private(path: str) -> None:
  """Makes `path` and its missing parents, each owner-only (`os.makedirs` gives parents 0o777)."""
  parent = os.path.dirname(path)
  if parent and parent != path and not os.path.isdir(parent):
    _mkdir_private(parent)
  os.mkdir(path, 0o700)


def copy_files(
  pairs: Sequence[tuple[str, str]], *, progress: bool = False, desc: str = "", mode: int = 0o600
) -> None:
  """`copy_file` of each (source, destination) pair, `THREADS` at once, with a bar in bytes.

  At most `THREADS` copies run, each with its two `BLOCK_BYTES` buffers: the
  memory a copy takes does not grow with the files. Raises the first error.
  """
  sizes = [os.stat(s).st_size for s, _ in pairs]
  bar = array_files.byte_bar(sum(sizes), desc) if progress else None
  # Each worker keeps its buffers from file to file: fresh pages cost a fault
  # each (and far more where the host has reclaimed them), once per copy here.
  local, made = threading.local(), []

  def copy(src: str, dst: str) -> None:
    if not hasattr(local, "buffers"):
      local.buffers = _buffers()
      made.append(local.buffers)
    copy_file(src, dst, mode, local.buffers)

  try:
    with concurrent.futures.ThreadPoolExecutor(THREADS, "offlax-copy") as pool:
      futures = {pool.submit(copy, s, d): n for (s, d), n in zip(pairs, sizes, strict=True)}
      for future in concurrent.futures.as_completed(futures):
        future.result()
        if bar is not None:
          bar.update(futures[future])
  finally:
    if bar is not None:
      bar.close()
    for buffers in made:
      for b in buffers:
        b.close()


def _buffers() -> list[mmap.mmap]:
  return [mmap.mmap(-1, BLOCK_BYTES) for _ in range(2)]  # page-aligned, as O_DIRECT needs


def copy_file(
  src: str, dst: str, mode: int = 0o600, buffers: Sequence[mmap.mmap] | None = None
) -> None:
  """Copies `src` into `dst`, a new file (refuses an existing one or a link) with `mode`.

  Direct I/O where the filesystem has it and the file has `DIRECT_MIN_BYTES`
  or more, through `buffers` (two of `BLOCK_BYTES`; None: made for this copy);
  else `sendfile`. Raises `OSError` on a failed or short transfer.
  """
  flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
  with open(src, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size >= DIRECT_MIN_BYTES and hasattr(os, "O_DIRECT"):
      try:
        rfd = os.open(src, os.O_RDONLY | os.O_DIRECT)
      except OSError:  # no direct I/O here (tmpfs)
        rfd = -1
      if rfd >= 0:
        try:
          try:
            wfd = os.open(dst, flags | os.O_DIRECT, mode)
          except OSError:
            wfd = -1
          if wfd >= 0:
            own = buffers is None
            bufs = _buffers() if buffers is None else buffers
            try:
              _direct(rfd, wfd, src, size, bufs)
              return
            finally:
              os.close(wfd)
              if own:
                for b in bufs:
                  b.close()
        finally:
          os.close(rfd)
    fd = os.open(dst, flags, mode)
    try:
      _sendfile(f.fileno(), fd, src, size)
    finally:
      os.close(fd)


def _sendfile(rfd: int, wfd: int, src: str, size: int) -> None:
  offset = 0
  while offset < size:
    n = os.sendfile(wfd, rfd, offset, size - offset)
    if n == 0:
      raise OSError(f"{src} ended after {offset} of {size} bytes")
    offset += n


def _read_block(rfd: int, buf: mmap.mmap, offset: int, want: int, src: str, size: int) -> None:
  got = 0
  while got < want:
    view = memoryview(buf)[got:]
    n = os.preadv(rfd, [view], offset + got)
    view.release()
    if n == 0:
      break
    got += n
    if got % _ALIGN:  # only the file's end reads short of the alignment
      break
  if got < want:
    raise OSError(f"{src} ended after {offset + got} of {size} bytes")


def _write_block(wfd: int, buf: mmap.mmap, offset: int, n: int, src: str) -> None:
  padded = -(-n // _ALIGN) * _ALIGN
  view = memoryview(buf)[:padded]
  try:
    done = 0
    while done < padded:
      w = os.pwrite(wfd, view[done:], offset + done)
      if w <= 0:
        raise OSError(f"short write copying {src} at {offset + done}")
      done += w
  finally:
    view.release()


def _direct(rfd: int, wfd: int, src: str, size: int, bufs: Sequence[mmap.mmap]) -> None:
  """Reads block k+1 in this thread while a writer thread writes block k (direct I/O both ways).

  A file of one block is read, then written, in this thread. The last block is
  written padded to the alignment and the file cut back to `size`.
  """
  if size <= BLOCK_BYTES:
    _read_block(rfd, bufs[0], 0, size, src, size)
    _write_block(wfd, bufs[0], 0, size, src)
    if size % _ALIGN:
      os.ftruncate(wfd, size)
    return
  filled = [threading.Semaphore(0), threading.Semaphore(0)]  # buffer i holds a block
  free = [threading.Semaphore(1), threading.Semaphore(1)]  # buffer i may be read into
  lengths = [0, 0]
  failure: list[BaseException] = []
  blocks = -(-size // BLOCK_BYTES)

  def write() -> None:
    try:
      for k in range(blocks):
        i = k % 2
        filled[i].acquire()
        if failure:
          return
        _write_block(wfd, bufs[i], k * BLOCK_BYTES, lengths[i], src)
        free[i].release()
    except BaseException as e:  # handed to the reading thread, which raises it
      failure.append(e)
      for s in free:
        s.release()

  writer = threading.Thread(target=write, name="offlax-direct-copy", daemon=True)
  writer.start()
  try:
    for k in range(blocks):
      i = k % 2
      free[i].acquire()
      if failure:
        break
      want = min(BLOCK_BYTES, size - k * BLOCK_BYTES)
      _read_block(rfd, bufs[i], k * BLOCK_BYTES, want, src, size)
      lengths[i] = want
      filled[i].release()
  except BaseException as e:
    failure.append(e)
    for s in filled:
      s.release()
    raise
  finally:
    writer.join()
  if failure:
    raise failure[0]
  if size % _ALIGN:
    os.ftruncate(wfd, size)
