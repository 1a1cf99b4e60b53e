"""`inspect_store`: what an NVMe store, a layer store or an orbax checkpoint holds.

Read-only: it takes no lock and writes nothing, so it can look at a store a
training process has open (the committed step may then move under it, which
the report says).
"""

from __future__ import annotations

import dataclasses
import fcntl
import math
import os

import crc32c
import numpy as np

from offlax._src import errors, host_checkpoint
from offlax._src import layout as layout_lib
from offlax._src.layer_store import files as layer_files
from offlax._src.layer_store import rest as layer_rest
from offlax._src.nvme import array_files, direct_io
from offlax._src.nvme import format as store_format
from offlax._src.nvme import store as store_lib
from offlax._src.units import format_bytes

_TMP_MARK = ".orbax-checkpoint-tmp"


@dataclasses.dataclass
class LeafReport:
  """One state array of a store: where it is in the state, its size, its status."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  cached: bool  # also held in RAM by the tier (on disk all the same)
  status: str = "ok"


@dataclasses.dataclass
class StoreReport:
  """What `inspect_store` found in one store or checkpoint item.

  Attributes:
    path: the store (or orbax item) directory.
    kind: ``"nvme"``, ``"layers"`` (an `offlax.LayerStore`), ``"orbax"`` (a pytree item) or
      ``"host_state"`` (a `HostStateSave` item).
    step: the committed step (an NVMe store), else None.
    kept: the committed steps kept, newest first (an NVMe store).
    generations: generation directories of the store.
    structure: the inner optimizer's state structure, as recorded.
    leaves: every state array.
    problems: what is wrong; empty for a healthy store.
    verified: whether every chunk was reread and checked.
    notes: facts worth knowing that are not problems.
    mismatches: the problems that are checksum mismatches (with `verified`).
  """

  path: str
  kind: str
  step: int | None = None
  kept: list[int] = dataclasses.field(default_factory=list)
  generations: int = 0
  structure: str = ""
  leaves: list[LeafReport] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)
  verified: bool = False
  notes: list[str] = dataclasses.field(default_factory=list)
  mismatches: int = 0

  @property
  def ok(self) -> bool:
    return not self.problems

  def format(self) -> str:
    """A readable multi-line report."""
    lines = [f"{self.kind} store {self.path}"]
    if self.kind in ("nvme", "layers"):
      lines.append(
        f"  committed step {self.step}; kept steps {self.kept} "
        f"({self.generations} generations on disk)"
      )
    if self.structure:
      lines.append(f"  inner state: {self.structure}")
    total = sum(leaf.nbytes for leaf in self.leaves)
    check = "files checked, not reread (--verify)"
    if self.verified:  # what the reread found: never "verified" above a PROBLEM line
      other = len(self.problems) - self.mismatches
      found = [f"{self.mismatches} mismatch{'es' * (self.mismatches != 1)}"] * (self.mismatches > 0)
      found += [f"{other} other problem{'s' * (other != 1)}"] * (other > 0)
      check = f"checksums: {', '.join(found)} (below)" if found else "checksums verified"
    lines.append(f"  {len(self.leaves)} arrays, {format_bytes(total)} per kept step; {check}")
    rows = [
      (leaf.path, f"{leaf.dtype}{list(leaf.shape)}", format_bytes(leaf.nbytes),
       "cached" if leaf.cached else "", leaf.status)
      for leaf in self.leaves
    ]  # fmt: skip
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(4)]
    for row in rows:
      cells = [
        cell.ljust(w) if i != 2 else cell.rjust(w)
        for i, (cell, w) in enumerate(zip(row, widths, strict=False))
      ]
      lines.append("    " + "  ".join([*cells, row[4]]))
    lines.extend(f"  note: {n}" for n in self.notes)
    lines.extend(f"  PROBLEM: {p}" for p in self.problems)
    lines.append("  OK" if self.ok else f"  {len(self.problems)} problem(s)")
    return "\n".join(lines)


def inspect_store(
  path: str | os.PathLike, *, verify: bool = False, progress: bool = True
) -> list[StoreReport]:
  """Reports on the NVMe store at `path`, or on every store and offlax item of a checkpoint.

  For an NVMe store: the committed step, the kept steps, and each state array
  with shape, dtype, bytes and status. Without `verify` it checks that every
  chunk file of every kept step is there with its size; with `verify` it
  rereads them all and checks their crc32c checksums. For an orbax checkpoint
  directory (a manager's directory, one step, or one item) it inspects each
  NVMe store saved in it (`NVMeStoreSave`), checks each `HostStateSave`
  item's files (`verify`: their checksums too) and lists the arrays of each
  pytree item; `verify` reads those arrays back. Walking a directory, it
  leaves out hidden ones (``.venv``, ``.git``), virtual environments and
  ``site-packages``.

  Args:
    path: an NVMe store directory or an orbax checkpoint directory.
    verify: reread every chunk (every array of a checkpoint) and check it.
    progress: show a progress bar while verifying.

  Returns:
    One `StoreReport` per store or item found; `report.ok` is False if
    anything is wrong.

  Raises:
    StoreError: `path` holds neither an offlax store nor an orbax checkpoint.

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, offlax
    >>> path = tempfile.mkdtemp()
    >>> tier = offlax.NVMeTier(path, cache_bytes=0, progress=False)
    >>> state = offlax.offload(optax.adam(1e-3), tier).init({"w": jnp.ones((4, 3))})
    >>> tier.close()
    >>> [report] = offlax.checkpoint.inspect_store(path, verify=True, progress=False)
    >>> report.ok, report.step, [leaf.path for leaf in report.leaves]
    (True, 0, ['[0].count', "[0].mu['w']", "[0].nu['w']"])
  """
  root = os.path.abspath(os.fspath(path))
  if not os.path.isdir(root):
    raise errors.StoreError(f"inspect: {root} is not a directory.")
  if os.path.exists(os.path.join(root, store_format.METADATA)):
    return [_inspect_nvme(root, verify, progress)]
  if os.path.exists(os.path.join(root, store_format.LAYERS)):
    return [_inspect_layers(root, verify, progress)]
  reports = []
  for directory, dirs, files in os.walk(root):
    # Hidden directories (.venv, .git), virtual environments and installed
    # packages hold no runs of the user's (orbax's test fixtures would read as
    # checkpoints); a path named explicitly is still inspected.
    dirs[:] = sorted(d for d in dirs if not _skipped(os.path.join(directory, d)))
    if _TMP_MARK in os.path.basename(directory):
      dirs.clear()  # an unfinished save: orbax ignores it, and so do we
      continue
    if store_format.METADATA in files:
      reports.append(_inspect_nvme(directory, verify, progress))
      dirs.clear()
    elif store_format.LAYERS in files:
      reports.append(_inspect_layers(directory, verify, progress))
      dirs.clear()
    elif host_checkpoint.is_host_state(directory):
      reports.append(_inspect_host_state(directory, verify, progress))
      dirs.clear()
    elif _ORBAX_ITEM_METADATA & set(files):
      reports.append(_inspect_orbax(directory, verify))
      dirs.clear()
  if not reports:
    raise errors.StoreError(
      f"inspect: {root} holds no offlax store (no {store_format.METADATA}) and no orbax "
      "checkpoint item (no _METADATA)."
    )
  return reports


# A pytree item's metadata file: `_METADATA` from orbax 0.11 on, `METADATA` before.
_ORBAX_ITEM_METADATA = {"_METADATA", "METADATA"}
_SKIPPED = {"site-packages", "dist-packages", "node_modules", "__pycache__"}


def _skipped(directory: str) -> bool:
  """Whether the walk of a directory above stores leaves `directory` out (see `inspect_store`)."""
  name = os.path.basename(directory)
  return (
    name.startswith(".")
    or name in _SKIPPED
    or os.path.exists(os.path.join(directory, "pyvenv.cfg"))  # a virtual environment
  )


def _inspect_nvme(path: str, verify: bool, progress: bool) -> StoreReport:
  store = store_lib.Store(path, fsync=False)
  report = StoreReport(path, "nvme", verified=verify)
  try:
    store.read_metadata()
  except errors.StoreCorruptedError as e:
    report.problems.append(str(e))
    return report
  report.step, report.generations, report.structure = (
    store.step,
    store.generations,
    store.structure,
  )
  report.kept = [s for s, _ in store.kept]
  if _locked(path):
    report.notes.append("a training process has the store open; the step may move meanwhile")
  report.leaves = [LeafReport(r.path, r.shape, r.dtype, r.nbytes, r.hot) for r in store.records]
  pairs = list(zip(report.leaves, store.records, strict=True))
  work = [(leaf, r, s, g) for s, g in store.kept for leaf, r in pairs]
  desc = f"offlax: verifying {path}"
  for leaf, r, step, gen in store_lib.progress_bar(work, progress and verify, desc):
    problem = _check_item(store, r, gen, verify)
    if problem is not None:
      report.problems.append(f"step {step}: {problem}")
      report.mismatches += "checksum mismatch" in problem
      if step == store.step:
        leaf.status = "BAD"
      elif leaf.status == "ok":
        leaf.status = f"bad in step {step}"
  if verify:
    for leaf in report.leaves:
      leaf.status = "verified" if leaf.status == "ok" else leaf.status
  return report


def _inspect_layers(path: str, verify: bool, progress: bool) -> StoreReport:
  """An `offlax.LayerStore`: each kept generation's files there at their size; `verify`: crcs."""
  report = StoreReport(path, "layers", verified=verify)
  try:
    manifest = layer_files.read_manifest(path)
  except (errors.StoreError, errors.StoreCorruptedError, errors.StoreMismatchError) as e:
    report.problems.append(str(e))
    return report
  n = manifest["n_layers"]
  report.step, report.generations = manifest["step"], manifest["generations"]
  report.kept = [s for s, _ in manifest["kept"]]
  report.structure = f"{n} layers"
  if _locked(path):
    report.notes.append("a training process has the store open; the step may move meanwhile")
  kinds = [("params", manifest["leaves"]), ("state", manifest["state"] or [])]
  leaves = {}
  for kind, records in kinds:
    for k, r in enumerate(records):
      nbytes = n * math.prod(r["shape"]) * np.dtype(r["dtype"]).itemsize
      leaf = LeafReport(f"{kind} {r['path']}", (n, *r["shape"]), r["dtype"], nbytes, False)
      leaves[kind, k] = leaf
      report.leaves.append(leaf)
  files = [(step, gen, kind, k, r) for step, gen in manifest["kept"]
           for kind, records in kinds for k, r in enumerate(records)]  # fmt: skip
  grads = layer_files.grad_records(manifest["leaves"], manifest.get("accumulator_dtype"))
  files += [(None, None, "grads", k, r) for k, r in enumerate(grads)]
  desc = f"offlax: verifying {path}"
  for step, gen, kind, k, r in store_lib.progress_bar(files, progress and verify, desc):
    folder = "grads" if gen is None else os.path.join(f"gen{gen}", kind)
    name = os.path.join(path, folder, f"{k}.bin")
    size = os.path.getsize(name) if os.path.isfile(name) else None
    problem = None
    if size != n * r["slot"]:
      problem = f"{name} holds {size} bytes, expected {n * r['slot']} ({n} layers of {r['slot']})"
    elif verify and gen is not None:
      crcs = manifest["crc"][str(gen)][kind]
      problem = _check_slots(name, r, n, [crcs[i * len(dict(kinds)[kind]) + k] for i in range(n)])
      report.mismatches += problem is not None and problem.endswith(_MISMATCH)
    if problem is not None:
      report.problems.append(problem if step is None else f"step {step}: {problem}")
      leaf = leaves.get((kind, k)) or leaves["params", k]
      leaf.status = "BAD" if step in (None, manifest["step"]) else f"bad in step {step}"
  rest = manifest.get("rest", {})
  for step, gen in manifest["kept"]:  # the rest of the model, committed with the layers
    records = rest.get(str(gen))
    if verify and records and (problem := layer_rest.check(path, gen, records)):
      report.problems.append(f"step {step}: {problem}")
      report.mismatches += problem.endswith(_MISMATCH)
  if verify:
    for leaf in report.leaves:
      leaf.status = "verified" if leaf.status == "ok" else leaf.status
  return report


_MISMATCH = "does not match its checksum"


def _check_slots(name: str, r: dict, n: int, crcs: list) -> str | None:
  """The first layer of file `name` whose crc32c is not its recorded one, or None."""
  buffer = direct_io.aligned_empty(r["slot"])
  fd, _ = direct_io.open_direct(name, os.O_RDONLY | os.O_NOFOLLOW)
  try:
    for i, crc in enumerate(crcs):
      direct_io.pread_into(fd, buffer, i * r["slot"])
      if crc is not None and crc32c.crc32c(buffer.data) != crc:
        return f"{name}: layer {i} of {r['path']} {_MISMATCH}"
  except OSError as e:
    return f"{name}: {e}"
  finally:
    os.close(fd)
  return None


def _check_item(store: store_lib.Store, r: store_format.LeafRecord, gen: int, verify: bool):
  """The first problem of item `r` in generation `gen`, or None."""
  return store.files.verify(r, gen) if verify else store.check_files(r, gen)


def _locked(path: str) -> bool:
  try:
    fd = os.open(os.path.join(path, store_format.LOCK), os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
  except BlockingIOError:
    return True
  finally:
    os.close(fd)


def _inspect_host_state(path: str, verify: bool, progress: bool) -> StoreReport:
  """A `HostStateSave` item: every shard file there with its size; with `verify`, its checksums."""
  report = StoreReport(path, "host_state", verified=verify)
  try:
    saved, crcs = host_checkpoint.read_layout(path)
  except errors.StoreCorruptedError as e:
    report.problems.append(str(e))
    return report
  files = []
  for i, meta in enumerate(saved):
    dtype, shape = np.dtype(meta["dtype"]), tuple(meta["shape"])
    leaf = LeafReport(meta["path"], shape, dtype.name, math.prod(shape) * dtype.itemsize, False)
    report.leaves.append(leaf)
    for k, shard in enumerate(meta["shards"]):
      name, piece = f"{i}.{k}", tuple(b - a for a, b in shard)
      file, size = os.path.join(path, name), math.prod(piece) * dtype.itemsize
      actual = os.path.getsize(file) if os.path.isfile(file) else None
      if actual is None or name not in crcs:
        leaf.status = "MISSING"
        report.problems.append(f"{leaf.path}: shard file {name} or its checksums missing")
      elif actual != size:
        leaf.status = "BAD"
        report.problems.append(f"{leaf.path}: {name} holds {actual} bytes, expected {size}")
      else:
        files.append((leaf, (file, piece, dtype, crcs[name])))
  if verify:
    total = sum(math.prod(f[1]) * f[2].itemsize for _, f in files)
    bar = array_files.byte_bar(total, f"offlax: verifying {path}") if progress else None
    for leaf, item in files:
      try:
        for _ in array_files.read_files([item]):
          pass
      except (errors.StoreError, errors.StoreCorruptedError) as e:  # that is the finding
        leaf.status = "BAD"
        report.problems.append(f"{leaf.path}: {e}")
        report.mismatches += "do not match their checksum" in str(e)
      if bar is not None:
        bar.update(math.prod(item[1]) * item[2].itemsize)
    if bar is not None:
      bar.close()
    for leaf in report.leaves:
      if leaf.status == "ok":
        leaf.status = "verified"
  return report


def _inspect_orbax(path: str, verify: bool) -> StoreReport:
  import orbax.checkpoint as ocp

  report = StoreReport(path, "orbax", verified=verify)
  # Closed when done: an open checkpointer's event loop, closed at exit, printed
  # "RuntimeError: Event loop is closed".
  with ocp.PyTreeCheckpointer() as checkpointer:
    return _inspect_orbax_with(checkpointer, path, verify, report)


def _inspect_orbax_with(checkpointer, path: str, verify: bool, report: StoreReport) -> StoreReport:
  import jax
  import orbax.checkpoint as ocp

  try:
    tree = checkpointer.metadata(path).item_metadata.tree
  except Exception as e:  # orbax raises many kinds; each is a problem to report
    report.problems.append(f"cannot read the checkpoint's metadata: {e!r}")
    return report
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  arrays = [(p, m) for p, m in flat if hasattr(m, "shape") and hasattr(m, "dtype")]
  for p, m in arrays:
    nbytes = layout_lib.nbytes(m)
    report.leaves.append(
      LeafReport(jax.tree_util.keystr(p), tuple(m.shape), np.dtype(m.dtype).name, nbytes, False)
    )
  if not os.path.exists(os.path.join(os.path.dirname(path), "commit_success.txt")) and not (
    os.path.exists(os.path.join(path, "commit_success.txt"))
  ):
    report.notes.append("no commit_success.txt: orbax may not have finished this save")
  if verify:
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    try:
      values = checkpointer.restore(path, restore_args=restore_args)
    except Exception as e:  # as above: any failure to read back is the finding
      report.problems.append(f"reading the arrays back failed: {e!r}")
      return report
    got = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(values)[0]}
    for leaf in report.leaves:
      shape = None if leaf.path not in got else tuple(np.shape(got[leaf.path]))
      if shape != leaf.shape:
        leaf.status = "BAD"
        report.problems.append(f"{leaf.path}: read back {shape}, expected {leaf.shape}")
      else:
        leaf.status = "verified"
  return report
