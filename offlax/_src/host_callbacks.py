"""Python host callbacks that `offlax.compile_for_gpu` can lower for CUDA from a CPU machine.

`jax.pure_callback` and `jax.experimental.io_callback` ask the lowering's
backend for its platform, and `compile_for_gpu` lowers for CUDA with CPU
devices (their shardings carry the memory kinds): JAX then refuses ("the
platform for the specified backend cpu is different from the lowering
platform cuda"). On a GPU such a callback lowers to one FFI custom call,
``xla_ffi_python_gpu_callback``, whose attribute ``index`` names the Python
function among the executable's callbacks; so while `compile_for_gpu` lowers
(`lowering_for_gpu`), `call` emits that custom call itself. The compiled
program is the one a GPU run would have (same operands, results and side
effect), for its memory figures; it is never run, so no function is behind the
index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import config as jax_config
from jax.experimental import io_callback

# A JAX config state, not a context variable: it is part of the trace context, so a
# function traced for the CPU is traced again, not taken from JAX's caches.
_FOR_GPU = jax_config.bool_state(
  name="offlax_callbacks_lowered_for_gpu",
  default=False,
  help="Lower offlax's host callbacks as XLA:GPU's Python callback custom call.",
  include_in_trace_context=True,
)

GPU_TARGET = "xla_ffi_python_gpu_callback"


def lowering_for_gpu() -> contextlib.AbstractContextManager:
  """Traces inside emit GPU callback custom calls (`compile_for_gpu` traces so)."""
  return _FOR_GPU(True)


def for_gpu() -> bool:
  """Whether the trace lowers for a GPU from CPU devices (inside `lowering_for_gpu`)."""
  return bool(_FOR_GPU.value)


def call(
  fn: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct], *args: Any, side_effect: bool
) -> list[Any]:
  """`fn(*args)` on the host, its results (`avals`) in device memory.

  Args:
    fn: the host function (numpy arrays in, numpy arrays out).
    avals: its results' shapes and dtypes.
    *args: its operands.
    side_effect: an `io_callback` (kept even where its results are unused, and
      run once per call) rather than a `jax.pure_callback`.

  Returns:
    The results, a list.
  """
  if _FOR_GPU.value:
    custom = jax.ffi.ffi_call(GPU_TARGET, list(avals), has_side_effect=side_effect)
    return list(custom(*args, index=np.uint64(0)))
  if side_effect:
    return list(io_callback(fn, list(avals), *args, ordered=False))
  return list(jax.pure_callback(fn, list(avals), *args))
