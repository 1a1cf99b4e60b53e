"""Flax glue: what offlax needs to know about Flax's containers, without importing Flax."""

from __future__ import annotations

import sys
from typing import Any

import jax


def unbox(tree: Any) -> Any:
  """`tree` with Flax NNX Variables replaced by their values.

  `nnx.Optimizer` initialises the optimizer on `nnx.state(model, wrt)`, whose
  leaves sit in `Variable`s, and updates it with plain arrays
  (`nnx.as_pure`). offlax records the parameter tree at `init` and checks
  every `update` against it, so it records the plain arrays, as `update` will
  see them; the state it returns then holds plain arrays too, which NNX wraps
  in its own `OptState` variables as it does for any optax state.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:  # Flax not imported: no Variables to unbox
    return tree
  is_variable = lambda x: isinstance(x, nnx.Variable)
  if not any(is_variable(x) for x in jax.tree.leaves(tree, is_leaf=is_variable)):
    return tree
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
