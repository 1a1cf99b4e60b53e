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
to the slot's end, its padding with it. A slot's crc32c is taken over its ranges in
order, as they are consumed (`Crcs`): a read one is compared with the slot's after
its last range (`StoreCorruptedError` as a whole slot's), before the step commits,
and a written one is recorded after its last. What a range derived from a slot not
yet verified is written into the free generation only, which a mismatch never commits.

`Flight` counts the bytes the step holds (reads issued, results, writes queued) and
their peak, `step.Stats.peak_bytes`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import crc32c
import numpy as np

from offlax._src import errors
from offlax._src.nvme.direct_io import BLOCK

if TYPE_CHECKING:
  from offlax._src.layer_store.slots import Slots

# Units in flight at once (`step.run`): the `step.AHEAD` read ahead, the one computing
# and the two queued for writing (its writes counted twice: the result and its aligned copy).
UNITS_IN_FLIGHT = 2 + 1 + 2


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


def row_bytes(record: dict) -> int:
  """One row (first axis) of a record's leaf, in bytes."""
  return int(np.prod(record["shape"][1:], dtype=np.int64)) * np.dtype(record["dtype"]).itemsize


def _align_rows(records: list[dict]) -> int:
  """The fewest rows that start every record's ranges on a direct-I/O block."""
  return math.lcm(*(BLOCK // math.gcd(row_bytes(r), BLOCK) for r in records))


def _min_budget(cost: int) -> int:
  return cost * UNITS_IN_FLIGHT


def plan(
  slots: Slots, owned: list[list[int]], shared: list[int], budget: int | None
) -> list[int | None]:
  """Per leaf, the rows of its ranges, or None for the whole leaf, within `budget` bytes.

  Each unit (a leaf or a range of it, with the shared state where it is leaf 0's first) is
  given a `UNITS_IN_FLIGHT`-th of `budget`.

  Args:
    slots: the store's open files (its records).
    owned: per leaf, the indices of its state leaves (`step.LeafUpdate.owned`).
    shared: the indices of the state leaves of no leaf (the count), read with leaf 0.
    budget: the most bytes the step may hold in flight (None: no bound, whole leaves).

  Raises:
    InvalidOptionError: `budget` cannot hold a leaf's smallest range, or a leaf that
      cannot be cut (the minimum named).
  """
  records, states = slots.records, slots.state_records
  if budget is None:
    return [None] * len(records)
  share = budget // UNITS_IN_FLIGHT
  out: list[int | None] = []
  least: list[tuple[int, str]] = []  # per leaf: the smallest share it runs in, and what
  for k, rec in enumerate(records):
    state = [states[j] for j in owned[k]]
    extra = sum(3 * states[j]["slot"] for j in shared) if k == 0 else 0
    # param, gradient and state read: where the param and gradient are handed in RAM
    # (``update="backward"``), their share holds the sum an accumulation's last reads
    ins = [rec, rec, *state]
    outs = [rec, *state]  # param and state written (twice: result and aligned copy)
    whole = sum(r["slot"] for r in ins) + 2 * sum(r["slot"] for r in outs) + extra
    rows = rec["shape"][0] if rec["shape"] else 0
    per_row = sum(row_bytes(r) for r in ins) + 2 * sum(row_bytes(r) for r in outs)
    cuttable = rows > 1 and per_row > 0 and all(r["shape"][:1] == [rows] for r in state)
    align = _align_rows([rec, *state]) if cuttable else rows
    fixed = extra + BLOCK * (len(ins) + 2 * len(outs))  # the last range's padding
    if cuttable and align < rows:
      least.append((min(whole, align * per_row + fixed), f"its smallest range ({align} rows)"))
    else:
      least.append((whole, "the whole leaf (it cannot be cut)"))
    if whole <= share:
      out.append(None)
    else:
      out.append(min(rows, max(align, (share - fixed) // per_row // align * align)))
  worst = max(range(len(records)), key=lambda k: least[k][0], default=None)
  if worst is not None and least[worst][0] > share:
    rec = records[worst]
    raise errors.InvalidOptionError(
      f"LayerStore: update_bytes={budget} cannot hold leaf {rec['path']} "
      f"({rec['dtype']}{rec['shape']} a layer) in flight: {least[worst][1]} needs "
      f"update_bytes >= {_min_budget(least[worst][0])} ({UNITS_IN_FLIGHT} units in flight: "
      "read ahead, updating, queued for writing). Raise update_bytes, or leave it None "
      "(whole leaves)."
    )
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


def to_buffer(record: dict, x: np.ndarray, r: Range) -> np.ndarray:
  """Range `r`'s rows `x` as the aligned bytes written at its place (the last zero-padded)."""
  from offlax._src.layer_store.files import to_slot

  return to_slot(x, span(record, r)[1])


class Crcs:
  """The crc32c of slots taken over their ranges in order (`Slots.check` / `Slots.record`)."""

  def __init__(self, slots: Slots):
    self._slots = slots
    self._running: dict[tuple[str, int, int, int], int] = {}

  def read(self, kind: str, gen: int, k: int, i: int, r: Range, buffer: np.ndarray) -> None:
    """Adds a range read; after the slot's last, checks it (raises `StoreCorruptedError`)."""
    key = (kind, gen, k, i)
    crc = crc32c.crc32c(buffer.data, value=self._running.pop(key, 0) if r.start else 0)
    if r.last:
      self._slots.check(kind, gen, k, i, crc)
    else:
      self._running[key] = crc

  def written(self, kind: str, gen: int, k: int, i: int, r: Range, buffer: np.ndarray) -> None:
    """Adds a range written; after the slot's last, records the slot's crc32c."""
    key = (kind, gen, k, i)
    crc = crc32c.crc32c(buffer.data, value=self._running.pop(key, 0) if r.start else 0)
    if r.last:
      self._slots.record(kind, gen, k, i, crc)
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
