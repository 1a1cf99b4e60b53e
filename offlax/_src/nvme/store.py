"""An open NVMe store directory (`Store`): its lock, manifest, arrays, I/O threads and commits.

Each part has its module: the lock (`store_lock.py`), what `offlax.json` says
(`manifest.py`), the chunk files (`chunks.py`); `Store` runs a step's reads and
writes on its I/O threads (`IOThreads`) and commits them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from offlax._src import errors
from offlax._src import telemetry as telemetry_lib
from offlax._src.nvme import array_files
from offlax._src.nvme.chunks import ChunkFiles
from offlax._src.nvme.direct_io import aligned_empty
from offlax._src.nvme.format import METADATA, LeafRecord, write_metadata
from offlax._src.nvme.manifest import Manifest
from offlax._src.nvme.store_lock import StoreLock


class IOThreads:
  """A store's I/O threads: started on first use; after `close`, they refuse new work.

  Example:
    >>> from offlax._src.nvme.store import IOThreads
    >>> threads = IOThreads("/tmp/store", 2)
    >>> threads.submit(sum, [1, 2]).result()
    3
    >>> threads.close()
  """

  def __init__(self, path: str, count: int):
    self.path = path  # named in the refusal after `close`
    self.count = count
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    self._closed = False
    # Host callbacks run on JAX's threads: two first submits must not make two pools,
    # or `close` would wait for one and writes of the other could land after it.
    self._lock = threading.Lock()

  def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs `fn(*args)` on an I/O thread; returns its future.

    Raises:
      StoreError: the threads were closed (the tier was).
    """
    with self._lock:
      if self._closed:
        raise errors.StoreError(f"{self.path}: the tier was closed.")
      if self._executor is None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
          self.count, thread_name_prefix="offlax-io"
        )
      return self._executor.submit(fn, *args)

  def open(self) -> None:
    """Takes work again (a store locked again after `close`)."""
    self._closed = False

  def close(self) -> None:
    """Refuses new work, then waits for the work submitted."""
    with self._lock:
      self._closed = True
      executor, self._executor = self._executor, None
    if executor is not None:
      executor.shutdown(wait=True)


class Store:
  """An open store directory: its lock, its manifest and arrays, a step's I/O, commits.

  `manifest` is what `offlax.json` says (read by `read_metadata`, replaced by
  each commit); `files` are the arrays' chunk files; reads and writes run on
  `threads`. Not thread-safe for concurrent steps; one training loop drives one
  store.

  Example:
    >>> import tempfile, numpy as np
    >>> from offlax._src.nvme.format import LeafRecord
    >>> from offlax._src.nvme.store import Store
    >>> store = Store(tempfile.mkdtemp(), fsync=False)
    >>> store.lock()
    >>> store.create([LeafRecord(0, "['w']", (4,), "float32", 4, False)], "", 16, generations=2)
    >>> store.write_all([(0, 0, np.ones(4, np.float32))])
    >>> store.commit(0)
    >>> store.result(store.read(0, 0, 4))
    array([1., 1., 1., 1.], dtype=float32)
    >>> store.close()
  """

  def __init__(
    self, path: str, *, fsync: bool, threads: int = 4, telemetry: Any = None, owner: Any = None
  ):
    self.path = os.path.abspath(path)
    self.fsync = fsync
    self.telemetry = telemetry or telemetry_lib.DiskTelemetry()
    self.owner = owner  # the NVMeTier of this store, for StoreLockedError
    self.manifest = Manifest()
    self.files = ChunkFiles(self.path, self.telemetry)
    self.threads = IOThreads(self.path, threads)
    self._lock = StoreLock(self.path)

  # -- the manifest's fields ---------------------------------------------------

  @property
  def records(self) -> list[LeafRecord]:
    """What `offlax.json` records of each state item."""
    return self.manifest.records

  @property
  def structure(self) -> str:
    """The inner state's treedef, as text."""
    return self.manifest.structure

  @property
  def chunk_bytes(self) -> int:
    """The slice budget the chunks were cut for."""
    return self.manifest.chunk_bytes

  @property
  def step(self) -> int:
    """The committed step."""
    return self.manifest.step

  @property
  def generation(self) -> int:
    """The committed step's generation."""
    return self.manifest.generation

  @property
  def generations(self) -> int:
    """The copies of the state on disk (`keep + 1`)."""
    return self.manifest.generations

  @property
  def kept(self) -> list[tuple[int, int]]:
    """(step, generation) of the committed steps kept, newest first."""
    return self.manifest.kept

  @property
  def next_generation(self) -> int:
    """The generation the next step writes."""
    return self.manifest.next_generation

  # -- opening -------------------------------------------------------------------

  def lock(self, shared: bool = False) -> None:
    """Creates the directory if needed and takes the writer lock (a reader's, if `shared`)."""
    self._lock.acquire(self, shared)
    self.threads.open()

  @property
  def locked(self) -> bool:
    """Whether this store holds its folder's lock (`lock` ran, `close` did not)."""
    return self._lock.held

  def close(self) -> None:
    """Waits for the I/O in flight, refusing more, and releases the lock."""
    # Callbacks of a failed step may still run on XLA threads: they must not
    # start I/O on a store whose lock is released.
    self.threads.close()
    self._lock.release(self)

  def exists(self) -> bool:
    return os.path.exists(os.path.join(self.path, METADATA))

  def read_metadata(self) -> dict:
    """Reads `offlax.json` into `manifest`; returns it as read."""
    self.manifest, meta = Manifest.read(self.path)
    return meta

  def create(
    self, records: Sequence[LeafRecord], structure: str, chunk_bytes: int, generations: int
  ) -> None:
    """Creates every generation of every item (no data written yet).

    The current generation is the last one, so that the first commit writes generation 0.
    """
    self.manifest = Manifest(list(records), structure, chunk_bytes, 0, generations - 1, generations)
    self.files.create_arrays(self.manifest.records, generations)

  def cache(self, hot: set[int]) -> None:
    """Marks the items held in RAM between steps (`LeafRecord.hot`): a resumed run's choice."""
    self.manifest.records = [dataclasses.replace(r, hot=r.index in hot) for r in self.records]

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
    return self.threads.submit(self.files.read, r, gen, start, stop, out)

  def read_item(self, index: int) -> np.ndarray:
    """Item `index` of the committed step, whole, in its shape (read now)."""
    r = self.records[index]
    return self.result(self.read(index, 0, r.size)).reshape(r.shape)

  def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs `fn(*args)` on the store's I/O threads (`IOThreads.submit`)."""
    return self.threads.submit(fn, *args)

  def result(self, future: Any) -> np.ndarray:
    return future.result()

  def check_files(self, r: LeafRecord, gen: int) -> str | None:
    """What is wrong with item `r`'s chunk files in generation `gen` (by size), or None."""
    return self.files.check_files(r, gen)

  def write_all(self, writes: Iterable[tuple[int, int, np.ndarray]]) -> None:
    """Runs `write(*args)` for each of `writes` on the I/O threads, a few at a time."""
    pending: list[concurrent.futures.Future] = []
    try:
      for args in writes:
        pending.append(self.threads.submit(self.write, *args))
        if len(pending) > self.threads.count:
          pending.pop(0).result()
    finally:
      # Every write done before anything is raised: none may land after the caller moves on.
      concurrent.futures.wait(pending)
    for p in pending:
      p.result()

  def write(self, index: int, start: int, value: np.ndarray) -> None:
    """Writes elements starting at `start` into the next generation, now (`ChunkFiles.write`)."""
    self.files.write(self.records[index], self.next_generation, start, value)

  def commit(self, step: int) -> None:
    """Makes the next generation current, atomically; its writes are done."""
    self.files.flush(self.fsync)
    gen, kept = self.manifest.committed(step)
    self.make_current(step, gen, kept)

  def make_current(self, step: int, gen: int, kept: list[tuple[int, int]]) -> None:
    """Writes `offlax.json` naming `step` in generation `gen` as committed, atomically."""
    try:
      write_metadata(self.path, self.metadata(step, gen, kept), fsync=self.fsync)
    except OSError as e:
      name = os.path.join(self.path, METADATA)
      raise errors.StoreError(f"cannot commit step {step} to {name}: {e}") from e
    self.manifest.step, self.manifest.generation, self.manifest.kept = step, gen, kept

  def metadata(self, step: int, gen: int, kept: list[tuple[int, int]]) -> dict:
    """The contents of `offlax.json` for this store with `step` current."""
    return self.manifest.to_json(step, gen, kept)


def progress_bar(items, enabled: bool, desc: str):
  """`items`, with a progress bar once the work has run `array_files.BAR_DELAY_S`."""
  if not enabled:
    return items
  from tqdm.auto import tqdm

  return tqdm(items, desc=desc, unit="slice", leave=False, delay=array_files.BAR_DELAY_S)
