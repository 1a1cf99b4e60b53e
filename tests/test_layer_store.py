"""Layers' params and gradients on disk (`LayerStore`), streamed through `offlax.scan_layers`.

The reference is `scan_layers` over the same stacked arrays in memory: the loss,
and the gradients the backward pass writes to the store, are the same bits.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offlax
from offlax._src import errors
from offlax._src.layer_store.store import LayerStore

L, D = 6, 16


def make_layers(dtype=jnp.float32, n=L):
  k = jax.random.split(jax.random.key(0), 2)
  return {
    "w": (jax.random.normal(k[0], (n, D, D)) / D**0.5).astype(dtype),
    "b": (jax.random.normal(k[1], (n, D)) * 0.1).astype(dtype),
  }


def layer(h, p):
  return jnp.tanh(h @ p["w"] + p["b"]), None


def loss_fn(**kw):
  def loss(layers, x):
    h, _ = offlax.scan_layers(layer, x, layers, **kw)
    return jnp.mean(h.astype(jnp.float32) ** 2)

  return loss


def inputs(dtype):
  return jax.random.normal(jax.random.key(1), (3, D)).astype(dtype)


def assert_tree_bits(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  "dtype, kw",
  [
    (jnp.float32, {}),
    pytest.param(jnp.bfloat16, {}, marks=pytest.mark.slow),
    pytest.param(jnp.float32, {"reverse": True}, marks=pytest.mark.slow),
    (jnp.bfloat16, {"remat": jax.checkpoint_policies.dots_saveable}),
    pytest.param(jnp.float32, {"remat": False}, marks=pytest.mark.slow),
  ],
)
def test_loss_and_grads_bit_exact(tmp_path, dtype, kw):
  layers, x = make_layers(dtype), inputs(dtype)
  loss = loss_fn(**kw)
  want_loss, (want_g, want_gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(layers, x)
  with LayerStore.create(str(tmp_path / "s"), layers) as store:
    assert_tree_bits(store.read_params(), layers)
    got_loss, (g_src, got_gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(store.source(), x)
    np.testing.assert_array_equal(got_loss, want_loss)
    np.testing.assert_array_equal(got_gx, want_gx)  # through the layers read from disk
    np.testing.assert_array_equal(g_src.token, np.zeros(L, np.float32))
    assert_tree_bits(store.read_grads(), want_g)
    assert store.peak_held <= store.pool_layers


def test_backward_reads_each_layer_again(tmp_path):
  layers, x = make_layers(), inputs(jnp.float32)
  with LayerStore.create(str(tmp_path / "s"), layers) as store:
    read = store.read_layer
    seen: list[int] = []
    store.read_layer = lambda i: (seen.append(i), read(i))[1]
    jax.jit(jax.grad(loss_fn()))(store.source(), x)
    # forward 0..L-1, then the rematerialised backward L-1..0, each layer read once
    # (the pool reads the next ahead; no guess is wasted)
    assert sorted(seen) == sorted(list(range(L)) * 2)
    assert store.peak_held == 2


def test_accumulate_and_overwrite(tmp_path):
  layers = make_layers(jnp.bfloat16)
  x1, x2 = inputs(jnp.bfloat16), inputs(jnp.bfloat16) * 2
  grad = jax.jit(jax.grad(loss_fn()))
  g1, g2 = grad(layers, x1), grad(layers, x2)
  with LayerStore.create(str(tmp_path / "s"), layers) as store:
    grad(store.source(accumulate=True), x1)
    grad(store.source(accumulate=True), x2)
    summed = jax.tree.map(lambda a, b: np.asarray(a) + np.asarray(b), g1, g2)
    assert_tree_bits(store.read_grads(), summed)
    grad(store.source(), x2)  # without accumulate: overwritten
    assert_tree_bits(store.read_grads(), g2)
    store.zero_grads()
    assert_tree_bits(store.read_grads(), jax.tree.map(np.zeros_like, g2))


@pytest.mark.parametrize(
  "pool_layers",
  [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)],
)
def test_pool_bound(tmp_path, pool_layers):
  """Reads started and not yet handed to the device never exceed the pool."""
  layers, x = make_layers(n=8), inputs(jnp.float32)
  with LayerStore.create(str(tmp_path / "s"), layers, pool_layers=pool_layers) as store:
    read, fetch = store.read_layer, store.fetch
    count = {"started": 0, "returned": 0, "most": 0}

    def counted_read(i):
      count["started"] += 1
      count["most"] = max(count["most"], count["started"] - count["returned"])
      return read(i)

    def counted_fetch(i):
      out = fetch(i)
      count["returned"] += 1
      return out

    store.read_layer, store.fetch = counted_read, counted_fetch
    jax.jit(jax.grad(loss_fn()))(store.source(), x)
    assert count["most"] <= pool_layers
    assert store.peak_held == pool_layers  # the pool is used: reads run ahead
    assert count["returned"] == 16


def test_reopen(tmp_path):
  layers, x = make_layers(), inputs(jnp.float32)
  LayerStore.create(str(tmp_path / "s"), layers).close()
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with LayerStore.open(str(tmp_path / "s"), like, pool_bytes=3 * 8192) as store:
    assert store.pool_layers == 3  # w and b each padded to one 4096-byte block
    assert_tree_bits(store.read_params(), layers)
    jax.jit(jax.grad(loss_fn()))(store.source(), x)
    assert_tree_bits(store.read_grads(), jax.jit(jax.grad(loss_fn()))(layers, x))


def test_bad_input(tmp_path):
  layers = make_layers()
  path = str(tmp_path / "s")
  with pytest.raises(errors.InvalidOptionError, match=r"pool_layers=0 .*minimum is 1"):
    LayerStore.create(path, layers, pool_layers=0)
  with pytest.raises(errors.InvalidOptionError, match=r"pool_bytes=100 .*minimum is 8192 bytes"):
    LayerStore.create(path, layers, pool_bytes=100)
  assert not os.path.exists(path)  # refused before writing anything
  with pytest.raises(errors.StoreError, match="no layer store"):
    LayerStore.open(path, layers)
  LayerStore.create(path, layers).close()
  with pytest.raises(errors.StoreExistsError, match="already holds a layer store.*LayerStore.open"):
    LayerStore.create(path, layers)

  wrong = {**layers, "w": jnp.zeros((L, D, D + 1))}
  with pytest.raises(errors.StoreMismatchError, match=r"leaf \['w'\] .*float32\[16, 16\].*"
                     r"expected float32\[16, 17\]"):  # fmt: skip
    LayerStore.open(path, wrong)
  with pytest.raises(errors.StoreMismatchError, match=r"leaf \['b'\] .*expected bfloat16"):
    LayerStore.open(path, {**layers, "b": layers["b"].astype(jnp.bfloat16)})
  with pytest.raises(errors.StoreMismatchError, match=r"no param leaf \['c'\]"):
    LayerStore.open(path, {**layers, "c": layers["b"]})
  with pytest.raises(
    errors.StoreMismatchError, match=r"param leaves the tree does not have: \['b'\]"
  ):
    LayerStore.open(path, {"w": layers["w"]})
  with pytest.raises(errors.StoreMismatchError, match=f"holds {L} layers, expected 3"):
    LayerStore.open(path, jax.tree.map(lambda a: a[:3], layers))
  with pytest.raises(errors.LeafTypeError, match=r"leaf \['b'\] must be an array"):
    LayerStore.create(str(tmp_path / "t"), {**layers, "b": 1.0})

  manifest = json.loads((tmp_path / "s" / "layers.json").read_text())
  grads = tmp_path / "s" / "grads" / "0.bin"
  os.truncate(grads, 100)
  with pytest.raises(
    errors.StoreCorruptedError, match=r"0.bin \(grads leaf \['b'\]\) holds 100 bytes"
  ):
    LayerStore.open(path, layers)
  (tmp_path / "s" / "layers.json").write_text(json.dumps({**manifest, "format": "x"}))
  with pytest.raises(errors.StoreCorruptedError, match="not a layer store"):
    LayerStore.open(path, layers)


@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_compiles_for_gpu_with_flat_device_memory(tmp_path):
  """The reads and gradient writes lower as XLA:GPU's Python callbacks; more layers, same peak."""
  peaks = []
  for n in (4, 8):
    with LayerStore.create(str(tmp_path / str(n)), make_layers(n=n)) as store:
      grad = jax.grad(loss_fn(offload_activations=True))
      m = offlax.compile_for_gpu(grad, store.source(), inputs(jnp.float32), target="h100")
    # a read forward, a read again backward (remat), a gradient write
    assert m.hlo.count('custom_call_target="xla_ffi_python_gpu_callback"') == 3
    peaks.append(m.device["temp"] + m.device["argument"] - 4 * n)  # less the token: 4 B a layer
  assert peaks[0] == peaks[1]


@pytest.mark.slow
@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_a_llama_with_its_layers_on_disk_compiles_flat(tmp_path):
  """Llama's step with its layers in a sparse store: no host buffer grows with the layers."""
  from offlax._src import llama

  peaks = {}
  for n in (2, 4):
    m = llama.Llama(layers=n, d=256, ffn=512, vocab=512, heads=2, tokens=128)
    on_disk = llama.compile_step(m, "h100", layer_store=str(tmp_path / str(n)))
    in_host = llama.compile_step(m, "h100")
    assert on_disk.host_compute == () and on_disk.fits
    peaks[n] = on_disk.host_peak, on_disk.device_peak, in_host.host_peak
  # Params in host memory: the host buffers grow by two layers' params, gradients and state;
  # on disk: not at all (the embedding, head and norm and their state only).
  assert peaks[4][2] - peaks[2][2] >= 2 * 16 * m.layer_params
  assert peaks[4][0] == peaks[2][0]
  assert 0 <= peaks[4][1] - peaks[2][1] <= 16  # the source's token: 4 B a layer (a read's operand)
