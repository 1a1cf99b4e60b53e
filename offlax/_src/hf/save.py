"""`save_safetensors`: a model's params as a Hugging Face checkpoint folder.

The tensors' names, shapes, dtypes and order are the source checkpoint's (the
folder the model was loaded from, or ``source=``); each param goes back
through the inverse of its mapping's steps (exact: transposes and reshapes)
and is cast to the source's dtype. A param at a time (a stored layer's leaves
read together), into shards laid out up front; tensors the model does not
hold (skipped, ``unused.``) are copied from the source as they are. All of it
goes into a temporary folder beside `path` (``.<name>.XXXXXXXX.tmp``), every
file and the folder fsynced, renamed to `path` at the end, and the parent
folder fsynced: a crash leaves no half checkpoint under `path`. An old `path`
(``overwrite``) is first renamed aside to ``.<name>.XXXXXXXX.old`` and removed
after; a crash between the two renames leaves it there and nothing at `path`,
and the next `save_safetensors` to `path` renames it back first. Temporary
folders a killed save left beside `path` are removed by the next save to it
(one save to a path at a time).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np

from offlax._src import errors
from offlax._src.hf import files, plan
from offlax._src.hf import load as load_lib
from offlax._src.hf import mapping as mapping_lib
from offlax._src.hf import params as params_lib

MAX_SHARD_BYTES = 5 * 2**30


def save_safetensors(model: Any, path: str, *, source: str | None = None,
                     mapping: dict[str, Any] | None = None, skip: Any = None, store: Any = None,
                     max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False,
                     progress: bool = True) -> str:  # fmt: skip
  """Writes `model`'s params to `path` as a Hugging Face checkpoint, laid out as its source.

  The params may be on the device, in ``pinned_host``, or (``store=``) in a
  `LayerStore`'s committed step. The checkpoint has the source's tensor
  names, shapes and dtypes, sharded into files of at most `max_shard_bytes`
  (one tensor larger than that gets a file of its own) with
  ``model.safetensors.index.json`` (one file: ``model.safetensors``), and the
  source's other files (``config.json``, tokenizer files) copied. A loaded
  model saved untrained gives every tensor back byte for byte.

  Args:
    model: a Flax NNX model with values.
    path: the new checkpoint's folder: absent or empty (or `overwrite`).
    source: the checkpoint folder whose layout to write; None: the folder
      the model was last loaded from by `offlax.load_safetensors`.
    mapping: as for `load_safetensors`; None: the load's (else Tunix's
      mapping for its models).
    skip: as for `load_safetensors`; None: the load's (else none).
    store: the `offlax.LayerStore` the model's layers read; None: the one
      `offload_params(model, store=)` gave them (a store given must be that one).
    max_shard_bytes: the largest file, in bytes (Hugging Face's 5 GiB).
    overwrite: replace a `path` that holds files.
    progress: show a progress bar.

  Returns:
    `path`.

  Raises:
    CheckpointExistsError: `path` holds files and not ``overwrite``.
    CheckpointMismatchError: the source does not fit the model (as for a load).
    InvalidOptionError: no source (the model was not loaded, and no
      ``source=``), the model has no values (`nnx.eval_shape`), or
      ``store`` is not the store its layers read.

  Example (docs/pretrained.md runs it)::

    offlax.load_safetensors(model, "Qwen3-14B")
    ...  # train
    offlax.save_safetensors(model, "Qwen3-14B-tuned")  # config.json, tokenizer files copied
  """
  where = "save_safetensors"
  loaded = load_lib.loaded_from(model)
  if source is None:
    if loaded is None:
      raise errors.InvalidOptionError(
        f"{where}: pass source= (the checkpoint folder whose names and layout to write): the "
        "model was not loaded by offlax.load_safetensors."
      )
    source = loaded["path"]
  same = loaded if loaded is not None and loaded["path"] == source else None
  if mapping is None:
    config = getattr(model, "config", None)
    mapping = same["mapping"] if same else mapping_lib.for_model(model, config)
  if skip is None:
    skip = same["skip"] if same else ()
  if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
    raise errors.InvalidOptionError(f"{where}: max_shard_bytes must be an int >= 1.")
  path = os.path.abspath(path)
  _recover(path)
  if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)) and not overwrite:
    raise errors.CheckpointExistsError(
      f"{where}: {path} exists and holds files; pass overwrite=True to replace it, or another path."
    )
  folder = files.read_folder(source)
  store = params_lib.model_store(model, store, where)
  targets = params_lib.of_model(model, store)
  matched = plan.match(folder, mapping, targets, skip, True, where)
  empty = [t.path for t in targets.values() if not params_lib.has_value(t)]
  if empty:
    raise errors.InvalidOptionError(
      f"{where}: the model's params {files.short(empty)} have no values (an nnx.eval_shape "
      "model): load_safetensors gives them theirs."
    )
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
  try:
    _write(tmp, folder, matched, targets, store, max_shard_bytes, progress)
    _replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path


def _write(tmp: str, folder: files.Folder, matched: plan.Match, targets: dict[str, Any],
           store: Any, max_shard_bytes: int, progress: bool) -> None:  # fmt: skip
  layout = [(t.name, t.dtype, t.shape) for t in folder.tensors.values()]
  metadata = next(iter(folder.metadata.values()), {}) or {"format": "pt"}
  writer = files.Writer(tmp, layout, max_shard_bytes, metadata)
  try:
    order = sorted(targets.values(), key=load_lib.order_key)
    layer: list[Any] = [-1, []]

    def value(target: Any) -> Any:
      if isinstance(target, params_lib.Param):
        return params_lib.get(target)
      if target.layer != layer[0]:  # a layer at a time: its leaves read together
        layer[:] = [target.layer, store.read_layer(target.layer)]
      return layer[1][target.leaf]

    def tensors(target: Any, x: Any) -> list[tuple[str, np.ndarray]]:
      out = []
      for entry, t in matched.by_path[target.path]:
        part = x if entry.at is None else x[entry.at]
        if t.nbytes >= files.DIRECT_BYTES:  # into an array the writer writes by direct I/O
          direct = mapping_lib.inverse(part, entry.steps, t.shape, writer.empty(t.name))
          out.append((t.name, direct))
          continue
        part = mapping_lib.inverse(part, entry.steps, t.shape)
        out.append((t.name, mapping_lib.contiguous(part.astype(t.dtype, copy=False))))
      return out

    desc = f"offlax: saving {os.path.basename(tmp)}"
    # The next params read and put in the checkpoint's layout while this one is written.
    pairs = load_lib.ahead(value, tensors, order)
    for _, parts in load_lib.progress_bar(pairs, progress, desc, len(order)):
      for name, part in parts:
        writer.write(name, part)
    for name in matched.others:
      writer.write(name, files.read(folder.tensors[name]))
    writer.finish()
  finally:
    writer.close()
  for name in sorted(os.listdir(folder.path)):  # config.json, tokenizer files, ...
    full = os.path.join(folder.path, name)
    if os.path.isfile(full) and not name.endswith(".safetensors") and name != files.INDEX:
      shutil.copyfile(full, os.path.join(tmp, name))
      _fsync(os.path.join(tmp, name))
  _fsync(tmp)  # its entries: the files' names


def _fsync(name: str) -> None:
  """Flushes file or folder `name` to disk."""
  fd = os.open(name, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _leftovers(path: str, suffix: str) -> list[str]:
  """The folders beside `path` an earlier save made (``.<name>.XXXXXXXX.tmp`` or ``.old``)."""
  parent, base = os.path.split(path)
  pattern = re.compile(rf"\.{re.escape(base)}\.[a-z0-9_]{{8}}\.{suffix}")
  if not os.path.isdir(parent):
    return []
  return sorted(
    os.path.join(parent, n) for n in os.listdir(parent)
    if pattern.fullmatch(n) and os.path.isdir(os.path.join(parent, n))
  )  # fmt: skip


def _recover(path: str) -> None:
  """Cleans up after a killed save to `path`: the old checkpoint put back, temporary folders gone.

  A save killed between its two renames left the old checkpoint in a
  ``.old`` folder and nothing at `path`: it goes back to `path`. Otherwise a
  ``.old`` folder is a replaced checkpoint not yet removed, and a ``.tmp``
  one a save that never finished.
  """
  olds = _leftovers(path, "old")
  if olds and not os.path.exists(path):
    newest = max(olds, key=os.path.getmtime)
    os.rename(newest, path)
    _fsync(os.path.dirname(path))
    olds.remove(newest)
  for name in olds + _leftovers(path, "tmp"):
    shutil.rmtree(name, ignore_errors=True)


def _replace(tmp: str, path: str) -> None:
  """Renames `tmp` to `path`; an old `path` goes aside first and is removed after."""
  old = None
  if os.path.exists(path):
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".old",
                           dir=os.path.dirname(path))  # fmt: skip
    os.rmdir(old)
    os.rename(path, old)
  os.rename(tmp, path)
  _fsync(os.path.dirname(path))  # the renames themselves
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
