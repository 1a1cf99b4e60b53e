"""Offloaded state on a `jax.sharding.Mesh`: which axes are sharded, and ZeRO-1 specs.

`offload` keeps each offloaded state array on the params' mesh with the
params' `PartitionSpec` (or, with `HostTier(shard_axis=...)`, also sharded over
that axis, ZeRO-1 style), in host memory: each device's host RAM holds only its
shard. Slices are cut along an axis that neither spec shards, so every device
slices its own shard and no slice needs communication.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from offlax._src import coupling as coupling_lib
from offlax._src import errors
from offlax._src import layout as layout_lib


def _axes(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def padded(spec: PartitionSpec | None, ndim: int) -> list[Any]:
  entries = list(spec or ())
  return entries + [None] * (ndim - len(entries))


def state_spec(
  shape: tuple[int, ...], spec: PartitionSpec | None, mesh: Mesh, shard_axis: str | None
) -> PartitionSpec:
  """The spec of an offloaded state array shaped like a param of spec `spec`.

  With `shard_axis` (ZeRO-1), the first dimension the param's spec leaves
  unsharded and `shard_axis` divides is also sharded over it; failing that,
  the first sharded dimension whose shards it still divides is sharded over
  both (e.g. ``("model", "data")``). An array with neither keeps the param's
  spec (replicated over `shard_axis`).
  """
  entries = padded(spec, len(shape))
  used = {a for e in entries for a in _axes(e)}
  if shard_axis is None or shard_axis in used:
    return PartitionSpec(*entries)
  for free in (True, False):
    for i, (n, e) in enumerate(zip(shape, entries, strict=True)):
      if (e is None) != free:
        continue
      axes = (*_axes(e), shard_axis)
      size = math.prod(mesh.shape[a] for a in axes)
      if n % size == 0 and n >= size:
        entries[i] = shard_axis if free else axes
        return PartitionSpec(*entries)
  return PartitionSpec(*entries)


def cut_axis(shape: tuple[int, ...], *specs: PartitionSpec | None) -> int | None:
  """The first axis longer than 1 that none of `specs` shards, or None."""
  for i, n in enumerate(shape):
    if n > 1 and all(padded(s, len(shape))[i] is None for s in specs):
      return i
  return None


def shards(spec: PartitionSpec | None, mesh: Mesh, ndim: int) -> int:
  """How many pieces `spec` cuts an array into (its bytes per device: total / this)."""
  return math.prod(mesh.shape[a] for e in padded(spec, ndim) for a in _axes(e))


def local_shape(shape: tuple[int, ...], spec: PartitionSpec | None, mesh: Mesh) -> tuple[int, ...]:
  """The shape of each device's shard of an array of `shape` sharded as `spec`."""
  return tuple(
    n // math.prod(mesh.shape[a] for a in _axes(e))
    for n, e in zip(shape, padded(spec, len(shape)), strict=True)
  )


def uneven_axis(shape: tuple[int, ...], spec: PartitionSpec | None, mesh: Mesh) -> int | None:
  """The first axis of `shape` that `spec`'s mesh axes do not divide evenly, or None."""
  for i, (n, e) in enumerate(zip(shape, padded(spec, len(shape)), strict=True)):
    if n % math.prod(mesh.shape[a] for a in _axes(e)):
      return i
  return None


def describe(mesh: Mesh, specs: Sequence[PartitionSpec | None], paths: Sequence[str]) -> dict:
  """What a store records of the mesh its state was sharded on (JSON-ready).

  `processes` lists the process owning each mesh position (row-major over the
  axes, as `mesh.devices.flat` and `jax.lax.axis_index(mesh.axis_names)`).
  """
  return {
    "axis_names": [str(a) for a in mesh.axis_names],
    "axis_sizes": [int(n) for n in mesh.devices.shape],
    "specs": {p: spec_entries(s) for p, s in zip(paths, specs, strict=True)},
    "processes": [int(d.process_index) for d in mesh.devices.flat],
  }


def spec_entries(spec: PartitionSpec | None) -> list[Any]:
  """`spec` as JSON (None, an axis name or a list of them per dimension), without trailing Nones.

  P('data', None) and P('data') shard alike, so both give ["data"].
  """
  entries = [list(e) if isinstance(e, tuple) else e for e in (spec or ())]
  while entries and entries[-1] is None:
    entries.pop()
  return entries


def spec_of_entries(entries: Sequence[Any]) -> PartitionSpec:
  """The inverse of `spec_entries`."""
  return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def block_index(
  shape: tuple[int, ...], spec: PartitionSpec, axis_sizes: dict[str, int], position: int
) -> tuple[slice, ...]:
  """Which block of an array of `shape` sharded as `spec` mesh position `position` holds.

  Positions are row-major over the mesh axes (in `axis_sizes`' order); a
  dimension sharded over several axes is split major to minor in the order
  the spec names them, as JAX does.
  """
  coords = dict(
    zip(axis_sizes, np.unravel_index(position, tuple(axis_sizes.values())), strict=True)
  )
  index = []
  for n, entry in zip(shape, padded(spec, len(shape)), strict=True):
    block, count = 0, 1
    for a in _axes(entry):
      block, count = block * axis_sizes[a] + int(coords[a]), count * axis_sizes[a]
    size = n // count
    index.append(slice(block * size, (block + 1) * size))
  return tuple(index)


def check_axis(mesh: Mesh | None, shard_axis: str | None) -> None:
  if shard_axis is not None and (mesh is None or shard_axis not in mesh.axis_names):
    where = "params on no mesh" if mesh is None else f"a mesh with axes {mesh.axis_names}"
    raise errors.InvalidTierError(
      f"HostTier(shard_axis={shard_axis!r}) shards the state over that mesh axis, but offload "
      f"got {where}: put the params on a Mesh that has it (jax.device_put(params, "
      "NamedSharding(mesh, spec)))."
    )


@dataclasses.dataclass(frozen=True)
class MeshPlan:
  """Where each state item of a sharded state lives, and how its slot is cut.

  Attributes:
    mesh: the params' mesh.
    item_specs: per state item (`StateLayout.split` order), its PartitionSpec.
    cut_axes: per param slot, the axis its pieces are cut along (None: moved
      whole, e.g. every axis sharded, or state shaped unlike the param).
    slot_bytes: per param slot, bytes of offloaded state per device.
  """

  mesh: Mesh
  item_specs: tuple[PartitionSpec, ...]
  cut_axes: tuple[int | None, ...]
  slot_bytes: tuple[int, ...]

  def put(self, j: int, x: Any, memory_kind: str) -> Any:
    """Item `j` (or a piece of it) placed in `memory_kind`, sharded as planned."""
    return place(x, self.mesh, self.item_specs[j], memory_kind)


ONE_DEVICE_AXIS = "offlax"


@functools.cache
def one_device_mesh(device: Any) -> Mesh:
  """The mesh of one device that single-device state is placed on (one per device)."""
  return Mesh(np.array([device]), (ONE_DEVICE_AXIS,))


def on_one_device(tree: Any, mesh: Mesh | None, device: Any) -> Any:
  """`tree` with every concrete array committed to `device` (the one device of `mesh`).

  A jitted step's cache key holds each argument's sharding (its type too: a
  `NamedSharding`'s mesh is part of the array's type) and whether it is
  committed, and JAX commits every output of a program that moves memory, as
  the step does. State that `init` left uncommitted, or typed unlike what the
  step returns, would compile the step a second time on its second call. The
  step returns arrays sharded like its first committed argument (the params,
  if committed): `one_device_target` picks the sharding that matches them.

  With a `NamedSharding`, specs built from the state
  (``jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)``, for AOT
  lowering, `jax.export` or an orbax restore target) keep each leaf's memory
  kind: JAX 0.10 types a `SingleDeviceSharding` in host memory as device memory
  (`offlax.placed` converts such specs).

  Args:
    tree: a pytree; tracers and non-array leaves pass through.
    mesh: a mesh of one device to commit to with a `NamedSharding`, or None
      for a `SingleDeviceSharding` on `device`.
    device: the device.

  Returns:
    The tree, each array committed to `device` in its own memory kind.
  """

  def put(x):
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
      return x
    return jax.device_put(x, one_device_sharding(mesh, device, x.sharding.memory_kind))

  return jax.tree.map(put, tree)


def one_device_sharding(mesh: Mesh | None, device: Any, memory_kind: str | None) -> Any:
  """The sharding `on_one_device` gives an array in `memory_kind`."""
  if mesh is not None:
    return NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind)
  return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def one_device_target(params: Any, device: Any) -> Mesh | None:
  """The mesh `on_one_device` should commit state for `params` (on `device`) to.

  The params' own one-device mesh if they have one; None (a
  `SingleDeviceSharding`) if they are committed with a `SingleDeviceSharding`;
  else (uncommitted params, `ShapeDtypeStruct`s) `one_device_mesh(device)`.
  """
  single = False
  for x in jax.tree.leaves(params):
    if isinstance(x, jax.core.Tracer):
      continue
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if isinstance(sharding, NamedSharding) and isinstance(mesh, Mesh) and mesh.size == 1:
      return mesh
    if isinstance(sharding, jax.sharding.SingleDeviceSharding) and getattr(x, "committed", False):
      single = True
  return None if single else one_device_mesh(device)


def place(x: Any, mesh: Mesh, spec: PartitionSpec, memory_kind: str | None = None) -> Any:
  """`x` sharded as `spec` on `mesh` (and in `memory_kind`), eagerly or inside `jit`.

  Inside `jit` on a mesh of Auto axes `device_put` to a `NamedSharding` only
  moves memory (JAX drops its sharding), so the sharding is a constraint on the
  device side of the move; on Explicit axes `device_put` reshards, as eagerly.
  """
  explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  if not isinstance(x, jax.core.Tracer) or explicit:
    return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=memory_kind))
  sharding = NamedSharding(mesh, spec)
  if memory_kind in (None, "device"):
    x = x if memory_kind is None else jax.device_put(x, jax.memory.Space.Device)
    return jax.lax.with_sharding_constraint(x, sharding)
  return jax.device_put(jax.lax.with_sharding_constraint(x, sharding), jax.memory.Space.Host)


def plan(
  spec: Any, owners: Sequence[int], items: Sequence[Any], offloaded: Sequence[bool], shard_axis
) -> MeshPlan:
  """The `MeshPlan` of a state whose params (`spec`) are sharded on `spec.mesh`."""
  mesh, n = spec.mesh, len(spec.shapes)
  item_specs: list[PartitionSpec] = []
  by_slot: list[list[PartitionSpec]] = [[] for _ in range(n)]
  whole = [False] * n
  slot_bytes = [0] * n
  for j, (x, o) in enumerate(zip(items, owners, strict=True)):
    shape = layout_lib.shape_of(x)
    if o == coupling_lib.GLOBAL:
      item_specs.append(PartitionSpec())
      continue
    if shape != spec.shapes[o]:  # factored state (e.g. Adafactor's rows and columns)
      s, whole[o] = PartitionSpec(), True
    elif offloaded[j]:
      s = state_spec(shape, spec.specs[o], mesh, shard_axis)
    else:
      s = PartitionSpec(*padded(spec.specs[o], len(shape)))
    item_specs.append(s)
    by_slot[o].append(s)
    if offloaded[j]:
      slot_bytes[o] += layout_lib.nbytes(x) // shards(s, mesh, len(shape))
  cut_axes = tuple(
    None if whole[o] or spec.shapes[o] is None else cut_axis(spec.shapes[o], spec.specs[o], *ss)
    for o, ss in enumerate(by_slot)
  )
  return MeshPlan(mesh, tuple(item_specs), cut_axes, tuple(slot_bytes))


def like_params(spec: Any, slots: list[Any]) -> list[Any]:
  """Updates sharded as their params (an all-gather where ZeRO-1 sharded the state)."""
  if spec.mesh is None:
    return slots
  return [
    x if s is None else place(x, spec.mesh, s) for x, s in zip(slots, spec.specs, strict=True)
  ]


def item_specs(
  spec: layout_lib.ParamSpec, layout: layout_lib.StateLayout, items: Sequence[Any], paths=None
) -> list[P]:
  """Each state item's PartitionSpec on the params' mesh: its param's, or P() (replicated).

  Raises `InvalidTierError` for an item that the shards of its param cannot
  split: shaped unlike its sharded param (factored state), or unevenly.
  """
  mesh, out = spec.mesh, []
  for j, (x, o) in enumerate(zip(items, layout.owners, strict=True)):
    shape = layout_lib.shape_of(x)
    if o == coupling_lib.GLOBAL or shards(spec.specs[o], mesh, len(shape)) == 1:
      out.append(P())
      continue
    where = f"state leaf {paths[j]}" if paths else f"state item {j}"
    param = f"param {spec.paths[o]} {list(spec.shapes[o] or ())} sharded as {spec.specs[o]}"
    if shape != spec.shapes[o]:
      raise errors.InvalidTierError(
        f"NVMeTier on a mesh keeps each device's shard of a state array in its own store, but "
        f"{where} is shaped {list(shape)}, unlike its {param} (factored state such as "
        "optax.adafactor's). Replicate that param, or use offlax.HostTier."
      )
    axis = uneven_axis(shape, spec.specs[o], mesh)
    if axis is not None:
      raise errors.InvalidTierError(
        f"NVMeTier on a mesh: {where} of {param}: axis {axis} ({shape[axis]}) is not divisible "
        f"by its mesh axes {mesh.shape}; every device's shard must have the same shape."
      )
    out.append(P(*padded(spec.specs[o], len(shape))))
  return out


def slot_spec(spec: layout_lib.ParamSpec, i: int) -> P:
  """Param slot `i`'s PartitionSpec (P() for a leaf on no mesh)."""
  return P(*padded(spec.specs[i], len(spec.shapes[i] or ())))


def local_spec(spec: layout_lib.ParamSpec) -> layout_lib.ParamSpec:
  """The ParamSpec of one device's shard of params sharded as `spec` (on no mesh)."""
  shapes = tuple(
    None if s is None else local_shape(s, slot_spec(spec, i), spec.mesh)
    for i, s in enumerate(spec.shapes)
  )
  nbytes = spec.nbytes // max(1, spec.mesh.size)  # for `offlax.stats` only
  return layout_lib.ParamSpec(spec.treedef, shapes, nbytes)
