"""The Adam step's maths in optax's expressions, shared by the host kernels' JAX twins.

`host_adam.py` (float32 moments) and `host_adam8.py` (8-bit moments) compute,
where their native kernels do not run, exactly what optax computes; the
hyperparameters of a step (`step_hyper`) are those both pass their kernels.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from optax._src import numerics

# What the whole step writes besides the state (native/adam.cc `Out`).
OUT_NONE, OUT_DELTA, OUT_PARAM = 0, 1, 2


@functools.partial(jax.jit, inline=True)
def bias_correction(decay, count):
  # As optax.tree.bias_correction computes it (a jitted function of the decay).
  return 1 - decay**count


def step_hyper(state, learning_rate, betas, weight_decay):
  """(new count, new schedule state, `Hyper`) of this step of an Adam chain, as optax computes them.

  `state`: the chain's state (the Adam state first, the learning rate's last).
  """
  b1, b2, eps, eps_root = betas
  adam_state, lr_state = state[0], state[-1]
  count_inc = numerics.safe_increment(adam_state.count)
  if callable(learning_rate):
    step_size = -1 * learning_rate(lr_state.count)
    lr_state = type(lr_state)(count=numerics.safe_increment(lr_state.count))
  else:
    step_size = -1 * learning_rate
  bc1, bc2 = bias_correction(b1, count_inc), bias_correction(b2, count_inc)
  scheduled = callable(learning_rate)
  hyper = Hyper(b1, b2, bc1, bc2, eps, eps_root, step_size, scheduled, weight_decay)
  return count_inc, lr_state, hyper


class Hyper(NamedTuple):
  """One step's hyperparameters, as optax holds them (Python floats or arrays)."""

  b1: Any
  b2: Any
  bc1: Any  # 1 - b1**count, float32
  bc2: Any
  eps: Any
  eps_root: Any
  step_size: Any  # -learning_rate
  scheduled: bool  # step_size is a schedule's value (optax casts it)
  weight_decay: Any

  def vector(self, moments_only: bool = True) -> jax.Array:
    """The float32 values native/adam.cc reads, in its order.

    Only constants for the moments: sharing the bias corrections with the
    update would change how XLA rewrites the update (and round it differently).
    """
    values: tuple[Any, ...] = (1 - self.b1, self.b1, 1 - self.b2, self.b2)
    if not moments_only:
      values += (self.bc1, self.bc2, self.eps_root, self.eps, self.step_size, self.weight_decay)
    return jnp.stack([jnp.asarray(x, jnp.float32) for x in values])


def moments(g, m, v, hyper: Hyper):
  """The new moments of one leaf, as optax computes them."""
  return (1 - hyper.b1) * g + hyper.b1 * m, (1 - hyper.b2) * (g * g) + hyper.b2 * v


def adam_leaf(g, m, v, p, hyper: Hyper, decay: bool, update_moments=None):
  """(update, m, v) of one leaf in optax's expressions; `update_moments(g, m, v)`: the moments."""
  m, v = moments(g, m, v, hyper) if update_moments is None else update_moments(g, m, v)
  u = (m / hyper.bc1.astype(m.dtype)) / (
    jnp.sqrt(v / hyper.bc2.astype(v.dtype) + hyper.eps_root) + hyper.eps
  )
  if decay:
    u = u + hyper.weight_decay * p
  step_size = jnp.array(hyper.step_size, u.dtype) if hyper.scheduled else hyper.step_size
  return step_size * u, m, v


def placeholder() -> jax.Array:
  """An operand the kernel does not read: a constant, so slicing its leaf is plainly safe."""
  return jnp.zeros((1,), jnp.float32)
