"""`master_weights`: a high-precision copy of the params kept in the optimizer state."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from offlax._src import apply as apply_lib
from offlax._src import errors, host_adam
from offlax._src.host_adam import OUT_DELTA, OUT_PARAM


class MasterWeightsState(NamedTuple):
  """State of `master_weights`.

  Attributes:
    master: the params in the master dtype; the inner transformation updates these.
    inner_state: the inner transformation's state, built on `master`.
  """

  master: Any
  inner_state: Any


def master_weights(
  inner: optax.GradientTransformation, *, dtype: Any = jnp.float32
) -> apply_lib.FusedTransformation:
  """Updates a `dtype` master copy of the params and returns updates that round to it.

  Mixed precision as in ZeRO-Offload: the model's params are low precision
  (e.g. bf16) and the optimizer keeps an fp32 master copy. Each update casts
  the gradients to `dtype`, runs `inner` on the master params, and returns, in
  `dtype`, the difference between the new master rounded to each param's dtype
  and the param, so that `optax.apply_updates(params, updates)` gives exactly
  the rounded master. Small steps that a bf16 param cannot represent
  accumulate in the master instead of being lost.

  The master is per-parameter state, so `offlax.offload(master_weights(inner))`
  keeps it in the tier and streams it with the moments (or updates it on the
  host with ``HostTier(compute="host")``). Leaves that are not floating point
  are passed through: their updates are returned as `inner` returns them.

  With `offlax.adam` or `offlax.adamw` as `inner` (float32 master, float32 or
  bfloat16 params and gradients), the step runs on XLA:CPU as one native pass
  over memory, in place: moments and master updated, the update (or, with
  `offlax.update_and_apply`, the new params) written, ZeRO-Offload's host
  step. Its results are `master_weights(optax.adamw(...))`'s to rounding (see
  `offlax.adam`).

  Args:
    inner: the transformation to run on the master params.
    dtype: the master dtype.

  Returns:
    A `FusedTransformation` (an `optax.GradientTransformationExtraArgs`) whose state is a
    `MasterWeightsState`; `update` requires `params`.

  Example:
    >>> import jax.numpy as jnp, optax, offlax
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> tx = offlax.master_weights(optax.sgd(1e-4))
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
    >>> optax.apply_updates(params, updates)["w"]  # 1 - 1e-4 rounds back to 1 in bf16
    Array([1, 1, 1], dtype=bfloat16)
    >>> state.master["w"]  # ... but the master moved
    Array([0.9999, 0.9999, 0.9999], dtype=float32)
  """
  errors.check_transformation(inner, "master_weights: inner")
  inner = optax.with_extra_args_support(inner)
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise errors.InvalidTierError(f"master_weights: dtype must be floating point, got {dtype}.")

  def to_master(x):
    return jnp.asarray(x, dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x

  def init_fn(params):
    master = jax.tree.map(to_master, params)
    return MasterWeightsState(master, inner.init(master))

  # `offlax.adam`/`adamw` run the whole step (moments, master, new params) in
  # one native pass on XLA:CPU; None where they cannot (other dtypes, no library).
  whole_step = (
    inner.whole_step
    if isinstance(inner, host_adam.AdamTransformation) and dtype == jnp.float32
    else None
  )

  def check_params(params):
    if params is None:
      raise errors.TreeMismatchError(
        "master_weights.update needs params: the updates it returns are the rounded new "
        "master minus the params."
      )

  def update_fn(updates, state, params=None, **extra_args):
    check_params(params)
    if whole_step is not None and (
      done := whole_step(updates, state.inner_state, state.master, params, out=OUT_DELTA)
    ):
      delta, inner_state, master = done
      return delta, MasterWeightsState(master, inner_state)
    grads = jax.tree.map(to_master, updates)
    steps, inner_state = inner.update(grads, state.inner_state, state.master, **extra_args)
    master = optax.apply_updates(state.master, steps)

    def delta(new, p, step):
      if not jnp.issubdtype(jnp.result_type(p), jnp.floating):
        return step
      # Both operands are exact in `dtype` (the rounded master and the param),
      # so p + delta recovers the rounded master exactly in apply_updates.
      return new.astype(jnp.result_type(p)).astype(dtype) - jnp.asarray(p, dtype)

    out = jax.tree.map(delta, master, params, steps)
    return out, MasterWeightsState(master, inner_state)

  def update_and_apply_fn(grads, state, params, **extra_args):
    """`offlax.update_and_apply`: the new params written by the same pass as the master."""
    check_params(params)
    if whole_step is not None and (
      done := whole_step(grads, state.inner_state, state.master, params, out=OUT_PARAM)
    ):
      new_params, inner_state, master = done
      return new_params, MasterWeightsState(master, inner_state)
    updates, state = update_fn(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state

  return apply_lib.FusedTransformation(init_fn, update_fn, update_and_apply_fn)


def rounds_to_master(tx: Any) -> bool:
  """Whether `tx`'s new floating params are its new master rounded, whatever they held.

  True for a `master_weights` and for its ``update`` as a chain holds it (`optax.chain`
  keeps the function, `layer_store.clip.split` takes it out): its update is the rounded
  master minus the params, so the params plus it is the rounded master for any finite
  params (zeros included). A step that keeps the params on disk need not read them
  (`layer_store.step`); leaves that are not floating point still need theirs.

  Args:
    tx: a transformation, or its ``update`` function.

  Returns:
    Whether `tx` is a `master_weights` (recognised by its update's code, never guessed).

  Example:
    >>> import optax, offlax
    >>> from offlax._src.master import rounds_to_master
    >>> rounds_to_master(offlax.master_weights(optax.adam(1e-3)))
    True
    >>> rounds_to_master(optax.adam(1e-3))
    False
  """
  update = getattr(tx, "update", tx)
  return getattr(update, "__code__", None) is _update_code()


@functools.cache
def _update_code() -> Any:
  return master_weights(optax.identity()).update.__code__
