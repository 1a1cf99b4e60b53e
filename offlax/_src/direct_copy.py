"""File copies at disk speed: direct I/O through two bounded buffers, reads overlapping writes.

A copy through the page cache (`sendfile`, `shutil.copyfile`) makes the kernel
fill fresh cache pages for every byte read and written, then write them back;
on a machine whose free memory is cold (a VM whose host reclaims it) that runs
at a fraction of the disk's speed, and it evicts the page cache of the training
job. Direct I/O moves the bytes between the disk and two aligned buffers of this
process (`BLOCK_BYTES` each, whatever the file's size): one is read into while
the other is written out, so a copy takes about as long as the slower of
reading and writing the file, not their sum.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
from collections.abc import Sequence

BLOCK_BYTES = 8 << 20  # a multiple of every logical block size (512, 4096)
# Below this a file is copied through the page cache: direct I/O gains nothing there.
DIRECT_MIN_BYTES = 1 << 20
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
  bar = None
  if progress:
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(sizes), desc=desc, unit="B", unit_scale=True, leave=False)
  try:
    with concurrent.futures.ThreadPoolExecutor(THREADS, "offlax-copy") as pool:
      futures = {
        pool.submit(copy_file, s, d, mode): n for (s, d), n in zip(pairs, sizes, strict=True)
      }
      for future in concurrent.futures.as_completed(futures):
        future.result()
        if bar is not None:
          bar.update(futures[future])
  finally:
    if bar is not None:
      bar.close()


def copy_file(src: str, dst: str, mode: int = 0o600) -> None:
  """Copies `src` into `dst`, a new file (refuses an existing one or a link) with `mode`.

  Direct I/O where the filesystem has it and the file has `DIRECT_MIN_BYTES`
  or more; else `sendfile`. Raises `OSError` on a failed or short transfer.
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
            try:
              _direct(rfd, wfd, src, size)
              return
            finally:
              os.close(wfd)
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


def _direct(rfd: int, wfd: int, src: str, size: int) -> None:
  """Reads block k+1 in this thread while a writer thread writes block k (direct I/O both ways).

  The last block is written padded to the alignment and the file cut back to `size`.
  """
  bufs = [mmap.mmap(-1, BLOCK_BYTES) for _ in range(2)]  # page-aligned, as O_DIRECT needs
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
        n = lengths[i]
        padded = -(-n // _ALIGN) * _ALIGN
        view = memoryview(bufs[i])[:padded]
        done = 0
        while done < padded:
          w = os.pwrite(wfd, view[done:], k * BLOCK_BYTES + done)
          if w <= 0:
            raise OSError(f"short write copying {src} at {k * BLOCK_BYTES + done}")
          done += w
        view.release()
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
      got = 0
      while got < want:
        view = memoryview(bufs[i])[got:]
        n = os.preadv(rfd, [view], k * BLOCK_BYTES + got)
        view.release()
        if n == 0:
          raise OSError(f"{src} ended after {k * BLOCK_BYTES + got} of {size} bytes")
        got += n
        if got % _ALIGN:  # only the file's end reads short of the alignment
          break
      if got < want:
        raise OSError(f"{src} ended after {k * BLOCK_BYTES + got} of {size} bytes")
      lengths[i] = want
      filled[i].release()
  except BaseException as e:
    failure.append(e)
    for s in filled:
      s.release()
    raise
  finally:
    writer.join()
    for b in bufs:
      b.close()
  if failure:
    raise failure[0]
  if size % _ALIGN:
    os.ftruncate(wfd, size)
