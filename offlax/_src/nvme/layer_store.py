"""Stacked layers' params, gradients and optimizer state on disk (`LayerStore`).

A `LayerStore` is a directory holding a stacked layer pytree (each leaf has
the layers on its first axis, as `scan_layers` takes them), its gradients and,
with an ``optimizer``, that optimizer's state (`jax.vmap` of its ``init``:
every state leaf, the step count too, one entry per layer):

  layers.json                 the manifest: leaves, committed step, generations
  gen<g>/params/<k>.bin       leaf k of the params, generation g
  gen<g>/state/<k>.bin        leaf k of the optimizer state, generation g
  grads/<k>.bin               leaf k of the gradients (no generations)

Layer i of a leaf is one slot at ``i * slot``, its bytes padded to the
direct-I/O block, so a layer is one aligned transfer: O_DIRECT where the
filesystem has it (`direct_io.set_direct`), the page cache elsewhere (tmpfs).

Commits. `update` (`layer_step`) reads params and state of the committed
generation and the gradients, layer by layer, and writes the new params and
state into a free generation; then every written file is flushed and the
manifest, naming the new step and generation, replaces the old one atomically
(`os.replace`). A kill at any moment leaves the manifest of the last committed
step, whose params and state were not touched: params and state always resume
from the same step. ``keep`` committed steps stay on disk (``keep + 1``
generations), for `LayerStore.open(..., step=)`. A new store reserves all its
files' space (`os.posix_fallocate`), so a full disk is refused at `create`.

Reads and writes for the model (`layer_source.LayerSource`): the forward pass
and the rematerialised backward pass read a layer by a callback from a pool of
read-ahead threads, at most ``pool_layers`` layers held or in flight; each
layer's gradient is copied out of the callback and written behind compute by
one writer thread (at most ``pool_layers`` layers queued), added into the
store's with ``source(accumulate=True)``. `update` and the read helpers wait
for those writes first.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offlax._src import errors
from offlax._src.nvme import layer_checks as checks
from offlax._src.nvme import layer_files as files
from offlax._src.nvme import layer_guards, layer_rest, layer_step
from offlax._src.nvme.direct_io import aligned_empty, open_direct, pread_into, pwrite_all
from offlax._src.nvme.layer_source import LayerSource
from offlax._src.nvme.pipeline import wait_for_dispatched_steps


class LayerStore:
  """A stacked layer pytree's params, gradients and optimizer state on disk.

  Make one with `LayerStore.create` or `LayerStore.open`; use it as a context
  manager or `close` it. Pass `source()` to `offlax.scan_layers` in place of the
  stacked layers, differentiate with respect to it (the backward pass writes
  the gradients into the store), then call `update()` to apply the optimizer to
  the layers on disk and commit the step.

  Attributes:
    path: the store's directory.
    n_layers: the number of layers.
    step: the committed step (0 after `create`).
    kept: the committed steps on disk, newest first.
    pool_layers: the most layers held in RAM by the model's reads.
    last_update: what the last `update` moved and how long it took, or None.
    peak_held: the most layers the reads held at once so far (for tests).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, offlax
    >>> layers = {"w": jnp.full((4, 3, 3), 0.1)}  # 4 layers
    >>> def loss(source, x):
    ...   body = lambda h, p: (jnp.tanh(h @ p["w"]), None)
    ...   return jnp.sum(offlax.scan_layers(body, x, source)[0])
    >>> with offlax.LayerStore.create(tempfile.mkdtemp() + "/s", layers,
    ...                               optimizer=optax.sgd(0.1)) as store:
    ...   _ = jax.grad(loss)(store.source(), jnp.ones((2, 3)))
    ...   store.update()
    ...   print(store.step, store.read_params()["w"].shape)
    1
    1 (4, 3, 3)
  """

  def __init__(self, path: str, manifest: dict, treedef: Any, optimizer: Any, state_treedef: Any,
               records: list[dict], state_records: list[dict], pool_layers: int | None,
               pool_bytes: int | None, fsync: bool, progress: bool):  # fmt: skip
    self.path, self.treedef, self.optimizer = path, treedef, optimizer
    self.state_treedef, self.records, self.state_records = state_treedef, records, state_records
    self.manifest = manifest
    self.layers_path: str | None = manifest.get("layers_path")  # for `offload_params`
    self._ledger = layer_guards.GradientsLedger(path, watch=optimizer is not None)
    self.n_layers: int = manifest["n_layers"]
    self.generations: int = manifest["generations"]
    self.step: int = manifest["step"]
    self.generation: int = manifest["generation"]
    self.kept: list[tuple[int, int]] = [tuple(k) for k in manifest["kept"]]  # type: ignore[misc]
    self.fsync, self.progress = fsync, progress
    self.layer_bytes = sum(r["slot"] for r in records)
    self.pool_layers = files.pool_size(self.layer_bytes, pool_layers, pool_bytes)
    self.last_update: layer_step.Stats | None = None
    self._lock = threading.Lock()
    self._ahead: dict[int, concurrent.futures.Future] = {}
    self._last: int | None = None
    self._direction = 1
    self._held = 0
    self.peak_held = 0
    self._pool = concurrent.futures.ThreadPoolExecutor(
      max(1, self.pool_layers - 1), "offlax-layers"
    )
    self._writer = concurrent.futures.ThreadPoolExecutor(1, "offlax-grads")
    self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
    self._updates = None if optimizer is None else layer_step.layer_update(optimizer, self)
    self._fds: dict[tuple[str, int], list[int]] = {}
    self._grad_crcs: list[list[int | None]] = [[checks.UNKNOWN] * self.n_layers for _ in records]
    self._lock_fd: int | None = None
    try:
      self._lock_fd = files.lock_store(path)
      for kind, gen in self._files():
        names = self._file_names(kind, gen)
        self._fds[kind, gen] = [open_direct(name, os.O_RDWR | os.O_NOFOLLOW)[0] for name in names]
    except BaseException:
      self.close()
      raise

  def _files(self) -> list[tuple[str, int]]:
    kinds = ["params"] + (["state"] if self.state_records else [])
    return [(k, g) for g in range(self.generations) for k in kinds] + [("grads", 0)]

  def _file_names(self, kind: str, gen: int) -> list[str]:
    records = self.state_records if kind == "state" else self.records
    folder = "grads" if kind == "grads" else os.path.join(f"gen{gen}", kind)
    return [
      os.path.join(self.path, folder, f"{r.get('index', k)}.bin") for k, r in enumerate(records)
    ]

  # -- making and opening ------------------------------------------------------

  @classmethod
  def create(cls, path: str, layers: Any, *, optimizer: Any = None, keep: int = 1,
             init_layer: Callable[[int], Any] | None = None, pool_layers: int | None = 2,
             pool_bytes: int | None = None, fsync: bool = True, progress: bool = True,
             layers_path: str | None = None) -> LayerStore:  # fmt: skip
    """Writes the stacked `layers` (and `optimizer.init` of each layer) into a new store.

    Args:
      path: a directory that does not exist or is empty.
      layers: a pytree of arrays, the layers stacked on each leaf's first axis;
        `jax.ShapeDtypeStruct` leaves make a sparse store of zeros, nothing
        written and no space reserved (to compile a model larger than the disk).
      optimizer: an elementwise optax `GradientTransformation` (Adam, AdamW,
        SGD, `offlax.master_weights` of them, ...) that `update` applies a layer
        at a time; None: params and gradients only.
      keep: committed steps kept on disk (>= 1); the store holds ``keep + 1``
        copies of the params and state.
      init_layer: with `layers` as `jax.ShapeDtypeStruct`s, a function of the
        layer index returning that layer's params (one layer's pytree): the
        store is written a layer at a time, never the whole model in RAM.
      pool_layers: layers the model's read-ahead pool may hold (>= 1; 2 reads
        one ahead).
      pool_bytes: instead of ``pool_layers``, the pool's size in bytes (at
        least one layer).
      fsync: flush the step's files before each commit (survives power loss).
      progress: show a progress bar while writing.
      layers_path: the model's list the layers are, as ``"encoder"`` names
        ``model.encoder``, recorded for `offload_params(model, store=)`;
        default: the list ``offlax.stack_layers(model, path)`` stacked.

    Returns:
      The open store, at step 0.

    Raises:
      StoreExistsError: `path` holds a layer store (`LayerStore.open` it).
      NotAStoreError: `path` holds other files.
      TransformationTypeError: the optimizer is wrapped by `offlax.offload`.
      InvalidOptionError: the pool cannot hold one layer, or the optimizer
        couples elements of a leaf (its update cannot run a layer at a time).
      StoreError: the disk has no room for the store.
    """
    records, n, treedef = files.layer_records(layers)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
      raise errors.InvalidOptionError(f"LayerStore: keep must be an int >= 1, got {keep!r}.")
    files.pool_size(sum(r["slot"] for r in records), pool_layers, pool_bytes)  # before writing
    abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(layers)]
    if init_layer is not None and not all(abstract):
      raise errors.InvalidOptionError(
        "LayerStore.create: init_layer= makes the layers; pass them as jax.ShapeDtypeStructs."
      )
    state_records, state_treedef = layer_guards.optimizer_state(optimizer, layers, path)
    layer_guards.check_folder(path)
    manifest = {
      "format": files.FORMAT, "version": files.VERSION, "n_layers": n, "leaves": records,
      "state": state_records if optimizer is not None else None, "generations": keep + 1,
      "step": 0, "generation": 0, "kept": [[0, 0]],
      "layers_path": layer_guards.layers_path(layers, layers_path),
    }  # fmt: skip
    manifest["crc"] = {str(g): files.no_crcs(manifest) for g in range(keep + 1)}
    made = not os.path.exists(path)
    try:
      files.make_files(path, manifest, reserve=init_layer is not None or not any(abstract))
      store = cls(path, manifest, treedef, optimizer, state_treedef, records, state_records,
                  pool_layers, pool_bytes, fsync, progress)  # fmt: skip
      try:
        if init_layer is not None:
          store._write_initial(init_layer)
        elif not all(abstract):
          host = [None if a else np.asarray(jax.device_get(x))
                  for a, x in zip(abstract, jax.tree.leaves(layers), strict=True)]  # fmt: skip
          store._write_initial(lambda i: [None if x is None else x[i] for x in host])
        files.write_manifest(path, manifest)  # the manifest last: a store is whole
      except BaseException:
        store.close()
        raise
    except BaseException:
      files.remove_files(path, manifest, made)
      raise
    return store

  @classmethod
  def open(cls, path: str, like: Any, *, optimizer: Any = None, step: int | None = None,
           pool_layers: int | None = 2, pool_bytes: int | None = None, fsync: bool = True,
           progress: bool = True) -> LayerStore:  # fmt: skip
    """Opens the store at `path`, checked against `like` (and `optimizer`).

    Args:
      path: the store's directory.
      like: the stacked layer pytree the store must hold: arrays or
        `jax.ShapeDtypeStruct`s of the same structure, shapes and dtypes.
      optimizer: the optimizer the store was made with (its state must match),
        or None to read and train nothing but the params and gradients.
      step: the step the caller's other state is at (e.g. a checkpoint of the
        rest of the model): a kept step is made current again, dropping the
        steps after it; another raises `StoreMismatchError`. None: the
        committed step.
      pool_layers: as for `create`, and so are pool_bytes, fsync and progress.

    Raises:
      StoreError: no store at `path`.
      StoreCorruptedError: its manifest or files are damaged.
      StoreMismatchError: it holds another layer tree, another optimizer's
        state or no optimizer state, or not `step`; or the layers of another
        model list than `like` was stacked from (`stack_layers(model, path)`).
    """
    manifest = files.read_manifest(path)
    records, n, treedef = files.layer_records(like)
    if manifest.get("n_layers") != n:
      raise errors.StoreMismatchError(
        f"LayerStore.open: {path} holds {manifest.get('n_layers')} layers, expected {n}."
      )
    records = files.check_records(path, "param", manifest["leaves"], records)
    state_records, state_treedef = layer_guards.optimizer_state(optimizer, like, path, manifest)
    manifest["layers_path"] = layer_guards.opened_path(path, manifest, like)
    store = cls(path, manifest, treedef, optimizer, state_treedef, records, state_records,
                pool_layers, pool_bytes, fsync, progress)  # fmt: skip
    try:
      store._check_sizes()
      if step is not None and step != store.step:
        store._go_to_step(step)
    except BaseException:
      store.close()
      raise
    return store

  def close(self) -> None:
    """Waits for the gradient writes, ends the reads and closes the files."""
    self._pool.shutdown(wait=True, cancel_futures=True)
    self._writer.shutdown(wait=True)
    self._ahead.clear()
    for fds in self._fds.values():
      for fd in fds:
        os.close(fd)
    self._fds = {}
    if self._lock_fd is not None:
      os.close(self._lock_fd)  # releases the lock
      self._lock_fd = None

  def __enter__(self) -> LayerStore:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"LayerStore({self.path!r}, n_layers={self.n_layers}, step={self.step})"

  # -- the model's side --------------------------------------------------------

  def source(self, *, accumulate: bool = False) -> LayerSource:
    """What `scan_layers` takes in place of the stacked layers.

    Differentiate with respect to it (``jax.grad(loss)(source, ...)``) to write
    the layers' gradients into the store; its own gradient is a zero token.

    Args:
      accumulate: add each gradient into the store's (gradient accumulation;
        `zero_grads` starts afresh), instead of overwriting it.
    """
    return LayerSource(jnp.zeros((self.n_layers,), jnp.float32), self, accumulate)

  def avals(self) -> list[jax.ShapeDtypeStruct]:
    """One layer's leaves, as shapes and dtypes."""
    return [jax.ShapeDtypeStruct(tuple(r["shape"]), np.dtype(r["dtype"])) for r in self.records]

  def read_layer(self, i: int) -> list[np.ndarray]:
    """Layer `i`'s committed params (leaves in tree order), read now."""
    return self.read_slots("params", self.generation, i)

  def read_params(self) -> Any:
    """All the committed params, stacked (the model's size in RAM: for small models)."""
    return self._stacked("params", self.treedef)

  def read_grads(self) -> Any:
    """All the gradients, stacked as the params are (for small models)."""
    self.flush_grads()
    return self._stacked("grads", self.treedef)

  def read_state(self) -> Any:
    """The committed optimizer state, each leaf stacked over the layers (for small models)."""
    if self.state_treedef is None:
      raise errors.InvalidOptionError(f"LayerStore: {self.path} is open without an optimizer.")
    return self._stacked("state", self.state_treedef)

  def read_rest(self, like: Any) -> Any:
    """What `update(rest=...)` committed with the current step, as numpy arrays.

    Args:
      like: a pytree of arrays or `jax.ShapeDtypeStruct`s with the rest's
        leaves (key paths, shapes and dtypes checked).

    Raises:
      StoreMismatchError: the step was committed without ``rest``, or its
        leaves differ from `like`'s.
      StoreCorruptedError: a leaf does not match its checksum.
    """
    records = self.manifest.get("rest", {}).get(str(self.generation))
    return layer_rest.read(self.path, self.generation, self.step, records, like)

  def zero_grads(self) -> None:
    """Sets every gradient to zero (before accumulating anew)."""
    self.flush_grads()
    self._ledger.used()
    for k, fd in enumerate(self._fds["grads", 0]):
      size = os.fstat(fd).st_size
      os.ftruncate(fd, 0)
      os.ftruncate(fd, size)
      os.posix_fallocate(fd, 0, size)  # reserved again: a gradient write never finds the disk full
      zero = checks.crc(np.zeros(self.records[k]["slot"], np.uint8))
      self._grad_crcs[k] = [zero] * self.n_layers

  def fetch(self, i: Any) -> list[np.ndarray]:
    """Layer `i` for the scan (a callback): from the pool, reading the next layers ahead."""
    i = int(i)
    with self._lock:
      if self._last is not None and abs(i - self._last) == 1:
        self._direction = i - self._last
      elif self._last == i:  # the backward pass starts on the layer the forward pass ended on
        self._direction = -self._direction
      self._last = i
      future = self._ahead.pop(i, None)
      wanted = [i + self._direction * d for d in range(1, self.pool_layers)]
      wanted = [j for j in wanted if 0 <= j < self.n_layers]
      for j in [j for j in self._ahead if j not in wanted]:  # a wrong guess: drop it
        self._drop(self._ahead.pop(j))
      if future is None:
        self._held += 1
        future = concurrent.futures.Future()
        future.set_result(self.read_layer(i))
      self.peak_held = max(self.peak_held, self._held)
      for j in wanted:
        if j not in self._ahead:
          self._held += 1
          self.peak_held = max(self.peak_held, self._held)
          self._ahead[j] = self._pool.submit(self.read_layer, j)
    try:
      return future.result()
    finally:
      with self._lock:
        self._held -= 1  # the device has its copy once the callback returns

  def _drop(self, future: concurrent.futures.Future) -> None:
    if not future.cancel():
      concurrent.futures.wait([future])
    self._held -= 1

  def put_grads(self, accumulate: bool, i: Any, *grads: np.ndarray) -> np.ndarray:
    """Layer `i`'s gradients (a callback): copied out, written behind compute."""
    i = int(i)
    self._ledger.written(i, accumulate, self.step)  # warns where unused ones are overwritten
    slots = [
      files.to_slot(np.asarray(g), r["slot"]) for g, r in zip(grads, self.records, strict=True)
    ]
    while len(self._pending) >= self.pool_layers:
      self._pending.popleft().result()  # bounds the RAM queued; raises a failed write
    self._pending.append(self._writer.submit(self._store_grads, accumulate, i, slots))
    return np.zeros((), np.float32)

  def flush_grads(self) -> None:
    """Waits for the steps dispatched so far and their gradient writes; raises a failed write."""
    wait_for_dispatched_steps()  # a jitted backward pass returns before its callbacks run
    while self._pending:
      self._pending.popleft().result()

  def _store_grads(self, accumulate: bool, i: int, slots: list[np.ndarray]) -> None:
    for k, slot in enumerate(slots):
      if accumulate:
        r = self.records[k]
        count = int(np.prod(r["shape"], dtype=np.int64)) * np.dtype(r["dtype"]).itemsize
        old = self.read_slot("grads", 0, k, i)
        new = slot[:count].view(old.dtype).reshape(old.shape)
        new[...] = old + new
      self._write_raw("grads", 0, k, i, slot)

  # -- the optimizer's side ----------------------------------------------------

  def update(self, *, rest: Any = None) -> int:
    """Applies the optimizer to the layers on disk with the stored gradients; commits.

    Waits for the gradient writes, then reads params, gradients and state a
    layer at a time (read ahead), runs the optimizer's update on the host CPU,
    writes the new params and state into a free generation (written behind)
    and commits them together.

    Args:
      rest: a pytree of arrays committed with the layers, of the same step:
        the rest of the model (embedding, head) and its optimizer state, as
        updated by this step. `read_rest` gives them back (after `open`,
        of the step opened).

    Returns:
      The new committed step.

    Raises:
      InvalidOptionError: the store is open without an optimizer.
      StoreError: a read or write failed (a full disk: ``errno.ENOSPC``);
        nothing was committed, the store still holds the step before, and
        `update` may be called again.
      StoreCorruptedError: a slot read does not match its checksum; nothing
        was committed (the message names the slot and the way back).
    """
    if self._updates is None:
      raise errors.InvalidOptionError(
        f"LayerStore.update: {self.path} is open without an optimizer; pass optimizer= to "
        "LayerStore.create or LayerStore.open."
      )
    self.flush_grads()
    self.drop_read_ahead()  # they are of the generation this step replaces
    target = next(g for g in range(self.generations) if g not in {g for _, g in self.kept})
    self.manifest["crc"][str(target)] = files.no_crcs(self.manifest)
    try:
      rest_records = (
        None if rest is None else layer_rest.write(self.path, target, rest, fsync=self.fsync)
      )
      stats = layer_step.run(self, self._updates, target)
      if self.fsync:
        for kind in ("params", "state"):
          for fd in self._fds.get((kind, target), []):
            os.fdatasync(fd)
    except OSError as e:
      raise errors.StoreError(
        e.errno,
        f"LayerStore.update: step {self.step + 1} was not committed ({e.strerror or e}); "
        f"{self.path} still holds step {self.step}, whole, and its gradients: "
        + ("free space on the disk, then " if e.errno == errno.ENOSPC else "")
        + "call update() again.",
      ) from e
    self.manifest.setdefault("rest", {})[str(target)] = rest_records
    keep = self.generations - 1
    self.kept = [(self.step + 1, target)] + self.kept[: keep - 1]
    self.step, self.generation = self.step + 1, target
    self._commit()
    self.last_update = stats
    self._ledger.used()
    return self.step

  def drop_read_ahead(self) -> None:
    """Forgets the layers read ahead (before a commit replaces their generation)."""
    with self._lock:
      for j in list(self._ahead):
        self._drop(self._ahead.pop(j))
      self._last = None

  def read_slots(self, kind: str, gen: int, i: int) -> list[np.ndarray]:
    """Layer `i` of every leaf of `kind` ("params", "state" or "grads") in generation `gen`."""
    records = self.state_records if kind == "state" else self.records
    return [self.read_slot(kind, gen, k, i) for k in range(len(records))]

  def write_slots(self, kind: str, gen: int, i: int, leaves: Sequence[Any]) -> None:
    """Writes layer `i` of every leaf of `kind` into generation `gen`."""
    records = self.state_records if kind == "state" else self.records
    for k, x in enumerate(leaves):
      self.write_slot(kind, gen, k, i, x)
    if len(leaves) != len(records):
      raise errors.StoreMismatchError(
        f"LayerStore: {len(leaves)} {kind} leaves for layer {i}, expected {len(records)}."
      )

  def write_slot(self, kind: str, gen: int, k: int, i: int, x: Any) -> None:
    """Writes layer `i` of leaf `k` of `kind` into generation `gen`, checked."""
    r = (self.state_records if kind == "state" else self.records)[k]
    x = np.asarray(x)
    if x.shape != tuple(r["shape"]) or x.dtype != np.dtype(r["dtype"]):
      raise errors.StoreMismatchError(
        f"LayerStore: layer {i} of {kind} leaf {r['path']} is {x.dtype.name}{list(x.shape)}, "
        f"expected {r['dtype']}{r['shape']}."
      )
    self._write_raw(kind, gen, k, i, files.to_slot(x, r["slot"]))

  # -- slots, files, commits -----------------------------------------------------

  def _stacked(self, kind: str, treedef: Any) -> Any:
    gen = self.generation
    n = len(self.state_records if kind == "state" else self.records)
    layers = [self.read_slots(kind, gen, i) for i in range(self.n_layers)]
    return jax.tree.unflatten(treedef, [np.stack([x[k] for x in layers]) for k in range(n)])

  def read_slot(self, kind: str, gen: int, k: int, i: int) -> np.ndarray:
    """Layer `i` of leaf `k` of `kind` in generation `gen` (the gradients have one), checked.

    Raises:
      StoreCorruptedError: the slot does not match its crc32c (`layer_checks`).
    """
    records = self.state_records if kind == "state" else self.records
    r = records[k]
    buffer = aligned_empty(r["slot"])
    try:
      pread_into(self._fds[kind, 0 if kind == "grads" else gen][k], buffer, i * r["slot"])
    except OSError as e:
      raise errors.StoreError(
        e.errno, f"LayerStore: cannot read layer {i} of {kind} leaf {r['path']}: {e}"
      ) from e
    at = checks.slot_at(records, k, i)
    want = self._grad_crcs[k][i] if kind == "grads" else self.manifest["crc"][str(gen)][kind][at]
    if want is not checks.UNKNOWN and (got := checks.crc(buffer)) != want:
      name = self._file_names(kind, gen)[k]
      if kind == "grads":
        raise checks.grads_corrupted(name, r["path"], i, self.step, got, want)
      step = next((s for s, g in self.kept if g == gen), None)
      raise checks.corrupted(self.path, name, kind, r["path"], i, step, self.kept, got, want)
    dtype = np.dtype(r["dtype"])
    count = int(np.prod(r["shape"], dtype=np.int64))
    return buffer[: count * dtype.itemsize].view(dtype).reshape(r["shape"])

  def _write_raw(self, kind: str, gen: int, k: int, i: int, slot: np.ndarray) -> None:
    records = self.state_records if kind == "state" else self.records
    r = records[k]
    if kind == "grads":  # in memory: see `layer_checks`
      self._grad_crcs[k][i] = checks.crc(slot)
    else:  # checked on every read, and by `offlax.inspect_store(verify=True)`
      self.manifest["crc"][str(gen)][kind][checks.slot_at(records, k, i)] = checks.crc(slot)
    try:
      pwrite_all(self._fds[kind, 0 if kind == "grads" else gen][k], [slot], i * r["slot"])
    except OSError as e:
      raise errors.StoreError(
        e.errno, f"LayerStore: cannot write layer {i} of {kind} leaf {r['path']}: {e.strerror or e}"
      ) from e

  def _write_initial(self, layer: Callable[[int], Any]) -> None:
    """Writes each layer's params (leaves None: left zero) and its optimizer's initial state."""
    init = None if self.optimizer is None else jax.jit(self.optimizer.init)
    nbytes = self.n_layers * (self.layer_bytes + sum(r["slot"] for r in self.state_records))
    desc = f"offlax: writing {self.path}"
    for i in layer_step.progress(range(self.n_layers), self, nbytes, desc):
      leaves = layer(i)
      if not isinstance(leaves, list):  # a layer's pytree, from init_layer
        leaves = files.layer_leaves(self.records, self.treedef, leaves, i)
      for k, x in enumerate(leaves):
        if x is not None:
          self._write_raw("params", 0, k, i, files.to_slot(np.asarray(x), self.records[k]["slot"]))
      if init is not None:
        shapes = [np.zeros(r["shape"], r["dtype"]) for r in self.records]
        params = [s if x is None else x for s, x in zip(shapes, leaves, strict=True)]
        self.write_slots("state", 0, i, jax.tree.leaves(init(self.treedef.unflatten(params))))
    for fds in self._fds.values():
      for fd in fds:
        os.fsync(fd)

  def _check_sizes(self) -> None:
    for kind, gen in self._files():
      if kind != "grads" and gen != self.generation and all(g != gen for _, g in self.kept):
        continue  # a free generation: written whole before it is committed
      records = self.state_records if kind == "state" else self.records
      names, fds = self._file_names(kind, gen), self._fds[kind, gen]
      sizes = [os.fstat(fd).st_size for fd in fds]
      files.check_sizes("LayerStore.open", kind, names, sizes, records, self.n_layers)

  def _go_to_step(self, step: int) -> None:
    self.kept = files.to_kept_step(self.path, self.step, self.kept, step)
    self.step, self.generation = self.kept[0]
    self._commit()

  def _commit(self) -> None:
    self.manifest.update(step=self.step, generation=self.generation, kept=self.kept)
    files.write_manifest(self.path, self.manifest, fsync=self.fsync)
