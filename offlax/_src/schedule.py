"""The streaming schedule: which pieces of which leaves each slice updates."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from offlax._src.coupling import Coupling


@dataclasses.dataclass(frozen=True)
class Piece:
  """Leaf `leaf`, whole (`start is None`) or rows `start:stop` of it along `axis`.

  With `flat`, the rows are those of the leaf flattened to one dimension; used
  when a single row of the leaf exceeds the slice budget. A leaf sharded on a
  mesh is cut along an axis no mesh axis shards (`axis`), never flattened, so
  every device slices its own shard.
  """

  leaf: int
  start: int | None = None
  stop: int | None = None
  flat: bool = False
  axis: int = 0

  @property
  def rows(self) -> int:
    """The rows of a cut piece (`stop - start`)."""
    assert self.start is not None and self.stop is not None, self
    return self.stop - self.start

  def take(self, x: jax.Array) -> jax.Array:
    if self.start is None:
      return x
    if self.flat:
      x = x.reshape(-1)
    return jax.lax.slice_in_dim(x, self.start, self.stop, axis=self.axis)


def join(pieces: Sequence[Piece], parts: Sequence[jax.Array], shape) -> jax.Array:
  """Inverse of `Piece.take` over all pieces of one leaf."""
  if len(parts) == 1 and pieces[0].start is None:
    return parts[0]
  whole = jnp.concatenate(parts, axis=pieces[0].axis)
  return whole.reshape(shape) if pieces[0].flat else whole


def split_step(
  shape: tuple[int, ...], size: int, chunk_bytes: int, axis: int = 0, flat_ok: bool = True
) -> tuple[bool, int, int]:
  """How a splittable leaf of `size` state bytes is cut: (flat, rows, rows per piece).

  Rows are those of axis `axis`, or single elements (`flat`, if `flat_ok`) when
  one row of that axis is already larger than `chunk_bytes`.
  """
  flat = flat_ok and len(shape) > 1 and size // shape[axis] > chunk_bytes
  rows = math.prod(shape) if flat or len(shape) == 1 else shape[axis]
  row_bytes = max(size // max(rows, 1), 1)
  return flat, rows, max(1, chunk_bytes // row_bytes)


def _even_step(rows: int, step: int) -> int:
  """A step of at most `step` rows that cuts `rows` into pieces as equal as it can.

  A divisor of `rows` where one gives at most twice the pieces: all pieces then
  run in one loop. Else pieces of equal rows and a last one shorter by less
  than a row per piece, which runs on its own after the loop.
  """
  n = -(-rows // step)
  for k in range(n, 2 * n + 1):
    if rows % k == 0:
      return rows // k
  return -(-rows // n)


def build(
  coupling: Coupling,
  shapes: Sequence[tuple[int, ...]],
  leaf_bytes: Sequence[int],
  chunk_bytes: int,
  cut_axes: Sequence[int | None] | None = None,
  even: bool = False,
  min_pieces: int = 1,
) -> tuple[tuple[Piece, ...], ...]:
  """Packs the leaves into slices of at most `chunk_bytes` of offloaded state.

  Groups of coupled leaves are never split across slices; a splittable leaf
  larger than `chunk_bytes` is cut into row ranges (of its leading axis, or of
  its flattened form when one row is already too large). Units are then packed
  greedily in tree order. A group larger than `chunk_bytes` that cannot be
  split gets a slice of its own, the one case where the bound is exceeded.

  Args:
    coupling: the result of `coupling.analyze` for these leaves.
    shapes: each leaf's shape.
    leaf_bytes: each leaf's bytes of offloaded state (per device, when sharded).
    chunk_bytes: the slice budget.
    cut_axes: for leaves sharded on a mesh, the axis to cut them along (None:
      no axis can be cut, the leaf moves whole); None for unsharded leaves.
    even: cut a leaf into pieces of equal rows (`_even_step`), not into full
      pieces and a remainder, each in a slice of its own, so that its pieces
      run in one loop (`streaming.runs`).

  Returns:
    The slices, each a tuple of pieces; at least one slice, possibly empty.
  """
  units: list[tuple[tuple[Piece, ...], int]] = []
  for group in coupling.groups:
    size = sum(leaf_bytes[i] for i in group)
    (leaf,) = group if len(group) == 1 else (None,)
    on_mesh = cut_axes is not None
    if (
      leaf is None
      or leaf not in coupling.splittable
      or (size <= chunk_bytes and (min_pieces < 2 or size == 0 or math.prod(shapes[leaf]) < 2))
      or (cut_axes is not None and cut_axes[leaf] is None)
    ):
      units.append((tuple(Piece(i) for i in group), size))
      continue
    axis = 0 if cut_axes is None else cut_axes[leaf] or 0
    budget = min(chunk_bytes, -(-size // min_pieces))
    flat, rows, step = split_step(shapes[leaf], size, budget, axis, flat_ok=not on_mesh)
    if rows < min_pieces and not on_mesh:  # too few rows: cut the flattened leaf
      flat, rows = True, math.prod(shapes[leaf])
      step = max(1, budget // max(size // rows, 1))
    if even:
      step = _even_step(rows, step)
    row_bytes = size // rows
    for start in range(0, rows, step):
      stop = min(rows, start + step)
      units.append(((Piece(leaf, start, stop, flat, axis),), (stop - start) * row_bytes))
  slices: list[tuple[Piece, ...]] = []
  current: list[Piece] = []
  current_bytes = 0
  for pieces, size in units:
    alone = even and pieces[0].start is not None  # a piece of a split leaf: a slice of its own
    if current and (alone or current_bytes + size > chunk_bytes):
      slices.append(tuple(current))
      current, current_bytes = [], 0
    current.extend(pieces)
    current_bytes += size
    if alone:
      slices.append(tuple(current))
      current, current_bytes = [], 0
  if current or not slices:
    slices.append(tuple(current))
  # Two pieces of one leaf never fit one slice (each is more than half of it,
  # or the only piece there); the stream relies on one piece per leaf.
  assert all(len({p.leaf for p in s}) == len(s) for s in slices), slices
  return tuple(slices)
