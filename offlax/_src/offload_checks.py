"""What `offload` refuses, with messages that name the leaf and the way out.

Its keyword options, an offload inside another, updates or params of another
tree than the state's, a tier whose I/O lacks what the stream reads, and a
per-device tier on a mesh whose inner update needs other shards.

Example:
  >>> import jax.numpy as jnp
  >>> from offlax._src import offload_checks
  >>> from offlax._src.layout import ParamSpec
  >>> spec = ParamSpec.of({"w": jnp.ones(2)})
  >>> try:
  ...   offload_checks.check_same(spec, ParamSpec.of({"w": jnp.ones(3)}), "updates")
  ... except ValueError as e:
  ...   print(str(e).split(";")[0])
  updates leaf ['w'] has shape (3,)
"""

from __future__ import annotations

import inspect
from typing import Any

import jax

from offlax._src import coupling as coupling_lib
from offlax._src import errors
from offlax._src import sharding as sharding_lib
from offlax._src.host_tier import HostTier
from offlax._src.layout import ParamSpec
from offlax._src.tier import OffloadState, Tier


def check_tier_options(tier_options: dict[str, Any]) -> None:
  """Refuses keywords that are not `HostTier`'s options, naming those that are."""
  known = list(inspect.signature(HostTier).parameters)
  unknown = sorted(set(tier_options) - set(known))
  if unknown:
    raise errors.InvalidOptionError(
      f"offload got unknown option(s) {unknown}: its keyword options are HostTier's, "
      f"{known} (or pass a tier: offload(inner, offlax.NVMeTier(path, ...)))."
    )


def check_not_nested(inner_state: Any) -> None:
  """Raises if an inner state holds an `OffloadState`: an offload inside another's inner."""
  is_state = lambda x: isinstance(x, OffloadState)
  if any(is_state(x) for x in jax.tree.leaves(inner_state, is_leaf=is_state)):
    raise errors.TransformationTypeError(
      "an offload transformation inside another's inner transformation (e.g. "
      "offload(chain(..., offload(...)))): a state can live in one tier. Offload once, "
      "at the outermost level: offload(chain(...), tier), or chain(..., offload(...))."
    )


def respec(state: OffloadState, updates: Any, params: Any) -> ParamSpec:
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


def check_io(tier: Tier, io: Any) -> None:
  """Raises `InvalidTierError` unless `io` states the capabilities the stream reads."""
  missing = [n for n in ("prefetch_depth", "writes_in_place", "offloaded") if not hasattr(io, n)]
  if missing:
    raise errors.InvalidTierError(
      f"{type(tier).__name__}.open_io returned a {type(io).__name__}, which lacks "
      f"{', '.join(missing)} (see offlax.extend.TierIO)."
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


def check_per_shard(
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


def check_same(expected: ParamSpec, actual: ParamSpec, what: str) -> None:
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
