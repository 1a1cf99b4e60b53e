"""Chunk file I/O below the store: direct I/O (O_DIRECT) with aligned buffers, crc32c, flushes."""

from __future__ import annotations

import fcntl
import functools
import os
import threading
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np


def chunk_crc(data: np.ndarray, zeros: int) -> int:
  """crc32c of `data` followed by `zeros` zero bytes (the GIL is released)."""
  crc = crc32c.crc32c(data.data)
  while zeros:
    n = min(zeros, _ZERO_BLOCK)
    crc = crc32c.crc32c(_zeros(n), value=crc)
    zeros -= n
  return crc


_ZERO_BLOCK = 1 << 20


@functools.cache
def _zero_block() -> np.ndarray:
  block = aligned_empty(_ZERO_BLOCK)  # aligned: direct I/O writes padding from it
  block[:] = 0
  return block


def _zeros(n: int) -> memoryview:
  """`n` <= `_ZERO_BLOCK` zero bytes, without allocating."""
  return _zero_block().data[:n]


def zero_parts(n: int) -> list[memoryview]:
  """`n` zero bytes as blocks of at most `_ZERO_BLOCK`."""
  return [_zeros(min(_ZERO_BLOCK, n - i)) for i in range(0, n, _ZERO_BLOCK)]


BLOCK = 4096  # direct I/O alignment (offsets, sizes and addresses)


O_DIRECT = getattr(os, "O_DIRECT", 0)


def supports_direct(path: str) -> bool:
  """Whether files under `path` can be opened with O_DIRECT."""
  if not O_DIRECT:
    return False
  probe = os.path.join(path, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
  try:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
  except OSError:
    return False
  os.close(fd)
  os.unlink(probe)
  return True


def clear_direct(fd: int) -> None:
  fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)


def set_direct(fd: int) -> bool:
  """Turns on direct I/O for `fd`; False where the platform or the filesystem has none.

  Set on an open file rather than passed to `open`: an `O_CREAT` open that the
  filesystem refuses for `O_DIRECT` (EINVAL) may already have made the file,
  and a fallback `O_EXCL` open of it would then fail.
  """
  if not O_DIRECT:
    return False
  try:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
  except OSError:  # EINVAL: this filesystem has no direct I/O
    return False
  return True


def open_direct(path: str, flags: int) -> tuple[int, bool]:
  """Opens `path` (mode 0o600 if created) with direct I/O where the filesystem has it.

  Returns:
    The descriptor, and whether it does direct I/O (else the page cache: the
    callers align their transfers either way).
  """
  fd = os.open(path, flags, 0o600)
  return fd, set_direct(fd)


def aligned_empty(nbytes: int) -> np.ndarray:
  """`nbytes` uninitialised bytes starting on a direct I/O block boundary."""
  raw = np.empty(nbytes + BLOCK, np.uint8)
  start = -raw.ctypes.data % BLOCK
  return raw[start : start + nbytes]


def pread_into(fd: int, data: np.ndarray, offset: int) -> None:
  view = data.data.cast("B")
  done = 0
  while done < len(view):
    n = os.preadv(fd, [view[done:]], offset + done)
    if n == 0:
      raise OSError(f"unexpected end of file after {done} of {len(view)} bytes")
    done += n


def pwrite_all(fd: int, parts: Sequence[Any], offset: int) -> None:
  """Writes `parts` back to back at `offset` (one pwritev, repeated if short)."""
  views = [memoryview(p).cast("B") for p in parts if len(p)]
  while views:
    n = os.pwritev(fd, views, offset)
    if n == 0:  # nothing written with bytes left: retrying would spin
      raise OSError(f"short write at {offset}")
    offset += n
    while views and n >= len(views[0]):
      n -= len(views.pop(0))
    if views:
      views[0] = views[0][n:]


def drop_cached(names) -> None:
  """Drops the page cache of files (clean pages only; dirty ones stay)."""
  for name in names:
    try:
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
      continue  # only a hint
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def syncfs(path: str) -> None:
  """Flushes the filesystem holding `path` (Linux syncfs), else everything."""
  fd = os.open(path, os.O_RDONLY)
  try:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
      raise OSError(ctypes.get_errno(), f"syncfs({path}) failed")
  except (AttributeError, TypeError):
    os.sync()
  finally:
    os.close(fd)


@functools.cache
def bound_malloc() -> None:
  """Makes glibc return freed slice-sized buffers to the OS.

  glibc raises its mmap threshold each time a large mmapped block is freed, up
  to 32 MiB, after which slice buffers (read results, write copies) come from
  the heap and stay resident when freed: RSS then grows with the state size
  instead of staying near `cache_bytes` plus a few slices. Fixing the
  threshold (as `MALLOC_MMAP_THRESHOLD_` would) keeps such buffers mmapped.
  """
  try:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
  except (OSError, AttributeError):  # not glibc: nothing to do
    pass
