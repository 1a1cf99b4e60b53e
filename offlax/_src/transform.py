"""`offload`: the optax wrapper that keeps an optimizer's state in a tier."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from offlax._src import apply as apply_lib
from offlax._src import (
  donation,
  errors,
  flax_glue,
  memory,
  nnx_hooks,
  offload_step,
  streaming,
  telemetry,
  wrapped_apply,
)
from offlax._src import layout as layout_lib
from offlax._src import offload_checks as checks
from offlax._src import schedule as schedule_lib
from offlax._src import sharding as sharding_lib
from offlax._src import tier as tier_lib
from offlax._src.compat import compute_on
from offlax._src.host_tier import HostTier
from offlax._src.layout import ParamSpec
from offlax._src.offload_step import Step, fill
from offlax._src.tier import OffloadState, Tier


def offload(
  inner: optax.GradientTransformation,
  tier: Tier | None = None,
  **tier_options: Any,
) -> OffloadTransformation:
  """Keeps the state of `inner` in a memory tier off the accelerator.

  `init` places the inner state in the tier. `update` works inside the caller's
  `jax.jit`: it streams the state to the device in slices, runs the inner
  update on each slice and moves the new state back. Slices follow the data
  dependencies of the inner update (see `offlax._src.coupling`), so the
  arithmetic is that of `inner` (coupled transformations such as a global norm
  clip inside `inner` run as one slice); `docs/exactness.md` says when XLA
  rounds the two programs differently.

  Args:
    inner: the transformation whose state is offloaded.
    tier: where the state lives (any `offlax.extend.Tier`: `HostTier`, `NVMeTier`,
      or your own); `None` means `HostTier(**tier_options)`.
    **tier_options: options of the default `HostTier` when `tier` is None.

  Returns:
    An `OffloadTransformation` (an `optax.GradientTransformationExtraArgs`
    with a fused `update_and_apply`) whose state is an `OffloadState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    >>> tx = offlax.offload(optax.adam(1e-3))
    >>> state = tx.init(params)
    >>> state.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
    >>> updates, state = jax.jit(tx.update)(params, state)
    >>> updates["w"].shape
    (4, 3)
  """
  errors.check_transformation(inner, "offload: inner")
  if isinstance(inner, OffloadTransformation):
    raise errors.TransformationTypeError(
      "offload(offload(...)): the inner transformation is already offloaded; its state "
      "already lives in its tier. Offload once: offlax.offload(optax.adam(...), tier)."
    )
  if tier is None:
    checks.check_tier_options(tier_options)
    tier = HostTier(**tier_options)
  elif tier_options:
    raise errors.InvalidTierError(
      f"offload got both a tier and tier options {sorted(tier_options)}; "
      "set the options on the tier."
    )
  tier_lib.check(tier)
  inner = optax.with_extra_args_support(inner)
  ref = tier_lib.TierRef(tier)

  def init_fn(params):
    donation.install()  # JAX's pairing of donated host buffers, once offloaded state exists
    spec = ParamSpec.of(params)
    devices = devices_of(params)
    tier.check_devices(devices)
    inner_state, step = tier.init(inner, params, spec)
    checks.check_not_nested(inner_state)
    state = OffloadState(inner_state, spec, step, ref)
    abstract = (jax.core.Tracer, jax.ShapeDtypeStruct)  # traced, or specs: nothing to place
    if not any(isinstance(x, abstract) for x in jax.tree.leaves(params)):
      if spec.mesh is None and len(devices) == 1:
        device = next(iter(devices))
        mesh = sharding_lib.one_device_target(params, device)
        state = sharding_lib.on_one_device(state, mesh, device)
      tier.check_config(state, devices)
      for platform in {d.platform for d in devices}:
        telemetry.check_committed(params, platform)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    # `offlax.update_and_apply` around an optax wrapper asks through an extra argument.
    if (request := extra_args.pop(wrapped_apply.ARG, None)) is not None:
      return request.serve(
        updates, state, params,
        update=lambda u, s, p: run(u, s, p, extra_args, apply=False),
        apply=lambda u, s, p: run(u, s, p, extra_args, apply=True),
      )  # fmt: skip
    return run(updates, state, params, extra_args, apply=False)

  def apply_fn(updates, state, params, **extra_args):
    if params is None:
      raise errors.TreeMismatchError("offlax.update_and_apply needs the params.")
    return run(updates, state, params, extra_args, apply=True)

  def run(updates, state, params, extra_args, apply):
    if not isinstance(state, OffloadState):
      raise errors.TreeMismatchError(
        f"offload.update expects the OffloadState returned by init, got {type(state).__name__}."
      )
    donation.install()  # (state restored from a checkpoint: no `init` ran)
    state = flax_glue.unbox_state(state)
    spec = state.spec
    if spec.placeholder and jax.tree.leaves(updates):
      spec = checks.respec(state, updates, params)
    checks.check_same(spec, ParamSpec.of(updates, "updates"), "updates")
    if params is not None:
      checks.check_same(spec, ParamSpec.of(params), "params")
    layout = layout_lib.StateLayout(state.inner_state, spec)
    items = layout.split(state.inner_state)
    tier.check_state(state.inner_state)
    values = Step.of(inner, tier, spec, layout, items, updates, params, extra_args)
    out, new_state = _run(values, state.step, apply)
    return out, new_state._replace(tier_ref=ref)

  # An nnx.Optimizer's update around MultiSteps(offload(...)) is fused for params on the
  # device too (`nnx_hooks.fuses`): its patch is installed by the first init on Variables.
  init = flax_glue.nnx_init(init_fn, lambda: tier.boxes_state, nnx_hooks.install_update)
  return OffloadTransformation(init, update_fn, apply_fn, inner, tier)


class OffloadTransformation(apply_lib.FusedTransformation):
  """What `offload` returns: a `FusedTransformation` that names its inner transformation and tier.

  Attributes:
    inner: the inner transformation (with extra args support).
    tier: the tier holding its state.
  """

  inner: Any = None
  tier: Any = None

  def __new__(cls, init, update, update_and_apply=None, inner=None, tier=None):
    self = super().__new__(cls, init, update, update_and_apply)
    self.inner, self.tier = inner, tier
    return self


def _strategy(spec: ParamSpec, tier: Tier):
  """The strategy of a step of params `spec` in `tier`: its entry of `_STRATEGIES`."""
  on_mesh = spec.mesh is not None
  key = (on_mesh, on_mesh and tier.compute == "host", on_mesh and bool(tier.per_device))
  return _STRATEGIES[key]


def _run(st: Step, step: Any, apply: bool = False):
  """(updates, state), or with `apply` (new params, state)."""
  strategy, fuses_apply = _strategy(st.spec, st.tier)
  out, state = strategy(st, step, apply and fuses_apply)
  if apply and not fuses_apply:
    out = apply_lib.apply_updates(st.spec.treedef.unflatten(st.p_slots), out)
  return out, state


def _open_io(st: Step, step: Any, **shard: Any):
  """The tier's I/O for this step's items, and the mesh plan it was given (None: no mesh)."""
  offloaded = [_offloaded(x) for x in st.items]
  mesh_plan = None
  if st.spec.mesh is not None:
    mesh_plan = sharding_lib.plan(
      st.spec, st.layout.owners, st.items, offloaded, st.tier.shard_axis
    )
  io = st.tier.open_io(st.items, offloaded, step, mesh_plan=mesh_plan, **shard)
  checks.check_io(st.tier, io)
  return io, mesh_plan


def _streamed(st: Step, step: Any, apply: bool = False, shard=None, coupling=None):
  """The streamed update (`streaming.run`) of the step's items; `shard`: see `Tier.open_io`.

  `coupling`: the whole tree's, when the caller has it (`_on_shards`).
  `apply`: return the new params instead of the updates.
  """
  spec, layout = st.spec, st.layout
  if coupling is None:
    coupling = offload_step.analyze(st)
  io, mesh_plan = _open_io(st, step, shard=shard)
  if mesh_plan is None:
    per_slot = layout_lib.leaf_bytes(st.items, layout.owners, len(spec.shapes), _offloaded)
    cut_axes = None
  else:
    per_slot = list(mesh_plan.slot_bytes)
    cut_axes = st.at_leaves(mesh_plan.cut_axes)
  on_host = st.tier.compute == "host"
  # Equal pieces for a tier whose state the stream slices itself: its runs loop.
  built = schedule_lib.build(
    coupling, st.shapes, st.at_leaves(per_slot), st.tier.chunk_bytes, cut_axes,
    even=io.writes_in_place, min_pieces=2 if on_host else 1,
  )  # fmt: skip
  leaves = st.leaves
  slices = [tuple(dataclasses.replace(p, leaf=leaves[p.leaf]) for p in pieces) for pieces in built]
  update = lambda u, state, p, apply: st.update(u, state, p, st.extra_args, apply)
  out_u_slots, out_items = streaming.run(
    update, st.u_slots, st.p_slots, layout, st.items, io, slices, on_host=on_host, apply=apply
  )
  out_items = io.finish(out_items)
  new_state = OffloadState(layout.merge(out_items), spec, io.next_step())
  out_u_slots = sharding_lib.like_params(spec, out_u_slots)
  return spec.treedef.unflatten(out_u_slots), new_state


def _on_shards(st: Step, step: Any, apply: bool = False):
  """A `per_device` tier on a mesh: the streamed update per device, inside `jax.shard_map`.

  A callback in an SPMD program runs once, not per device; inside
  `shard_map` each device runs its own, with its shard of every array, and
  passes its mesh position (`axis_index` over every mesh axis) so that its
  callbacks use its own store. Each device updates its shard by itself, so
  the update of a sharded param must not need other shards (checked here).
  """
  del apply  # (added after it: `_STRATEGIES`)
  spec, layout, items, mesh = st.spec, st.layout, st.items, st.spec.mesh
  coupling = offload_step.analyze(st)
  checks.check_per_shard(st.tier, coupling, spec, st.leaves)
  slot_specs = [sharding_lib.slot_spec(spec, i) for i in st.leaves]
  item_specs = sharding_lib.item_specs(spec, layout, items)
  hot = [j for j, x in enumerate(items) if not isinstance(x, layout_lib.OnDisk)]
  local = sharding_lib.local_spec(spec)
  local_items: list[Any] = [
    layout_lib.OnDisk(x.index, sharding_lib.local_shape(x.shape, s, mesh), x.dtype)
    if isinstance(x, layout_lib.OnDisk)
    else None
    for x, s in zip(items, item_specs, strict=True)
  ]

  def body(u, p, hot_values, e, step):
    shard = jax.lax.axis_index(mesh.axis_names)
    its = fill(local_items, hot, hot_values)
    updates = spec.treedef.unflatten(st.put(st.u_slots, u))
    params = None if st.p_slots is None else spec.treedef.unflatten(st.put(st.p_slots, p))
    per_device = Step.of(st.inner, st.tier, local, layout, its, updates, params, st.extra(e))
    new_u, new_state = _streamed(per_device, step, shard=shard, coupling=coupling)
    new_items = layout.split(new_state.inner_state)
    new_u = jax.tree.leaves(new_u, is_leaf=layout_lib.is_masked)
    return st.at_leaves(new_u), [new_items[j] for j in hot], new_state.step

  hot_specs = [item_specs[j] for j in hot]
  p_in = [] if st.p_slots is None else st.at_leaves(st.p_slots)
  run = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(slot_specs, slot_specs[: len(p_in)], hot_specs, [P()] * len(st.arrays), P()),
    out_specs=(slot_specs, hot_specs, P()),
    # Replicated outputs are computed alike on every device, from like stores.
    check_vma=False,
  )
  new_u, new_hot, new_step = run(
    st.at_leaves(st.u_slots), p_in, [items[j] for j in hot], st.extra_arrays(), step
  )
  out_items = fill(items, hot, new_hot)
  out_u = spec.treedef.unflatten(st.put(st.u_slots, new_u))
  return out_u, OffloadState(layout.merge(out_items), spec, new_step)


def _on_host(st: Step, step: Any, apply: bool = False):
  """The whole inner update in one host computation: host compute on a mesh.

  On one device host compute runs slice by slice (`streaming.run`); on a
  mesh the slices' `dynamic_slice`s of sharded host arrays are not yet
  checked with XLA's GPU compiler, so the update stays whole there. The
  tier's I/O moves the values in (`to_host`) and ends the step (`finish`,
  `next_step`); the state does not move.
  """
  del apply  # (added after it: `_STRATEGIES`)
  spec, layout, items = st.spec, st.layout, st.items
  io, _ = _open_io(st, step)
  to_host = lambda xs: [io.to_host(x) for x in xs]

  def update(*args):
    # Typed as device values inside the host computation: the inner update
    # makes constants (device-typed), and ops need one memory space.
    u, s, p, e = jax.tree.map(memory.to_device, args)
    p_slots = None if p is None else st.put(st.p_slots, p)
    new_u, new_state = st.update(st.put(st.u_slots, u), layout.merge(s), p_slots, st.extra(e))
    return st.at_leaves(new_u), layout.split(new_state)

  on_host = compute_on(update, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
  new_u, new_items = on_host(
    to_host(st.at_leaves(st.u_slots)),
    to_host(items),
    None if st.p_slots is None else to_host(st.at_leaves(st.p_slots)),
    to_host(st.extra_arrays()),
  )
  out_u = st.put(st.u_slots, [memory.to_device(x) for x in new_u])
  out_u = sharding_lib.like_params(spec, out_u)
  # Items that were on the device (scalars, partial offload) go back there.
  out_items = [
    x if _offloaded(old) else memory.to_device(x) for old, x in zip(items, new_items, strict=True)
  ]
  out_items = io.finish(out_items)
  return spec.treedef.unflatten(out_u), OffloadState(layout.merge(out_items), spec, io.next_step())


# Where a step's update runs, by (on a mesh, compute="host", a per-device tier): the
# strategy, and whether it fuses the apply (else `_run` adds the updates to the params).
_STRATEGIES = {
  (False, False, False): (_streamed, True),  # one device: slices, on the device or the host
  (True, False, False): (_streamed, True),  # a mesh: slices of the global arrays
  (True, False, True): (_on_shards, False),  # a mesh, a store per device: slices per shard
  (True, True, False): (_on_host, False),  # a mesh, host compute: one host computation
  (True, True, True): (_on_host, False),
}


_offloaded = tier_lib.is_offloaded


def devices_of(tree: Any) -> set[Any]:
  devices: set[Any] = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      # Only this process's: other hosts' devices are not ours to inspect.
      devices |= set(leaf.sharding.addressable_devices)
  return devices or set(jax.local_devices()[:1])
