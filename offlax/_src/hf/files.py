"""A Hugging Face checkpoint folder's safetensors files: headers, index, reads and writes.

A safetensors file is an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range in the data that follows) and the
data. A sharded checkpoint adds ``model.safetensors.index.json``, naming each
tensor's file. Reads go through ``os.preadv`` into one buffer per tensor (no
mapping of the whole file: the RSS holds the tensor being read, nothing else),
and every byte range is checked against the file's size before anything is
read, so a cut-short download is refused by name.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import struct
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from offlax._src import errors
from offlax._src.nvme.direct_io import BLOCK, aligned_empty, open_direct, pwrite_all

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES: dict[str, Any] = {
  "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
  "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I8": np.int8,
  "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "U16": np.uint16,
  "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
}  # fmt: skip
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
DIRECT_BYTES = 2**20  # tensors read with direct I/O from this size


class Tensor(NamedTuple):
  """One tensor of a checkpoint: where its bytes are, and what they hold."""

  name: str
  file: str  # the file's full path
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int  # of its first byte in the file
  nbytes: int


class Folder(NamedTuple):
  """A checkpoint folder's tensors (in the files' order) and each file's ``__metadata__``."""

  path: str
  tensors: dict[str, Tensor]
  metadata: dict[str, dict[str, str]]  # file name -> its header's __metadata__


def read_folder(path: str) -> Folder:
  """The tensors of the checkpoint at `path`, every header checked against its file.

  Raises:
    CheckpointNotFoundError: no folder, no safetensors file, or a shard the
      index names is missing.
    CheckpointCorruptedError: a header is unreadable, a tensor's byte range
      disagrees with its shape or runs past the end of its file (a cut-short
      download), or the index and the files disagree.
  """
  if not os.path.isdir(path):
    raise errors.CheckpointNotFoundError(f"load_safetensors: {path} is not a folder.")
  weight_map = None
  index = os.path.join(path, INDEX)
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise errors.CheckpointCorruptedError(f"load_safetensors: cannot read {index}: {e!r}") from e
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
      lost = sum(1 for n in weight_map.values() if n in missing)
      raise errors.CheckpointNotFoundError(
        f"load_safetensors: {index} names {len(names)} shards, and {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} missing from {path} ({lost} tensors): "
        "download the checkpoint again (all its shards)."
      )
  else:
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
      raise errors.CheckpointNotFoundError(
        f"load_safetensors: {path} holds no .safetensors file (nor {INDEX})."
      )
  tensors: dict[str, Tensor] = {}
  metadata = {}
  for name in names:
    found, metadata[name] = read_header(os.path.join(path, name))
    for t in found:
      if t.name in tensors:
        raise errors.CheckpointCorruptedError(
          f"load_safetensors: tensor {t.name} is in both {tensors[t.name].file} and {t.file}."
        )
      if weight_map is not None and weight_map.get(t.name) != name:
        raise errors.CheckpointCorruptedError(
          f"load_safetensors: {t.file} holds tensor {t.name}, which {index} places in "
          f"{weight_map.get(t.name, 'no file')}."
        )
      tensors[t.name] = t
  if weight_map is not None and (absent := sorted(set(weight_map) - set(tensors))):
    raise errors.CheckpointCorruptedError(
      f"load_safetensors: {index} names tensors its files lack: {short(absent)}."
    )
  return Folder(path, tensors, metadata)


def read_header(file: str) -> tuple[list[Tensor], dict[str, str]]:
  """A safetensors file's tensors and ``__metadata__``, each byte range checked."""
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    if n is None or 8 + n > size:
      raise errors.CheckpointCorruptedError(
        f"load_safetensors: {file} is cut short ({size} bytes, within its header): download it "
        "again."
      )
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise errors.CheckpointCorruptedError(
        f"load_safetensors: {file}'s header is not JSON ({e}): download it again."
      ) from e
  if not isinstance(header, dict):
    raise errors.CheckpointCorruptedError(
      f"load_safetensors: {file}'s header is a JSON {type(header).__name__}, not an object of "
      "tensors: download it again."
    )
  start, tensors = 8 + n, []
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    shape, begin, end = _entry(file, name, meta)
    dtype = DTYPES.get(meta.get("dtype"))
    if dtype is None:
      raise errors.CheckpointCorruptedError(
        f"load_safetensors: tensor {name} of {file} has dtype {meta.get('dtype')!r}, which "
        f"offlax does not read ({', '.join(DTYPES)})."
      )
    want = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if end - begin != want:
      raise errors.CheckpointCorruptedError(
        f"load_safetensors: tensor {name} of {file} is {meta['dtype']}{list(shape)} "
        f"({want} bytes) but its header gives it {end - begin} bytes."
      )
    if begin < 0 or start + end > size:
      raise errors.CheckpointCorruptedError(
        f"load_safetensors: {file} is cut short: tensor {name} ends at byte {start + end}, the "
        f"file has {size} bytes (an interrupted download?): download it again."
      )
    tensors.append(Tensor(name, file, np.dtype(dtype), shape, start + begin, want))
  return tensors, header.get("__metadata__") or {}


def _entry(file: str, name: str, meta: Any) -> tuple[tuple[int, ...], int, int]:
  """A header entry's shape and byte range, each a list of non-negative ints as the format has."""

  def ints(key: str, n: int | None) -> list[int] | None:
    x = meta.get(key)
    ok = isinstance(x, list) and (n is None or len(x) == n)
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)
    return x if ok else None

  shape = ints("shape", None) if isinstance(meta, dict) else None
  offsets = ints("data_offsets", 2) if isinstance(meta, dict) else None
  if shape is None or offsets is None or offsets[0] > offsets[1]:
    got = meta if not isinstance(meta, dict) else {
      k: meta.get(k) for k in ("dtype", "shape", "data_offsets")
    }  # fmt: skip
    raise errors.CheckpointCorruptedError(
      f"load_safetensors: tensor {name} of {file} has a damaged header entry {got!r} (a shape "
      "of non-negative ints and data_offsets [begin, end] wanted): download it again."
    )
  return tuple(shape), offsets[0], offsets[1]


class Buffers:
  """Aligned buffers for `read`, used again.

  A new buffer's pages are zeroed by the kernel as they are first touched:
  at a checkpoint's size, as much CPU as the transposes; a kept one's are not.
  `give(x)` hands back the buffer under `x` (an array `read` returned) once
  nothing reads `x`; at most `keep` are kept of each size (whole MiB).
  """

  def __init__(self, keep: int = 1):
    self._free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    self._lent: dict[int, np.ndarray] = {}  # by the address of the array `read` returned
    self._lock = threading.Lock()  # taken on the read thread, given on the conversion's
    self._keep = keep

  def take(self, nbytes: int) -> np.ndarray:
    """An aligned buffer of at least `nbytes` (a kept one, or a new one)."""
    size = -(-nbytes // 2**20) * 2**20
    with self._lock:
      free = self._free[size]
      buffer = free.pop() if free else None
    return aligned_empty(size) if buffer is None else buffer

  def lend(self, x: np.ndarray, buffer: np.ndarray) -> None:
    with self._lock:
      self._lent[x.ctypes.data] = buffer

  def give(self, x: np.ndarray) -> None:
    """Keeps the buffer under `x`, which nothing reads any more (another array: ignored)."""
    with self._lock:
      buffer = self._lent.pop(x.ctypes.data, None)
      if buffer is not None and len(self._free[buffer.size]) < self._keep:
        self._free[buffer.size].append(buffer)


def read(t: Tensor, buffers: Buffers | None = None) -> np.ndarray:
  """Tensor `t`'s values, read now into a new array (or one of `buffers`).

  A large tensor is read with direct I/O where the filesystem has it (its
  aligned byte range into an aligned buffer: the disk's speed, and no page
  cache filled with a checkpoint read once); a small one through the page cache.
  """
  direct = t.nbytes >= DIRECT_BYTES
  start = t.offset - t.offset % BLOCK if direct else t.offset
  need = t.offset + t.nbytes - start
  size = -(-need // BLOCK) * BLOCK
  whole = None
  if direct:
    whole = buffers.take(size) if buffers is not None else aligned_empty(size)
  buffer = whole[:size] if whole is not None else np.empty(need, np.uint8)
  fd = open_direct(t.file, os.O_RDONLY)[0] if direct else os.open(t.file, os.O_RDONLY)
  try:
    done = 0
    while done < need:
      got = os.preadv(fd, [buffer[done:].data], start + done)
      if got <= 0:
        raise errors.CheckpointCorruptedError(
          f"load_safetensors: {t.file} ended while reading tensor {t.name}: download it again."
        )
      done += got
  finally:
    os.close(fd)
  data = buffer[t.offset - start : t.offset - start + t.nbytes].view(t.dtype).reshape(t.shape)
  if buffers is not None and whole is not None:
    buffers.lend(data, whole)
  return data


class Writer:
  """Writes tensors into the shard files of a new checkpoint, laid out up front.

  Each tensor's place (file, offset) is known before its bytes are: the
  headers are written first, each file's space reserved, then `write` puts each
  tensor in its place, in any order (a layer at a time). A large tensor's
  whole blocks go by direct I/O where the filesystem has it (no copy into the
  page cache, which cost more CPU than the rest of a save, and no writeback
  left for `finish`), from memory in the same phase of the block as its place
  in the file (`empty` gives such an array; another is copied into one); the
  partial blocks at its ends, and small tensors, through the page cache.
  `finish` flushes the files and writes the index.
  """

  def __init__(self, folder: str, layout: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
               max_shard_bytes: int, metadata: dict[str, str]):  # fmt: skip
    shards: list[list[tuple[str, np.dtype, tuple[int, ...], int]]] = [[]]
    used = 0
    for name, dtype, shape in layout:
      nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
      if shards[-1] and used + nbytes > max_shard_bytes:
        shards.append([])
        used = 0
      shards[-1].append((name, np.dtype(dtype), tuple(shape), nbytes))
      used += nbytes
    n = len(shards)
    self.folder, self.places, self.fds = folder, {}, []
    self.direct: list[int | None] = []  # each file's direct-I/O descriptor, where it has one
    self.names = (
      [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    self.weight_map: dict[str, str] = {}
    self.total = 0
    try:  # a failure (a full disk at the reservation) leaves no descriptor open
      for file, shard in zip(self.names, shards, strict=True):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape, nbytes in shard:
          header[name] = {"dtype": NAMES[dtype], "shape": list(shape),
                          "data_offsets": [offset, offset + nbytes]}  # fmt: skip
          offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data 8-byte aligned, as safetensors writes it
        full = os.path.join(folder, file)
        fd = os.open(full, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.fds.append(fd)
        os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(fd, 8 + len(raw) + offset)
        _reserve(fd, 8 + len(raw) + offset)
        dfd, direct = open_direct(full, os.O_RDWR)
        if not direct:
          os.close(dfd)
        self.direct.append(dfd if direct else None)
        for name, dtype, shape, _ in shard:
          at = 8 + len(raw) + header[name]["data_offsets"][0]
          self.places[name] = (fd, self.direct[-1], at, dtype, shape)
          self.weight_map[name] = file
        self.total += offset
    except BaseException:
      self.close()
      raise

  def empty(self, name: str) -> np.ndarray:
    """An uninitialised array of tensor `name`'s dtype and shape that `write` writes uncopied."""
    _, _, offset, dtype, shape = self.places[name]
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    phase = offset % BLOCK
    return aligned_empty(phase + nbytes)[phase:].view(dtype).reshape(shape)

  def write(self, name: str, x: np.ndarray) -> None:
    """Puts tensor `name`'s values (already of its dtype and shape) in its place."""
    fd, direct, offset, dtype, shape = self.places[name]
    assert x.dtype == dtype and x.shape == shape, (name, x.dtype, x.shape, dtype, shape)
    raw = (x if x.flags.c_contiguous else x.copy(order="C")).reshape(-1).view(np.uint8)
    begin, end = -(-offset // BLOCK) * BLOCK, (offset + raw.size) // BLOCK * BLOCK
    if direct is None or raw.size < DIRECT_BYTES or end <= begin:
      _pwrite(fd, raw, offset)
      return
    whole = raw[begin - offset : end - offset]
    if whole.ctypes.data % BLOCK:  # not in the file's phase: copied into an array that is
      copy = self.empty(name).reshape(-1).view(np.uint8)
      copy[:] = raw
      raw, whole = copy, copy[begin - offset : end - offset]
    pwrite_all(direct, [whole], begin)
    _pwrite(fd, raw[: begin - offset], offset)  # the partial blocks, through the page cache
    _pwrite(fd, raw[end - offset :], end)

  def finish(self) -> None:
    """Flushes every file and writes the index (for more than one shard)."""
    for fd in self.fds:
      os.fsync(fd)
    if len(self.names) > 1:
      index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
      with open(os.path.join(self.folder, INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    self.close()

  def close(self) -> None:
    for fd in self.fds + [d for d in self.direct if d is not None]:
      os.close(fd)
    self.fds, self.direct = [], []


def _pwrite(fd: int, raw: np.ndarray, offset: int) -> None:
  done = 0
  while done < raw.size:
    done += os.pwrite(fd, raw[done:].data, offset + done)


def _reserve(fd: int, size: int) -> None:
  """Reserves a new file's space: a full disk refused up front, direct writes into blocks."""
  try:
    os.posix_fallocate(fd, 0, size)
  except OSError as e:
    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it: written as is
      raise


def short(names: list[str], n: int = 8) -> str:
  """At most `n` of `names`, and how many more."""
  more = f" and {len(names) - n} more" if len(names) > n else ""
  return ", ".join(names[:n]) + more
