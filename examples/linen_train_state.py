"""Flax Linen: a `TrainState` whose optimizer state lives in host memory.

Run from the repository root (seconds on a CPU):

    python examples/linen_train_state.py --steps 200
    python examples/linen_train_state.py --steps 200 --compute host

A small convolutional classifier learns to tell horizontal from vertical
stripes (images made here). The only change from a plain Linen training loop
is the `tx`: `offlax.offload(offlax.adamw(...), offlax.HostTier(...))`;
`TrainState.create` and `state.apply_gradients` work as they are.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import offlax


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
    return nn.Dense(2)(x.reshape(x.shape[0], -1))


def stripes(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """Noisy 16x16 images of horizontal (label 0) or vertical (label 1) stripes."""
  labels = rng.integers(0, 2, n)
  phase = rng.integers(0, 4, n)[:, None]
  wave = (np.arange(16)[None, :] + phase) % 4 < 2
  images = np.where(labels[:, None, None], wave[:, None, :], wave[:, :, None]).astype(np.float32)
  images += 0.3 * rng.standard_normal(images.shape).astype(np.float32)
  return images[..., None], labels.astype(np.int32)


def main(argv: list[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--compute", choices=("device", "host"), default="device")
  args = parser.parse_args(argv)

  rng = np.random.default_rng(0)
  module = CNN()
  params = module.init(jax.random.key(0), jnp.zeros((1, 16, 16, 1)))["params"]
  tx = offlax.offload(offlax.adamw(1e-3), offlax.HostTier(compute=args.compute))
  state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)

  @jax.jit
  def step(state, images, labels):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  for i in range(args.steps):
    state, loss = step(state, *stripes(32, rng))
    if i % 50 == 0 or i == args.steps - 1:
      print(f"step {i:4d}  loss {float(loss):.4f}")
  images, labels = stripes(512, rng)
  accuracy = float((state.apply_fn({"params": state.params}, images).argmax(-1) == labels).mean())
  kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state) if x.ndim})
  print(f"accuracy {accuracy:.3f}; optimizer state in {kinds}")
  return accuracy


if __name__ == "__main__":
  main()
