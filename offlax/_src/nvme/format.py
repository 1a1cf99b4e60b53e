"""The NVMe store's format: what a store directory holds, and the checks of its metadata.

Layout of a store directory::

  PATH/offlax.json        committed metadata (format, step, generation, kept steps, leaves)
  PATH/.lock              held with flock by the one process writing the store
  PATH/gen0/leaf_00000/   zarr3 arrays, one per state item, generation 0
  PATH/gen1/leaf_00000/   the same, generation 1 (and so on: `keep + 1` generations)

Every state item is stored flat (1-D), uncompressed, with a crc32c checksum per
chunk (the zarr3 `crc32c` codec), so tensorstore (or any zarr3 reader) opens
and verifies it. Tensorstore creates the arrays; the step itself reads and
writes the chunk files directly (`c/<i>`: the chunk's bytes, zero-padded to the
chunk size, then their crc32c, little endian), since each piece of the
streaming schedule is exactly one chunk: that saves tensorstore's buffer
copies and fresh allocations, which cost more CPU than the disk time on small
machines. A step reads generation `g` (the committed one) and writes generation
`g + 1` (modulo the number of generations); once every write of the step has
completed and is flushed, `offlax.json` is replaced atomically (write, fsync,
rename, fsync directory) with `step + 1` and generation `g + 1`. A process
killed at any point leaves `offlax.json` naming a generation that no write of
the unfinished step touched, so reopening yields exactly the last committed
state.

With `keep + 1` generations the store keeps the last `keep` committed steps
(`offlax.json`'s `kept`: the generations no step is writing), and `rollback`
makes one of them current again.

Leaf directories are named by index (`leaf_00000`), never by the pytree key
path, so no key can name a file outside the store; the key paths are recorded
in `offlax.json`.

For params sharded on a mesh, `path` holds one such store per device, each
with only that device's shard of every state array::

  PATH/offlax-mesh.json   the mesh (axis names and sizes), each param's spec, each shard's process
  PATH/shard_00000/       the store of mesh position 0 (`mesh.devices.flat[0]`)
  PATH/shard_00001/       ...

A process creates and opens only the stores of its own devices. The streamed
update runs per device inside `jax.shard_map`, so each device's callbacks read
and write its own store (`DiskIO`'s `shard`); each store commits its step
atomically as above. A crash between two shards' commits leaves them one step
apart: reopening rolls the ones ahead back to the step every shard has (a
kept generation), so all restart from the same step.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offlax._src import errors
from offlax._src import layout as layout_lib

FORMAT_VERSION = 3  # 2: chunk_bytes recorded; step I/O on chunk files. 3: keep generations


DEFAULT_KEEP = 2  # committed steps kept: the current one and one to roll back to


METADATA = "offlax.json"


MESH = "offlax-mesh.json"
LAYERS = "layers.json"  # an `offlax.LayerStore`'s manifest (`layer_store/`), not this format


LOCK = ".lock"


@dataclasses.dataclass(frozen=True)
class LeafRecord:
  """What `offlax.json` records of one state item."""

  index: int
  path: str  # key path in the inner state, e.g. "[0].mu['w']"
  shape: tuple[int, ...]
  dtype: str
  chunk: int  # elements per storage chunk
  hot: bool  # also held in RAM between steps
  # For a typed PRNG key array: its implementation (e.g. "threefry2x32"); the
  # store holds its key data (`jax.random.key_data`), as `shape` and `dtype` say.
  key: str | None = None

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize

  @property
  def chunk_size(self) -> int:
    """Elements per chunk as stored (a chunk never exceeds the array)."""
    return max(1, min(self.chunk, self.size))

  @property
  def chunk_nbytes(self) -> int:
    return self.chunk_size * np.dtype(self.dtype).itemsize


def metadata_problem(records, step, generation, chunk_bytes, generations, kept) -> str | None:
  """What makes these fields of `offlax.json` impossible, or None.

  Checked before any is used: `generation` and `index` name directories, and a
  wrong one would send the step's writes elsewhere.
  """

  def nat(x, low=0):
    return type(x) is int and x >= low  # not `isinstance`: True is no step

  if not nat(generations, 2):
    return f"generations {generations!r}"
  if not nat(step) or not nat(generation) or generation >= generations:
    return f"step {step!r}, generation {generation!r} of {generations}"
  pairs = kept if isinstance(kept, list) else None
  if (
    pairs is None
    or not all(isinstance(e, list) and len(e) == 2 and all(nat(x) for x in e) for e in pairs)
    or [step, generation] not in pairs
    or len({g for _, g in pairs}) != len(pairs)
    or any(g >= generations for _, g in pairs)
  ):
    return f"kept steps {kept!r} (step {step}, generation {generation} of {generations})"
  if not nat(chunk_bytes, 1):
    return f"chunk_bytes {chunk_bytes!r}"
  for position, r in enumerate(records):
    dtype = jnp.dtype(r.dtype)  # TypeError for names that are no dtype
    if (
      r.index != position
      or not nat(r.index)
      or not isinstance(r.path, str)
      or not all(nat(d) for d in r.shape)
      or not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_)
      or not nat(r.chunk)  # 0 for a 0-size item
      or type(r.hot) is not bool
      or not (r.key is None or (isinstance(r.key, str) and r.hot))
    ):
      return f"leaf record {position} is {dataclasses.asdict(r)}"
  return None


def write_metadata(directory: str, meta: dict, *, fsync: bool) -> None:
  """Replaces `offlax.json` atomically: write, fsync, rename, fsync the directory."""
  write_json(directory, METADATA, meta, fsync=fsync)


def is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_impl(x: Any) -> str | None:
  """The implementation of a typed PRNG key array (or its shape), else None."""
  if not is_key(x):
    return None
  if not isinstance(x, jax.Array):  # a ShapeDtypeStruct: a key of its dtype tells
    x = jnp.zeros((), x.dtype)
  return str(jax.random.key_impl(x))


def key_data(x: Any) -> Any:
  """`x`, or a typed PRNG key array's key data: what the store holds of it."""
  return jax.random.key_data(x) if is_key(x) else x


def stored_form(x: Any) -> Any:
  """The shape and dtype the store holds for a state item of `x`'s (key data for keys)."""
  return jax.eval_shape(jax.random.key_data, x) if is_key(x) else x


def shard_dir(i: int) -> str:
  return f"shard_{i:05d}"


def shapes_record(spec: layout_lib.ParamSpec) -> dict[str, Any]:
  """Each param's global shape, as the mesh record keeps it (JSON)."""
  return {p: None if s is None else list(s) for p, s in zip(spec.paths, spec.shapes, strict=True)}


def read_json(name: str) -> dict:
  try:
    with open(name) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.StoreCorruptedError(f"cannot read {name}: {e}") from e
  if not isinstance(meta, dict):
    raise errors.StoreCorruptedError(f"{name} is malformed: not a JSON object.")
  return meta


def write_json(directory: str, filename: str, meta: dict, *, fsync: bool) -> None:
  """Replaces `directory/filename` atomically: write, fsync, rename, fsync the directory.

  The temporary file is this process's own (processes of one job may share
  `directory` and write the same record; pids repeat across hosts).
  """
  name = os.path.join(directory, filename)
  tmp = f"{name}.{jax.process_index()}.{os.getpid()}.tmp"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
  with os.fdopen(fd, "w") as f:
    json.dump(meta, f, indent=1)
    f.flush()
    if fsync:
      os.fsync(f.fileno())
  os.replace(tmp, name)
  if fsync:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
      os.fsync(dir_fd)
    finally:
      os.close(dir_fd)


def mesh_text(record: dict) -> str:
  try:
    axes = dict(zip(record["axis_names"], record["axis_sizes"], strict=True))
  except (KeyError, TypeError, ValueError):
    return f"{record!r:.200}"
  return f"a mesh {axes}"


def is_sharded(path: str) -> bool:
  """Whether `path` holds a sharded store (one store per device, see the module docstring)."""
  return os.path.exists(os.path.join(path, MESH))


def item_paths(state: Any, layout: layout_lib.StateLayout) -> list[str]:
  """The key path of each item of `layout.split(state)`."""
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=layout_lib.is_masked)[0]
  by_id = {id(x): jax.tree_util.keystr(p) for p, x in flat}
  return [by_id[id(x)] for x in layout.split(state)]
