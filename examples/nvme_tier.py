"""Train a small MLP with its Adam state on disk, in a cache smaller than the state.

Run from the repository root:

    python examples/nvme_tier.py --steps 200 --dir /tmp/offlax-nvme-run

The optimizer is `offlax.offload(optax.adam(...), offlax.NVMeTier(dir, ...))`.
Its state (two moments, ~8 bytes per parameter) lives in tensorstore arrays under
`--dir`; only `--cache-kib` of it stays in RAM between steps, and every step
streams the rest through the jitted update and commits it atomically. Stop the
script at any time (Ctrl-C, or kill -9) and run it again with `--resume`: it
continues from the last committed step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

import offlax


def init_params(key: jax.Array, width: int) -> dict:
  keys = jax.random.split(key, 3)
  return {
    "in": {"kernel": jax.random.normal(keys[0], (1, width)), "bias": jnp.zeros(width)},
    "hidden": {
      "kernel": jax.random.normal(keys[1], (width, width)) / jnp.sqrt(width),
      "bias": jnp.zeros(width),
    },
    "out": {
      "kernel": jax.random.normal(keys[2], (width, 1)) / jnp.sqrt(width),
      "bias": jnp.zeros(1),
    },
  }


def model(params: dict, x: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["in"]["kernel"] + params["in"]["bias"])
  h = jnp.tanh(h @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  return h @ params["out"]["kernel"] + params["out"]["bias"]


def main(argv: list[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--dir", default=None, help="store directory (default: a fresh temp dir)")
  parser.add_argument("--resume", action="store_true", help="continue the run stored in --dir")
  parser.add_argument("--cache-kib", type=int, default=64, help="state kept in RAM between steps")
  parser.add_argument(
    "--chunk-kib", type=int, default=256, help="slice size of the streamed update"
  )
  args = parser.parse_args(argv)
  path = args.dir or tempfile.mkdtemp(prefix="offlax-nvme-")

  params = init_params(jax.random.key(0), args.width)
  x = jnp.linspace(-3, 3, 512)[:, None]
  y = jnp.sin(x) + 0.05 * jax.random.normal(jax.random.key(1), x.shape)
  state_bytes = 2 * sum(p.nbytes for p in jax.tree.leaves(params))

  tier = offlax.NVMeTier(
    path, cache_bytes=args.cache_kib * 1024, chunk_bytes=args.chunk_kib * 1024, resume=args.resume
  )
  tx = offlax.offload(optax.adam(5e-4), tier)
  opt_state = tx.init(params)
  first = int(opt_state.step)
  print(
    f"store {path}: Adam state {state_bytes / 2**20:.1f} MiB, cache {args.cache_kib} KiB, "
    f"starting at step {first}"
  )
  if first:
    # Params are the caller's to save (e.g. with orbax); this example replays
    # them from the optimizer-free start for simplicity.
    print("note: params restart from their initial values; the optimizer state resumes")

  @jax.jit
  def train_step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((model(p, x) - y) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  start = time.perf_counter()
  for i in range(args.steps):
    params, opt_state, loss = train_step(params, opt_state)
    if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
      print(f"step {first + i + 1:4d}  loss {float(loss):.5f}")
  elapsed = time.perf_counter() - start
  print(f"{args.steps} steps in {elapsed:.1f}s; committed step {int(opt_state.step)} in {path}")
  on_disk = [
    x
    for x in jax.tree.leaves(
      opt_state.inner_state, is_leaf=lambda n: isinstance(n, offlax.extend.OnDisk)
    )
    if isinstance(x, offlax.extend.OnDisk)
  ]
  stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
  print(f"{len(on_disk)} state arrays on disk; the store holds {stored / 2**20:.1f} MiB")
  tier.close()
  return float(loss)


if __name__ == "__main__":
  main()
