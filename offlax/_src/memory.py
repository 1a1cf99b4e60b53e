"""Memory kinds: whether a value lives in host or device memory, and the moves between them.

Inside `jax.jit`, JAX 0.10 types one host memory space, ``pinned_host``
(`jax.memory.Space.Host`), in a value's type (`jax.typeof(x).memory_space`);
a `jax.ShapeDtypeStruct` names its memory in its sharding instead. Every
module asks here, so that "on the host" means one thing.
"""

from __future__ import annotations

from typing import Any

import jax

# The memory kinds of host RAM a sharding may name.
HOST_KINDS = ("pinned_host", "unpinned_host")


def on_host(x: Any) -> bool:
  """Whether `x` (an array, tracer or `ShapeDtypeStruct`) lives in host memory."""
  if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "dtype"):
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind in HOST_KINDS
  try:
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
  except TypeError:
    return False


def any_on_host(tree: Any) -> bool:
  """Whether some leaf of `tree` lives in host memory."""
  return any(on_host(x) for x in jax.tree.leaves(tree))


def to_host(x: Any) -> Any:
  """`x` moved to host memory (``pinned_host``); valid inside and outside `jit`."""
  return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: Any) -> Any:
  """`x` moved to device memory; valid inside and outside `jit`."""
  return jax.device_put(x, jax.memory.Space.Device)


def as_device_value(x: Any) -> Any:
  """`x` typed as a device value, as values inside a host computation must be.

  Ops in a host computation make constants typed as device values, and an op
  needs one memory space; the data does not move (it is a relabel).
  """
  if not hasattr(x, "dtype") or not on_host(x):
    return x
  return to_device(x)


def flat(x: Any) -> Any:
  """`x` as a 1-D array: how a gradient goes into a host computation.

  XLA:GPU gives a matmul's gradient the layout its dot prefers (``{0,1}`` for a
  transposed weight), then fails its own check that a host computation's
  parameter has the layout it was built with (``{1,0}``: "The async-start
  expects the async shape ... to match"). A 1-D array has one layout, and the
  reshape costs no copy: XLA has the dot write row-major and bitcasts it.
  """
  return x.reshape(-1)


def device_source(x: Any) -> Any | None:
  """The device value the current trace copied to host memory as `x`, or None.

  A backward pass through params in host memory makes each gradient on the
  device and copies it to the host (the transpose of the forward's
  `device_put`). What reads that gradient on the device (a norm) should read
  the device value: read from the host copy, XLA:GPU hoists whatever the read
  needs first (a reshape) to the device and copies the gradient a second time.

  This reads JAX's record of the traced operation that made `x` (a tracer's
  `parent` and `val`: JAX 0.10's tracing internals); anything else (a program
  input, a loop carry, a value made on the host, another JAX) gives None, and
  the caller reads the host value (`tests/test_offload_params.py` holds that a
  step's gradients are found).
  """
  eqn: Any = getattr(x, "parent", None)
  if getattr(getattr(eqn, "primitive", None), "name", None) != "device_put":
    return None
  try:
    source = eqn.in_tracers[[v is x.val for v in eqn.outvars].index(True)]
  except (AttributeError, IndexError, ValueError):
    return None
  return None if on_host(source) else source


def sharding_kind(x: Any) -> str:
  """``"host"`` or ``"device"``: the memory a concrete array's or spec's sharding names.

  The sharding, not the type: JAX 0.10 types an array with a one-device
  sharding in ``pinned_host`` as device memory, and it still lives on the
  host. Tracers count as device values.
  """
  concrete = isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and not isinstance(x, jax.core.Tracer)
  kind = getattr(x.sharding, "memory_kind", None) if concrete else None
  return "host" if kind in HOST_KINDS else "device"


def mixed_operands(error: BaseException) -> bool:
  """Whether `error` was raised where an operation met operands in two memory spaces.

  JAX refuses such an operation while tracing it (a `ValueError` from its
  type rule). This reads the types of the values in the frame that raised the
  error (JAX's type rule, or with JAX's traceback filtering the `jnp` function
  that called it), not the error's text.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from offlax._src import memory
    >>> host = jax.device_put(jnp.ones(2), jax.memory.Space.Host)
    >>> try:
    ...   jax.jit(lambda a, b: a + b)(host, jnp.ones(2))
    ... except ValueError as e:
    ...   memory.mixed_operands(e)
    True
    >>> memory.mixed_operands(ValueError("memory_space"))
    False
  """
  tb = error.__traceback__
  if tb is None:
    return False
  while tb.tb_next is not None:
    tb = tb.tb_next
  spaces = set()
  for value in tb.tb_frame.f_locals.values():
    for x in value if isinstance(value, (tuple, list)) else (value,):
      aval = x if isinstance(x, jax.core.ShapedArray) else None
      if isinstance(x, (jax.Array, jax.core.Tracer)):
        aval = jax.typeof(x)
      if aval is not None and aval.ndim:  # (JAX's rule lets scalars mix)
        spaces.add(getattr(aval, "memory_space", None))
  return len(spaces - {None, jax.memory.Space.Any}) > 1
