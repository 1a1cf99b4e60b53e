"""Train a small language model with its layers' params, gradients and Adam state on disk.

Run from the repository root:

    python examples/nvme_params.py --steps 100 --dir /tmp/offlax-layers-run

The model's stacked blocks live in an `offlax.LayerStore` under `--dir`:
`offlax.scan_layers` reads each block from disk inside the jitted step (a few
blocks in RAM at a time), the backward pass writes each block's gradient back,
and `store.update()` applies AdamW with an fp32 master a block at a time on
the CPU and commits params and state together. The embedding stays in memory
with a plain optax AdamW, and each commit takes it and its state along
(`update(rest=...)`): blocks and embedding are always of one step.

Stop the script at any time (Ctrl-C, or kill -9) and run it again with
`--resume`: it reopens the store at its committed step, takes the embedding
back from it, and continues.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import optax

import offlax

VOCAB = 64


def blocks(args) -> dict:
  """The stacked blocks' shapes: a residual MLP per layer, bf16."""
  d, f, n = args.width, 4 * args.width, args.layers
  return {
    "up": jax.ShapeDtypeStruct((n, d, f), jnp.bfloat16),
    "down": jax.ShapeDtypeStruct((n, f, d), jnp.bfloat16),
  }


def init_block(i: int, args) -> dict:
  """Block `i`'s params (the store is written a block at a time)."""
  k = jax.random.split(jax.random.key(i), 2)
  d, f = args.width, 4 * args.width
  return {
    "up": (jax.random.normal(k[0], (d, f)) / d**0.5).astype(jnp.bfloat16),
    "down": (jax.random.normal(k[1], (f, d)) / f**0.5 / args.layers).astype(jnp.bfloat16),
  }


def loss_fn(layers, embed, tokens):
  def block(h, p):
    return h + (jax.nn.gelu(h.astype(jnp.bfloat16) @ p["up"]) @ p["down"]).astype(h.dtype), None

  h, _ = offlax.scan_layers(block, embed[tokens[:, :-1]], layers)
  logits = h @ embed.T  # the embedding, tied
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def data(step: int) -> jax.Array:
  """Sequences counting up from a random start: next token = this one + 1."""
  start = jax.random.randint(jax.random.key(1000 + step), (8, 1), 0, VOCAB)
  return (start + jnp.arange(17)) % VOCAB


def main(argv: list[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--dir", default=None, help="store directory (default: a fresh temp dir)")
  parser.add_argument("--resume", action="store_true", help="continue the run stored in --dir")
  args = parser.parse_args(argv)
  root = args.dir or tempfile.mkdtemp(prefix="offlax-layers-")
  path = os.path.join(root, "layers")

  layer_tx = offlax.master_weights(offlax.adamw(3e-3, weight_decay=0.01))
  embed_tx = optax.adamw(3e-3, weight_decay=0.01)
  embed = jax.random.normal(jax.random.key(0), (VOCAB, args.width)) * 0.1
  embed_state = embed_tx.init(embed)
  if args.resume:
    store = offlax.LayerStore.open(path, blocks(args), optimizer=layer_tx)
    embed, embed_state = store.read_rest((embed, embed_state))  # of the store's step
  else:
    store = offlax.LayerStore.create(path, blocks(args), optimizer=layer_tx,
                                     init_layer=lambda i: init_block(i, args))  # fmt: skip
  print(f"store {path}: {args.layers} blocks on disk, starting at step {store.step}")

  @jax.jit
  def grads(source, embed, embed_state, tokens):
    loss, (_, g) = jax.value_and_grad(loss_fn, argnums=(0, 1))(source, embed, tokens)
    updates, embed_state = embed_tx.update(g, embed_state, embed)
    return loss, optax.apply_updates(embed, updates), embed_state

  with store:
    for _ in range(args.steps):
      loss, embed, embed_state = grads(store.source(), embed, embed_state, data(store.step))
      step = store.update(rest=(embed, embed_state))  # blocks and embedding, committed
      if step % 20 == 0 or step == 1:
        print(f"step {step}: loss {float(loss):.4f}")
    s = store.last_update
    moved = (s.bytes_read + s.bytes_written) / 2**20
    print(
      f"committed step {store.step}; last update moved {moved:.1f} MiB in {s.seconds * 1e3:.0f} ms"
    )
  return float(loss)


if __name__ == "__main__":
  main()
