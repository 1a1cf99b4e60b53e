"""The host tier: optimizer state in host RAM, moved to the device per slice."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from offlax._src import errors, host_params, memory, telemetry
from offlax._src import layout as layout_lib
from offlax._src import sharding as sharding_lib
from offlax._src import tier as tier_lib

# Inside `jit`, JAX 0.10 types exactly one host memory space, `pinned_host`
# (`jax.memory.Space.Host`); `unpinned_host` buffers are typed as device memory,
# so a program could silently compute on them. Refuse the others up front.
_HOST_KINDS = ("pinned_host",)
DEFAULT_CHUNK_BYTES = 64 * 2**20
_COMPUTE = ("device", "host")


def _on_accelerator(params: Any) -> bool:
  """Whether some param is an array on a GPU or TPU (whose memory `init` must spare).

  On the CPU backend device memory is host RAM: the state is made where it is,
  without a host computation to compile.
  """
  devices: set[Any] = {
    device
    for x in jax.tree.leaves(params)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    for device in x.sharding.device_set
  }
  return any(device.platform != "cpu" for device in devices)


@dataclasses.dataclass(frozen=True)
class HostTier(tier_lib.Tier):
  """Keeps optimizer state in host memory; updates it on the device or the host.

  The state lives in arrays with memory kind ``memory_kind``. With
  ``compute="device"`` each update moves the state to the device in slices of
  at most ``chunk_bytes``, runs the inner update on the slice and moves the new
  state back (see ``docs/host_tier.md``, "The streaming schedule"). With
  ``compute="host"`` (ZeRO-Offload style) the state never moves: the gradients
  (and params) go to host memory, the inner update runs on the host CPU
  (``compute_on("device_host")``), and only the updates come back.

  Attributes:
    chunk_bytes: upper bound on the bytes of offloaded state in one slice.
    memory_kind: the host memory kind holding the state; only
      ``"pinned_host"`` can be addressed inside ``jax.jit`` in this JAX.
    min_offload_bytes: state leaves with fewer bytes stay in device memory.
    compute: ``"device"`` (stream the state through the device) or ``"host"``
      (run the update on the host CPU).
    fraction: the share of the offloadable state bytes to offload (partial
      offload, like DeepSpeed's ``ratio``); the rest stays on the device.
    select: which state leaves may be offloaded: a regular expression searched
      in the leaf's key path in the inner state (e.g. ``"mu|nu"``, or
      ``"embed"`` for the moments of embedding params), or a callable taking
      that key path and returning a bool. ``None``: all.
    shard_axis: a mesh axis of the params' mesh (e.g. ``"data"``) to shard the
      offloaded state over as well (ZeRO-1): each device's host memory then
      holds 1/n of the state even where the params are replicated over that
      axis. ``None``: state arrays are sharded as their params are (always the
      case for params on a mesh; see ``docs/multi_device.md``).

  Placement rule: a state leaf may live in host memory iff it has at least one
  dimension, at least ``min_offload_bytes`` bytes and ``select`` accepts its
  key path. Of those, the largest are offloaded first (ties in tree order)
  until ``fraction`` of their bytes is offloaded; with the default
  ``fraction=1.0`` all are. Scalars (``count``,
  injected hyperparameters, ...) stay on the device: every slice needs them, so
  offloading one would cost a latency-bound transfer each way per step and save
  a few bytes; on the device they also stay usable by wrappers such as
  ``optax.MultiSteps`` that compute on the state.

  Example:
    >>> import offlax
    >>> tier = offlax.HostTier(chunk_bytes=2**20, compute="host", select="mu|nu")
    >>> tier.compute, tier.fraction
    ('host', 1.0)
  """

  chunk_bytes: int = DEFAULT_CHUNK_BYTES
  memory_kind: str = "pinned_host"
  min_offload_bytes: int = 0
  compute: str = "device"
  fraction: float = 1.0
  select: str | Callable[[str], bool] | None = None
  shard_axis: str | None = None

  boxes_state: ClassVar[bool] = True

  def __post_init__(self):
    for name in ("chunk_bytes", "min_offload_bytes"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise errors.InvalidTierError(
          f"HostTier.{name} must be an int, got {type(value).__name__} {value!r}."
        )
    if self.chunk_bytes <= 0:
      raise errors.InvalidTierError(
        f"HostTier.chunk_bytes must be > 0 bytes, got {self.chunk_bytes}."
      )
    if self.min_offload_bytes < 0:
      raise errors.InvalidTierError(
        f"HostTier.min_offload_bytes must be >= 0, got {self.min_offload_bytes}."
      )
    if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
      raise errors.InvalidTierError(
        f"HostTier.fraction must be a number in [0, 1], got {self.fraction!r}."
      )
    if not 0.0 <= self.fraction <= 1.0:
      raise errors.InvalidTierError(f"HostTier.fraction must be in [0, 1], got {self.fraction}.")
    if isinstance(self.select, str):
      try:
        re.compile(self.select)
      except re.error as e:
        raise errors.InvalidTierError(
          f"HostTier.select is not a valid regular expression ({e}): {self.select!r}."
        ) from None
    elif self.select is not None and not callable(self.select):
      raise errors.InvalidTierError(
        f"HostTier.select must be a regex string, a callable or None, got {self.select!r}."
      )
    if self.shard_axis is not None and not isinstance(self.shard_axis, str):
      raise errors.InvalidTierError(
        f"HostTier.shard_axis must be a mesh axis name or None, got {self.shard_axis!r}."
      )
    if self.compute not in _COMPUTE:
      raise errors.InvalidTierError(
        f"HostTier.compute must be one of {_COMPUTE}, got {self.compute!r}."
      )
    if self.memory_kind not in _HOST_KINDS:
      raise errors.MemoryKindError(
        f"HostTier.memory_kind must be one of {_HOST_KINDS}, got "
        f"{self.memory_kind!r}. JAX addresses no other host memory kind "
        "inside jit."
      )

  def offloads(self, leaf: Any) -> bool:
    """Whether a state leaf of this shape and dtype may live in host memory."""
    return np.ndim(leaf) > 0 and layout_lib.nbytes(leaf) >= self.min_offload_bytes

  def placement(self, state: Any) -> Any:
    """Which leaves of `state` live in host memory: a tree of bools like it."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    candidates = [
      i
      for i, (path, x) in enumerate(flat)
      if self.offloads(x) and self._selects(jax.tree_util.keystr(path))
    ]
    budget = self.fraction * sum(layout_lib.nbytes(flat[i][1]) for i in candidates)
    chosen, done = set(), 0
    for i in sorted(candidates, key=lambda i: -layout_lib.nbytes(flat[i][1])):
      if done >= budget and self.fraction < 1.0:
        break
      chosen.add(i)
      done += layout_lib.nbytes(flat[i][1])
    return jax.tree_util.tree_unflatten(treedef, [i in chosen for i in range(len(flat))])

  def place(self, state: Any, spec: layout_lib.ParamSpec | None = None) -> Any:
    """`state` with each leaf where `placement` puts it (host leaves moved back too).

    With `spec` of params sharded on a mesh, offloaded leaves are sharded as
    `sharding.plan` says (their param's spec, plus `shard_axis`).
    """
    placement = self.placement(state)
    mesh = None if spec is None else spec.mesh

    def back(x):  # a leaf the placement keeps on the device
      x = memory.to_device(x) if memory.on_host(x) else x
      if mesh is not None and getattr(getattr(x, "sharding", None), "mesh", None) != mesh:
        # Scalars made by `init` (a step count) sit on one device: replicate them
        # over the params' mesh, so the state is one set of global arrays.
        x = sharding_lib.place(x, mesh, jax.sharding.PartitionSpec())
      return x

    if spec is None or spec.mesh is None:
      return jax.tree.map(lambda x, h: self.to_host(x) if h else back(x), state, placement)
    layout, items, host, mesh_plan = self.mesh_plan(state, spec, placement)
    placed = [
      mesh_plan.put(j, x, self.memory_kind) if h else back(x)
      for j, (x, h) in enumerate(zip(items, host, strict=True))
    ]
    return layout.merge(placed)

  def mesh_plan(self, state: Any, spec: layout_lib.ParamSpec, placement: Any = None):
    """For params on a mesh: the state's layout, its items, which go to host, their `MeshPlan`."""
    layout = layout_lib.StateLayout(state, spec)
    placement = self.placement(state) if placement is None else placement
    items, host = layout.split(state), layout.split(placement)
    return layout, items, host, sharding_lib.plan(spec, layout.owners, items, host, self.shard_axis)

  def _selects(self, path: str) -> bool:
    if self.select is None:
      return True
    if isinstance(self.select, str):
      return re.search(self.select, path) is not None
    return bool(self.select(path))

  def check_devices(self, devices: Iterable[Any]) -> None:
    """Raises `MemoryKindError` unless every device offers `memory_kind`."""
    for device in devices:
      kinds = {m.kind for m in device.addressable_memories()}
      if self.memory_kind not in kinds:
        raise errors.MemoryKindError(
          f"Device {device} has no {self.memory_kind!r} memory (it has "
          f"{sorted(kinds)}); HostTier cannot place optimizer state there."
        )

  def to_host(self, x: jax.Array) -> jax.Array:
    """Moves `x` to this tier's host memory (``pinned_host``); valid inside and outside jit."""
    return memory.to_host(x)

  @staticmethod
  def to_device(x: jax.Array) -> jax.Array:
    """Moves `x` to device memory; valid inside and outside jit."""
    return memory.to_device(x)

  # -- the `Tier` protocol ---------------------------------------------------

  def init(self, inner: Any, params: Any, spec: layout_lib.ParamSpec) -> tuple[Any, None]:
    """The inner state of `params`, each leaf where `placement` puts it; no step."""
    sharding_lib.check_axis(spec.mesh, self.shard_axis)
    state = host_params.init(inner.init, params, via_host=_on_accelerator(params))
    return self.place(state, spec), None

  def open_io(self, items, offloaded, step, *, mesh_plan=None, shard=None) -> HostIO:
    """The moves of one step's slices between host memory and the device."""
    return HostIO(self, items, offloaded, mesh_plan)

  def stats(self, state: tier_lib.OffloadState, *, sync: bool = False) -> telemetry.OffloadStats:
    """Resident bytes per memory, and what a step moves each way."""
    resident = tier_lib.resident(state.inner_state)
    moved = state.spec.nbytes if self.compute == "host" else resident["host"] + resident["nvme"]
    return telemetry.OffloadStats(None, resident["device"], resident["host"], 0, moved, moved)

  def check_state(self, inner_state: Any) -> None:
    """Refuses state whose offloaded leaves arrive typed as device arrays.

    The step would run, keep them on the device and return them there: the state
    would leave its tier without a word.
    """
    flat = jax.tree_util.tree_flatten_with_path(inner_state)[0]
    wanted = jax.tree.leaves(self.placement(inner_state))
    for (path, x), host in zip(flat, wanted, strict=True):
      if host and not tier_lib.is_offloaded(x):
        raise errors.MemoryKindError(
          f"state leaf {jax.tree_util.keystr(path)} is typed as device memory "
          f"({jax.typeof(x)}), but the tier keeps it in {self.memory_kind}. Restored state "
          "and jax.ShapeDtypeStruct specs need offlax.placed(tree) (JAX types a "
          "SingleDeviceSharding in host memory as device memory; a NamedSharding keeps it), "
          "or restore into offlax.abstract_state(...); jax.eval_shape keeps no memory kinds: "
          "build specs with offlax.abstract_state. State moved by hand must stay where init "
          "put it."
        )

  def check_config(self, state: tier_lib.OffloadState, devices: Iterable[Any]) -> None:
    """Warns about a slice size far from the default, or a full pinned host pool."""
    s = self.stats(state)
    if self.compute == "device":
      telemetry.check_chunk(self.chunk_bytes, DEFAULT_CHUNK_BYTES, s.h2d_bytes)
    for platform in {d.platform for d in devices}:
      telemetry.check_pinned(s.host_bytes, platform)

  def close(self) -> None:
    """Nothing to release: the state's arrays are the caller's."""


class HostIO:
  """Moves slices between the host tier and the device inside the jitted step."""

  # The items are arrays in host memory: the stream slices them (at traced
  # offsets in loops) and writes them back in place; a read waits for the
  # slice before written back, which bounds device memory to a few slices.
  prefetch_depth = 1
  writes_in_place = True

  def __init__(
    self,
    tier: HostTier,
    items: Sequence[Any],
    offloaded: Sequence[bool],
    mesh_plan: sharding_lib.MeshPlan | None = None,
  ):
    self.tier, self.items, self.offloaded = tier, items, offloaded
    self.mesh_plan = mesh_plan

  def to_host(self, x):
    """A value (a piece of a device item, a gradient) moved into the host computation."""
    return self.tier.to_host(x)

  def plan(self, keys):
    self.keys = keys

  def to_device(self, j, x):
    if not self.offloaded[j]:
      return x
    if self.mesh_plan is not None:  # each device moves its own shard of the piece
      return self.mesh_plan.put(j, x, "device")
    return self.tier.to_device(x)

  def to_tier(self, j, x):
    if not self.offloaded[j]:
      return x
    if self.mesh_plan is not None:
      return self.mesh_plan.put(j, x, self.tier.memory_kind)
    return self.tier.to_host(x)

  def fetch(self, keys, after):
    """Moves the given (item, piece) pairs to the device, not before `after` exists."""
    pieces = [p.take(self.items[j]) for j, p in keys]
    if after is not None:
      _, pieces = jax.lax.optimization_barrier((after, pieces))
    return [self.to_device(j, x) for (j, _), x in zip(keys, pieces, strict=True)]

  def load(self, k, after):
    return self.fetch(self.keys[k], after)

  def store(self, k, values):
    return [self.to_tier(j, x) for (j, _), x in zip(self.keys[k], values, strict=True)]

  def finish(self, items):
    return items

  def next_step(self):
    return None
