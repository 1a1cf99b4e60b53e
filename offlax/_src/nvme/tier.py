"""The NVMe tier (`NVMeTier`): optimizer state in tensorstore arrays on a local disk.

The store format is in `offlax._src.nvme.format`; each step reads generation
`g` and writes `g + 1`, then commits (`store.Store.commit`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from offlax._src import coupling as coupling_lib
from offlax._src import errors, ffi, host_params
from offlax._src import layout as layout_lib
from offlax._src import schedule as schedule_lib
from offlax._src import telemetry as telemetry_lib
from offlax._src import tier as tier_lib
from offlax._src.host_tier import HostTier
from offlax._src.nvme.copies import copy_store
from offlax._src.nvme.direct_io import bound_malloc
from offlax._src.nvme.format import (
  DEFAULT_KEEP,
  MESH,
  METADATA,
  LeafRecord,
  is_key,
  item_paths,
  key_data,
  key_impl,
  mesh_text,
  read_json,
  shard_dir,
  stored_form,
  write_json,
)
from offlax._src.nvme.pipeline import wait_for_dispatched_steps
from offlax._src.nvme.rollback import rollback_locked
from offlax._src.nvme.sharded import all_processes, init_sharded
from offlax._src.nvme.step_io import DiskIO
from offlax._src.nvme.store import Store, progress_bar

DEFAULT_CHUNK = 16 * 2**20


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
    bound_malloc()
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

  # -- init ------------------------------------------------------------------

  def init(
    self, inner: Any, params: Any, spec: layout_lib.ParamSpec, state: Any = None
  ) -> tuple[Any, Any]:
    """Creates or resumes the store; returns (inner state with OnDisk items, step).

    A new store holds `inner.init(params)`, or `state` (an inner state with its
    values in memory) if given.
    """
    if spec.placeholder:
      # A tree without arrays (optax.tree.map_params' placeholder) has no state
      # to store: the inner state as is, with a step, has the state's structure.
      return inner.init(params), jnp.zeros((), jnp.int32)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
      raise errors.InvalidTierError(
        "NVMeTier: init writes the store, so it must run eagerly, not under jax.jit or "
        "jax.eval_shape."
      )
    if spec.mesh is not None:
      return init_sharded(self, inner, params, spec, state)
    if os.path.exists(os.path.join(self.path, MESH)):
      raise errors.StoreMismatchError(
        f"{self.path} holds the state of params sharded on a mesh ({MESH}: "
        f"{mesh_text(read_json(os.path.join(self.path, MESH)))}); these params are on no "
        "mesh. Put them on that mesh, or choose another path."
      )
    abstract = jax.eval_shape(inner.init, params)
    layout = layout_lib.StateLayout(abstract, spec)
    shapes = layout.split(abstract)
    paths = item_paths(abstract, layout)
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
    wait_for_dispatched_steps()
    if self.store._lock_fd is None or not self.store.exists():
      raise errors.StoreError(f"{self.path}: snapshot needs an open store (init it first).")
    dest = os.fspath(dest)
    if not self.shards:
      return copy_store(self.path, dest, progress=self.progress)
    local = [shard.store.step for shard in self.shards.values()]
    steps = all_processes(np.array([min(local), max(local)], np.int64))
    if steps[:, 0].min() != steps[:, 1].max():
      # A step that failed on some shards (a write error) was committed by others.
      raise errors.StoreError(
        f"{self.path}: the shards' stores are at steps {steps[:, 0].min()} to "
        f"{steps[:, 1].max()} (a step failed on some of them); close the tier and reopen it "
        "with NVMeTier(..., resume=True), which brings them to one step, then save."
      )
    os.makedirs(dest, mode=0o700, exist_ok=True)
    for i, shard in self.shards.items():
      copy_store(shard.path, os.path.join(dest, shard_dir(i)), progress=self.progress)
    write_json(dest, MESH, read_json(os.path.join(self.path, MESH)), fsync=True)
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

  def _committed_step(self) -> Any:
    try:
      with open(os.path.join(self.path, METADATA)) as f:
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
    rollback_locked(self.store, step, "NVMeTier(resume=True, step=...)")
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
      if x.ndim == 0 or o == coupling_lib.GLOBAL or is_key(x):
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
      key = key_impl(x)
      x = stored_form(x)
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
      for n, group in enumerate(
        progress_bar(groups, self.progress, f"offlax: writing {self.path}")
      ):
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
            yield r.index, 0, np.asarray(key_data(x))

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
      x = stored_form(x)
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
    for r in progress_bar(records, self.progress, f"offlax: resuming {self.path}"):
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
