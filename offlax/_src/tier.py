"""The `Tier` protocol: what `offload` asks of the memory that holds an optimizer state.

`offload` knows tiers only through this protocol. A tier places the inner
state at `init` (`Tier.init`), checks it before each step (`check_state`),
opens the step's I/O (`open_io`: a `TierIO` that moves slice k of the state to
the device and its new values back, then finishes the step), reports what it
holds (`stats`) and releases what it holds (`close`). `HostTier` (host RAM) and
`NVMeTier` (a local disk) implement it; docs/adding_a_tier.md walks through
writing a third.

The data flow of one `update` inside the caller's `jax.jit`::

  grads, params ──> offload ── coupling analysis, schedule of slices
                       │
                       ├─ tier.check_state(inner_state)
                       ├─ io = tier.open_io(items, offloaded, step)
                       │    io.plan(keys)                  every slice's (item, piece) pairs
                       │    for slice k:
                       │      io.load(k) / io.to_device     tier   ──> device
                       │      inner.update(slice k)         on the device
                       │      io.store(k) / io.to_tier      device ──> tier
                       │    io.finish(items)                 e.g. commit the step
                       └─> (updates, OffloadState(inner_state, spec, io.next_step()))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import jax
import optax

from offlax._src import errors, memory, telemetry
from offlax._src import layout as layout_lib
from offlax._src.layout import ParamSpec


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class TierRef:
  """The tier an `OffloadState` lives in: a pytree node without leaves.

  Static data of the state's treedef, so it survives `jax.jit`,
  `jax.eval_shape` and any optax wrapper that keeps the state's structure:
  `offlax.abstract_state` finds each `offload`'s tier in
  ``jax.eval_shape(tx.init, params)``. Two refs are equal when their tiers
  are of one type: a state keeps its structure whatever its tier's options
  (``chunk_bytes``, ...), so a checkpoint made under one tier restores into a
  target built with another (`offlax.abstract_state`'s default). What a step
  does is its transformation's tier, which ``update`` writes into the state
  it returns.
  """

  tier: Any

  @property
  def kind(self) -> type:
    """The tier's type (kept by a pickled ref, which drops the live tier)."""
    return self.tier.kind if isinstance(self.tier, DetachedTier) else type(self.tier)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, TierRef) and self.kind is other.kind

  # A tier is a live resource (a store's files, locks and threads): copies of a
  # state share it, and a pickle keeps only its type.
  def __copy__(self) -> TierRef:
    return self

  def __deepcopy__(self, memo: dict) -> TierRef:
    return self

  def __reduce__(self) -> tuple:
    return TierRef, (DetachedTier(self.kind),)

  def __hash__(self) -> int:
    return hash(self.kind)


@dataclasses.dataclass(frozen=True)
class DetachedTier:
  """The tier of an unpickled state: its type, without the live tier."""

  kind: type


class OffloadState(NamedTuple):
  """State of `offload`: the inner state, placed in the tier.

  Attributes:
    inner_state: the inner transformation's state, with the inner structure
      unchanged, so `optax.tree_utils.tree_get(state, "mu")` finds it.
    spec: the parameter tree the state was built for (static, no leaves).
    step: the tier's step (`Tier.init`, then `TierIO.next_step`): for the NVMe
      tier the last committed step (an int32 scalar); None for the host tier.
    tier_ref: the tier holding the state (a `TierRef`: static, no leaves), or
      None for a state built by hand; `tier` reads it.

  Example:
    >>> import jax.numpy as jnp, optax, offlax
    >>> tier = offlax.HostTier()
    >>> state = offlax.offload(optax.adam(1e-3), tier).init({"w": jnp.ones(3)})
    >>> state.tier is tier, state.inner_state[0].mu["w"].sharding.memory_kind
    (True, 'pinned_host')
  """

  inner_state: Any
  spec: ParamSpec
  step: Any = None
  tier_ref: TierRef | None = None

  @property
  def tier(self) -> Any:
    """The tier holding this state (`offload`'s), or None if unknown (or unpickled)."""
    if self.tier_ref is None or isinstance(self.tier_ref.tier, DetachedTier):
      return None
    return self.tier_ref.tier


@runtime_checkable
class TierIO(Protocol):
  """A tier's I/O during one traced `update`: moves state slices in and out.

  `offload` cuts the state into slices (`offlax._src.schedule`); slice k is a
  list of keys `(j, piece)`: item j of the split state (`layout.StateLayout`)
  and the piece of it the slice updates. `streaming` calls, in order, `plan`,
  then per slice the moves its capabilities name, then `finish`, then
  `next_step`:

  - ``writes_in_place = True``: the items are JAX arrays that the stream
    slices itself (`piece.take`, also at traced offsets inside a `fori_loop`
    over a run of equal pieces) and writes back in place
    (`dynamic_update_slice`), moving each piece with `to_device` and the new
    one with `to_tier`. The tier's schedule cuts leaves into equal pieces, so
    that runs loop. The host tier's I/O.
  - ``writes_in_place = False``: only the tier can read and write its items:
    the stream asks `load` for slice k's pieces and hands the new ones to
    `store`. The NVMe tier's I/O, and a tier keeping state outside JAX.
    Optionally such a tier runs a run of equal pieces in one loop itself:
    where ``can_loop(k, count)`` says so, the stream calls
    ``loop(k, count, update, carry)`` for slices k .. k+count-1 instead, which
    returns the final carry of ``update(i, pieces, carry) -> (new pieces,
    carry)`` applied to slice k+i's pieces, and takes their new pieces (the NVMe
    tier: one read and one write callback in the program, whatever `count`).

  With the tier's ``compute="host"`` the update runs on the host CPU where the
  state lies: the stream moves gradient pieces in with `to_host` and needs
  ``writes_in_place`` (a host computation slices the arrays itself).

  Attributes:
    prefetch_depth: how many slices ahead a read may run. 1: slice k's read
      waits for slice k-1's state written back (about one slice in flight
      each way: the host tier). ``d > 1``: it waits for slice k-d's update
      computed, so d slices of reads may be in flight (the NVMe tier's
      read-ahead, `d = 2`).
    writes_in_place: whether the stream slices the items and writes them
      back itself (see above), or the tier does (`load`, `store`).
    offloaded: per item, whether it lives off the device (items on the
      device, e.g. scalars, are used in place).
  """

  prefetch_depth: int
  writes_in_place: bool
  offloaded: Sequence[bool]

  def plan(self, keys: Sequence[Sequence[tuple[int, Any]]]) -> None:
    """Receives every slice's keys before the first slice is traced.

    Args:
      keys: per slice, its `(item, piece)` pairs in the order `load` returns them.
    """

  def to_host(self, x: jax.Array) -> jax.Array:
    """`x`, a value of the step, moved into the host computation (``compute="host"``)."""
    ...

  def to_device(self, j: int, x: jax.Array) -> jax.Array:
    """A piece `x` of item `j` (as the tier holds it) moved to device memory."""
    ...

  def to_tier(self, j: int, x: jax.Array) -> Any:
    """A new piece `x` of item `j` (on the device) moved to where the tier holds item `j`."""
    ...

  def load(self, k: int, after: Any) -> list[Any]:
    """Slice k's state pieces on the device, one per key (``writes_in_place = False`` only).

    Args:
      k: the slice.
      after: what the read must wait for (an earlier slice's results), or None.

    Returns:
      The pieces, in the order of `keys[k]`.
    """
    ...

  def store(self, k: int, values: Sequence[Any]) -> list[Any]:
    """Hands slice k's new state pieces to the tier (``writes_in_place = False`` only).

    Returns:
      Per key, the piece as the caller should write it into the item, or None
      where the tier has taken it (the item stays as the tier holds it).
    """
    ...

  def finish(self, items: list[Any]) -> list[Any]:
    """Ends the step; returns the new items (None: the tier's own, unchanged item)."""
    ...

  def next_step(self) -> Any:
    """The new `OffloadState.step` (None for a tier that counts no steps)."""
    ...


@runtime_checkable
class Tier(Protocol):
  """Where `offlax.offload` keeps the inner state; the only interface it uses.

  The protocol is structural: any object with these members is a tier. A
  subclass of `Tier` inherits the defaults below: compute on the device, no
  mesh axis of its own, no device or state check, no warnings, nothing to close.

  Attributes:
    compute: ``"device"`` (stream each slice to the device) or ``"host"`` (run
      the update on the host CPU where the state lies: `HostTier(compute="host")`).
    shard_axis: on a mesh, a mesh axis to shard the offloaded state over in
      addition to its param's spec (`HostTier.shard_axis`), or None.
    per_device: on a mesh, run the streamed update per device inside
      `jax.shard_map` (each device's `TierIO` gets its mesh position), as the
      NVMe tier does with one store per device; else once, on global arrays.
    boxes_state: for params in NNX Variables, put the placed state's arrays in
      Variables carrying their placement (`flax_glue.rebox`).

  Example:
    >>> import offlax
    >>> isinstance(offlax.HostTier(), offlax.extend.Tier)
    True
  """

  compute: str = "device"
  shard_axis: str | None = None
  per_device: ClassVar[bool] = False
  boxes_state: ClassVar[bool] = False

  @property
  def chunk_bytes(self) -> int:
    """Upper bound on the bytes of offloaded state in one slice."""
    ...

  def init(self, inner: optax.GradientTransformation, params: Any, spec: ParamSpec) -> Any:
    """The inner state of `params`, placed in this tier (`offload(...).init`).

    Args:
      inner: the inner transformation (with extra args support).
      params: the params, unboxed (arrays, on no mesh or on `spec.mesh`).
      spec: their `ParamSpec`; `spec.placeholder` for optax's params placeholder.

    Returns:
      `(inner_state, step)`: the inner state with each item where the tier
      keeps it (an array in its memory, or an `OnDisk` placeholder for an item
      the tier keeps outside JAX), and the tier's step (a scalar), or None for
      a tier that counts none.
    """
    ...

  def open_io(
    self,
    items: Sequence[Any],
    offloaded: Sequence[bool],
    step: Any,
    *,
    mesh_plan: Any = None,
    shard: Any = None,
  ) -> TierIO:
    """The I/O of one traced `update` (called inside the caller's `jit`).

    Args:
      items: the split inner state (`StateLayout.split`), as `init` placed it.
      offloaded: per item, whether it lives off the device.
      step: `OffloadState.step`, traced.
      mesh_plan: on a mesh (not `per_device`), the `sharding.MeshPlan` of the
        state: how each device's shard of an item moves.
      shard: with `per_device`, the device's mesh position (traced).

    Returns:
      A `TierIO`.
    """
    ...

  def stats(self, state: OffloadState, *, sync: bool = False) -> telemetry.OffloadStats:
    """What `state` holds where and what a step moves (`offlax.stats`)."""
    ...

  def check_devices(self, devices: Iterable[Any]) -> None:
    """Raises if the tier cannot hold state for params on `devices`."""
    return None

  def check_state(self, inner_state: Any) -> None:
    """Raises if `inner_state`, given to `update`, is not where the tier put it."""
    return None

  def check_config(self, state: OffloadState, devices: Iterable[Any]) -> None:
    """Warns (`PerformanceWarning`) about settings that work but cost speed or memory."""
    return None

  def close(self) -> None:
    """Releases what the tier holds open (files, locks); the default holds nothing."""
    return None


def check(tier: Any) -> None:
  """Raises `InvalidTierError` unless `tier` implements the `Tier` protocol."""
  if not isinstance(tier, Tier):
    missing = [name for name in _MEMBERS if not hasattr(tier, name)]
    raise errors.InvalidTierError(
      f"tier must implement offlax.extend.Tier (e.g. offlax.HostTier or offlax.NVMeTier), got "
      f"{type(tier).__name__}, which lacks {', '.join(missing)}."
    )
  if tier.compute not in ("device", "host"):
    raise errors.InvalidTierError(
      f"{type(tier).__name__}.compute must be 'device' or 'host', got {tier.compute!r}."
    )


_MEMBERS = (
  "chunk_bytes", "compute", "shard_axis", "per_device", "boxes_state", "init", "open_io",
  "stats", "check_devices", "check_state", "check_config", "close",
)  # fmt: skip


def stats(state: Any, tier: Any, *, sync: bool = False) -> telemetry.OffloadStats:
  """Bytes per tier and per step of an `offload` state, and the NVMe tier's last step.

  Cheap enough to call every step: it reads shapes and memory kinds, not
  values, and never waits for the device unless `sync` is set.

  Args:
    state: the `OffloadState` returned by `offload(...).init` or `update` (or
      an abstract one, e.g. from `jax.eval_shape`), or a state holding exactly
      one (e.g. that of ``optax.chain(clip, offload(...))``).
    tier: the tier passed to `offload` (a `HostTier`, an `NVMeTier`, or any `Tier`).
    sync: wait for dispatched steps first (`jax.effects_barrier`), so the NVMe
      figures are those of the step that produced `state`; otherwise they are
      those of the last step that has completed.

  Returns:
    An `OffloadStats`.

  Example:
    >>> import jax.numpy as jnp, optax, offlax
    >>> tier = offlax.HostTier()
    >>> state = offlax.offload(optax.adam(1e-3), tier).init({"w": jnp.ones((256, 256))})
    >>> s = offlax.stats(state, tier)
    >>> s.host_bytes, s.h2d_bytes  # mu and nu, fp32
    (524288, 524288)
  """
  if not isinstance(state, OffloadState):
    # A chain's state (optax.chain(clip, offload(...))): the OffloadState inside it.
    found = [
      x
      for x in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, OffloadState))
      if isinstance(x, OffloadState)
    ]
    if len(found) != 1:
      got = f"{len(found)} of them" if found else "none"
      raise errors.TreeMismatchError(
        f"offlax.stats expects the OffloadState of offlax.offload, or a state holding one "
        f"(a chain's), got a {type(state).__name__} holding {got}; pass the OffloadState itself."
      )
    state = found[0]
  if not callable(getattr(tier, "stats", None)):
    raise errors.InvalidTierError(
      f"offlax.stats: tier must be the HostTier or NVMeTier of offload, got {type(tier).__name__}."
    )
  return tier.stats(state, sync=sync)


def is_offloaded(x: Any) -> bool:
  """Whether a state item lives off the device (where the tier's `init` put it)."""
  return isinstance(x, layout_lib.OnDisk) or memory.on_host(x)


def resident(inner_state: Any) -> dict[str, int]:
  """Bytes of `inner_state` in device memory, host memory and on disk (`OnDisk` items)."""
  out = {"device": 0, "host": 0, "nvme": 0}
  for x in jax.tree.leaves(inner_state, is_leaf=layout_lib.is_slot):
    if isinstance(x, layout_lib.OnDisk):
      out["nvme"] += layout_lib.nbytes(x)
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
      out[memory.sharding_kind(x)] += layout_lib.nbytes(x)
  return out
