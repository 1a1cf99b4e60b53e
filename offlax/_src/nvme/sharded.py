"""Stores of params sharded on a mesh: one store per device, their mesh record and agreement."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from offlax._src import errors
from offlax._src import layout as layout_lib
from offlax._src import sharding as sharding_lib
from offlax._src.nvme.copies import copy_store
from offlax._src.nvme.format import (
  MESH,
  METADATA,
  item_paths,
  mesh_text,
  read_json,
  shapes_record,
  shard_dir,
  write_json,
)
from offlax._src.nvme.rollback import rollback
from offlax._src.nvme.store import Store, progress_bar


def _shard_on(x: Any, device: Any) -> Any:
  """`device`'s shard of `x` (all of `x` if it has no sharding), on that device."""
  if isinstance(x, jax.Array):
    for s in x.addressable_shards:
      if s.device == device:
        return s.data
  return jax.device_put(x, device)


def _local_value(x: Any, mesh: Any, spec: P, device: Any) -> Any:
  """`device`'s block of a state value `x` sharded as `spec`: sliced on the host if numpy."""
  if isinstance(x, jax.Array):
    return _shard_on(sharding_lib.place(x, mesh, spec), device)
  x = np.asarray(x)
  index = jax.sharding.NamedSharding(mesh, spec).devices_indices_map(x.shape)[device]
  return jax.device_put(x[index], device)


_RESHARD = (
  "The NVMe tier resumes on the mesh and specs a store was written with (each device's store "
  "holds that mesh's shard); offlax.checkpoint.reshard(inner, params, path, new_path) writes a "
  "copy "
  "sharded for these params."
)


def _check_mesh(path: str, saved: dict, now: dict, *, shapes_only: bool = False) -> None:
  """Raises `StoreMismatchError` unless the store was written on this mesh, these specs."""
  for key, what in (("axis_names", "mesh axes"), ("axis_sizes", "mesh axis sizes")):
    if not shapes_only and saved.get(key) != now[key]:
      raise errors.StoreMismatchError(
        f"{path} was written on {mesh_text(saved)}; these params are on {mesh_text(now)} "
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
  all_processes(np.zeros(1))
  error: Exception | None = None
  try:
    result = _read_sharded(path, inner, params, spec, progress)
  except Exception as e:  # shared below, so that no process waits on this one
    error = e
  failed = all_processes(np.array([error is not None]))[:, 0]
  if error is not None:
    raise error
  if failed.any():
    raise errors.StoreError(
      f"{path}: reading the shards' stores failed in process(es) {np.flatnonzero(failed)}."
    )
  return result


def _read_sharded(path, inner, params, spec, progress) -> tuple[Any, int, dict[str, int]]:
  name = os.path.join(path, MESH)
  if not os.path.exists(name):
    raise errors.StoreError(f"{path} holds no sharded offlax store ({MESH}).")
  record = read_json(name)
  abstract = jax.eval_shape(inner.init, params)
  layout = layout_lib.StateLayout(abstract, spec)
  shapes = layout.split(abstract)
  paths = item_paths(abstract, layout)
  now = {"shapes": shapes_record(spec)}
  _check_mesh(path, record, now, shapes_only=True)
  try:
    sizes = dict(zip(record["axis_names"], record["axis_sizes"], strict=True))
    old_specs = tuple(sharding_lib.spec_of_entries(record["specs"][p]) for p in spec.paths)
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
  except (KeyError, TypeError, ValueError) as e:
    raise errors.StoreCorruptedError(f"{name} is malformed: {e!r}.") from e
  old = dataclasses.replace(spec, mesh=mesh, specs=old_specs)
  specs = sharding_lib.item_specs(old, layout, shapes, paths)
  values = [np.empty(x.shape, x.dtype) for x in shapes]
  steps = set()
  for position in progress_bar(range(mesh.size), progress, f"offlax: reading {path}"):
    store = Store(os.path.join(path, shard_dir(position)), fsync=False)
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


def _agree(path: str, shards: dict[int, Any]) -> None:
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
  gathered = all_processes(local)
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
    names = ", ".join(shard_dir(i) for i in missing) or "another process's"
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
          f"{path}: {shard_dir(i)} committed step {step}, another shard only step {low}, which "
          f"{shard_dir(i)} no longer keeps (NVMeTier(keep=...)): the shards cannot agree."
        ) from None


def all_processes(values: np.ndarray) -> np.ndarray:
  """`values` of every process, one row each (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return values[None]
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(values)).reshape(jax.process_count(), -1)


def init_sharded(
  tier: Any, inner: Any, params: Any, spec: layout_lib.ParamSpec, state: Any
) -> tuple[Any, Any]:
  """`NVMeTier.init` for params on a mesh: one store per device of this process, each its shard.

  A given `state` may hold numpy arrays (the whole state, as `read_sharded`
  returns it): each device's block is cut from them on the host.
  """
  mesh = spec.mesh
  if tier.keep is not None and tier.keep < 2:
    # Shards commit independently: after a crash between two commits, the ones
    # ahead go back a step, which they must still keep.
    raise errors.InvalidTierError(
      f"NVMeTier(keep={tier.keep}) on a mesh: each device's store commits on its own, so "
      "reopening after a crash may roll some back one step; that needs keep >= 2."
    )
  abstract = jax.eval_shape(inner.init, params)
  layout = layout_lib.StateLayout(abstract, spec)
  shapes = layout.split(abstract)
  specs = sharding_lib.item_specs(spec, layout, shapes, item_paths(abstract, layout))
  record = sharding_lib.describe(mesh, spec.specs, spec.paths)
  record["shapes"] = shapes_record(spec)
  name = os.path.join(tier.path, MESH)
  # Every process looks before any writes (processes may share `path`), and
  # all of them take the same decision, so none waits on one that gave up.
  looked = np.array([os.path.exists(name), os.path.exists(os.path.join(tier.path, METADATA))])
  found, plain = all_processes(looked).astype(bool).T
  if plain.any():
    raise errors.StoreMismatchError(
      f"{tier.path} holds the store of params on no mesh; these params are sharded on "
      f"{mesh_text(record)}. Open it with params on no mesh, or choose another path."
    )
  if found.any() and not tier.resume:
    raise errors.StoreExistsError(
      f"{tier.path} already holds a sharded offlax store; pass NVMeTier(..., resume=True) "
      "to continue from it, or choose another path."
    )
  if tier.resume and not found.all():
    where = "" if found.size == 1 else f" (missing in processes {np.flatnonzero(~found)})"
    raise errors.StoreError(f"NVMeTier(resume=True): no offlax store in {tier.path}{where}.")
  if tier.resume:
    _check_mesh(tier.path, read_json(name), record)
  else:
    try:
      os.makedirs(tier.path, mode=0o700, exist_ok=True)
      write_json(tier.path, MESH, record, fsync=tier.store.fsync)
    except OSError as e:
      raise errors.StoreError(f"cannot create the NVMe store {tier.path}: {e}") from e
  here = jax.process_index()
  positions = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == here]
  shards = {i: tier.shard_tier(i) for i in positions}
  if tier.resume:
    _agree(tier.path, shards)
  local = sharding_lib.local_spec(spec)
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
      per_shard[i] = layout.split(inner_state)
  except BaseException:
    for shard in shards.values():
      shard.store.close()
    tier.use_shards({})
    raise
  tier.use_shards(shards)  # its store, telemetry and chunk_bytes are then the first's
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
  step = sharding_lib.place(jnp.asarray(tier.store.step, jnp.int32), mesh, P())
  return layout.merge(items), step


def snapshot_shards(tier: Any, dest: str) -> int:
  """`NVMeTier.snapshot` on a mesh: this process's shards' stores copied, then the mesh record.

  Refuses shards at different steps (a step that failed on some of them).
  """
  local = [shard.store.step for shard in tier.shards.values()]
  steps = all_processes(np.array([min(local), max(local)], np.int64))
  if steps[:, 0].min() != steps[:, 1].max():
    # A step that failed on some shards (a write error) was committed by others.
    raise errors.StoreError(
      f"{tier.path}: the shards' stores are at steps {steps[:, 0].min()} to "
      f"{steps[:, 1].max()} (a step failed on some of them); close the tier and reopen it "
      "with NVMeTier(..., resume=True), which brings them to one step, then save."
    )
  os.makedirs(dest, mode=0o700, exist_ok=True)
  for i, shard in tier.shards.items():
    copy_store(shard.path, os.path.join(dest, shard_dir(i)), progress=tier.progress)
  write_json(dest, MESH, read_json(os.path.join(tier.path, MESH)), fsync=True)
  return tier.store.step
