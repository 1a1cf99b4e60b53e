"""`LayerStore` with 8-bit optimizer state (`offlax.adamw(..., state_bits=8)`, issue 45).

The store's state is each layer's own (its ``init`` on one layer's params), so each layer's
leaf is quantized in its own blocks of 256: the reference runs the same 8-bit optimizer in
memory on each layer's tree in turn. Params and state equal it bit for bit in both update
modes, under `offlax.master_weights`, with leaves cut in ranges of blocks (``update_bytes``),
with accumulation, with a leading global-norm clip that applies, and across a close and
reopen; the step's bytes a param with an fp32 master are counted; what stays refused is.

Default run: one small store per update mode, with a master, reopened (`test_8bit_store_*`),
the bytes a param and the refusals; the budget's cuts and the clip on larger leaves are slow.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offlax
from offlax._src import errors
from offlax._src.layer_store import ranges

L = 3


def make_layers(rows=256, cols=1024, bias=False, dtype=jnp.bfloat16):
  """`w` quantized (8-bit moments); `b`, where asked, under 4096 elements: float moments."""
  k = jax.random.split(jax.random.key(0), 2)
  layers = {"w": (jax.random.normal(k[0], (L, rows, cols)) / cols**0.5).astype(dtype)}
  if bias:
    layers["b"] = (jax.random.normal(k[1], (L, rows)) * 0.1).astype(dtype)
  return layers


def loss(layers, x):
  step = lambda h, p: (jnp.tanh(h @ p["w"] @ p["w"].T + p.get("b", 0)), None)
  h, _ = offlax.scan_layers(step, x, layers)
  return jnp.mean(h.astype(jnp.float32) ** 2)


grad = jax.jit(jax.grad(loss))


def batch(step, rows, dtype):
  return jax.random.normal(jax.random.key(100 + step), (3, rows)).astype(dtype)


def layer(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def reference(tx, layers, steps, micro=1, transform=None):
  """Params and state after `steps` steps, the 8-bit optimizer run on each layer in memory
  (the gradients of every layer through `transform` first, where given)."""
  update = jax.jit(
    lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  )
  rows, dtype = layers["w"].shape[1], layers["w"].dtype
  params, states = layers, [tx.init(layer(layers, i)) for i in range(L)]
  for step in range(steps):
    gs = [grad(params, batch(micro * step + m, rows, dtype)) for m in range(micro)]
    g = gs[0]
    for more in gs[1:]:
      g = jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), g, more)
    g = g if transform is None else transform(g)
    new = [update(layer(g, i), states[i], layer(params, i)) for i in range(L)]
    params = jax.tree.map(lambda *xs: np.stack(xs), *[p for p, _ in new])
    states = [s for _, s in new]
  return params, jax.tree.map(lambda *xs: np.stack(xs), *states)


def assert_bits(got, want):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for a, b in zip(got_leaves, want_leaves, strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def master_8bit():
  return offlax.master_weights(offlax.adamw(1e-2, weight_decay=0.1, state_bits=8))


def train(store, steps, start=0, micro=1, rows=256, dtype=jnp.bfloat16):
  for step in range(start, start + steps):
    if micro == 1:
      grad(store.source(), batch(step, rows, dtype))
    else:
      store.zero_grads()
      for m in range(micro):
        last = m == micro - 1
        grad(store.source(accumulate=True, last=last), batch(micro * step + m, rows, dtype))
    store.update()


def like(layers):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)


@pytest.mark.parametrize("mode", [pytest.param("explicit", marks=pytest.mark.slow), "backward"])
def test_8bit_store_equals_the_optimizer_on_each_layer_and_reopens(tmp_path, mode):
  """Bit for bit, with an fp32 master, across a reopen; and the bytes a step moves."""
  path, layers, tx = str(tmp_path / "s"), make_layers(), master_8bit()
  with offlax.LayerStore.create(path, layers, optimizer=tx, progress=False, update=mode) as store:
    train(store, 1)
    moved = store.bytes_read + store.bytes_written
    train(store, 1, start=1)
    moved = store.bytes_read + store.bytes_written - moved
    state = store.read_state()
  want_params, want_state = reference(tx, layers, 3)
  adam = state.inner_state[0]  # master_weights' inner chain: the 8-bit Adam's state
  assert adam.mu["w"].dtype == jnp.int8 and adam.mu_scale["w"].shape == (L, 1024)
  with offlax.LayerStore.open(path, like(layers), optimizer=tx, progress=False,
                              update=mode) as store:  # fmt: skip
    train(store, 1, start=2)
    assert store.step == 3
    assert_bits(store.read_params(), want_params)
    assert_bits(store.read_state(), want_state)
  # A step's bytes a param, from the store's counters (a layer's 256 x 1024 w, each slot a
  # whole number of 4096-byte blocks): the params read twice by the model (2 + 2); the fp32
  # master (4) and two 8-bit moments with a float32 scale a 256 (1 + 4/256 each) read and
  # written; the params written (2); the step count (a 4096-byte slot a layer) read and
  # written. update="explicit" writes the gradients and reads them back (+4): not the params,
  # which the master's step overwrites whatever they held (`master.rounds_to_master`).
  n = 256 * 1024
  state = 4 + 2 * (1 + 4 / 256)
  want = 2 + 2 + 2 * state + 2 + 2 * 4096 / n + (4 if mode == "explicit" else 0)
  assert moved / (L * n) == want  # 18.09 a param (backward), 22.09 (explicit): fp32 30, 34
  assert mode == "explicit" or moved / (L * n) <= 20


def create(path, layers, tx, mode="explicit", budget=None):
  return offlax.LayerStore.create(
    path, layers, optimizer=tx, progress=False, update=mode, update_bytes=budget
  )


def least_budget(tmp_path, layers, tx):
  """The least ``update_bytes`` the store takes, from the refusal of a smaller one."""
  with pytest.raises(errors.InvalidOptionError, match=r"update_bytes=100000 cannot hold") as e:
    create(str(tmp_path / "refused"), layers, tx, budget=100_000)
  return int(str(e.value).split("update_bytes >= ")[1].split(" ")[0])


def test_a_budget_that_cannot_hold_an_8bit_leaf_names_it_and_the_least_that_works(tmp_path):
  layers = make_layers(rows=64, cols=64)  # 4096 elements a layer: its blocks cannot be cut
  with pytest.raises(errors.InvalidOptionError) as e:
    create(str(tmp_path / "s"), layers, master_8bit(), budget=10_000)
  assert "leaf ['w'] (bfloat16[64, 64] a layer; its unit whole" in str(e.value)
  assert "8-bit moments are cut at multiples of 262144 elements" in str(e.value)
  assert "update_bytes >= " in str(e.value)
  assert not (tmp_path / "s").exists()  # refused before writing anything


def test_8bit_ranges_start_on_blocks_of_codes_and_scales():
  """`ranges.plan` cuts an 8-bit leaf where its codes and its scales both start a direct-I/O
  block, and `ranges.blocks` maps its ranges onto the scales, covering them once."""
  rec = {"path": "['w']", "shape": [1000, 1024], "dtype": "bfloat16", "slot": 2048000}
  codes = {"path": "mu", "shape": [1000, 1024], "dtype": "int8", "slot": 1024000}
  scales = {"path": "mu_scale", "shape": [4000], "dtype": "float32", "slot": 16384}
  assert ranges._align_rows([rec, codes], [scales], 1024) == 256  # 262144 elements
  leaf = ranges._leaf(rec, rec, [codes], [], [scales])
  assert leaf.align == 256 and leaf.scales
  cut = ranges.of(rec, 256)
  spans = [ranges.span(scales, ranges.blocks(rec, r)) for r in cut]
  assert [ranges.blocks(rec, r)[:2] for r in cut] == [(0, 1024), (1024, 2048), (2048, 3072),
                                                      (3072, 4000)]  # fmt: skip
  assert all(start % 4096 == 0 for start, _ in spans)
  assert sum(n for _, n in spans) == scales["slot"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["explicit", "backward"])
def test_8bit_leaves_cut_in_ranges_of_blocks_give_the_same_bits(tmp_path, mode):
  layers, tx = make_layers(rows=512, bias=True), master_8bit()
  budget = least_budget(tmp_path, layers, tx)  # w in 2 ranges of 256 rows (262144 elements)
  with create(str(tmp_path / "s"), layers, tx, mode, budget) as store:
    train(store, 2, rows=512)
    params, state, stats = store.read_params(), store.read_state(), store.last_update
  with create(str(tmp_path / "w"), layers, tx, mode) as store:
    train(store, 2, rows=512)
    whole = store.last_update
  want_params, want_state = reference(tx, layers, 2)
  assert_bits(params, want_params)
  assert_bits(state, want_state)
  assert 0 < stats.peak_bytes <= budget < whole.peak_bytes  # w was cut
  assert stats.bytes_written == whole.bytes_written


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["explicit", "backward"])
def test_8bit_accumulation_and_a_clip_that_applies_within_a_budget(tmp_path, mode):
  layers = make_layers(rows=512, bias=True)
  make = lambda: optax.chain(optax.clip_by_global_norm(1e-4), master_8bit())
  budget = least_budget(tmp_path, layers, make())
  out = []
  for name, b in (("cut", budget), ("whole", None)):
    with create(str(tmp_path / name), layers, make(), mode, b) as store:
      train(store, 2, micro=2, rows=512)
      assert store.last_update.clipped
      out.append((store.read_params(), store.read_state()))
  assert_bits(out[0], out[1])
  # The clip is the chain's, over every layer's gradients: on the stacked tree, then the
  # 8-bit optimizer on each layer.
  clip = optax.clip_by_global_norm(1e-4)
  clipped = jax.jit(lambda g: clip.update(g, clip.init(g))[0])
  want = reference(master_8bit(), layers, 2, micro=2, transform=clipped)
  assert_bits(out[0], want)


@pytest.mark.slow
def test_a_flipped_byte_in_a_cut_8bit_scales_slot_is_refused(tmp_path):
  from test_layer_store_budget import flip

  path, layers, tx = str(tmp_path / "s"), make_layers(rows=512), master_8bit()
  budget = least_budget(tmp_path, layers, tx)
  with create(path, layers, tx, budget=budget) as store:
    train(store, 1, rows=512)
    before = store.read_params()
  records = json.load(open(os.path.join(path, "layers.json")))["state"]
  nu_scale = next(j for j, r in enumerate(records) if "nu_scale" in r["path"])
  flip(path, "state", nu_scale, 1, 5)  # in w's first range of layer 1: seen after its last
  with offlax.LayerStore.open(path, like(layers), optimizer=tx, progress=False,
                              update_bytes=budget) as store:  # fmt: skip
    with pytest.raises(errors.StoreCorruptedError, match=r"layer 1 of state leaf .*nu_scale"):
      train(store, 1, start=1, rows=512)
    assert store.step == 1
    assert_bits(store.read_params(), before)  # nothing committed
