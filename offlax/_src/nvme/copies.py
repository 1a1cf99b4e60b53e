"""Copies of a store's committed step (snapshots for checkpoints), plain or sharded."""

from __future__ import annotations

import os

import jax

from offlax._src import errors
from offlax._src.nvme import direct_copy
from offlax._src.nvme.direct_io import syncfs
from offlax._src.nvme.format import (
  MESH,
  METADATA,
  read_json,
  shard_dir,
  write_json,
  write_metadata,
)
from offlax._src.nvme.store import Store


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
  if os.path.exists(os.path.join(dest, METADATA)):
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
        source = store.files.array_path(r.index, g)
        target = os.path.join(dest, os.path.relpath(source, store.path))
        if g == gen:
          pairs += direct_copy.tree_pairs(source, target)
        else:  # only the array's metadata: its chunks belong to no step the copy keeps
          os.makedirs(target, mode=0o700)
          pairs.append((os.path.join(source, "zarr.json"), os.path.join(target, "zarr.json")))
    direct_copy.copy_files(pairs, progress=progress, desc=f"offlax: copying {src} -> {dest}")
    syncfs(dest)
    write_metadata(dest, store.metadata(store.step, gen, [(store.step, gen)]), fsync=True)
  except OSError as e:
    raise errors.StoreError(f"cannot copy the store {src} to {dest}: {e}") from e
  return store.step


def copy_sharded(src: str, dest: str, *, progress: bool = True) -> int:
  """`copy_store` for a sharded store: this process's shards (as recorded), then the record."""
  record = read_json(os.path.join(src, MESH))
  here = jax.process_index()
  mine = [i for i, p in enumerate(record.get("processes", [])) if p == here]
  step = 0
  os.makedirs(dest, mode=0o700, exist_ok=True)
  for i in mine:
    step = copy_store(
      os.path.join(src, shard_dir(i)), os.path.join(dest, shard_dir(i)), progress=progress
    )
  write_json(dest, MESH, record, fsync=True)
  return step
