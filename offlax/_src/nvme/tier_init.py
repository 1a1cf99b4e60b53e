"""`NVMeTier.init`'s store: created with the inner state, or resumed and checked against it.

Both decide per state item how it is chunked (aligned with the schedule's
pieces) and whether it stays in RAM between steps (`cache_bytes`), and return
the state's items: arrays for those in RAM, `OnDisk` placeholders for the rest.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from offlax._src import coupling as coupling_lib
from offlax._src import errors, host_params
from offlax._src import layout as layout_lib
from offlax._src import schedule as schedule_lib
from offlax._src import sharding as sharding_lib
from offlax._src import telemetry as telemetry_lib
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
  stored_form,
)
from offlax._src.nvme.manifest import Manifest
from offlax._src.nvme.rollback import rollback_locked
from offlax._src.nvme.store import progress_bar

if TYPE_CHECKING:
  from offlax._src.host_tier import HostTier
  from offlax._src.nvme.tier import NVMeTier


def open_store(tier: NVMeTier, inner, params, spec: layout_lib.ParamSpec, state) -> tuple[Any, Any]:
  """`NVMeTier.init` of params on no mesh: the store at `tier.path` locked, then created or
  resumed; returns (inner state with OnDisk items, step)."""
  if os.path.exists(os.path.join(tier.path, MESH)):
    raise errors.StoreMismatchError(
      f"{tier.path} holds the state of params sharded on a mesh ({MESH}: "
      f"{mesh_text(read_json(os.path.join(tier.path, MESH)))}); these params are on no "
      "mesh. Put them on that mesh, or choose another path."
    )
  abstract = jax.eval_shape(inner.init, params)
  layout = layout_lib.StateLayout(abstract, spec)
  shapes = layout.split(abstract)
  paths = item_paths(abstract, layout)
  tier.store.lock()
  try:
    if tier.store.exists():
      if not tier.resume:
        raise errors.StoreExistsError(
          f"{tier.path} already holds an offlax store (step {committed_step(tier.path)}); pass "
          "NVMeTier(..., resume=True) to continue from it, or choose another path."
        )
      items = resume(tier, shapes, paths, layout)
    else:
      if tier.resume:
        raise errors.StoreError(f"NVMeTier(resume=True): no offlax store in {tier.path}.")
      values = None if state is None else layout.split(state)
      items = create(tier, inner, params, spec, layout, shapes, paths, values)
  except BaseException:
    tier.store.close()  # release the lock; nothing was committed
    raise
  telemetry_lib.check_cache(tier.store.records, tier.cache_bytes)
  return layout.merge(items), jnp.asarray(tier.store.step, jnp.int32)


def is_abstract(params) -> bool:
  """Whether `params` are `jax.ShapeDtypeStruct`s or traced (under `jax.eval_shape`, `jax.jit`)."""
  abstract = (jax.core.Tracer, jax.ShapeDtypeStruct)
  return any(isinstance(x, abstract) for x in jax.tree.leaves(params))


def abstract_store(tier: NVMeTier, inner, params, spec: layout_lib.ParamSpec) -> tuple[Any, Any]:
  """`NVMeTier.init` of abstract params: the state a new store would give, nothing written.

  Params as `jax.ShapeDtypeStruct`s give the state as specs: `OnDisk` for the
  items on disk, `ShapeDtypeStruct`s placed as `init` places the others (host
  memory, or the device for what the host tier keeps there). Traced params
  (under `jax.eval_shape`) give the same as traced values. The store's records
  (each item's chunking, whether it stays in RAM) are made as `create` makes
  them and kept in memory only, so that a step traced with this state (a
  compile, `offlax.compile_for_gpu`) reads them; the directory is not touched,
  and such a step cannot run (`pipeline.Reader` refuses a store not open).
  """
  if spec.mesh is not None:
    raise errors.InvalidTierError(
      "NVMeTier: init of abstract params (jax.ShapeDtypeStructs, or under jax.eval_shape or "
      "jax.jit) on a mesh: the state's specs are made for params on one device only. Init "
      "with the params' arrays."
    )
  abstract = jax.eval_shape(inner.init, params)
  layout = layout_lib.StateLayout(abstract, spec)
  shapes = layout.split(abstract)
  recorded = records(tier, shapes, item_paths(abstract, layout), layout)
  keep = DEFAULT_KEEP if tier.keep is None else tier.keep
  tier.store.manifest = Manifest(recorded, str(layout.treedef), tier.chunk_bytes, 0, keep, keep + 1)
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
    values = layout.split(inner.init(params))
    items = [entry(tier.host, r, x) for r, x in zip(recorded, values, strict=True)]
    return layout.merge(items), jnp.zeros((), jnp.int32)
  device = jax.local_devices()[0]
  mesh = sharding_lib.one_device_target(params, device) or sharding_lib.one_device_mesh(device)

  def spec_of(x, kind=None):  # a NamedSharding: JAX types its host memory kind as host memory
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  items = [
    layout_lib.OnDisk(r.index, r.shape, r.dtype)
    if not r.hot
    else spec_of(x, tier.host.memory_kind if tier.host.offloads(x) else None)
    for r, x in zip(recorded, shapes, strict=True)
  ]
  return layout.merge(items), spec_of(jax.ShapeDtypeStruct((), jnp.int32))


def hot_items(shapes, layout, cache_bytes: int) -> set[int]:
  """The items held in RAM between steps: the smallest, up to `cache_bytes`.

  Scalars, global items and PRNG keys always stay in RAM.
  """
  order = sorted(range(len(shapes)), key=lambda j: layout_lib.nbytes(shapes[j]))
  hot, budget = set(), cache_bytes
  for j in order:
    x, o = shapes[j], layout.owners[j]
    if x.ndim == 0 or o == coupling_lib.GLOBAL or is_key(x):
      hot.add(j)
    elif layout_lib.nbytes(x) <= budget:
      hot.add(j)
      budget -= layout_lib.nbytes(x)
  return hot


def records(tier: NVMeTier, shapes, paths, layout) -> list[LeafRecord]:
  """What a new store records of each item: its chunking, and whether it stays in RAM."""
  leaf_bytes = layout_lib.leaf_bytes(shapes, layout.owners, len(layout.spec.shapes), tier.offloads)
  hot = hot_items(shapes, layout, tier.cache_bytes)
  out = []
  for j, x in enumerate(shapes):
    key = key_impl(x)
    x = stored_form(x)
    o = layout.owners[j]
    size = int(np.prod(x.shape, dtype=np.int64))
    chunk = size
    if o != coupling_lib.GLOBAL and leaf_bytes[o] > tier.chunk_bytes and x.ndim:
      # Align storage chunks with the pieces the schedule cuts this leaf into.
      flat, rows, step = schedule_lib.split_step(tuple(x.shape), leaf_bytes[o], tier.chunk_bytes)
      chunk = step * (size // rows)
    out.append(
      LeafRecord(j, paths[j], tuple(x.shape), np.dtype(x.dtype).name, chunk, j in hot, key)
    )
  return out


def entry(host: HostTier, r: LeafRecord, x: Any) -> Any:
  """What the state holds for item `r` of value `x`: the array, placed, or OnDisk."""
  if not r.hot:
    return layout_lib.OnDisk(r.index, r.shape, r.dtype)
  return host.to_host(x) if host.offloads(x) else x


def create(tier: NVMeTier, inner, params, spec, layout, shapes, paths, values=None) -> list[Any]:
  """Writes a new store of `inner.init(params)` (or of `values`, the state's items) and commits
  it as step 0; returns the state's items."""
  recorded = records(tier, shapes, paths, layout)
  keep = DEFAULT_KEEP if tier.keep is None else tier.keep
  tier.store.create(recorded, str(layout.treedef), tier.chunk_bytes, keep + 1)
  slots = jax.tree.leaves(params, is_leaf=layout_lib.is_masked)
  groups = _init_groups(layout, shapes, tier.chunk_bytes, len(slots))
  init = jax.jit(functools.partial(host_params.init, inner.init))
  items: list[Any] = [None] * len(shapes)

  whole = values

  def writes():  # computes each group as the writes of the one before proceed
    nonlocal whole
    for n, group in enumerate(progress_bar(groups, tier.progress, f"offlax: writing {tier.path}")):
      group_values = whole
      if group_values is None and len(groups) > 1:
        masked = [s if i in group else layout_lib.MASKED() for i, s in enumerate(slots)]
        try:
          group_values = layout.split(init(spec.treedef.unflatten(masked)))
        except (ValueError, TypeError):  # an init that takes no masked leaves (optax.sm3)
          group_values = None
      if group_values is None:  # the whole state at once
        whole = group_values = layout.split(init(params))
      for j, (x, r) in enumerate(zip(group_values, recorded, strict=True)):
        owner = layout.owners[j]
        if n == 0 if owner == coupling_lib.GLOBAL else owner in group:
          items[j] = entry(tier.host, r, x)
          yield r.index, 0, np.asarray(key_data(x))

  tier.store.write_all(writes())
  tier.store.commit(0)
  return items


def resume(tier: NVMeTier, shapes, paths, layout) -> list[Any]:
  """Opens the existing store at the step asked for (`NVMeTier(step=)`), checks it holds this
  optimizer's state, reads the items that stay in RAM; returns the state's items."""
  store = tier.store
  store.read_metadata()
  if tier.step is not None and tier.step != store.step:
    _go_to_step(tier, tier.step)
  elif tier.step is None:
    # The store commits every step, so after a kill it may be ahead of the
    # params' last checkpoint; only the caller knows the params' step.
    logging.getLogger("offlax").warning(
      "%s: resumed at its committed step %d. offlax cannot check that your params are at "
      "step %d too; pass NVMeTier(..., resume=True, step=<your params' step>) to check it "
      "(and roll back a store that is ahead).",
      tier.path, store.step, store.step,
    )  # fmt: skip
  if store.chunk_bytes != tier.chunk_bytes:
    if tier.options.chunk_bytes is not None:
      raise errors.StoreMismatchError(
        f"{tier.path} was created with chunk_bytes={store.chunk_bytes}; got "
        f"chunk_bytes={tier.chunk_bytes}. A store keeps its chunking: omit chunk_bytes."
      )
    tier.use_chunk_bytes(store.chunk_bytes)
  if tier.keep is not None and tier.keep + 1 != store.generations:
    raise errors.StoreMismatchError(
      f"{tier.path} was created with keep={store.generations - 1}; got keep={tier.keep}. "
      "A store keeps its generations: omit keep."
    )
  _check_records(tier.path, store.records, shapes, paths)
  # The cache is this run's choice (`cache_bytes`), not the store's: which items
  # stay in RAM is chosen again. Every item is on disk after each commit, and
  # its chunking does not depend on it.
  store.cache(hot_items(shapes, layout, tier.cache_bytes))
  items = []
  for r in progress_bar(store.records, tier.progress, f"offlax: resuming {tier.path}"):
    if r.hot:
      value = jnp.asarray(store.read_item(r.index))
      if r.key is not None:
        value = jax.random.wrap_key_data(value, impl=r.key)
      items.append(entry(tier.host, r, value))
    else:
      items.append(layout_lib.OnDisk(r.index, r.shape, r.dtype))
  return items


def _check_records(path: str, recorded: list[LeafRecord], shapes, paths) -> None:
  """Raises `StoreMismatchError` unless the store holds this optimizer's state items."""
  if len(recorded) != len(shapes):
    raise errors.StoreMismatchError(
      f"{path} holds {len(recorded)} state arrays; this optimizer has {len(shapes)}."
    )
  for r, x, item_path in zip(recorded, shapes, paths, strict=True):
    x = stored_form(x)
    want = (item_path, tuple(x.shape), np.dtype(x.dtype).name)
    if (r.path, r.shape, r.dtype) != want:
      raise errors.StoreMismatchError(
        f"{path}: state leaf {r.path} is stored as {r.dtype}{list(r.shape)}; this "
        f"optimizer has {want[0]} as {want[2]}{list(want[1])}."
      )


def committed_step(path: str) -> Any:
  """The step `offlax.json` at `path` names, for a message ("unknown" if unreadable)."""
  try:
    with open(os.path.join(path, METADATA)) as f:
      return json.load(f)["step"]
  except (OSError, ValueError, KeyError):  # only for the message
    return "unknown"


def _go_to_step(tier: NVMeTier, step: int) -> None:
  """Makes `step` (the caller's params' step) current, or raises: see `NVMeTier(step=...)`."""
  store = tier.store
  kept = sorted(s for s, _ in store.kept)
  if step not in kept:
    raise errors.StoreMismatchError(
      f"{tier.path} has committed step {store.step} and keeps steps {kept}, but the "
      f"params are at step {step} (NVMeTier(step={step})): training on would mix params and "
      "optimizer state of different steps. Restore the store of that step from the "
      "checkpoint holding the params (offlax.checkpoint.NVMeStoreRestore; save it with "
      "offlax.checkpoint.NVMeStoreSave(tier) beside the params), or resume the params from step "
      f"{store.step}."
    )
  rollback_locked(store, step, "NVMeTier(resume=True, step=...)")
  logging.getLogger("offlax").warning(
    "%s: rolled back to step %d, the params' step (the store had committed step %d).",
    tier.path, step, kept[-1],
  )  # fmt: skip


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
