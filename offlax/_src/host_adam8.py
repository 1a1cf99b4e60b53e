"""The native host step of `offlax.adam/adamw(state_bits=8)`: one pass per block (native/adam8.cc).

On XLA:CPU each quantized leaf's step runs in the C++ kernel: per block of
256 elements, the moments dequantized, updated, the update (or the new param,
or with `master_weights` the new master and low-precision param) written, and
the moments quantized again, in one pass over memory. Its arithmetic and
tables are the JAX path's (`quantized.py`, optax's expressions), so the
results are bit-identical under the tests' XLA flags (arithmetic as written)
and agree to rounding under XLA's defaults. Elsewhere (a GPU program, no
native library) the same leaf step runs in plain JAX. Leaves kept in float32
run `host_adam`'s float32 kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import adam_maths as ha
from offlax._src import ffi, quantized

_TARGET = "offlax_adam8_step"
OUT_UPDATE = 3  # besides host_adam's OUT_NONE, OUT_DELTA, OUT_PARAM: the update


@functools.cache
def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The kernel's tables (signed then unsigned): maps, midpoints then +inf, bucket counts."""
  inf = np.float32(np.inf)
  maps = np.concatenate([quantized.code_map(True), quantized.code_map(False)])
  above = np.concatenate(
    [np.append(quantized.midpoints(True), inf), np.append(quantized.midpoints(False), inf)]
  )
  # int32 (not quantized.py's uint8): 32-bit lanes for the kernel's scalar path (no AVX-512,
  # partial vectors, |y| > 1); with AVX-512 it searches the midpoints in registers instead.
  keys = np.concatenate([quantized.bucket_counts(True), quantized.bucket_counts(False)])
  return maps, above.astype(np.float32), keys.astype(np.int32)


def native_leaf(g, m, v) -> bool:
  """Whether the kernel covers a leaf: quantized moments, a float32 or bfloat16 gradient."""
  return (
    m.dtype == jnp.int8
    and v.dtype == jnp.uint8
    and g.dtype in (jnp.float32, jnp.bfloat16)
    and g.size > 0
    and quantized.BLOCK == 256
  )


def leaf_step(g, codes, w, low, hyper: ha.Hyper, vector, decay: bool, out: int):
  """One quantized leaf's step: ``(result, (mc, ms, vc, vs), new_w)``.

  `codes`: ``(mu codes, mu scales, nu codes, nu scales)``; `w`: the param
  (read with `decay`, and updated unless ``out == OUT_UPDATE``) or the float32
  master of `low`. `result`: the update (``OUT_UPDATE``, in `g`'s dtype), the
  new param (``OUT_NONE``: same as `new_w`), the new low-precision param
  (``OUT_PARAM``) or its float32 update (``OUT_DELTA``).
  """

  def plain(g, mc, ms, vc, vs, w, low, vector):
    del vector
    # The whole step runs on the float32 master's gradient (`master_weights` casts it).
    g = g if out == OUT_UPDATE else g.astype(jnp.float32)
    m = quantized.dequantize(mc, ms, True)
    v = quantized.dequantize(vc, vs, False)
    update, m, v = ha.adam_leaf(g, m, v, w, hyper, decay)
    state = (*quantized.quantize(m, True), *quantized.quantize(v, False))
    if out == OUT_UPDATE:
      return update.astype(g.dtype), *state, w
    new_w = optax.apply_updates(w, update)
    if out == ha.OUT_NONE:
      return new_w, *state, new_w
    new_low = new_w.astype(low.dtype)
    result = new_low if out == ha.OUT_PARAM else new_low.astype(w.dtype) - low.astype(w.dtype)
    return result, *state, new_w

  def native(g, mc, ms, vc, vs, w, low, vector):
    f32 = jax.ShapeDtypeStruct(g.shape, jnp.float32)
    result = {
      OUT_UPDATE: f32,
      ha.OUT_NONE: jax.ShapeDtypeStruct((1,), jnp.float32),  # unused
      ha.OUT_DELTA: f32,
      ha.OUT_PARAM: jax.ShapeDtypeStruct(g.shape, low.dtype),
    }[out]
    shapes = (result, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (mc, ms, vc, vs)))
    w_shape = jax.ShapeDtypeStruct((1,) if out == OUT_UPDATE else w.shape, jnp.float32)
    # In place: the state into its buffers, w into its own, the new param over the old.
    aliases = {1: 1, 2: 2, 3: 3, 4: 4} | ({} if out == OUT_UPDATE else {5: 5})
    aliases |= {6: 0} if out == ha.OUT_PARAM else {}
    call = jax.ffi.ffi_call(_TARGET, (*shapes, w_shape), input_output_aliases=aliases)
    maps, above, keys = (jnp.asarray(t) for t in _tables())
    w_in = w if (decay or out != OUT_UPDATE) else ha.placeholder()
    low_in = low if out in (ha.OUT_DELTA, ha.OUT_PARAM) else ha.placeholder()
    r, mc, ms, vc, vs, new_w = call(
      g, mc, ms, vc, vs, w_in, low_in, maps, above, keys, vector, decay=decay, out=np.int32(out)
    )
    if out == ha.OUT_NONE:
      r = new_w
    return r, mc, ms, vc, vs, (w if out == OUT_UPDATE else new_w)

  mc, ms, vc, vs = codes
  if out == OUT_UPDATE and g.dtype != jnp.float32:
    r, *rest = plain(g, mc, ms, vc, vs, w, low, vector)  # the kernel writes float32 updates
  else:
    w = ha.placeholder() if w is None else w
    low = w if low is None else low
    r, *rest = ffi.on_cpu(native, plain, g, mc, ms, vc, vs, w, low, vector)
  return r, tuple(rest[:4]), rest[4]
