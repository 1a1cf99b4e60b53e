"""An NNX model's list of layers with their params in a `LayerStore` (`offload_params(store=)`).

Each layer keeps its module tree: its params become `StoredParam`s holding an
one-element placeholder, and it gains a `LayerToken`, a scalar `nnx.Param`. Where
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

from offlax._src import errors, memory
from offlax._src import nnx_paths as paths
from offlax._src.layer_store import guards as layer_guards
from offlax._src.layer_store import whole_norm
from offlax._src.layer_store.source import LayerSource

# The attributes a stored layer gains: its index in the store and its token.
INDEX = "_offlax_layer"
TOKEN = whole_norm.TOKEN  # (defined where flax is not imported: the clip finds tokens by it)
SOURCE = "_offlax_source"  # of a stored layer's class: the `LayerSource` its layers read


class LayerToken(nnx.Param):
  """A stored layer's token: a zero whose gradient is the hand-off of its gradients to the store."""


class StoredParam(nnx.Variable):
  """A param whose value is in a `LayerStore`: a placeholder between the layer's runs."""


def stack_layers(layers: Any, path: str | None = None, *, wrt: Any = nnx.Param) -> Any:
  """The params of a list of NNX layers, stacked on a new first axis for `LayerStore.create`.

  Layers of arrays give stacked arrays (the layers' size in RAM: for small
  models); layers made by `nnx.eval_shape` give `jax.ShapeDtypeStruct`s, for
  ``LayerStore.create(path, stack_layers(model, "layers"), init_layer=...)`` to
  write a layer at a time.

  ``stack_layers(model, "encoder")`` stacks ``model.encoder`` and records
  which list it is: `LayerStore.create` writes that in the store, and
  ``offload_params(model, store=)`` attaches the store to that list. A bare
  list (``stack_layers(model.encoder)``) records nothing: the store then goes
  to the one list of the model that matches it, and where several do (an
  encoder and a decoder of the same shapes), ``offload_params`` needs
  ``layers="encoder"``.

  Args:
    layers: a list of NNX modules with the same params (e.g. ``model.layers``),
      or, with `path`, the model that holds the list.
    path: the list's attribute path in the model: ``"layers"`` for
      ``model.layers``, ``"decoder.layers"``, ``"blocks[0]"``.
    wrt: the NNX filter of the params (default: every `nnx.Param`).

  Returns:
    One layer's `nnx.State`, each leaf with the layer count as its first axis.

  Raises:
    StoreMismatchError: a layer's params differ from the first's in their
      paths, shapes or dtypes.
    InvalidOptionError: `path` names no list of layers of the model; or the
      layers were given to `offload_params` (their params are in host memory
      or a `LayerStore`): stack them before, or `onload_params` first.

  Example:
    >>> import offlax
    >>> from flax import nnx
    >>> layers = [nnx.Linear(2, 3, rngs=nnx.Rngs(0)) for _ in range(4)]
    >>> offlax.stack_layers(layers)["kernel"].shape
    (4, 2, 3)
  """
  if path is not None:
    layers = _list_at(layers, layer_guards.check_path(path, "stack_layers: path"))
  elif isinstance(layers, nnx.Module) and not _is_layer_list(layers):
    raise errors.InvalidOptionError(
      f"stack_layers: got a {type(layers).__name__}, not a list of layers: pass the list, "
      "stack_layers(model.layers), or the model and the list's path, "
      "stack_layers(model, 'layers'), which the store then records."
    )
  _check_not_offloaded(layers, wrt)
  stacked = _stack([nnx.state(layer, wrt) for layer in layers])
  return stacked if path is None else layer_guards.tag(stacked, path)


def _list_at(model: Any, path: str) -> Any:
  """The list of layers at `path` in `model`, or `InvalidOptionError` naming the model's lists."""
  found = dict(_layer_lists(model)).get(paths.parse(path))
  if found is None:
    names = ", ".join(repr(paths.dotted(p)) for p, _ in _layer_lists(model)) or "none"
    raise errors.InvalidOptionError(
      f"stack_layers: model.{path} is not a list of layers of the {type(model).__name__}; "
      f"its lists of layers: {names}."
    )
  return found


def _check_not_offloaded(layers: Any, wrt: Any) -> None:
  """Refuses layers given to `offload_params`: their params are not in them to stack."""
  for i, layer in enumerate(layers):
    if jax.tree.leaves(nnx.state(layer, StoredParam)):
      raise errors.InvalidOptionError(
        f"stack_layers: layer {i} was given to offload_params(model, store=): its params are "
        "in the LayerStore, the layer holds placeholders. store.read_params() gives "
        "them stacked; or call offlax.onload_params(model) first, which reads them back."
      )
    if memory.any_on_host(nnx.state(layer, wrt)):
      raise errors.InvalidOptionError(
        f"stack_layers: layer {i}'s params are in host memory (offload_params moved them): "
        "stack the layers before offload_params, e.g. LayerStore.create(path, "
        "offlax.stack_layers(model, 'layers'), ...), then offload_params(model, store=store); "
        "or call offlax.onload_params(model) first."
      )


def _stack(states: list[Any]) -> Any:
  """The layers' states stacked, refused where a layer's leaves differ from the first's."""
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
  from offlax._src.layer_store.store import LayerStore

  if isinstance(store, LayerStore):
    return store.source()
  if isinstance(store, LayerSource):
    return store
  raise errors.InvalidOptionError(
    f"offload_params: store= takes an offlax.LayerStore (or its source(accumulate=True)), "
    f"got {type(store).__name__}."
  )


def _is_layer_list(node: Any) -> bool:
  return (
    isinstance(node, (list, tuple, nnx.List))
    and len(node) > 0 and all(isinstance(m, nnx.Module) for m in node)
  )  # fmt: skip


def _layer_lists(model: Any) -> list[tuple[tuple[Any, ...], Any]]:
  """The lists of layers in `model` and their paths, in graph order."""
  return [(path, node) for path, node in nnx.graph.iter_graph(model) if _is_layer_list(node)]


def find_layers(model: Any, source: LayerSource, is_stored: Any, layers: str | None = None):
  """The path of the store's list in `model`: `layers`, the store's own, or the one that matches.

  A store records the list it was made from (`stack_layers(model, path)`);
  one that does not (a bare list, an older offlax) goes to the one list whose
  layers match it, leaf for leaf, and is refused where several do.
  """
  lists, store = _layer_lists(model), source.store
  named, origin = layers, "layers="
  if layers is None:
    named, origin = store.layers_path, f"the store ({store.path}/layers.json)"
  if named is not None:
    path = paths.parse(layer_guards.check_path(named, "offload_params: layers"))
    found = dict(lists).get(path)
    if found is None:
      names = ", ".join(repr(paths.dotted(p)) for p, _ in lists) or "none"
      raise errors.StoreMismatchError(
        f"offload_params: {origin} names model.{named}, which is not a list of layers of the "
        f"model; its lists of layers: {names}. Pass layers='...' to name the list the store "
        "holds."
      )
    if (problem := _mismatch(path, found, source, is_stored)) is not None:
      raise errors.StoreMismatchError(
        f"offload_params: {origin} names model.{named}, whose layers do not match the store "
        f"at {store.path}: {problem}."
      )
    return path
  results = [(path, _mismatch(path, node, source, is_stored)) for path, node in lists]
  matches = [path for path, problem in results if problem is None]
  if len(matches) > 1:
    raise errors.InvalidOptionError(
      f"offload_params: the store at {store.path} matches {len(matches)} lists of layers of "
      f"the model, {', '.join(paths.name(p) for p in matches)}, and does not record which it "
      f"was made from. Pick one with layers= ({' or '.join(repr(paths.dotted(p)) for p in matches)}"
      f"), e.g. offload_params(model, store=store, layers={paths.dotted(matches[0])!r}); or make "
      f"the store from offlax.stack_layers(model, {paths.dotted(matches[0])!r}), which records it."
    )
  if matches:
    return matches[0]
  found = "; ".join(p for _, p in results if p) or "the model has no list of layers"
  raise errors.StoreMismatchError(
    f"offload_params: no list of layers in the model matches the store at "
    f"{store.path} ({source.n_layers} layers of {len(store.records)} params each): {found}."
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


def is_placeholder(stored: Any, records: list[dict]) -> bool:
  """Whether a layer's stored state holds its placeholders (it is not inside its own run).

  A placeholder's shape is never its param's (`_placeholder`), so one leaf tells.
  """
  leaves = jax.tree.leaves(stored)
  return any(tuple(x.shape) != tuple(r["shape"]) for x, r in zip(leaves, records, strict=True))


def read(source: LayerSource, i: int, token: Any, treedef: Any) -> Any:
  """Layer `i`'s params from the store, laid out by `treedef` (its placeholders' state's)."""
  [leaf] = jax.tree.leaves(token)
  return jax.tree.unflatten(treedef, jax.tree.leaves(source.read(i, leaf)))


def _name(key: str) -> str:
  """A leaf's key without the ``.value`` of an `nnx.State`'s Variables (a plain dict has none)."""
  return key.removesuffix(".value")


def _placeholder(x: Any) -> Any:
  # One element, not zero: orbax refuses to save an array of zero size, and a trainer's
  # checkpoint (Tunix's: nnx.state(model)) holds the placeholders. Two where the param is
  # itself of shape (1,): a placeholder's shape is never its param's (`is_placeholder`).
  shape = (2,) if tuple(x.shape) == (1,) else (1,)
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return jnp.zeros(shape, x.dtype)


def layers_source(node: Any) -> LayerSource | None:
  """The `LayerSource` that `node`, a stored list of layers (`offload_params(store=)`), reads.

  None for any other node. `nnx_params` gives a stored layer's class the
  source as its `SOURCE` attribute.
  """
  if isinstance(node, (list, tuple, nnx.List)) and node:
    return getattr(type(node[0]), SOURCE, None)
  return None


def stores_of(model: Any) -> list[Any]:
  """The `LayerStore`s that `model`'s stored lists of layers read (`offload_params(store=)`)."""
  found: list[Any] = []
  for _, node in nnx.graph.iter_graph(model):
    source = layers_source(node)
    if source is not None and not any(s is source.store for s in found):
      found.append(source.store)
  return found
