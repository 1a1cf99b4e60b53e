"""An NNX model's list of layers with their params in a `LayerStore` (`offload_params(store=)`).

Each layer keeps its module tree: its params become `StoredParam`s holding an
empty placeholder, and it gains a `LayerToken`, a scalar `nnx.Param`. Where
the layer runs, `read` brings its params from the store by the token (a
`LayerSource` read, in the layer's rematerialised region), so the forward
pass and its recomputation in the backward pass read the layer from disk, and
the backward pass hands the layer's gradient to the store. The token is an
`nnx.Param` so that ``nnx.grad`` differentiates with respect to it by default:
its gradient (a zero) is what depends on the hand-off.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from offlax._src import errors
from offlax._src import nnx_paths as paths
from offlax._src.nvme.layer_source import LayerSource

# The attributes a stored layer gains: its index in the store and its token.
INDEX = "_offlax_layer"
TOKEN = "_offlax_token"


class LayerToken(nnx.Param):
  """A stored layer's token: a zero whose gradient is the hand-off of its gradients to the store."""


class StoredParam(nnx.Variable):
  """A param whose value is in a `LayerStore`: an empty placeholder between the layer's runs."""


def stack_layers(layers: Any, *, wrt: Any = nnx.Param) -> Any:
  """The params of a list of NNX layers, stacked on a new first axis for `LayerStore.create`.

  Layers of arrays give stacked arrays (the layers' size in RAM: for small
  models); layers made by `nnx.eval_shape` give `jax.ShapeDtypeStruct`s, for
  ``LayerStore.create(path, stack_layers(model.layers), init_layer=...)`` to
  write a layer at a time.

  Args:
    layers: a list of NNX modules with the same params (e.g. ``model.layers``).
    wrt: the NNX filter of the params (default: every `nnx.Param`).

  Returns:
    One layer's `nnx.State`, each leaf with the layer count as its first axis.

  Raises:
    StoreMismatchError: a layer's params differ from the first's in their
      paths, shapes or dtypes.

  Example:
    >>> import offlax
    >>> from flax import nnx
    >>> layers = [nnx.Linear(2, 3, rngs=nnx.Rngs(0)) for _ in range(4)]
    >>> offlax.stack_layers(layers)["kernel"].shape
    (4, 2, 3)
  """
  states = [nnx.state(layer, wrt) for layer in layers]
  first = _leaf_specs(states[0])
  for i, state in enumerate(states[1:], 1):
    if (specs := _leaf_specs(state)) != first:
      got, want = next(
        p for p in itertools.zip_longest(specs, first, fillvalue="nothing") if p[0] != p[1]
      )
      raise errors.StoreMismatchError(
        f"stack_layers: the layers' params differ: layer {i} has {got} where layer 0 has {want}."
      )
  if isinstance(jax.tree.leaves(states[0])[0], jax.ShapeDtypeStruct):
    n = len(states)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), states[0])
  return jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def _leaf_specs(state: Any) -> list[str]:
  return [f"{key} {np.dtype(x.dtype).name}{list(x.shape)}" for key, x in _keyed(state)]


def source_of(store: Any) -> LayerSource:
  """The `LayerSource` `offload_params(store=)` reads from: a store's `source()`, or that source."""
  from offlax._src.nvme.layer_store import LayerStore

  if isinstance(store, LayerStore):
    return store.source()
  if isinstance(store, LayerSource):
    return store
  raise errors.InvalidOptionError(
    f"offload_params: store= takes an offlax.LayerStore (or its source(accumulate=True)), "
    f"got {type(store).__name__}."
  )


def find_layers(model: Any, source: LayerSource, is_stored: Any) -> tuple[Any, ...]:
  """The path of the one list in `model` whose layers match the store, leaf for leaf."""
  lists = [
    (path, node)
    for path, node in nnx.graph.iter_graph(model)
    if isinstance(node, (list, tuple, nnx.List))
    and len(node) and all(isinstance(m, nnx.Module) for m in node)
  ]  # fmt: skip
  problems = []
  for path, node in lists:
    problem = _mismatch(path, node, source, is_stored)
    if problem is None:
      return path
    problems.append(problem)
  found = "; ".join(problems) if problems else "the model has no list of layers"
  raise errors.StoreMismatchError(
    f"offload_params: no list of layers in the model matches the store at "
    f"{source.store.path} ({source.n_layers} layers of {len(source.store.records)} params "
    f"each): {found}."
  )


def _mismatch(path: tuple[Any, ...], layers: Any, source: LayerSource, is_stored: Any):
  """Why the list at `path` does not match the store's layers, or None."""
  name = paths.name(path)
  if len(layers) != source.n_layers:
    return f"{name} has {len(layers)} layers, the store {source.n_layers}"
  records = source.store.records
  for i, layer in enumerate(layers):
    flat = _stored_leaves(layer, is_stored)
    if len(flat) != len(records):
      return f"{name}[{i}] has {len(flat)} params, the store {len(records)} per layer"
    for (key, leaf), r in zip(flat, records, strict=True):
      want = (_name(r["path"]), tuple(r["shape"]), np.dtype(r["dtype"]))
      got = (_name(key), tuple(leaf.shape), np.dtype(leaf.dtype))
      if got != want:
        return (
          f"{name}[{i}]{key} is {got[2]}{list(got[1])}, the store's leaf {r['path']} is "
          f"{want[2]}{list(want[1])}"
        )
  return None


def _stored_leaves(layer: Any, is_stored: Any) -> list[tuple[str, Any]]:
  """A layer's params that go to the store, in the store's leaf order (its state's)."""
  return _keyed(nnx.state(layer, is_stored))


def _keyed(state: Any) -> list[tuple[str, Any]]:
  """`state`'s leaves with their key paths, in its leaf order."""
  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]


def attach(layers: Any, is_stored: Any) -> None:
  """Each layer's stored params as placeholders, and its index and token."""
  for i, layer in enumerate(layers):
    for path, var in list(nnx.graph.iter_graph(layer)):
      if isinstance(var, nnx.Variable) and is_stored(path, var):
        paths.set_at(layer, path, StoredParam(_placeholder(var.get_value())))
    setattr(layer, INDEX, i)
    setattr(layer, TOKEN, LayerToken(jnp.zeros((), jnp.float32)))


def detach(layers: Any, source: LayerSource) -> None:
  """The inverse of `attach`: each layer's committed params read back into `nnx.Param`s."""
  for i, layer in enumerate(layers):
    values = iter(source.store.read_layer(i))
    for path, var in list(nnx.graph.iter_graph(layer)):
      if isinstance(var, StoredParam):
        paths.set_at(layer, path, nnx.Param(jnp.asarray(next(values))))
    delattr(layer, INDEX)
    delattr(layer, TOKEN)


def is_placeholder(stored: Any) -> bool:
  """Whether a layer's stored state holds its placeholders (it is not inside its own run)."""
  return all(x.shape == (0,) for x in jax.tree.leaves(stored))


def read(source: LayerSource, i: int, token: Any, treedef: Any) -> Any:
  """Layer `i`'s params from the store, laid out by `treedef` (its placeholders' state's)."""
  [leaf] = jax.tree.leaves(token)
  return jax.tree.unflatten(treedef, jax.tree.leaves(source.read(i, leaf)))


def _name(key: str) -> str:
  """A leaf's key without the ``.value`` of an `nnx.State`'s Variables (a plain dict has none)."""
  return key.removesuffix(".value")


def _placeholder(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((0,), x.dtype)
  return jnp.zeros((0,), x.dtype)
