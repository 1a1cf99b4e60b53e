"""Crash safety: SIGKILL at random points never leaves a torn or lost state.

A child process trains with the NVMe tier and is killed at a random moment
(mid-read, mid-write or mid-commit: the step is a few hundred milliseconds of
I/O). The store is then read back and must equal, bit for bit, plain optax's
state after exactly the committed step. The next trial resumes the same store.
Gradients depend on the step only, so the reference does not need the params.
The same harness kills children that save an orbax checkpoint of the store
after every step. A handful of trials run by default, 50 of each kind with
`--hypothesis-profile=long` (docs/reliability.md has the figures).
"""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal, long_profile

from offlax._src.layout import ParamSpec, StateLayout
from offlax._src.nvme.store import Store

KEEP = 3  # the children's orbax max_to_keep
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
  mngr = None
  if {checkpoints!r}:  # an orbax checkpoint of the store after every step
    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager({checkpoints!r}, options=ocp.CheckpointManagerOptions(
      max_to_keep={keep}, enable_async_checkpointing=True))
  start = int(state.step)
  for i in range(start, start + 1000):
    updates, state = step(params, state, grads(i))
    if mngr is not None:
      committed = int(state.step)  # waits for the step's commit
      if committed not in mngr.all_steps():
        mngr.save(committed, args=ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreSave(tier)))
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
  return StateLayout(like, ParamSpec.of(_params())).merge(values), store.step


def run_trials(path, trials: int, seed: int, checkpoints=None) -> dict:
  """Kills `trials` training children at random points; checks the store after each.

  With `checkpoints` (a directory), each child also saves an orbax checkpoint
  of the store after every step, so kills land in checkpoint writes too; each
  checkpoint orbax lists after the kill is restored and must hold exactly the
  state of the step it is labelled with.
  """
  inner = optax.adamw(1e-3)
  params = _params()
  # Gradients are computed eagerly here as in the child: inside this jit XLA would
  # constant-fold `sin` with its own evaluator, a different rounding.
  update = jax.jit(lambda s, g: inner.update(g, s, params)[1])
  references = [inner.init(params)]

  def reference(step):
    while len(references) <= step:
      references.append(update(references[-1], _grads(len(references) - 1)))
    return references[step]

  rng = np.random.default_rng(seed)
  figures = {"trials": trials, "committed_steps": [], "lost_or_torn": 0}
  if checkpoints is not None:
    figures.update(killed_mid_checkpoint=0, checkpoints_restored=0, half_deleted_refused=0)
  for _ in range(trials):
    resume = os.path.exists(os.path.join(path, "offlax.json"))
    unfinished = _unfinished(checkpoints)
    script = CHILD.format(
      shapes=SHAPES,
      path=str(path),
      resume=resume,
      checkpoints=checkpoints and str(checkpoints),
      keep=KEEP,
    )
    child = subprocess.Popen(
      [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
      line = child.stdout.readline()
      assert line.startswith("ready"), child.stderr.read()[-3000:]
      time.sleep(rng.uniform(0.0, 1.0))
    finally:
      child.kill()
      child.wait(timeout=60)
    stored, step = _stored(path, references[0])
    assert_trees_equal(stored, reference(step))
    figures["committed_steps"].append(step)
    if checkpoints is not None:
      if _unfinished(checkpoints) - unfinished:
        figures["killed_mid_checkpoint"] += 1
      restored, refused = _check_checkpoints(checkpoints, path, reference)
      figures["checkpoints_restored"] += restored
      figures["half_deleted_refused"] += refused
  return figures


def _unfinished(directory) -> set[str]:
  """Orbax's temporary checkpoint directories (renamed when a save is done)."""
  if directory is None or not os.path.isdir(directory):
    return set()
  return {name for name in os.listdir(directory) if "tmp" in name}


def _check_checkpoints(directory, path, reference) -> tuple[int, int]:
  """Restores every checkpoint orbax lists; each must be its step's state.

  Returns (restored, refused). Orbax deletes the checkpoints beyond
  `max_to_keep` with `rmtree`, oldest first and not atomically: a kill during
  it leaves a half-deleted step that orbax still lists. offlax must refuse
  such a one with its error (a file missing from the copy, or a chunk missing
  when read), never restore it; it may only be one of those being deleted.
  """
  import orbax.checkpoint as ocp

  import offlax

  restored_path = f"{path}-restored"
  refused = 0
  with ocp.CheckpointManager(directory) as mngr:
    steps = sorted(mngr.all_steps())
    for label in steps:
      shutil.rmtree(restored_path, ignore_errors=True)
      args = ocp.args.Composite(
        opt=offlax.checkpoint.NVMeStoreRestore(restored_path, progress=False)
      )
      try:
        step = mngr.restore(label, args=args).opt
        stored, stored_step = _stored(restored_path, reference(0))
      except (offlax.errors.StoreError, offlax.errors.StoreCorruptedError) as e:
        assert label in steps[: len(steps) - KEEP], f"checkpoint {label} of {steps}: {e}"
        refused += 1
        continue
      assert step == stored_step == label, f"checkpoint {label} holds store step {step}"
      assert_trees_equal(stored, reference(label))
  shutil.rmtree(restored_path, ignore_errors=True)
  return len(steps) - refused, refused


def _trials(default: int) -> int:
  """A handful of trials by default; the long profile's 50 (docs/reliability.md)."""
  return 50 if long_profile() else default


@pytest.mark.slow  # test_bad_input.py's full disk and Ctrl-C keep the commit
def test_sigkill_keeps_the_last_committed_state(tmp_path):
  figures = run_trials(tmp_path / "store", trials=_trials(2), seed=0)
  print(figures)
  steps = figures["committed_steps"]
  # Kills land at random points of the steps that follow compilation (2 per child).
  assert steps[-1] > 2 * len(steps), figures


@pytest.mark.slow
def test_sigkill_during_orbax_checkpoints(tmp_path):
  figures = run_trials(
    tmp_path / "store", trials=_trials(2), seed=2, checkpoints=tmp_path / "checkpoints"
  )
  print(figures)
  assert figures["checkpoints_restored"] >= figures["trials"], figures


# -- on a mesh: one store per device ---------------------------------------------

MESH_SHAPES = {
  "emb": ((512, 64), ("data", None)),
  "w1": ((64, 256), (None, "model")),
  "b1": ((256,), ("model",)),
  "w2": ((256, 64), ("data", "model")),
  "scale": ((), ()),
}
MESH = {"data": 4, "model": 2}

MESH_CHILD = textwrap.dedent(
  """
  import os
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  import jax, jax.numpy as jnp, numpy as np, optax, offlax
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  shapes = {shapes!r}
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  params = {{k: put(jnp.ones(s, jnp.float32), spec) for k, (s, spec) in shapes.items()}}
  def grads(i):
    return {{k: put(jnp.sin(jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) + i), spec)
            for k, (s, spec) in shapes.items()}}
  tier = offlax.NVMeTier({path!r}, chunk_bytes=4096, cache_bytes=512, progress=False,
                         fsync=False, resume={resume})
  tx = offlax.offload(optax.adamw(1e-3), tier)
  state = tx.init(params)
  steps = {{s.store.step for s in tier.shards.values()}}  # one step, after reopening
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  start = int(state.step)
  for i in range(start, start + 1000):
    updates, state = step(params, state, grads(i))
    if i == start + 1:
      jax.block_until_ready(state)
      print("ready", start, len(steps), flush=True)
  """
)


def _mesh_grads(i):
  return {
    k: jnp.sin(jnp.arange(np.prod(s), dtype=jnp.float32).reshape(s) + i)
    for k, (s, _) in MESH_SHAPES.items()
  }


def _block(shape, spec, position):
  """The index of mesh position `position`'s shard of an array of `shape` sharded as `spec`."""
  coords = dict(zip(MESH, np.unravel_index(position, tuple(MESH.values())), strict=True))
  index = []
  for n, axis in zip(shape, spec + (None,) * (len(shape) - len(spec)), strict=True):
    size = n // (MESH[axis] if axis else 1)
    start = size * int(coords[axis]) if axis else 0
    index.append(slice(start, start + size))
  return tuple(index)


@pytest.mark.slow
def test_sigkill_on_a_mesh_keeps_every_shard_committed(tmp_path):
  # A child trains on 8 devices (one store each) and is killed at a random point,
  # maybe between two shards' commits. Each store must hold exactly optax's
  # state (computed unsharded: adamw is elementwise) at its own committed step;
  # the next child reopens the stores and must find them all at one step.
  path = tmp_path / "store"
  inner = optax.adamw(1e-3)
  params = {k: jnp.ones(s, jnp.float32) for k, (s, _) in MESH_SHAPES.items()}
  update = jax.jit(lambda s, g: inner.update(g, s, params)[1])
  references = [inner.init(params)]
  rng = np.random.default_rng(5)
  split, steps_seen = 0, []
  for _ in range(_trials(3)):
    script = MESH_CHILD.format(shapes=MESH_SHAPES, path=str(path), resume=path.exists())
    child = subprocess.Popen(
      [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
      line = child.stdout.readline()
      assert line.startswith("ready"), child.stderr.read()[-3000:]
      assert line.split()[2] == "1", line  # every shard at the same step after reopening
      time.sleep(rng.uniform(0.0, 1.0))
    finally:
      child.kill()
      child.wait(timeout=60)
    steps = []
    for position in range(8):
      store = Store(str(path / f"shard_{position:05d}"), fsync=False)
      store.read_metadata()
      steps.append(store.step)
      while len(references) <= store.step:
        references.append(update(references[-1], _mesh_grads(len(references) - 1)))
      want = {
        jax.tree_util.keystr(p): x
        for p, x in jax.tree_util.tree_flatten_with_path(references[store.step])[0]
      }
      for r in store.records:
        got = store.result(store.read(r.index, 0, r.size)).reshape(r.shape)
        name = r.path.split("'")[1] if "'" in r.path else None
        shape, spec = MESH_SHAPES[name] if name else ((), ())
        expected = np.asarray(want[r.path])[_block(shape, spec, position) if name else ()]
        assert np.array_equal(got, expected), (position, r.path, store.step)
    assert max(steps) - min(steps) <= 1, steps
    split += len(set(steps)) > 1
    steps_seen.append(steps)
  print({"trials": len(steps_seen), "steps": steps_seen, "killed_between_commits": split})
