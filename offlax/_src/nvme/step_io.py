"""The NVMe tier's `TierIO` (`DiskIO`): a step's slices via `io_callback`s and native copies."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from offlax._src import errors, ffi, host_callbacks
from offlax._src import layout as layout_lib
from offlax._src.host_tier import HostIO
from offlax._src.nvme.format import is_key, key_data, key_impl
from offlax._src.nvme.pipeline import ByShard, Reader


class DiskIO:
  """Moves slices between the NVMe tier and the device inside the jitted step.

  Cached items move like the host tier's. Items on disk are read by one
  `io_callback` per slice, which returns slice k (prefetched by the previous
  call) and starts reading the next ones; new values go back by a callback that
  writes them and returns a ticket; a run of equal pieces of one leaf on disk is one
  `fori_loop` (`loop`) holding one of each, the slice a traced operand (unrolled, XLA's
  compile time grew with the slices: docs/nvme_tier.md). The callbacks are unordered
  (JAX 0.10 cannot lower ordered callbacks beside host-memory outputs), so
  data dependencies order them: the read of slice k takes the ticket of slice
  k-2, and the last callback, which writes the cached items and commits, takes
  every ticket.

  On XLA:CPU (with offlax's native library) the values do not cross the
  callbacks: the read callback returns where slice k lies (its buffer's
  address and size), `offlax_from_slice` copies it into XLA's arrays, and
  `offlax_to_slice` copies the new values back into the same buffer before the
  write callback (`submit`) hands it to the I/O threads (`native/slices.cc`).

  On a mesh the step runs per device inside `jax.shard_map`, `items` are one
  device's shards and `shard` is the device's mesh position (traced): every
  callback gets it first, and `ByShard` hands it to that shard's store.
  """

  # Its reads are planned per slice (`plan`), in the schedule's order, and run
  # ahead in the store's threads: slice k's read waits for slice k-2 (`load`).
  prefetch_depth = 2
  writes_in_place = False

  def __init__(self, tier: Any, items, offloaded, step, shard=None):
    self.tier, self.items, self.offloaded, self.step = tier, items, offloaded, step
    self.shard = () if shard is None else (shard,)
    self.host = HostIO(tier.host, items, offloaded)  # the moves of cached items

  def plan(self, keys):
    self.keys = keys
    self.tickets: list[tuple[int, Any]] = []  # (slice, write callback's result)
    self.copied: dict[int, Any] = {}  # slice -> (where, ticket) of its native read
    self.host.plan(keys)
    self.cold = [
      [n for n, (j, _) in enumerate(ks) if isinstance(self.items[j], layout_lib.OnDisk)]
      for ks in keys
    ]
    reads = []
    for ks, cold in zip(keys, self.cold, strict=True):
      reads.append(
        [(self.items[ks[n][0]].index, *_flat_range(self.items[ks[n][0]], ks[n][1])) for n in cold]
      )
    if self.shard:
      readers = {
        i: Reader(t.store, reads, self.tier.readahead) for i, t in self.tier.shards.items()
      }
      self.reader: Any = ByShard(readers)
    else:
      self.reader = Reader(self.tier.store, reads, self.tier.readahead)

  def to_host(self, x):
    return self.host.to_host(x)

  def to_device(self, j, x):
    return self.host.to_device(j, x)

  def to_tier(self, j, x):
    return self.host.to_tier(j, x)

  def load(self, k, after):
    hot = [n for n in range(len(self.keys[k])) if n not in self.cold[k]]
    out: list[Any] = [None] * len(self.keys[k])
    if hot:
      loaded = self.host.fetch([self.keys[k][n] for n in hot], after)
      for n, x in zip(hot, loaded, strict=True):
        out[n] = x
    if self.cold[k]:
      avals = [
        jax.ShapeDtypeStruct(shape, self.items[self.keys[k][n][0]].dtype)
        for n, (_, _, _, shape) in zip(self.cold[k], self.reader.reads[k], strict=True)
      ]
      # Reading slice k waits for slice k-2's write callback: XLA would otherwise
      # be free to run every read first and hold the whole state in memory.
      values, self.copied[k] = _read_slice(self, k, avals, self.ticket_before(k))
      for n, x in zip(self.cold[k], values, strict=True):
        out[n] = x
    return out

  def store(self, k, values):
    out = [
      None if n in self.cold[k] else self.host.to_tier(j, values[n])
      for n, (j, _) in enumerate(self.keys[k])
    ]
    if self.cold[k]:
      cold = [_same_dtype(self.tier, self.keys[k][n][0], values[n]) for n in self.cold[k]]
      self.tickets.append((k, _write_slice(self, k, cold, self.copied[k])))
    return out

  def can_loop(self, k: int, count: int) -> bool:  # (`_can_loop`)
    return _can_loop(self, k, count)

  def loop(self, k: int, count: int, update, carry):  # (`_loop`)
    return _loop(self, k, count, update, carry)

  def ticket_before(self, k: int):
    """What slice k's read waits for: the ticket of slice k-2's write, or the step."""
    earlier = [t for i, t in self.tickets if i <= k - 2]
    return earlier[-1] if earlier else self.step

  def finish(self, items):
    items = [self.items[j] if x is None else x for j, x in enumerate(items)]
    hot = [j for j, x in enumerate(items) if not isinstance(x, layout_lib.OnDisk)]
    for j in hot:
      _same_dtype(self.tier, j, items[j])
    # The write tickets make the commit wait for every write callback.
    commit = functools.partial(self.reader.commit, hot, len(self.tickets))
    tickets = [t for _, t in self.tickets]
    values = [key_data(items[j]) for j in hot]  # (a callback takes no PRNG key)
    _io_callback(commit, None, *self.shard, self.step, *tickets, *values)
    return items

  def next_step(self):
    return self.step + 1


def _can_loop(io: DiskIO, k: int, count: int) -> bool:
  """Whether slices k .. k+count-1 (equal pieces of one leaf) can run in one `DiskIO.loop`.

  Every item of theirs is on disk and laid out alike in its slice's buffer;
  a cached item's pieces are the host tier's moves, which the slices unroll.
  """
  ks = range(k, k + count)
  same = lambda x: all(np.array_equal(x[k], x[i]) for i in ks)
  return (
    all(len(io.cold[i]) == len(io.keys[i]) > 0 for i in ks)
    and all(io.tier.store.records[j].key is None for j, _ in io.keys[k])
    and same(io.reader.offsets)
    and same([[shape for *_, shape in r] for r in io.reader.reads])
  )


def _loop(io: DiskIO, k: int, count: int, update, carry):
  """Slices k .. k+count-1 (`_can_loop`) in one `fori_loop`; returns the final `carry`.

  `update(i, values, carry) -> (new values, carry)` is slice k+i's update of
  its values (read from disk); the new ones are written back. The program
  holds one read and one write callback whatever `count`. As unrolled, slice
  i's read waits for the write ticket of slice i-2 (the loop carries the last
  two), and the commit for the last two, which wait for all before.
  """
  avals = [
    jax.ShapeDtypeStruct(shape, io.items[j].dtype)
    for (j, _), (*_, shape) in zip(io.keys[k], io.reader.reads[k], strict=True)
  ]
  ticket = lambda i: jnp.asarray(io.ticket_before(i), jnp.int32)

  def body(i, c):
    carry, (before, last) = c
    values, copied = _read_slice(io, k + i, avals, before, like=k)
    values, carry = update(i, values, carry)
    cold = [_same_dtype(io.tier, j, x) for (j, _), x in zip(io.keys[k], values, strict=True)]
    return carry, (last, _write_slice(io, k + i, cold, copied, like=k))

  carry, last = jax.lax.fori_loop(0, count, body, (carry, (ticket(k), ticket(k + 1))))
  io.tickets += [(k + count - 2, last[0]), (k + count - 1, last[1])]
  return carry


def _io_callback(fn, result, *args):
  """`io_callback(fn, result, *args)`, unordered, by `host_callbacks.call` (which, while
  `compile_for_gpu` lowers, emits the custom call a GPU lowers it to)."""
  many = isinstance(result, (list, tuple))
  avals = [] if result is None else list(result) if many else [result]

  def listed(*a):
    out = fn(*a)
    return [] if result is None else list(out) if many else [out]

  out = host_callbacks.call(listed, avals, *args, side_effect=True)
  return None if result is None else out if many else out[0]


def _read_slice(io: DiskIO, k, avals, dep, like: int | None = None):
  """Slice k's values, and (where, ticket) for `_write_slice` on XLA:CPU with the native library.

  `k` is traced inside a `DiskIO.loop`, whose slices are laid out as slice `like`'s.
  """
  offsets = io.reader.offsets[k if like is None else like]
  k = jnp.asarray(k, jnp.int32)  # an operand of the callback: traced in a loop
  via_callback = lambda shard, step, dep: (
    _io_callback(io.reader.read, avals, k, *shard, step, dep),
    (jnp.zeros(4, jnp.uint32), jnp.int32(0)),
  )

  def native(shard, step, dep):
    where = _io_callback(
      io.reader.locate, jax.ShapeDtypeStruct((4,), jnp.uint32), k, *shard, step, dep
    )
    out = (*avals, jax.ShapeDtypeStruct((), jnp.int32))
    copy = jax.ffi.ffi_call("offlax_from_slice", out, has_side_effect=True)
    *values, ticket = copy(where, offsets=offsets)
    return values, (where, ticket)

  return ffi.on_cpu(native, via_callback, io.shard, io.step, dep)


def _write_slice(io: DiskIO, k, cold, copied, like: int | None = None):
  """Writes slice k's new values (the other end of `_read_slice`, `copied` its result); a
  ticket."""
  offsets = io.reader.offsets[k if like is None else like]
  k = jnp.asarray(k, jnp.int32)
  ticket = jax.ShapeDtypeStruct((), jnp.int32)
  via_callback = lambda shard, copied, cold: _io_callback(io.reader.write, ticket, k, *shard, *cold)

  def native(shard, copied, cold):
    where, after = copied
    copy = jax.ffi.ffi_call("offlax_to_slice", ticket, has_side_effect=True)
    copied = copy(where, after, *cold, offsets=offsets)
    return _io_callback(io.reader.submit, ticket, k, *shard, copied)

  return ffi.on_cpu(native, via_callback, io.shard, copied, cold)


def _same_dtype(tier: Any, j: int, x: Any) -> Any:
  """`x`, the new value of item `j`, if it has the item's stored dtype (checked when traced).

  A store keeps each array's dtype; bytes of another would be written into
  its chunks, torn, and committed.
  """
  r = tier.store.records[j]
  if r.key is not None and key_impl(x) == r.key:
    return x
  if is_key(x) or np.dtype(x.dtype) != np.dtype(r.dtype):
    raise errors.StoreMismatchError(
      f"the inner update returns state leaf {r.path} as {x.dtype}, but "
      f"{tier.path} stores it as {r.dtype}, as init made it: the NVMe tier cannot change "
      "a state array's dtype. (optax.inject_hyperparams, for one, promotes low-precision "
      "moments to float32 with its float32 hyperparameters; give the moments a fixed dtype.)"
    )
  return x


def _flat_range(item: layout_lib.OnDisk, piece) -> tuple[int, int, tuple[int, ...]]:
  size = int(np.prod(item.shape, dtype=np.int64))
  if piece.start is None:
    return 0, size, item.shape
  if piece.flat:
    return piece.start, piece.stop, (piece.stop - piece.start,)
  row = size // item.shape[0]
  return piece.start * row, piece.stop * row, (piece.stop - piece.start, *item.shape[1:])
