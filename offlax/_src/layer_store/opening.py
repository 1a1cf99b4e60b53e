"""Making and opening a layer store (`LayerStore.create`, `LayerStore.open`): the checks first.

`create` checks the layers, the options and the folder before writing anything,
reserves the files' space, writes the layers (and their optimizer's initial
state) and writes the manifest last: a store is whole once it has one; a
failed create removes what it made. `open` checks the manifest and the files
against the layers and optimizer given, and goes back to a kept step if asked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from offlax._src import errors
from offlax._src.layer_store import backward, files, guards
from offlax._src.layer_store.commits import Commits
from offlax._src.layer_store.slots import Slots, write_initial


def create(
  cls: Any,
  path: str,
  layers: Any,
  *,
  optimizer: Any,
  keep: int,
  init_layer: Callable[[int], Any] | None,
  pool_layers: int | None,
  pool_bytes: int | None,
  fsync: bool,
  progress: bool,
  layers_path: str | None,
  update: str = "explicit",
  update_bytes: int | None = None,
  accumulator_dtype: Any = None,
) -> Any:
  """`LayerStore.create` (`cls`): its checks, the files, the layers written, the manifest."""
  records, n, treedef = files.layer_records(layers)
  accumulator = files.accumulator_dtype(accumulator_dtype, records)
  if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
    raise errors.InvalidOptionError(f"LayerStore: keep must be an int >= 1, got {keep!r}.")
  pool = files.pool_size(sum(r["slot"] for r in records), pool_layers, pool_bytes)  # before writing
  abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(layers)]
  if init_layer is not None and not all(abstract):
    raise errors.InvalidOptionError(
      "LayerStore.create: init_layer= makes the layers; pass them as jax.ShapeDtypeStructs."
    )
  state_records, state_treedef = guards.optimizer_state(optimizer, layers, path)
  update = backward.check_mode(update, optimizer, "LayerStore.create")
  guards.check_folder(path)
  manifest = {
    "format": files.FORMAT, "version": files.VERSION, "n_layers": n, "leaves": records,
    "state": state_records if optimizer is not None else None, "generations": keep + 1,
    "step": 0, "generation": 0, "kept": [[0, 0]],
    "layers_path": guards.layers_path(layers, layers_path),
  }  # fmt: skip
  if accumulator is not None:  # (absent: the layers' dtype, as a store made before it)
    manifest["accumulator_dtype"] = accumulator
  manifest["crc"] = {str(g): files.no_crcs(manifest) for g in range(keep + 1)}
  made = not os.path.exists(path)
  try:
    files.make_files(path, manifest, reserve=init_layer is not None or not any(abstract))
    commits = Commits(path, manifest, fsync)
    parts = Slots(path, records, state_records, commits)  # under the store's lock
    store = _open(cls, parts, treedef, optimizer, state_treedef, parts, commits, pool, progress,
                  update, update_bytes)  # fmt: skip
    try:
      if init_layer is not None:
        write_initial(parts, treedef, optimizer, init_layer, progress)
      elif not all(abstract):
        host = [None if a else np.asarray(jax.device_get(x))
                for a, x in zip(abstract, jax.tree.leaves(layers), strict=True)]  # fmt: skip
        layer = lambda i: [None if x is None else x[i] for x in host]
        write_initial(parts, treedef, optimizer, layer, progress)
      files.write_manifest(path, manifest)  # the manifest last: a store is whole
    except BaseException:
      store.close()
      raise
  except BaseException:
    files.remove_files(path, manifest, made)
    raise
  return store


def open_store(
  cls: Any,
  path: str,
  like: Any,
  *,
  optimizer: Any,
  step: int | None,
  pool_layers: int | None,
  pool_bytes: int | None,
  fsync: bool,
  progress: bool,
  update: str = "explicit",
  update_bytes: int | None = None,
) -> Any:
  """`LayerStore.open` (`cls`): the manifest and files checked, at `step` if given."""
  manifest = files.read_manifest(path)
  records, n, treedef = files.layer_records(like)
  if manifest.get("n_layers") != n:
    raise errors.StoreMismatchError(
      f"LayerStore.open: {path} holds {manifest.get('n_layers')} layers, expected {n}."
    )
  records = files.check_records(path, "param", manifest["leaves"], records)
  state_records, state_treedef = guards.optimizer_state(optimizer, like, path, manifest)
  update = backward.check_mode(update, optimizer, "LayerStore.open")
  manifest["layers_path"] = guards.opened_path(path, manifest, like)
  pool = files.pool_size(sum(r["slot"] for r in records), pool_layers, pool_bytes)
  commits = Commits(path, manifest, fsync)
  parts = Slots(path, records, state_records, commits)  # under the store's lock
  store = _open(cls, parts, treedef, optimizer, state_treedef, parts, commits, pool, progress,
                update, update_bytes)  # fmt: skip
  try:
    parts.check_sizes()
    if step is not None and step != commits.step:
      commits.go_to_step(step)
  except BaseException:
    store.close()
    raise
  return store


def _open(cls: Any, parts: Slots, *args: Any) -> Any:
  """``cls(*args)``: the store of `parts`, which are closed (the lock too) if that fails."""
  try:
    return cls(*args)
  except BaseException:
    parts.close()
    raise
