"""Quickstart: train a small MLP with its Adam state in host memory.

Run from the repository root:

    python examples/quickstart.py --steps 300

A two-layer MLP learns a noisy sine. The optimizer is
`offlax.offload(optax.adamw(...))`: its moments live in `pinned_host` memory and
are streamed through the device in slices inside the jitted step. The script
prints the loss, then where each part of the state lives.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import offlax


def init_params(key: jax.Array, width: int) -> dict:
  k1, k2 = jax.random.split(key)
  return {
    "hidden": {"kernel": jax.random.normal(k1, (1, width)), "bias": jnp.zeros(width)},
    "out": {"kernel": jax.random.normal(k2, (width, 1)) / jnp.sqrt(width), "bias": jnp.zeros(1)},
  }


def model(params: dict, x: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  return h @ params["out"]["kernel"] + params["out"]["bias"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((model(params, x) - y) ** 2)


def main(argv: list[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument(
    "--chunk-bytes",
    type=int,
    default=2048,
    help="slice size of the streamed state (small here to show streaming)",
  )
  args = parser.parse_args(argv)

  key = jax.random.key(0)
  params = init_params(key, args.width)
  x = jnp.linspace(-3, 3, 512)[:, None]
  y = jnp.sin(x) + 0.05 * jax.random.normal(jax.random.key(1), x.shape)

  tx = offlax.offload(optax.adamw(3e-3, weight_decay=1e-4), chunk_bytes=args.chunk_bytes)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  start = time.perf_counter()
  for step in range(args.steps):
    params, opt_state, loss = train_step(params, opt_state)
    if step % max(1, args.steps // 6) == 0 or step == args.steps - 1:
      print(f"step {step:4d}  loss {float(loss):.5f}")
  print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s on {jax.devices()[0]}")

  print("where the optimizer state lives:")
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    name = jax.tree_util.keystr(path)
    print(f"  {name:55s} {str(leaf.shape):12s} {leaf.sharding.memory_kind}")
  return float(loss)


if __name__ == "__main__":
  main()
