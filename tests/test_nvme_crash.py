"""Crash safety: SIGKILL at random points never leaves a torn or lost state.

A child process trains with the NVMe tier and is killed at a random moment
(mid-read, mid-write or mid-commit: the step is a few hundred milliseconds of
I/O). The store is then read back and must equal, bit for bit, plain optax's
state after exactly the committed step. The next trial resumes the same store.
Gradients depend on the step only, so the reference does not need the params.
"""

import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal

from offlax._src.layout import StateLayout
from offlax._src.nvme_tier import Store
from offlax._src.transform import _spec_of

SHAPES = {"emb": (512, 64), "w1": (64, 256), "b1": (256,), "w2": (256, 64), "scale": ()}

CHILD = textwrap.dedent(
  """
  import sys, jax, jax.numpy as jnp, numpy as np, optax, offlax
  shapes = {shapes!r}
  params = {{k: jnp.ones(s, jnp.float32) for k, s in shapes.items()}}
  def grads(i):
    return {{k: jnp.sin(jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) + i)
            for k, s in shapes.items()}}
  tier = offlax.NVMeTier({path!r}, chunk_bytes=16384, cache_bytes=2048, progress=False,
                         fsync=False, resume={resume})
  tx = offlax.offload(optax.adamw(1e-3), tier)
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  start = int(state.step)
  for i in range(start, start + 1000):
    updates, state = step(params, state, grads(i))
    if i == start + 1:  # the second call compiles again (committed scalars)
      jax.block_until_ready(state)
      print("ready", start, flush=True)  # compiled: kills now land in steps
  """
)


def _params():
  return {k: jnp.ones(s, jnp.float32) for k, s in SHAPES.items()}


def _grads(i):
  return {
    k: jnp.sin(jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) + i) for k, s in SHAPES.items()
  }


def _stored(path, like):
  store = Store(str(path), fsync=False)
  store.read_metadata()
  values = [store.result(store.read(r.index, 0, r.size)).reshape(r.shape) for r in store.records]
  return StateLayout(like, _spec_of(_params(), "params")).merge(values), store.step


def run_trials(path, trials: int, seed: int) -> dict:
  inner = optax.adamw(1e-3)
  params = _params()
  # Gradients are computed eagerly here as in the child: inside this jit XLA would
  # constant-fold `sin` with its own evaluator, a different rounding.
  update = jax.jit(lambda s, g: inner.update(g, s, params)[1])
  references = [inner.init(params)]
  rng = np.random.default_rng(seed)
  steps_seen = []
  for _ in range(trials):
    resume = os.path.exists(os.path.join(path, "offlax.json"))
    child = subprocess.Popen(
      [sys.executable, "-c", CHILD.format(shapes=SHAPES, path=str(path), resume=resume)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    try:
      line = child.stdout.readline()
      assert line.startswith("ready"), child.stderr.read()[-3000:]
      time.sleep(rng.uniform(0.0, 1.0))
    finally:
      child.kill()
      child.wait(timeout=60)
    stored, step = _stored(path, references[0])
    while len(references) <= step:
      references.append(update(references[-1], _grads(len(references) - 1)))
    assert_trees_equal(stored, references[step])
    steps_seen.append(step)
  return {"trials": trials, "committed_steps": steps_seen, "lost_or_torn": 0}


def test_sigkill_keeps_the_last_committed_state(tmp_path):
  figures = run_trials(tmp_path / "store", trials=4, seed=0)
  steps = figures["committed_steps"]
  # Kills land at random points of the steps that follow compilation (2 per child).
  assert steps[-1] > 2 * len(steps), figures


@pytest.mark.slow
def test_sigkill_many_trials(tmp_path):
  figures = run_trials(tmp_path / "store", trials=50, seed=1)
  print(figures)
