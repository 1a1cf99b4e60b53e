"""Trains a small `LayerStore` until killed (tests/test_layer_update.py's crash test).

  python tests/layer_store_run.py PATH [UPDATE [clip]]

Creates the store at PATH, or resumes it; prints "ready" once open, then steps
forever: the gradients of batch `store.step`, then `update`, committing with
the layers a "rest" of the model that says which step it is (`rest_of`), and
prints "committed STEP" after each commit. UPDATE is the store's mode, ``explicit`` (the
default) or ``backward`` (each layer updated in the backward pass, `update` commits);
``clip``: the optimizer after a global-norm clip that applies (`clipped`).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from test_layer_update import (  # noqa: E402
  batch,
  grad,
  make_layers,
  make_layers_like,
  rest_of,
  run_optimizer,
)

import offlax  # noqa: E402


def clipped():
  """`run_optimizer` after a global-norm clip at 1e-3 (these gradients' norm: about 0.1)."""
  return optax.chain(optax.clip_by_global_norm(1e-3), run_optimizer())


def main(path, update="explicit", clip=""):
  make = clipped if clip == "clip" else run_optimizer
  if os.path.exists(os.path.join(path, "layers.json")):
    store = offlax.LayerStore.open(
      path, make_layers_like(), optimizer=make(), progress=False, update=update
    )
  else:
    store = offlax.LayerStore.create(path, make_layers(jnp.float32), optimizer=make(),
                                     progress=False, update=update)  # fmt: skip
  print("ready", store.step, flush=True)
  while True:
    grad(store.source(), batch(store.step, jnp.float32))
    store.update(rest=rest_of(store.step + 1))
    print("committed", store.step, flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
