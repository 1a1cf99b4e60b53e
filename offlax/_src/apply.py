"""Applying updates to params that may live in host memory, fused with the update where it can."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import errors, memory, multi_steps, wrapped_apply
from offlax._src.compat import compute_on
from offlax._src.tier import OffloadState

# Rows of a host leaf that `apply_updates` adds in one host computation: a
# bound on host temporaries, large enough that a loop step is not overhead.
APPLY_CHUNK_BYTES = 64 * 2**20


class FusedTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that can also run its update fused with `apply_updates`.

  It is an `optax.GradientTransformationExtraArgs` (``init``, ``update``) with
  one more attribute, ``update_and_apply(grads, state, params, **extra_args)
  -> (new_params, new_state)``, whose result is that of
  ``optax.apply_updates(params, update(grads, state, params)[0])``.
  `offlax.offload`, `offlax.adam`, `offlax.adamw` and `offlax.master_weights`
  return one; `fused_update_and_apply` reads it.

  ``update_and_apply`` is an attribute, not a third tuple field: optax's
  combinators unpack transformations as ``(init, update)`` pairs
  (``optax.chain`` zips them). A transformation rebuilt from the pair (by a
  wrapper, or by ``_replace``) is a plain one: its step is update, then apply.
  """

  update_and_apply: Callable[..., tuple[Any, Any]] | None = None

  def __new__(cls, init, update, update_and_apply=None):
    self = super().__new__(cls, init, update)
    self.update_and_apply = update_and_apply
    return self


def fused_update_and_apply(tx: Any) -> Callable[..., tuple[Any, Any]] | None:
  """The fused step of `tx` (its update and `apply_updates` in one), or None if it has none.

  Args:
    tx: a transformation.

  Returns:
    ``update_and_apply(grads, state, params, **extra_args) -> (new_params,
    new_state)`` for a `FusedTransformation` (`offlax.offload`, `offlax.adam`,
    `offlax.adamw`, `offlax.master_weights`), else None: a wrapper around one
    (``optax.chain(clip, offload(...))``) runs its update, then `apply_updates`.

  Example:
    >>> import optax, offlax
    >>> from offlax._src.apply import fused_update_and_apply
    >>> fused_update_and_apply(offlax.offload(optax.adam(1e-3))) is not None
    True
    >>> fused_update_and_apply(optax.adam(1e-3)) is None
    True
  """
  if isinstance(tx, FusedTransformation):
    return tx.update_and_apply
  if isinstance(tx, optax.MultiSteps):  # gradient accumulation around a fused step
    inner = fused_update_and_apply(tx.inner_opt)
    if inner is None or not multi_steps.default_skip(tx):
      return None  # optax's own update, then apply_updates (init refuses host params)
    return multi_steps.fused(tx, inner)
  return None


def apply_updates(params: optax.Params, updates: optax.Updates) -> optax.Params:
  """`optax.apply_updates` for params that may live in host memory.

  Leaves in device memory are added as optax adds them. A param in host
  memory is updated by the host CPU, in slices written back into its buffer
  (in place when the params are donated), with its update taken from host
  memory (as `offlax.offload` returns it for gradients in host memory) or
  from the device. The arithmetic is optax's: ``(p + u).astype(p.dtype)``.

  Args:
    params: the params.
    updates: updates of the params' structure, e.g. from `offlax.offload`.

  Returns:
    The new params, each leaf in the memory its param was in.

  Example:
    >>> import jax, jax.numpy as jnp, offlax
    >>> host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    >>> params = {"w": jax.device_put(jnp.ones(4), host)}
    >>> new = jax.jit(offlax.extend.apply_updates)(params, {"w": jnp.full(4, 0.5)})
    >>> new["w"], new["w"].sharding.memory_kind
    (Array([1.5, 1.5, 1.5, 1.5], dtype=float32), 'pinned_host')
  """
  return jax.tree.map(_apply, params, updates, is_leaf=lambda x: x is None)


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: optax.Updates,
  state: optax.OptState,
  params: optax.Params,
  **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
  """One optimizer step: ``tx.update`` then `apply_updates`, fused where `tx` is offlax's.

  For `offlax.offload(...)` each slice of the streamed (or host) update adds
  its updates to its piece of the params and writes the new params over the
  old: no model-sized updates buffer exists on the device or the host, and
  `offlax.master_weights`' fp32 updates of bf16 params never leave the slice.
  This is the step for params and gradients in host memory
  (`offlax.scan_layers`). Inside an optax wrapper (``optax.chain(clip,
  offload(...))``, ``optax.masked``, ``optax.inject_hyperparams``) an
  `offload` whose updates are the step's runs the same fused step; one whose
  updates another transformation reads (``chain(offload(...), scale)``), and
  any other transformation, runs its update, then `apply_updates`. The result
  is that of ``optax.apply_updates(params, tx.update(grads, state, params)[0])``.

  Args:
    tx: the transformation.
    grads: the gradients.
    state: `tx`'s state.
    params: the params (donate them to the jitted step: they are updated in place).
    **extra_args: passed to ``tx.update``.

  Returns:
    ``(new_params, new_state)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> params = {"w": jnp.ones(3)}
    >>> tx = offlax.offload(optax.sgd(0.5))
    >>> state = tx.init(params)
    >>> params, state = jax.jit(offlax.update_and_apply, static_argnums=0)(
    ...   tx, {"w": jnp.ones(3)}, state, params)
    >>> params["w"]
    Array([0.5, 0.5, 0.5], dtype=float32)
  """
  fused = fused_update_and_apply(tx)
  if fused is not None:
    return fused(grads, state, params, **extra_args)
  try:
    if params is not None and holds_offload_state(state):
      done = wrapped_apply.update_and_apply(tx, grads, state, params, extra_args, _apply)
      if done is not None:
        return done
    updates, state = tx.update(grads, state, params, **extra_args)
  except ValueError as e:
    if not memory.mixed_operands(e) or not memory.any_on_host(grads):
      raise
    raise errors.MemoryKindError(
      "update_and_apply: the gradients live in host memory, and a transformation outside "
      "offlax.offload computed on them (only offload's update runs in host memory); put the "
      "whole transformation inside: offlax.offload(optax.chain(...), tier) "
      f"({type(e).__name__}: {str(e).splitlines()[0]})"
    ) from e
  return apply_updates(params, updates), state


def holds_offload_state(state: Any) -> bool:
  """Whether `state` (any transformation's) holds an `offload`'s state."""
  is_state = lambda x: isinstance(x, OffloadState)
  return any(is_state(x) for x in jax.tree.leaves(state, is_leaf=is_state))


def _apply(p: Any, u: Any) -> Any:
  if u is None:
    return p
  if not memory.on_host(p):
    return optax.apply_updates(p, u)
  u = u if memory.on_host(u) else memory.to_host(u)
  add = compute_on(_add, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
  rows = _rows_per_chunk(p)
  if rows is None:
    return add(p, u)

  def body(i, p):
    start = i * rows
    piece = add(*(jax.lax.dynamic_slice_in_dim(x, start, rows) for x in (p, u)))
    return jax.lax.dynamic_update_slice_in_dim(p, piece, start, 0)

  n = p.shape[0] // rows
  p = jax.lax.fori_loop(0, n, body, p)
  if n * rows < p.shape[0]:  # the rows left over (sliced inside the host computation)
    tail = compute_on(
      lambda p, u: _add(p[n * rows :], u[n * rows :]),
      compute_type="device_host",
      out_memory_spaces=jax.memory.Space.Host,
    )(p, u)
    p = jax.lax.dynamic_update_slice_in_dim(p, tail, n * rows, 0)
  return p


def _add(p, u):
  p, u = memory.as_device_value(p), memory.as_device_value(u)
  return jnp.asarray(p + u).astype(p.dtype)


def _rows_per_chunk(p: Any) -> int | None:
  """Rows of `p` per host computation, or None: add the whole leaf at once."""
  nbytes = int(np.prod(np.shape(p), dtype=np.int64)) * jnp.dtype(p.dtype).itemsize
  if np.ndim(p) == 0 or nbytes <= APPLY_CHUNK_BYTES or np.shape(p)[0] < 2:
    return None
  return max(1, p.shape[0] * APPLY_CHUNK_BYTES // nbytes)
