"""An open NVMe store directory (`Store`): its lock, generations, chunk I/O and commits."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import os
import re
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from offlax._src import errors
from offlax._src import telemetry as telemetry_lib
from offlax._src.nvme import array_files
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
from offlax._src.nvme.format import (
  DEFAULT_KEEP,
  FORMAT_VERSION,
  LAYERS,
  LOCK,
  MESH,
  METADATA,
  LeafRecord,
  metadata_problem,
  read_json,
  write_metadata,
)

# The stores this process holds open for writing, by path: a second open names the
# first (a notebook cell that ran again), rather than blame another process.
_OPEN: weakref.WeakValueDictionary[str, Store] = weakref.WeakValueDictionary()

# The names a store (or a mesh's stores) writes in its folder.
_STORE_NAME = re.compile(
  "|".join([re.escape(LOCK), re.escape(METADATA), re.escape(MESH), r"gen\d+", r"shard_\d+"])
)


def _lock_pid(fd: int) -> int | None:
  """The PID the lock file's holder wrote into it, or None."""
  try:
    text = os.pread(fd, 32, 0).decode().strip()
    return int(text) if text.isdigit() else None
  except (OSError, ValueError):
    return None


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
    if os.path.exists(os.path.join(self.path, LAYERS)):
      raise errors.StoreMismatchError(
        f"{self.path} holds an offlax.LayerStore (layers' params, gradients and optimizer "
        "state), not an NVMeTier store: open it with offlax.LayerStore.open, or give the "
        "NVMeTier another folder."
      )
    if not shared:
      _refuse_foreign_folder(self.path)
    try:
      os.makedirs(self.path, mode=0o700, exist_ok=True)
      # O_NOFOLLOW: a symlink planted at .lock must not redirect the lock file.
      fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
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
        f"NVMe store {self.path} is open for writing by {who} (lock {LOCK}); stop it, or "
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
    return os.path.exists(os.path.join(self.path, METADATA))

  def read_metadata(self) -> dict:
    name = os.path.join(self.path, METADATA)
    meta = read_json(name)
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
      problem = metadata_problem(records, step, generation, chunk_bytes, generations, kept)
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
      out = aligned_empty((stop - start) * dtype.itemsize).view(dtype)
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
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | (O_DIRECT if direct else 0))
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
      pread_into(fd, data, 0)  # direct: from the disk to `data`, no page cache copy
      if direct:
        clear_direct(fd)  # the 4-byte checksum is not a whole block
      stored = int.from_bytes(os.pread(fd, 4, chunk_nbytes), "little")
      # The rest of a short last chunk is zero padding, as zarr3 writes it.
      if chunk_crc(data, chunk_nbytes - data.nbytes) != stored:
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
      raise errors.StoreError(f"I/O error on {self._where(r, gen, c)}: {e}") from e

  def _direct(self, data: np.ndarray) -> bool:
    """Whether `data` moves with direct I/O: whole, aligned blocks, a filesystem that can."""
    if data.nbytes % BLOCK or data.ctypes.data % BLOCK:
      return False
    if self._direct_ok is None:
      self._direct_ok = supports_direct(self.path)
    return self._direct_ok

  def commit(self, step: int) -> None:
    """Makes the next generation current, atomically; its writes are done."""
    if self.fsync:
      syncfs(self.path)  # flush the chunks before the pointer
      drop_cached(self._written)  # now clean; read again in two steps, from disk
    self._written.clear()
    gen = self.next_generation
    # The generation the step after this one writes is no longer a kept step.
    after = (gen + 1) % self.generations
    kept = [(step, gen), *((s, g) for s, g in self.kept if g not in (gen, after))]
    self.make_current(step, gen, kept)

  def make_current(self, step: int, gen: int, kept: list[tuple[int, int]]) -> None:
    """Writes `offlax.json` naming `step` in generation `gen` as committed, atomically."""
    try:
      write_metadata(self.path, self.metadata(step, gen, kept), fsync=self.fsync)
    except OSError as e:
      name = os.path.join(self.path, METADATA)
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


def progress_bar(items, enabled: bool, desc: str):
  """`items`, with a progress bar once the work has run `array_files.BAR_DELAY_S`."""
  if not enabled:
    return items
  from tqdm.auto import tqdm

  return tqdm(items, desc=desc, unit="slice", leave=False, delay=array_files.BAR_DELAY_S)


def _refuse_foreign_folder(path: str) -> None:
  """Refuses a folder that holds files and no store: a store's files would land among them.

  A store's own names (the lock, the metadata, generations, a mesh's shards) mark
  a folder as offlax's, even one whose store was never committed.
  """
  try:
    names = os.listdir(path)
  except (FileNotFoundError, NotADirectoryError):
    return
  if names and not any(_STORE_NAME.fullmatch(name) for name in names):
    shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    raise errors.NotAStoreError(
      f"NVMe store path {path} holds {len(names)} other file(s) ({shown}) and no offlax store: "
      "a store writes .lock, offlax.json and gen0, gen1, ... there, beside them. Give the tier "
      f"an empty or new folder, e.g. NVMeTier({os.path.join(path, 'offlax-state')!r})."
    )
