"""`load_safetensors`: an NNX model's params from a Hugging Face checkpoint folder.

Everything is checked first (`plan.match`, `plan.check_config`, the files'
headers): a refused checkpoint leaves the model and its store as they were.
Then a param at a time (a stored layer's leaves together): each tensor read
into one host buffer, put in the param's layout and dtype, and placed where the
param lives: ``jax.device_put`` to its sharding (a ``pinned_host`` param goes
from host RAM straight to pinned host memory, never through the device), or
written into a free generation of the store with its optimizer's fresh state
(`LayerStore.rewrite`, on a writer thread), committed as `LayerStore.update`
commits (files flushed, the manifest renamed over the old one): a kill at any
moment leaves the store's step as it was, or loaded, whole and with its
checksums. Reading, converting and writing run on three threads at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from offlax._src.hf import files, plan
from offlax._src.hf import mapping as mapping_lib
from offlax._src.hf import params as params_lib

# The folder each model was loaded from (and its mapping and skips): `save_safetensors`'s
# default source, for the same names, layouts and dtypes.
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AHEAD = 2  # items read and converted ahead of the one placed


class Loaded(dict):
  """What `load_safetensors` read into a model: ``path``, ``mapping``, ``skip``, ``seconds``."""


def load_safetensors(model: Any, path: str, *, mapping: dict[str, Any] | None = None,
                     skip: Iterable[str] = (), store: Any = None, config: Any = None,
                     check_config: bool = True, cast: bool = True,
                     progress: bool = True) -> Any:  # fmt: skip
  """Fills `model`'s params from the Hugging Face checkpoint folder at `path`.

  The folder holds ``*.safetensors`` files (one, or shards named by
  ``model.safetensors.index.json``). Each tensor is read from disk into host
  RAM on its own, mapped to its param (transposed, reshaped, cast to the
  param's dtype, as the mapping says) and put where the param lives: on the
  device, in ``pinned_host`` memory after `offlax.offload_params` (straight
  from RAM, never through the device), or, for a model whose layers are in a
  `LayerStore` (``offload_params(model, store=store)``), into the store, a
  layer at a time, with the store's optimizer state made afresh from the
  loaded params (``optimizer.init``: the fp32 master of `master_weights`, zero
  moments). The store's step keeps its number and gets the loaded layers in
  one atomic commit, as `LayerStore.update` commits: a crash mid-load leaves
  the step as it was (`offlax.checkpoint.inspect_store` verifies it). The model may be
  abstract (`nnx.eval_shape`): loading gives it its values.

  Every tensor, param, shape, dtype, file size and the folder's
  ``config.json`` are checked before anything is written. The params outside
  the store (all of them, without one) are placed as they are read but set
  only at the end, after the store's commit: a failure or Ctrl-C mid-load
  leaves the model as it was. A model that already holds values (not
  `nnx.eval_shape`) so needs room for those params twice during the load, in
  their memory (device or ``pinned_host``); an abstract one needs none.

  Args:
    model: a Flax NNX model; changed in place.
    path: the checkpoint folder.
    mapping: ``{regex over tensor names: (param path, transform)}``, Tunix's
      format (docs/pretrained.md); None: Tunix's own for its Llama3, Qwen3 and
      Gemma3.
    skip: names or regular expressions of tensors not to load (a vision
      tower; `save_safetensors` copies them from the source as they are).
    store: the `offlax.LayerStore` the model's layers read; None: the one
      `offload_params(model, store=)` gave them (a store given must be that one).
    config: the model's config, compared with ``config.json``; None: the
      model's ``config`` attribute (Tunix's models have one).
    check_config: compare ``config.json`` with the config at all.
    cast: convert a tensor to its param's dtype (floating point only); False
      refuses any dtype that differs.
    progress: show a progress bar.

  Returns:
    `model` itself.

  Raises:
    CheckpointNotFoundError: no folder, no safetensors file, or a shard the
      index names is missing.
    CheckpointCorruptedError: a file is cut short or its header is damaged.
    CheckpointMismatchError: a tensor the model lacks (not skipped), a param
      without its tensor, a wrong shape or dtype, or a ``config.json`` that
      disagrees with the model's config.
    InvalidOptionError: no mapping is known for the model, ``store`` is not
      the store its layers read, or the store holds optimizer state and is
      open without its optimizer.

  Example (docs/pretrained.md runs it, with a tiny checkpoint)::

    from tunix.models.qwen3 import model as qwen3

    config = qwen3.ModelConfig.qwen3_14b()
    model = nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0)))
    offlax.offload_params(model)                 # params in pinned_host, still shapes
    offlax.load_safetensors(model, "Qwen3-14B")  # a Hugging Face folder
  """
  where = "load_safetensors"
  start = time.perf_counter()
  folder = files.read_folder(path)
  config = getattr(model, "config", None) if config is None else config
  if check_config:
    plan.check_config(path, config, where)
  if mapping is None:
    mapping = mapping_lib.for_model(model, config)
  store = params_lib.model_store(model, store, where)
  targets = params_lib.of_model(model, store)
  skip = tuple(skip)
  matched = plan.match(folder, mapping, targets, skip, cast, where)
  order = sorted(targets.values(), key=order_key)
  stored = any(isinstance(t, params_lib.Stored) for t in order)
  if stored:
    params_lib.check_store(store, where)
  # The stored layers go into a free generation of the store, on a thread of their own (the
  # step's own generation is left whole until the commit).
  writer = params_lib.LayerWriter(store) if stored else None
  # The params outside the store, placed but set only once all is read and the store committed:
  # a failure or Ctrl-C before leaves the model as it was, not half loaded.
  placed: list[tuple[params_lib.Param, Any]] = []
  buffers = files.Buffers()  # the reads' buffers used again: no new pages to zero
  read = lambda target: [files.read(t, buffers) for _, t in matched.by_path[target.path]]

  def convert(target: Any, raw: list[np.ndarray]) -> np.ndarray:  # a stored leaf: into its slot
    out = writer.empty(target) if isinstance(target, params_lib.Stored) and writer else None
    x = assemble(matched.by_path[target.path], raw, target, out)
    if out is not None:  # a layer's leaf, copied into its slot: the next layer's reads reuse these
      for r in raw:
        buffers.give(r)
    return x

  try:
    for target, x in progress_bar(
      ahead(read, convert, order), progress, f"offlax: loading {path}", len(order)
    ):
      if isinstance(target, params_lib.Param):
        placed.append((target, params_lib.place(target, x)))
      elif writer is not None:  # a stored param: the store is written
        writer.put(target, x)
    if writer is not None:
      writer.commit()
  finally:
    if writer is not None:
      writer.close()
  for target, value in placed:
    target.variable.set_value(value)
  for target in order:
    if isinstance(target, params_lib.Stored):
      params_lib.concrete_placeholder(target)
  _LOADED[model] = Loaded(path=path, mapping=mapping, skip=skip,
                          seconds=time.perf_counter() - start)  # fmt: skip
  return model


def loaded_from(model: Any) -> Loaded | None:
  """What `load_safetensors` last read into `model` (its folder, mapping, skips), or None."""
  return _LOADED.get(model)


def assemble(pairs: list[tuple[mapping_lib.Entry, files.Tensor]], raw: list[np.ndarray],
             target: Any, out: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
  """A param's values from its tensors' (`raw`, as read): each put in its layout, cast, stacked.

  Into `out` where given (C-contiguous, the param's shape and dtype).
  """
  if pairs[0][0].index is None:
    ((entry, _),) = pairs
    if out is not None:
      return mapping_lib.forward(raw[0], entry.steps, out=out)
    return _cast(mapping_lib.forward(raw[0], entry.steps), target.dtype)
  if out is None:
    out = np.empty(target.shape, target.dtype)
  for (entry, _), x in zip(pairs, raw, strict=True):
    mapping_lib.forward(x, entry.steps, out=out[entry.at])
  return out


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  return x if x.dtype == dtype else x.astype(dtype)


def order_key(target: Any) -> tuple[int, int, str]:
  """The params first, then the stored layers, each layer's leaves together."""
  if isinstance(target, params_lib.Stored):
    return (1 + target.layer, target.leaf, target.path)
  return (0, 0, target.path)


def ahead(read: Callable[[Any], Any], convert: Callable[[Any, Any], Any],
          items: list) -> Iterator[tuple[Any, Any]]:  # fmt: skip
  """`(item, convert(item, read(item)))` for each item, two stages ahead on their own threads.

  One thread reads (disk, the GIL released), one converts (transposes and
  casts, numpy's copies releasing the GIL), while the caller places the item
  before: the disk, the conversion and the placing overlap. Items are
  submitted two ahead of the caller's, so the reads run while the item before
  converts: four items' values are held at most.
  """
  with (
    concurrent.futures.ThreadPoolExecutor(1, "offlax-read") as io,
    concurrent.futures.ThreadPoolExecutor(1, "offlax-convert") as cpu,
  ):
    done: collections.deque[concurrent.futures.Future] = collections.deque()

    def submit(j: int) -> None:
      if j < len(items):
        raw = io.submit(read, items[j])
        done.append(cpu.submit(lambda: convert(items[j], raw.result())))

    try:
      for j in range(min(_AHEAD, len(items))):
        submit(j)
      for j, item in enumerate(items):
        value = done.popleft().result()
        submit(j + _AHEAD)
        yield item, value
    finally:
      for future in done:  # a failure or an early exit: nothing more starts
        future.cancel()


def progress_bar(items: Iterable, enabled: bool, desc: str, total: int) -> Any:
  if not enabled:
    return items
  from tqdm.auto import tqdm

  return tqdm(items, desc=desc, total=total, unit="param", leave=False, delay=2.0)
