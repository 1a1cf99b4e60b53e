"""The mistakes a `LayerStore` refuses or warns about, each naming the way out.

- ``create`` in a folder that holds a store: `StoreExistsError`, pointing to ``open``.
- An ``optimizer`` wrapped by `offlax.offload`: the store runs its optimizer itself (on the
  host, a layer at a time, its state on disk), so it takes the transformation unwrapped.
- The list of layers a store was made from (``layers_path``, in ``layers.json``): recorded at
  ``create``, from ``layers_path=`` or from what ``offlax.stack_layers(model, path)`` returned,
  and checked at ``open``; `offload_params(model, store=)` attaches the store there. A manifest
  without it (older offlax, or layers stacked from a bare list) says nothing: unknown.
- A backward pass that overwrites gradients no ``update`` has used (a forgotten
  ``store.update()``): `GradientsOverwrittenWarning`.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import jax

from offlax._src import errors, nnx_paths
from offlax._src.layer_store import files
from offlax._src.layer_store import step as layer_step

# The attribute of `stack_layers(model, path)`'s result naming the list it stacked (set
# with `object.__setattr__`: an `nnx.State` turns a plain attribute into a key, a leaf).
PATH_ATTRIBUTE = "offlax_layers_path"


def tag(tree: Any, path: str) -> Any:
  """`tree` (an `nnx.State`) marked as the stacked layers of the list at `path`."""
  object.__setattr__(tree, PATH_ATTRIBUTE, path)
  return tree


def tagged_path(tree: Any) -> str | None:
  """The list `tree` was stacked from (`tag`), or None: unknown."""
  return vars(tree).get(PATH_ATTRIBUTE) if hasattr(tree, "__dict__") else None


def check_path(text: Any, where: str) -> str:
  """`text` if it is a path into a model (``"layers"``, ``"decoder.blocks"``), else refused."""
  try:
    if not isinstance(text, str):
      raise ValueError(f"a str is needed, got {type(text).__name__}")
    nnx_paths.parse(text)
  except ValueError as e:
    raise errors.InvalidOptionError(
      f"{where}: {text!r} is not the path of a list of layers in a model ({e}); write it as "
      "its attribute names from the model, e.g. 'layers' for model.layers or 'decoder.layers'."
    ) from None
  return text


def layers_path(layers: Any, given: str | None) -> str | None:
  """The path `create` records: `given`, else the tag of `stack_layers(model, path)`'s result."""
  tagged = tagged_path(layers)
  if given is None:
    return tagged
  check_path(given, "LayerStore.create: layers_path")
  if tagged is not None and tagged != given:
    raise errors.InvalidOptionError(
      f"LayerStore.create: layers_path={given!r}, but the layers were stacked from "
      f"model.{tagged} (offlax.stack_layers(model, {tagged!r})); pass one of them."
    )
  return given


def opened_path(path: str, manifest: dict, like: Any) -> str | None:
  """The path `open` keeps: the manifest's, checked against `like`'s tag (else adopted)."""
  recorded, tagged = manifest.get("layers_path"), tagged_path(like)
  if recorded is not None and tagged is not None and recorded != tagged:
    raise errors.StoreMismatchError(
      f"LayerStore.open: {path} holds the layers of model.{recorded}, and `like` was stacked "
      f"from model.{tagged}: open the store of that list, or stack "
      f"offlax.stack_layers(model, {recorded!r})."
    )
  return recorded if recorded is not None else tagged


def check_folder(path: str) -> None:
  """Refuses to create a store in a folder that holds files: a store, or others."""
  if os.path.exists(os.path.join(path, files.MANIFEST)):
    raise errors.StoreExistsError(
      f"LayerStore.create: {path} already holds a layer store ({files.MANIFEST}); create "
      f"writes a new one. Reopen it at its committed step with offlax.LayerStore.open({path!r}, "
      "like, optimizer=...) (like: the stacked layers or their shapes, e.g. "
      "offlax.stack_layers(model, 'layers')), or create the new store in another folder."
    )
  if os.path.isdir(path) and os.listdir(path):
    raise errors.NotAStoreError(f"LayerStore.create: {path} exists and is not empty.")


def optimizer_state(optimizer: Any, layers: Any, path: str, manifest: dict | None = None):
  """The records and treedef of one layer's optimizer state ([] and None without an optimizer).

  With `manifest` (`open`), checked against the store's; the optimizer must be
  elementwise and not wrapped by `offlax.offload`.
  """
  where = "LayerStore.create" if manifest is None else "LayerStore.open"
  if optimizer is None:
    return [], None
  if manifest is not None and manifest.get("state") is None:
    raise errors.StoreMismatchError(
      f"LayerStore.open: {path} was made without optimizer state (params and gradients "
      "only), so update() has nothing to apply: open it without optimizer=, or create a "
      "new store with LayerStore.create(path, layers, optimizer=...)."
    )
  one = one_layer_state(optimizer, layers, where)
  records = files.state_records(one)
  if manifest is not None:
    records = files.check_records(path, "state", manifest["state"], records)
  layer_step.check_elementwise(optimizer, layers)
  return records, jax.tree.structure(one)


def one_layer_state(optimizer: Any, layers: Any, where: str) -> Any:
  """`layer_step.one_layer_state`, refusing an optimizer wrapped by `offlax.offload`."""
  from offlax._src import tier as tier_lib

  one, offloaded = None, False
  try:
    one = layer_step.one_layer_state(optimizer, layers)
  except errors.InvalidTierError:  # an NVMeTier's init refuses eval_shape
    offloaded = True
  else:  # an offload, alone or inside a chain: its state is an OffloadState
    is_state = lambda x: isinstance(x, tier_lib.OffloadState)
    offloaded = any(map(is_state, jax.tree.leaves(one, is_leaf=is_state)))
  if offloaded:
    raise errors.TransformationTypeError(
      f"{where}: optimizer= is (or holds) an offlax.offload(...) transformation. A LayerStore "
      "runs its optimizer itself, on the host CPU a layer at a time, with its state on disk: "
      "pass the optax transformation unwrapped, e.g. optimizer=optax.adamw(1e-3), "
      "offlax.adamw(1e-3) or offlax.master_weights(offlax.adamw(1e-3)). offlax.offload(tx, "
      'compute="host") is for the rest of the model: nnx.Optimizer(model, offlax.offload(tx, '
      'compute="host"), wrt=nnx.Param).'
    )
  return one


class GradientsLedger:
  """Which layers' gradients the backward passes wrote and no `update` has used yet.

  A backward pass writing layer i's gradients over unused ones (without
  ``accumulate``) means a step's gradients were dropped: most often a
  forgotten ``store.update()``, where the store would stay at its step.
  """

  def __init__(self, path: str, watch: bool):
    self.path, self.watch = path, watch  # a store without an optimizer has no update to forget
    self._unused: set[int] = set()
    self._lock = threading.Lock()

  def written(self, i: int, accumulate: bool, step: int) -> None:
    """Notes layer `i`'s gradients written (a callback); warns where unused ones are overwritten."""
    with self._lock:
      overwrites = self.watch and not accumulate and i in self._unused
      if overwrites:
        self._unused = set()  # one warning per overwriting pass, not one per layer
      self._unused.add(i)
    if overwrites:
      warnings.warn(
        errors.GradientsOverwrittenWarning(
          f"LayerStore {self.path}: a backward pass overwrote layer {i}'s gradients before "
          f"update() used them; the store is still at step {step}. Call "
          "store.update() after each step's backward pass (before the next step), or "
          "differentiate with store.source(accumulate=True) to add microbatches' gradients "
          "(store.zero_grads() starts afresh)."
        ),
        stacklevel=2,
      )

  def used(self) -> None:
    """The gradients were used (`update`) or cleared (`zero_grads`)."""
    with self._lock:
      self._unused = set()
