"""Copies of a store's committed step (snapshots for checkpoints), plain or sharded."""

from __future__ import annotations

import os
import shutil

import jax

from offlax._src import errors
from offlax._src.nvme.direct_io import _syncfs
from offlax._src.nvme.format import (
  _MESH,
  _METADATA,
  _read_json,
  _shard_dir,
  _write_json,
  _write_metadata,
)
from offlax._src.nvme.store import Store, _progress


def copy_store(src: str, dest: str, *, progress: bool = True) -> int:
  """Copies the committed step of the store at `src` into a new store at `dest`.

  File by file in the kernel (`sendfile`, into owner-only files: no state in
  this process's RAM): the committed generation's arrays, the other
  generations' array metadata, then `offlax.json` last and atomically, after a
  flush of `dest`, so a crash leaves no store at `dest` rather than a torn one.
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
    for r in _progress(store.records, progress, f"offlax: copying {src} -> {dest}"):
      for g in range(store.generations):
        source = store._array_path(r.index, g)
        target = os.path.join(dest, os.path.relpath(source, store.path))
        if g == gen:
          shutil.copytree(source, target, copy_function=_copy_private)
        else:  # only the array's metadata: its chunks belong to no step the copy keeps
          os.makedirs(target, mode=0o700)
          _copy_private(os.path.join(source, "zarr.json"), os.path.join(target, "zarr.json"))
    _syncfs(dest)
    _write_metadata(dest, store.metadata(store.step, gen, [(store.step, gen)]), fsync=True)
  except OSError as e:
    raise errors.StoreError(f"cannot copy the store {src} to {dest}: {e}") from e
  return store.step


def _copy_private(src: str, dst: str) -> None:
  """Copies a file in the kernel (`sendfile`, as `shutil.copyfile`) into a new owner-only file."""
  with open(src, "rb") as f:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
      offset, size = 0, os.fstat(f.fileno()).st_size
      while offset < size:
        n = os.sendfile(fd, f.fileno(), offset, size - offset)
        if n == 0:
          raise OSError(f"{src} ended after {offset} of {size} bytes")
        offset += n
    finally:
      os.close(fd)


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
