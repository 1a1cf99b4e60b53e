"""`offload`: the optax wrapper that keeps an optimizer's state in a tier."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from offlax._src import apply as apply_lib
from offlax._src import coupling as coupling_lib
from offlax._src import errors, flax_glue, memory, streaming, telemetry, wrapped_apply
from offlax._src import layout as layout_lib
from offlax._src import schedule as schedule_lib
from offlax._src import sharding as sharding_lib
from offlax._src import tier as tier_lib
from offlax._src.compat import compute_on
from offlax._src.host_tier import HostTier
from offlax._src.layout import ParamSpec
from offlax._src.tier import OffloadState, Tier


def _check_tier_options(tier_options: dict[str, Any]) -> None:
  """Refuses keywords that are not `HostTier`'s options, naming those that are."""
  known = list(inspect.signature(HostTier).parameters)
  unknown = sorted(set(tier_options) - set(known))
  if unknown:
    raise errors.InvalidOptionError(
      f"offload got unknown option(s) {unknown}: its keyword options are HostTier's, "
      f"{known} (or pass a tier: offload(inner, offlax.NVMeTier(path, ...)))."
    )


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
    tier: where the state lives (any `offlax.Tier`: `HostTier`, `NVMeTier`,
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
    _check_tier_options(tier_options)
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
    boxed = flax_glue.has_variables(params)
    params = flax_glue.unbox(params)
    spec = ParamSpec.of(params)
    devices = devices_of(params)
    tier.check_devices(devices)
    inner_state, step = tier.init(inner, params, spec)
    _check_not_nested(inner_state)
    state = OffloadState(inner_state, spec, step, ref)
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
      if spec.mesh is None and len(devices) == 1:
        device = next(iter(devices))
        mesh = sharding_lib.one_device_target(params, device)
        state = sharding_lib.on_one_device(state, mesh, device)
      tier.check_config(state, devices)
      for platform in {d.platform for d in devices}:
        telemetry.check_committed(params, platform)
      if boxed and tier.boxes_state:
        state = state._replace(inner_state=flax_glue.rebox(state.inner_state))
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
    # State from `init` on NNX Variables, used as is (`nnx.Optimizer` unboxes it).
    state = state._replace(inner_state=flax_glue.unbox(state.inner_state))
    spec = state.spec
    if spec.placeholder and jax.tree.leaves(updates):
      spec = _respec(state, updates, params)
    _check_same(spec, ParamSpec.of(updates, "updates"), "updates")
    if params is not None:
      _check_same(spec, ParamSpec.of(params), "params")
    values = _Step.of(inner, tier, updates, state.inner_state, params, extra_args)
    out, new_state = _run(values, spec, state.step, apply)
    return out, new_state._replace(tier_ref=ref)

  return OffloadTransformation(init_fn, update_fn, apply_fn, inner, tier)


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


def _check_not_nested(inner_state: Any) -> None:
  """Raises if an inner state holds an `OffloadState`: an offload inside another's inner."""
  is_state = lambda x: isinstance(x, OffloadState)
  if any(is_state(x) for x in jax.tree.leaves(inner_state, is_leaf=is_state)):
    raise errors.TransformationTypeError(
      "an offload transformation inside another's inner transformation (e.g. "
      "offload(chain(..., offload(...)))): a state can live in one tier. Offload once, "
      "at the outermost level: offload(chain(...), tier), or chain(..., offload(...))."
    )


def _respec(state: OffloadState, updates: Any, params: Any) -> ParamSpec:
  """The spec of a state whose own is a placeholder's (it came through `optax.tree.map_params`).

  `optax.tree.map_params` builds its result on a state initialised for a
  placeholder, so the spec it carries is the placeholder's; the updates give
  the tree and shapes again. Params on a mesh are not visible inside `jit`.
  """
  source = params if params is not None else updates
  spec = ParamSpec.of(source, "params" if params is not None else "updates")
  traced = [x for x in jax.tree.leaves(source) if isinstance(x, jax.core.Tracer)]
  on_mesh = any(getattr(jax.typeof(x).sharding.mesh, "size", 1) > 1 for x in traced)
  if spec.mesh is None and on_mesh:
    raise errors.TreeMismatchError(
      "offload.update got a state whose spec is optax's params placeholder (the state came "
      "through optax.tree.map_params), and params sharded on a mesh, whose shardings are not "
      "visible inside jit. Give the state its spec back: "
      "state = new_state._replace(spec=old_state.spec)."
    )
  return spec


@dataclasses.dataclass(frozen=True)
class _Step:
  """One traced `update`'s values: the inner transformation, the tier, the flat slots.

  The functions below (`_run`, `_streamed`, `_on_shards`, `_on_host`,
  `_analyze`) are the strategies of a step, each a function of these values.
  """

  inner: Any
  tier: Any
  u_slots: list[Any]
  p_slots: list[Any] | None
  extra_args: dict[str, Any]
  inner_state: Any

  @classmethod
  def of(cls, inner, tier, updates, inner_state, params, extra_args) -> _Step:
    u_slots = jax.tree.leaves(updates, is_leaf=layout_lib.is_masked)
    p_slots = None if params is None else jax.tree.leaves(params, is_leaf=layout_lib.is_masked)
    return cls(inner, tier, u_slots, p_slots, extra_args, inner_state)


def _run(st: _Step, spec: ParamSpec, step: Any, apply: bool = False):
  """(updates, state), or with `apply` (new params, state)."""
  layout = layout_lib.StateLayout(st.inner_state, spec)
  items = layout.split(st.inner_state)
  st.tier.check_state(st.inner_state)
  if spec.mesh is not None:
    if st.tier.compute == "host":
      updates, state = _on_host(st, layout, items, spec, step)
    elif st.tier.per_device:
      updates, state = _on_shards(st, layout, items, spec, step)
    else:
      return _streamed(st, layout, items, spec, step, apply=apply)
    if not apply:
      return updates, state
    params = spec.treedef.unflatten(st.p_slots)
    return apply_lib.apply_updates(params, updates), state
  return _streamed(st, layout, items, spec, step, apply=apply)


def _streamed(st: _Step, layout, items, spec, step, shard=None, coupling=None, apply=False):
  """The streamed update (`streaming.run`) of `items`; `shard`: see `Tier.open_io`.

  `coupling`: the whole tree's, when the caller has it (`_on_shards`).
  `apply`: return the new params instead of the updates.
  """
  leaves = [i for i, s in enumerate(spec.shapes) if s is not None]
  shapes = [s for s in spec.shapes if s is not None]
  if coupling is None:
    coupling = _analyze(st, layout, items, leaves, shapes)
  offloaded = [_offloaded(x) for x in items]
  mesh_plan = None
  if spec.mesh is not None:
    mesh_plan = sharding_lib.plan(spec, layout.owners, items, offloaded, st.tier.shard_axis)
  io = st.tier.open_io(items, offloaded, step, mesh_plan=mesh_plan, shard=shard)
  if mesh_plan is None:
    per_slot = layout_lib.leaf_bytes(items, layout.owners, len(spec.shapes), _offloaded)
    cut_axes = None
  else:
    per_slot = list(mesh_plan.slot_bytes)
    cut_axes = [mesh_plan.cut_axes[i] for i in leaves]
  leaf_bytes = [per_slot[i] for i in leaves]
  on_host = st.tier.compute == "host"
  _check_io(st.tier, io)
  # Equal pieces for a tier whose state the stream slices itself: its runs loop.
  built = schedule_lib.build(
    coupling, shapes, leaf_bytes, st.tier.chunk_bytes, cut_axes,
    even=io.writes_in_place, min_pieces=2 if on_host else 1,
  )  # fmt: skip
  slices = [tuple(dataclasses.replace(p, leaf=leaves[p.leaf]) for p in pieces) for pieces in built]
  update = lambda u, state, p, apply: _update(st, spec, u, state, p, st.extra_args, apply)
  out_u_slots, out_items = streaming.run(
    update, st.u_slots, st.p_slots, layout, items, io, slices, on_host=on_host, apply=apply
  )
  out_items = io.finish(out_items)
  new_state = OffloadState(layout.merge(out_items), spec, io.next_step())
  out_u_slots = sharding_lib.like_params(spec, out_u_slots)
  return spec.treedef.unflatten(out_u_slots), new_state


def _on_shards(st: _Step, layout, items, spec: ParamSpec, step: Any):
  """A `per_device` tier on a mesh: the streamed update per device, inside `jax.shard_map`.

  A callback in an SPMD program runs once, not per device; inside
  `shard_map` each device runs its own, with its shard of every array, and
  passes its mesh position (`axis_index` over every mesh axis) so that its
  callbacks use its own store. Each device updates its shard by itself, so
  the update of a sharded param must not need other shards (checked here).
  """
  mesh = spec.mesh
  leaves = [i for i, s in enumerate(spec.shapes) if s is not None]
  coupling = _analyze(st, layout, items, leaves, [spec.shapes[i] for i in leaves])
  _check_per_shard(st.tier, coupling, spec, leaves)
  slot_specs = [sharding_lib.slot_spec(spec, i) for i in leaves]
  item_specs = sharding_lib.item_specs(spec, layout, items)
  hot = [j for j, x in enumerate(items) if not isinstance(x, layout_lib.OnDisk)]
  local = sharding_lib.local_spec(spec)
  local_items: list[Any] = [
    layout_lib.OnDisk(x.index, sharding_lib.local_shape(x.shape, s, mesh), x.dtype)
    if isinstance(x, layout_lib.OnDisk)
    else None
    for x, s in zip(items, item_specs, strict=True)
  ]
  extra_leaves, extra_def = jax.tree.flatten(st.extra_args)
  arrays = [i for i, x in enumerate(extra_leaves) if layout_lib.is_array(x)]

  def body(u, p, hot_values, e, step):
    shard = jax.lax.axis_index(mesh.axis_names)
    its = _fill(local_items, hot, hot_values)
    updates = spec.treedef.unflatten(_fill(st.u_slots, leaves, u))
    params = None if st.p_slots is None else spec.treedef.unflatten(_fill(st.p_slots, leaves, p))
    extra_args = jax.tree.unflatten(extra_def, _fill(extra_leaves, arrays, e))
    per_device = _Step.of(st.inner, st.tier, updates, layout.merge(its), params, extra_args)
    new_u, new_state = _streamed(per_device, layout, its, local, step, shard, coupling)
    new_items = layout.split(new_state.inner_state)
    new_u = jax.tree.leaves(new_u, is_leaf=layout_lib.is_masked)
    return [new_u[i] for i in leaves], [new_items[j] for j in hot], new_state.step

  hot_specs = [item_specs[j] for j in hot]
  p_in = [] if st.p_slots is None else [st.p_slots[i] for i in leaves]
  run = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(slot_specs, slot_specs[: len(p_in)], hot_specs, [P()] * len(arrays), P()),
    out_specs=(slot_specs, hot_specs, P()),
    # Replicated outputs are computed alike on every device, from like stores.
    check_vma=False,
  )
  new_u, new_hot, new_step = run(
    [st.u_slots[i] for i in leaves],
    p_in,
    [items[j] for j in hot],
    [extra_leaves[i] for i in arrays],
    step,
  )
  out_items = _fill(items, hot, new_hot)
  out_u = spec.treedef.unflatten(_fill(st.u_slots, leaves, new_u))
  return out_u, OffloadState(layout.merge(out_items), spec, new_step)


def _update(st: _Step, spec, u_slots, state, p_slots, extra_args, apply=False):
  """The inner update of flat slots: (updates, state), or with `apply` (new params, state)."""
  updates = spec.treedef.unflatten(u_slots)
  params = None if p_slots is None else spec.treedef.unflatten(p_slots)
  if apply:  # the inner's own fused step where it has one (offlax.adam, master_weights)
    out, new_state = apply_lib.update_and_apply(st.inner, updates, state, params, **extra_args)
  else:
    out, new_state = st.inner.update(updates, state, params, **extra_args)
  return jax.tree.leaves(out, is_leaf=layout_lib.is_masked), new_state


def _on_host(st: _Step, layout, items, spec, step):
  """The whole inner update in one host computation: host compute on a mesh.

  On one device host compute runs slice by slice (`streaming.run`); on a
  mesh the slices' `dynamic_slice`s of sharded host arrays are not yet
  checked with XLA's GPU compiler, so the update stays whole there. The
  tier's I/O moves the values in (`to_host`) and ends the step (`finish`,
  `next_step`); the state does not move.
  """
  leaves = [i for i, s in enumerate(spec.shapes) if s is not None]
  offloaded = [_offloaded(x) for x in items]
  mesh_plan = sharding_lib.plan(spec, layout.owners, items, offloaded, st.tier.shard_axis)
  io = st.tier.open_io(items, offloaded, step, mesh_plan=mesh_plan)
  _check_io(st.tier, io)
  extra_leaves, extra_def = jax.tree.flatten(st.extra_args)
  arrays = [i for i, x in enumerate(extra_leaves) if layout_lib.is_array(x)]
  to_host = lambda xs: [io.to_host(x) for x in xs]

  def update(*args):
    # Typed as device values inside the host computation: the inner update
    # makes constants (device-typed), and ops need one memory space.
    u, s, p, e = jax.tree.map(memory.to_device, args)
    extra_args = jax.tree.unflatten(extra_def, _fill(extra_leaves, arrays, e))
    p_slots = None if p is None else _fill(st.p_slots, leaves, p)
    new_u, new_state = _update(
      st, spec, _fill(st.u_slots, leaves, u), layout.merge(s), p_slots, extra_args
    )
    return [new_u[i] for i in leaves], layout.split(new_state)

  on_host = compute_on(update, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
  new_u, new_items = on_host(
    to_host([st.u_slots[i] for i in leaves]),
    to_host(items),
    None if st.p_slots is None else to_host([st.p_slots[i] for i in leaves]),
    to_host([extra_leaves[i] for i in arrays]),
  )
  out_u = _fill(st.u_slots, leaves, [memory.to_device(x) for x in new_u])
  out_u = sharding_lib.like_params(spec, out_u)
  # Items that were on the device (scalars, partial offload) go back there.
  out_items = [
    x if _offloaded(old) else memory.to_device(x) for old, x in zip(items, new_items, strict=True)
  ]
  out_items = io.finish(out_items)
  return spec.treedef.unflatten(out_u), OffloadState(layout.merge(out_items), spec, io.next_step())


def _analyze(st: _Step, layout, items, leaves, shapes) -> coupling_lib.Coupling:
  """Traces the inner update on the whole tree and derives its coupling."""
  extra_leaves, extra_def = jax.tree.flatten(st.extra_args)
  arrays = [i for i, x in enumerate(extra_leaves) if layout_lib.is_array(x)]
  if any(np.ndim(extra_leaves[i]) for i in arrays):
    return coupling_lib.single_group(len(leaves), "an extra argument is a non-scalar array")
  position = {leaf: k for k, leaf in enumerate(leaves)}
  spec = layout.spec

  def restricted(keep):
    """The flat inner update of the leaves in `keep`, the others masked as in a slice."""
    kept = [i for i in leaves if i in keep]
    kept_items = [j for j, o in enumerate(layout.owners) if o == coupling_lib.GLOBAL or o in keep]
    mask = lambda slots: [
      layout_lib.MASKED() if i in position and i not in keep else x for i, x in enumerate(slots)
    ]

    def flat_update(u, s, p, e):
      extra_args = jax.tree.unflatten(extra_def, _fill(extra_leaves, arrays, e))
      u_slots = _fill(mask(st.u_slots), kept, u)
      p_slots = None if p is None else _fill(mask(st.p_slots), kept, p)
      s_items = _fill([layout_lib.MASK] * len(items), kept_items, s)
      new_u, new_state = _update(st, spec, u_slots, layout.merge(s_items), p_slots, extra_args)
      new_items = layout.split(new_state)
      return [new_u[i] for i in kept], [new_items[j] for j in kept_items]

    u_args = abstract([st.u_slots[i] for i in kept])
    p_args = None if st.p_slots is None else abstract([st.p_slots[i] for i in kept])
    args = (u_args, abstract([items[j] for j in kept_items]), p_args)
    return flat_update, (*args, abstract([extra_leaves[i] for i in arrays]))

  abstract = lambda xs: [
    jax.ShapeDtypeStruct(layout_lib.shape_of(x), layout_lib.dtype_of(x)) for x in xs
  ]
  flat_update, args = restricted(set(leaves))
  jaxpr = jax.make_jaxpr(flat_update)(*args)
  p_args = args[2]
  owner = lambda o: o if o == coupling_lib.GLOBAL else position[o]
  in_owners = (
    list(range(len(leaves)))
    + [owner(o) for o in layout.owners]
    + ([] if p_args is None else list(range(len(leaves))))
    + [coupling_lib.GLOBAL] * len(arrays)
  )
  out_owners = list(range(len(leaves))) + [owner(o) for o in layout.owners]
  coupling = coupling_lib.analyze(jaxpr, in_owners, out_owners, shapes)
  reason = (
    None if len(coupling.groups) < 2 else _dtype_dependence(restricted, leaves, args[0], jaxpr)
  )
  if reason is None:
    return coupling
  # One slice; each leaf's update is still its own (elementwise leaves stay
  # `splittable`: the NVMe tier on a mesh updates each shard by itself).
  return dataclasses.replace(coupling, groups=(tuple(range(len(leaves))),), reason=reason)


def _dtype_dependence(restricted, leaves, u_args, jaxpr) -> str | None:
  """Why the update of some leaves would change if other leaves left the call, or None.

  The coupling analysis follows values, not dtypes; some transformations read
  the dtypes of the whole tree (`optax.inject_hyperparams` casts its
  hyperparameters to the highest float dtype among the params), so a slice
  without the tree's highest dtype would compute in another precision, or
  fail (no common dtype for float16 and bfloat16 without a float32 leaf). For
  a tree of several float dtypes, the leaves of each proper subset of them are
  traced alone (at most 14 traces: four dtypes): a failure, or an operation the
  whole tree does not do (e.g. a cast to another dtype), keeps one slice.
  """
  floats = sorted({str(a.dtype) for a in u_args if jax.dtypes.issubdtype(a.dtype, np.floating)})
  if len(floats) < 2:
    return None
  if len(floats) > 4:
    return f"the params have {len(floats)} float dtypes ({', '.join(floats)})"
  whole = coupling_lib.signatures(jaxpr)  # the whole tree's update
  subsets = [c for n in range(1, len(floats)) for c in itertools.combinations(floats, n)]
  for dtypes in subsets:
    keep = {i for i, a in zip(leaves, u_args, strict=True) if str(a.dtype) in dtypes}
    fn, args = restricted(keep)
    what = f"the update of the {'/'.join(dtypes)} leaves"
    try:
      part = coupling_lib.signatures(jax.make_jaxpr(fn)(*args))
    except Exception as e:  # the inner update's own error: the whole tree avoids it
      first = (str(e).splitlines() or [""])[0][:200]
      return f"{what} fails without the others ({type(e).__name__}: {first})"
    extra = part - whole
    if extra:
      prim, ins, outs = next(iter(extra))
      return (
        f"{what} computes differently without the others "
        f"({prim} of {ins} to {outs} is not in the whole tree's update)"
      )
  return None


def _check_io(tier: Tier, io: Any) -> None:
  """Raises `InvalidTierError` unless `io` states the capabilities the stream reads."""
  missing = [n for n in ("prefetch_depth", "writes_in_place", "offloaded") if not hasattr(io, n)]
  if missing:
    raise errors.InvalidTierError(
      f"{type(tier).__name__}.open_io returned a {type(io).__name__}, which lacks "
      f"{', '.join(missing)} (see offlax.TierIO)."
    )
  depth = io.prefetch_depth
  if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
    raise errors.InvalidTierError(
      f"{type(io).__name__}.prefetch_depth must be an int >= 1, got {depth!r}."
    )
  if tier.compute == "host" and not io.writes_in_place:
    raise errors.InvalidTierError(
      f"{type(tier).__name__}.compute is 'host', but its I/O does not write in place "
      "(writes_in_place=False): a host computation slices the state arrays itself."
    )


def _check_per_shard(
  tier: Tier, coupling: coupling_lib.Coupling, spec: ParamSpec, leaves: list[int]
) -> None:
  """Raises `InvalidTierError` if the update of a sharded param needs other shards.

  A `per_device` tier (the NVMe tier) on a mesh updates each device's shard by itself, which is
  exact for elementwise updates (adam, sgd, ...) and for replicated params.
  """
  paths, mesh = spec.paths, spec.mesh
  sharded_leaf = lambda i: sharding_lib.shards(spec.specs[i], mesh, len(spec.shapes[i] or ())) > 1
  # Elementwise (`splittable`) leaves need nothing but their own shard, even
  # where the schedule keeps them in one slice (see `_dtype_dependence`).
  sharded = [
    paths[leaves[k]]
    for k in range(len(leaves))
    if k not in coupling.splittable and sharded_leaf(leaves[k])
  ]
  if sharded:
    why = (coupling.reason if not coupling.splittable else None) or "it is not elementwise"
    raise errors.InvalidTierError(
      f"{type(tier).__name__} on a mesh updates each device's shard of the state by itself, "
      f"but the inner update of sharded param(s) {', '.join(sharded[:3])} needs the other "
      f"shards ({why}; "
      "e.g. optax.clip_by_global_norm needs the norm over all of them). Chain such "
      "transformations outside offload, where they see global arrays: "
      "optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(...), tier)); "
      "or use offlax.HostTier on a mesh."
    )


_offloaded = tier_lib.is_offloaded


def _fill(slots, leaves, values):
  out = list(slots)
  for i, v in zip(leaves, values, strict=True):
    out[i] = v
  return out


def _check_same(expected: ParamSpec, actual: ParamSpec, what: str) -> None:
  if expected.treedef != actual.treedef:
    want, got = expected.paths, actual.paths
    missing = [p for p in want if p not in got]
    extra = [p for p in got if p not in want]
    detail = (
      f"missing leaves {', '.join(missing[:5]) or 'none'}; "
      f"unexpected leaves {', '.join(extra[:5]) or 'none'}"
      if missing or extra
      else f"expected structure {expected.treedef}, got {actual.treedef}"
    )
    raise errors.TreeMismatchError(
      f"{what} do not have the structure of the params the state was initialised with: {detail}."
    )
  for path, want_shape, got_shape in zip(
    expected.paths, expected.shapes, actual.shapes, strict=True
  ):
    if want_shape != got_shape:
      raise errors.TreeMismatchError(
        f"{what} leaf {path or '<root>'} has shape {got_shape}; the state was "
        f"initialised for shape {want_shape}."
      )


def devices_of(tree: Any) -> set[Any]:
  devices: set[Any] = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      # Only this process's: other hosts' devices are not ours to inspect.
      devices |= set(leaf.sharding.addressable_devices)
  return devices or set(jax.local_devices()[:1])
