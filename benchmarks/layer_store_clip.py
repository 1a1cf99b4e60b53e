"""A leading global-norm clip in a `LayerStore`: the bytes a parameter a step, both modes.

Three optimizers (no clip; a clip that never applies; one that always does)
times the two update modes, on bf16 layers with `offlax.master_weights(offlax.adamw)`,
read from the store's counters (`bytes_read`, `bytes_written`) on the last of 3 steps.

  python benchmarks/layer_store_clip.py [--layers 4] [--d 1024] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run(layers: int, d: int, folder: str | None) -> list[tuple[str, str, float, float, bool]]:
  """(mode, optimizer, bytes a param, seconds, clipped) of the last of 3 steps, each case."""
  import jax
  import jax.numpy as jnp
  import optax

  import offlax

  stacked = jax.random.normal(jax.random.key(0), (layers, d, d)) / d**0.5
  like = {"w": stacked.astype(jnp.bfloat16)}

  @jax.jit
  def grads(source, x):
    def loss(source):
      h, _ = offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"]), None), x, source)
      return jnp.mean(h.astype(jnp.float32) ** 2)

    return jax.grad(loss)(source)

  tail = lambda: offlax.master_weights(offlax.adamw(1e-3))
  clip = lambda c: optax.chain(optax.clip_by_global_norm(c), tail())
  cases = [("no clip", tail), ("clip, not applying", lambda: clip(1e6))]
  cases.append(("clip, applying", lambda: clip(1e-6)))
  rows = []
  for mode in ["explicit", "backward"]:
    for name, make in cases:
      path = tempfile.mkdtemp(dir=folder) + "/layers"
      with offlax.LayerStore.create(path, like, optimizer=make(), update=mode,
                                    progress=False) as store:  # fmt: skip
        for _ in range(3):
          before, start = store.bytes_read + store.bytes_written, time.perf_counter()
          grads(store.source(), jnp.ones((8, d), jnp.bfloat16))
          store.update()
        moved = store.bytes_read + store.bytes_written - before
        seconds = time.perf_counter() - start
        rows.append((mode, name, moved / (layers * d * d), seconds, store.last_update.clipped))
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--d", type=int, default=1024, help="a layer: one bf16 matrix of d x d")
  parser.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
  args = parser.parse_args()
  print("| mode | optimizer | bytes a param a step | step | clipped |")
  print("| --- | --- | --- | --- | --- |")
  for mode, name, per_param, seconds, clipped in run(args.layers, args.d, args.dir):
    print(f"| `{mode}` | {name} | {per_param:.1f} | {seconds:.3f} s | {clipped} |")


if __name__ == "__main__":
  main()
