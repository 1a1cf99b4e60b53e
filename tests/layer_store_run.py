"""Trains a small `LayerStore` until killed (tests/test_layer_update.py's crash test).

  python tests/layer_store_run.py PATH [UPDATE [clip|budget [N]]]

Creates the store at PATH, or resumes it; prints "ready" once open, then steps
forever: the gradients of batch `store.step`, then `update`, committing with
the layers a "rest" of the model that says which step it is (`rest_of`), and
prints "committed STEP" after each commit. UPDATE is the store's mode, ``explicit`` (the
default) or ``backward`` (each layer updated in the backward pass, `update` commits);
``clip``: the optimizer after a global-norm clip that applies (`clipped`); ``budget``:
test_layer_store_budget's layers under its ``update_bytes=BUDGET`` (``w`` cut in row ranges);
N: SIGKILLs itself at its N-th read or write of a range of a slot (`kill_at`), else runs on.
"""

import itertools
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from test_layer_update import (  # noqa: E402
  batch,
  grad,
  make_layers,
  rest_of,
  run_optimizer,
)

import offlax  # noqa: E402


def clipped():
  """`run_optimizer` after a global-norm clip at 1e-3 (these gradients' norm: about 0.1)."""
  return optax.chain(optax.clip_by_global_norm(1e-3), run_optimizer())


def model(extra=""):
  """The layers, their gradient and batch functions and the store's budget (``budget``: those of
  test_layer_store_budget, whose ``w`` its ``BUDGET`` cuts in row ranges)."""
  if extra != "budget":
    return make_layers(jnp.float32), grad, batch, None
  import test_layer_store_budget as b

  return b.make_layers(), b.grad, b.batch, b.BUDGET


def kill_at(n):
  """SIGKILLs this process just after its `n`-th read or write of a range of a slot (part of a
  slot, not a whole one): in a ranged update, its unit's other ranges not yet done."""
  from offlax._src.layer_store import slots

  count = itertools.count(1)

  def counted(io):
    def run(self, kind, gen, k, i, start, data):
      out = io(self, kind, gen, k, i, start, data)
      size = data if isinstance(data, int) else data.nbytes
      if (start or size < self.records_of(kind)[k]["slot"]) and next(count) == n:
        os.kill(os.getpid(), signal.SIGKILL)
      return out

    return run

  slots.Slots.read_range = counted(slots.Slots.read_range)
  slots.Slots.write_range = counted(slots.Slots.write_range)


def main(path, update="explicit", extra="", n=""):
  if n:
    kill_at(int(n))
  make = clipped if extra == "clip" else run_optimizer
  layers, step_grad, step_batch, budget = model(extra)
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  kw = dict(optimizer=make(), progress=False, update=update, update_bytes=budget)
  if os.path.exists(os.path.join(path, "layers.json")):
    store = offlax.LayerStore.open(path, like, **kw)
  else:
    store = offlax.LayerStore.create(path, layers, **kw)
  print("ready", store.step, flush=True)
  while True:
    step_grad(store.source(), step_batch(store.step, jnp.float32))
    store.update(rest=rest_of(store.step + 1))
    print("committed", store.step, flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
