"""Flax glue: what offlax needs to know about Flax's containers, without importing Flax."""

from __future__ import annotations

import sys
from typing import Any

import jax


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


def nnx_update(optimizer: Any, model: Any, grads: Any, /, **kwargs: Any) -> None:
  """`optimizer.update(model, grads)` with the update fused with its apply (`update_and_apply`).

  `nnx.Optimizer.update` runs ``tx.update`` and then `optax.apply_updates`,
  which for params in host memory is compute on host memory (XLA's GPU
  compiler converts it into slow host compute of its own) after a model-sized
  updates buffer. With `offlax.offload` as the optimizer's transformation this
  writes the new params slice by slice instead; the result is the same.

  Args:
    optimizer: an `nnx.Optimizer` built on `model`.
    model: the model whose params `optimizer` updates (its ``wrt`` filter).
    grads: the gradients, from `nnx.grad` of `model`.
    **kwargs: extra arguments of ``tx.update``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, offlax.offload(optax.sgd(0.1)), wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, optimizer, x):
    ...   grads = nnx.grad(lambda m: m(x).sum())(model)
    ...   offlax.nnx_update(optimizer, model, grads)
    >>> step(model, optimizer, jnp.ones((1, 2)))
    >>> int(optimizer.step[...])
    1
  """
  from flax import nnx

  from offlax._src.apply import update_and_apply

  graph = getattr(optimizer, "graph", None)
  state = lambda tree, *filters: nnx.state(tree, *filters, graph=graph)
  params = nnx.as_pure(state(model, optimizer.wrt))
  grads = nnx.as_pure(state(grads, optimizer.wrt))
  new_params, new_state = update_and_apply(
    optimizer.tx, grads, nnx.as_pure(optimizer.opt_state), params, **nnx.as_pure(kwargs)
  )
  nnx.update(model, new_params)
  nnx.update(optimizer.opt_state, state(new_state))
  optimizer.step[...] += 1


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

  install_sharding_fixes()

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


def install_sharding_fixes() -> None:
  """Keeps offloaded state in host memory where NNX frameworks place it by partition specs.

  Idempotent. Two places where a partition spec, which has no memory kind,
  becomes a sharding in device memory:

  * ``nnx.get_named_sharding(state, mesh)`` (Tunix's restore target for the
    optimizer state): here the sharding of a Variable whose metadata names a
    ``memory_kind`` gets that memory kind.
  * ``jax.lax.with_sharding_constraint(x, P(...))`` outside ``jit`` (Tunix's
    ``_shard_optimizer``): eagerly JAX moves a host array given a bare
    `PartitionSpec` to device memory, while inside ``jit`` the same constraint
    keeps its memory kind; here eager calls keep it as ``jit`` does. Shardings
    passed as `jax.sharding.Sharding`s (which name a memory kind) are as given.
  """
  from flax import nnx
  from flax.nnx import spmd

  if not getattr(spmd.get_named_sharding, "offlax_memory_kinds", False):
    original = spmd.get_named_sharding

    def get_named_sharding(tree, mesh):
      shardings = original(tree, mesh)
      is_leaf = lambda x: isinstance(x, nnx.Variable)

      def keep(v, s):
        kind = _memory_kind_of(v)
        if kind is None:
          return s
        if isinstance(s, nnx.Variable):
          return s.replace(s.get_value().with_memory_kind(kind))
        return s.with_memory_kind(kind)

      return jax.tree.map(keep, tree, shardings, is_leaf=is_leaf)

    get_named_sharding.offlax_memory_kinds = True  # type: ignore[attr-defined]
    spmd.get_named_sharding = get_named_sharding
    nnx.get_named_sharding = get_named_sharding

  if not getattr(jax.lax.with_sharding_constraint, "offlax_memory_kinds", False):
    wsc = jax.lax.with_sharding_constraint

    def with_sharding_constraint(x, shardings):
      from jax._src import mesh as mesh_lib

      mesh = mesh_lib.get_concrete_mesh()
      if mesh is None or mesh.empty:
        mesh = mesh_lib.thread_resources.env.physical_mesh
      is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec)

      def keep(s, leaf):
        if (
          is_spec(s)
          and not mesh.empty
          and isinstance(leaf, jax.Array)
          and not isinstance(leaf, jax.core.Tracer)
          and getattr(leaf.sharding, "memory_kind", None) == _HOST
        ):
          return jax.sharding.NamedSharding(mesh, s, memory_kind=_HOST)
        return s

      try:
        shardings = jax.tree.map(keep, shardings, x, is_leaf=is_spec)
      except ValueError:  # a prefix tree of shardings: JAX's own rules, unchanged
        pass
      return wsc(x, shardings)

    with_sharding_constraint.offlax_memory_kinds = True  # type: ignore[attr-defined]
    jax.lax.with_sharding_constraint = with_sharding_constraint
