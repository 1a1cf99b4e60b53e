"""A layer store's optimizer step in row ranges (`LayerStore.create(..., update_bytes=)`).

Without a budget the step's unit is a whole leaf of a layer: its param, gradient and
state slots are read whole, updated and written whole, `step.AHEAD` units read ahead
and two queued for writing, so RAM holds a few of the largest leaf's slots (a 405B
model's MLP leaf, 872M params, is 10 GB of them with an fp32 master and Adam).
With ``update_bytes`` the step holds at most that many bytes in flight: a leaf too
large for its share is cut into ranges of rows of its first axis (`plan`), each a
contiguous part of every slot of that leaf (param, gradient, each owned state leaf),
so an elementwise optimizer's update of a range is that of the leaf, element for
element. Each range keeps every axis but the first (a mask by ``ndim`` sees the
same leaf), and there are at most two shapes a leaf (the range and the last one), so
the jitted update compiles at most twice a leaf.

A range starts on a direct-I/O block (`plan` rounds its rows); the last one runs
to the slot's end, its padding with it. An 8-bit moment (``state_bits=8``) is a codes
slot, shaped like the param and cut in its rows, and a block scales slot, one float32 per
256 elements of the layer's leaf in row-major order: a range of such a leaf starts on a
block (and on a direct-I/O block of the scales, so at a multiple of 262144 elements), and
its scales slot is cut in the range's blocks (`blocks`), so that the update of a range
quantizes the very blocks the update of the whole leaf does. A slot's crc32c is taken
over its ranges in order, as they are consumed (`Crcs`): a read one is compared with the
slot's after its last range (`StoreCorruptedError` as a whole slot's), before the step
commits, and a written one is recorded after its last. What a range derived from a slot not
yet verified is written into the free generation only, which a mismatch never commits.

`Flight` counts the bytes the step holds (reads issued, results, writes queued) and
their peak, `step.Stats.peak_bytes`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import crc32c
import numpy as np

from offlax._src import errors
from offlax._src.nvme.direct_io import BLOCK
from offlax._src.quantized import BLOCK as QBLOCK

if TYPE_CHECKING:
  from offlax._src.layer_store.slots import Slots

# Units in flight at once (`step.run`): the inputs of the one computing and of the `step.AHEAD`
# read ahead; the results of the one computing and of the two queued for writing (each
# counted twice: the result and its aligned copy).
READS = 2 + 1
WRITES = 1 + 2


class Range(NamedTuple):
  """Rows ``start:stop`` of a leaf's first axis (`last`: the leaf's last range)."""

  start: int
  stop: int
  last: bool


class Flight:
  """The bytes a step holds in flight, and their peak (thread-safe)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self.now = self.peak = 0

  def add(self, n: int) -> None:
    with self._lock:
      self.now += n
      self.peak = max(self.peak, self.now)

  def sub(self, n: int) -> None:
    with self._lock:
      self.now -= n


def nbytes(record: dict) -> int:
  """A record's leaf of one layer, in bytes (its slot without the padding)."""
  return int(np.prod(record["shape"], dtype=np.int64)) * np.dtype(record["dtype"]).itemsize


def row_bytes(record: dict) -> int:
  """One row (first axis) of a record's leaf, in bytes."""
  return int(np.prod(record["shape"][1:], dtype=np.int64)) * np.dtype(record["dtype"]).itemsize


def _align_rows(records: list[dict], scales: list[dict], elements: int) -> int:
  """The fewest rows that start every record's ranges on a direct-I/O block (the block
  `scales` of a leaf of `elements` a row: on a block of its codes too, `blocks`)."""
  rows = [BLOCK // math.gcd(row_bytes(r), BLOCK) for r in records]
  for r in scales:  # rows * elements * itemsize / QBLOCK bytes: a multiple of BLOCK
    unit = BLOCK * QBLOCK
    rows.append(unit // math.gcd(elements * np.dtype(r["dtype"]).itemsize, unit))
  return math.lcm(*rows)


def blocks(record: dict, r: Range) -> Range:
  """Range `r` of a leaf of `record` as the range of its 8-bit moment's block scales (one
  per `QBLOCK` elements in row-major order); `r` starts on a block (`plan`)."""
  elements = int(np.prod(record["shape"][1:], dtype=np.int64))
  size = elements * (record["shape"][0] if record["shape"] else 1)
  assert r.start * elements % QBLOCK == 0, (record["path"], r)
  stop = -(-size // QBLOCK) if r.last else r.stop * elements // QBLOCK
  return Range(r.start * elements // QBLOCK, stop, r.last)


class _Leaf(NamedTuple):
  """What a unit of a leaf holds in flight: inputs and outputs (results and copies), whole,
  a row's, and the fixed part of a range (the shared state, the last range's padding)."""

  ins: int
  outs: int
  in_row: int
  out_row: int
  in_fixed: int
  out_fixed: int
  rows: int
  align: int  # the fewest rows a range may have (`rows`: the leaf cannot be cut)
  scales: bool = False  # 8-bit moments: ranges start on their scales' direct-I/O blocks


def _leaf(rec: dict, grad: dict, state: list[dict], shared: list[dict],
          scales: list[dict]) -> _Leaf:  # fmt: skip
  # param, gradient (`grad`: its slot's record) and state read: where the param and gradient
  # are handed in RAM (``update="backward"``), their share holds the sum an accumulation's
  # last reads
  ins, outs = [rec, grad, *state], [rec, *state]  # param and state written
  rows = rec["shape"][0] if rec["shape"] else 0
  elements = int(np.prod(rec["shape"][1:], dtype=np.int64))
  # A row's block scales: elements / QBLOCK of them, a part of one more a range (its end)
  scale_row = sum(-(-elements * np.dtype(r["dtype"]).itemsize // QBLOCK) for r in scales)
  scale_end = sum(np.dtype(r["dtype"]).itemsize for r in scales)
  in_row = sum(map(row_bytes, ins)) + scale_row
  out_row = 2 * (sum(map(row_bytes, outs)) + scale_row)
  cuttable = rows > 1 and in_row > 0 and all(r["shape"][:1] == [rows] for r in state)
  shared_slots = sum(r["slot"] for r in shared)
  slots = sum(r["slot"] for r in [*outs, *scales])
  return _Leaf(
    ins=slots + rec["slot"] + shared_slots,
    outs=2 * (slots + shared_slots),
    in_row=in_row,
    out_row=out_row,
    in_fixed=shared_slots + scale_end + BLOCK * (len(ins) + len(scales)),
    out_fixed=2 * (shared_slots + scale_end + BLOCK * (len(outs) + len(scales))),
    rows=rows,
    align=min(rows, _align_rows([rec, grad, *state], scales, elements)) if cuttable else rows,
    scales=bool(scales),
  )


def plan(
  slots: Slots,
  owned: list[list[int]],
  shared: list[int],
  budget: int | None,
  scales: list[tuple[int, ...]] | None = None,
) -> list[int | None]:
  """Per leaf, the rows of its ranges, or None for the whole leaf, within `budget` bytes.

  At most `READS` units' inputs and `WRITES` units' outputs are in flight (`step.run`), so
  each unit's inputs get a `READS`-th of the inputs' part of `budget` and its outputs a
  `WRITES`-th of the rest; the parts are in the proportion of a row of the largest leaf (its
  ranges then fill the budget). A leaf within both shares is one unit.

  Args:
    slots: the store's open files (its records).
    owned: per leaf, the indices of its state leaves (`step.LeafUpdate.owned`).
    shared: the indices of the state leaves of no leaf (the count), read with leaf 0.
    budget: the most bytes the step may hold in flight (None: no bound, whole leaves).
    scales: per leaf, which of its `owned` are an 8-bit moment's block scales (`blocks`).

  Raises:
    InvalidOptionError: `budget` cannot hold a leaf's smallest range, or a leaf that
      cannot be cut (the minimum named).
  """
  records, grads, states = slots.records, slots.grad_records, slots.state_records
  if budget is None or not records:
    return [None] * len(records)
  shared_records = [states[j] for j in shared]
  scales = scales or [()] * len(records)
  leaves = [_leaf(rec, grads[k], [states[j] for j in owned[k] if j not in scales[k]],
                  shared_records if k == 0 else [], [states[j] for j in scales[k]])
            for k, rec in enumerate(records)]  # fmt: skip
  big = max(leaves, key=lambda x: x.ins + x.outs)
  part = big.in_row / (big.in_row + big.out_row) if big.in_row else big.ins / (big.ins + big.outs)
  share_in, share_out = int(budget * part) // READS, int(budget * (1 - part)) // WRITES

  def least(x: _Leaf) -> int:  # the budget its smallest unit needs
    ins, outs = x.ins, x.outs
    if x.align < x.rows:
      ins = min(ins, x.align * x.in_row + x.in_fixed)
      outs = min(outs, x.align * x.out_row + x.out_fixed)
    need = max(ins * READS / part, outs * WRITES / (1 - part))
    return math.ceil(need) + READS + WRITES  # (the shares' rounding down)

  out: list[int | None] = []
  for x in leaves:
    if x.ins <= share_in and x.outs <= share_out:
      out.append(None)
    elif x.align >= x.rows or least(x) > budget:
      w = max(range(len(leaves)), key=lambda j: least(leaves[j]))
      rec, x = records[w], leaves[w]
      unit = "whole (it cannot be cut)" if x.align >= x.rows else f"{x.align} rows at least"
      if x.scales:  # (the scales' direct-I/O block: 1024 float32 scales, of 256 elements each)
        unit += (f"; its 8-bit moments are cut at multiples of {BLOCK // 4 * QBLOCK} elements "
                 "(a direct-I/O block of their block scales)")  # fmt: skip
      raise errors.InvalidOptionError(
        f"LayerStore: update_bytes={budget} cannot hold leaf {rec['path']} "
        f"({rec['dtype']}{rec['shape']} a layer; its unit {unit}) in flight: the optimizer "
        f"step needs update_bytes >= {least(x)} ({READS} units read and {WRITES} "
        "written in flight). Raise update_bytes, or leave it None (whole leaves)."
      )
    else:
      rows = min((share_in - x.in_fixed) // x.in_row, (share_out - x.out_fixed) // x.out_row)
      out.append(min(x.rows, max(x.align, rows // x.align * x.align)))
  return out


def of(record: dict, rows: int | None) -> list[Range | None]:
  """The ranges of a leaf cut every `rows` rows (None: one unit, the whole leaf)."""
  if rows is None:
    return [None]
  n = record["shape"][0]
  return [Range(a, min(a + rows, n), a + rows >= n) for a in range(0, n, rows)]


def span(record: dict, r: Range) -> tuple[int, int]:
  """The byte offset in its slot of range `r` of a leaf of `record`, and its length (the
  last runs to the slot's end)."""
  start = r.start * row_bytes(record)
  return start, (record["slot"] if r.last else r.stop * row_bytes(record)) - start


def view(record: dict, buffer: np.ndarray, r: Range) -> np.ndarray:
  """Range `r`'s bytes as its rows, in the leaf's dtype."""
  dtype = np.dtype(record["dtype"])
  shape = (r.stop - r.start, *record["shape"][1:])
  count = int(np.prod(shape, dtype=np.int64))
  return buffer[: count * dtype.itemsize].view(dtype).reshape(shape)


def to_buffer(record: dict, x: np.ndarray, r: Range, kind: str, i: int) -> np.ndarray:
  """Range `r`'s rows `x` as the aligned bytes written at its place (the last zero-padded).

  Raises:
    StoreMismatchError: `x` is not the range's rows of the leaf's shape and dtype (an
      optimizer's update returned another), as `Slots.write_slot` refuses a whole slot.
  """
  from offlax._src.layer_store.files import to_slot

  shape = (r.stop - r.start, *record["shape"][1:])
  if x.shape != shape or x.dtype != np.dtype(record["dtype"]):
    raise errors.StoreMismatchError(
      f"LayerStore: rows {r.start}:{r.stop} of layer {i} of {kind} leaf {record['path']} are "
      f"{x.dtype.name}{list(x.shape)}, expected {record['dtype']}{list(shape)}."
    )
  return to_slot(x, span(record, r)[1])


class Crcs:
  """The crc32c of slots taken over their ranges in order (`Slots.check` / `Slots.record`)."""

  def __init__(self, slots: Slots):
    self._slots = slots
    self._running: dict[tuple[str, int, int, int], int] = {}

  def read(self, kind: str, gen: int, k: int, i: int, r: Range, buffer: np.ndarray) -> None:
    """Adds a range read; after the slot's last, checks it (raises `StoreCorruptedError`)."""
    self._add((kind, gen, k, i), r, buffer, self._slots.check)

  def written(self, kind: str, gen: int, k: int, i: int, r: Range, buffer: np.ndarray) -> None:
    """Adds a range written; after the slot's last, records the slot's crc32c."""
    self._add((kind, gen, k, i), r, buffer, self._slots.record)

  def _add(self, key: tuple[str, int, int, int], r: Range, buffer: np.ndarray,
           last: Callable[..., None]) -> None:  # fmt: skip
    """Continues `key`'s crc32c over `buffer`; after the slot's last range, `last(*key, crc)`."""
    crc = crc32c.crc32c(buffer.data, value=self._running.pop(key, 0) if r.start else 0)
    if r.last:
      last(*key, crc)
    else:
      self._running[key] = crc


def read_checked(slots: Slots, kind: str, gen: int, k: int, i: int, rows: int) -> Iterator[Any]:
  """Layer `i` of leaf `k` of `kind`, range after range of `rows` rows (their views), the
  slot's checksum checked after the last is read, before it is yielded."""
  record, crcs = slots.records_of(kind)[k], Crcs(slots)
  for r in of(record, rows):
    assert r is not None
    buffer = slots.read_range(kind, gen, k, i, *span(record, r))
    crcs.read(kind, gen, k, i, r, buffer)
    yield r, view(record, buffer, r)
