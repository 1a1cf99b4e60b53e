"""The NVMe tier (`NVMeTier`): optimizer state in tensorstore arrays on a local disk.

The store format is in `offlax._src.nvme.format`; each step reads generation
`g` and writes `g + 1`, then commits (`store.Store.commit`). The tier's options
are `tier_options.TierOptions`; `init` creates or resumes its store
(`tier_init`, or `sharded` on a mesh); a step's I/O is `step_io.DiskIO`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from offlax._src import errors, ffi
from offlax._src import layout as layout_lib
from offlax._src import telemetry as telemetry_lib
from offlax._src import tier as tier_lib
from offlax._src.host_tier import HostTier
from offlax._src.nvme import tier_init
from offlax._src.nvme.copies import copy_store
from offlax._src.nvme.direct_io import bound_malloc
from offlax._src.nvme.format import shard_dir
from offlax._src.nvme.pipeline import wait_for_dispatched_steps
from offlax._src.nvme.sharded import init_sharded, snapshot_shards
from offlax._src.nvme.step_io import DiskIO
from offlax._src.nvme.store import Store
from offlax._src.nvme.tier_options import DEFAULT_CHUNK, TierOptions


class NVMeTier(tier_lib.Tier):
  """Keeps optimizer state on a local disk, with small leaves cached in RAM.

  Each state array is a tensorstore zarr3 array under `path` (see
  `offlax._src.nvme.format` for the layout and the commit protocol). Arrays that fit in
  `cache_bytes` (smallest first; scalars always) stay in host memory between
  steps, like the host tier; the others are read from disk slice by slice
  inside the jitted step, by `io_callback`s that read `readahead` slices ahead
  of the one being updated and hand each updated slice to I/O threads to
  write. Each step ends with an atomic commit; the whole state, cached arrays
  included, is on disk after it.

  With params sharded on a mesh, `path` holds one store per device, each with
  only that device's shard (`offlax._src.nvme.format`); the options apply to each
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
    keep: committed steps kept on disk, for `offlax.checkpoint.rollback` (default 2: the
      current one and the one before); the store holds `keep + 1` copies of
      the state. Fixed when the store is created, like `chunk_bytes`.
    log_every: log a one-line `offlax.stats` summary through the `offlax`
      logger (INFO) every this many steps; None: never.
    step: with `resume`, the step the caller's params are at (e.g. the step of
      the model checkpoint being restored). The store must be at that step: one
      it keeps is made current again (as `offlax.checkpoint.rollback`: the steps after it
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

  per_device: ClassVar[bool] = True  # on a mesh, each device streams its own store

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
    self.options = TierOptions(
      path, cache_bytes, chunk_bytes, resume, fsync, progress, readahead, keep, log_every, step
    )
    self.host = HostTier(chunk_bytes=self.options.chunk_bytes or DEFAULT_CHUNK)
    bound_malloc()
    self.telemetry = telemetry_lib.DiskTelemetry(log_every)
    self.store = Store(self.path, fsync=bool(fsync), telemetry=self.telemetry, owner=self)
    # Params on a mesh: the tier of each of this process's devices' shards, by
    # mesh position (`shard_NNNNN`); `store` and `telemetry` are then the first's.
    self.shards: dict[int, NVMeTier] = {}

  # -- the options (`TierOptions`: as given) --------------------------------------

  @property
  def path(self) -> str:
    """The store directory."""
    return os.fspath(self.options.path)

  @property
  def cache_bytes(self) -> int:
    """Bytes of state held in RAM between steps."""
    return int(self.options.cache_bytes)

  @property
  def resume(self) -> bool:
    """Whether `init` opens an existing store."""
    return bool(self.options.resume)

  @property
  def progress(self) -> bool:
    """Whether the initial write, a resume and a snapshot show a progress bar."""
    return bool(self.options.progress)

  @property
  def readahead(self) -> int:
    """Slices read ahead of the one being updated."""
    return int(self.options.readahead)

  @property
  def keep(self) -> int | None:
    """Committed steps kept on disk, as given (None: the store's, or `DEFAULT_KEEP`)."""
    return self.options.keep

  @property
  def step(self) -> int | None:
    """With `resume`, the step the caller's params are at; None: the store's."""
    return None if self.options.step is None else int(self.options.step)

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

  def check_devices(self, devices: Any) -> None:
    """Raises `MemoryKindError` unless every device offers host memory for the cache."""
    self.host.check_devices(devices)

  def open_io(self, items, offloaded, step, *, mesh_plan=None, shard=None) -> DiskIO:
    """The callbacks of one step: reads and writes of the store, then the commit."""
    return DiskIO(self, items, offloaded, step, shard)

  def stats(self, state: Any, *, sync: bool = False) -> telemetry_lib.OffloadStats:
    """Resident bytes per tier, the committed step, and the last completed step's I/O."""
    resident = tier_lib.resident(state.inner_state)
    moved = resident["host"] + resident["nvme"]
    if sync:
      jax.effects_barrier()
    on_disk = sum(r.nbytes for r in self.store.records)
    last = self.telemetry.last
    base = telemetry_lib.OffloadStats(
      self.store.step, resident["device"], resident["host"], on_disk, moved, moved
    )
    return base if last is None else base._replace(**last._asdict())

  def check_config(self, state: Any, devices: Any) -> None:
    """Warns about the slice size, the pinned host pool, and huge pages on the CPU."""
    s = self.stats(state)
    telemetry_lib.check_chunk(self.chunk_bytes, DEFAULT_CHUNK, s.h2d_bytes)
    for platform in {d.platform for d in devices}:
      telemetry_lib.check_pinned(s.host_bytes, platform)
      if platform == "cpu":  # (builds the native library)
        telemetry_lib.check_hugepages(s.nvme_bytes, platform, native=ffi.available())

  def close(self) -> None:
    """Waits for steps in flight (`jax.effects_barrier`) and releases the store's lock."""
    try:
      wait_for_dispatched_steps()
    except jax.errors.JaxRuntimeError:
      pass  # a failed step's error: its own outputs raise it, not closing the store
    for shard in self.shards.values():
      shard.store.close()
    self.store.close()

  def init(
    self, inner: Any, params: Any, spec: layout_lib.ParamSpec, state: Any = None
  ) -> tuple[Any, Any]:
    """Creates or resumes the store; returns (inner state with OnDisk items, step).

    A new store holds `inner.init(params)`, or `state` (an inner state with its
    values in memory) if given; abstract params, the state it would hold
    (`tier_init.abstract_store`).
    """
    if spec.placeholder:
      # A tree without arrays (optax.tree.map_params' placeholder) has no state
      # to store: the inner state as is, with a step, has the state's structure.
      return inner.init(params), jnp.zeros((), jnp.int32)
    if tier_init.is_abstract(params):  # a new store's state, nothing written: for a compile
      return tier_init.abstract_store(self, inner, params, spec)
    if spec.mesh is not None:
      return init_sharded(self, inner, params, spec, state)
    return tier_init.open_store(self, inner, params, spec, state)

  def snapshot(self, dest: str) -> int:
    """Copies the last committed step's store into `dest`, a new directory; returns the step.

    `NVMeTier(dest, resume=True)` opens the copy. Waits for steps in flight;
    run it between steps (an orbax save of `offlax.checkpoint.NVMeStoreSave(tier)` does).
    On a mesh each process copies its own shards' stores, then the mesh record.
    """
    wait_for_dispatched_steps()
    if not self.store.locked or not self.store.exists():
      raise errors.StoreError(f"{self.path}: snapshot needs an open store (init it first).")
    dest = os.fspath(dest)
    if not self.shards:
      return copy_store(self.path, dest, progress=self.progress)
    return snapshot_shards(self, dest)

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
      return jnp.asarray(self.store.read_item(x.index)) if isinstance(x, layout_lib.OnDisk) else x

    jax.effects_barrier()  # the last step's commit may still be running
    return jax.tree.map(value, state.inner_state, is_leaf=layout_lib.is_slot)

  def use_chunk_bytes(self, chunk_bytes: int) -> None:
    """Takes a resumed store's `chunk_bytes` (the slice budget), which the store keeps."""
    self.host = dataclasses.replace(self.host, chunk_bytes=chunk_bytes)

  def shard_tier(self, position: int) -> NVMeTier:
    """The tier of mesh position `position`'s store (`shard_NNNNN` under `path`): these options."""
    return type(self)(os.path.join(self.path, shard_dir(position)), **self.options.keywords())

  def use_shards(self, shards: dict[int, NVMeTier]) -> None:
    """Makes `shards` (mesh position -> its store's tier) this tier's, on a mesh.

    `store`, `telemetry` and `chunk_bytes` are then the first shard's; no shards:
    the tier has none again (a failed init), and keeps its own.
    """
    self.shards = shards
    if shards:
      first = next(iter(shards.values()))
      self.store, self.telemetry = first.store, first.telemetry
      self.host = first.host  # a resumed store's chunk_bytes
