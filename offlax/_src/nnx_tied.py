"""A param used by several units in one step (a tied embedding): its gradient summed on the device.

`offload_params` runs each use of a module's params in its own rematerialised unit
(`nnx_params.remat_call`), which fetches them from host memory: a tied embedding's
``__call__`` (the embedding) and its ``attend`` (the head, as Gemma 3, Llama 3.2 and
small Qwen 3 models have) are two units reading one param. The transpose of a fetch is
a copy to host memory, so the two uses gave two copies and JAX summed the cotangents in
host memory, which XLA's GPU compiler turns into host compute (``add_any``) of the
param's size every step.

Each use takes instead, beside the param, its *carrier* (`carrier`): a device value of the
param's shape that nothing reads in the forward pass (XLA removes it) and whose cotangent
is the unit's gradient of the param, on the device. A param has one carrier within a call
of the model (`sharing`), so JAX sums its uses' gradients on the device, and the carrier's
own transpose copies the sum to host memory once. The cost: the first use's gradient waits
on the device for the last one's (the param's size, in the backward pass).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp

from offlax._src import memory

_LOCAL = threading.local()


@contextlib.contextmanager
def sharing() -> Iterator[None]:
  """Within it (the outermost call of an offloaded model's method), a param's uses in one
  trace share one carrier; the carriers are dropped when it ends."""
  if getattr(_LOCAL, "carriers", None) is not None:  # an inner call: the outer one's
    yield
    return
  _LOCAL.carriers = {}
  try:
    yield
  finally:
    _LOCAL.carriers = None


def wanted(tree: Any) -> bool:
  """Whether `tree`'s params take carriers: where some are abstract (inside `jax.jit`, where
  XLA drops the carriers' unused zeros). Eagerly they would be computed, a device buffer of
  each param's size, for an eager sum whose memory does not matter."""
  return any(
    isinstance(x, jax.core.Tracer) and x.to_concrete_value() is None for x in jax.tree.leaves(tree)
  )


def carrier(x: Any) -> Any:
  """The carrier of `x`, a param in host memory: a device value whose cotangent, summed over
  the uses that take it, becomes `x`'s in host memory.

  Within `sharing`, the carrier made for `x` in the current trace (else a new one): a
  carrier made in a nested trace is not used outside it (its tracer would escape).

  Args:
    x: an array or tracer in host memory.

  Returns:
    A value of `x`'s shape and dtype on the device (its value unused: zeros).
  """
  carriers = getattr(_LOCAL, "carriers", None)
  trace = jax.extend.core.get_opaque_trace_state(convention="offlax")
  if carriers is not None:
    hit = carriers.get(id(x))
    if hit is not None and hit[0] is x and hit[2] == trace:
      return hit[1]
  made = _carry(x)
  if carriers is not None:  # `x` kept with it: its id stays its own while the entry lives
    carriers[id(x)] = (x, made, trace)
  return made


@jax.custom_vjp
def _carry(x: Any) -> Any:
  # The device copy's zeros: the fetch's sharding, on the device; unused, so XLA drops both.
  return jnp.zeros_like(memory.to_device(x))


def _carry_fwd(x: Any) -> tuple[Any, None]:
  return _carry(x), None


def _carry_bwd(_: None, cotangent: Any) -> tuple[Any]:
  # The uses' gradients summed on the device: one copy of the sum to host memory.
  return (jax.device_put(cotangent, jax.memory.Space.Host),)


_carry.defvjp(_carry_fwd, _carry_bwd)
