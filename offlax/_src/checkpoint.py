"""Checkpoints: orbax restore targets and the NVMe store handler; moving state between tiers."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath

from offlax._src import adam8, errors, flax_glue
from offlax._src import layout as layout_lib
from offlax._src import sharding as sharding_lib
from offlax._src import tier as tier_lib
from offlax._src import transform as transform_lib
from offlax._src.host_tier import HostTier
from offlax._src.nvme import copies, sharded
from offlax._src.nvme.format import is_sharded
from offlax._src.nvme.tier import NVMeTier
from offlax._src.transform import OffloadState, devices_of


def abstract_state(
  inner: optax.GradientTransformation, params: Any, tier: HostTier | NVMeTier | None = None
) -> OffloadState:
  """The state `offload(inner, tier).init(params)` would return, as shapes and shardings.

  Nothing is allocated: the leaves are `jax.ShapeDtypeStruct`s whose shardings
  carry the memory kind each leaf would have (``pinned_host`` for the ones the
  tier offloads). Pass it to orbax as the restore target, and orbax builds
  every leaf directly in its tier:
  ``mngr.restore(step, args=ocp.args.StandardRestore(target))``; its
  ``inner_state`` is the target for a checkpoint of the plain optimizer.

  Args:
    inner: the offloaded transformation, or the `offload(inner, tier)`
      transformation itself (then its tier is used).
    params: the params, or their `jax.ShapeDtypeStruct`s.
    tier: a `HostTier` or an `NVMeTier`; None means the default one (or the one of `inner`
      if `inner` is an `offload` transformation). An `NVMeTier` gives the
      state a new store would give (its items on disk `OnDisk`), writing
      nothing: for a compile; a checkpoint of it is its store, see
      ``docs/checkpoints.md``.

  Returns:
    An `OffloadState` of `jax.ShapeDtypeStruct`s.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
    >>> state = offlax.abstract_state(optax.adam(1e-3), params)
    >>> state.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
  """
  errors.check_transformation(inner, "abstract_state: inner")
  if isinstance(inner, transform_lib.OffloadTransformation):
    if tier is not None and tier != inner.tier:
      raise errors.InvalidTierError(
        f"abstract_state got an offload transformation (tier {inner.tier!r}) and a different "
        f"tier {tier!r}; pass either offload(inner, tier), or inner and tier."
      )
    inner, tier = inner.inner, inner.tier
  else:
    composed = _abstract_composition(inner, params, tier)
    if composed is not None:
      return composed
  tier = HostTier() if tier is None else tier
  params = flax_glue.unbox(params)
  if isinstance(tier, NVMeTier):
    # Its init of specs is the state a new store would give, nothing written.
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    specs = jax.tree.map(spec, params)
    return transform_lib.offload(inner, tier).init(specs)
  shapes = jax.eval_shape(optax.with_extra_args_support(inner).init, params)
  return _placed_like_init(shapes, layout_lib.ParamSpec.of(params), params, tier)


def _placed_like_init(shapes: Any, spec: Any, params: Any, tier: Any) -> OffloadState:
  """The inner state `shapes` as `ShapeDtypeStruct`s placed as `tier`'s `init` places them."""
  if not isinstance(tier, HostTier):
    raise errors.InvalidTierError(
      f"abstract_state takes a HostTier, got {type(tier).__name__}: an NVMeTier's state is "
      "its store (see docs/checkpoints.md)."
    )
  device = min(devices_of(params), key=lambda d: d.id)
  placement = tier.placement(shapes)
  default = jax.sharding.SingleDeviceSharding(device).memory_kind
  ref = tier_lib.TierRef(tier)

  def sds(x, mesh, spec, host):
    kind = tier.memory_kind if host else default
    sharding = jax.sharding.NamedSharding(mesh, spec, memory_kind=kind)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  if spec.mesh is not None:  # each leaf as `offload(...).init` shards it
    layout, items, host, mesh_plan = tier.mesh_plan(shapes, spec, placement)
    targets = [
      sds(x, spec.mesh, mesh_plan.item_specs[j], h)
      for j, (x, h) in enumerate(zip(items, host, strict=True))
    ]
    return OffloadState(layout.merge(targets), spec, None, ref)
  # A NamedSharding: JAX 0.10 types a SingleDeviceSharding's host memory kind as
  # device memory (see `placed`), a NamedSharding's as host memory. On the
  # params' own mesh of one device if they have one (one program has one mesh).
  mesh = sharding_lib.one_device_target(params, device) or sharding_lib.one_device_mesh(device)
  place = lambda x, host: sds(x, mesh, jax.sharding.PartitionSpec(), host)
  return OffloadState(jax.tree.map(place, shapes, placement), spec, None, ref)


def _abstract_composition(
  tx: optax.GradientTransformation, params: Any, tier: HostTier | NVMeTier | None
) -> Any | None:
  """`abstract_state` of a transformation holding `offload`s (a chain): None if it holds none.

  ``jax.eval_shape(tx.init, params)`` (nothing is allocated) holds an
  `OffloadState` per `offload`, which names its tier (`OffloadState.tier`);
  each is placed as that tier's `init` places it. The other leaves (a
  wrapper's own state) are replicated on the params' mesh, in device memory.
  """
  params = flax_glue.unbox(params)
  is_state = lambda x: isinstance(x, OffloadState)
  shapes = jax.eval_shape(optax.with_extra_args_support(tx).init, params)
  if not any(is_state(x) for x in jax.tree.leaves(shapes, is_leaf=is_state)):
    return None
  spec = layout_lib.ParamSpec.of(params)
  device = min(devices_of(params), key=lambda d: d.id)
  mesh = spec.mesh or (
    sharding_lib.one_device_target(params, device) or sharding_lib.one_device_mesh(device)
  )
  outer = jax.tree.structure(params, is_leaf=lambda x: isinstance(x, optax.MaskedNode))

  def replace(node):
    if not is_state(node):
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      return jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=sharding)
    if tier is not None and tier != node.tier:
      raise errors.InvalidTierError(
        f"abstract_state got a transformation whose offload has tier {node.tier!r} and a "
        f"different tier {tier!r}; omit tier."
      )
    # The params the offload got: the caller's (with their shardings) unless the
    # wrapper gave it others (e.g. optax.masked's), known by their spec.
    if node.spec.treedef == outer:
      return _placed_like_init(node.inner_state, spec, params, node.tier)
    return _placed_like_init(node.inner_state, node.spec, None, node.tier)

  return jax.tree.map(replace, shapes, is_leaf=is_state)


def placed(tree: Any) -> Any:
  """`tree` with every array typed for the memory its sharding names.

  JAX 0.10 types an array made from a ``SingleDeviceSharding`` with memory
  kind ``pinned_host`` (as orbax makes them, restoring into a target built from
  live arrays with ``ocp.utils.to_shape_dtype_struct``) as device memory,
  whatever the sharding says, and `jax.jit` goes by the type: `offload` would
  treat such state as device state (it refuses it, naming the leaf). Pass
  restored state through this function (a no-op for arrays typed right), or
  restore into `abstract_state`, whose shardings JAX types right. The same
  holds for `jax.ShapeDtypeStruct` specs with such a sharding (AOT lowering
  from the state of a step whose params were committed to one device): they
  become specs with a `NamedSharding` of the same device and memory kind.

  Args:
    tree: a pytree of arrays and/or `jax.ShapeDtypeStruct`s; other leaves pass through.

  Returns:
    The tree, its host arrays re-placed with their memory space in their type.

  Example:
    >>> import jax, jax.numpy as jnp, offlax
    >>> x = jax.device_put(jnp.ones(3), jax.memory.Space.Host)
    >>> offlax.placed({"x": x})["x"].sharding.memory_kind
    'pinned_host'
  """

  def fix(x):
    sharding = getattr(x, "sharding", None)
    if (
      isinstance(x, jax.ShapeDtypeStruct)
      and isinstance(sharding, jax.sharding.SingleDeviceSharding)
      and sharding.memory_kind == "pinned_host"
    ):
      # A spec: the same device and memory, as a NamedSharding, which JAX types right.
      device = next(iter(sharding.device_set))
      named = sharding_lib.one_device_sharding(
        sharding_lib.one_device_mesh(device), device, "pinned_host"
      )
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named)
    if (
      isinstance(x, jax.Array)
      and not isinstance(x, jax.core.Tracer)
      and x.sharding.memory_kind == "pinned_host"
      and jax.typeof(x).memory_space != jax.memory.Space.Host
    ):
      return jax.device_put(x, jax.memory.Space.Host)
    return x

  return jax.tree.map(fix, tree)


def retier(
  inner: optax.GradientTransformation, params: Any, inner_state: Any, tier: HostTier | NVMeTier
) -> OffloadState:
  """The state of `offload(inner, tier)` holding the values of `inner_state`.

  Moves optimizer state between tiers, or into one from a plain optax state:
  a host-tier checkpoint into an NVMe store (`tier` creates it, as `init`
  would, from these values), an NVMe store's state into host memory (read it
  first with `NVMeTier.read_state`), or a plain optimizer's state into either.

  The state helpers (`offlax.abstract_state`, `retier`, `reshard`) take the
  transformation and the params first, as `offload(inner, ...)` and
  ``inner.init(params)`` do, then what they act on.

  Args:
    inner: the transformation `inner_state` belongs to.
    params: the params (or their `jax.ShapeDtypeStruct`s) it was built for.
    inner_state: a state of `inner`, its arrays in memory (any memory kind).
    tier: where it goes; use the returned state with `offload(inner, tier)`.

  Returns:
    An `OffloadState`.

  Example:
    >>> import jax.numpy as jnp, optax, offlax
    >>> params = {"w": jnp.ones(3)}
    >>> plain = optax.adam(1e-3).init(params)
    >>> state = offlax.checkpoint.retier(optax.adam(1e-3), params, plain, offlax.HostTier())
    >>> state.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
  """
  if _is_transformation(params) and not _is_transformation(inner):
    _refuse_old_order("retier", "(inner, params, inner_state, tier)", "(inner_state, inner, ...)")
  errors.check_transformation(inner, "retier: inner")
  params = flax_glue.unbox(params)
  spec = layout_lib.ParamSpec.of(params)
  inner = optax.with_extra_args_support(inner)
  _check_state(jax.eval_shape(inner.init, params), inner_state)
  if isinstance(tier, NVMeTier):
    tier.host.check_devices(devices_of(params))
    items, step = tier.init(inner, params, spec, state=inner_state)
    return OffloadState(items, spec, step, tier_lib.TierRef(tier))
  if not isinstance(tier, HostTier):
    raise errors.InvalidTierError(f"retier: tier must be a HostTier or NVMeTier, got {tier!r}.")
  tier.check_devices(devices_of(params))
  # numpy leaves become JAX arrays; JAX arrays stay as they are until placed.
  placed_state = tier.place(jax.tree.map(jnp.asarray, inner_state))
  return OffloadState(placed_state, spec, None, tier_lib.TierRef(tier))


def reshard(
  inner: optax.GradientTransformation,
  params: Any,
  src: str | os.PathLike,
  dest: str | os.PathLike,
  **tier_options: Any,
) -> int:
  """Writes the sharded NVMe store at `src` to a new one at `dest`, sharded as `params` are.

  For resuming on another mesh (or with other specs) than the one `src` was
  written on, which `NVMeTier(src, resume=True)` refuses. Every shard's store
  of `src` is read (through the same chunk files tensorstore opens) into the
  whole state in host RAM, and `dest` is created from it as `init` would, one
  store per device of `params`' mesh, each with its block; then
  `NVMeTier(dest, resume=True)` continues. Run it in a single-process job that
  sees all of `src`'s shards, or in every process of the new mesh (each writes its own
  devices' stores, like `init`), with no process training on `src`.

  Args:
    inner: the offloaded transformation.
    params: the params (or `jax.ShapeDtypeStruct`s with shardings) on the new
      mesh; params on no mesh give an unsharded store.
    src: the sharded store; its shards must be at one step (reopening it on
      its own mesh brings them there).
    dest: a new directory.
    **tier_options: options of the new `NVMeTier` (`cache_bytes`, `fsync`,
      ...); `chunk_bytes` and `keep` default to `src`'s.

  Returns:
    The step `src` had committed. `dest` starts its own count at 0 (the
    optimizer's own step count is in the state, unchanged).
  """
  if all(isinstance(x, (str, os.PathLike)) for x in (inner, params)):
    _refuse_old_order("reshard", "(inner, params, src, dest, **tier_options)", "(src, dest, ...)")
  errors.check_transformation(inner, "reshard: inner")
  params = flax_glue.unbox(params)
  inner = optax.with_extra_args_support(inner)
  src, dest = os.fspath(src), os.fspath(dest)
  progress = tier_options.get("progress", True)
  spec = layout_lib.ParamSpec.of(params)
  state, step, options = sharded.read_sharded(src, inner, params, spec, progress=progress)
  tier = NVMeTier(dest, **{**options, **tier_options})
  retier(inner, params, state, tier)
  tier.close()
  return step


def _is_transformation(x: Any) -> bool:
  return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


def _refuse_old_order(where: str, order: str, old: str) -> NoReturn:
  """Raises for a call in the argument order of offlax 0.1, which would otherwise misbehave."""
  raise errors.TransformationTypeError(
    f"{where} takes {order}: the optax GradientTransformation and the params first, as "
    f"offlax.abstract_state does. It got them in the order of offlax 0.1, {old}; call "
    f"{where}{order}."
  )


def _check_state(want: Any, state: Any) -> None:
  """Raises `TreeMismatchError` naming the first leaf where `state` is not like `want`."""
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  got_flat, got_def = jax.tree_util.tree_flatten_with_path(state)
  if str(want_def) != str(got_def):  # (PyTreeDef has no typed __ne__)
    raise errors.TreeMismatchError(
      f"retier: the state is not one of this optimizer for these params: its structure is "
      f"{got_def}, expected {want_def}." + adam8.bits_hint([str(got_def)], [str(want_def)])
    )
  for (path, w), (_, g) in zip(want_flat, got_flat, strict=True):
    if (np.shape(g), np.dtype(g.dtype)) != (w.shape, np.dtype(w.dtype)):
      raise errors.TreeMismatchError(
        f"retier: the state is not one of this optimizer for these params: leaf "
        f"{jax.tree_util.keystr(path)} is {np.dtype(g.dtype).name}{list(np.shape(g))}, "
        f"expected {np.dtype(w.dtype).name}{list(w.shape)}."
      )


class _OnDiskRefusal(ocp.type_handlers.TypeHandler):
  """Makes orbax refuse to save an NVMe-tier state's `OnDisk` placeholders.

  `OnDisk` is a pytree node without leaves; orbax would save it as an empty
  value and restore None, losing the moments without a word. Orbax asks the
  handler of each value's type for its type string first: this one raises.
  It meets them in a plain state and, inside `OnDiskVariable`s, in Flax NNX's
  `nnx.state` / `nnx.split` of the optimizer (`flax_on_disk.py`), whether
  saved by `StandardSave`, `PyTreeSave` or inside a `Composite`.
  """

  armed = False  # the registry asks for the type string once, when registering

  def typestr(self) -> str:
    if not self.armed:
      return "offlax.OnDisk"  # the type's name as registered with orbax, unchanged
    raise errors.UnsavableStateError(
      "ocp.args.StandardSave (or another orbax pytree save: PyTreeSave, an item of a "
      "Composite) got an NVMe-tier state: its arrays on disk are offlax.extend.OnDisk "
      "placeholders (in Flax NNX's nnx.state(optimizer), OnDiskVariables), which orbax "
      "would save and restore as None. Save the store with offlax.checkpoint.NVMeStoreSave(tier) "
      "instead, e.g. mngr.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave("
      "params), opt=offlax.checkpoint.NVMeStoreSave(tier))) (with NNX: nnx.state(model) and "
      "optimizer.step as the model item), or move the state to a HostTier first "
      "(offlax.checkpoint.retier(inner, params, tier.read_state(state), offlax.HostTier())). "
      "Tunix's "
      "PeftTrainer checkpoints nnx.state(optimizer, nnx.optimizer.OptState) this way: with "
      "the NVMe tier, give it checkpoint_root_directory=None and save as above, or use "
      "offlax.HostTier() with its checkpoints."
    )

  def metadata(self, infos):  # never reached: `typestr` raises first
    raise NotImplementedError

  def serialize(self, values, infos, args=None):
    raise NotImplementedError

  def deserialize(self, infos, args=None):
    raise NotImplementedError


_refusal = _OnDiskRefusal()
ocp.type_handlers.register_type_handler(layout_lib.OnDisk, _refusal, override=True)
_refusal.armed = True


class _NVMeStoreHandler(ocp.handlers.CheckpointHandler):
  """Saves an NVMe tier's committed store into a checkpoint, restores it to a path."""

  def save(self, directory: epath.Path, args: NVMeStoreSave) -> None:
    args.tier.snapshot(os.fspath(directory))

  def restore(self, directory: epath.Path, args: NVMeStoreRestore) -> int:
    src, dest = os.fspath(directory), os.fspath(args.path)
    if is_sharded(src):  # each process restores its own shards' stores
      return copies.copy_sharded(src, dest, progress=args.progress)
    return copies.copy_store(src, dest, progress=args.progress)


@ocp.args.register_with_handler(_NVMeStoreHandler, for_save=True)
@dataclasses.dataclass
class NVMeStoreSave(ocp.args.CheckpointArgs):
  """Orbax save argument: the NVMe tier's last committed step, copied file by file.

  Use it beside the other items of a step, e.g.
  ``mngr.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(params),
  opt=offlax.checkpoint.NVMeStoreSave(tier)))``: the store holds all of the optimizer
  state, cached arrays included. The copy streams in the kernel and needs no
  RAM for the state; it runs before `save` returns, even with asynchronous
  checkpointing, because the store overwrites that generation `keep + 1` steps later.

  Attributes:
    tier: the open `NVMeTier`.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, offlax, orbax.checkpoint as ocp
    >>> tier = offlax.NVMeTier(tempfile.mkdtemp(), progress=False)
    >>> state = offlax.offload(optax.adam(1e-3), tier).init({"w": jnp.ones(3)})
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mngr:
    ...   _ = mngr.save(0, args=ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreSave(tier)))
    ...   mngr.wait_until_finished()
    ...   [report] = offlax.checkpoint.inspect_store(mngr.directory / "0" / "opt", progress=False)
    >>> report.ok, report.step
    (True, 0)
    >>> tier.close()
  """

  tier: NVMeTier

  def __post_init__(self):
    if not isinstance(self.tier, NVMeTier):  # orbax would fail later, in its save thread
      raise errors.InvalidTierError(
        f"NVMeStoreSave takes an NVMeTier, got {type(self.tier).__name__}; save a host tier's "
        "state with ocp.args.StandardSave."
      )


@ocp.args.register_with_handler(_NVMeStoreHandler, for_restore=True)
@dataclasses.dataclass
class NVMeStoreRestore(ocp.args.CheckpointArgs):
  """Orbax restore argument: writes the checkpoint's store to `path` (a new directory).

  Open it with ``NVMeTier(path, resume=True)``; `offload(...).init` then
  returns the checkpointed state. Restoring returns the store's step.

  Attributes:
    path: where to put the store; must not hold one.
    progress: show a progress bar.
  """

  path: str
  progress: bool = True

  def __post_init__(self):
    if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
      raise errors.InvalidTierError(
        f"NVMeStoreRestore.path must be a directory path, got {self.path!r}."
      )
