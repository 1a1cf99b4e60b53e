"""Host-tier state in an orbax checkpoint at disk speed: raw array files by direct I/O.

Orbax writes arrays through tensorstore and the page cache. Here each leaf's
shards go to raw files by direct I/O (`nvme.array_files`), several ranges at
once, and come back read straight into the new arrays, which on the CPU
become the restored state without a copy. The checkpoint is a directory of
`<leaf>.<shard>` files, `host_state.json` (each leaf's key path, shape, dtype
and shards) and one `crc32c.<process>.json` per process (each file's checksums).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from offlax._src import adam8, errors
from offlax._src.checkpoint import placed
from offlax._src.nvme import array_files
from offlax._src.nvme.format import write_json

_LAYOUT = "host_state.json"
_FORMAT = 1

Index = tuple[tuple[int, int], ...]  # a shard's (start, stop) per dimension


def _index(index: Any, shape: tuple[int, ...]) -> Index:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _shards(x: jax.Array) -> list[Index]:
  """The distinct shards of `x`, in the same order in every process."""
  if not isinstance(x, jax.Array):  # a NumPy array: one shard
    return [tuple((0, n) for n in np.shape(x))]
  found = {_index(i, x.shape) for i in x.sharding.devices_indices_map(x.shape).values()}
  return sorted(found)


def _leaves(tree: Any, where: str) -> list[tuple[str, Any]]:
  leaves = []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if not isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
      raise errors.LeafTypeError(
        f"{where}: leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}; "
        "only arrays (and, for a restore target, jax.ShapeDtypeStruct) can be saved."
      )
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      raise errors.LeafTypeError(
        f"{where}: leaf {jax.tree_util.keystr(path)} is a PRNG key ({x.dtype}); save "
        "jax.random.key_data(key) instead, or the key with ocp.args.StandardSave."
      )
    leaves.append((jax.tree_util.keystr(path), x))
  return leaves


class _HostStateHandler(ocp.handlers.CheckpointHandler):
  """Saves a pytree of arrays as raw files by direct I/O; restores it into a target's shardings."""

  def save(self, directory: epath.Path, args: HostStateSave) -> None:
    path, here = os.fspath(directory), jax.process_index()
    layout, items = [], []
    for i, (key, x) in enumerate(_leaves(args.state, "HostStateSave")):
      shards = _shards(x)
      layout.append(
        {"path": key, "shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).name, "shards": shards}
      )
      if isinstance(x, np.ndarray):
        mine = [(0, lambda x=x: x)] if here == 0 else []
      else:
        mine = [
          (shards.index(_index(s.index, x.shape)), lambda s=s: np.asarray(s.data))
          for s in x.addressable_shards
          if s.replica_id == 0
        ]
      itemsize = np.dtype(x.dtype).itemsize
      for k, source in mine:
        nbytes = int(np.prod([b - a for a, b in shards[k]], dtype=np.int64)) * itemsize
        items.append((os.path.join(path, f"{i}.{k}"), source, nbytes))
    crcs = array_files.write_files(
      items, progress=args.progress, desc=f"offlax: saving host state to {path}"
    )
    write_json(
      path, f"crc32c.{here}.json", {os.path.basename(p): c for p, c in crcs.items()}, fsync=True
    )
    if here == 0:
      write_json(path, _LAYOUT, {"format": _FORMAT, "leaves": layout}, fsync=True)

  def restore(self, directory: epath.Path, args: HostStateRestore) -> Any:
    path = os.fspath(directory)
    saved, crcs = read_layout(path)
    leaves = _leaves(args.target, "HostStateRestore")
    treedef = jax.tree.structure(args.target)
    _check_target(path, saved, leaves)
    # Per leaf: each addressable device's shard, and the saved shards it is made of.
    plans, wanted = [], {}
    for i, ((_, x), meta) in enumerate(zip(leaves, saved, strict=True)):
      sharding = getattr(x, "sharding", None)
      if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      stored = [tuple(map(tuple, s)) for s in meta["shards"]]
      indices = sharding.addressable_devices_indices_map(x.shape).items()
      devices = {d: _index(idx, x.shape) for d, idx in indices}
      for want in set(devices.values()):
        for k in _overlapping(stored, want):
          wanted[(i, k)] = ([b - a for a, b in stored[k]], meta["dtype"])
      plans.append((x, sharding, stored, devices))
    order = sorted(wanted)
    names = [f"{i}.{k}" for i, k in order]
    missing = [n for n in names if n not in crcs]
    if missing:
      raise errors.StoreCorruptedError(
        f"{path} lacks the checksums of {missing[:3]}: saved by a process whose files are not "
        "here (a checkpoint of several processes restores on a filesystem they all wrote to)."
      )
    reads = [
      (os.path.join(path, n), tuple(wanted[o][0]), np.dtype(wanted[o][1]), crcs[n])
      for n, o in zip(names, order, strict=True)
    ]
    # Leaf by leaf as its files come in: where making the array copies (a
    # GPU's pinned host memory), the read arrays are dropped leaf by leaf.
    got: dict[tuple[int, int], np.ndarray] = {}
    files_of = collections.Counter(i for i, _ in order)
    need = [files_of[i] for i in range(len(leaves))]
    out: list[Any] = [None] * len(leaves)
    for j, array in array_files.read_files(
      reads, progress=args.progress, desc=f"offlax: restoring host state from {path}"
    ):
      i = order[j][0]
      got[order[j]] = array
      need[i] -= 1
      if not need[i]:
        out[i] = _assemble(*plans[i], {k: got.pop((n, k)) for n, k in list(got) if n == i})
    for i, leaf in enumerate(out):
      if leaf is None:  # a leaf with no addressable shard here
        out[i] = _assemble(*plans[i], {})
    return placed(jax.tree.unflatten(treedef, out))


def is_host_state(path: str) -> bool:
  """Whether `path` is an item saved by `HostStateSave`."""
  return os.path.exists(os.path.join(path, _LAYOUT))


def read_layout(path: str) -> tuple[list[dict], dict[str, list[int]]]:
  """A `HostStateSave` item's leaves (key path, shape, dtype, shards) and its files' checksums.

  A leaf's shard k is the file ``f"{leaf index}.{k}"``.
  """
  try:
    with open(os.path.join(path, _LAYOUT)) as f:
      saved = json.load(f)["leaves"]
    crcs: dict[str, list[int]] = {}
    for name in os.listdir(path):
      if name.startswith("crc32c.") and name.endswith(".json"):
        with open(os.path.join(path, name)) as f:
          crcs.update(json.load(f))
  except (OSError, ValueError, KeyError) as e:
    raise errors.StoreCorruptedError(f"{path} holds no readable offlax host state: {e}") from e
  return saved, crcs


def _overlapping(stored: list[Index], want: Index) -> list[int]:
  if want in stored:
    return [stored.index(want)]
  return [
    k
    for k, s in enumerate(stored)
    if all(a < d and c < b for (a, b), (c, d) in zip(s, want, strict=True))
  ]


def _assemble(x: Any, sharding: Any, stored: list[Index], devices: dict, arrays: dict) -> jax.Array:
  """The leaf in `sharding`, each device's shard taken whole from a file where one matches."""
  shards = {}
  for want in set(devices.values()):
    if want in stored:
      shards[want] = arrays[stored.index(want)]
      continue
    block = np.empty([b - a for a, b in want], x.dtype)  # a reshard: copied from the saved ones
    for k in _overlapping(stored, want):
      s = stored[k]
      lo = [max(a, c) for (a, _), (c, _) in zip(s, want, strict=True)]
      hi = [min(b, d) for (_, b), (_, d) in zip(s, want, strict=True)]
      into = tuple(slice(p - c, q - c) for p, q, (c, _) in zip(lo, hi, want, strict=True))
      from_ = tuple(slice(p - a, q - a) for p, q, (a, _) in zip(lo, hi, s, strict=True))
      block[into] = arrays[k][from_]
    shards[want] = block
  kind, used, singles = sharding.memory_kind, set(), []
  for d, idx in devices.items():
    # On the CPU `device_put` of an aligned array aliases it: a replica on a
    # second device gets its own copy, or a step donating one would write both.
    value = shards[idx] if idx not in used else shards[idx].copy()
    used.add(idx)
    singles.append(jax.device_put(value, jax.sharding.SingleDeviceSharding(d, memory_kind=kind)))
  return jax.make_array_from_single_device_arrays(x.shape, sharding, singles)


def _check_target(path: str, saved: list[dict], leaves: list[tuple[str, Any]]) -> None:
  hint = adam8.bits_hint([m["path"] for m in saved], [key for key, _ in leaves])
  for n, (meta, (key, x)) in enumerate(zip(saved, leaves, strict=False)):
    want = (meta["path"], tuple(meta["shape"]), meta["dtype"])
    have = (key, tuple(x.shape), np.dtype(x.dtype).name)
    if want != have:
      raise errors.TreeMismatchError(
        f"HostStateRestore: leaf {n} of the target is {have[0]} {have[2]}{list(have[1])}, "
        f"but {path} holds {want[0]} {want[2]}{list(want[1])} there: restore into the "
        "state this checkpoint was saved from (offlax.abstract_state of the same optimizer "
        "and params)." + hint
      )
  if len(saved) != len(leaves):
    raise errors.TreeMismatchError(
      f"HostStateRestore: the target has {len(leaves)} leaves, {path} holds {len(saved)}." + hint
    )


@ocp.args.register_with_handler(_HostStateHandler, for_save=True)
@dataclasses.dataclass
class HostStateSave(ocp.args.CheckpointArgs):
  """Orbax save argument: host-tier state (any pytree of arrays) as raw files, by direct I/O.

  Faster than ``ocp.args.StandardSave`` where the page cache is the
  bottleneck: each shard goes to its own file by direct I/O, several at once,
  with a crc32c per 64 MiB. The save runs before `save` returns (the state's
  buffers may be donated to the next step), flushed. Restore it with
  `HostStateRestore`; orbax's own handlers cannot read it.

  Attributes:
    state: the state, e.g. ``offload(...).init(params)``'s or a train step's.
    progress: show a progress bar in bytes.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp, offlax
    >>> params = {"w": jnp.ones((4, 3))}
    >>> state = offlax.offload(optax.adam(1e-3)).init(params)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mngr:
    ...   item = offlax.checkpoint.HostStateSave(state, progress=False)
    ...   _ = mngr.save(0, args=ocp.args.Composite(opt=item))
    ...   target = offlax.abstract_state(optax.adam(1e-3), params)
    ...   item = offlax.checkpoint.HostStateRestore(target, progress=False)
    ...   restored = mngr.restore(0, args=ocp.args.Composite(opt=item)).opt
    >>> restored.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
  """

  state: Any
  progress: bool = True


@ocp.args.register_with_handler(_HostStateHandler, for_restore=True)
@dataclasses.dataclass
class HostStateRestore(ocp.args.CheckpointArgs):
  """Orbax restore argument: a `HostStateSave` checkpoint, into `target`'s shardings.

  Each leaf is read by direct I/O straight into its new array, built where
  `target`'s sharding says (``offlax.abstract_state(...)`` names
  ``pinned_host`` for the offloaded leaves); a target sharded differently
  from the saved state is assembled from the saved shards. Every range's
  crc32c is checked.

  Attributes:
    target: the state to restore as, e.g. ``offlax.abstract_state(inner, params, tier)``
      (`jax.ShapeDtypeStruct`s with shardings) or a live state of the same shapes.
    progress: show a progress bar in bytes.
  """

  target: Any
  progress: bool = True

  def __post_init__(self):
    if self.target is None:
      raise errors.InvalidTargetError(
        "HostStateRestore needs a target: offlax.abstract_state(inner, params, tier)."
      )
