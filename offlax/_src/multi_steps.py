"""`optax.MultiSteps` around offlax's fused update, for params and gradients in host memory.

Gradient accumulation (Tunix's ``gradient_accumulation_steps`` wraps the
transformation in `optax.MultiSteps`) keeps a model-sized accumulator where
the gradients are. With params in host memory that is host memory: optax's
own ``init`` cannot make its zeros there, and its ``update`` would add host
arrays on the device and run the inner update and `optax.apply_updates` at
every micro-step. Here the accumulator is made and updated on the host CPU
(optax's running mean, rounded as optax rounds it), and every k-th micro-step
runs the inner transformation's fused update on it, writing the new params
over the old; the other micro-steps leave params and inner state as they are,
as optax's selects do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import errors, memory, patches
from offlax._src.compat import compute_on

INIT = patches.register(
  patches.Patch(
    name="optax-multisteps-init-host-params",
    target="optax.MultiSteps.init",
    scope="process",
    upstream=(
      "MultiSteps.init makes its accumulator with optax.tree.zeros_like(params), which "
      "for a pinned_host array outside jit builds a device buffer under a host sharding "
      "(optax/transforms/_accumulation.py)"
    ),
    versions="optax 0.2.8, jax 0.10.2",
    failure=(
      "Tunix 0.1.7's PeftTrainer with gradient_accumulation_steps and offload_params "
      "raises 'Memory kind mismatch with xla::PjRtBuffers' in its constructor"
    ),
  )
)


def install() -> None:
  """Makes `optax.MultiSteps.init` place its accumulator in host memory for host params."""

  def wrap(original):
    @functools.wraps(original)
    def init_(self, params):
      if not memory.any_on_host(params):
        return original(self, params)
      return init(self, params)

    return init_

  patches.replace(INIT, optax.MultiSteps, "init", wrap)


def fused(tx: optax.MultiSteps, inner: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
  """`update_and_apply` of `tx`, given its inner transformation's fused step `inner`."""
  return functools.partial(update_and_apply, tx, inner)


def init(tx: optax.MultiSteps, params: Any) -> optax.MultiStepsState:
  """``tx.init(params)`` with the accumulator in host memory where the params are."""
  _check_default_skip(tx)

  def zeros(p):
    dtype = tx._accumulator_dtype or p.dtype
    if not memory.on_host(p):
      return jnp.zeros_like(p, dtype=dtype)
    if isinstance(p, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(p.shape, dtype, sharding=p.sharding)
    return jax.device_put(np.zeros(p.shape, dtype), p.sharding)

  from offlax._src import flax_glue  # it imports `apply`, which imports this module

  acc_grads = jax.tree.map(zeros, flax_glue.unbox(params))
  if flax_glue.in_concrete_variables(params):
    # `nnx.Optimizer`'s params: mapped over their Variables, the accumulator would carry
    # the params' sharding names (Tunix's ('tp', 'fsdp')), which name no axis of the
    # host arrays' one-device mesh, and Tunix's restore (`nnx.get_named_sharding` on
    # that mesh) fails; boxed as `offload` boxes its state, each says where it lives.
    acc_grads = flax_glue.rebox(acc_grads)
  return optax.MultiStepsState(
    mini_step=jnp.zeros([], dtype=jnp.int32),
    gradient_step=jnp.zeros([], dtype=jnp.int32),  # its own buffer: a trainer donates both
    inner_opt_state=tx.inner_opt.init(params),
    acc_grads=acc_grads,
    skip_state=(),
  )


def update_and_apply(
  tx: optax.MultiSteps,
  inner: Callable[..., tuple[Any, Any]],
  grads: Any,
  state: optax.MultiStepsState,
  params: Any,
  **extra_args: Any,
) -> tuple[Any, optax.MultiStepsState]:
  """One micro-step: accumulate `grads`; on the k-th, the fused update on their mean."""
  k_steps = tx._every_k_schedule(state.gradient_step)
  emit = state.mini_step == (k_steps - 1)
  accumulate = functools.partial(_accumulate, tx, n_acc=state.mini_step, emit=emit)
  pairs = jax.tree.map(accumulate, grads, state.acc_grads)
  is_pair = lambda x: isinstance(x, tuple)
  mean = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=is_pair)
  kept = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=is_pair)

  def step(operands):
    mean, inner_state, params = operands
    return inner(mean, inner_state, params, **extra_args)

  def wait(operands):
    _, inner_state, params = operands
    return params, inner_state

  operands = (mean, state.inner_opt_state, params)
  if _in_a_loop(tx, params):
    params, inner_state = _once_or_not(emit, step, operands)
  else:
    params, inner_state = jax.lax.cond(emit, step, wait, operands)
  new_state = optax.MultiStepsState(
    mini_step=optax.safe_increment(state.mini_step) % k_steps,
    gradient_step=emit * optax.safe_increment(state.gradient_step)
    + (1 - emit) * state.gradient_step,
    inner_opt_state=inner_state,
    acc_grads=kept,
    skip_state=state.skip_state,
  )
  return params, new_state


def _in_a_loop(tx: optax.MultiSteps, params: Any) -> bool:
  """Whether the k-th micro-step's update runs as a loop of 0 or 1 trips, not a `lax.cond`.

  XLA:GPU moves values to host memory (a host computation's operands) inside a loop's
  body but not inside a conditional's branch ("Expected computation ... to be called only
  by one caller and that caller to be a While"), which an update computed on the host
  needed: with fp32 or 8-bit state for params on the device, with 8-bit state for params
  in host memory. Compiled by XLA:GPU, the loop costs no device memory beside the
  conditional and less host memory, except for params in host memory streamed through the
  device, where it holds a params-sized device buffer: those keep the conditional.
  """
  tier = getattr(tx.inner_opt, "tier", None)
  return not memory.any_on_host(params) or getattr(tier, "compute", None) == "host"


def _once_or_not(run: Any, step: Callable[[Any], Any], operands: Any) -> Any:
  """``step(operands)`` where `run`, else ``operands``' params and state: a loop of 0 or 1 trips.

  The trip count, known only at run time, is not simplified away (`_in_a_loop`).
  """
  mean, inner_state, params = operands

  def body(carry):
    _, inner_state, params = carry
    params, inner_state = step((mean, inner_state, params))
    return jnp.ones((), bool), inner_state, params

  pending = lambda carry: jnp.logical_not(carry[0])  # carry[0]: the update has run (or won't)
  _, inner_state, params = jax.lax.while_loop(
    pending, body, (jnp.logical_not(run), inner_state, params)
  )
  return params, inner_state


def _accumulate(tx: optax.MultiSteps, g: Any, acc: Any, *, n_acc: Any, emit: Any) -> tuple:
  """(the mean to update with, in `g`'s dtype; the accumulator to keep) of one leaf."""

  def both(g, acc, n_acc, emit):
    g, acc = memory.as_device_value(g), memory.as_device_value(acc)
    g = g.reshape(acc.shape)
    new = tx._acc_update(g, acc, n_acc=n_acc)
    kept = jnp.astype((1 - emit) * new, tx._accumulator_dtype)
    return new.astype(g.dtype), kept

  # Where the accumulator lives decides: gradients on the device added to a host
  # accumulator would otherwise bring it, model-sized, onto the device.
  if not memory.on_host(acc):
    return both(g, acc, n_acc, emit)
  g = g if memory.on_host(g) else memory.to_host(g)
  on_host = compute_on(both, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
  return on_host(memory.flat(g), acc, n_acc, emit)  # reshaped inside


def default_skip(tx: optax.MultiSteps) -> bool:
  """Whether `tx` skips no update (optax's default ``should_skip_update_fn``)."""
  skip = tx._should_skip_update_fn
  return skip.__qualname__ == "MultiSteps.__init__.<locals>.should_skip_update_fn"


def _check_default_skip(tx: optax.MultiSteps) -> None:
  if not default_skip(tx):
    skip = tx._should_skip_update_fn
    raise errors.InvalidOptionError(
      "optax.MultiSteps with params in host memory: should_skip_update_fn "
      f"({skip.__qualname__}) is not supported; drop it, or keep the params on the device."
    )


def layers_accumulation(tx: optax.MultiSteps, gradient_step: Any) -> tuple[Any, bool, Any]:
  """What a `LayerStore` needs to accumulate its layers as `tx` does (`layer_store.micro`).

  Args:
    tx: the `optax.MultiSteps`.
    gradient_step: its state's ``gradient_step`` (traced or not).

  Returns:
    (its k at `gradient_step`, whether it takes the mean, its accumulator's dtype: None where
    it skips updates, which a store cannot do).
  """
  k = tx._every_k_schedule(gradient_step)
  return k, bool(tx._use_grad_mean), tx._accumulator_dtype if default_skip(tx) else None
