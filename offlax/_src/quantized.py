"""Dynamic blockwise 8-bit quantization of optimizer moments (the 8-bit Adam scheme).

The scheme of Dettmers et al., "8-bit Optimizers via Block-wise Quantization"
(ICLR 2022; bitsandbytes' 8-bit Adam, torchao's `AdamW8bit`), exactly:

* A leaf is read in row-major order and cut into blocks of `BLOCK` (256)
  consecutive elements; the last block may be shorter.
* Each block keeps one float32 scale, its absmax ``s = max |x|``.
* Each element keeps one byte: the index of the entry of a 256-entry code map
  (values in [-1, 1], or [0, 1]) nearest to ``y = x * r``, where ``r = 1 / s``
  (both rounded to float32: one division a block, a multiply an element).
  Ties go to the larger entry: the index is the number of float32 midpoints
  between neighbouring entries that are <= ``y``.
* Dequantized: ``map[code] * s`` (one float32 multiply).

The code map is bitsandbytes' `create_dynamic_map` (dynamic tree
quantization, 7 exponent "decades" from 1e-6 to 1): the first moment uses the
signed map (127 negative values, zero, 128 positive ones up to 1.0), the
second the unsigned one (0, 254 values in (0, 1), and 1.0): the second moment
is non-negative, so its byte spends no bit on a sign. Why the dynamic map and
not a linear code: Adam divides by ``sqrt(v)``, and within a block ``v`` spans
orders of magnitude; a linear uint8 code flushes every ``v < s/510`` to zero
and turns those elements' updates into ``m / eps``. The dynamic map keeps a
relative error of at most 7% down to ``1e-6 s`` (0.7% near ``s``).

Storage: the unsigned code is a `uint8` (the map index); the signed code an
`int8`, the map index minus 128, so that codes order like the values they
stand for (value 0 is code -1; the init quantizes zeros, as any moment).

Why 256 elements a block (torchao's choice; bitsandbytes uses 2048): an
outlier raises the scale, and so the error, of its block only, and smaller
blocks keep it local; the scale costs 4/256 = 1.6% more bytes (1.016 bytes an
element), against 0.2% at 2048, a negligible difference against fp32's 4.

Leaves of fewer than `MIN_SIZE` (4096, bitsandbytes' ``min_8bit_size``)
elements, and leaves that are not floating point, stay as optax keeps them
(biases, norms: a few bytes, and the most sensitive).

Example:
  >>> import jax.numpy as jnp
  >>> from offlax._src import quantized
  >>> x = jnp.linspace(-1.0, 2.0, 5000)
  >>> codes, scales = quantized.quantize(x, signed=True)
  >>> codes.dtype, codes.shape, scales.shape  # ceil(5000 / 256) blocks
  (dtype('int8'), (5000,), (20,))
  >>> err = jnp.abs(quantized.dequantize(codes, scales, signed=True) - x)
  >>> bool(err.max() <= quantized.max_error(scales, signed=True).max())
  True
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 256
MIN_SIZE = 4096
SIGNED_OFFSET = 128  # int8 code + 128 = the index into the signed map
_IN_FLOAT = contextvars.ContextVar("offlax_quantized_in_float", default=False)


@functools.cache
def code_map(signed: bool) -> np.ndarray:
  """The 256 values of bitsandbytes' `create_dynamic_map(signed)`, sorted, float32.

  For each decade ``i = 0..6`` the midpoints of ``linspace(0.1, 1, k + 1)``
  times ``10**(i - 6)``: ``k = 2**i`` values (and their negatives) for the
  signed map, ``k = 2**(i + 1)`` for the unsigned one; then 0 and 1.
  Computed in float64 and rounded once to float32.

  Args:
    signed: the map of the first moment (True) or of the second (False).

  Returns:
    A float32 array of 256 strictly increasing values.

  Example:
    >>> from offlax._src.quantized import code_map
    >>> m = code_map(signed=False)
    >>> m[0], m[1], m[-1]
    (np.float32(0.0), np.float32(3.25e-07), np.float32(1.0))
  """
  values = [0.0, 1.0]
  for i in range(7):
    bounds = np.linspace(0.1, 1.0, (2**i if signed else 2 ** (i + 1)) + 1)
    means = (bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)
    values += [*means, *(-means if signed else [])]
  out = np.sort(np.asarray(values, np.float64)).astype(np.float32)
  assert out.shape == (256,) and np.all(np.diff(out) > 0)
  out.flags.writeable = False
  return out


@functools.cache
def midpoints(signed: bool) -> np.ndarray:
  """The 255 float32 decision points: ``(map[i] + map[i + 1]) / 2``, rounded once from float64.

  The code of a normalized value ``y`` is the number of them that are ``<= y``.

  Args:
    signed: which map.

  Returns:
    A float32 array of 255 strictly increasing values.
  """
  m = code_map(signed).astype(np.float64)
  out = ((m[:-1] + m[1:]) / 2).astype(np.float32)
  out.flags.writeable = False
  return out


_KEY_SHIFT = 15  # a bucket: the floats sharing their top 17 bits (relative width 2**-8)


@functools.cache
def bucket_counts(signed: bool) -> np.ndarray:
  """Per bucket of float32 bit patterns (``bits >> 15``): the midpoints <= its lowest value.

  A bucket spans 2**-8 of its values' magnitude, the midpoints lie at least
  0.5% apart in [-1, 1] (checked here), so a bucket holds at most one: the
  count for any ``y`` in it is this count, plus one if ``y`` reaches the next
  midpoint. Buckets outside [-1, 1] (never met: ``|x| <= absmax``) and NaNs
  are clipped to a valid index.

  Args:
    signed: which map.

  Returns:
    A uint8 array of 2**17 counts.
  """
  keys = np.arange(2**17, dtype=np.uint32)
  # The lowest value of a bucket: its first bit pattern if positive, its last if negative.
  ones = np.uint32((1 << _KEY_SHIFT) - 1)
  negative = (keys >> 16).astype(bool)
  low_bits = (keys << _KEY_SHIFT) | np.where(negative, ones, 0).astype(np.uint32)
  high_bits = (keys << _KEY_SHIFT) | np.where(negative, 0, ones).astype(np.uint32)
  mids = midpoints(signed)
  with np.errstate(invalid="ignore"):
    low, high = low_bits.view(np.float32), high_bits.view(np.float32)
    counts = np.searchsorted(mids, np.nan_to_num(low, nan=0.0), side="right")
    inside = (np.abs(low) <= 1) & (np.abs(high) <= 1)
  more = np.searchsorted(mids, np.where(inside, high, 0), side="right") - counts
  assert np.all(more[inside] <= 1), "a bucket holds two midpoints"
  out = np.minimum(counts, 255).astype(np.uint8)
  out.flags.writeable = False
  return out


def num_blocks(size: int, block: int = BLOCK) -> int:
  """How many blocks (scales) a leaf of `size` elements has: ``ceil(size / block)``."""
  return -(-size // block)


def quantizes(x, min_size: int = MIN_SIZE) -> bool:
  """Whether a moment like `x` (an array or shape-dtype struct) is stored in 8 bits."""
  if _IN_FLOAT.get():
    return False
  return jnp.issubdtype(x.dtype, jnp.floating) and int(np.prod(x.shape)) >= min_size


@contextlib.contextmanager
def kept_in_float() -> Iterator[None]:
  """Inside, an 8-bit optimizer's ``init`` keeps every moment in float (`quantizes` is False).

  For an analysis of the rest of its maths: traced inside, ``offlax.adam(..., state_bits=8)``
  is optax's Adam, and what differs outside is the quantization alone, blockwise within a
  leaf (`LayerStore`'s check that its update may run a layer, or a range of blocks, at a time).
  """
  token = _IN_FLOAT.set(True)
  try:
    yield
  finally:
    _IN_FLOAT.reset(token)


def _blocks(flat: jax.Array, block: int) -> jax.Array:
  n = flat.shape[0]
  return jnp.pad(flat, (0, num_blocks(n, block) * block - n)).reshape(-1, block)


@functools.partial(jax.jit, static_argnames=("signed", "block"))
def quantize(x: jax.Array, signed: bool, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
  """Codes (`x`'s shape; int8 if `signed` else uint8) and per-block float32 absmax scales.

  A block of zeros gets scale 0 (its codes those of 0). A NaN or infinity in a
  block makes its scale non-finite, so the whole block dequantizes to NaN (as
  a float32 moment would carry the NaN on).

  Args:
    x: a floating array, any shape (computed in float32).
    signed: the signed map (a first moment) or the unsigned one (a second
      moment: `x` must be >= 0).
    block: elements per scale.

  Returns:
    ``(codes, scales)``, scales of shape ``(ceil(x.size / block),)``.
  """
  flat = jnp.ravel(x).astype(jnp.float32)
  blocks = _blocks(flat, block)
  scales = jnp.max(jnp.abs(blocks), axis=1)
  # A multiply by the block's reciprocal, not a division: the native kernel's
  # arithmetic too, and a division an element was most of its time.
  y = blocks * (jnp.float32(1) / jnp.where(scales > 0, scales, jnp.float32(1)))[:, None]
  # The index is the number of midpoints <= y. A table keyed by y's top 17
  # bits (sign, exponent, 8 mantissa bits) gives that count at the low end of
  # y's bucket; a bucket holds at most one midpoint, so one comparison with the
  # next midpoint finishes it (`bucket_counts`): two lookups, not a search.
  key = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(y, jnp.uint32), jnp.uint32(15))
  low = jnp.asarray(bucket_counts(signed))[key].astype(jnp.int32)
  above = jnp.asarray(np.append(midpoints(signed), np.float32(np.inf)))
  index = low + (above[low] <= y).astype(jnp.int32)
  codes = (index - SIGNED_OFFSET).astype(jnp.int8) if signed else index.astype(jnp.uint8)
  return codes.reshape(-1)[: flat.shape[0]].reshape(jnp.shape(x)), scales


@functools.partial(jax.jit, static_argnames=("signed", "block"))
def dequantize(codes: jax.Array, scales: jax.Array, signed: bool, block: int = BLOCK) -> jax.Array:
  """The float32 values `codes` and `scales` stand for: ``map[code] * scale``.

  Args:
    codes: what `quantize` returned (int8 if `signed`, else uint8).
    scales: its per-block scales.
    signed: which map.
    block: elements per scale.

  Returns:
    A float32 array of `codes`' shape.
  """
  index = codes.astype(jnp.int32) + (SIGNED_OFFSET if signed else 0)
  values = jnp.asarray(code_map(signed))[jnp.ravel(index)]
  out = (_blocks(values, block) * scales[:, None]).reshape(-1)[: values.shape[0]]
  return out.reshape(codes.shape)


def max_error(scales: jax.Array, signed: bool) -> jax.Array:
  """A bound on ``|x - dequantize(quantize(x))|`` per block: the map's widest half gap times scale.

  The widest gap is in the top decade (0.9 / 64 for the signed map, 0.9 / 128
  unsigned; ``y = -1`` lies that half gap below the lowest signed entry), plus
  ``2**-22 s`` for the float32 rounding of ``x * (1 / s)`` and of
  ``map[code] * s`` (each under an ulp of ``s``, ``2**-23 s``).

  Args:
    scales: per-block scales (`quantize`'s).
    signed: which map.

  Returns:
    The bound for each block, float32.
  """
  gap = float(np.max(np.diff(code_map(signed).astype(np.float64)))) / 2
  return scales * np.float32(gap + 2**-22)
