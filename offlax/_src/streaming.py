"""The streamed update: the inner update run slice by slice, each slice's state moved in and out.

`offload`'s `update` hands this module the flat update, the state items and the
schedule (`schedule.build`). Every leaf cut into pieces is written back piece by
piece with `dynamic_update_slice` into one buffer (its gradient's for the
updates, the tier's array for the state), never rejoined with `concatenate`:
on the GPU a concatenate of host arrays is compute on host memory, which XLA
converts into slow host compute, and on the device it is a second copy of the
leaf. Runs of equal pieces of one leaf become one `fori_loop` whose carries are
those buffers: XLA's GPU compiler updates them in place and keeps about four
pieces on the device, where unrolled slices of one leaf were all fetched at
the start of the program whatever their dependencies said. A tier that writes its own
state runs such a loop itself where it can (`TierIO.loop`: the NVMe tier's callbacks).

With ``on_host`` (``HostTier(compute="host")``) each slice's update runs on the
host CPU instead (``compute_on("device_host")``): the gradient piece goes to
the host, the update piece comes back, and the offloaded state goes into the
host computation whole, is sliced there, and its new pieces are written back
in place (XLA:GPU returns a host call's results through device memory: one
piece each).

Params and gradients may live in host memory too (`offlax.scan_layers`): their
pieces are fetched to the device for a streamed slice, and results are written
back to the memory their buffer lives in. With ``apply``
(`offlax.update_and_apply`) each slice adds its updates to its params piece
and writes the new params over the old (in place): no model-sized updates
buffer exists, and `master_weights`' fp32 updates never leave the slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from offlax._src import coupling as coupling_lib
from offlax._src import host_params, memory
from offlax._src import layout as layout_lib
from offlax._src import schedule as schedule_lib
from offlax._src.compat import compute_on
from offlax._src.schedule import Piece

# The inner update of one slice: (u_slots, inner state, p_slots or None, apply)
# -> (flat new updates, or with `apply` the flat new params; new inner state).
Update = Callable[[list[Any], Any, Any, bool], tuple[list[Any], Any]]


@dataclasses.dataclass(frozen=True)
class _Run:
  """`count` pieces of leaf `piece.leaf`, each `piece`'s size, starting at `piece.start`."""

  k: int  # the first slice
  piece: Piece
  count: int


def runs(slices: Sequence[tuple[Piece, ...]]) -> list[_Run | int]:
  """The slices in order; each run of >= 2 equal consecutive pieces of one leaf is a `_Run`."""
  out: list[_Run | int] = []
  k = 0
  while k < len(slices):
    n = 1
    if len(slices[k]) == 1 and slices[k][0].start is not None:
      p = slices[k][0]
      while k + n < len(slices) and len(slices[k + n]) == 1 and _follows(p, slices[k + n][0], n):
        n += 1
    out.append(_Run(k, slices[k][0], n) if n >= 2 else k)
    k += n
  return out


def _follows(p: Piece, q: Piece, n: int) -> bool:
  """Whether `q` is the piece `n` after `p`, of its size, in the same leaf."""
  shift = n * p.rows
  assert p.start is not None and p.stop is not None
  return (q.leaf, q.flat, q.axis, q.start, q.stop) == (
    p.leaf, p.flat, p.axis, p.start + shift, p.stop + shift
  )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  """What one streamed update is: fixed while its slices are traced.

  Attributes:
    update: the inner update of a slice (see `Update`).
    layout: the state's `StateLayout`.
    io: the tier's `TierIO`: its capabilities choose the strategy
      (``writes_in_place``: the stream slices and writes the items; else the
      tier's `load`/`store`; `prefetch_depth`: what a read waits for).
    on_host: run each slice's update on the host CPU (state stays in place).
    apply: return the new params (each slice's updates added to its params
      piece, written over the params) instead of the updates.
    p_slots: the flat params (`optax.MaskedNode` where masked), or None.
    by_leaf: per param leaf (`coupling.GLOBAL` for none), its state items.
    out_host: per leaf, whether its result buffer lives in host memory.
  """

  update: Update
  layout: Any
  io: Any
  on_host: bool
  apply: bool
  p_slots: list[Any] | None
  by_leaf: dict[int, list[int]]
  out_host: list[bool]

  @property
  def globals(self) -> list[int]:
    """The items no param owns (a step count): every slice reads and writes them."""
    return self.by_leaf.get(coupling_lib.GLOBAL, [])


@dataclasses.dataclass
class Buffers:
  """What the slices write, slice after slice: the current buffer of each result.

  Attributes:
    grads: the gradients, as given.
    out: per leaf, where its result goes: the params' buffer with `apply`,
      else the gradients' (overwritten in place) until an update of another
      dtype needs its own.
    over_grads: per leaf, whether `out` is the gradients' buffer.
    items: the current buffer of each state item.
    globals_in: the global items, on the device.
    new_globals: the new global items (every slice computes the same), once known.
    parts: pieces to join by `concatenate` at the end: ``("u", leaf)`` or
      ``("item", j)`` keys (a dtype that changes, or a tier without in-place writes).
    taken: items the tier has taken (`TierIO.store` returned None).
  """

  grads: list[Any]
  out: list[Any]
  over_grads: list[bool]
  items: list[Any]
  globals_in: list[Any] = dataclasses.field(default_factory=list)
  new_globals: list[Any] | None = None
  parts: dict[Any, list[Any]] = dataclasses.field(default_factory=dict)
  taken: set[int] = dataclasses.field(default_factory=set)

  def grads_of(self, leaf: int) -> Any:
    """The buffer holding `leaf`'s gradients (pieces not yet updated where overwritten)."""
    return self.out[leaf] if self.over_grads[leaf] else self.grads[leaf]


def run(
  update: Update, u_slots, p_slots, layout, items, io, slices, *, on_host=False, apply=False
) -> tuple[list[Any], list[Any]]:
  """The streamed update of `slices`: the new update (or param) slots and state items.

  Args:
    update: the inner update of a slice (see `Update`).
    u_slots, p_slots: the flat updates and params (`optax.MaskedNode` where masked).
    layout: the state's `StateLayout`; `items` its split state.
    io: the tier's `TierIO`, opened for this step.
    slices: the schedule (`schedule.build`): per slice, its pieces.
    on_host: run each slice's update on the host CPU (state stays in place).
    apply: return the new params instead of the updates.
  """
  out = list(p_slots) if apply else list(u_slots)
  by_leaf: dict[int, list[int]] = {}
  for j, o in enumerate(layout.owners):
    by_leaf.setdefault(o, []).append(j)
  plan = StreamSpec(
    update, layout, io, on_host, apply, p_slots, by_leaf,
    [not layout_lib.is_masked(x) and memory.on_host(x) for x in out],
  )  # fmt: skip
  b = Buffers(list(u_slots), out, [not apply] * len(u_slots), list(items))
  keys = [[(j, p) for p in pieces for j in by_leaf.get(p.leaf, [])] for pieces in slices]
  io.plan(keys)
  b.globals_in = [io.to_device(j, b.items[j]) for j in plan.globals]
  done: list[Any] = []  # per slice, what a later slice's read waits for
  for part in runs(slices):
    if isinstance(part, _Run):
      u_dtype = _loopable(plan, b, part)
      if u_dtype is not None:
        done += [_loop(plan, b, part, done[-1] if done else None, u_dtype)] * part.count
        continue
      ks: Sequence[int] = range(part.k, part.k + part.count)
    else:
      ks = (part,)
    for k in ks:
      # Slice k's read waits for slice k - prefetch_depth (`TierIO`).
      lag = io.prefetch_depth
      after = done[k - lag] if k >= lag else None
      done.append(_slice(plan, b, k, slices[k], keys[k], after))
  return _joined(plan, b, slices, [_shape(x) for x in u_slots], [_shape(x) for x in items])


# -- the slice's arithmetic ------------------------------------------------------


def _compute(plan: StreamSpec, pieces, keys, u_in, p_in, state_in, globals_in):
  """The inner update of one slice (on the device, or inside a host computation)."""
  n_items, n_slots = len(plan.layout.owners), len(plan.out_host)
  slice_items: list[Any] = [layout_lib.MASK] * n_items
  for j, x in zip(plan.globals, globals_in, strict=True):
    slice_items[j] = x
  for (j, _), x in zip(keys, state_in, strict=True):
    slice_items[j] = x
  u_slots: list[Any] = [layout_lib.MASKED()] * n_slots
  p_slots: list[Any] | None = None if plan.p_slots is None else list(u_slots)
  for n, p in enumerate(pieces):
    u_slots[p.leaf] = u_in[n]
    if p_slots is not None:
      p_slots[p.leaf] = p_in[n]
  out, out_state = plan.update(u_slots, plan.layout.merge(slice_items), p_slots, plan.apply)
  out_items = plan.layout.split(out_state)
  new = [out[p.leaf] for p in pieces]
  return (
    new,
    [out_items[j] for j, _ in keys],
    [out_items[j] for j in plan.globals],
  )


# -- buffers ---------------------------------------------------------------------


def _view(x, p: Piece):
  return x.reshape(-1) if p.flat and x.ndim != 1 else x


def _take(x, p: Piece, start):
  x = _view(x, p)
  if p.start is None:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, p.rows, p.axis)


def _put(
  plan: StreamSpec, b: Buffers, buffers: list[Any], key: Any, i: int, value, p: Piece, start
):
  """Writes piece `p` of buffer `i` (its new `value`), in place where dtypes allow."""
  if p.start is None:
    buffers[i] = value
    return
  old = _view(buffers[i], p)
  if key in b.parts or (value.dtype != old.dtype and key[0] == "item"):
    b.parts.setdefault(key, []).append(value)  # joined by `concatenate` at the end
    return
  if value.dtype != old.dtype:  # updates of another dtype than the gradients: a new buffer
    old = host_params.zeros_like(old, value.dtype, host=plan.out_host[i])
    b.over_grads[i] = False
  buffers[i] = jax.lax.dynamic_update_slice_in_dim(old, value, start, p.axis)


def _p_piece(plan: StreamSpec, b: Buffers, p: Piece, start):
  if plan.p_slots is None:
    return None
  # With `apply`, from the buffer being written: each piece is read before it
  # is written, and the old params are not kept alive beside the new.
  return _take((b.out if plan.apply else plan.p_slots)[p.leaf], p, start)


def _where(plan: StreamSpec, leaf: int, x):
  """A result piece `x` of `leaf`, moved to the memory its buffer lives in."""
  return memory.to_host(x) if plan.out_host[leaf] else x


# -- one slice -------------------------------------------------------------------


def _slice(plan: StreamSpec, b: Buffers, k: int, pieces, keys, after) -> Any:
  """Slice `k`; returns what a later slice's read waits for (see `run`)."""
  u_in = [_take(b.grads_of(p.leaf), p, p.start) for p in pieces]
  p_in = [_p_piece(plan, b, p, p.start) for p in pieces]
  if plan.on_host:
    new_u, new_state, new_g, stored = _slice_on_host(plan, b, pieces, keys, u_in, p_in, after)
  else:
    new_u, new_state, new_g, stored = _slice_streamed(plan, b, k, pieces, keys, u_in, p_in, after)
  for p, x in zip(pieces, new_u, strict=True):
    if plan.io.writes_in_place or plan.apply or plan.out_host[p.leaf]:
      _put(plan, b, b.out, ("u", p.leaf), p.leaf, x, p, p.start)
    elif p.start is None:
      b.out[p.leaf] = x
    else:
      # A tier that writes its own state (the NVMe tier): pieces (and loops'
      # stacks) joined by a `concatenate` XLA fuses into `apply_updates` (in the
      # gradients' buffer they would be a second copy in RAM). Into params, or
      # gradients in host memory (no concatenate on host), it is in place.
      b.parts.setdefault(("u", p.leaf), []).append(x)
  if b.new_globals is None:
    b.new_globals = new_g
  if not plan.io.writes_in_place:  # the tier's reads run ahead (`prefetch_depth`)
    return (new_u, new_state)
  # What the next slice's read waits for: this one's state written back.
  # Waiting for less (its computation, or the slice before) lets XLA's GPU
  # scheduler hold many slices' state on the device, however the waits are
  # chained.
  if plan.on_host:
    # Host compute: its updates on the device; with params in host memory, the
    # host arrays its results were written into. XLA:GPU returns a host call's
    # results through device memory, and left unordered it writes them back at
    # the end of the step, holding every slice's on the device.
    device = [x for x in new_u if not memory.on_host(x)]
    return device or [b.items[j] for j, _ in keys] + [b.out[p.leaf] for p in pieces]
  return stored


def _slice_streamed(plan: StreamSpec, b: Buffers, k: int, pieces, keys, u_in, p_in, after):
  """Slice `k` on the device: its state read not before `after` exists, and written back."""
  io = plan.io
  if io.writes_in_place:
    # The wait is on the whole arrays, so that no piece is taken before it.
    sources = [b.items[j] for j, _ in keys]
    if after is not None:
      _, sources = jax.lax.optimization_barrier((after, sources))
    state_in = [
      io.to_device(j, _take(x, p, p.start)) for (j, p), x in zip(keys, sources, strict=True)
    ]
  else:
    state_in = io.load(k, after)
  new_u, new_state, new_g = _compute(
    plan, pieces, keys, host_params.fetch(u_in), host_params.fetch(p_in), state_in, b.globals_in
  )
  new_u = [_where(plan, p.leaf, x) for p, x in zip(pieces, new_u, strict=True)]
  if io.writes_in_place:
    stored = [io.to_tier(j, x) for (j, _), x in zip(keys, new_state, strict=True)]
  else:
    stored = io.store(k, new_state)
  for (j, p), x in zip(keys, stored, strict=True):
    if x is None:  # taken by the tier
      b.taken.add(j)
    else:
      _put(plan, b, b.items, ("item", j), j, x, p, p.start)
  return new_u, new_state, new_g, stored


def _slice_on_host(plan: StreamSpec, b: Buffers, pieces, keys, u_in, p_in, after):
  """A slice on the host CPU: the state does not move; its new pieces are written in place.

  Its gradient and param pieces go to the host not before `after` exists, and
  it returns device values (its updates): XLA groups independent host work of
  one computation into one host call, whose inputs, every such slice's
  pieces, would all be copied to the host at once (docs/gpu_memory.md).
  """
  if after is not None:  # ordered through a device value: see above
    _, (u_in, p_in) = jax.lax.optimization_barrier((after, (u_in, p_in)))
  starts = [p.start for _, p in keys]
  new_u, new_g, stored = _host_slice(plan, b, pieces, keys, u_in, p_in, starts)
  for (j, p), x in zip(keys, stored, strict=True):
    _put(plan, b, b.items, ("item", j), j, x, p, p.start)
  return new_u, None, new_g, stored


def _host_slice(plan: StreamSpec, b: Buffers, pieces, keys, u_in, p_in, starts, sources=None):
  """One slice's update on the host CPU: new update pieces, globals and state pieces.

  Offloaded state goes into the host computation whole (`sources`, or the current buffers)
  and is sliced there: a piece sliced outside it is copied to the device, where XLA:GPU's
  host call reads its operands from: one piece more of device memory, and the piece twice
  more over the bus. The new pieces come back for the caller to write into the host arrays
  (in place); pieces of items kept on the device go to the host and come back.
  """
  io = plan.io
  sources = [b.items[j] for j, _ in keys] if sources is None else sources
  host = [bool(io.offloaded[j]) for j, _ in keys]
  state_in = [
    x if h else io.to_host(_take(x, p, s))
    for x, (_, p), h, s in zip(sources, keys, host, starts, strict=True)
  ]
  # A loop's starts are traced and go in as arguments; the others stay Python
  # ints (a flat leaf's may pass int32).
  traced = {i: io.to_host(s) for i, s in enumerate(starts) if isinstance(s, jax.Array)}
  # Pieces already in host memory (params and gradients there) are passed as they are.
  to_host = lambda xs: [x if x is None or memory.on_host(x) else io.to_host(x) for x in xs]

  def host_update(flat_u, p_in, state_in, traced, globals_in):
    args = jax.tree.map(memory.as_device_value, (flat_u, p_in, state_in, traced, globals_in))
    flat_u, p_in, state_in, traced, globals_in = args
    u = [x.reshape(piece.shape) for x, piece in zip(flat_u, u_in, strict=True)]
    state_in = [
      _take(x, p, traced.get(i, starts[i])) if h else x
      for i, (x, (_, p), h) in enumerate(zip(state_in, keys, host, strict=True))
    ]
    return _compute(plan, pieces, keys, u, p_in, state_in, globals_in)

  call = compute_on(
    host_update, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host
  )
  flat = [memory.flat(x) for x in to_host(u_in)]  # reshaped inside
  new_u, new_state, new_g = call(flat, to_host(p_in), state_in, traced, to_host(b.globals_in))
  new_state = [x if h else memory.to_device(x) for x, h in zip(new_state, host, strict=True)]
  new_u = [
    x if plan.out_host[p.leaf] else memory.to_device(x) for p, x in zip(pieces, new_u, strict=True)
  ]
  new_g = [
    x if io.offloaded[j] else memory.to_device(x) for j, x in zip(plan.globals, new_g, strict=True)
  ]
  return new_u, new_g, new_state


# -- a run of equal pieces: one loop -----------------------------------------------


def _loop(plan: StreamSpec, b: Buffers, run: _Run, after, u_dtype) -> Any:
  """The pieces of `run` in one `fori_loop` whose carries are the leaf's buffers.

  The updates are written over the gradients where they have their dtype;
  otherwise (`master_weights`: fp32 updates of bf16 params) into a new array.
  With `apply` the new params are written over the params. A tier that writes
  its own state runs the loop (`TierIO.loop`): the state is not a carry.
  """
  p0, size, leaf = run.piece, run.piece.rows, run.piece.leaf
  if not (plan.io.writes_in_place or plan.apply or plan.out_host[leaf]):
    return _stacked_loop(plan, b, run, u_dtype)
  js = plan.by_leaf.get(leaf, [])
  keys = [(j, p0) for j in js]
  grads = _view(b.grads_of(leaf), p0)
  in_place = b.over_grads[leaf] and grads.dtype == u_dtype  # the gradients are the carry
  if in_place or not b.over_grads[leaf]:  # (the params with `apply`)
    out = _view(b.out[leaf], p0)
  else:
    out = host_params.zeros_like(grads, u_dtype, host=plan.out_host[leaf])
    b.over_grads[leaf] = False

  def inputs(u_buf, i):
    start = p0.start + i * size
    u_in = [jax.lax.dynamic_slice_in_dim(u_buf if in_place else grads, start, size, p0.axis)]
    if plan.apply:
      return start, u_in, [jax.lax.dynamic_slice_in_dim(u_buf, start, size, p0.axis)]
    return start, u_in, [_p_piece(plan, b, p0, start)]

  if not plan.io.writes_in_place:

    def update(i, state_in, carry):
      u_buf, _ = carry
      start, u_in, p_in = inputs(u_buf, i)
      new_u, new_state, new_g = _compute(
        plan, (p0,), keys, host_params.fetch(u_in), host_params.fetch(p_in), state_in, b.globals_in
      )
      new_u = _where(plan, leaf, new_u[0])
      return new_state, (jax.lax.dynamic_update_slice_in_dim(u_buf, new_u, start, p0.axis), new_g)

    u_buf, new_g = plan.io.loop(run.k, run.count, update, (out, list(b.globals_in)))
    b.taken.update(js)
    bufs = [u_buf]  # what a later slice waits for
  else:
    bufs = [_view(b.items[j], p0) for j in js]
    if after is not None:  # the state's fetch is what needs ordering
      _, bufs = jax.lax.optimization_barrier((after, bufs))
    piece = _piece_on_host if plan.on_host else _piece_streamed

    def body(i, carry):
      (u_buf, bufs), _ = carry
      start, u_in, p_in = inputs(u_buf, i)
      new_u, bufs, new_g = piece(plan, b, p0, keys, u_in, p_in, start, bufs)
      u_buf = jax.lax.dynamic_update_slice_in_dim(u_buf, new_u[0], start, p0.axis)
      return (u_buf, bufs), new_g

    # Every piece computes the same new globals (a step count): the carry keeps one.
    init = ((out, bufs), list(b.globals_in))
    (u_buf, bufs), new_g = jax.lax.fori_loop(0, run.count, body, init)
    for j, x in zip(js, bufs, strict=True):
      b.items[j] = x
  b.out[leaf] = u_buf
  if b.new_globals is None:
    b.new_globals = new_g
  return bufs


def _stacked_loop(plan: StreamSpec, b: Buffers, run: _Run, u_dtype) -> Any:
  """The pieces of `run` in the tier's loop (`TierIO.loop`), their updates stacked.

  The stack joins the leaf's other pieces by `concatenate`, as unrolled slices'
  do (`_slice`): unlike the gradients as a carry, it is dropped where unused,
  and never a copy of the step's arguments.
  """
  p0, size, leaf = run.piece, run.piece.rows, run.piece.leaf
  keys = [(j, p0) for j in plan.by_leaf.get(leaf, [])]
  grads = _view(b.grads_of(leaf), p0)

  def update(i, state_in, carry):
    stack, start = carry[0], p0.start + i * size
    u_in = host_params.fetch([jax.lax.dynamic_slice_in_dim(grads, start, size, p0.axis)])
    p_in = host_params.fetch([_p_piece(plan, b, p0, start)])
    new_u, new_state, new_g = _compute(plan, (p0,), keys, u_in, p_in, state_in, b.globals_in)
    return new_state, (jax.lax.dynamic_update_index_in_dim(stack, new_u[0], i, 0), new_g)

  shape = list(jax.eval_shape(lambda x: _take(x, p0, p0.start), grads).shape)
  stack = jnp.zeros((run.count, *shape), u_dtype)
  stack, new_g = plan.io.loop(run.k, run.count, update, (stack, list(b.globals_in)))
  b.taken.update(j for j, _ in keys)
  shape[p0.axis] *= run.count  # the pieces one after another along the cut axis
  b.parts.setdefault(("u", leaf), []).append(jnp.moveaxis(stack, 0, p0.axis).reshape(shape))
  if b.new_globals is None:
    b.new_globals = new_g
  return stack


def _piece_on_host(plan: StreamSpec, b: Buffers, p0: Piece, keys, u_in, p_in, start, bufs):
  """One piece of a loop on the host CPU: its state sliced and written back in host memory."""
  new_u, new_g, new_state = _host_slice(plan, b, (p0,), keys, u_in, p_in, [start] * len(keys), bufs)
  bufs = [
    jax.lax.dynamic_update_slice_in_dim(x, s, start, p0.axis)
    for x, s in zip(bufs, new_state, strict=True)
  ]
  return new_u, bufs, new_g


def _piece_streamed(plan: StreamSpec, b: Buffers, p0: Piece, keys, u_in, p_in, start, bufs):
  """One piece of a loop on the device: its state moved in and out through the tier's I/O."""
  io = plan.io
  state_in = [jax.lax.dynamic_slice_in_dim(x, start, p0.rows, p0.axis) for x in bufs]
  state_in = [io.to_device(j, x) for (j, _), x in zip(keys, state_in, strict=True)]
  new_u, new_state, new_g = _compute(
    plan, (p0,), keys, host_params.fetch(u_in), host_params.fetch(p_in), state_in, b.globals_in
  )
  new_u = [_where(plan, p0.leaf, new_u[0])]
  bufs = [
    jax.lax.dynamic_update_slice_in_dim(x, io.to_tier(j, s), start, p0.axis)
    for (j, _), x, s in zip(keys, bufs, new_state, strict=True)
  ]
  return new_u, bufs, new_g


def _loopable(plan: StreamSpec, b: Buffers, run: _Run) -> Any:
  """The dtype of the run's update pieces if its state pieces keep their dtypes, else None.

  A loop carries the state buffers, so their dtypes must not change. A tier
  that does not write in place loops where it has a `loop` that takes the run
  (`can_loop`; the NVMe tier's items on disk); else its slices unroll.
  """
  if not plan.io.writes_in_place:
    can_loop = getattr(plan.io, "can_loop", None)
    if plan.on_host or can_loop is None or not can_loop(run.k, run.count):
      return None
  p0 = run.piece
  js = plan.by_leaf.get(p0.leaf, [])
  keys = [(j, p0) for j in js]
  # Plain shapes: `_compute` sees its inputs on the device (moved there, or relabelled inside a
  # host computation), while JAX >= 0.11 keeps a host array's memory space in `eval_shape`.
  chunk = lambda x: _plain(jax.eval_shape(lambda y: _take(y, p0, p0.start), x))
  u_in = [chunk(b.grads_of(p0.leaf))]
  p_in = [None if plan.p_slots is None else chunk(plan.p_slots[p0.leaf])]
  # (an item only its tier can read, `OnDisk`: its shape and dtype)
  item = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, layout_lib.OnDisk) else x
  state_in = [chunk(item(b.items[j])) for j in js]
  g_in = [jax.ShapeDtypeStruct(jnp.shape(x), layout_lib.dtype_of(x)) for x in b.globals_in]
  out = jax.eval_shape(lambda *a: _compute(plan, (p0,), keys, *a), u_in, p_in, state_in, g_in)
  same = lambda a, b: [(x.shape, x.dtype) for x in a] == [(x.shape, x.dtype) for x in b]
  if not (same(out[1], state_in) and same(out[2], g_in)) or out[0][0].shape != u_in[0].shape:
    return None
  return out[0][0].dtype


# -- the end of the update ---------------------------------------------------------


def _joined(plan: StreamSpec, b: Buffers, slices, shapes_u, shapes_items):
  """The final update leaves and state items, in their own shapes."""
  pieces_of: dict[int, list[Piece]] = {}
  for pieces in slices:
    for p in pieces:
      pieces_of.setdefault(p.leaf, []).append(p)
  u = list(b.out)
  for leaf, shape in enumerate(shapes_u):
    if ("u", leaf) in b.parts:
      u[leaf] = schedule_lib.join(pieces_of[leaf], b.parts[("u", leaf)], shape)
    elif shape is not None and leaf in pieces_of:
      u[leaf] = u[leaf].reshape(shape)
  items = list(b.items)
  io, globals_ = plan.io, plan.globals
  for j, o in enumerate(plan.layout.owners):
    if o == coupling_lib.GLOBAL:
      new = b.new_globals[globals_.index(j)] if b.new_globals is not None else items[j]
      items[j] = io.to_tier(j, new) if not plan.on_host else new
    elif j in b.taken:
      items[j] = None
    elif ("item", j) in b.parts:
      # Pieces whose dtype changed (an update that casts its state): joined on
      # the device, as XLA:GPU would turn a join on host memory into host compute.
      parts = [io.to_device(j, x) for x in b.parts[("item", j)]]
      items[j] = io.to_tier(j, schedule_lib.join(pieces_of[o], parts, shapes_items[j]))
    elif o in pieces_of:
      items[j] = items[j].reshape(shapes_items[j])
  if not plan.apply:
    # A leaf written piece by piece is whole before it leaves: XLA's GPU compiler
    # otherwise fuses its last `dynamic_update_slice` into the caller's
    # `apply_updates`, whose output is then a new leaf-sized buffer, not the
    # params updated in place.
    for leaf, pieces in pieces_of.items():
      if ("u", leaf) not in b.parts and any(p.start is not None for p in pieces):
        u[leaf] = jax.lax.optimization_barrier(u[leaf])
  return u, items


def _shape(x: Any) -> Any:
  return None if layout_lib.is_masked(x) else layout_lib.shape_of(x)


def _plain(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """`x`'s shape and dtype, in the default (device) memory."""
  return jax.ShapeDtypeStruct(x.shape, x.dtype)
