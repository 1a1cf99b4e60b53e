"""A `LayerStore`'s ``accumulator_dtype``: bf16 layers' gradients summed in float32 on disk.

The reference sums each micro-step's bf16 gradients in float32 in memory, in the order the
store adds them, casts the sum to bf16 (as `optax.MultiSteps` casts its accumulator for the
optimizer) and runs the optimizer on each layer. The store equals it bit for bit in both
update modes, with whole leaves and with leaves cut in ranges (``update_bytes``), across a
reopen; with a global-norm clip that applies, the backward mode (its redo reads the kept
gradients back) equals the explicit one. A bf16 accumulator gives other params (what the
option is for); bad values are refused, a damaged manifest's too.
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

L, ROWS, COLS, MICRO = 3, 256, 512, 4
FEWEST_ROUNDED = 0.1  # of a bf16 sum's elements differing from the float32 one (measured: 30%)
BUDGET = 1 << 20  # cuts the 256 KiB bf16 leaf (1 MiB of fp32 master and moments) in ranges


def make_layers():
  w = jax.random.normal(jax.random.key(0), (L, ROWS, COLS)) / COLS**0.5
  return {"w": w.astype(jnp.bfloat16)}


def like():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_layers())


def loss(layers, x):
  step = lambda h, p: (jnp.tanh(h @ p["w"] @ p["w"].T), None)
  h, _ = offlax.scan_layers(step, x, layers)
  return jnp.mean(h.astype(jnp.float32) ** 2)


grad = jax.jit(jax.grad(loss))


def batch(n):
  return jax.random.normal(jax.random.key(100 + n), (3, ROWS)).astype(jnp.bfloat16)


def master():
  return offlax.master_weights(optax.adamw(1e-2, weight_decay=0.1))


def reference(steps):
  """Params after `steps` steps of `MICRO` micro-steps: their sum in float32, cast to bf16,
  then the optimizer on each layer."""
  tx = master()
  layer = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
  apply = lambda p, u_s: (optax.apply_updates(p, u_s[0]), u_s[1])
  update = jax.jit(lambda g, s, p: apply(p, tx.update(g, s, p)))
  params = make_layers()
  states = [tx.init(layer(params, i)) for i in range(L)]
  for step in range(steps):
    acc = None
    for m in range(MICRO):
      g = np.asarray(grad(params, batch(MICRO * step + m))["w"]).astype(np.float32)
      acc = g if acc is None else acc + g
    g = {"w": acc.astype(jnp.bfloat16)}
    new = [update(layer(g, i), states[i], layer(params, i)) for i in range(L)]
    params = jax.tree.map(lambda *xs: np.stack(xs), *[p for p, _ in new])
    states = [s for _, s in new]
  return params


def train(store, steps, start=0):
  for step in range(start, start + steps):
    store.zero_grads()
    for m in range(MICRO):
      source = store.source(accumulate=True, last=m == MICRO - 1)
      grad(source, batch(MICRO * step + m))
    store.update()


def create(path, mode, *, tx=None, budget=None, accumulator=jnp.float32):
  return offlax.LayerStore.create(
    str(path), make_layers(), optimizer=tx or master(), progress=False, update=mode,
    update_bytes=budget, accumulator_dtype=accumulator,
  )  # fmt: skip


def assert_bits(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow_except("explicit-whole", "backward-whole")
@pytest.mark.parametrize(
  "mode, budget",
  [("explicit", None), ("backward", None), ("explicit", BUDGET), ("backward", BUDGET)],
  ids=["explicit-whole", "backward-whole", "explicit-ranges", "backward-ranges"],
)
def test_a_float32_accumulator_sums_bf16_micro_steps_as_optax_does(tmp_path, mode, budget):
  """Bit for bit the float32 sum cast to bf16, then the optimizer; reopened, it goes on."""
  with create(tmp_path / "s", mode, budget=budget) as store:
    assert [r["dtype"] for r in store.grad_records] == ["float32"]
    assert [r["dtype"] for r in store.records] == ["bfloat16"]
    train(store, 1)
  with offlax.LayerStore.open(str(tmp_path / "s"), like(), optimizer=master(), progress=False,
                              update=mode, update_bytes=budget) as store:  # fmt: skip
    assert store.grad_records[0]["dtype"] == "float32"  # recorded in the manifest
    train(store, 1, start=1)
    assert_bits(store.read_params(), reference(2))
  [report] = offlax.checkpoint.inspect_store(str(tmp_path / "s"), verify=True, progress=False)
  assert not report.problems, report.problems  # the gradients' files at float32's size


def test_the_sum_on_disk_is_float32_and_a_bf16_one_rounds(tmp_path):
  """`read_grads` gives the float32 sum itself; the same steps with the layers' own bf16
  accumulator round each partial sum (a sum other than the float32 one rounded once), and give
  other params."""
  with create(tmp_path / "f", "explicit") as store:
    store.zero_grads()
    for m in range(MICRO):
      grad(store.source(accumulate=True), batch(m))
    params = make_layers()
    want = sum(np.asarray(grad(params, batch(m))["w"]).astype(np.float32) for m in range(MICRO))
    got = store.read_grads()["w"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    store.update()
    f32 = store.read_params()["w"]
  with create(tmp_path / "b", "explicit", accumulator=None) as store:
    store.zero_grads()
    for m in range(MICRO):
      grad(store.source(accumulate=True), batch(m))
    rounded = store.read_grads()["w"]
    assert rounded.dtype == jnp.bfloat16
    store.update()
    bf16 = store.read_params()["w"]
  assert np.mean(rounded != want.astype(jnp.bfloat16)) > FEWEST_ROUNDED
  assert_bits({"w": f32}, reference(1))
  assert np.any(f32 != bf16)


def test_a_float32_gradient_moves_4_bytes_a_param_more_each_way(tmp_path):
  """A step of one batch in the explicit mode, from the store's counters: the params read
  twice by the model (2 + 2), the gradient written and read back in float32 (4 + 4), the
  fp32 master and moments read and written (12 + 12), the params written (2), the step
  count's 4096-byte slot read and written: 38 bytes a param, 34 with bf16 gradients."""
  n = ROWS * COLS
  for accumulator, want in ((jnp.float32, 38), (None, 34)):
    with create(tmp_path / str(accumulator), "explicit", accumulator=accumulator) as store:
      grad(store.source(), batch(0))
      store.update()
      moved = store.bytes_read + store.bytes_written
      grad(store.source(), batch(1))
      store.update()
      moved = store.bytes_read + store.bytes_written - moved
    assert moved / (L * n) == want + 2 * 4096 / n


@pytest.mark.slow  # two stores, a redo: 10 s on the shared machine
def test_a_clip_that_applies_redoes_from_the_float32_gradients_kept(tmp_path):
  """The backward mode keeps the last micro-step's sum (cast for its slot) for the clip's redo:
  the same params as the explicit mode, which reads the sum."""
  tx = lambda: optax.chain(optax.clip_by_global_norm(1e-3), master())  # noqa: E731
  out = {}
  for mode in ("explicit", "backward"):
    with create(tmp_path / mode, mode, tx=tx()) as store:
      train(store, 2)
      assert store.last_update.clipped
      out[mode] = store.read_params()
  assert_bits(out["backward"], out["explicit"])


@pytest.mark.parametrize(
  "dtype, match",
  [
    (jnp.int32, r"accumulator_dtype=int32; pass a floating dtype \(jnp.float32"),
    ("float33", r"accumulator_dtype='float33'; pass a floating dtype"),
    (jnp.float16, r"accumulator_dtype=float16 cannot hold leaf \['w'\]'s bfloat16 gradients"),
  ],
)
def test_an_accumulator_that_cannot_hold_the_gradients_is_refused(tmp_path, dtype, match):
  with pytest.raises(errors.InvalidOptionError, match=match):
    create(tmp_path / "s", "explicit", accumulator=dtype)
  assert not os.path.exists(tmp_path / "s")  # refused before anything is written


def test_a_damaged_accumulator_dtype_in_the_manifest_is_said(tmp_path):
  create(tmp_path / "s", "explicit").close()
  name = tmp_path / "s" / "layers.json"
  manifest = json.loads(name.read_text())
  manifest["accumulator_dtype"] = "float33"
  name.write_text(json.dumps(manifest))
  with pytest.raises(errors.StoreCorruptedError, match="accumulator_dtype 'float33', not a float"):
    offlax.LayerStore.open(str(tmp_path / "s"), like(), optimizer=master())
