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
