"""What a `LayerStore` commits beside its layers: the rest of the model (``update(rest=...)``).

The model's other params (embedding, head, final norm) and their optimizer
state are a pytree of arrays the layers' step does not touch. ``update``
writes them into the generation it is about to commit, one file
(``gen{g}/rest.bin``) with a record per leaf (key path, shape, dtype, offset,
crc32c) in the manifest; the manifest's atomic rename then commits layers and
rest together. After a kill, the store resumes with both from one step.
"""

from __future__ import annotations

import os
from typing import Any

import crc32c
import jax
import numpy as np

from offlax._src import errors
from offlax._src.layer_store import files as layer_files

FILE = "rest.bin"


def check_leaves(tree: Any) -> None:
  """Raises `LeafTypeError` unless every leaf of `tree` is an array (before a step is used)."""
  for key, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not hasattr(leaf, "dtype"):
      raise errors.LeafTypeError(
        f"LayerStore.update: rest leaf {jax.tree_util.keystr(key)} must be an array, got "
        f"{type(leaf).__name__}; nothing was committed."
      )


def write(path: str, gen: int, tree: Any, *, fsync: bool) -> list[dict[str, Any]]:
  """Writes `tree`'s leaves into generation `gen`'s rest file; returns their records.

  `gen` is a free generation, or the committed one where its step has no rest (written
  late, `backward`): the manifest names no rest file there either way.
  """
  check_leaves(tree)
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  records, offset = [], 0
  name = os.path.join(path, f"gen{gen}", FILE)
  with layer_files.open_private(name, "wb") as f:
    for key, leaf in flat:
      data = np.asarray(jax.device_get(leaf))
      raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # (1-d: of a 0-d leaf too)
      f.write(raw.data)
      records.append({
        "path": jax.tree_util.keystr(key), "shape": list(data.shape), "dtype": data.dtype.name,
        "offset": offset, "crc": crc32c.crc32c(raw.data),
      })  # fmt: skip
      offset += raw.size
    f.flush()
    if fsync:
      os.fdatasync(f.fileno())
  return records


def read(path: str, gen: int, step: int, records: list[dict[str, Any]] | None, like: Any) -> Any:
  """The rest committed with `step` (generation `gen`), as numpy arrays laid out as `like`."""
  if records is None:
    raise errors.StoreMismatchError(
      f"LayerStore.read_rest: step {step} of {path} was committed without rest= "
      "(store.update(rest=...) commits the rest of the model with the layers)."
    )
  flat, treedef = jax.tree_util.tree_flatten_with_path(like)
  keys = [jax.tree_util.keystr(k) for k, _ in flat]
  stored = [r["path"] for r in records]
  if keys != stored:
    extra, missing = [k for k in keys if k not in stored], [k for k in stored if k not in keys]
    why = [f"`like` lacks {', '.join(missing)}"] if missing else []
    why += [f"the rest lacks {', '.join(extra)}"] if extra else []
    raise errors.StoreMismatchError(
      f"LayerStore.read_rest: step {step}'s rest and `like` differ: "
      + ("; ".join(why) or "the same leaves in another order")
      + "."
    )
  name = os.path.join(path, f"gen{gen}", FILE)
  out = []
  with open(name, "rb") as f:
    for want, r in zip((x for _, x in flat), records, strict=True):
      dtype, shape = np.dtype(r["dtype"]), tuple(r["shape"])
      if (tuple(want.shape), np.dtype(want.dtype)) != (shape, dtype):
        raise errors.StoreMismatchError(
          f"LayerStore.read_rest: leaf {r['path']} is {dtype.name}{list(shape)} in step "
          f"{step}, `like` has {np.dtype(want.dtype).name}{list(want.shape)}."
        )
      leaf = _read_leaf(f, r)
      if leaf is None:
        raise errors.StoreCorruptedError(
          f"LayerStore.read_rest: {name}: leaf {r['path']} of step {step} does not match its "
          "checksum (the file was changed or cut short)."
        )
      out.append(leaf)
  return jax.tree_util.tree_unflatten(treedef, out)


def check(path: str, gen: int, records: list[dict[str, Any]]) -> str | None:
  """The first problem of generation `gen`'s rest file (each leaf's crc32c), or None."""
  name = os.path.join(path, f"gen{gen}", FILE)
  try:
    with open(name, "rb") as f:
      for r in records:
        if _read_leaf(f, r) is None:
          return f"{name}: rest leaf {r['path']} does not match its checksum"
  except OSError as e:
    return f"{name}: {e}"
  return None


def _read_leaf(f: Any, r: dict[str, Any]) -> np.ndarray | None:
  """Leaf `r` read from rest file `f`, or None where it is cut short or fails its crc32c."""
  leaf = np.empty(tuple(r["shape"]), np.dtype(r["dtype"]))
  raw = leaf.reshape(-1).view(np.uint8)
  f.seek(r["offset"])
  if f.readinto(raw.data) != raw.size or crc32c.crc32c(raw.data) != r["crc"]:
    return None
  return leaf
