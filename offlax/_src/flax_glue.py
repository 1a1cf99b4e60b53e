"""Flax glue: what offlax needs to know about Flax's containers, without importing Flax.

`offload`'s handling of NNX Variables lives here: `nnx_init` wraps its `init`
(unboxes the params, reboxes the state), `unbox_state` starts its `update`.

Also two process-wide patches for NNX frameworks (`install_sharding_fixes`,
listed in docs/patches.md), installed when `init` first boxes state in NNX
Variables.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax

from offlax._src import compat, patches


def has_variables(tree: Any) -> bool:
  """Whether `tree` holds Flax NNX Variables."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return False
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return any(is_variable(x) for x in jax.tree.leaves(tree, is_leaf=is_variable))


def unbox(tree: Any) -> Any:
  """`tree` with Flax NNX Variables replaced by their values.

  `nnx.Optimizer` initialises the optimizer on `nnx.state(model, wrt)`, whose
  leaves sit in `Variable`s, and updates it with plain arrays
  (`nnx.as_pure`). offlax records the parameter tree at `init` and checks
  every `update` against it, so it records the plain arrays, as `update` will
  see them; the state it returns then holds plain arrays too, which NNX wraps
  in its own `OptState` variables as it does for any optax state.
  """
  if not has_variables(tree):  # (Flax not imported: none)
    return tree
  is_variable = lambda x: isinstance(x, sys.modules["flax.nnx"].Variable)
  return jax.tree.map(lambda x: x.get_value() if is_variable(x) else x, tree, is_leaf=is_variable)


def nnx_init(
  init: Callable[[Any], Any],
  boxes_state: Callable[[], bool],
  on_variables: Callable[[], None] = lambda: None,
) -> Callable[[Any], Any]:
  """`offload`'s `init` for params that may sit in NNX Variables (`nnx.Optimizer`'s).

  `init` sees the plain arrays (`unbox`); given concrete Variables, and where
  the tier asks for it (``boxes_state()``: `Tier.boxes_state`), the state's
  arrays come back in Variables that say where they live (`rebox`).

  Args:
    init: ``init(params) -> OffloadState`` on plain arrays.
    boxes_state: whether the tier's state is boxed, read at each call.
    on_variables: called first at each call given Variables, concrete or traced.

  Returns:
    ``init`` for params with or without NNX Variables.

  Example:
    >>> import jax.numpy as jnp
    >>> from offlax._src import flax_glue
    >>> init = flax_glue.nnx_init(lambda p: p, lambda: True)
    >>> init({"w": jnp.ones(2)})["w"].shape  # no Variables: `init`'s answer
    (2,)
  """

  def init_fn(params):
    if has_variables(params):
      on_variables()
    boxed = in_concrete_variables(params)
    state = init(unbox(params))
    if boxed and boxes_state():
      state = state._replace(inner_state=rebox(state.inner_state))
    return state

  return init_fn


def in_concrete_variables(params: Any) -> bool:
  """Whether `params` sit in NNX Variables holding concrete arrays (`nnx.Optimizer`'s, not
  traced): the state made from them goes back in Variables (`rebox`)."""
  concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(unbox(params)))
  return concrete and has_variables(params)


def unbox_state(state: Any) -> Any:
  """An `OffloadState` from `nnx_init` with its Variables' values (`nnx.Optimizer` unboxes it)."""
  return state._replace(inner_state=unbox(state.inner_state))


def rebox(state: Any) -> Any:
  """`state` with its arrays that live off the device or sharded in NNX `Variable`s.

  For `init` given NNX Variables (`nnx.Optimizer`): the Variables' metadata
  says where each array lives, so frameworks that place the optimizer state by
  it (``nnx.get_partition_spec``, ``nnx.get_named_sharding``: Tunix shards and
  restores it so) keep it there. `out_sharding` is the array's own spec (not the
  param's: `HostTier.shard_axis` may shard the state further), `memory_kind`
  its memory kind when it is in host memory. `nnx.Optimizer` copies the
  metadata into its `OptVariable`s, as for plain optax, whose state holds the
  params' Variables; `update` unboxes them.
  """
  from flax import nnx

  from offlax._src import flax_on_disk, layout

  install_sharding_fixes()
  # Placeholders made before Flax NNX was imported did not register it (`layout.OnDisk`).
  flax_on_disk.register(layout.OnDisk)

  def box(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or not isinstance(sharding, jax.sharding.NamedSharding):
      return x
    metadata: dict[str, Any] = {}
    if any(p is not None for p in sharding.spec):
      metadata["out_sharding"] = tuple(sharding.spec)
    if sharding.memory_kind == _HOST:
      metadata["memory_kind"] = _HOST
    return nnx.Variable(x, **metadata) if metadata else x

  return jax.tree.map(box, state)


_HOST = "pinned_host"


def _memory_kind_of(v: Any) -> str | None:
  nnx = sys.modules.get("flax.nnx")
  if nnx is None or not isinstance(v, nnx.Variable):
    return None
  return v.get_metadata().get("memory_kind")


NAMED_SHARDING = patches.register(
  patches.Patch(
    name="nnx-named-sharding-memory-kind",
    target="flax.nnx.get_named_sharding",
    scope="process",
    upstream=(
      "get_named_sharding builds NamedSharding(mesh, spec) from a Variable's partition "
      "spec alone, in device memory, whatever the Variable's memory_kind metadata says "
      "(flax/nnx/spmd.py)"
    ),
    versions="flax 0.12.8, jax 0.10.2",
    failure=(
      "Tunix 0.1.7 restores an offloaded optimizer state on a mesh into device memory; "
      "the first step raises MemoryKindError"
    ),
  )
)
SHARDING_CONSTRAINT = patches.register(
  patches.Patch(
    name="eager-sharding-constraint-memory-kind",
    target="jax.lax.with_sharding_constraint",
    scope="process",
    upstream=(
      "outside jit, with_sharding_constraint(x, PartitionSpec) makes a device-memory "
      "NamedSharding from the spec and copies a pinned_host array to the device; inside "
      "jit the same constraint keeps its memory kind (jax/_src/pjit.py)"
    ),
    versions="jax 0.10.2",
    failure=(
      "Tunix 0.1.7's PeftTrainer on a mesh moves the offloaded optimizer state to device "
      "memory in its constructor (_shard_optimizer); the first step raises MemoryKindError"
    ),
  )
)


def _is_offloaded(v: Any) -> bool:
  """Whether `v` is a Variable of offlax's state in host memory (`rebox`'s metadata)."""
  return _memory_kind_of(v) == _HOST


def _wrap_get_named_sharding(original: Callable[..., Any]) -> Callable[..., Any]:
  from flax import nnx

  @functools.wraps(original)
  def get_named_sharding(tree, mesh):
    shardings = original(tree, mesh)
    is_leaf = lambda x: isinstance(x, nnx.Variable)
    if not any(_is_offloaded(v) for v in jax.tree.leaves(tree, is_leaf=is_leaf)):
      return shardings  # no Variable of offlax's in host memory: Flax's answer as it is

    def keep(v, s):
      if not _is_offloaded(v):
        return s
      if isinstance(s, nnx.Variable):
        return s.replace(s.get_value().with_memory_kind(_HOST))
      return s.with_memory_kind(_HOST)

    return jax.tree.map(keep, tree, shardings, is_leaf=is_leaf)

  return get_named_sharding


def _eager_on_host(v: Any) -> bool:
  """Whether `v` is a Variable of offlax's holding a concrete (untraced) array in host memory."""
  if not _is_offloaded(v):
    return False
  value = v.get_value()
  return (
    isinstance(value, jax.Array)
    and not isinstance(value, jax.core.Tracer)
    and getattr(value.sharding, "memory_kind", None) == _HOST
  )


def _wrap_with_sharding_constraint(original: Callable[..., Any]) -> Callable[..., Any]:
  from flax import nnx

  @functools.wraps(original)
  def with_sharding_constraint(x, shardings, *args, **kwargs):
    is_variable = lambda v: isinstance(v, nnx.Variable)
    eager = any(_eager_on_host(v) for v in jax.tree.leaves(x, is_leaf=is_variable))
    mesh = compat.context_mesh() if eager else None  # (only outside jit: no tracers)
    if mesh is None:
      return original(x, shardings, *args, **kwargs)  # JAX's, as it is
    is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)

    def keep(s, v):
      # A bare spec (no memory kind) for a host array of offlax's: the spec in host memory.
      spec = s.get_value() if is_variable(s) else s
      if not (is_spec(spec) and _eager_on_host(v)):
        return s
      host = jax.sharding.NamedSharding(mesh, spec, memory_kind=_HOST)
      return s.replace(host) if is_variable(s) else host

    try:
      shardings = jax.tree.map(keep, shardings, x, is_leaf=lambda s: is_spec(s) or is_variable(s))
    except ValueError:  # shardings not of x's structure (a prefix): JAX's rules, unchanged
      pass
    return original(x, shardings, *args, **kwargs)

  return with_sharding_constraint


def install_sharding_fixes() -> None:
  """Keeps offloaded state in host memory where NNX frameworks place it by partition specs.

  Idempotent; ``OFFLAX_NO_PATCHES=1`` leaves both functions as they are. Two
  process-wide patches (docs/patches.md), each acting only on trees holding
  Variables of offlax's state in host memory (``memory_kind`` metadata, from
  `rebox`) and handing every other call through unchanged:

  * ``nnx.get_named_sharding(state, mesh)`` (Tunix's restore target for the
    optimizer state): the sharding of such a Variable gets its memory kind.
  * ``jax.lax.with_sharding_constraint(state, specs)`` outside ``jit`` (Tunix's
    ``_shard_optimizer``): eagerly JAX moves a host array given a bare
    `PartitionSpec` to device memory, while inside ``jit`` the same constraint
    keeps its memory kind; such a Variable's array keeps it eagerly too.
  """
  from flax import nnx
  from flax.nnx import spmd

  patches.replace(
    NAMED_SHARDING,
    spmd,
    "get_named_sharding",
    _wrap_get_named_sharding,
    also=[(nnx, "get_named_sharding")],
  )
  patches.replace(
    SHARDING_CONSTRAINT, jax.lax, "with_sharding_constraint", _wrap_with_sharding_constraint
  )
