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

Commits (`commits`). `update` (`step`) reads params and state of the committed
generation and the gradients, layer by layer, and writes the new params and
state into a free generation; then every written file is flushed and the
manifest, naming the new step and generation, replaces the old one atomically
(`os.replace`). A kill at any moment leaves the manifest of the last committed
step, whose params and state were not touched: params and state always resume
from the same step. ``keep`` committed steps stay on disk (``keep + 1``
generations), for `LayerStore.open(..., step=)`. A new store reserves all its
files' space (`os.posix_fallocate`), so a full disk is refused at `create`.

Reads and writes for the model (`source.LayerSource`): the forward pass
and the rematerialised backward pass read a layer by a callback from a pool of
read-ahead threads, at most ``pool_layers`` layers held or in flight; each
layer's gradient is copied out of the callback and written behind compute by
one writer thread (at most ``pool_layers`` layers queued), added into the
store's with ``source(accumulate=True)``. `update` and the read helpers wait
for those writes first.

With ``update="backward"`` (`backward`) the gradients are not written: each
layer is updated in the backward pass as its gradient reaches the host, into
the free generation, and `update` commits.

`LayerStore` is the facade of its parts, one job each: `slots.Slots` (its open
files, a slot read and written checked), `commits.Commits` (the manifest, the
committed step), `read_ahead.ReadAhead` (the model's reads),
`grads.GradientWriter` (the gradients' hand-off) and `step.LayerStep` (the
optimizer's step), or `backward.BackwardStep` for both; `opening` makes and opens a store.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offlax._src import errors
from offlax._src.layer_store import backward, micro, opening, whole_norm
from offlax._src.layer_store import rest as layer_rest
from offlax._src.layer_store import step as layer_step
from offlax._src.layer_store.commits import Commits
from offlax._src.layer_store.read_ahead import ReadAhead
from offlax._src.layer_store.rewrite import Rewrite
from offlax._src.layer_store.slots import Slots
from offlax._src.layer_store.source import LayerSource


def _held(where: str, doc: str) -> Any:
  """An attribute of the store one of its parts holds (`where`: ``"_part.name"``), as a property."""
  return property(operator.attrgetter(where), doc=doc)


class _Parts:
  """What a `LayerStore`'s parts hold, as its properties, read-only."""

  _commits: Commits
  _slots: Slots
  _reads: ReadAhead

  manifest: dict = _held("_commits.manifest", "The manifest as in memory (``layers.json``).")
  fsync: bool = _held("_commits.fsync", "Whether a commit flushes the step's files first.")
  generations: int = _held("_commits.generations", "Copies of params and state (``keep + 1``).")
  step: int = _held("_commits.step", "The committed step (0 after `create`).")
  generation: int = _held("_commits.generation", "The committed step's generation.")
  kept: list[tuple[int, int]] = _held("_commits.kept", "(step, gen)s kept, newest first.")
  n_layers: int = _held("_slots.n_layers", "The number of layers.")
  records: list[dict] = _held("_slots.records", "Per param leaf: path, shape, dtype, slot bytes.")
  grad_records: list[dict] = _held("_slots.grad_records", "The same per gradient leaf.")
  state_records: list[dict] = _held("_slots.state_records", "The same per optimizer state leaf.")
  layer_bytes: int = _held("_slots.layer_bytes", "One layer's param slots, in bytes.")
  pool_layers: int = _held("_reads.pool_layers", "The most layers the model's reads hold in RAM.")
  peak_held: int = _held("_reads.peak_held", "The most layers the reads held at once (tests).")
  layers_path: str | None = _held("_commits.layers_path", "The model list of the layers, or None.")
  bytes_read: int = _held("_slots.bytes_read", "Bytes read from the store's files since opened.")
  bytes_written: int = _held("_slots.bytes_written", "Bytes written to its files since opened.")


class _Reads(_Parts):
  """A `LayerStore`'s reads of what it holds: the committed params, state and rest, the
  gradients, one layer's params."""

  path: str
  treedef: Any
  state_treedef: Any
  update_mode: str
  _grads: Any

  def avals(self) -> list[jax.ShapeDtypeStruct]:
    """One layer's leaves, as shapes and dtypes."""
    return [jax.ShapeDtypeStruct(tuple(r["shape"]), np.dtype(r["dtype"])) for r in self.records]

  def read_layer(self, i: int) -> list[np.ndarray]:
    """Layer `i`'s committed params (leaves in tree order), read now."""
    return self._slots.read_slots("params", self.generation, i)

  def read_params(self) -> Any:
    """All the committed params, stacked (the model's size in RAM: for small models)."""
    return self._slots.stacked("params", self.generation, self.treedef)

  def read_grads(self) -> Any:
    """All the gradients, stacked as the params are (for small models)."""
    backward.refuse(self.update_mode, "read_grads()", self.path)
    self._grads.flush()  # the gradient writes queued
    return self._slots.stacked("grads", self.generation, self.treedef)

  def read_state(self) -> Any:
    """The committed optimizer state, each leaf stacked over the layers (for small models)."""
    if self.state_treedef is None:
      raise errors.InvalidOptionError(f"LayerStore: {self.path} is open without an optimizer.")
    return self._slots.stacked("state", self.generation, self.state_treedef)

  def read_rest(self, like: Any) -> Any:
    """What `update(rest=...)` committed with the current step, as numpy arrays.

    Args:
      like: a pytree of arrays or `jax.ShapeDtypeStruct`s with the rest's leaves (key paths,
        shapes and dtypes checked).

    Raises:
      StoreMismatchError: the step was committed without ``rest``, or its leaves differ.
      StoreCorruptedError: a leaf does not match its checksum.
    """
    records = self._commits.rest_records()
    return layer_rest.read(self.path, self.generation, self.step, records, like)


class LayerStore(_Reads):
  """A stacked layer pytree's params, gradients and optimizer state on disk.

  Make one with `LayerStore.create` or `LayerStore.open`; use it as a context manager or `close`
  it. Pass `source()` to `offlax.scan_layers` in place of the stacked layers, differentiate with
  respect to it (the backward pass writes the gradients into the store), then call `update()` to
  apply the optimizer to the layers on disk and commit the step.

  Attributes:
    path: the store's directory.
    n_layers: the number of layers.
    step: the committed step (0 after `create`).
    kept: the committed steps on disk, newest first.
    pool_layers: the most layers held in RAM by the model's reads.
    last_update: what the last `update` moved and took (a clip: its norm), or None.
    update_mode: where the optimizer runs, ``"explicit"`` or ``"backward"`` (`create`).
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

  def __init__(self, treedef: Any, optimizer: Any, state_treedef: Any, slots: Slots,
               commits: Commits, pool_layers: int, progress: bool,
               update: str = "explicit", update_bytes: int | None = None):  # fmt: skip
    self.path, self.treedef, self.optimizer = slots.path, treedef, optimizer
    self.state_treedef, self.progress, self.update_mode = state_treedef, progress, update
    self.last_update: layer_step.Stats | None = None
    self._slots, self._commits = slots, commits
    self._reads = ReadAhead(lambda i: self.read_layer(i), slots.n_layers, pool_layers)
    self._update, self._grads = backward.step_parts(
      update, optimizer, treedef, slots, commits, pool_layers, progress, self._reads, update_bytes
    )

  @classmethod
  def create(cls, path: str, layers: Any, *, optimizer: Any = None, keep: int = 1,
             init_layer: Callable[[int], Any] | None = None, pool_layers: int | None = 2,
             pool_bytes: int | None = None, fsync: bool = True, progress: bool = True,
             layers_path: str | None = None, update: str = "explicit",
             update_bytes: int | None = None,
             accumulator_dtype: Any = None) -> LayerStore:  # fmt: skip
    """Writes the stacked `layers` (and `optimizer.init` of each layer) into a new store.

    Args:
      path: a directory that does not exist or is empty.
      layers: a pytree of arrays, the layers stacked on each leaf's first axis;
        `jax.ShapeDtypeStruct` leaves make a sparse store of zeros, nothing
        written and no space reserved (to compile a model larger than the disk).
      optimizer: an elementwise optax `GradientTransformation` (Adam, AdamW, SGD,
        `offlax.master_weights` of them, ...) applied a layer at a time, or one after a leading
        ``optax.clip_by_global_norm(c)`` in an ``optax.chain`` (`clip`; one norm with the rest
        of the model: `offlax.clip_by_global_norm`); None: no optimizer.
      keep: committed steps kept on disk (>= 1); the store holds ``keep + 1``
        copies of the params and state.
      init_layer: with `layers` as `jax.ShapeDtypeStruct`s, a function of the layer index
        returning that layer's params (one layer's pytree): the store is written a layer at a
        time, never the whole model in RAM.
      pool_layers: layers the model's read-ahead pool may hold (>= 1; 2 reads one ahead).
      pool_bytes: instead of ``pool_layers``, the pool's size in bytes (at least one layer).
      fsync: flush the step's files before each commit (survives power loss).
      progress: show a progress bar while writing.
      layers_path: the model's list the layers are, as ``"encoder"`` names ``model.encoder``,
        recorded for `offload_params(model, store=)`; default: the list
        ``offlax.stack_layers(model, path)`` stacked.
      update: ``"explicit"``: `update()` runs the optimizer after the backward pass, from the
        gradients written to disk; ``"backward"``: each layer is updated as its gradient
        reaches the host, `update()` commits (`backward`; a clip: `speculate`). Not recorded.
      update_bytes: the most bytes the optimizer step holds in flight (its reads, updates and
        writes): a leaf too large for its share is read, updated and written a range of rows
        at a time (`ranges`), the same values to the bit. None: whole leaves (a few of the
        largest leaf's param, gradient and state slots in flight). Not recorded. With
        ``update="backward"`` the gradients handed off and the params kept are not counted.
      accumulator_dtype: the dtype the gradients are held and accumulated in on disk, as
        `optax.MultiSteps`' ``accumulator_dtype``: ``jnp.float32`` sums bf16 layers'
        micro-steps in float32 (2 bytes a param more each way), and the update casts them to
        the layers' dtype, as `optax.MultiSteps` does. None: the layers' own. Recorded.

    Returns:
      The open store, at step 0.

    Raises:
      StoreExistsError: `path` holds a layer store (`LayerStore.open` it).
      NotAStoreError: `path` holds other files.
      TransformationTypeError: the optimizer is wrapped by `offlax.offload`.
      InvalidOptionError: the pool cannot hold one layer, the optimizer couples elements of
        a leaf (a clip not first in a flat chain, LAMB), `update` is not a mode,
        `update_bytes` cannot hold a leaf's smallest range (the minimum named), or
        `accumulator_dtype` is not a float as wide as the layers'.
      StoreError: the disk has no room for the store.
    """
    return opening.create(cls, path, layers, optimizer=optimizer, keep=keep, init_layer=init_layer,
                          pool_layers=pool_layers, pool_bytes=pool_bytes, fsync=fsync,
                          progress=progress, layers_path=layers_path, update=update,
                          update_bytes=update_bytes,
                          accumulator_dtype=accumulator_dtype)  # fmt: skip

  @classmethod
  def open(cls, path: str, like: Any, *, optimizer: Any = None, step: int | None = None,
           pool_layers: int | None = 2, pool_bytes: int | None = None, fsync: bool = True,
           progress: bool = True, update: str = "explicit",
           update_bytes: int | None = None) -> LayerStore:  # fmt: skip
    """Opens the store at `path`, checked against `like` (and `optimizer`).

    Args:
      path: the store's directory.
      like: the stacked layer pytree the store must hold: arrays or
        `jax.ShapeDtypeStruct`s of the same structure, shapes and dtypes.
      optimizer: the optimizer the store was made with (its state must match),
        or None to read and train nothing but the params and gradients.
      step: the step the caller's other state is at (e.g. a checkpoint of the rest of the
        model): a kept step is made current again, dropping the steps after it; another raises
        `StoreMismatchError`. None: the committed step.
      pool_layers: as for `create`, and so are pool_bytes, fsync, progress, update and
        update_bytes.

    Raises:
      StoreError: no store at `path`.
      StoreCorruptedError: its manifest or files are damaged.
      StoreMismatchError: it holds another layer tree, another optimizer's state or no
        optimizer state, or not `step`; or the layers of another model list than `like` was
        stacked from (`stack_layers(model, path)`).
    """
    return opening.open_store(cls, path, like, optimizer=optimizer, step=step,
                              pool_layers=pool_layers, pool_bytes=pool_bytes, fsync=fsync,
                              progress=progress, update=update,
                              update_bytes=update_bytes)  # fmt: skip

  def close(self) -> None:
    """Waits for the gradient writes (and steps dispatched: backward), ends reads, closes."""
    self._grads.close()  # first: a step dispatched and not run yet still reads the layers
    self._reads.close()
    self._slots.close()

  def __enter__(self) -> LayerStore:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"LayerStore({self.path!r}, n_layers={self.n_layers}, step={self.step})"

  def source(self, *, accumulate: bool = False, last: bool = False) -> LayerSource:
    """What `scan_layers` takes in place of the stacked layers.

    Differentiate with respect to it (``jax.grad(loss)(source, ...)``) to write
    the layers' gradients into the store; its own gradient is a zero token.

    Args:
      accumulate: add each gradient into the store's (gradient accumulation; `zero_grads`
        starts afresh), instead of overwriting it.
      last: with ``accumulate``, the last micro-step: with ``update="backward"`` each layer is
        updated as its gradient's sum is known (`backward`); else the same as ``accumulate``.
    """
    kind = backward.hand_off(accumulate, last, self.path, self.update_mode, self._grads)
    return LayerSource(jnp.zeros((self.n_layers,), jnp.float32), self, kind)

  def zero_grads(self) -> None:
    """Sets every gradient to zero (before accumulating anew)."""
    self._grads.zero()

  def fetch(self, i: Any) -> list[np.ndarray]:
    """Layer `i` for the scan (a callback): from the pool, reading the next layers ahead.

    With ``update="backward"``, a step updated and not committed is committed first (warning).
    """
    if isinstance(self._grads, backward.BackwardStep):  # kept: the update's params
      return self._grads.read(i, self._reads.fetch)
    return self._reads.fetch(i)

  def put_grads(self, mode: micro.Micro, i: Any, *grads: np.ndarray) -> np.ndarray:
    """Layer `i`'s gradients (a callback): copied out, written behind compute. A model's
    source of a trainer that accumulates (`micro.plan_of`) hands off as its micro-step asks."""
    plan = micro.plan_of(self) if mode == micro.STEP else None
    if plan is not None:
      mode = plan.mode(int(i) == self.n_layers - 1)
    return self._grads.put(mode, i, *grads)

  def flush_grads(self) -> None:
    """Waits for the steps dispatched so far and their gradient writes; raises a failed write."""
    self._grads.flush()

  def update(self, *, rest: Any = None) -> int:
    """Applies the optimizer to the layers on disk with the stored gradients; commits.

    Waits for the gradient writes, then reads params, gradients and state a layer at a time,
    runs the optimizer on the host CPU, writes the new params and state into a free generation
    and commits them together (`step.LayerStep`). ``update="backward"``: waits for the
    backward pass's updates (`backward.BackwardStep`), commits.

    Args:
      rest: a pytree of arrays committed with the layers, of the same step: the rest of the
        model (embedding, head) and its optimizer state, as updated by this step. `read_rest`
        gives them back (after `open`, of the step opened).

    Returns:
      The new committed step.

    Raises:
      InvalidOptionError: the store is open without an optimizer.
      IncompleteStepError: ``update="backward"``, and no backward pass handed off every layer.
      StoreError: a read or write failed (a full disk: ``errno.ENOSPC``); nothing committed, the
        store holds the step before: call `update` again (a layer's update failed: run the step).
      StoreCorruptedError: a slot fails its checksum; nothing committed (named, the way back).
    """
    if self._update is None:
      raise errors.InvalidOptionError(
        f"LayerStore.update: {self.path} is open without an optimizer; pass optimizer= to "
        "LayerStore.create or LayerStore.open."
      )
    self.flush_grads()
    whole = whole_norm.part_of(self._update).whole  # (`whole_norm()`)
    if whole is not None:  # the step's programs ran: the rest's part came, or never will
      whole.end(self.step + 1)
    self.drop_read_ahead()  # they are of the generation this step replaces
    self.last_update = self._update(rest)
    self._grads.used()
    return self.step

  def whole_norm(self, max_norm: Any) -> whole_norm.WholeNorm:
    """The store's side of ``offlax.clip_by_global_norm(max_norm, store=self)``: one norm over
    the layers and the rest of the model (`whole_norm`), made once.

    Raises:
      InvalidOptionError: the optimizer has no leading global-norm clip, or another max_norm.
    """
    return whole_norm.attach(self, whole_norm.part_of(self._update), max_norm)

  def drop_read_ahead(self) -> None:
    """Forgets the layers read ahead and kept (before a commit replaces their generation)."""
    self._reads.drop()

  def rewrite(self) -> Rewrite:
    """New values of the committed step's layers, committed at once (`load_safetensors`)."""
    self.drop_read_ahead()  # first: an interrupted backward step's worker waited for
    return Rewrite(self._slots, self._commits, self.optimizer, self.treedef, self.drop_read_ahead)
