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
the start of the program whatever their dependencies said.

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
from offlax._src import host_params
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


class Stream:
  """One streamed update; `run` returns the new updates and state items.

  Args:
    update: the inner update of a slice (see `Update`).
    u_slots, p_slots: the flat updates and params (`optax.MaskedNode` where masked).
    layout: the state's `StateLayout`; `items` its split state.
    io: moves state between the tier and the device (`to_device`, `to_tier`;
      a tier whose state needs its own reads, the NVMe tier, has `load`/`store`
      and `loops = False`).
    on_host: run each slice's update on the host CPU (state stays in place).
    apply: return the new params (each slice's updates added to its params
      piece, written over the params) instead of the updates.
  """

  def __init__(
    self, update: Update, u_slots, p_slots, layout, items, io, on_host=False, apply=False
  ):
    self.update, self.layout, self.io, self.on_host = update, layout, io, on_host
    self.p_slots, self.apply = p_slots, apply
    self.u = list(u_slots)  # the gradients
    # Where results go: the params' buffers with `apply`, else the gradients'
    # (overwritten in place) until an update of another dtype needs its own.
    self.out = list(p_slots) if apply else list(u_slots)
    self.over_grads = [not apply] * len(self.u)
    self.out_host = [not layout_lib.is_masked(x) and host_params.on_host(x) for x in self.out]
    self.items = list(items)  # the current buffer of each state item
    self.shapes_u = [
      layout_lib.shape_of(x) if not layout_lib.is_masked(x) else None for x in u_slots
    ]
    self.shapes_items = [layout_lib.shape_of(x) for x in items]
    self.by_leaf: dict[int, list[int]] = {}
    for j, o in enumerate(layout.owners):
      self.by_leaf.setdefault(o, []).append(j)
    self.globals = self.by_leaf.get(coupling_lib.GLOBAL, [])
    self.new_globals: list[Any] | None = None
    self.parts: dict[Any, list[Any]] = {}  # leaves whose pieces change dtype: joined at the end
    self.stored_none: set[int] = set()

  # -- the slice's arithmetic ------------------------------------------------

  def compute(self, pieces, keys, u_in, p_in, state_in, globals_in):
    """The inner update of one slice (on the device, or inside a host computation)."""
    slice_items: list[Any] = [layout_lib.MASK] * len(self.items)
    for j, x in zip(self.globals, globals_in, strict=True):
      slice_items[j] = x
    for (j, _), x in zip(keys, state_in, strict=True):
      slice_items[j] = x
    u_slots: list[Any] = [layout_lib.MASKED()] * len(self.u)
    p_slots: list[Any] | None = None if self.p_slots is None else list(u_slots)
    for n, p in enumerate(pieces):
      u_slots[p.leaf] = u_in[n]
      if p_slots is not None:
        p_slots[p.leaf] = p_in[n]
    out, out_state = self.update(u_slots, self.layout.merge(slice_items), p_slots, self.apply)
    out_items = self.layout.split(out_state)
    new = [out[p.leaf] for p in pieces]
    return (
      new,
      [out_items[j] for j, _ in keys],
      [out_items[j] for j in self.globals],
    )

  # -- buffers ------------------------------------------------------------------

  def _view(self, x, p: Piece):
    return x.reshape(-1) if p.flat and x.ndim != 1 else x

  def _take(self, x, p: Piece, start):
    x = self._view(x, p)
    if p.start is None:
      return x
    return jax.lax.dynamic_slice_in_dim(x, start, p.rows, p.axis)

  def _put(self, buffers: list[Any], key: Any, i: int, value, p: Piece, start) -> None:
    """Writes piece `p` of buffer `i` (its new `value`), in place where dtypes allow."""
    if p.start is None:
      buffers[i] = value
      return
    old = self._view(buffers[i], p)
    if key in self.parts or (value.dtype != old.dtype and key[0] == "item"):
      self.parts.setdefault(key, []).append(value)  # joined by `concatenate` at the end
      return
    if value.dtype != old.dtype:  # updates of another dtype than the gradients: a new buffer
      old = host_params.zeros_like(old, value.dtype, host=self.out_host[i])
      self.over_grads[i] = False
    buffers[i] = jax.lax.dynamic_update_slice_in_dim(old, value, start, p.axis)

  def _grads(self, leaf: int):
    """The buffer holding `leaf`'s gradients (pieces not yet updated where overwritten)."""
    return self.out[leaf] if self.over_grads[leaf] else self.u[leaf]

  def _p_piece(self, p: Piece, start):
    if self.p_slots is None:
      return None
    # With `apply`, from the buffer being written: each piece is read before it
    # is written, and the old params are not kept alive beside the new.
    return self._take((self.out if self.apply else self.p_slots)[p.leaf], p, start)

  def _where(self, leaf: int, x):
    """A result piece `x` of `leaf`, moved to the memory its buffer lives in."""
    return jax.device_put(x, jax.memory.Space.Host) if self.out_host[leaf] else x

  # -- one slice, one run -------------------------------------------------------

  def slice(self, k: int, pieces, keys, after) -> Any:
    """Slice `k`; returns what the next slice's fetch waits for (see `run`).

    Its state is fetched not before `after` exists (streamed). Host compute
    does not move the state, but its gradient and param pieces go to the host
    not before `after` exists, and it returns device values (its updates):
    XLA groups independent host work of one computation into one host call,
    whose inputs, every such slice's pieces, were all copied to the host at
    once (3.9 GB of host temporaries for a 7B model; one slice since).
    """
    io = self.io
    u_in = [self._take(self._grads(p.leaf), p, p.start) for p in pieces]
    p_in = [self._p_piece(p, p.start) for p in pieces]
    starts = [p.start for _, p in keys]
    if self.on_host:
      if after is not None:  # ordered through a device value: see above
        _, (u_in, p_in) = jax.lax.optimization_barrier((after, (u_in, p_in)))
      new_u, new_g, stored = self._host_slice(pieces, keys, u_in, p_in, starts)
      for (j, p), x in zip(keys, stored, strict=True):
        self._put(self.items, ("item", j), j, x, p, p.start)
    else:
      if io.loops:
        # The wait is on the whole arrays, so that no piece is taken before it.
        sources = [self.items[j] for j, _ in keys]
        if after is not None:
          _, sources = jax.lax.optimization_barrier((after, sources))
        state_in = [
          io.to_device(j, self._take(x, p, p.start))
          for (j, p), x in zip(keys, sources, strict=True)
        ]
      else:
        state_in = io.load(k, after)
      new_u, new_state, new_g = self.compute(
        pieces, keys, host_params.fetch(u_in), host_params.fetch(p_in), state_in,
        self.device_globals,
      )  # fmt: skip
      new_u = [self._where(p.leaf, x) for p, x in zip(pieces, new_u, strict=True)]
      if io.loops:
        stored = [io.to_tier(j, x) for (j, _), x in zip(keys, new_state, strict=True)]
      else:
        stored = io.store(k, new_state)
      for (j, p), x in zip(keys, stored, strict=True):
        if x is None:  # written to disk by the tier
          self.stored_none.add(j)
        else:
          self._put(self.items, ("item", j), j, x, p, p.start)
    for p, x in zip(pieces, new_u, strict=True):
      if io.loops or self.apply or self.out_host[p.leaf]:
        self._put(self.out, ("u", p.leaf), p.leaf, x, p, p.start)
      elif p.start is None:
        self.out[p.leaf] = x
      else:
        # The NVMe tier's slices are not looped: joined by a `concatenate` that
        # XLA fuses into `apply_updates` (written into the gradients' buffer,
        # the updates would be a second copy of them in RAM). Into params, or
        # into gradients in host memory (no concatenate on host), it is in place.
        self.parts.setdefault(("u", p.leaf), []).append(x)
    if self.new_globals is None:
      self.new_globals = new_g
    if not io.loops:  # the NVMe tier's reads run ahead in its own threads: see `run`
      return (new_u, new_state)
    # What the next slice's fetch waits for: this one's state written back.
    # Waiting for less (its computation, or the slice before) lets XLA's GPU
    # scheduler hold many slices' state on the device (measured: 0.2-0.6 B/param
    # more at 1B), however the waits are chained.
    if self.on_host:
      # Host compute: its updates on the device; with params in host memory, the
      # host arrays its results were written into. XLA:GPU returns a host call's
      # results through device memory, and left unordered it wrote them back at
      # the end of the step (13B, 1024 tokens: 2.55 GB of device peak -> 1.17).
      device = [x for x in new_u if not host_params.on_host(x)]
      return device or [self.items[j] for j, _ in keys] + [self.out[p.leaf] for p in pieces]
    return stored

  def _host_slice(self, pieces, keys, u_in, p_in, starts, sources=None):
    """One slice's update on the host CPU: new update pieces, globals and state pieces.

    Offloaded state goes into the host computation whole (`sources`, or the
    current buffers) and is sliced there: a piece sliced outside it is copied
    to the device, where XLA:GPU's host call reads its operands from (measured:
    one piece more of device memory, and the piece twice more over the bus).
    The new pieces come back for the caller to write into the host arrays (in
    place); pieces of items kept on the device go to the host and come back.
    """
    io = self.io
    sources = [self.items[j] for j, _ in keys] if sources is None else sources
    host = [bool(io.offloaded[j]) for j, _ in keys]
    state_in = [
      b if h else io.to_host(self._take(b, p, s))
      for b, (_, p), h, s in zip(sources, keys, host, starts, strict=True)
    ]
    # A loop's starts are traced and go in as arguments; the others stay Python
    # ints (a flat leaf's may pass int32).
    traced = {i: io.to_host(s) for i, s in enumerate(starts) if isinstance(s, jax.Array)}
    # Pieces already in host memory (params and gradients there) are passed as they are.
    to_host = lambda xs: [
      x if x is None or host_params.on_host(x) else io.to_host(x) for x in xs
    ]  # fmt: skip

    def on_host(u_in, p_in, state_in, traced, globals_in):
      args = jax.tree.map(host_params.as_device_value, (u_in, p_in, state_in, traced, globals_in))
      u_in, p_in, state_in, traced, globals_in = args
      state_in = [
        self._take(x, p, traced.get(i, starts[i])) if h else x
        for i, (x, (_, p), h) in enumerate(zip(state_in, keys, host, strict=True))
      ]
      return self.compute(pieces, keys, u_in, p_in, state_in, globals_in)

    run = compute_on(on_host, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    new_u, new_state, new_g = run(
      to_host(u_in), to_host(p_in), state_in, traced, to_host(self.device_globals)
    )
    new_state = [x if h else _to_device(x) for x, h in zip(new_state, host, strict=True)]
    new_u = [
      x if self.out_host[p.leaf] else _to_device(x) for p, x in zip(pieces, new_u, strict=True)
    ]
    new_g = [
      x if io.offloaded[j] else _to_device(x) for j, x in zip(self.globals, new_g, strict=True)
    ]
    return new_u, new_g, new_state

  def loop(self, run: _Run, after, u_dtype) -> Any:
    """The pieces of `run` in one `fori_loop` whose carries are the leaf's buffers.

    The updates are written over the gradients where they have their dtype;
    otherwise (`master_weights`: fp32 updates of bf16 params) into a new array.
    With `apply` the new params are written over the params.
    """
    p0, size, leaf = run.piece, run.piece.rows, run.piece.leaf
    js = self.by_leaf.get(leaf, [])
    keys = [(j, p0) for j in js]
    grads = self._view(self._grads(leaf), p0)
    in_place = self.over_grads[leaf] and grads.dtype == u_dtype  # the gradients are the carry
    if in_place or not self.over_grads[leaf]:  # (the params with `apply`)
      out = self._view(self.out[leaf], p0)
    else:
      out = host_params.zeros_like(grads, u_dtype, host=self.out_host[leaf])
      self.over_grads[leaf] = False
    bufs = [self._view(self.items[j], p0) for j in js]
    if after is not None:  # the state's fetch is what needs ordering
      _, bufs = jax.lax.optimization_barrier((after, bufs))
    init = (out, bufs)

    def body(i, carry):
      (u_buf, bufs), _ = carry
      start = p0.start + i * size
      u_in = [jax.lax.dynamic_slice_in_dim(u_buf if in_place else grads, start, size, p0.axis)]
      if self.apply:
        p_in = [jax.lax.dynamic_slice_in_dim(u_buf, start, size, p0.axis)]
      else:
        p_in = [self._p_piece(p0, start)]
      if self.on_host:
        new_u, new_g, new_state = self._host_slice((p0,), keys, u_in, p_in, [start] * len(js), bufs)
        bufs = [
          jax.lax.dynamic_update_slice_in_dim(b, x, start, p0.axis)
          for b, x in zip(bufs, new_state, strict=True)
        ]
      else:
        state_in = [jax.lax.dynamic_slice_in_dim(b, start, size, p0.axis) for b in bufs]
        state_in = [self.io.to_device(j, x) for j, x in zip(js, state_in, strict=True)]
        new_u, new_state, new_g = self.compute(
          (p0,), keys, host_params.fetch(u_in), host_params.fetch(p_in), state_in,
          self.device_globals,
        )  # fmt: skip
        new_u = [self._where(leaf, new_u[0])]
        bufs = [
          jax.lax.dynamic_update_slice_in_dim(b, self.io.to_tier(j, x), start, p0.axis)
          for j, b, x in zip(js, bufs, new_state, strict=True)
        ]
      u_buf = jax.lax.dynamic_update_slice_in_dim(u_buf, new_u[0], start, p0.axis)
      return (u_buf, bufs), new_g

    # Every piece computes the same new globals (a step count): the carry keeps one.
    (u_buf, bufs), new_g = jax.lax.fori_loop(0, run.count, body, (init, list(self.device_globals)))
    self.out[leaf] = u_buf
    for j, b in zip(js, bufs, strict=True):
      self.items[j] = b
    if self.new_globals is None:
      self.new_globals = new_g
    return bufs

  def loopable(self, run: _Run) -> Any:
    """The dtype of the run's update pieces if its state pieces keep their dtypes, else None.

    A loop carries the state buffers, so their dtypes must not change.
    """
    if not self.io.loops:
      return None
    p0 = run.piece
    js = self.by_leaf.get(p0.leaf, [])
    keys = [(j, p0) for j in js]
    # Plain shapes: `compute` sees its inputs on the device (moved there, or relabelled inside a
    # host computation), while JAX >= 0.11 keeps a host array's memory space in `eval_shape`.
    chunk = lambda x: _plain(jax.eval_shape(lambda y: self._take(y, p0, p0.start), x))
    u_in = [chunk(self._grads(p0.leaf))]
    p_in = [None if self.p_slots is None else chunk(self.p_slots[p0.leaf])]
    state_in = [chunk(self.items[j]) for j in js]
    g_in = [jax.ShapeDtypeStruct(jnp.shape(x), layout_lib.dtype_of(x)) for x in self.device_globals]
    out = jax.eval_shape(lambda *a: self.compute((p0,), keys, *a), u_in, p_in, state_in, g_in)
    same = lambda a, b: [(x.shape, x.dtype) for x in a] == [(x.shape, x.dtype) for x in b]
    if not (same(out[1], state_in) and same(out[2], g_in)) or out[0][0].shape != u_in[0].shape:
      return None
    return out[0][0].dtype

  # -- the whole update ---------------------------------------------------------

  def run(self, slices: Sequence[tuple[Piece, ...]]) -> tuple[list[Any], list[Any]]:
    keys = [[(j, p) for p in pieces for j in self.by_leaf.get(p.leaf, [])] for pieces in slices]
    self.io.plan(keys)
    self.device_globals = [self.io.to_device(j, self.items[j]) for j in self.globals]
    done: list[Any] = []  # per slice, what the next one waits for
    for part in runs(slices):
      if isinstance(part, _Run):
        u_dtype = self.loopable(part)
        if u_dtype is not None:
          done += [self.loop(part, done[-1] if done else None, u_dtype)] * part.count
          continue
        ks: Sequence[int] = range(part.k, part.k + part.count)
      else:
        ks = (part,)
      for k in ks:
        # The NVMe tier's slice k waits for slice k - 2 computed, as its reads
        # are planned (`DiskIO`); the host tier's for slice k - 1 written back.
        lag = 1 if self.io.loops else 2
        after = done[k - lag] if k >= lag else None
        done.append(self.slice(k, slices[k], keys[k], after))
    return self._joined(slices)

  def _joined(self, slices):
    """The final update leaves and state items, in their own shapes."""
    pieces_of: dict[int, list[Piece]] = {}
    for pieces in slices:
      for p in pieces:
        pieces_of.setdefault(p.leaf, []).append(p)
    u = list(self.out)
    for leaf, shape in enumerate(self.shapes_u):
      if ("u", leaf) in self.parts:
        u[leaf] = schedule_lib.join(pieces_of[leaf], self.parts[("u", leaf)], shape)
      elif shape is not None and leaf in pieces_of:
        u[leaf] = u[leaf].reshape(shape)
    items = list(self.items)
    for j, o in enumerate(self.layout.owners):
      if o == coupling_lib.GLOBAL:
        new = self.new_globals[self.globals.index(j)] if self.new_globals is not None else items[j]
        items[j] = self.io.to_tier(j, new) if not self.on_host else new
      elif j in self.stored_none:
        items[j] = None
      elif ("item", j) in self.parts:
        # Pieces whose dtype changed (an update that casts its state): joined on
        # the device, as XLA:GPU would turn a join on host memory into host compute.
        parts = [self.io.to_device(j, x) for x in self.parts[("item", j)]]
        items[j] = self.io.to_tier(j, schedule_lib.join(pieces_of[o], parts, self.shapes_items[j]))
      elif o in pieces_of:
        items[j] = items[j].reshape(self.shapes_items[j])
    if not self.apply:
      # A leaf written piece by piece is whole before it leaves: XLA's GPU compiler
      # otherwise fuses its last `dynamic_update_slice` into the caller's
      # `apply_updates`, whose output is then a new leaf-sized buffer (7B: one
      # more slice at 16 layers, 6 at 2), not the params updated in place.
      for leaf, pieces in pieces_of.items():
        if ("u", leaf) not in self.parts and any(p.start is not None for p in pieces):
          u[leaf] = jax.lax.optimization_barrier(u[leaf])
    return u, items


def _to_device(x):
  return jax.device_put(x, jax.memory.Space.Device)


def _plain(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """`x`'s shape and dtype, in the default (device) memory."""
  return jax.ShapeDtypeStruct(x.shape, x.dtype)
