"""The NVMe tier: optimizer state in tensorstore arrays on a local disk.

Layout of a store directory::

  PATH/offlax.json        committed metadata (format, step, generation, kept steps, leaves)
  PATH/.lock              held with flock by the one process writing the store
  PATH/gen0/leaf_00000/   zarr3 arrays, one per state item, generation 0
  PATH/gen1/leaf_00000/   the same, generation 1 (and so on: `keep + 1` generations)

Every state item is stored flat (1-D), uncompressed, with a crc32c checksum per
chunk (the zarr3 `crc32c` codec), so tensorstore (or any zarr3 reader) opens
and verifies it. Tensorstore creates the arrays; the step itself reads and
writes the chunk files directly (`c/<i>`: the chunk's bytes, zero-padded to the
chunk size, then their crc32c, little endian), since each piece of the
streaming schedule is exactly one chunk: that saves tensorstore's buffer
copies and fresh allocations, which cost more CPU than the disk time on small
machines. A step reads generation `g` (the committed one) and writes generation
`g + 1` (modulo the number of generations); once every write of the step has
completed and is flushed, `offlax.json` is replaced atomically (write, fsync,
rename, fsync directory) with `step + 1` and generation `g + 1`. A process
killed at any point leaves `offlax.json` naming a generation that no write of
the unfinished step touched, so reopening yields exactly the last committed
state.

With `keep + 1` generations the store keeps the last `keep` committed steps
(`offlax.json`'s `kept`: the generations no step is writing), and `rollback`
makes one of them current again.

Leaf directories are named by index (`leaf_00000`), never by the pytree key
path, so no key can name a file outside the store; the key paths are recorded
in `offlax.json`.

For params sharded on a mesh, `path` holds one such store per device, each
with only that device's shard of every state array::

  PATH/offlax-mesh.json   the mesh (axis names and sizes), each param's spec, each shard's process
  PATH/shard_00000/       the store of mesh position 0 (`mesh.devices.flat[0]`)
  PATH/shard_00001/       ...

A process creates and opens only the stores of its own devices. The streamed
update runs per device inside `jax.shard_map`, so each device's callbacks read
and write its own store (`DiskIO`'s `shard`); each store commits its step
atomically as above. A crash between two shards' commits leaves them one step
apart: reopening rolls the ones ahead back to the step every shard has (a
kept generation), so all restart from the same step.
"""

from __future__ import annotations

import _thread
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from offlax._src import coupling as coupling_lib
from offlax._src import direct_copy, errors, ffi, host_params
from offlax._src import layout as layout_lib
from offlax._src import schedule as schedule_lib
from offlax._src import sharding as sharding_lib
from offlax._src import telemetry as telemetry_lib
from offlax._src.host_tier import HostTier

DEFAULT_CHUNK = 16 * 2**20
FORMAT_VERSION = 3  # 2: chunk_bytes recorded; step I/O on chunk files. 3: keep generations
DEFAULT_KEEP = 2  # committed steps kept: the current one and one to roll back to
_METADATA = "offlax.json"
_MESH = "offlax-mesh.json"
_LOCK = ".lock"


# The stores this process holds open for writing, by path: a second open names the
# first (a notebook cell that ran again), rather than blame another process.
_OPEN: weakref.WeakValueDictionary[str, Store] = weakref.WeakValueDictionary()


def _lock_pid(fd: int) -> int | None:
  """The PID the lock file's holder wrote into it, or None."""
  try:
    text = os.pread(fd, 32, 0).decode().strip()
    return int(text) if text.isdigit() else None
  except (OSError, ValueError):
    return None


@dataclasses.dataclass(frozen=True)
class LeafRecord:
  """What `offlax.json` records of one state item."""

  index: int
  path: str  # key path in the inner state, e.g. "[0].mu['w']"
  shape: tuple[int, ...]
  dtype: str
  chunk: int  # elements per storage chunk
  hot: bool  # also held in RAM between steps
  # For a typed PRNG key array: its implementation (e.g. "threefry2x32"); the
  # store holds its key data (`jax.random.key_data`), as `shape` and `dtype` say.
  key: str | None = None

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize

  @property
  def chunk_size(self) -> int:
    """Elements per chunk as stored (a chunk never exceeds the array)."""
    return max(1, min(self.chunk, self.size))

  @property
  def chunk_nbytes(self) -> int:
    return self.chunk_size * np.dtype(self.dtype).itemsize


class Store:
  """An open store directory: locking, the generations, commits.

  Not thread-safe for concurrent steps; one training loop drives one store.
  """

  def __init__(self, path: str, *, fsync: bool, threads: int = 4, telemetry=None):
    self.path = os.path.abspath(path)
    self.fsync = fsync
    self.telemetry = telemetry or telemetry_lib.DiskTelemetry()
    self.step = 0
    self.generation = 0
    self.generations = DEFAULT_KEEP + 1
    self.kept: list[tuple[int, int]] = []  # (step, generation) of committed steps, newest first
    self.chunk_bytes = 0  # the slice budget the chunks were cut for
    self.records: list[LeafRecord] = []
    self.structure = ""  # the inner state's treedef, for people reading offlax.json
    self._context = ts.Context({"file_io_sync": False, "cache_pool": {"total_bytes_limit": 0}})
    self._lock_fd: int | None = None
    self._threads = threads
    # Direct I/O skips the page cache copy both ways and the kernel's writeback
    # (DeepSpeed's ZeRO-Infinity does the same); tmpfs and some others refuse it,
    # which the first chunk I/O finds out.
    self._direct_ok: bool | None = None
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    self._closed = False
    self._made_dirs: set[str] = set()
    self._written: set[str] = set()  # chunk files written since the last commit
    self.owner: Any = None  # the NVMeTier of this store, for StoreLockedError

  # -- opening ---------------------------------------------------------------

  def lock(self, shared: bool = False) -> None:
    """Creates the directory if needed and takes the writer lock (a reader's, if `shared`)."""
    if os.path.lexists(self.path) and not os.path.isdir(self.path):
      raise errors.StoreError(f"NVMe store path {self.path} exists and is not a directory.")
    try:
      os.makedirs(self.path, mode=0o700, exist_ok=True)
      # O_NOFOLLOW: a symlink planted at .lock must not redirect the lock file.
      fd = os.open(os.path.join(self.path, _LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
      raise errors.StoreError(f"cannot open NVMe store {self.path}: {e}") from e
    try:
      fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
      pid = _lock_pid(fd)
      os.close(fd)
      holder = _OPEN.get(self.path)
      if holder is not None:
        owner = getattr(holder, "owner", None) or holder
        raise errors.StoreLockedError(
          f"NVMe store {self.path} is already open for writing in this process (PID "
          f"{os.getpid()}), by {owner!r}, not closed (a notebook cell run again?). Close it "
          "first: tier.close(), or, if you no longer hold it, error.holder.close() on this "
          "error; then open the store again.",
          pid=os.getpid(),
          holder=owner,
        ) from None
      who = "another process" if pid is None else f"another process (PID {pid})"
      if pid == os.getpid():  # (a store object of ours that the registry lost)
        who = f"this process (PID {pid}), through a store that was not closed"
      raise errors.StoreLockedError(
        f"NVMe store {self.path} is open for writing by {who} (lock {_LOCK}); stop it, or "
        "open another path.",
        pid=pid,
      ) from None
    if not shared:
      # The holder's PID, for the message another process gets (advisory only).
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
      _OPEN[self.path] = self
    self._lock_fd = fd
    self._closed = False

  def close(self) -> None:
    # Callbacks of a failed step may still run on XLA threads: they must not
    # start I/O on a store whose lock is released.
    self._closed = True
    if self._executor is not None:
      self._executor.shutdown(wait=True)
      self._executor = None
    if self._lock_fd is not None:
      if _OPEN.get(self.path) is self:
        del _OPEN[self.path]
      os.close(self._lock_fd)
      self._lock_fd = None

  def __del__(self) -> None:
    # A store nothing refers to any more (a tier deleted without close, e.g. in a
    # notebook) cannot write again: release its lock, so the path opens again.
    fd = getattr(self, "_lock_fd", None)
    if fd is not None:
      try:
        os.close(fd)
      except OSError:
        pass

  def exists(self) -> bool:
    return os.path.exists(os.path.join(self.path, _METADATA))

  def read_metadata(self) -> dict:
    name = os.path.join(self.path, _METADATA)
    meta = _read_json(name)
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
      raise errors.StoreCorruptedError(
        f"{name} has format_version {version!r}; this offlax reads versions <= {FORMAT_VERSION}."
      )
    try:
      records = [
        LeafRecord(
          r["index"], r["path"], tuple(r["shape"]), r["dtype"], r["chunk"], r["hot"], r.get("key")
        )
        for r in meta["leaves"]
      ]
      step, generation, chunk_bytes = meta["step"], meta["generation"], meta["chunk_bytes"]
      if version < 3:  # two generations, the committed one the only step kept
        generations, kept = 2, [[step, generation]]
      else:
        generations, kept = meta["generations"], meta["kept"]
      problem = _metadata_problem(records, step, generation, chunk_bytes, generations, kept)
    except (KeyError, TypeError, ValueError) as e:
      problem = repr(e)
    if problem:
      raise errors.StoreCorruptedError(f"{name} is malformed: {problem}.")
    self.records, self.step, self.generation = records, step, generation
    self.generations, self.kept = generations, [(s, g) for s, g in kept]
    self.chunk_bytes = chunk_bytes
    self.structure = str(meta.get("state_structure", ""))
    return meta

  def create(
    self, records: Sequence[LeafRecord], structure: str, chunk_bytes: int, generations: int
  ) -> None:
    """Creates every generation of every item (no data written yet)."""
    self.records = list(records)
    self.structure = structure
    self.chunk_bytes = chunk_bytes
    self.generations = generations
    for gen in range(generations):
      for r in self.records:
        self.open_array(r, gen, create=True)
        # Owner-only, like the chunk files: tensorstore creates with the umask.
        _chmod(self._array_path(r.index, gen), 0o700, r)
        _chmod(os.path.join(self._array_path(r.index, gen), "zarr.json"), 0o600, r)
      # (made here too: a state without arrays, e.g. optax.sign_sgd's, has no item to make it)
      os.makedirs(os.path.join(self.path, f"gen{gen}"), mode=0o700, exist_ok=True)
      _chmod(os.path.join(self.path, f"gen{gen}"), 0o700)

  # -- arrays ----------------------------------------------------------------

  @property
  def next_generation(self) -> int:
    """The generation the next step writes."""
    return (self.generation + 1) % self.generations

  def _array_path(self, index: int, gen: int) -> str:
    return os.path.join(self.path, f"gen{gen}", f"leaf_{index:05d}")

  def open_array(self, r: LeafRecord, gen: int, create: bool = False) -> ts.TensorStore:
    """Item `r` of generation `gen` as a tensorstore array (created if `create`)."""
    spec: dict[str, Any] = {
      "driver": "zarr3",
      "kvstore": {"driver": "file", "path": self._array_path(r.index, gen)},
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
      raise errors.StoreError(f"I/O error on {self._where(r, gen)}: {e}") from e
    if tuple(array.shape) != (r.size,) or array.dtype.numpy_dtype != np.dtype(r.dtype):
      raise errors.StoreCorruptedError(
        f"{self._where(r, gen)} holds {array.dtype.numpy_dtype}[{array.shape[0]}], "
        f"metadata says {r.dtype}[{r.size}]."
      )
    return array

  def _where(self, r: LeafRecord, gen: int, chunk: int | None = None) -> str:
    name = self._array_path(r.index, gen)
    if chunk is not None:
      name = os.path.join(name, "c", str(chunk))
    return f"{name} (state leaf {r.path})"

  def _chunks(self, r: LeafRecord, start: int, stop: int):
    """The chunks holding elements [start, stop): (chunk, first, end) of each."""
    chunk = r.chunk_size
    for c in range(start // chunk, -(-stop // chunk)):
      yield c, c * chunk, min((c + 1) * chunk, r.size)

  # -- the step's I/O: whole chunk files, crc32c-checked ---------------------

  def read(self, index: int, start: int, stop: int, gen: int | None = None, out=None) -> Any:
    """Starts reading elements [start, stop) of an item; returns a future.

    The result is `out` (a flat array of the item's dtype) if given, filled.
    """
    r = self.records[index]
    gen = self.generation if gen is None else gen
    if out is None:
      dtype = np.dtype(r.dtype)
      out = _aligned_empty((stop - start) * dtype.itemsize).view(dtype)
    return self._submit(self._read, r, gen, start, stop, out)

  def _submit(self, fn, *args) -> concurrent.futures.Future:
    if self._closed:
      raise errors.StoreError(f"{self.path}: the tier was closed.")
    if self._executor is None:
      self._executor = concurrent.futures.ThreadPoolExecutor(
        self._threads, thread_name_prefix="offlax-io"
      )
    return self._executor.submit(fn, *args)

  def result(self, future: Any) -> np.ndarray:
    return future.result()

  def _read(self, r: LeafRecord, gen: int, start: int, stop: int, out: np.ndarray) -> np.ndarray:
    for c, first, end in self._chunks(r, start, stop):
      a, b = max(first, start), min(end, stop)
      whole = (a, b) == (first, end)
      data = out[a - start : b - start] if whole else np.empty(end - first, out.dtype)
      self._read_chunk(r, gen, c, data.view(np.uint8))
      if not whole:
        out[a - start : b - start] = data[a - first : b - first]
    return out

  def check_files(self, r: LeafRecord, gen: int) -> str | None:
    """What is wrong with item `r`'s chunk files in generation `gen` (by size), or None."""
    for c, _, _ in self._chunks(r, 0, r.size):
      name = os.path.join(self._array_path(r.index, gen), "c", str(c))
      try:
        size = os.stat(name).st_size
      except OSError:
        return f"{self._where(r, gen, c)}: the chunk file is missing."
      if size != r.chunk_nbytes + 4:
        return f"{self._where(r, gen, c)}: {size} bytes, expected {r.chunk_nbytes + 4}."
    return None

  def _read_chunk(self, r: LeafRecord, gen: int, c: int, data: np.ndarray) -> None:
    name = os.path.join(self._array_path(r.index, gen), "c", str(c))
    chunk_nbytes = r.chunk_nbytes
    try:
      direct = self._direct(data)
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | (_O_DIRECT if direct else 0))
    except FileNotFoundError:
      raise errors.StoreCorruptedError(
        f"corrupted chunk in {self._where(r, gen, c)}: the file is missing."
      ) from None
    except OSError as e:
      raise errors.StoreError(f"I/O error on {self._where(r, gen, c)}: {e}") from e
    try:
      size = os.fstat(fd).st_size
      if size != chunk_nbytes + 4:
        raise errors.StoreCorruptedError(
          f"corrupted chunk in {self._where(r, gen, c)}: {size} bytes, expected "
          f"{chunk_nbytes + 4} (truncated or overwritten)."
        )
      _pread_into(fd, data, 0)  # direct: from the disk to `data`, no page cache copy
      if direct:
        _clear_direct(fd)  # the 4-byte checksum is not a whole block
      stored = int.from_bytes(os.pread(fd, 4, chunk_nbytes), "little")
      # The rest of a short last chunk is zero padding, as zarr3 writes it.
      if _crc(data, chunk_nbytes - data.nbytes) != stored:
        raise errors.StoreCorruptedError(
          f"corrupted chunk in {self._where(r, gen, c)}: crc32c checksum mismatch."
        )
      if not direct:
        # The data is ours now; leave the page cache to data that is used again.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      self.telemetry.bytes_read(size)
    except OSError as e:
      raise errors.StoreError(f"I/O error on {self._where(r, gen, c)}: {e}") from e
    finally:
      os.close(fd)

  def write_all(self, writes) -> None:
    """Runs `write(*args)` for each of `writes` on the I/O threads, a few at a time."""
    pending: list[concurrent.futures.Future] = []
    try:
      for args in writes:
        pending.append(self._submit(self.write, *args))
        if len(pending) > self._threads:
          pending.pop(0).result()
    finally:
      for p in pending:
        p.result()

  def write(self, index: int, start: int, value: np.ndarray) -> None:
    """Writes elements starting at `start` into the next generation, now.

    The range must consist of whole chunks (the schedule cuts pieces on chunk
    boundaries), so no chunk is ever read back and merged.
    """
    r = self.records[index]
    gen = self.next_generation
    flat = np.ascontiguousarray(value).reshape(-1)
    for c, first, end in self._chunks(r, start, start + flat.size):
      if first < start or end > start + flat.size:
        raise AssertionError(
          f"write of {self._where(r, gen)} [{start}, +{flat.size}) cuts chunk {c}"
        )
      self._write_chunk(r, gen, c, flat[first - start : end - start].view(np.uint8))

  def _write_chunk(self, r: LeafRecord, gen: int, c: int, data: np.ndarray) -> None:
    directory = os.path.join(self._array_path(r.index, gen), "c")
    chunk_nbytes = r.chunk_nbytes
    pad = chunk_nbytes - data.nbytes
    crc = _crc(data, pad).to_bytes(4, "little")
    try:
      if directory not in self._made_dirs:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._made_dirs.add(directory)
      name = os.path.join(directory, str(c))
      # A short last chunk too, when its zero padding is whole blocks.
      direct = pad % _BLOCK == 0 and self._direct(data)
      flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (_O_DIRECT if direct else 0)
      fd = os.open(name, flags, 0o600)
      self._written.add(name)
      try:
        # In place: this generation is not the committed one, so a torn file
        # here is never read back.
        if direct:
          # To the disk, no page cache copy or writeback.
          _pwrite_all(fd, [data, *_zero_parts(pad)], 0)
          _clear_direct(fd)  # the 4-byte checksum is not a whole block
          _pwrite_all(fd, [crc], chunk_nbytes)
        else:
          _pwrite_all(fd, [data, *_zero_parts(pad), crc], 0)
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
      raise errors.StoreError(f"I/O error on {self._where(r, gen, c)}: {e}") from e

  def _direct(self, data: np.ndarray) -> bool:
    """Whether `data` moves with direct I/O: whole, aligned blocks, a filesystem that can."""
    if data.nbytes % _BLOCK or data.ctypes.data % _BLOCK:
      return False
    if self._direct_ok is None:
      self._direct_ok = _supports_direct(self.path)
    return self._direct_ok

  def commit(self, step: int) -> None:
    """Makes the next generation current, atomically; its writes are done."""
    if self.fsync:
      _syncfs(self.path)  # flush the chunks before the pointer
      _drop_cached(self._written)  # now clean; read again in two steps, from disk
    self._written.clear()
    gen = self.next_generation
    # The generation the step after this one writes is no longer a kept step.
    after = (gen + 1) % self.generations
    kept = [(step, gen), *((s, g) for s, g in self.kept if g not in (gen, after))]
    self.make_current(step, gen, kept)

  def make_current(self, step: int, gen: int, kept: list[tuple[int, int]]) -> None:
    """Writes `offlax.json` naming `step` in generation `gen` as committed, atomically."""
    try:
      _write_metadata(self.path, self.metadata(step, gen, kept), fsync=self.fsync)
    except OSError as e:
      name = os.path.join(self.path, _METADATA)
      raise errors.StoreError(f"cannot commit step {step} to {name}: {e}") from e
    self.step, self.generation, self.kept = step, gen, kept

  def metadata(self, step: int, gen: int, kept: list[tuple[int, int]]) -> dict:
    """The contents of `offlax.json` for this store with `step` current."""
    return {
      "format_version": FORMAT_VERSION,
      "step": step,
      "generation": gen,
      "generations": self.generations,
      "kept": [list(e) for e in kept],
      "chunk_bytes": self.chunk_bytes,
      "state_structure": self.structure,
      "leaves": [dataclasses.asdict(r) for r in self.records],
    }


def _chmod(name: str, mode: int, r: LeafRecord | None = None) -> None:
  try:
    os.chmod(name, mode, follow_symlinks=False)
  except OSError as e:
    leaf = "" if r is None else f" (state leaf {r.path})"
    raise errors.StoreError(f"I/O error on {name}{leaf}: {e}") from e


def _metadata_problem(records, step, generation, chunk_bytes, generations, kept) -> str | None:
  """What makes these fields of `offlax.json` impossible, or None.

  Checked before any is used: `generation` and `index` name directories, and a
  wrong one would send the step's writes elsewhere.
  """

  def nat(x, low=0):
    return type(x) is int and x >= low  # not `isinstance`: True is no step

  if not nat(generations, 2):
    return f"generations {generations!r}"
  if not nat(step) or not nat(generation) or generation >= generations:
    return f"step {step!r}, generation {generation!r} of {generations}"
  pairs = kept if isinstance(kept, list) else None
  if (
    pairs is None
    or not all(isinstance(e, list) and len(e) == 2 and all(nat(x) for x in e) for e in pairs)
    or [step, generation] not in pairs
    or len({g for _, g in pairs}) != len(pairs)
    or any(g >= generations for _, g in pairs)
  ):
    return f"kept steps {kept!r} (step {step}, generation {generation} of {generations})"
  if not nat(chunk_bytes, 1):
    return f"chunk_bytes {chunk_bytes!r}"
  for position, r in enumerate(records):
    dtype = jnp.dtype(r.dtype)  # TypeError for names that are no dtype
    if (
      r.index != position
      or not nat(r.index)
      or not isinstance(r.path, str)
      or not all(nat(d) for d in r.shape)
      or not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_)
      or not nat(r.chunk)  # 0 for a 0-size item
      or type(r.hot) is not bool
      or not (r.key is None or (isinstance(r.key, str) and r.hot))
    ):
      return f"leaf record {position} is {dataclasses.asdict(r)}"
  return None


def _write_metadata(directory: str, meta: dict, *, fsync: bool) -> None:
  """Replaces `offlax.json` atomically: write, fsync, rename, fsync the directory."""
  _write_json(directory, _METADATA, meta, fsync=fsync)


def rollback(path: str | os.PathLike, step: int) -> int:
  """Makes an earlier committed step of the NVMe store at `path` current, atomically.

  The store keeps its last `keep` committed steps (`NVMeTier(keep=...)`);
  rolling back drops the steps after `step`, and `NVMeTier(path, resume=True)`
  then continues from `step`. Takes the store's lock, so it refuses a store a
  training process has open, and checks that every chunk file of `step` is
  there with its size (`offlax.inspect_store(path, verify=True)` also checks
  their checksums).

  For a sharded store (params on a mesh) `path` may be its root: every shard's
  store under it is rolled back, after checking that all of them keep `step`.

  Args:
    path: the store directory.
    step: a kept step (`python -m offlax inspect PATH` lists them).

  Returns:
    The step now current.

  Raises:
    StepNotKeptError: `step` is not kept; the message lists the kept steps.
    StoreCorruptedError: a chunk file of `step` is missing or has the wrong size.
    StoreLockedError: another process has the store open.
  """
  if is_sharded(os.fspath(path)):
    return _rollback_shards(os.fspath(path), step)
  store = Store(os.fspath(path), fsync=True)
  if not store.exists():
    raise errors.StoreError(f"rollback: no offlax store in {store.path}.")
  store.lock()
  try:
    store.read_metadata()
    _rollback_locked(store, step, "rollback")
  finally:
    store.close()
  return int(step)


def _rollback_locked(store: Store, step: int, where: str) -> None:
  """`rollback` of a store this process has locked and read."""
  gens = {s: g for s, g in store.kept}
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step not in gens:
    raise errors.StepNotKeptError(
      f"{where}: {store.path} does not keep step {step!r}; it keeps steps "
      f"{sorted(gens)} (NVMeTier(keep=...) sets how many)."
    )
  for r in store.records:
    problem = store.check_files(r, gens[step])
    if problem is not None:
      raise errors.StoreCorruptedError(
        f"{where}: step {step} is damaged: {problem} The store is unchanged."
      )
  after = (gens[step] + 1) % store.generations  # the next step writes it
  kept = [(s, g) for s, g in store.kept if s <= step and g != after]
  store.make_current(int(step), gens[step], kept)


def _rollback_shards(path: str, step: int) -> int:
  """`rollback` of every shard's store under the root `path` of a sharded store."""
  shards = sorted(d for d in os.listdir(path) if d.startswith("shard_"))
  for name in shards:  # all keep `step`, or none changes
    store = Store(os.path.join(path, name), fsync=False)
    store.read_metadata()
    if step not in {s for s, _ in store.kept}:
      raise errors.StepNotKeptError(
        f"rollback: {store.path} does not keep step {step!r}; it keeps steps "
        f"{sorted(s for s, _ in store.kept)}. No shard was changed."
      )
  # Each shard's rollback is atomic; one that fails midway leaves shards at two
  # steps, which reopening brings back to one (the lower: `step`).
  for name in shards:
    rollback(os.path.join(path, name), step)
  return int(step)


def copy_store(src: str, dest: str, *, progress: bool = True) -> int:
  """Copies the committed step of the store at `src` into a new store at `dest`.

  Several files at once, in the kernel or by direct I/O in bounded buffers
  (`direct_copy.copy_files`, into owner-only files: no state staged in this
  process's RAM), with a progress bar in bytes: the committed generation's
  arrays, the other generations' array metadata, then `offlax.json` last and
  atomically, after a flush of `dest`, so a crash leaves no store at `dest`
  rather than a torn one.
  The copy keeps only the committed step. The caller keeps `src` from changing
  (holds its lock, between steps). Returns the step.
  """
  if os.path.exists(os.path.join(dest, _METADATA)):
    raise errors.StoreExistsError(f"{dest} already holds an offlax store; choose another path.")
  store = Store(src, fsync=True)
  store.read_metadata()
  gen = store.generation
  try:
    os.makedirs(dest, mode=0o700, exist_ok=True)
    for g in range(store.generations):
      os.makedirs(os.path.join(dest, f"gen{g}"), mode=0o700, exist_ok=True)
    pairs = []
    for r in store.records:
      for g in range(store.generations):
        source = store._array_path(r.index, g)
        target = os.path.join(dest, os.path.relpath(source, store.path))
        if g == gen:
          pairs += direct_copy.tree_pairs(source, target)
        else:  # only the array's metadata: its chunks belong to no step the copy keeps
          os.makedirs(target, mode=0o700)
          pairs.append((os.path.join(source, "zarr.json"), os.path.join(target, "zarr.json")))
    direct_copy.copy_files(pairs, progress=progress, desc=f"offlax: copying {src} -> {dest}")
    _syncfs(dest)
    _write_metadata(dest, store.metadata(store.step, gen, [(store.step, gen)]), fsync=True)
  except OSError as e:
    raise errors.StoreError(f"cannot copy the store {src} to {dest}: {e}") from e
  return store.step


class NVMeTier:
  """Keeps optimizer state on a local disk, with small leaves cached in RAM.

  Each state array is a tensorstore zarr3 array under `path` (see the module
  docstring for the layout and the commit protocol). Arrays that fit in
  `cache_bytes` (smallest first; scalars always) stay in host memory between
  steps, like the host tier; the others are read from disk slice by slice
  inside the jitted step, by `io_callback`s that read `readahead` slices ahead
  of the one being updated and hand each updated slice to I/O threads to
  write. Each step ends with an atomic commit; the whole state, cached arrays
  included, is on disk after it.

  With params sharded on a mesh, `path` holds one store per device, each with
  only that device's shard (module docstring); the options apply to each
  store (`cache_bytes` per device), and `shards` holds this process's.

  Args:
    path: the store directory; created if missing.
    cache_bytes: bytes of state held in RAM between steps.
    chunk_bytes: slice budget of the streamed update, and storage chunk size;
      default 16 MiB, which already reaches most of a disk's bandwidth. Fixed
      when the store is created: a resumed store keeps its own, and passing a
      different one is an error. RAM in use while streaming is a few times
      this (slices read ahead, XLA's copies).
    resume: open an existing store and continue from its last committed step.
      Without it, `init` refuses a directory that already holds a store.
    fsync: flush data and metadata to the device at each commit, so a commit
      also survives power loss (a killed process needs no flush).
    progress: show a progress bar for the initial write and for a resume.
    readahead: slices read ahead of the one being updated; also the slices of
      writes in flight before a write callback waits.
    keep: committed steps kept on disk, for `offlax.rollback` (default 2: the
      current one and the one before); the store holds `keep + 1` copies of
      the state. Fixed when the store is created, like `chunk_bytes`.
    log_every: log a one-line `offlax.stats` summary through the `offlax`
      logger (INFO) every this many steps; None: never.
    step: with `resume`, the step the caller's params are at (e.g. the step of
      the model checkpoint being restored). The store must be at that step: one
      it keeps is made current again (as `offlax.rollback`: the steps after it
      are dropped); otherwise `init` raises `StoreMismatchError` rather than
      train params and optimizer state of different steps. None: the store's
      committed step, whatever it is.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, offlax
    >>> tier = offlax.NVMeTier(tempfile.mkdtemp(), cache_bytes=0, progress=False)
    >>> tx = offlax.offload(optax.adam(1e-3), tier)
    >>> state = tx.init({"w": jnp.ones((4, 3))})
    >>> optax.tree_utils.tree_get(state, "mu")["w"]
    OnDisk(index=1, shape=(4, 3), dtype='float32')
    >>> tier.close()
  """

  def __init__(
    self,
    path: str | os.PathLike,
    *,
    cache_bytes: int = 256 * 2**20,
    chunk_bytes: int | None = None,
    resume: bool = False,
    fsync: bool = True,
    progress: bool = True,
    readahead: int = 2,
    keep: int | None = None,
    log_every: int | None = None,
    step: int | None = None,
  ):
    for name, value, low in (
      ("cache_bytes", cache_bytes, 0),
      ("readahead", readahead, 1),
      ("keep", DEFAULT_KEEP if keep is None else keep, 1),
      ("log_every", 1 if log_every is None else log_every, 1),
      ("step", 0 if step is None else step, 0),
    ):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise errors.InvalidTierError(f"NVMeTier.{name} must be an int >= {low}, got {value!r}.")
    for name, flag in (("resume", resume), ("fsync", fsync), ("progress", progress)):
      if not isinstance(flag, (bool, np.bool_)):  # "no" would be true
        raise errors.InvalidTierError(f"NVMeTier.{name} must be a bool, got {flag!r}.")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
      raise errors.InvalidTierError(f"NVMeTier.path must be a directory path, got {path!r}.")
    if chunk_bytes is not None and (
      isinstance(chunk_bytes, bool)
      or not isinstance(chunk_bytes, (int, np.integer))
      or chunk_bytes <= 0
    ):  # (checked here so that the message names NVMeTier, not its HostTier)
      raise errors.InvalidTierError(
        f"NVMeTier.chunk_bytes must be an int > 0 bytes (or None for the default "
        f"{DEFAULT_CHUNK}), got {chunk_bytes!r}."
      )
    self.host = HostTier(chunk_bytes=DEFAULT_CHUNK if chunk_bytes is None else chunk_bytes)
    _bound_malloc()
    self.path = os.fspath(path)
    self.cache_bytes = int(cache_bytes)
    self._chunk_bytes_given = chunk_bytes is not None
    self.resume = bool(resume)
    self.progress = bool(progress)
    self.readahead = int(readahead)
    self.keep = keep
    self.telemetry = telemetry_lib.DiskTelemetry(log_every)
    self.step = None if step is None else int(step)
    self.store = Store(self.path, fsync=bool(fsync), telemetry=self.telemetry)
    self.store.owner = self
    # Params on a mesh: the tier of each of this process's devices' shards, by
    # mesh position (`shard_NNNNN`); `store` and `telemetry` are then the first's.
    self.shards: dict[int, NVMeTier] = {}
    self._options: dict[str, Any] = dict(
      cache_bytes=cache_bytes, chunk_bytes=chunk_bytes, fsync=fsync, progress=progress,
      readahead=readahead, keep=keep, log_every=log_every, step=step,
    )  # fmt: skip

  @property
  def chunk_bytes(self) -> int:
    return self.host.chunk_bytes

  def __repr__(self) -> str:
    return (
      f"NVMeTier({self.path!r}, cache_bytes={self.cache_bytes}, chunk_bytes={self.chunk_bytes}, "
      f"resume={self.resume})"
    )

  def offloads(self, x: Any) -> bool:
    return isinstance(x, layout_lib.OnDisk) or self.host.offloads(x)

  def to_host(self, x: Any) -> Any:
    return self.host.to_host(x)

  def to_device(self, x: Any) -> Any:
    return self.host.to_device(x)

  def close(self) -> None:
    """Waits for steps in flight (`jax.effects_barrier`) and releases the store's lock."""
    try:
      _wait_for_dispatched_steps()
    except jax.errors.JaxRuntimeError:
      pass  # a failed step's error: its own outputs raise it, not closing the store
    for shard in self.shards.values():
      shard.store.close()
    self.store.close()

  # -- init ------------------------------------------------------------------

  def init(
    self, inner: Any, params: Any, spec: layout_lib.ParamSpec, state: Any = None
  ) -> tuple[Any, Any]:
    """Creates or resumes the store; returns (inner state with OnDisk items, step).

    A new store holds `inner.init(params)`, or `state` (an inner state with its
    values in memory) if given.
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
      raise errors.InvalidTierError(
        "NVMeTier: init writes the store, so it must run eagerly, not under jax.jit or "
        "jax.eval_shape."
      )
    if spec.mesh is not None:
      return self._init_sharded(inner, params, spec, state)
    if os.path.exists(os.path.join(self.path, _MESH)):
      raise errors.StoreMismatchError(
        f"{self.path} holds the state of params sharded on a mesh ({_MESH}: "
        f"{_mesh_text(_read_json(os.path.join(self.path, _MESH)))}); these params are on no "
        "mesh. Put them on that mesh, or choose another path."
      )
    abstract = jax.eval_shape(inner.init, params)
    layout = layout_lib.StateLayout(abstract, spec)
    shapes = layout.split(abstract)
    paths = _item_paths(abstract, layout)
    self.store.lock()
    try:
      if self.store.exists():
        if not self.resume:
          raise errors.StoreExistsError(
            f"{self.path} already holds an offlax store (step {self._committed_step()}); pass "
            "NVMeTier(..., resume=True) to continue from it, or choose another path."
          )
        items = self._resume(shapes, paths, layout)
      else:
        if self.resume:
          raise errors.StoreError(f"NVMeTier(resume=True): no offlax store in {self.path}.")
        values = None if state is None else layout.split(state)
        items = self._create(inner, params, spec, layout, shapes, paths, values)
    except BaseException:
      self.store.close()  # release the lock; nothing was committed
      raise
    telemetry_lib.check_cache(self.store.records, self.cache_bytes)
    return layout.merge(items), jnp.asarray(self.store.step, jnp.int32)

  def snapshot(self, dest: str) -> int:
    """Copies the last committed step's store into `dest`, a new directory; returns the step.

    `NVMeTier(dest, resume=True)` opens the copy. Waits for steps in flight;
    run it between steps (an orbax save of `offlax.NVMeStoreSave(tier)` does).
    On a mesh each process copies its own shards' stores, then the mesh record.
    """
    _wait_for_dispatched_steps()
    if self.store._lock_fd is None or not self.store.exists():
      raise errors.StoreError(f"{self.path}: snapshot needs an open store (init it first).")
    dest = os.fspath(dest)
    if not self.shards:
      return copy_store(self.path, dest, progress=self.progress)
    local = [shard.store.step for shard in self.shards.values()]
    steps = _all_processes(np.array([min(local), max(local)], np.int64))
    if steps[:, 0].min() != steps[:, 1].max():
      # A step that failed on some shards (a write error) was committed by others.
      raise errors.StoreError(
        f"{self.path}: the shards' stores are at steps {steps[:, 0].min()} to "
        f"{steps[:, 1].max()} (a step failed on some of them); close the tier and reopen it "
        "with NVMeTier(..., resume=True), which brings them to one step, then save."
      )
    os.makedirs(dest, mode=0o700, exist_ok=True)
    for i, shard in self.shards.items():
      copy_store(shard.path, os.path.join(dest, _shard_dir(i)), progress=self.progress)
    _write_json(dest, _MESH, _read_json(os.path.join(self.path, _MESH)), fsync=True)
    return self.store.step

  def read_state(self, state: Any) -> Any:
    """The inner state of `state` (this tier's), every array read into memory.

    What `retier` takes to move the state to another tier; it needs RAM for
    the whole state.
    """

    if self.shards:
      raise errors.InvalidTierError(
        f"read_state: {self.path} is sharded on a mesh; each process holds only its shards' "
        "stores, so there is no whole state to read here."
      )

    def value(x):
      if not isinstance(x, layout_lib.OnDisk):
        return x
      r = self.store.records[x.index]
      return jnp.asarray(self.store.result(self.store.read(r.index, 0, r.size)).reshape(r.shape))

    jax.effects_barrier()  # the last step's commit may still be running
    return jax.tree.map(value, state.inner_state, is_leaf=layout_lib.is_slot)

  def _init_sharded(
    self, inner: Any, params: Any, spec: layout_lib.ParamSpec, state: Any
  ) -> tuple[Any, Any]:
    """`init` for params on a mesh: one store per device of this process, each its shard.

    A given `state` may hold numpy arrays (the whole state, as `read_sharded`
    returns it): each device's block is cut from them on the host.
    """
    mesh = spec.mesh
    if self.keep is not None and self.keep < 2:
      # Shards commit independently: after a crash between two commits, the ones
      # ahead go back a step, which they must still keep.
      raise errors.InvalidTierError(
        f"NVMeTier(keep={self.keep}) on a mesh: each device's store commits on its own, so "
        "reopening after a crash may roll some back one step; that needs keep >= 2."
      )
    abstract = jax.eval_shape(inner.init, params)
    layout = layout_lib.StateLayout(abstract, spec)
    shapes = layout.split(abstract)
    specs = item_specs(spec, layout, shapes, _item_paths(abstract, layout))
    record = sharding_lib.describe(mesh, spec.specs, spec.paths)
    record["shapes"] = _shapes_record(spec)
    name = os.path.join(self.path, _MESH)
    # Every process looks before any writes (processes may share `path`), and
    # all of them take the same decision, so none waits on one that gave up.
    looked = np.array([os.path.exists(name), os.path.exists(os.path.join(self.path, _METADATA))])
    found, plain = _all_processes(looked).astype(bool).T
    if plain.any():
      raise errors.StoreMismatchError(
        f"{self.path} holds the store of params on no mesh; these params are sharded on "
        f"{_mesh_text(record)}. Open it with params on no mesh, or choose another path."
      )
    if found.any() and not self.resume:
      raise errors.StoreExistsError(
        f"{self.path} already holds a sharded offlax store; pass NVMeTier(..., resume=True) "
        "to continue from it, or choose another path."
      )
    if self.resume and not found.all():
      where = "" if found.size == 1 else f" (missing in processes {np.flatnonzero(~found)})"
      raise errors.StoreError(f"NVMeTier(resume=True): no offlax store in {self.path}{where}.")
    if self.resume:
      _check_mesh(self.path, _read_json(name), record)
    else:
      try:
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        _write_json(self.path, _MESH, record, fsync=self.store.fsync)
      except OSError as e:
        raise errors.StoreError(f"cannot create the NVMe store {self.path}: {e}") from e
    here = jax.process_index()
    positions = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == here]
    shards = {
      i: NVMeTier(os.path.join(self.path, _shard_dir(i)), resume=self.resume, **self._options)
      for i in positions
    }
    if self.resume:
      _agree(self.path, shards)
    local = local_spec(spec)
    values = None if state is None else layout.split(state)
    per_shard: dict[int, list[Any]] = {}
    try:
      for i, shard in shards.items():
        device = mesh.devices.flat[i]
        local_params = jax.tree.map(lambda x, d=device: _shard_on(x, d), params)
        local_state = None
        if values is not None:  # each device's shard of the given state
          local_state = layout.merge(
            [_local_value(x, mesh, s, device) for x, s in zip(values, specs, strict=True)]
          )
        inner_state, _ = shard.init(inner, local_params, local, local_state)
        self.shards[i] = shard
        per_shard[i] = layout.split(inner_state)
    except BaseException:
      for shard in shards.values():
        shard.store.close()
      self.shards = {}
      raise
    first = shards[positions[0]]
    self.store, self.telemetry = first.store, first.telemetry
    self.host = first.host  # a resumed store's chunk_bytes
    items: list[Any] = []
    for j, (x, s) in enumerate(zip(shapes, specs, strict=True)):
      first_item = per_shard[positions[0]][j]
      if isinstance(first_item, layout_lib.OnDisk):
        items.append(layout_lib.OnDisk(first_item.index, tuple(x.shape), first_item.dtype))
        continue
      # Cached in RAM: one global array of the devices' shards. (`init` makes
      # scalars such as a step count on the default device: each goes to its own.)
      kind = first_item.sharding.memory_kind
      mine = [
        jax.device_put(per_shard[i][j], jax.sharding.SingleDeviceSharding(d, memory_kind=kind))
        for i, d in ((i, mesh.devices.flat[i]) for i in positions)
      ]
      sharding = jax.sharding.NamedSharding(mesh, s, memory_kind=kind)
      items.append(jax.make_array_from_single_device_arrays(x.shape, sharding, mine))
    step = sharding_lib.place(jnp.asarray(self.store.step, jnp.int32), mesh, P())
    return layout.merge(items), step

  def _committed_step(self) -> Any:
    try:
      with open(os.path.join(self.path, _METADATA)) as f:
        return json.load(f)["step"]
    except (OSError, ValueError, KeyError):  # only for the message
      return "unknown"

  def _go_to_step(self, step: int) -> None:
    """Makes `step` (the caller's params' step) current, or raises: see `NVMeTier(step=...)`."""
    kept = sorted(s for s, _ in self.store.kept)
    if step not in kept:
      raise errors.StoreMismatchError(
        f"{self.path} has committed step {self.store.step} and keeps steps {kept}, but the "
        f"params are at step {step} (NVMeTier(step={step})): training on would mix params and "
        "optimizer state of different steps. Restore the store of that step from the "
        "checkpoint holding the params (offlax.NVMeStoreRestore; save it with "
        "offlax.NVMeStoreSave(tier) beside the params), or resume the params from step "
        f"{self.store.step}."
      )
    _rollback_locked(self.store, step, "NVMeTier(resume=True, step=...)")
    logging.getLogger("offlax").warning(
      "%s: rolled back to step %d, the params' step (the store had committed step %d).",
      self.path, step, kept[-1],
    )  # fmt: skip

  def _hot(self, shapes, layout) -> set[int]:
    """The items held in RAM between steps: the smallest, up to `cache_bytes`."""
    order = sorted(range(len(shapes)), key=lambda j: layout_lib.nbytes(shapes[j]))
    hot, budget = set(), self.cache_bytes
    for j in order:
      x, o = shapes[j], layout.owners[j]
      if x.ndim == 0 or o == coupling_lib.GLOBAL or _is_key(x):
        hot.add(j)  # scalars, global items and PRNG keys always stay in RAM
      elif layout_lib.nbytes(x) <= budget:
        hot.add(j)
        budget -= layout_lib.nbytes(x)
    return hot

  def _records(self, shapes, paths, layout) -> list[LeafRecord]:
    leaf_bytes = layout_lib.leaf_bytes(
      shapes, layout.owners, len(layout.spec.shapes), self.offloads
    )
    hot = self._hot(shapes, layout)
    records = []
    for j, x in enumerate(shapes):
      key = _key_impl(x)
      x = _stored(x)
      o = layout.owners[j]
      size = int(np.prod(x.shape, dtype=np.int64))
      chunk = size
      if o != coupling_lib.GLOBAL and leaf_bytes[o] > self.chunk_bytes and x.ndim:
        # Align storage chunks with the pieces the schedule cuts this leaf into.
        flat, rows, step = schedule_lib.split_step(tuple(x.shape), leaf_bytes[o], self.chunk_bytes)
        chunk = step * (size // rows)
      records.append(
        LeafRecord(j, paths[j], tuple(x.shape), np.dtype(x.dtype).name, chunk, j in hot, key)
      )
    return records

  def _create(self, inner, params, spec, layout, shapes, paths, values=None) -> list[Any]:
    records = self._records(shapes, paths, layout)
    keep = DEFAULT_KEEP if self.keep is None else self.keep
    self.store.create(records, str(layout.treedef), self.chunk_bytes, keep + 1)
    self.store.generation = keep  # the last one, so the first commit writes generation 0
    slots = jax.tree.leaves(params, is_leaf=layout_lib.is_masked)
    groups = _init_groups(layout, shapes, self.chunk_bytes, len(slots))
    init = jax.jit(functools.partial(host_params.init, inner.init))
    items: list[Any] = [None] * len(shapes)

    whole = values

    def writes():  # computes each group as the writes of the one before proceed
      nonlocal whole
      for n, group in enumerate(_progress(groups, self.progress, f"offlax: writing {self.path}")):
        group_values = whole
        if group_values is None and len(groups) > 1:
          masked = [s if i in group else layout_lib.MASKED() for i, s in enumerate(slots)]
          try:
            group_values = layout.split(init(spec.treedef.unflatten(masked)))
          except (ValueError, TypeError):  # an init that takes no masked leaves (optax.sm3)
            group_values = None
        if group_values is None:  # the whole state at once
          whole = group_values = layout.split(init(params))
        for j, (x, r) in enumerate(zip(group_values, records, strict=True)):
          owner = layout.owners[j]
          if n == 0 if owner == coupling_lib.GLOBAL else owner in group:
            items[j] = self._entry(r, x)
            yield r.index, 0, np.asarray(_key_data(x))

    self.store.write_all(writes())
    self.store.commit(0)
    return items

  def _resume(self, shapes, paths, layout) -> list[Any]:
    self.store.read_metadata()
    if self.step is not None and self.step != self.store.step:
      self._go_to_step(self.step)
    elif self.step is None:
      # The store commits every step, so after a kill it may be ahead of the
      # params' last checkpoint; only the caller knows the params' step.
      logging.getLogger("offlax").warning(
        "%s: resumed at its committed step %d. offlax cannot check that your params are at "
        "step %d too; pass NVMeTier(..., resume=True, step=<your params' step>) to check it "
        "(and roll back a store that is ahead).",
        self.path, self.store.step, self.store.step,
      )  # fmt: skip
    if self.store.chunk_bytes != self.chunk_bytes:
      if self._chunk_bytes_given:
        raise errors.StoreMismatchError(
          f"{self.path} was created with chunk_bytes={self.store.chunk_bytes}; got "
          f"chunk_bytes={self.chunk_bytes}. A store keeps its chunking: omit chunk_bytes."
        )
      self.host = dataclasses.replace(self.host, chunk_bytes=self.store.chunk_bytes)
    if self.keep is not None and self.keep + 1 != self.store.generations:
      raise errors.StoreMismatchError(
        f"{self.path} was created with keep={self.store.generations - 1}; got keep={self.keep}. "
        "A store keeps its generations: omit keep."
      )
    records = self.store.records
    if len(records) != len(shapes):
      raise errors.StoreMismatchError(
        f"{self.path} holds {len(records)} state arrays; this optimizer has {len(shapes)}."
      )
    for r, x, path in zip(records, shapes, paths, strict=True):
      x = _stored(x)
      want = (path, tuple(x.shape), np.dtype(x.dtype).name)
      if (r.path, r.shape, r.dtype) != want:
        raise errors.StoreMismatchError(
          f"{self.path}: state leaf {r.path} is stored as {r.dtype}{list(r.shape)}; this "
          f"optimizer has {want[0]} as {want[2]}{list(want[1])}."
        )
    # The cache is this run's choice (`cache_bytes`), not the store's: which items
    # stay in RAM is chosen again. Every item is on disk after each commit, and
    # its chunking does not depend on it.
    hot = self._hot(shapes, layout)
    records = [dataclasses.replace(r, hot=r.index in hot) for r in records]
    self.store.records = records
    items = []
    for r in _progress(records, self.progress, f"offlax: resuming {self.path}"):
      if r.hot:
        data = self.store.result(self.store.read(r.index, 0, r.size)).reshape(r.shape)
        value = jnp.asarray(data)
        if r.key is not None:
          value = jax.random.wrap_key_data(value, impl=r.key)
        items.append(self._entry(r, value))
      else:
        items.append(layout_lib.OnDisk(r.index, r.shape, r.dtype))
    return items

  def _entry(self, r: LeafRecord, x: Any) -> Any:
    """What the state holds for item `r` of value `x`: the array, placed, or OnDisk."""
    if not r.hot:
      return layout_lib.OnDisk(r.index, r.shape, r.dtype)
    return self.host.to_host(x) if self.host.offloads(x) else x


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_impl(x: Any) -> str | None:
  """The implementation of a typed PRNG key array (or its shape), else None."""
  if not _is_key(x):
    return None
  if not isinstance(x, jax.Array):  # a ShapeDtypeStruct: a key of its dtype tells
    x = jnp.zeros((), x.dtype)
  return str(jax.random.key_impl(x))


def _key_data(x: Any) -> Any:
  """`x`, or a typed PRNG key array's key data: what the store holds of it."""
  return jax.random.key_data(x) if _is_key(x) else x


def _stored(x: Any) -> Any:
  """The shape and dtype the store holds for a state item of `x`'s (key data for keys)."""
  return jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x


def _shard_dir(i: int) -> str:
  return f"shard_{i:05d}"


def item_specs(
  spec: layout_lib.ParamSpec, layout: layout_lib.StateLayout, items: Sequence[Any], paths=None
) -> list[P]:
  """Each state item's PartitionSpec on the params' mesh: its param's, or P() (replicated).

  Raises `InvalidTierError` for an item that the shards of its param cannot
  split: shaped unlike its sharded param (factored state), or unevenly.
  """
  mesh, out = spec.mesh, []
  for j, (x, o) in enumerate(zip(items, layout.owners, strict=True)):
    shape = layout_lib.shape_of(x)
    if o == coupling_lib.GLOBAL or sharding_lib.shards(spec.specs[o], mesh, len(shape)) == 1:
      out.append(P())
      continue
    where = f"state leaf {paths[j]}" if paths else f"state item {j}"
    param = f"param {spec.paths[o]} {list(spec.shapes[o] or ())} sharded as {spec.specs[o]}"
    if shape != spec.shapes[o]:
      raise errors.InvalidTierError(
        f"NVMeTier on a mesh keeps each device's shard of a state array in its own store, but "
        f"{where} is shaped {list(shape)}, unlike its {param} (factored state such as "
        "optax.adafactor's). Replicate that param, or use offlax.HostTier."
      )
    axis = sharding_lib.uneven_axis(shape, spec.specs[o], mesh)
    if axis is not None:
      raise errors.InvalidTierError(
        f"NVMeTier on a mesh: {where} of {param}: axis {axis} ({shape[axis]}) is not divisible "
        f"by its mesh axes {mesh.shape}; every device's shard must have the same shape."
      )
    out.append(P(*sharding_lib.padded(spec.specs[o], len(shape))))
  return out


def slot_spec(spec: layout_lib.ParamSpec, i: int) -> P:
  """Param slot `i`'s PartitionSpec (P() for a leaf on no mesh)."""
  return P(*sharding_lib.padded(spec.specs[i], len(spec.shapes[i] or ())))


def local_spec(spec: layout_lib.ParamSpec) -> layout_lib.ParamSpec:
  """The ParamSpec of one device's shard of params sharded as `spec` (on no mesh)."""
  shapes = tuple(
    None if s is None else sharding_lib.local_shape(s, slot_spec(spec, i), spec.mesh)
    for i, s in enumerate(spec.shapes)
  )
  nbytes = spec.nbytes // max(1, spec.mesh.size)  # for `offlax.stats` only
  return layout_lib.ParamSpec(spec.treedef, shapes, nbytes)


def _shard_on(x: Any, device: Any) -> Any:
  """`device`'s shard of `x` (all of `x` if it has no sharding), on that device."""
  if isinstance(x, jax.Array):
    for s in x.addressable_shards:
      if s.device == device:
        return s.data
  return jax.device_put(x, device)


def _shapes_record(spec: layout_lib.ParamSpec) -> dict[str, Any]:
  """Each param's global shape, as the mesh record keeps it (JSON)."""
  return {p: None if s is None else list(s) for p, s in zip(spec.paths, spec.shapes, strict=True)}


def _local_value(x: Any, mesh: Any, spec: P, device: Any) -> Any:
  """`device`'s block of a state value `x` sharded as `spec`: sliced on the host if numpy."""
  if isinstance(x, jax.Array):
    return _shard_on(sharding_lib.place(x, mesh, spec), device)
  x = np.asarray(x)
  index = jax.sharding.NamedSharding(mesh, spec).devices_indices_map(x.shape)[device]
  return jax.device_put(x[index], device)


def _read_json(name: str) -> dict:
  try:
    with open(name) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.StoreCorruptedError(f"cannot read {name}: {e}") from e
  if not isinstance(meta, dict):
    raise errors.StoreCorruptedError(f"{name} is malformed: not a JSON object.")
  return meta


def _write_json(directory: str, filename: str, meta: dict, *, fsync: bool) -> None:
  """Replaces `directory/filename` atomically: write, fsync, rename, fsync the directory.

  The temporary file is this process's own (processes of one job may share
  `directory` and write the same record; pids repeat across hosts).
  """
  name = os.path.join(directory, filename)
  tmp = f"{name}.{jax.process_index()}.{os.getpid()}.tmp"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
  with os.fdopen(fd, "w") as f:
    json.dump(meta, f, indent=1)
    f.flush()
    if fsync:
      os.fsync(f.fileno())
  os.replace(tmp, name)
  if fsync:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
      os.fsync(dir_fd)
    finally:
      os.close(dir_fd)


def _mesh_text(record: dict) -> str:
  try:
    axes = dict(zip(record["axis_names"], record["axis_sizes"], strict=True))
  except (KeyError, TypeError, ValueError):
    return f"{record!r:.200}"
  return f"a mesh {axes}"


_RESHARD = (
  "The NVMe tier resumes on the mesh and specs a store was written with (each device's store "
  "holds that mesh's shard); offlax.reshard(path, new_path, inner, params) writes a copy "
  "sharded for these params."
)


def _check_mesh(path: str, saved: dict, now: dict, *, shapes_only: bool = False) -> None:
  """Raises `StoreMismatchError` unless the store was written on this mesh, these specs."""
  for key, what in (("axis_names", "mesh axes"), ("axis_sizes", "mesh axis sizes")):
    if not shapes_only and saved.get(key) != now[key]:
      raise errors.StoreMismatchError(
        f"{path} was written on {_mesh_text(saved)}; these params are on {_mesh_text(now)} "
        f"(different {what}). {_RESHARD}"
      )
  for key, what in (("specs", "is sharded as"), ("shapes", "has shape")):
    if shapes_only and key == "specs":
      continue
    old, new = saved.get(key) or {}, now[key]
    show = sharding_lib.spec_of_entries if key == "specs" else (lambda x: x)
    for leaf in sorted(set(old) | set(new)):
      if old.get(leaf) != new.get(leaf):
        was, now_ = (None if x is None else show(x) for x in (old.get(leaf), new.get(leaf)))
        raise errors.StoreMismatchError(
          f"{path}: param {leaf} {what} {was} in the store, {now_} now. "
          + ("" if key == "shapes" else _RESHARD)
        )


def read_sharded(
  path: str, inner: Any, params: Any, spec: layout_lib.ParamSpec, *, progress: bool = True
) -> tuple[Any, int, dict[str, int]]:
  """The whole inner state held by the sharded store at `path` (numpy arrays), and its step.

  Also returns the stores' `chunk_bytes` and `keep`, as `NVMeTier` options.

  Reads every shard's store (all must be visible from this process and at one
  step; none open for writing) into arrays of the global shapes, each shard at
  its block for the mesh and specs `path` records. Needs RAM for the state.
  With several processes every one calls it, and all raise if one fails.
  """
  # Every process has closed its tier on `path` (its lock) before any reads.
  _all_processes(np.zeros(1))
  error: Exception | None = None
  try:
    result = _read_sharded(path, inner, params, spec, progress)
  except Exception as e:  # shared below, so that no process waits on this one
    error = e
  failed = _all_processes(np.array([error is not None]))[:, 0]
  if error is not None:
    raise error
  if failed.any():
    raise errors.StoreError(
      f"{path}: reading the shards' stores failed in process(es) {np.flatnonzero(failed)}."
    )
  return result


def _read_sharded(path, inner, params, spec, progress) -> tuple[Any, int, dict[str, int]]:
  name = os.path.join(path, _MESH)
  if not os.path.exists(name):
    raise errors.StoreError(f"{path} holds no sharded offlax store ({_MESH}).")
  record = _read_json(name)
  abstract = jax.eval_shape(inner.init, params)
  layout = layout_lib.StateLayout(abstract, spec)
  shapes = layout.split(abstract)
  paths = _item_paths(abstract, layout)
  now = {"shapes": _shapes_record(spec)}
  _check_mesh(path, record, now, shapes_only=True)
  try:
    sizes = dict(zip(record["axis_names"], record["axis_sizes"], strict=True))
    old_specs = tuple(sharding_lib.spec_of_entries(record["specs"][p]) for p in spec.paths)
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
  except (KeyError, TypeError, ValueError) as e:
    raise errors.StoreCorruptedError(f"{name} is malformed: {e!r}.") from e
  old = dataclasses.replace(spec, mesh=mesh, specs=old_specs)
  specs = item_specs(old, layout, shapes, paths)
  values = [np.empty(x.shape, x.dtype) for x in shapes]
  steps = set()
  for position in _progress(range(mesh.size), progress, f"offlax: reading {path}"):
    store = Store(os.path.join(path, _shard_dir(position)), fsync=False)
    if not store.exists():
      raise errors.StoreCorruptedError(f"{store.path}: the shard's store is missing.")
    store.lock(shared=True)  # no process may be writing it; readers may share it
    try:
      store.read_metadata()
      steps.add(store.step)
      for r, x, s, want in zip(store.records, shapes, specs, paths, strict=True):
        if r.path != want or r.dtype != np.dtype(x.dtype).name:
          raise errors.StoreMismatchError(
            f"{store.path}: state leaf {r.path} ({r.dtype}); this optimizer has {want} "
            f"({np.dtype(x.dtype).name})."
          )
        block = sharding_lib.block_index(tuple(x.shape), s, sizes, position)
        data = store.result(store.read(r.index, 0, r.size))
        values[r.index][block] = data.reshape(values[r.index][block].shape)
    finally:
      store.close()
  if len(steps) > 1:
    raise errors.StoreCorruptedError(
      f"{path}: the shards' stores are at steps {sorted(steps)}; open it once with "
      "NVMeTier(path, resume=True) on its own mesh, which brings them to one step."
    )
  options = {"chunk_bytes": store.chunk_bytes, "keep": store.generations - 1}
  return layout.merge(values), steps.pop(), options


def _agree(path: str, shards: dict[int, NVMeTier]) -> None:
  """Brings every shard's store to the step all of them have committed.

  Each shard commits on its own, so a crash between two commits leaves some
  one step ahead: they go back to the common step, a kept one (as `rollback`).
  With several processes the steps are compared across all of them.
  """
  steps, missing = {}, []
  error: Exception | None = None
  try:
    for i, shard in shards.items():
      store = Store(shard.path, fsync=False)
      if store.exists():
        store.read_metadata()
        steps[i] = store.step
      else:
        missing.append(i)
  except Exception as e:  # shared below, so that no process waits on this one
    error = e
  big = np.iinfo(np.int64).max
  summary = np.array([min(steps.values(), default=big), max(steps.values(), default=-1)])
  local = np.append(summary, [len(missing), error is not None]).astype(np.int64)
  gathered = _all_processes(local)
  if error is not None:
    raise error
  if gathered[:, 3].any():
    raise errors.StoreCorruptedError(
      f"{path}: reading the shards' metadata failed in process(es) "
      f"{np.flatnonzero(gathered[:, 3])}; see their errors."
    )
  summary = np.array([gathered[:, 0].min(), gathered[:, 1].max(), gathered[:, 2].sum()])
  low, high, n_missing = (int(v) for v in summary)
  if n_missing:
    names = ", ".join(_shard_dir(i) for i in missing) or "another process's"
    raise errors.StoreCorruptedError(
      f"{path}: the store of {n_missing} shard(s) is missing ({names}; this process's devices "
      "are at mesh positions " + ", ".join(str(i) for i in shards) + "): a store is restored "
      "on the mesh and processes it was written from, after its creation completed."
    )
  if low == high:
    return
  for i, step in steps.items():
    if step > low:
      try:
        rollback(shards[i].path, low)
      except errors.StepNotKeptError:
        raise errors.StoreCorruptedError(
          f"{path}: {_shard_dir(i)} committed step {step}, another shard only step {low}, which "
          f"{_shard_dir(i)} no longer keeps (NVMeTier(keep=...)): the shards cannot agree."
        ) from None


def _all_processes(values: np.ndarray) -> np.ndarray:
  """`values` of every process, one row each (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return values[None]
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(values)).reshape(jax.process_count(), -1)


def is_sharded(path: str) -> bool:
  """Whether `path` holds a sharded store (one store per device, see the module docstring)."""
  return os.path.exists(os.path.join(path, _MESH))


def copy_sharded(src: str, dest: str, *, progress: bool = True) -> int:
  """`copy_store` for a sharded store: this process's shards (as recorded), then the record."""
  record = _read_json(os.path.join(src, _MESH))
  here = jax.process_index()
  mine = [i for i, p in enumerate(record.get("processes", [])) if p == here]
  step = 0
  os.makedirs(dest, mode=0o700, exist_ok=True)
  for i in mine:
    step = copy_store(
      os.path.join(src, _shard_dir(i)), os.path.join(dest, _shard_dir(i)), progress=progress
    )
  _write_json(dest, _MESH, record, fsync=True)
  return step


def _crc(data: np.ndarray, zeros: int) -> int:
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
  block = _aligned_empty(_ZERO_BLOCK)  # aligned: direct I/O writes padding from it
  block[:] = 0
  return block


def _zeros(n: int) -> memoryview:
  """`n` <= `_ZERO_BLOCK` zero bytes, without allocating."""
  return _zero_block().data[:n]


def _zero_parts(n: int) -> list[memoryview]:
  """`n` zero bytes as blocks of at most `_ZERO_BLOCK`."""
  return [_zeros(min(_ZERO_BLOCK, n - i)) for i in range(0, n, _ZERO_BLOCK)]


_BLOCK = 4096  # direct I/O alignment (offsets, sizes and addresses)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _supports_direct(path: str) -> bool:
  """Whether files under `path` can be opened with O_DIRECT."""
  if not _O_DIRECT:
    return False
  probe = os.path.join(path, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
  try:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
  except OSError:
    return False
  os.close(fd)
  os.unlink(probe)
  return True


def _clear_direct(fd: int) -> None:
  fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _aligned_empty(nbytes: int) -> np.ndarray:
  """`nbytes` uninitialised bytes starting on a direct I/O block boundary."""
  raw = np.empty(nbytes + _BLOCK, np.uint8)
  start = -raw.ctypes.data % _BLOCK
  return raw[start : start + nbytes]


def _pread_into(fd: int, data: np.ndarray, offset: int) -> None:
  view = data.data.cast("B")
  done = 0
  while done < len(view):
    n = os.preadv(fd, [view[done:]], offset + done)
    if n == 0:
      raise OSError(f"unexpected end of file after {done} of {len(view)} bytes")
    done += n


def _pwrite_all(fd: int, parts: Sequence[Any], offset: int) -> None:
  """Writes `parts` back to back at `offset` (one pwritev, repeated if short)."""
  views = [memoryview(p).cast("B") for p in parts if len(p)]
  while views:
    n = os.pwritev(fd, views, offset)
    offset += n
    while views and n >= len(views[0]):
      n -= len(views.pop(0))
    if views:
      views[0] = views[0][n:]


def _drop_cached(names) -> None:
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


def _syncfs(path: str) -> None:
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
def _bound_malloc() -> None:
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


def _init_groups(layout, shapes, chunk_bytes, n_slots) -> list[set[int]]:
  """Leaves initialised together: greedy in tree order, about `chunk_bytes` each."""
  leaf_bytes = layout_lib.leaf_bytes(shapes, layout.owners, n_slots, lambda x: True)
  groups: list[set[int]] = [set()]
  size = 0
  for i, b in enumerate(leaf_bytes):
    if groups[-1] and size + b > chunk_bytes:
      groups.append(set())
      size = 0
    groups[-1].add(i)
    size += b
  return groups


def _item_paths(state: Any, layout: layout_lib.StateLayout) -> list[str]:
  """The key path of each item of `layout.split(state)`."""
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=layout_lib.is_masked)[0]
  by_id = {id(x): jax.tree_util.keystr(p) for p, x in flat}
  return [by_id[id(x)] for x in layout.split(state)]


def _progress(items, enabled: bool, desc: str):
  if not enabled:
    return items
  from tqdm.auto import tqdm

  return tqdm(items, desc=desc, unit="slice", leave=False)


class DiskIO:
  """Moves slices between the NVMe tier and the device inside the jitted step.

  Cached items move like the host tier's. Items on disk are read by one
  `io_callback` per slice, which returns slice k (prefetched by the previous
  call) and starts reading the next ones; new values go back by a callback that
  writes them and returns a ticket. The callbacks are unordered
  (JAX 0.10 cannot lower ordered callbacks beside host-memory outputs), so
  data dependencies order them: the read of slice k takes the ticket of slice
  k-2, and the last callback, which writes the cached items and commits, takes
  every ticket.

  On XLA:CPU (with offlax's native library) the values do not cross the
  callbacks: the read callback returns where slice k lies (its buffer's
  address and size), `offlax_from_slice` copies it into XLA's arrays, and
  `offlax_to_slice` copies the new values back into the same buffer before the
  write callback (`submit`) hands it to the I/O threads (`native/slices.cc`).

  On a mesh the step runs per device inside `jax.shard_map`, `items` are one
  device's shards and `shard` is the device's mesh position (traced): every
  callback gets it first, and `_ByShard` hands it to that shard's store.
  """

  loops = False  # its reads are planned per slice (`plan`), in the schedule's order

  def __init__(self, tier: NVMeTier, items, offloaded, step, shard=None):
    from offlax._src.transform import _HostIO  # the moves of cached items

    self.tier, self.items, self.offloaded, self.step = tier, items, offloaded, step
    self.shard = () if shard is None else (shard,)
    self.host = _HostIO(tier.host, items, offloaded)

  def plan(self, keys):
    self.keys = keys
    self.tickets: list[tuple[int, Any]] = []  # (slice, write callback's result)
    self.copied: dict[int, Any] = {}  # slice -> (where, ticket) of its native read
    self.host.plan(keys)
    self.cold = [
      [n for n, (j, _) in enumerate(ks) if isinstance(self.items[j], layout_lib.OnDisk)]
      for ks in keys
    ]
    reads = []
    for ks, cold in zip(keys, self.cold, strict=True):
      reads.append(
        [(self.items[ks[n][0]].index, *_flat_range(self.items[ks[n][0]], ks[n][1])) for n in cold]
      )
    if self.shard:
      readers = {
        i: _Reader(t.store, reads, self.tier.readahead) for i, t in self.tier.shards.items()
      }
      self.reader: Any = _ByShard(readers)
    else:
      self.reader = _Reader(self.tier.store, reads, self.tier.readahead)

  def to_device(self, j, x):
    return self.host.to_device(j, x)

  def to_tier(self, j, x):
    return self.host.to_tier(j, x)

  def load(self, k, after):
    hot = [n for n in range(len(self.keys[k])) if n not in self.cold[k]]
    out: list[Any] = [None] * len(self.keys[k])
    if hot:
      loaded = self.host.fetch([self.keys[k][n] for n in hot], after)
      for n, x in zip(hot, loaded, strict=True):
        out[n] = x
    if self.cold[k]:
      avals = [
        jax.ShapeDtypeStruct(shape, self.items[self.keys[k][n][0]].dtype)
        for n, (_, _, _, shape) in zip(self.cold[k], self.reader.reads[k], strict=True)
      ]
      # Reading slice k waits for slice k-2's write callback: XLA would otherwise
      # be free to run every read first and hold the whole state in memory.
      earlier = [t for i, t in self.tickets if i <= k - 2]
      dep = earlier[-1] if earlier else self.step
      values, self.copied[k] = self._fetch(k, avals, dep)
      for n, x in zip(self.cold[k], values, strict=True):
        out[n] = x
    return out

  def _fetch(self, k, avals, dep):
    """Slice k's values, and (where, ticket) for `_put` on XLA:CPU with the native library."""
    read = functools.partial(self.reader.read, k)
    via_callback = lambda shard, step, dep: (
      io_callback(read, avals, *shard, step, dep),
      (jnp.zeros(4, jnp.uint32), jnp.int32(0)),
    )

    def native(shard, step, dep):
      locate = functools.partial(self.reader.locate, k)
      where = io_callback(locate, jax.ShapeDtypeStruct((4,), jnp.uint32), *shard, step, dep)
      out = (*avals, jax.ShapeDtypeStruct((), jnp.int32))
      copy = jax.ffi.ffi_call("offlax_from_slice", out, has_side_effect=True)
      *values, ticket = copy(where, offsets=self.reader.offsets[k])
      return values, (where, ticket)

    return ffi.on_cpu(native, via_callback, self.shard, self.step, dep)

  def store(self, k, values):
    out = [
      None if n in self.cold[k] else self.host.to_tier(j, values[n])
      for n, (j, _) in enumerate(self.keys[k])
    ]
    if self.cold[k]:
      cold = [self._same_dtype(self.keys[k][n][0], values[n]) for n in self.cold[k]]
      self.tickets.append((k, self._put(k, cold)))
    return out

  def _put(self, k, cold):
    """Writes slice k's new values (the other end of `_fetch`); a ticket."""
    ticket = jax.ShapeDtypeStruct((), jnp.int32)
    write = functools.partial(self.reader.write, k)
    via_callback = lambda shard, copied, cold: io_callback(write, ticket, *shard, *cold)

    def native(shard, copied, cold):
      where, after = copied
      copy = jax.ffi.ffi_call("offlax_to_slice", ticket, has_side_effect=True)
      copied = copy(where, after, *cold, offsets=self.reader.offsets[k])
      return io_callback(functools.partial(self.reader.submit, k), ticket, *shard, copied)

    return ffi.on_cpu(native, via_callback, self.shard, self.copied[k], cold)

  def finish(self, items):
    items = [self.items[j] if x is None else x for j, x in enumerate(items)]
    hot = [j for j, x in enumerate(items) if not isinstance(x, layout_lib.OnDisk)]
    for j in hot:
      self._same_dtype(j, items[j])
    # The write tickets make the commit wait for every write callback.
    commit = functools.partial(self.reader.commit, hot, len(self.tickets))
    tickets = [t for _, t in self.tickets]
    values = [_key_data(items[j]) for j in hot]  # (a callback takes no PRNG key)
    io_callback(commit, None, *self.shard, self.step, *tickets, *values)
    return items

  def next_step(self):
    return self.step + 1

  def _same_dtype(self, j: int, x: Any) -> Any:
    """`x`, the new value of item `j`, if it has the item's stored dtype (checked when traced).

    A store keeps each array's dtype; bytes of another would be written into
    its chunks, torn, and committed.
    """
    r = self.tier.store.records[j]
    if r.key is not None and _key_impl(x) == r.key:
      return x
    if _is_key(x) or np.dtype(x.dtype) != np.dtype(r.dtype):
      raise errors.StoreMismatchError(
        f"the inner update returns state leaf {r.path} as {x.dtype}, but "
        f"{self.tier.path} stores it as {r.dtype}, as init made it: the NVMe tier cannot change "
        "a state array's dtype. (optax.inject_hyperparams, for one, promotes low-precision "
        "moments to float32 with its float32 hyperparameters; give the moments a fixed dtype.)"
      )
    return x


def _flat_range(item: layout_lib.OnDisk, piece) -> tuple[int, int, tuple[int, ...]]:
  size = int(np.prod(item.shape, dtype=np.int64))
  if piece.start is None:
    return 0, size, item.shape
  if piece.flat:
    return piece.start, piece.stop, (piece.stop - piece.start,)
  row = size // item.shape[0]
  return piece.start * row, piece.stop * row, (piece.stop - piece.start, *item.shape[1:])


class _Reader:
  """The Python side of one traced step's callbacks; reused by every call.

  Slice k is read into one buffer (from a small pool, so the step does not
  touch fresh memory: first touches cost more than the copies here). The new
  values of slice k go into the same buffer, once XLA has copied it out (they
  depend on it): `write` copies them, or the native copy has before `submit`.
  Either leaves the writes to the I/O threads (at most `readahead` slices of
  writes in flight), so no XLA thread waits on the disk; the buffer returns
  to the pool when they are done, and the commit waits for all of them.
  """

  def __init__(self, store: Store, reads, readahead: int):
    self.store, self.reads, self.readahead = store, reads, readahead
    self._nonempty = [k for k, r in enumerate(reads) if r]
    self._futures: dict[tuple[int, int], tuple[Any, np.ndarray]] = {}
    # Slices of this step already handed to XLA: when XLA runs slice k+1's read
    # before slice k's, k's prefetch of k+1 must not read it a second time.
    self._consumed: set[tuple[int, int]] = set()
    self._buffers: list[np.ndarray] = []  # free slice buffers
    self._in_use: dict[int, np.ndarray] = {}
    self._writes: list[tuple[int, concurrent.futures.Future]] = []  # (epoch, write), oldest first
    # Bumped when a callback fails. Writes of an earlier epoch belong to a failed
    # step and target the generation the next step writes: it waits for them.
    self._epoch = 0
    self._lock = threading.Lock()  # XLA may run callbacks on several threads
    # Where slice k's items lie in its buffer (bytes); block-aligned, so whole
    # chunks move with direct I/O.
    self.offsets, self._nbytes = [], []
    for slice_reads in reads:
      offsets, total = [], 0
      for index, a, b, _ in slice_reads:
        offsets.append(total)
        total += -(-(b - a) * np.dtype(store.records[index].dtype).itemsize // _BLOCK) * _BLOCK
      self.offsets.append(np.array(offsets, np.int64))
      self._nbytes.append(total)

  def _buffer(self, nbytes: int) -> np.ndarray:
    for i, b in enumerate(self._buffers):
      if b.nbytes >= nbytes:
        return self._buffers.pop(i)
    return _aligned_empty(nbytes)

  def _issue(self, k: int, prefetch: bool = True) -> None:
    # Keyed by step: XLA may run the callbacks of one step out of order, and a
    # prefetch of a slice already read must not be consumed by the next step.
    with self._lock:
      key = (self.store.step, k)
      if key in self._futures or (prefetch and key in self._consumed):
        return
      views, buffer = self._views(k)
      outs = [
        (self.store.read(index, a, b, out=out), shape)
        for (index, a, b, shape), out in zip(self.reads[k], views, strict=True)
      ]
      self._futures[self.store.step, k] = (outs, buffer)

  def _views(self, k: int, buffer: np.ndarray | None = None):
    """Slice k's items laid out in one buffer (a pooled one unless given)."""
    if buffer is None:
      buffer = self._buffer(self._nbytes[k])
    views = []
    for (index, a, b, _), offset in zip(self.reads[k], self.offsets[k], strict=True):
      dtype = np.dtype(self.store.records[index].dtype)
      views.append(buffer[offset : offset + (b - a) * dtype.itemsize].view(dtype))
    return views, buffer

  def _check(self, step) -> None:
    if int(step) != self.store.step:
      self._futures.clear()
      self._consumed.clear()
      kept = sorted(s for s, _ in self.store.kept)
      raise errors.StaleStateError(
        f"this state is from step {int(step)}, but {self.store.path} has committed step "
        f"{self.store.step}: an NVMe-tier state can be updated once; use the state the "
        "last update returned. If that update's result was lost (an interrupt or an error "
        "after its commit), go back to the step of your params: tier.close(), then "
        f"NVMeTier(path, resume=True, step=<your params' step>) (it keeps steps {kept}) "
        "and init again; or continue from the committed step with the params of that step."
      )

  def _settle(self) -> None:
    with self._lock:
      old = [f for e, f in self._writes if e < self._epoch]
      self._writes = [(e, f) for e, f in self._writes if e == self._epoch]
    concurrent.futures.wait(old)  # their errors were the failed step's

  @contextlib.contextmanager
  def _failing_bumps_epoch(self, ends_step: bool = False):
    """Around each callback: a failure ends its step's epoch; Ctrl-C waits for the commit.

    `ends_step`: the commit's callback; after it (or a failure) an interrupt that
    came during the step is raised.
    """
    try:
      with _interrupts_deferred():
        yield
    except BaseException:
      with self._lock:
        self._epoch += 1
      _deliver_deferred_interrupt()
      raise
    if ends_step:
      _deliver_deferred_interrupt()

  def read(self, k: int, step, after) -> list[np.ndarray]:
    with self._failing_bumps_epoch():
      return self._read(k, step)

  def locate(self, k: int, step, after) -> np.ndarray:
    """Reads slice k like `read`, but returns where it lies: its buffer's address and size.

    The native copy (`DiskIO._fetch`) takes the values from there. The buffer
    stays in use until `submit(k)` has written the slice back.
    """
    with self._failing_bumps_epoch():
      self._read(k, step)
      with self._lock:
        buffer = self._in_use[k]
    words = [buffer.ctypes.data, buffer.nbytes]
    return np.array([w >> s & 0xFFFFFFFF for w in words for s in (0, 32)], np.uint32)

  def _read(self, k: int, step) -> list[np.ndarray]:
    self.store.telemetry.begin()
    self._settle()
    if k == self._nonempty[0]:
      self._check(step)
    self._issue(k, prefetch=False)  # a retried step reads it again
    with self._lock:
      outs, buffer = self._futures.pop((self.store.step, k))
      self._consumed.add((self.store.step, k))
      self._in_use[k] = buffer
    position = self._nonempty.index(k)
    for nxt in self._nonempty[position + 1 : position + 1 + self.readahead]:
      self._issue(nxt)  # overlaps the update of slice k
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

  def write(self, k: int, *values) -> np.ndarray:
    with self._failing_bumps_epoch():
      return self._write_slice(k, values)

  def submit(self, k: int, copied) -> np.ndarray:
    """Writes slice k back from its buffer, where the native copy put the new values.

    `copied` is that copy's ticket: XLA runs this only after it.
    """
    with self._failing_bumps_epoch():
      return self._write_slice(k, None)

  def _write_slice(self, k: int, values) -> np.ndarray:
    self._settle()
    with self._lock:
      buffer = self._in_use.pop(k)
    views, _ = self._views(k, buffer)
    if values is not None:  # else the native copy has filled the buffer
      for view, v in zip(views, values, strict=True):
        np.copyto(view, np.asarray(v).reshape(-1))  # XLA owns `v` only during this call
    writes = [(index, a, view) for (index, a, _, _), view in zip(self.reads[k], views, strict=True)]
    future = self.store._submit(self._write, writes, buffer)
    with self._lock:
      self._writes.append((self._epoch, future))
      oldest = self._writes.pop(0)[1] if len(self._writes) > self.readahead else None
    if oldest is not None:
      with self._waiting():
        oldest.result()  # bounds the buffers in flight; raises the write's error
    return np.asarray(k, np.int32)

  def _write(self, writes, buffer: np.ndarray) -> None:
    try:
      for index, a, view in writes:
        self.store.write(index, a, view)
    finally:
      with self._lock:
        self._buffers.append(buffer)
        del self._buffers[: -2 * self.readahead - 2]  # more only for an odd schedule

  def commit(self, hot: list[int], n_tickets: int, step, *args) -> None:
    with self._failing_bumps_epoch(ends_step=True):
      self._commit(hot, n_tickets, step, *args)

  def _commit(self, hot: list[int], n_tickets: int, step, *args) -> None:
    telemetry = self.store.telemetry
    telemetry.begin()
    self._settle()
    with self._lock:
      writes, self._writes = self._writes, []
    with self._waiting():
      for _, w in writes:
        w.result()
      self._check(step)
      for j, v in zip(hot, args[n_tickets:], strict=True):
        self.store.write(j, 0, v)
      self.store.commit(int(step) + 1)
    nbytes = [r.nbytes for r in self.store.records]
    hit = sum(nbytes[j] for j in hot)
    telemetry.end(int(step) + 1, hit, sum(nbytes) - hit)
    with self._lock:
      self._futures.clear()
      self._consumed.clear()
      self._in_use.clear()


def _wait_for_dispatched_steps() -> None:
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


_DEFERRED_INTERRUPT = threading.Event()


@contextlib.contextmanager
def _interrupts_deferred():
  """Holds back Ctrl-C while a callback of the step runs (in the main thread).

  On XLA:CPU the callbacks may run in the thread that called the step, where
  Python raises KeyboardInterrupt: inside a callback it would fail the step
  (as a JaxRuntimeError, which `except KeyboardInterrupt` misses), possibly
  after its commit, losing its result. Held back, it is raised once the step
  has committed (or failed), in the caller's code: see
  `_deliver_deferred_interrupt`. Only Python's own SIGINT handler is replaced.
  """
  if (
    threading.current_thread() is not threading.main_thread()
    or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
  ):
    yield
    return
  previous = signal.signal(signal.SIGINT, _defer_interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _defer_interrupt(signum: int, frame: Any) -> None:
  """The SIGINT handler inside a callback: holds the interrupt back, for a while.

  The step's commit delivers it (`_deliver_deferred_interrupt`); should no commit
  come within `_INTERRUPT_LATEST_S` (the callbacks are unordered: this one may
  have run after the step's last delivery), it is delivered then all the same.
  """
  _DEFERRED_INTERRUPT.set()

  def deliver_late():
    time.sleep(_INTERRUPT_LATEST_S)
    _deliver_deferred_interrupt()

  threading.Thread(target=deliver_late, name="offlax-interrupt-late", daemon=True).start()


def _deliver_deferred_interrupt() -> None:
  """Raises a held-back Ctrl-C in the main thread once it has left the callbacks.

  A callback that raised it would fail the step: another thread interrupts the
  main thread a moment later, when the step has returned its results (a
  callback of the next step would hold it back again, until that one commits).
  """
  if not _DEFERRED_INTERRUPT.is_set():
    return
  _DEFERRED_INTERRUPT.clear()

  def interrupt():
    time.sleep(_INTERRUPT_DELAY_S)
    _thread.interrupt_main()

  threading.Thread(target=interrupt, name="offlax-interrupt", daemon=True).start()


_INTERRUPT_DELAY_S = 0.05
_INTERRUPT_LATEST_S = 1.0


class _ByShard:
  """The callbacks of a step on a mesh: each goes to the `_Reader` of its device's shard.

  The shard (a mesh position) comes first in each callback's arguments.
  """

  def __init__(self, readers: dict[int, _Reader]):
    self.readers = readers
    first = next(iter(readers.values()))
    self.reads, self.offsets = first.reads, first.offsets  # the same plan for every shard

  def _of(self, shard) -> _Reader:
    reader = self.readers.get(int(shard))
    if reader is None:  # the mesh puts a device of another process's stores here
      raise errors.StoreError(
        f"no store of mesh position {int(shard)} is open in process {jax.process_index()} "
        f"(it opened {sorted(self.readers)})."
      )
    return reader

  def read(self, k: int, shard, step, after) -> list[np.ndarray]:
    return self._of(shard).read(k, step, after)

  def write(self, k: int, shard, *values) -> np.ndarray:
    return self._of(shard).write(k, *values)

  def locate(self, k: int, shard, step, after) -> np.ndarray:
    return self._of(shard).locate(k, step, after)

  def submit(self, k: int, shard, copied) -> np.ndarray:
    return self._of(shard).submit(k, copied)

  def commit(self, hot: list[int], n_tickets: int, shard, step, *args) -> None:
    self._of(shard).commit(hot, n_tickets, step, *args)
