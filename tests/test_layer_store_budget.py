"""`LayerStore(update_bytes=)`: the optimizer step within a byte budget (issue 44.4).

A budget small enough that the largest leaf (``w``, 256 rows a layer) is cut into row
ranges gives the same params and state to the bit as whole leaves and as the same
optimizer on the layers in memory, in both update modes, with gradient accumulation and
with a global-norm clip that applies; the step's peak bytes in flight stay within the
budget (well under the whole leaves' peak); a flipped byte anywhere in a cut slot is
refused with `StoreCorruptedError`, nothing committed; a budget that cannot hold a leaf's
smallest range is refused naming the leaf and the minimum; a SIGKILL inside a ranged update
leaves the store at its last committed step, to the bit (slow).
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_layer_update import OPTIMIZERS, rest_of, run_optimizer

import offlax
from offlax._src import errors
from offlax._src.layer_store import ranges

L, D = 3, 256
HERE = os.path.dirname(os.path.abspath(__file__))
BUDGET = 2_000_000  # w's whole leaves need about 5.3 MB in flight: cut in ranges of 32 rows


def make_layers(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 2)
  return {
    "b": (jax.random.normal(k[1], (L, D)) * 0.1).astype(dtype),
    "w": (jax.random.normal(k[0], (L, D, D)) / D**0.5).astype(dtype),
  }


def loss(layers, x):
  h, _ = offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), x, layers)
  return jnp.mean(h.astype(jnp.float32) ** 2)


grad = jax.jit(jax.grad(loss))


def batch(step, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(100 + step), (3, D)).astype(dtype)


def reference(tx, layers, steps, dtype, micro=1):
  """Params and state after `steps` steps (of `micro` batches summed) with the layers in memory."""
  update = jax.jit(
    lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  )
  params, state = layers, tx.init(layers)
  for step in range(steps):
    gs = [grad(params, batch(micro * step + m, dtype)) for m in range(micro)]
    g = gs[0]
    for more in gs[1:]:
      g = jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), g, more)
    params, state = update(g, state, params)
  return params, state


def per_layer(state):
  return jax.tree.map(lambda x: np.broadcast_to(x, (L,)) if np.ndim(x) == 0 else x, state)


def assert_bits(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def train(path, tx, dtype, mode, budget, steps=2, micro=1):
  """A store trained `steps` steps; its params, state and the last update's stats."""
  layers = make_layers(dtype)
  with offlax.LayerStore.create(path, layers, optimizer=tx, progress=False, update=mode,
                                update_bytes=budget) as store:  # fmt: skip
    for step in range(steps):
      if micro == 1:
        grad(store.source(), batch(step, dtype))
      else:
        store.zero_grads()
        for m in range(micro):
          last = m == micro - 1
          grad(store.source(accumulate=True, last=last), batch(micro * step + m, dtype))
      store.update()
    return store.read_params(), store.read_state(), store.last_update


@pytest.mark.slow_except("adam-backward")
@pytest.mark.parametrize("mode", ["explicit", "backward"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_leaves_cut_in_ranges_give_the_same_bits(tmp_path, name, mode):
  make_tx, dtype = OPTIMIZERS[name]
  params, state, stats = train(str(tmp_path / "s"), make_tx(), dtype, mode, BUDGET)
  want_params, want_state = reference(make_tx(), make_layers(dtype), 2, dtype)
  assert_bits(params, want_params)
  assert_bits(state, per_layer(want_state))
  whole = train(str(tmp_path / "w"), make_tx(), dtype, mode, None)[2]
  # within the budget, where whole leaves are well over it: w was cut
  assert 0 < stats.peak_bytes <= BUDGET < whole.peak_bytes
  assert stats.bytes_written == whole.bytes_written


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["explicit", "backward"])
def test_accumulation_within_the_budget(tmp_path, mode):
  tx = optax.adam(1e-2)
  params, state, stats = train(str(tmp_path / "s"), tx, jnp.float32, mode, BUDGET, 2, micro=2)
  want_params, want_state = reference(tx, make_layers(), 2, jnp.float32, micro=2)
  assert_bits(params, want_params)
  assert_bits(state, per_layer(want_state))
  assert 0 < stats.peak_bytes <= BUDGET


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["explicit", "backward"])
def test_a_clip_that_applies_within_the_budget(tmp_path, mode):
  # SGD: a wrong clip scale would show (Adam's scale invariance hides it)
  make = lambda: optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
  params, state, stats = train(str(tmp_path / "s"), make(), jnp.float32, mode, BUDGET)
  assert stats.clipped and 0 < stats.peak_bytes <= BUDGET
  want = train(str(tmp_path / "w"), make(), jnp.float32, mode, None)
  assert_bits((params, state), want[:2])
  assert_bits(params, reference(make(), make_layers(), 2, jnp.float32)[0])


def flip(path, kind, leaf, layer, at):
  """Flips a bit at byte `at` of `layer`'s slot of state or params leaf `leaf` (committed)."""
  manifest = json.load(open(os.path.join(path, "layers.json")))
  records = manifest["leaves"] if kind == "params" else manifest["state"]
  name = os.path.join(path, f"gen{manifest['generation']}", kind, f"{leaf}.bin")
  data = bytearray(open(name, "rb").read())
  data[layer * records[leaf]["slot"] + at] ^= 0x10
  open(name, "wb").write(bytes(data))


@pytest.mark.parametrize("mode", ["explicit", pytest.param("backward", marks=pytest.mark.slow)])
def test_a_flipped_byte_in_a_cut_slot_is_refused(tmp_path, mode):
  path, tx = str(tmp_path / "s"), optax.adam(1e-2)
  with offlax.LayerStore.create(path, make_layers(), optimizer=tx, progress=False, update=mode,
                                update_bytes=BUDGET) as store:  # fmt: skip
    grad(store.source(), batch(0))
    store.update()
    before = store.read_params()
  state = [r["path"] for r in json.load(open(os.path.join(path, "layers.json")))["state"]]
  mu_w = next(j for j, p in enumerate(state) if "mu" in p and "'w'" in p)
  flip(path, "state", mu_w, 1, 5)  # in w's first range of layer 1: seen after its last
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_layers())
  with offlax.LayerStore.open(path, like, optimizer=tx, progress=False, update=mode,
                              update_bytes=BUDGET) as store:  # fmt: skip
    with pytest.raises(errors.StoreCorruptedError, match=r"layer 1 of state leaf .*'w'"):
      grad(store.source(), batch(1))
      store.update()
    assert store.step == 1
    assert_bits(store.read_params(), before)  # nothing committed


def test_a_budget_too_small_is_refused_with_the_minimum(tmp_path):
  too_small = r"update_bytes=100000 cannot hold leaf \['w'\]"
  with pytest.raises(errors.InvalidOptionError, match=too_small) as e:
    offlax.LayerStore.create(str(tmp_path / "s"), make_layers(), optimizer=optax.adam(1e-2),
                             progress=False, update_bytes=100_000)  # fmt: skip
  least = int(str(e.value).split("update_bytes >= ")[1].split(" ")[0])
  assert not os.path.exists(tmp_path / "s")  # refused before writing anything
  with offlax.LayerStore.create(str(tmp_path / "s"), make_layers(), optimizer=optax.adam(1e-2),
                                progress=False, update_bytes=least) as store:  # fmt: skip
    grad(store.source(), batch(0))
    store.update()
    assert 0 < store.last_update.peak_bytes <= least
  with pytest.raises(errors.InvalidOptionError, match="update_bytes=0"):
    offlax.LayerStore.open(str(tmp_path / "s"), make_layers(), optimizer=optax.adam(1e-2),
                           update_bytes=0)  # fmt: skip


def test_ranges_start_on_blocks_and_cover_the_leaf():
  rec = {"path": "['w']", "shape": [300, 3], "dtype": "float32", "slot": 4096}
  cut = ranges.of(rec, 1024)
  assert cut == [ranges.Range(0, 300, True)]
  rec = {"path": "['w']", "shape": [3000, 1024], "dtype": "bfloat16", "slot": 3000 * 2048}
  cut = ranges.of(rec, 1024)
  assert [(r.start, r.stop, r.last) for r in cut] == [(0, 1024, False), (1024, 2048, False),
                                                      (2048, 3000, True)]  # fmt: skip
  spans = [ranges.span(rec, r) for r in cut]
  assert all(start % 4096 == 0 for start, _ in spans)
  assert sum(n for _, n in spans) == rec["slot"]


def test_the_planner_counts_the_peak_the_store_holds(tmp_path, monkeypatch):
  """`plan --update-bytes`'s figure for the update in flight is the store's measured peak
  (within 10%), on a disk slower than the update (the writes queued, as on a real NVMe)."""
  import time

  from offlax._src import plan_disk
  from offlax._src.layer_store import slots as slots_lib

  n, budget = 2, 4_000_000
  layers = {"b": jnp.zeros((n, 1024)), "w": jnp.full((n, 1024, 256), 0.01)}
  tx = optax.adam(1e-2)
  state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(tx.init, layers)))
  params = sum(x.nbytes for x in jax.tree.leaves(layers))
  count = sum(x.size for x in jax.tree.leaves(layers))
  leaf, rest = plan_disk.layer_leaves(layers, n)
  planned = plan_disk.params_on_disk_bytes(params, state, count, n, leaf_params=leaf,
                                           rest_params=rest, update_bytes=budget)  # fmt: skip
  whole = plan_disk.params_on_disk_bytes(params, state, count, n, leaf_params=leaf)
  assert planned["update"] == budget < whole["update"]  # the budget, not whole leaves
  write = slots_lib.Slots.write_range

  def slow(self, *args):
    time.sleep(0.01)
    return write(self, *args)

  monkeypatch.setattr(slots_lib.Slots, "write_range", slow)
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, progress=False,
                                update_bytes=budget) as store:  # fmt: skip
    x = jnp.ones((2, 256))
    store_loss = lambda s: jnp.sum(
      offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"].T @ p["w"]), None), x, s)[0]
    )
    jax.grad(store_loss)(store.source())
    store.update()
    peak = store.last_update.peak_bytes
  assert 0.9 * planned["update"] <= peak <= planned["update"], (peak, planned["update"])


@pytest.mark.parametrize("budget", [None, BUDGET])
def test_an_update_of_another_dtype_is_refused_whole_or_by_ranges(tmp_path, budget):
  """An optimizer whose update returns a state leaf in another dtype than its init made: the
  ranges refuse it as whole leaves do, by name, nothing committed (they wrote its bytes)."""

  def update(g, s, p=None):
    cast = lambda m: m.astype(jnp.bfloat16) if m.ndim == 2 else m  # w's, the leaf cut
    m = jax.tree.map(lambda m, g: cast(0.9 * m + g), s["m"], g)
    return jax.tree.map(lambda m: -0.1 * m.astype(jnp.float32), m), {"m": m}

  init = lambda p: {"m": jax.tree.map(lambda x: jnp.zeros_like(x, jnp.float32), p)}
  tx = optax.GradientTransformation(init, update)
  with offlax.LayerStore.create(str(tmp_path / "s"), make_layers(), optimizer=tx,
                                update_bytes=budget, progress=False) as store:  # fmt: skip
    jax.grad(loss)(store.source(), jnp.ones((3, D)))
    with pytest.raises(errors.StoreMismatchError, match=r"of state leaf \['m'\]\['w'\] .*bfloat16"):
      store.update()
    assert store.step == 0


@pytest.mark.slow  # the default run's cover of the ranges: the tests above; of the kills: none
@pytest.mark.parametrize("update", ["explicit", "backward"])
def test_killed_inside_a_ranged_update_resumes_one_whole_step(tmp_path, update):
  """SIGKILL in the middle of a leaf's ranges (`w` cut by ``BUDGET``): the store reopens at the
  last committed step, params, state and rest to the bit of the layers in memory.

  Half the runs are killed at a random moment after their first commit (as
  test_layer_update's), half just after a random read or write of a range (`kill_at`: one
  inside a ranged update for sure, in the backward pass's with ``update="backward"``).
  """
  path, rng = str(tmp_path / "s"), np.random.default_rng(2)
  cmd = [sys.executable, os.path.join(HERE, "layer_store_run.py"), path, update, "budget"]
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_layers())
  steps = []
  for run in range(6):
    counted = run % 2 == 1
    # a step reads or writes a range 162 times (explicit; 126 backward): past the first commit
    at = [str(rng.integers(200, 700))] if counted else []
    proc = subprocess.Popen(cmd + at, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready")  # jax imported, the store open
    if not counted:
      assert proc.stdout.readline().startswith("committed")  # compiled: the kill lands later
      time.sleep(rng.uniform(0.05, 1.5))
      proc.send_signal(signal.SIGKILL)
    words = proc.communicate(timeout=300)[0].split()
    assert proc.returncode == -signal.SIGKILL
    printed = [
      int(b) for a, b in zip(words, words[1:], strict=False) if a in ("ready", "committed")
    ]
    with offlax.LayerStore.open(
      path, like, optimizer=run_optimizer(), update_bytes=BUDGET
    ) as store:
      steps.append(store.step)
      if counted:  # killed in a step's ranges: before its commit
        assert store.step == printed[-1], printed
      params, state = reference(run_optimizer(), make_layers(), store.step, jnp.float32)
      assert_bits(store.read_params(), params)
      assert_bits(store.read_state(), per_layer(state))
      if store.step:  # the rest of the model committed with the layers: of the same step
        assert_bits(store.read_rest(rest_of(0)), rest_of(store.step))
  assert steps == sorted(steps) and steps[-1] > 0, steps
