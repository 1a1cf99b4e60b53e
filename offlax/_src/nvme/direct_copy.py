"""File copies at disk speed: several files at once, read by the kernel, written by direct I/O.

A copy of one file after another leaves the disk idle while each file is
opened, created and flushed: `copy_files` copies `THREADS` files at once.
Each copy reads through the page cache, so the kernel's read-ahead streams
the source, into an aligned buffer of its thread (`BLOCK_BYTES`, whatever the
file's size), and writes by direct I/O: the copy dirties no page cache. Why
this mix, measured on the development VM (ext4 on a virtio disk, 1.07 GB of
8 MiB chunk files, `benchmarks/checkpoint.py`): a copy through the page cache
both ways (`sendfile`) ran at 0.5-1.1x the raw disk depending on what ran
before it (each fresh page-cache page costs a fault, and far more once the
host has reclaimed the guest's free memory), direct I/O both ways at a steady
0.75-0.8x (the files' reads were slower than the raw disk's), this mix at
0.8-1.0x. Files under `SMALL_BYTES` (the arrays' metadata) go by `sendfile`.
A file's unaligned end is written through the page cache; the caller flushes
the filesystem afterwards (`copies.copy_store`).
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
from collections.abc import Sequence

from offlax._src.nvme import array_files
from offlax._src.nvme.direct_io import clear_direct, pwrite_all, set_direct

# One read and one write per block: a whole chunk file of the NVMe tier's
# default 16 MiB chunks but its unaligned last bytes. A multiple of every
# logical block size (512, 4096).
BLOCK_BYTES = 16 << 20
SMALL_BYTES = 1 << 20  # below this a file goes by `sendfile`
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

  At most `THREADS` copies run, each with one `BLOCK_BYTES` buffer: the memory
  a copy takes does not grow with the files. Raises the first error.
  """
  sizes = [os.stat(s).st_size for s, _ in pairs]
  bar = array_files.byte_bar(sum(sizes), desc) if progress else None
  # Each worker keeps its buffer from file to file: fresh pages cost a fault
  # each (and far more where the host has reclaimed them), once per copy here.
  local, made = threading.local(), []

  def copy(src: str, dst: str) -> None:
    if not hasattr(local, "buffer"):
      local.buffer = mmap.mmap(-1, BLOCK_BYTES)  # page-aligned, as direct I/O needs
      made.append(local.buffer)
    copy_file(src, dst, mode, local.buffer)

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
    for buffer in made:
      buffer.close()


def copy_file(src: str, dst: str, mode: int = 0o600, buffer: mmap.mmap | None = None) -> None:
  """Copies `src` into `dst`, a new file (refuses an existing one or a link) with `mode`.

  A file of `SMALL_BYTES` or more is read through `buffer` (an mmap of
  `BLOCK_BYTES`; None: one made for this copy) and written by direct I/O where
  the filesystem has it; else, and where direct I/O is refused, by `sendfile`.
  Raises `OSError` on a failed or short transfer.
  """
  rfd = os.open(src, os.O_RDONLY)
  try:
    size = os.fstat(rfd).st_size
    wfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
      if size < SMALL_BYTES or not set_direct(wfd):
        _sendfile(rfd, wfd, src, size)
      elif buffer is not None:
        _blocks(rfd, wfd, src, size, buffer)
      else:
        with mmap.mmap(-1, BLOCK_BYTES) as own:
          _blocks(rfd, wfd, src, size, own)
    finally:
      os.close(wfd)
  finally:
    os.close(rfd)


def _sendfile(rfd: int, wfd: int, src: str, size: int) -> None:
  offset = 0
  while offset < size:
    n = os.sendfile(wfd, rfd, offset, size - offset)
    if n == 0:
      raise OSError(f"{src} ended after {offset} of {size} bytes")
    offset += n


def _blocks(rfd: int, wfd: int, src: str, size: int, buffer: mmap.mmap) -> None:
  """Reads each block of `src` into `buffer`, writes it out by direct I/O; the unaligned end not."""
  view = memoryview(buffer)
  try:
    for offset in range(0, size, len(view)):
      n = min(len(view), size - offset)
      got = 0
      while got < n:
        read = os.preadv(rfd, [view[got:n]], offset + got)
        if read == 0:
          raise OSError(f"{src} ended after {offset + got} of {size} bytes")
        got += read
      aligned = n - n % _ALIGN
      pwrite_all(wfd, [view[:aligned]], offset)
      if aligned < n:  # the file's last bytes: direct I/O writes whole blocks only
        clear_direct(wfd)
        pwrite_all(wfd, [view[aligned:n]], offset + aligned)
  finally:
    view.release()
