"""A layer store's files (`store.LayerStore`): records, manifest, creation, the lock.

The layout and the commit protocol are described in `store`. Records
are JSON-able dicts, one per leaf: its key path, one layer's shape and dtype,
and its slot (one layer's bytes padded to the direct-I/O block).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from offlax._src import errors
from offlax._src.nvme import format as format_lib
from offlax._src.nvme.direct_io import BLOCK, aligned_empty

MANIFEST = format_lib.LAYERS
FORMAT = "offlax-layer-store"
VERSION = 2
KINDS = ("params", "state", "grads")


def padded(n: int) -> int:
  return -(-n // BLOCK) * BLOCK


def record(key: str, shape: Sequence[int], dtype: Any) -> dict[str, Any]:
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  return {"path": key, "shape": list(shape), "dtype": dtype.name, "slot": padded(nbytes)}


def grad_records(records: list[dict[str, Any]], dtype: Any) -> list[dict[str, Any]]:
  """The gradient slots' records: the params' `records` (their order, their ``index``), the
  floating ones in `dtype` where given (a store's ``accumulator_dtype``), else their own."""
  if dtype is None:
    return records
  return [dict(r, **record(r["path"], r["shape"], dtype)) if _floating(r["dtype"]) else r
          for r in records]  # fmt: skip


def accumulator_dtype(dtype: Any, records: list[dict[str, Any]]) -> str | None:
  """`LayerStore.create`'s ``accumulator_dtype`` as the manifest records it (its name), or
  None (the layers'); `InvalidOptionError` unless a float that holds every floating leaf."""
  if dtype is None:
    return None
  try:
    name = np.dtype(dtype).name
  except TypeError:
    name = None
  if name is None or not _floating_name(name):
    raise errors.InvalidOptionError(
      f"LayerStore.create: accumulator_dtype={name or repr(dtype)}; pass a floating dtype "
      "(jnp.float32: bf16 layers' gradients summed in float32, as optax.MultiSteps' "
      "default), or None (the layers' own)."
    )
  for r in records:
    if _floating(r["dtype"]) and not np.can_cast(np.dtype(r["dtype"]), np.dtype(name), "safe"):
      raise errors.InvalidOptionError(
        f"LayerStore.create: accumulator_dtype={name} cannot hold leaf {r['path']}'s "
        f"{r['dtype']} gradients exactly; pass a dtype at least as wide (jnp.float32), or None."
      )
  return name


def _floating(dtype: Any) -> bool:
  return bool(jax.dtypes.issubdtype(np.dtype(dtype), np.floating))


def _floating_name(name: str) -> bool:
  try:
    return _floating(name)
  except TypeError:  # not a dtype's name
    return False


def layer_records(layers: Any) -> tuple[list[dict[str, Any]], int, Any]:
  """Per leaf: key path, one layer's shape and dtype; the layer count; the treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(layers)
  if not flat:
    raise errors.InvalidOptionError("LayerStore: the layer pytree has no leaves.")
  records, n = [], None
  for path, leaf in flat:
    key = jax.tree_util.keystr(path)
    shape = tuple(getattr(leaf, "shape", ()))
    if not hasattr(leaf, "dtype") or not shape:
      raise errors.LeafTypeError(
        f"LayerStore: leaf {key} must be an array with a leading layer axis, got "
        f"{type(leaf).__name__} of shape {shape}."
      )
    if n is None:
      n = shape[0]
    elif shape[0] != n:
      raise errors.TreeMismatchError(
        f"LayerStore: leaf {key} stacks {shape[0]} layers, expected {n} (as the first leaf)."
      )
    records.append(record(key, shape[1:], leaf.dtype))
  assert n is not None
  return records, n, treedef


def layer_leaves(
  records: list[dict[str, Any]], treedef: Any, tree: Any, i: int
) -> list[np.ndarray]:
  """`init_layer(i)`'s result as the store's leaves, checked against its records."""
  flat, got = jax.tree_util.tree_flatten(tree)
  if got != treedef:
    raise errors.TreeMismatchError(
      f"LayerStore.create: init_layer({i}) returned a tree of structure {got}, expected {treedef}."
    )
  out = []
  for r, x in zip(records, flat, strict=True):
    x = np.asarray(jax.device_get(x))
    if x.shape != tuple(r["shape"]) or x.dtype != np.dtype(r["dtype"]):
      raise errors.StoreMismatchError(
        f"LayerStore.create: init_layer({i}) leaf {r['path']} is {x.dtype.name}"
        f"{list(x.shape)}, expected {r['dtype']}{r['shape']}."
      )
    out.append(x)
  return out


def state_records(one_layer_state: Any) -> list[dict[str, Any]]:
  records = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(one_layer_state)[0]:
    key = jax.tree_util.keystr(path)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      raise errors.LeafTypeError(
        f"LayerStore: optimizer state leaf {key} is a PRNG key; the store holds numeric state only."
      )
    records.append(record(key, leaf.shape, leaf.dtype))
  return records


def check_records(path: str, what: str, stored: list[dict], want: list[dict]) -> list[dict]:
  """`want`'s records with the store's slots, or StoreMismatchError naming the leaf."""
  got = {r.get("path"): r for r in stored}
  for r in want:
    s = got.get(r["path"])
    if s is None:
      raise errors.StoreMismatchError(
        f"LayerStore.open: {path} has no {what} leaf {r['path']}; it holds "
        f"{', '.join(sorted(str(k) for k in got)) or 'none'}."
      )
    if (list(s.get("shape", [])), s.get("dtype")) != (r["shape"], r["dtype"]):
      raise errors.StoreMismatchError(
        f"LayerStore.open: {what} leaf {r['path']} of {path} is {s.get('dtype')}{s.get('shape')} "
        f"per layer, expected {r['dtype']}{r['shape']}."
      )
  extra = sorted(str(k) for k in got if k not in {r["path"] for r in want})
  if extra:
    raise errors.StoreMismatchError(
      f"LayerStore.open: {path} holds {what} leaves the tree does not have: {', '.join(extra)}."
    )
  return [dict(r, index=stored.index(got[r["path"]])) for r in want]


def no_crcs(manifest: dict) -> dict[str, list[int | None]]:
  """A generation's slot checksums, none known yet (layer i of leaf k at ``i * leaves + k``)."""
  n = manifest["n_layers"]
  kinds = [("params", manifest["leaves"]), ("state", manifest["state"] or [])]
  return {kind: [None] * (n * len(records)) for kind, records in kinds}


def lock_store(path: str) -> int:
  """Takes the store's writer lock (``.lock``, as the NVMe tier's): one process writes it."""
  fd = os.open(os.path.join(path, format_lib.LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise errors.StoreLockedError(
      f"LayerStore: {path} is already open for writing, in this process or another; close it "
      "first (store.close(), or leave its with-block)."
    ) from None
  return fd


def check_sizes(
  where: str, kind: str, names: list[str], sizes: list[int], records: list[dict], n_layers: int
) -> None:
  """Raises `StoreCorruptedError` naming the first file of `kind` not at its size."""
  for name, size, r in zip(names, sizes, records, strict=True):
    if size != n_layers * r["slot"]:
      raise errors.StoreCorruptedError(
        f"{where}: {name} ({kind} leaf {r['path']}) holds {size} bytes, expected "
        f"{n_layers * r['slot']} ({n_layers} layers of {r['slot']})."
      )


def to_kept_step(
  path: str, committed: int, kept: list[tuple[int, int]], step: int
) -> list[tuple[int, int]]:
  """The kept steps once kept `step` is current again (`LayerStore.open(step=)`), newest first."""
  if step not in dict(kept):
    raise errors.StoreMismatchError(
      f"LayerStore.open: {path} has committed step {committed} and keeps steps "
      f"{sorted(dict(kept))}, but step={step} was asked for: training on would mix layers and "
      "the rest of the model at different steps. Resume the rest from one of the kept steps."
    )
  logging.getLogger("offlax").warning(
    "%s: rolled back to step %d (the store had committed step %d).", path, step, committed
  )
  return [(s, g) for s, g in kept if s <= step]


def rollback(path: str, step: int) -> int:
  """`offlax.checkpoint.rollback` of a LayerStore: kept `step` made current (manifest renamed).

  Takes the store's lock (a store open for training is refused) and checks that
  the files of `step` are there at their sizes; `inspect_store(verify=True)`
  checks their checksums, every read of them after does too.
  """
  manifest = read_manifest(path)
  fd = lock_store(path)
  try:
    manifest = read_manifest(path)  # as of holding the lock
    kept = [(s, g) for s, g in manifest["kept"]]
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step not in dict(kept):
      raise errors.StepNotKeptError(
        f"rollback: {path} does not keep step {step!r}; it keeps steps {sorted(dict(kept))} "
        "(LayerStore.create(keep=...) sets how many)."
      )
    gen, n = dict(kept)[step], manifest["n_layers"]
    for kind, records in (("params", manifest["leaves"]), ("state", manifest["state"] or [])):
      names = [os.path.join(path, f"gen{gen}", kind, f"{k}.bin") for k in range(len(records))]
      sizes = [os.path.getsize(name) if os.path.isfile(name) else -1 for name in names]
      check_sizes(f"rollback: step {step} is damaged (the store is unchanged)", kind, names,
                  sizes, records, n)  # fmt: skip
    kept = to_kept_step(path, manifest["step"], kept, int(step))
    manifest.update(step=int(step), generation=gen, kept=kept)
    write_manifest(path, manifest)
  finally:
    os.close(fd)
  return int(step)


def pool_size(layer_bytes: int, pool_layers: int | None, pool_bytes: int | None) -> int:
  if pool_bytes is not None:
    if pool_bytes < layer_bytes:
      raise errors.InvalidOptionError(
        f"LayerStore: pool_bytes={pool_bytes} cannot hold one layer; the minimum is "
        f"{layer_bytes} bytes (one layer, its leaves padded to {BLOCK} bytes)."
      )
    return int(pool_bytes // layer_bytes)
  if not isinstance(pool_layers, int) or pool_layers < 1:
    raise errors.InvalidOptionError(
      f"LayerStore: pool_layers={pool_layers!r} cannot hold one layer; the minimum is 1 "
      f"(one layer, {layer_bytes} bytes; 2 reads one layer ahead)."
    )
  return pool_layers


def to_slot(x: Any, slot: int, dtype: Any = None) -> np.ndarray:
  """`x`'s bytes in a new aligned buffer of `slot` bytes, zero-padded; cast to `dtype` where
  given (a store's ``accumulator_dtype``) as it is copied, in the same pass."""
  x = np.asarray(x)
  dtype = x.dtype if dtype is None else np.dtype(dtype)
  buffer = aligned_empty(slot)
  n = x.size * dtype.itemsize
  buffer[:n].view(dtype)[...] = x.reshape(-1)
  buffer[n:] = 0
  return buffer


def store_files(path: str, manifest: dict) -> list[tuple[str, int]]:
  """Every file of a store and its size."""
  n, files = manifest["n_layers"], []
  kinds = [("params", manifest["leaves"]), ("state", manifest["state"] or [])]
  for g in range(manifest["generations"]):
    for kind, records in kinds:
      files += [(os.path.join(path, f"gen{g}", kind, f"{k}.bin"), n * r["slot"])
                for k, r in enumerate(records)]  # fmt: skip
  grads = grad_records(manifest["leaves"], manifest.get("accumulator_dtype"))
  files += [(os.path.join(path, "grads", f"{k}.bin"), n * r["slot"])
            for k, r in enumerate(grads)]  # fmt: skip
  return files


def make_files(path: str, manifest: dict, *, reserve: bool) -> None:
  """Creates the store's files at their sizes; with `reserve`, allocates their space."""
  files = store_files(path, manifest)
  if reserve:
    os.makedirs(path, mode=0o700, exist_ok=True)
    need, free = sum(size for _, size in files), free_bytes(path)
    if free is not None and need > free:
      raise errors.StoreError(
        errno.ENOSPC,
        f"LayerStore.create: {path} needs {need / 2**30:.2f} GiB ({manifest['generations']} "
        f"generations of params and state, and the gradients) and its disk has "
        f"{free / 2**30:.2f} GiB free. Free space, lower keep=, or choose another disk.",
      )
  os.makedirs(path, mode=0o700, exist_ok=True)  # owner-only, as the NVMe tier's
  for name, size in files:
    folder = os.path.dirname(name)
    for d in (os.path.dirname(folder), folder):  # gen<g> and gen<g>/<kind>, each its mode
      os.makedirs(d, mode=0o700, exist_ok=True)
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
      os.ftruncate(fd, size)  # sparse: zero until written
      if reserve and size:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
      raise errors.StoreError(e.errno, f"LayerStore.create: cannot make {name}: {e}") from e
    finally:
      os.close(fd)


def remove_files(path: str, manifest: dict, made: bool) -> None:
  """Removes what `create` made (a failed create leaves the folder as it found it)."""
  for name, _ in store_files(path, manifest):
    if os.path.exists(name):
      os.remove(name)
  for g in range(manifest["generations"]):
    for kind in ("params", "state"):
      rmdir(os.path.join(path, f"gen{g}", kind))
    rmdir(os.path.join(path, f"gen{g}"))
  rmdir(os.path.join(path, "grads"))
  for name in (MANIFEST, MANIFEST + ".tmp", format_lib.LOCK):
    if os.path.exists(os.path.join(path, name)):
      os.remove(os.path.join(path, name))
  if made:
    rmdir(path)


def rmdir(path: str) -> None:
  try:
    os.rmdir(path)
  except OSError:
    pass


def free_bytes(path: str) -> int | None:
  try:
    s = os.statvfs(path)
  except OSError:
    return None
  return s.f_bavail * s.f_frsize


def open_private(name: str, mode: str = "w") -> Any:
  """`open(name, mode)` for writing, owner-only (0600) and never through a link."""
  fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
  os.fchmod(fd, 0o600)  # a file left by an older offlax (0644) too
  return os.fdopen(fd, mode)


def read_manifest(path: str) -> dict:
  """A layer store's manifest, checked for its format; raises `StoreError` and kin."""
  manifest_path = os.path.join(path, MANIFEST)
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except FileNotFoundError:
    if os.path.exists(os.path.join(path, format_lib.METADATA)):
      raise errors.StoreMismatchError(
        f"LayerStore.open: {path} holds an NVMeTier store (optimizer state, made without "
        "params), not a LayerStore: params on disk need their own store. Create one with "
        "offlax.LayerStore.create(new_path, layers, optimizer=...)."
      ) from None
    raise errors.StoreError(
      f"LayerStore.open: no layer store at {path} ({MANIFEST} is missing)."
    ) from None
  except (OSError, ValueError) as e:
    raise errors.StoreCorruptedError(f"LayerStore.open: cannot read {manifest_path}: {e}") from e
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    raise errors.StoreCorruptedError(f"LayerStore.open: {manifest_path} is not a layer store's.")
  if manifest.get("version") != VERSION:
    raise errors.StoreCorruptedError(
      f"LayerStore.open: {manifest_path} is format version {manifest.get('version')}; this "
      f"offlax reads version {VERSION}."
    )
  keys = ("n_layers", "leaves", "state", "generations", "step", "generation", "kept", "crc")
  missing = [k for k in keys if k not in manifest]
  if missing:
    raise errors.StoreCorruptedError(f"LayerStore.open: {manifest_path} lacks {missing}.")
  acc = manifest.get("accumulator_dtype")
  if acc is not None and not (isinstance(acc, str) and _floating_name(acc)):
    raise errors.StoreCorruptedError(
      f"LayerStore.open: {manifest_path} names accumulator_dtype {acc!r}, not a float dtype."
    )
  return manifest


def write_manifest(path: str, manifest: dict, *, fsync: bool = True) -> None:
  """Writes `manifest` (0600) and renames it over the store's: the commit."""
  tmp = os.path.join(path, MANIFEST + ".tmp")
  with open_private(tmp) as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    if fsync:
      os.fsync(f.fileno())
  os.replace(tmp, os.path.join(path, MANIFEST))
  if fsync:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)  # the rename itself
    finally:
      os.close(fd)
