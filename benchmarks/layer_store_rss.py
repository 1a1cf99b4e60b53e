"""Layers on disk (`LayerStore`): host RAM and device memory stay flat as layers are added.

Each size runs in its own process: the store is made (the model in RAM only
then), the model dropped, the peak RSS reset, and one forward+backward pass of
`offlax.scan_layers` over the store's `LayerSource` run, its gradients written
to disk layer by layer. Then the same step is compiled for a GPU
(`offlax.compile_for_gpu`) at two layer counts.

  python benchmarks/layer_store_rss.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import _common  # noqa: E402

D, B = 2048, 8  # a layer: two fp32 matrices of D x 2D, 32 MiB
OFFLOAD = False  # saved layer inputs in pinned_host memory (the GPU compile sets it)


def step(source, x):
  import jax
  import jax.numpy as jnp

  import offlax

  def layer(h, p):
    return h + jnp.tanh(h @ p["up"]) @ p["down"], None

  loss = lambda s, x: jnp.mean(offlax.scan_layers(layer, x, s, offload_activations=OFFLOAD)[0] ** 2)
  return jax.grad(loss)(source, x)


def make_store(path, n):
  import numpy as np

  from offlax._src.layer_store.store import LayerStore

  rng = np.random.default_rng(0)
  layers = {
    "up": (rng.standard_normal((n, D, 2 * D), np.float32) * 0.01),
    "down": (rng.standard_normal((n, 2 * D, D), np.float32) * 0.01),
  }
  return LayerStore.create(path, layers)


def child(n, path):
  import jax
  import jax.numpy as jnp

  store = make_store(path, n)
  gc.collect()
  _common.reset_peak_rss()
  jax.block_until_ready(jax.jit(step)(store.source(), jnp.ones((B, D))))
  print(_common.peak_rss())


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=tempfile.gettempdir())
  parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    return child(args.child, args.dir)
  import jax.numpy as jnp

  import offlax

  for n in (8, 32):
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="offlax-layers-") as d:
      cmd = [sys.executable, __file__, "--child", str(n), "--dir", os.path.join(d, "s")]
      rss = int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])
    print(f"{n} layers ({n * 32} MiB of params): peak RSS {rss / 2**20:.0f} MiB")
  global OFFLOAD
  for OFFLOAD in (False, True):  # the saved layer inputs on the device, then in host memory
    for n in (8, 16):
      with tempfile.TemporaryDirectory(dir=args.dir, prefix="offlax-layers-") as d:
        store = make_store(os.path.join(d, "s"), n)
        m = offlax.compile_for_gpu(step, store.source(), jnp.ones((B, D)), target="h100")
        store.close()
      print(f"{n} layers compiled for h100 (offload_activations={OFFLOAD}): device peak "
            f"{m.device_peak / 1e6:.2f} MB, host peak {m.host_peak / 1e6:.2f} MB")  # fmt: skip


if __name__ == "__main__":
  main()
