"""The optimizer step over a `LayerStore`'s layers: a leaf of a layer at a time, on the CPU.

As ZeRO-Infinity's CPU Adam: the params, their gradients and the optimizer
state never sit whole in RAM. For each leaf of each layer (a unit), read-ahead
threads bring its param, gradient and state slots from disk, the optimizer's
update runs on the CPU (jitted once per leaf: offlax's `adam`/`adamw` use
their native kernel there), and writer threads write the new param and state
into the free generation while the next unit computes.

Piece by piece is the optimizer applied to the stacked tree only where every
leaf's update is elementwise (Adam: yes; a global-norm clip, LAMB's per-leaf
trust ratio: no). `check_elementwise` checks that on the update's jaxpr
(`coupling.analyze`) rather than trusting a list of optimizers. The state is
each layer's ``init`` (`slots.write_initial`): each layer holds its own copy of
global leaves (the step count), all equal, since a global leaf never depends on
the params, and an 8-bit Adam's moments (``state_bits=8``) are quantized in
blocks of that layer's leaf: the store equals the optimizer run on each layer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import adam8, errors, quantized
from offlax._src import coupling as coupling_lib
from offlax._src import layout as layout_lib
from offlax._src import master as master_lib
from offlax._src.layer_store import clip as clip_lib
from offlax._src.layer_store import ranges as ranges_lib
from offlax._src.layer_store import rest as layer_rest

if TYPE_CHECKING:
  from offlax._src.layer_store.commits import Commits
  from offlax._src.layer_store.slots import Slots

AHEAD = 2  # units read ahead: with the writes queued, RAM holds about 4 leaves' streams
IO_THREADS = 4  # per direction: what a disk needs to reach its bandwidth with 8-64 MiB transfers
# A progress bar is for work long enough to watch: it shows once the work has run
# `array_files.BAR_DELAY_S`, and only where the work moves this many bytes or more: an update
# of a small store (a step of a training loop, its first one compiling) shows none.
BAR_MIN_BYTES = 1 << 30


def moved_bytes(store: Any) -> int:
  """The bytes an `update` of `store` (a `LayerStore` or its `Slots`) moves: params, gradients
  and state read, params and state written."""
  state = sum(r["slot"] for r in store.state_records)
  return store.n_layers * (3 * store.layer_bytes + 2 * state)


def progress(items: Any, show: bool, nbytes: int, desc: str) -> Any:
  """`items`, with a progress bar where the store `show`s them and the work is long (above)."""
  from offlax._src.nvme.store import progress_bar

  return progress_bar(items, show and nbytes >= BAR_MIN_BYTES, desc)


class Stats(NamedTuple):
  """What one `LayerStore.update` moved and how long it took.

  Attributes:
    step: the step it committed.
    seconds: its wall time, reads, compute, writes and flushes together.
    bytes_read: params, gradients and state read from disk (``update="backward"``: the state,
      an accumulation's sum and the params the model's reads did not keep; the gradients
      handed off and the params kept are not read).
    bytes_written: params and state written (with a clip, ``update="backward"``: the
      gradients kept for its redo too).
    read_seconds: time the read threads spent reading (summed over threads).
    write_seconds: time the writer spent writing.
    compute_seconds: time the optimizer's update ran.
    grad_norm: with a leading global-norm clip, the gradients' global norm as the clip saw
      it (`clip.global_norm`); else None.
    clipped: whether the clip scaled the gradients (``update="backward"``: the step was
      redone, `backward`).
    peak_bytes: the most bytes the step held in flight at once: its reads issued, the
      results and their copies until written (``update_bytes`` bounds it: `ranges`); the
      gradients and params handed in RAM by the backward pass are not counted (the hand-off's).
  """

  step: int
  seconds: float
  bytes_read: int
  bytes_written: int
  read_seconds: float
  write_seconds: float
  compute_seconds: float
  grad_norm: float | None = None
  clipped: bool = False
  peak_bytes: int = 0


def _one_layer(layers: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype), layers)


def one_layer_state(optimizer: Any, layers: Any) -> Any:
  """The optimizer's state of one layer, as shapes and dtypes (a leading clip's none)."""
  if not isinstance(optimizer, optax.GradientTransformation):
    raise errors.TransformationTypeError(
      f"LayerStore: optimizer must be an optax GradientTransformation, got "
      f"{type(optimizer).__name__}."
    )
  return jax.eval_shape(clip_lib.state_init(optimizer), _one_layer(layers))


def check_elementwise(optimizer: Any, stacked: Any) -> None:
  """Raises `InvalidOptionError` unless the update of each leaf is elementwise.

  A leading `optax.clip_by_global_norm` is taken apart (`clip.split`): the rest of the
  chain is checked. So is an 8-bit Adam's (``state_bits=8``) with its moments kept in float
  (`quantized.kept_in_float`): the quantization is the one part of its update that reads more
  than an element, a block of 256 of one layer's leaf (the store's state is each layer's own,
  `slots.write_initial`, so a block never spans two layers; `ranges` cuts at blocks).
  """
  optimizer = clip_lib.split(optimizer).tail
  with quantized.kept_in_float():  # 8-bit moments: the rest of the maths (their blocks: `ranges`)
    _check_elementwise(optimizer, stacked)


def _check_elementwise(optimizer: Any, stacked: Any) -> None:
  spec = layout_lib.ParamSpec.of(stacked)
  state = jax.eval_shape(optimizer.init, stacked)
  layout = layout_lib.StateLayout(state, spec)
  items = layout.split(state)

  def flat(u, s, p):
    new_u, new_s = optimizer.update(
      spec.treedef.unflatten(u), layout.merge(s), spec.treedef.unflatten(p)
    )
    return jax.tree.leaves(new_u), layout.split(new_s)

  leaves = jax.tree.leaves(stacked)
  n = len(leaves)
  in_owners = [*range(n), *layout.owners, *range(n)]
  out_owners = [*range(n), *layout.owners]
  # As traced for a GPU program, where offlax's native kernels are elementwise by contract.
  with coupling_lib.splitting_native(True):
    jaxpr = jax.make_jaxpr(flat)(leaves, items, leaves)
    shapes = [tuple(x.shape) for x in leaves]
    coupling = coupling_lib.analyze(jaxpr, in_owners, out_owners, shapes)
  coupled = [p for i, p in enumerate(spec.paths) if i not in coupling.splittable]
  if coupled:
    why = coupling.reason or "it reads more than each element's own values"
    raise clip_lib.not_recognised(coupled[0], why)


class LeafUpdate(NamedTuple):
  """The optimizer's update of one leaf of one layer (`layer_update`).

  Attributes:
    fn: jitted (param, grad, owned state, global state) -> (param, owned, global).
    owned: indices of the state leaves that belong to this leaf.
    shared: indices of the state leaves that belong to no leaf (the count).
    clipped: with a leading global-norm clip, the same with the gradient clipped first
      (param, grad, owned, global, norm), for the steps where the clip applies; else None.
    scales: which of `owned` are an 8-bit moment's block scales (`adam8.block_scales`): cut
      by blocks, not rows (`ranges.blocks`).
    reads_param: whether the update reads the param's values. Not where the new param is
      the optimizer's new master rounded (`master.rounds_to_master`, a floating leaf): the
      step gives it zeros and reads no param slot, 2 bytes a bf16 param fewer.
  """

  fn: Any
  owned: list[int]
  shared: list[int]
  clipped: Any = None
  scales: tuple[int, ...] = ()
  reads_param: bool = True


def layer_update(optimizer: Any, treedef: Any, records: list[dict]) -> list[LeafUpdate]:
  """The optimizer's update of each leaf of a layer, the other leaves masked.

  A leaf at a time rather than a layer: RAM then holds a few leaves' params,
  gradients and state in flight, not a few layers' (a 70B model's layer is 14
  GB of them). The other leaves are `optax.MaskedNode`s, as in the NVMe tier's
  slices, so masks and per-path options see the layer's whole tree. The
  caller has checked the update with `check_elementwise`. A leading global-norm clip
  (`clip.split`) gives each leaf a second function, the gradient scaled as optax does
  first: a step the clip leaves alone runs the very function a chain without it would.
  """
  optimizer, max_norm = clip_lib.split(optimizer)
  one = jax.tree.unflatten(
    treedef, [jax.ShapeDtypeStruct(tuple(r["shape"]), np.dtype(r["dtype"])) for r in records]
  )
  spec = layout_lib.ParamSpec.of(one)
  state = jax.eval_shape(optimizer.init, one)
  layout = layout_lib.StateLayout(state, spec)
  owners = layout.owners  # in the state's leaf order, as the store's state records
  shared = [j for j, o in enumerate(owners) if o == coupling_lib.GLOBAL]
  is_scales = adam8.block_scales(state)
  rounds = master_lib.rounds_to_master(optimizer)

  def make(k: int) -> LeafUpdate:
    owned = [j for j, o in enumerate(owners) if o == k]
    masked = lambda x: spec.treedef.unflatten(
      [x if i == k else layout_lib.MASKED() for i in range(len(records))]
    )

    def update(p, g, s_owned, s_shared):
      items: list[Any] = [layout_lib.MASK] * len(owners)
      for j, x in zip([*owned, *shared], [*s_owned, *s_shared], strict=True):
        items[j] = x
      updates, state = optimizer.update(masked(g), layout.merge(items), masked(p))
      [u] = jax.tree.leaves(updates)
      new = layout.split(state)
      return optax.apply_updates(p, u), [new[j] for j in owned], [new[j] for j in shared]

    def clipped(p, g, s_owned, s_shared, norm):
      return update(p, clip_lib.scale_gradient(g, norm, max_norm), s_owned, s_shared)

    clip = None if max_norm is None else jax.jit(clipped)
    scales = tuple(j for j in owned if is_scales[j])
    reads = not (rounds and jnp.issubdtype(np.dtype(records[k]["dtype"]), jnp.floating))
    return LeafUpdate(jax.jit(update), owned, shared, clip, scales, reads)

  return [make(k) for k in range(len(records))]


def run(
  slots: Slots,
  updates: list[LeafUpdate],
  gen: int,
  target: int,
  *,
  step: int,
  show: bool,
  layers: Sequence[int] | None = None,
  handed: Callable[[int, int], tuple[np.ndarray, np.ndarray]] | None = None,
  where: list[tuple[int, int]] | None = None,
  norm: np.ndarray | None = None,
  abort: Callable[[], None] | None = None,
  budget: int | None = None,
  flight: ranges_lib.Flight | None = None,
) -> Stats:
  """Updates every layer of a store's `slots` from generation `gen` into `target`, as `step`.

  The unit is one leaf of one layer (or, with a `budget`, a range of its rows: `ranges`):
  its param, gradient and state slots are read (`AHEAD` units ahead) by `IO_THREADS`
  threads, as one reader reaches only part of an NVMe's bandwidth; its update
  runs on the CPU; its new param and state are written by as many threads, at
  most two units queued while the next computes. A layer's shared state (the
  step count) is read with its first leaf and written with it.

  `layers` is the order (default 0, 1, ...); `handed(i, k)`, where given, is leaf `k` of
  layer `i`'s gradient and param, waited for, in place of the store's gradient and param
  slots (the update in the backward pass, `backward.BackwardStep`: the gradient handed off,
  the param as the backward pass read it; the same units, the same update function).
  Where it fails, the unit (layer, leaf) whose read, update or write failed is appended to
  `where`, where given. `norm`, where given, is the gradients' global norm, and the clip
  applies: each unit runs its ``clipped`` function (`LeafUpdate`). `abort`, where given, is
  called before each unit and raises to stop the run (a step dropped: the redo of a clip).
  `budget`, where given, bounds the bytes the step holds in flight (`ranges.plan`);
  `flight` counts them (a new one where not given), their peak in `Stats.peak_bytes`.
  """
  cpu = jax.devices("cpu")[0]  # the host's compute, whatever the default device
  nk = len(slots.records)
  order = list(range(slots.n_layers) if layers is None else layers)
  # As for reading the param and gradient even where handed (`handed`): their share leaves
  # room for the sum on disk an accumulation's last micro-step reads (`backward`).
  rows = plan(slots, updates, budget)
  cuts = [ranges_lib.of(slots.records[k], rows[k]) for k in range(nk)]

  def cut(kind, k, j, r):  # range `r` of leaf `k` as rows of its slot `j` of `kind`
    scales = kind == "state" and j in updates[k].scales
    return ranges_lib.blocks(slots.records[k], r) if scales and r is not None else r

  units = [(i, k, r) for i in order for k in range(nk) for r in cuts[k]]
  ahead = AHEAD
  lock = threading.Lock()
  tally: collections.defaultdict[str, float] = collections.defaultdict(float)
  flight = ranges_lib.Flight() if flight is None else flight
  crcs = ranges_lib.Crcs(slots)

  def timed(what, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    with lock:
      tally[what + "_seconds"] += time.perf_counter() - start
    return out

  def read(pool, u):
    i, k, r = units[u]

    def slot(kind, g, j):
      record = slots.records_of(kind)[j]
      if r is None:
        flight.add(ranges_lib.nbytes(record))  # (the bytes `read_slot` gives)
        return pool.submit(timed, "read", slots.read_slot, kind, g, j, i)
      start, nbytes = ranges_lib.span(record, cut(kind, k, j, r))
      flight.add(nbytes)
      return pool.submit(timed, "read", slots.read_range, kind, g, j, i, start, nbytes)

    first = r is None or r.start == 0
    shared = updates[k].shared if k == 0 and first else []

    def whole(kind, g, j):
      flight.add(ranges_lib.nbytes(slots.state_records[j]))
      return pool.submit(timed, "read", slots.read_slot, kind, g, j, i)

    return [
      [slot("params", gen, k)] if handed is None and updates[k].reads_param else [],
      [slot("grads", 0, k)] if handed is None else [],
      [slot("state", gen, j) for j in updates[k].owned], [whole("state", gen, j) for j in shared],
    ]  # fmt: skip

  def checked(i, k, r, ps, gs, owned):
    """A range's buffers: the crc32c streamed (the slot's checked after its last), as rows."""
    out = []
    mine = [k] if handed is None else []  # (handed: the param and gradient are not read)
    for kind, g, js, xs in (
      ("params", gen, mine if updates[k].reads_param else [], ps),
      ("grads", 0, mine, gs),
      ("state", gen, updates[k].owned, owned),
    ):
      for j, x in zip(js, xs, strict=True):
        crcs.read(kind, g, j, i, cut(kind, k, j, r), x)
        out.append(ranges_lib.view(slots.records_of(kind)[j], x, cut(kind, k, j, r)))
    n = len(ps)
    return out[:n], out[n : n + len(gs)], out[n + len(gs) :]

  def write(pool, i, k, r, p, owned, shared):
    state = zip(updates[k].owned, owned, strict=True)
    out = [("params", k, p), *(("state", j, x) for j, x in state)]
    shared_out = []
    if k == 0 and (r is None or r.start == 0):
      shared_out = [("state", j, x) for j, x in zip(updates[k].shared, shared, strict=True)]
    futures = []
    for kind, j, x in out:
      if r is None:
        futures.append(pool.submit(timed, "write", slots.write_slot, kind, target, j, i, x))
        continue
      record, rj = slots.records_of(kind)[j], cut(kind, k, j, r)
      buffer = ranges_lib.to_buffer(record, x, rj, kind, i)  # (its crc streamed here, in order)
      crcs.written(kind, target, j, i, rj, buffer)
      start = ranges_lib.span(record, rj)[0]
      futures.append(pool.submit(timed, "write", slots.write_range, kind, target, j, i, start,
                                 buffer))  # fmt: skip
    futures += [pool.submit(timed, "write", slots.write_slot, kind, target, j, i, x)
                for kind, j, x in shared_out]  # fmt: skip
    return futures

  start = time.perf_counter()
  with (
    concurrent.futures.ThreadPoolExecutor(IO_THREADS, "offlax-update-read") as readers,
    concurrent.futures.ThreadPoolExecutor(IO_THREADS, "offlax-update-write") as writers,
  ):
    reads = {u: read(readers, u) for u in range(min(ahead, len(units)))}
    writes: collections.deque[tuple[tuple[int, int], list[concurrent.futures.Future], int]]
    writes = collections.deque()
    shared: list[Any] = []
    at = units[0][:2] if units else (0, 0)  # the unit waited for: where a failure is
    leaf: tuple[np.ndarray, np.ndarray] | None = None  # handed: the unit's whole leaves
    try:
      desc = f"offlax: updating {slots.path}"
      u = 0
      for i in progress(order, show, moved_bytes(slots), desc):
        for k in range(nk):
          for r in cuts[k]:
            at = (i, k)
            if abort is not None:
              abort()
            ps, gs, owned, got = [[f.result() for f in futures] for futures in reads.pop(u)]
            held = sum(x.nbytes for x in [*ps, *gs, *owned, *got])
            tally["read_bytes"] += held
            if r is not None:
              ps, gs, owned = checked(i, k, r, ps, gs, owned)
            shared = got if k == 0 and (r is None or r.start == 0) else shared
            if handed is None:  # (a param not read: the update overwrites it, `reads_param`)
              # in the layers' dtype, from an ``accumulator_dtype``'s: as optax.MultiSteps
              g = gs[0].astype(np.dtype(slots.records[k]["dtype"]), copy=False)
              p = ps[0] if ps else np.zeros(g.shape, g.dtype)
            else:
              if r is None or r.start == 0:
                leaf = handed(i, k)
              assert leaf is not None
              g, p = leaf if r is None else (x[r.start : r.stop] for x in leaf)
            if u + ahead < len(units):
              reads[u + ahead] = read(readers, u + ahead)
            t = time.perf_counter()
            with jax.default_device(cpu):
              if norm is None:
                new_p, new_owned, new_shared = updates[k].fn(p, g, owned, shared)
              else:
                new_p, new_owned, new_shared = updates[k].clipped(p, g, owned, shared, norm)
              new_p, new_owned = np.asarray(new_p), [np.asarray(x) for x in new_owned]
              first = r is None or r.start == 0
              new_shared = [np.asarray(x) for x in new_shared] if k == 0 and first else []
            tally["compute_seconds"] += time.perf_counter() - t
            out = 2 * sum(x.nbytes for x in [new_p, *new_owned, *new_shared])
            flight.add(out)  # the results and their aligned copies, until written
            del ps, gs, owned, g, p
            flight.sub(held)
            if r is None or r.last:
              leaf = None
            while len(writes) >= 2:  # one unit written, one queued, while the next computes
              at, done, n = writes.popleft()
              [f.result() for f in done]
              flight.sub(n)
            futures = write(writers, i, k, r, new_p, new_owned, new_shared)
            writes.append(((i, k), futures, out))
            tally["write_bytes"] += out // 2
            del new_p, new_owned
            u += 1
      while writes:
        at, done, n = writes.popleft()
        [f.result() for f in done]
        flight.sub(n)
    except BaseException:
      if where is not None:
        where.append(at)
      for f in [f for unit in reads.values() for fs in unit for f in fs]:
        f.cancel()
      for f in [f for _, fs, _ in writes for f in fs]:
        f.cancel()
      raise
  return Stats(
    step=step,
    seconds=time.perf_counter() - start,
    bytes_read=int(tally["read_bytes"]),
    bytes_written=int(tally["write_bytes"]),
    read_seconds=tally["read_seconds"],
    write_seconds=tally["write_seconds"],
    compute_seconds=tally["compute_seconds"],
    peak_bytes=flight.peak,
  )


def plan(slots: Slots, updates: list[LeafUpdate], budget: int | None) -> list[int | None]:
  """`ranges.plan` for the leaves' `updates`: per leaf its ranges' rows, or None (whole)."""
  shared = updates[0].shared if updates else []
  owned, scales = [u.owned for u in updates], [u.scales for u in updates]
  return ranges_lib.plan(slots, owned, shared, budget, scales)


def check_budget(slots: Slots, updates: list[LeafUpdate], budget: Any) -> int | None:
  """`budget` (``update_bytes``) if the step can run within it, else `InvalidOptionError`."""
  if budget is None:
    return None
  if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget <= 0:
    raise errors.InvalidOptionError(
      f"LayerStore: update_bytes={budget!r}; pass a number of bytes > 0 (the most the "
      "optimizer step holds in flight), or None to update whole leaves."
    )
  if updates:  # (without an optimizer the store runs no step)
    plan(slots, updates, int(budget))
  return int(budget)


class LayerStep:
  """`LayerStore.update`'s step: the optimizer over the slots into a free generation, committed.

  Args:
    optimizer: the elementwise optax transformation (`check_elementwise`), a leading
      global-norm clip allowed (`clip.split`).
    treedef: one layer's tree structure.
    slots: the store's open files.
    commits: the store's manifest and committed step.
    progress: show a progress bar for a long update.
    squares: with a clip, the gradient slots' sums of squares
      (`grads.GradientWriter.squares`).
    budget: the most bytes the step holds in flight (`ranges`), or None (whole leaves).
  """

  def __init__(self, optimizer: Any, treedef: Any, slots: Slots, commits: Commits,
               progress: bool, squares: Callable[[], np.ndarray] | None = None,
               budget: int | None = None):  # fmt: skip
    self._slots, self._commits, self._progress = slots, commits, progress
    self._updates = layer_update(optimizer, treedef, slots.records)
    self._max_norm, self._squares = clip_lib.split(optimizer).max_norm, squares
    self._budget = check_budget(slots, self._updates, budget)
    self.whole: Any = None  # a clip by the whole model's norm (`whole_norm.attach`)

  def layer_squares(self) -> np.ndarray:
    """The gradient slots' sums of squares, their writes waited for (`whole_norm`)."""
    assert self._squares is not None  # (given with a clip, which `whole_norm` checks)
    return self._squares()

  def __call__(self, rest: Any) -> Stats:
    """Writes the next step (and `rest`) into a free generation, flushes it and commits it.

    Raises:
      StoreError: a read or write failed; nothing was committed.
    """
    commits = self._commits
    target = commits.free_generation()
    # the whole model's norm (its rest's part came in the step), or IncompleteStepError
    whole = None if self.whole is None else self.whole.take(commits.step + 1)
    try:
      rest_records = (
        None if rest is None else layer_rest.write(commits.path, target, rest, fsync=commits.fsync)
      )
      norm = whole
      if norm is None and self._max_norm is not None and self._squares is not None:
        norm = clip_lib.global_norm(self._squares(), self._slots.records, self._max_norm)
      stats = run(self._slots, self._updates, commits.generation, target,
                  step=commits.step + 1, show=self._progress, budget=self._budget,
                  norm=norm.norm if norm is not None and norm.applies else None)  # fmt: skip
      if norm is not None:
        stats = stats._replace(grad_norm=float(norm.norm), clipped=norm.applies)
      if commits.fsync:
        self._slots.sync(target)
    except OSError as e:
      raise errors.StoreError(
        e.errno,
        f"LayerStore.update: step {commits.step + 1} was not committed ({e.strerror or e}); "
        f"{commits.path} still holds step {commits.step}, whole, and its gradients: "
        + ("free space on the disk, then " if e.errno == errno.ENOSPC else "")
        + "call update() again.",
      ) from e
    commits.commit(target, rest_records)
    if self.whole is not None:
      self.whole.clear()
    return stats
