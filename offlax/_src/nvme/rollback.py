"""An earlier committed step of an NVMe store made current again (`offlax.checkpoint.rollback`)."""

from __future__ import annotations

import os

import numpy as np

from offlax._src import errors
from offlax._src.layer_store import files as layer_files
from offlax._src.nvme.format import LAYERS, is_sharded
from offlax._src.nvme.store import Store


def rollback(path: str | os.PathLike, step: int) -> int:
  """Makes an earlier committed step of the NVMe store at `path` current, atomically.

  The store keeps its last `keep` committed steps (`NVMeTier(keep=...)`);
  rolling back drops the steps after `step`, and `NVMeTier(path, resume=True)`
  then continues from `step`. Takes the store's lock, so it refuses a store a
  training process has open, and checks that every chunk file of `step` is
  there with its size (`offlax.checkpoint.inspect_store(path, verify=True)` also checks
  their checksums).

  For a sharded store (params on a mesh) `path` may be its root: every shard's
  store under it is rolled back, after checking that all of them keep `step`.
  For an `offlax.LayerStore` (``LayerStore.create(keep=...)``), as
  ``LayerStore.open(path, like, step=step)`` does: the store's files of `step`
  are checked for their sizes, and `LayerStore.open` then resumes from it.

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
  if os.path.exists(os.path.join(os.fspath(path), LAYERS)):
    return layer_files.rollback(os.fspath(path), step)
  store = Store(os.fspath(path), fsync=True)
  if not store.exists():
    raise errors.StoreError(f"rollback: no offlax store in {store.path}.")
  store.lock()
  try:
    store.read_metadata()
    rollback_locked(store, step, "rollback")
  finally:
    store.close()
  return int(step)


def rollback_locked(store: Store, step: int, where: str) -> None:
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
