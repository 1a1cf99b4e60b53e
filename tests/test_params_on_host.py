"""Params, gradients and optimizer state all off the device, trained bit for bit as without offlax.

The model keeps its stacked layers (and embedding) in ``pinned_host`` memory;
`offlax.scan_layers` fetches a layer at a time, gradients come back in host
memory, and `offlax.update_and_apply` runs the optimizer and writes the new
params over the old. The reference is the same model, all on the device, with a
plain `jax.lax.scan` and optax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal, committed, committed_state
from test_nvme import _stored_state

import offlax
from offlax._src import apply as apply_lib

L, D = 4, 32
HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def make_params(dtype):
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "layers": {
      "w": (jax.random.normal(k[0], (L, D, D)) / D**0.5).astype(dtype),
      "b": (jax.random.normal(k[1], (L, D)) * 0.1).astype(dtype),
    },
    "embed": jax.random.normal(k[2], (16, D)).astype(dtype),
    "scale": jnp.ones(D, dtype),  # stays on the device
  }


def layer(h, w):
  return jnp.tanh(h @ w["w"] + w["b"]), None


def loss_with(scan):
  def loss(p, tokens):
    h = offlax.fetch(p["embed"])[tokens]
    h, _ = scan(h, p["layers"])
    return jnp.mean((h.astype(jnp.float32) * p["scale"]) ** 2)

  return loss


def offlax_scan(**kw):
  return lambda h, layers: offlax.scan_layers(layer, h, layers, **kw)


def plain_scan(h, layers):
  return jax.lax.scan(layer, h, layers)


def to_host(p):
  return {**jax.device_put({k: v for k, v in p.items() if k != "scale"}, HOST), "scale": p["scale"]}


TOKENS = jnp.array([[1, 5, 7, 2], [3, 3, 0, 15]])


def train(tx, params, loss, steps, fused):
  params = committed(params)  # the step compiles once
  state = committed_state(tx.init(params))

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss)(params, TOKENS)
    if fused:
      return offlax.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params, state


@pytest.mark.slow_except(
  "True-True-True", "False-False-True"
)  # remat + offloaded inputs, no remat; reversed
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
  "remat, offload_activations",
  [(True, False), (False, False), (True, True), (jax.checkpoint_policies.dots_saveable, True)],
)
def test_layer_gradients_equal_plain_scan(remat, reverse, offload_activations):
  params = make_params(jnp.float32)
  want = jax.jit(jax.grad(loss_with(lambda h, w: jax.lax.scan(layer, h, w, reverse=reverse))))(
    params, TOKENS
  )
  scan = offlax_scan(remat=remat, reverse=reverse, offload_activations=offload_activations)
  got = jax.jit(jax.grad(loss_with(scan)))(to_host(params), TOKENS)
  # Every layer's gradient, and the embedding's, arrive in host memory.
  assert got["layers"]["w"].sharding.memory_kind == "pinned_host"
  assert got["embed"].sharding.memory_kind == "pinned_host"
  assert got["scale"].sharding.memory_kind == "device"
  assert_trees_equal(got, want)


def test_offload_activations_needs_remat():
  with pytest.raises(offlax.errors.InvalidOptionError, match="remat"):
    offlax.scan_layers(layer, jnp.ones(D), make_params(jnp.float32)["layers"],
                       remat=False, offload_activations=True)  # fmt: skip


@pytest.mark.parametrize("compute", [pytest.param("device", marks=pytest.mark.slow), "host"])
@pytest.mark.parametrize("master", [pytest.param(False, marks=pytest.mark.slow), True])
def test_training_off_device_equals_plain(compute, master):
  dtype = jnp.bfloat16 if master else jnp.float32
  inner = optax.adamw(1e-2)
  inner = offlax.master_weights(inner) if master else inner
  params = make_params(dtype)
  want_p, want_s = train(inner, params, loss_with(plain_scan), 3, fused=False)
  # 2 KiB slices: the stacked leaves are cut into pieces, updated in loops.
  tx = offlax.offload(inner, compute=compute, chunk_bytes=2048)
  got_p, got_s = train(tx, to_host(params), loss_with(offlax_scan()), 3, fused=True)
  assert_trees_equal(got_p, want_p)
  assert_trees_equal(got_s.inner_state, want_s)
  kinds = jax.tree.map(lambda x: x.sharding.memory_kind, got_p)
  assert kinds == {
    "layers": {"w": "pinned_host", "b": "pinned_host"}, "embed": "pinned_host", "scale": "device"
  }  # fmt: skip
  master_w = got_s.inner_state.master["layers"]["w"] if master else None
  assert master_w is None or master_w.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("compute", [pytest.param("device", marks=pytest.mark.slow), "host"])
def test_unfused_update_keeps_host_updates_on_host(compute):
  params = to_host(make_params(jnp.float32))
  tx = offlax.offload(optax.adam(1e-2), compute=compute, chunk_bytes=2048)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss_with(offlax_scan()))(params, TOKENS)
    updates, state = tx.update(grads, state, params)
    return updates, offlax.extend.apply_updates(params, updates), state

  updates, new, _ = step(params, state)
  assert updates["layers"]["w"].sharding.memory_kind == "pinned_host"
  assert new["layers"]["w"].sharding.memory_kind == "pinned_host"
  want = jax.tree.map(lambda p, u: p + u, jax.device_get(params), jax.device_get(updates))
  assert_trees_equal(new, want)


def test_apply_updates_in_slices(monkeypatch):
  # 1 KiB per host computation: the (4, 32, 32) leaf in 4 slices of 8 rows... and a tail.
  monkeypatch.setattr(apply_lib, "APPLY_CHUNK_BYTES", 1000)
  p = jax.device_put(jnp.arange(5 * 8 * 8, dtype=jnp.float32).reshape(5, 8, 8), HOST)
  u = jnp.full((5, 8, 8), 0.25)
  got = jax.jit(offlax.extend.apply_updates)({"p": p}, {"p": u})["p"]
  assert got.sharding.memory_kind == "pinned_host"
  np.testing.assert_array_equal(np.asarray(got), np.asarray(p) + 0.25)


@pytest.mark.slow  # the host tier's and NNX's cases run
@pytest.mark.parametrize("compute", ["device", "host"])
def test_coupled_update_inside_offload_equals_optax(compute):
  # The global norm needs every gradient: the update runs as one slice.
  ref = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
  tx = offlax.offload(ref, compute=compute)
  params = make_params(jnp.float32)
  got_p, got_s = train(tx, to_host(params), loss_with(offlax_scan()), 2, fused=True)
  want_p, want_s = train(ref, params, loss_with(plain_scan), 2, fused=False)
  assert_trees_equal(got_p, want_p)
  assert_trees_equal(got_s.inner_state, want_s)


def test_transformations_outside_offload_on_host_gradients_are_refused():
  tx = optax.chain(optax.clip_by_global_norm(0.1), offlax.offload(optax.adam(1e-2)))
  params = to_host(make_params(jnp.float32))
  with pytest.raises(offlax.errors.MemoryKindError, match=r"offlax.offload\(optax.chain"):
    train(tx, params, loss_with(offlax_scan()), 1, fused=True)


def test_master_weights_leaf_with_a_tail_piece_equals_plain():
  # A regression: a leaf cut into a loop of equal pieces and a shorter last
  # piece read that piece's gradients from the updates buffer of the loop.
  params = {"w": jax.random.normal(jax.random.key(1), (4, 64, 64), jnp.bfloat16)}
  grads = jax.tree.map(lambda x: (x * 3).astype(x.dtype), params)
  inner = offlax.master_weights(optax.adamw(1e-2))
  for compute in ("device", "host"):
    tx = offlax.offload(inner, compute=compute, chunk_bytes=16384)
    got = jax.jit(tx.update)(grads, tx.init(params), params)
    want = jax.jit(inner.update)(grads, inner.init(params), params)
    assert_trees_equal(got[0], want[0])
    assert_trees_equal(got[1].inner_state, want[1])


@pytest.mark.slow  # the host tier's and NNX's cases run
def test_nvme_tier_with_params_on_host(tmp_path):
  inner = offlax.master_weights(optax.adamw(1e-2))
  params = make_params(jnp.bfloat16)
  want_p, want_s = train(inner, params, loss_with(plain_scan), 3, fused=False)
  tier = offlax.NVMeTier(str(tmp_path / "store"), chunk_bytes=2048, cache_bytes=0)
  tx = offlax.offload(inner, tier)
  got_p, got_s = train(tx, to_host(params), loss_with(offlax_scan()), 3, fused=True)
  tier.close()
  assert_trees_equal(got_p, want_p)
  assert got_p["layers"]["w"].sharding.memory_kind == "pinned_host"
  stored, step = _stored_state(tmp_path / "store", want_s, want_p)
  assert step == 3
  assert_trees_equal(stored, want_s)


@pytest.mark.parametrize("compute", [pytest.param("device", marks=pytest.mark.slow), "host"])
def test_step_exports_for_cuda(compute):
  # jax.export type-checks memory spaces for CUDA (tests/test_gpu_compile.py compiles it).
  params = to_host(make_params(jnp.bfloat16))
  tx = offlax.offload(offlax.master_weights(optax.adamw(1e-2)), compute=compute, chunk_bytes=2048)
  state = tx.init(params)

  def step(params, state):
    grads = jax.grad(loss_with(offlax_scan(offload_activations=True)))(params, TOKENS)
    return offlax.update_and_apply(tx, grads, state, params)

  exported = jax.export.export(jax.jit(step, donate_argnums=(0, 1)), platforms=["cuda"])(
    params, state
  )
  assert "cuda" in exported.platforms
  text = exported.mlir_module()
  assert "pinned_host" in text and "annotate_device_placement" in text
