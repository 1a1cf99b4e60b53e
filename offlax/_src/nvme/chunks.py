"""A store's arrays on disk (`ChunkFiles`): zarr3 arrays made by tensorstore, whole chunk files
read and written with their crc32c, by direct I/O where the filesystem and the buffer allow."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from offlax._src import errors
from offlax._src.nvme.direct_io import (
  BLOCK,
  O_DIRECT,
  aligned_empty,
  chunk_crc,
  clear_direct,
  drop_cached,
  pread_into,
  pwrite_all,
  supports_direct,
  syncfs,
  zero_parts,
)
from offlax._src.nvme.format import LeafRecord


class ChunkFiles:
  """The arrays of the store at `path`: one zarr3 array per state item and generation.

  A step moves whole chunk files (`c/<i>`: the chunk's bytes, zero-padded to the
  chunk size, then their crc32c), never through tensorstore: each piece of the
  streaming schedule is exactly one chunk. `format.py` has the layout.

  Example:
    >>> import tempfile, numpy as np
    >>> from offlax._src import telemetry
    >>> from offlax._src.nvme.chunks import ChunkFiles
    >>> from offlax._src.nvme.format import LeafRecord
    >>> files = ChunkFiles(tempfile.mkdtemp(), telemetry.DiskTelemetry())
    >>> r = LeafRecord(0, "['w']", (6,), "float32", 4, False, None)
    >>> files.create_arrays([r], generations=1)
    >>> files.write(r, 0, 0, np.arange(6, dtype=np.float32))
    >>> files.read(r, 0, 1, 5, np.empty(4, np.float32))
    array([1., 2., 3., 4.], dtype=float32)
  """

  def __init__(self, path: str, telemetry: Any):
    self.path = path
    self.telemetry = telemetry  # counts the bytes moved
    self._context = ts.Context({"file_io_sync": False, "cache_pool": {"total_bytes_limit": 0}})
    # Direct I/O skips the page cache copy both ways and the kernel's writeback
    # (DeepSpeed's ZeRO-Infinity does the same); tmpfs and some others refuse it,
    # which the first chunk I/O finds out.
    self._direct_ok: bool | None = None
    self._made_dirs: set[str] = set()
    self._written: set[str] = set()  # chunk files written since the last `flush`

  def array_path(self, index: int, gen: int) -> str:
    """The folder of item `index`'s array in generation `gen`."""
    return os.path.join(self.path, f"gen{gen}", f"leaf_{index:05d}")

  def where(self, r: LeafRecord, gen: int, chunk: int | None = None) -> str:
    """Item `r`'s array (or chunk file) in generation `gen`, named for a message."""
    name = self.array_path(r.index, gen)
    if chunk is not None:
      name = os.path.join(name, "c", str(chunk))
    return f"{name} (state leaf {r.path})"

  def create_arrays(self, records: Sequence[LeafRecord], generations: int) -> None:
    """Creates every generation of every item's array, owner-only (no data written yet)."""
    for gen in range(generations):
      for r in records:
        self.open_array(r, gen, create=True)
        # Owner-only, like the chunk files: tensorstore creates with the umask.
        _chmod(self.array_path(r.index, gen), 0o700, r)
        _chmod(os.path.join(self.array_path(r.index, gen), "zarr.json"), 0o600, r)
      # (made here too: a state without arrays, e.g. optax.sign_sgd's, has no item to make it)
      os.makedirs(os.path.join(self.path, f"gen{gen}"), mode=0o700, exist_ok=True)
      _chmod(os.path.join(self.path, f"gen{gen}"), 0o700)

  def open_array(self, r: LeafRecord, gen: int, create: bool = False) -> ts.TensorStore:
    """Item `r` of generation `gen` as a tensorstore array (created if `create`)."""
    spec: dict[str, Any] = {
      "driver": "zarr3",
      "kvstore": {"driver": "file", "path": self.array_path(r.index, gen)},
      "fill_missing_data_reads": False,
    }
    if create:
      spec.update(
        create=True,
        delete_existing=True,
        store_data_equal_to_fill_value=True,
        metadata={
          "shape": [r.size],
          "data_type": np.dtype(r.dtype).name,
          "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [r.chunk_size]},
          },
          "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
      )
    try:
      array = ts.open(spec, context=self._context).result()
    except Exception as e:  # tensorstore raises ValueError for every status
      raise errors.StoreError(f"I/O error on {self.where(r, gen)}: {e}") from e
    if tuple(array.shape) != (r.size,) or array.dtype.numpy_dtype != np.dtype(r.dtype):
      raise errors.StoreCorruptedError(
        f"{self.where(r, gen)} holds {array.dtype.numpy_dtype}[{array.shape[0]}], "
        f"metadata says {r.dtype}[{r.size}]."
      )
    return array

  @staticmethod
  def chunks(r: LeafRecord, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """The chunks holding elements [start, stop): (chunk, first, end) of each."""
    chunk = r.chunk_size
    for c in range(start // chunk, -(-stop // chunk)):
      yield c, c * chunk, min((c + 1) * chunk, r.size)

  def read(self, r: LeafRecord, gen: int, start: int, stop: int, out: np.ndarray) -> np.ndarray:
    """Reads elements [start, stop) of item `r` into `out` (flat, its dtype); returns `out`."""
    for c, first, end in self.chunks(r, start, stop):
      a, b = max(first, start), min(end, stop)
      whole = (a, b) == (first, end)
      data = out[a - start : b - start] if whole else np.empty(end - first, out.dtype)
      self.read_chunk(r, gen, c, data.view(np.uint8))
      if not whole:
        out[a - start : b - start] = data[a - first : b - first]
    return out

  def check_files(self, r: LeafRecord, gen: int) -> str | None:
    """What is wrong with item `r`'s chunk files in generation `gen` (by size), or None."""
    for c, _, _ in self.chunks(r, 0, r.size):
      name = os.path.join(self.array_path(r.index, gen), "c", str(c))
      try:
        size = os.stat(name).st_size
      except OSError:
        return f"{self.where(r, gen, c)}: the chunk file is missing."
      if size != r.chunk_nbytes + 4:
        return f"{self.where(r, gen, c)}: {size} bytes, expected {r.chunk_nbytes + 4}."
    return None

  def verify(self, r: LeafRecord, gen: int) -> str | None:
    """The first problem of item `r`'s chunks in generation `gen`, checksums read, or None."""
    buffer = aligned_empty(r.chunk_nbytes)
    for c, first, end in self.chunks(r, 0, r.size):
      try:
        self.read_chunk(r, gen, c, buffer[: (end - first) * np.dtype(r.dtype).itemsize])
      except errors.OffloadError as e:
        return str(e)
    return None

  def read_chunk(self, r: LeafRecord, gen: int, c: int, data: np.ndarray) -> None:
    """Reads chunk `c` of item `r` into `data` (bytes) and checks its crc32c.

    Raises:
      StoreCorruptedError: the file is missing, has the wrong size or checksum.
      StoreError: any other I/O error.
    """
    name = os.path.join(self.array_path(r.index, gen), "c", str(c))
    chunk_nbytes = r.chunk_nbytes
    try:
      direct = self._direct(data)
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | (O_DIRECT if direct else 0))
    except FileNotFoundError:
      raise errors.StoreCorruptedError(
        f"corrupted chunk in {self.where(r, gen, c)}: the file is missing."
      ) from None
    except OSError as e:
      raise errors.StoreError(f"I/O error on {self.where(r, gen, c)}: {e}") from e
    try:
      size = os.fstat(fd).st_size
      if size != chunk_nbytes + 4:
        raise errors.StoreCorruptedError(
          f"corrupted chunk in {self.where(r, gen, c)}: {size} bytes, expected "
          f"{chunk_nbytes + 4} (truncated or overwritten)."
        )
      pread_into(fd, data, 0)  # direct: from the disk to `data`, no page cache copy
      if direct:
        clear_direct(fd)  # the 4-byte checksum is not a whole block
      stored = int.from_bytes(os.pread(fd, 4, chunk_nbytes), "little")
      # The rest of a short last chunk is zero padding, as zarr3 writes it.
      if chunk_crc(data, chunk_nbytes - data.nbytes) != stored:
        raise errors.StoreCorruptedError(
          f"corrupted chunk in {self.where(r, gen, c)}: crc32c checksum mismatch."
        )
      if not direct:
        # The data is ours now; leave the page cache to data that is used again.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      self.telemetry.bytes_read(size)
    except OSError as e:
      raise errors.StoreError(f"I/O error on {self.where(r, gen, c)}: {e}") from e
    finally:
      os.close(fd)

  def write(self, r: LeafRecord, gen: int, start: int, value: np.ndarray) -> None:
    """Writes elements of item `r` starting at `start` into generation `gen`, now.

    The range must consist of whole chunks (the schedule cuts pieces on chunk
    boundaries), so no chunk is ever read back and merged.
    """
    flat = np.ascontiguousarray(value).reshape(-1)
    for c, first, end in self.chunks(r, start, start + flat.size):
      if first < start or end > start + flat.size:
        raise AssertionError(
          f"write of {self.where(r, gen)} [{start}, +{flat.size}) cuts chunk {c}"
        )
      self._write_chunk(r, gen, c, flat[first - start : end - start].view(np.uint8))

  def _write_chunk(self, r: LeafRecord, gen: int, c: int, data: np.ndarray) -> None:
    directory = os.path.join(self.array_path(r.index, gen), "c")
    chunk_nbytes = r.chunk_nbytes
    pad = chunk_nbytes - data.nbytes
    crc = chunk_crc(data, pad).to_bytes(4, "little")
    try:
      if directory not in self._made_dirs:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._made_dirs.add(directory)
      name = os.path.join(directory, str(c))
      # A short last chunk too, when its zero padding is whole blocks.
      direct = pad % BLOCK == 0 and self._direct(data)
      flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (O_DIRECT if direct else 0)
      fd = os.open(name, flags, 0o600)
      self._written.add(name)
      try:
        # In place: this generation is not the committed one, so a torn file
        # here is never read back.
        if direct:
          # To the disk, no page cache copy or writeback.
          pwrite_all(fd, [data, *zero_parts(pad)], 0)
          clear_direct(fd)  # the 4-byte checksum is not a whole block
          pwrite_all(fd, [crc], chunk_nbytes)
        else:
          pwrite_all(fd, [data, *zero_parts(pad), crc], 0)
        os.ftruncate(fd, chunk_nbytes + 4)
        if not direct:
          # Starts this chunk's writeback now (an I/O thread waits, not XLA): the
          # disk writes while the step goes on, and the commit's flush does not
          # find the whole step still dirty.
          os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)
      self.telemetry.bytes_written(chunk_nbytes + 4)
    except OSError as e:
      raise errors.StoreError(f"I/O error on {self.where(r, gen, c)}: {e}") from e

  def _direct(self, data: np.ndarray) -> bool:
    """Whether `data` moves with direct I/O: whole, aligned blocks, a filesystem that can."""
    if data.nbytes % BLOCK or data.ctypes.data % BLOCK:
      return False
    if self._direct_ok is None:
      self._direct_ok = supports_direct(self.path)
    return self._direct_ok

  def flush(self, fsync: bool) -> None:
    """Before a commit: with `fsync`, the chunks written since the last flush reach the disk."""
    if fsync:
      syncfs(self.path)  # flush the chunks before the pointer
      drop_cached(self._written)  # now clean; read again in two steps, from disk
    self._written.clear()


def _chmod(name: str, mode: int, r: LeafRecord | None = None) -> None:
  try:
    os.chmod(name, mode, follow_symlinks=False)
  except OSError as e:
    leaf = "" if r is None else f" (state leaf {r.path})"
    raise errors.StoreError(f"I/O error on {name}{leaf}: {e}") from e
