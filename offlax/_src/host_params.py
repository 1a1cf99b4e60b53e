"""Params and gradients in host memory: fetched where used, initialised and applied on the host.

A model too big for the device keeps its params in ``pinned_host`` arrays; a
step fetches each to the device where it is used (`fetch`, or layer by layer
with `offlax.scan_layers`), and autodiff returns their gradients in host memory
(the transpose of a host -> device copy is a device -> host copy). What the
optimizer does with them must not compute on host memory outside a host
computation: XLA's GPU compiler would convert each such op into slow host
compute of its own, and the CPU backend would silently accept it. So the
inner state is built here (`init`) inside ``compute_on("device_host")``, and
updates are applied by `offlax._src.apply`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from offlax._src import layout as layout_lib
from offlax._src import memory, multi_steps
from offlax._src import sharding as sharding_lib
from offlax._src.compat import compute_on

# One definition of "in host memory" (`memory.py`), under the names other modules use here.
on_host = memory.on_host
any_on_host = memory.any_on_host
as_device_value = memory.as_device_value


def fetch(tree: Any) -> Any:
  """`tree` with its host-memory leaves copied to the device; other leaves as they are.

  Use it inside `jax.jit` where a param kept in host memory is used (an
  embedding, a final norm); its gradient comes back in host memory. Layers
  stacked along a leading axis are better fetched one at a time by
  `offlax.scan_layers`.

  Args:
    tree: a pytree of arrays.

  Returns:
    The same tree, every host leaf replaced by its device copy.

  Example:
    >>> import jax, jax.numpy as jnp, offlax
    >>> host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    >>> w = jax.device_put(jnp.ones(3), host)
    >>> jax.jit(lambda w: offlax.fetch(w) * 2)(w)
    Array([2., 2., 2.], dtype=float32)
  """
  return jax.tree.map(lambda x: memory.to_device(x) if memory.on_host(x) else x, tree)


def to_host(tree: Any, memory_kind: str = "pinned_host") -> Any:
  """`tree`'s arrays moved to host memory, each kept on its devices and sharding.

  An array on a mesh keeps its `NamedSharding`; an array on one device gets a
  one-device `NamedSharding`, as offlax places state: JAX 0.10 types a
  `SingleDeviceSharding` in host memory as device memory in specs built from it
  (an orbax restore target, AOT lowering), and a `NamedSharding` keeps it.

  The first call installs offlax's patch of `optax.MultiSteps.init`
  (docs/patches.md): for params in host memory it makes the accumulator there,
  where optax's own init fails (JAX's "Memory kind mismatch").

  Args:
    tree: a pytree of arrays (e.g. ``nnx.state(model.blocks)``).
    memory_kind: ``"pinned_host"`` (what transfers need to be fast) or
      ``"unpinned_host"``.

  Returns:
    The tree, in host memory.

  Example:
    >>> import jax.numpy as jnp, offlax
    >>> offlax.to_host({"w": jnp.ones(3)})["w"].sharding.memory_kind
    'pinned_host'
  """
  multi_steps.install()
  return placed_on_host(tree, memory_kind)


def placed_on_host(tree: Any, memory_kind: str = "pinned_host") -> Any:
  """`to_host` without its patch: offlax's own moves."""

  def move(x):
    if not isinstance(x, jax.Array):
      return x
    sharding = x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
      (device,) = sharding.device_set
      mesh = sharding_lib.one_device_mesh(device)
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put(x, sharding.with_memory_kind(memory_kind))

  return jax.tree.map(move, tree)


def init(init_fn: Any, params: Any, *, via_host: bool = False) -> Any:
  """`init_fn(params)` run in a host computation when some param lives in host memory.

  The state of a model whose params do not fit on the device must not pass
  through it: it is computed on the host CPU and returned in host memory
  (the tier then moves scalars such as a step count to the device). With
  `via_host`, device params are copied to host memory first and the state is
  made there too: the host tier's state, made on the device by an eager
  `init_fn`, would hold the device's memory all at once (8 B/param for Adam)
  before it moves, and not fit where the tier is needed.
  """
  if via_host:
    params = jax.tree.map(_in_host_memory, params)
  if not any_on_host(params):
    return init_fn(params)

  def on_cpu(params):
    return init_fn(jax.tree.map(as_device_value, params))

  run = compute_on(on_cpu, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
  mesh, _ = layout_lib.mesh_of(jax.tree_util.tree_flatten_with_path(params)[0])
  if mesh is None:
    return jax.jit(run)(params)
  # A mesh with Explicit axes types the arrays with it: the jitted call must run inside it.
  with jax.set_mesh(mesh):
    return jax.jit(run)(params)


def _in_host_memory(x: Any) -> Any:
  """`x` copied to host memory, with its sharding.

  An array is copied eagerly, leaf by leaf (nothing model-sized passes through
  the device); a traced value by the program's own transfer.
  """
  if not hasattr(x, "dtype") or memory.on_host(x):
    return x
  if isinstance(x, jax.core.Tracer):
    return memory.to_host(x)
  return placed_on_host(x)


def zeros_like(x: Any, dtype: Any, *, host: bool) -> Any:
  """Zeros of `x`'s shape (and sharding) in `dtype`: in host memory (made by the CPU) or not."""
  if not host:
    return jnp.zeros_like(x, dtype=dtype)
  make = compute_on(
    lambda: jnp.zeros(x.shape, dtype),
    compute_type="device_host",
    out_memory_spaces=jax.memory.Space.Host,
  )
  return make()


def global_norm(tree: Any) -> jax.Array:
  """`optax.global_norm(tree)`, on the device, for a tree with leaves in host memory.

  A gradient the step copied to the host (a backward pass through params in
  host memory) is summed on the device, from the value copied
  (`memory.device_source`): one host copy of it, as without the norm. Other
  host leaves (program inputs) are summed on the host CPU, where they lie, in
  one host computation: passed in flat (`memory.flat`), summed in their own
  shapes (optax's rounding); only those scalars cross to the device. One
  computation, not one a leaf: JAX lowers equal-shaped leaves' computations to
  one function called from several places, and XLA:GPU's host-compute wrapper
  then aborts the process compiling its reduction (a Tunix Qwen3's gradients).
  """

  def square_sum(x):
    x = memory.as_device_value(x)
    return jnp.sum(jnp.square(x.real) + jnp.square(x.imag))

  leaves = [_device_value(x) for x in jax.tree.leaves(tree)]
  host = [x for x in leaves if memory.on_host(x)]
  on_host = compute_on(
    # Summed in the leaves' shapes: a flat sum may round differently (optax's norm differs).
    lambda xs: [
      square_sum(memory.as_device_value(x).reshape(h.shape)) for x, h in zip(xs, host, strict=True)
    ],
    compute_type="device_host",
    out_memory_spaces=jax.memory.Space.Host,
  )
  host_sums = iter(on_host([memory.flat(x) for x in host]) if host else ())
  # Added in the leaves' order, as optax adds them.
  sums = [memory.to_device(next(host_sums)) if memory.on_host(x) else square_sum(x) for x in leaves]
  return jnp.sqrt(sum(sums)) if sums else jnp.zeros(())


def _device_value(x: Any) -> Any:
  """`x`, or the device value the step copied to the host as `x`."""
  source = memory.device_source(x) if memory.on_host(x) else None
  return x if source is None else source
