"""Flax NNX: a decoder with stacked layers in host memory, trained through `nnx.Optimizer`."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_trees_equal
from flax import nnx

import offlax

HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
L, D = 3, 16


class Block(nnx.Module):
  def __init__(self, rngs, lora_rank=0):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    if lora_rank:
      self.up = nnx.LoRALinear(D, 2 * D, lora_rank=lora_rank, rngs=rngs)
    else:
      self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Decoder(nnx.Module):
  """Layers made by `nnx.vmap` (params stacked on a first axis), run by `offlax.scan_layers`."""

  def __init__(self, rngs, lora_rank=0, offlax_scan=True):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs, lora_rank)

    self.embed = nnx.Embed(11, D, rngs=rngs)
    self.blocks = make(rngs)
    self.head = nnx.Linear(D, 11, rngs=rngs)
    self.offlax_scan = offlax_scan

  def __call__(self, tokens):
    graphdef, layers = nnx.split(self.blocks)
    layer = lambda x, s: (nnx.merge(graphdef, s)(x), None)
    scan = offlax.scan_layers if self.offlax_scan else jax.lax.scan
    x, _ = scan(layer, self.embed(tokens), layers)
    return self.head(x)


def blocks_to_host(model):
  nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), HOST))


TOKENS = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])


def train(model, optimizer, steps, fused, wrt=nnx.Param):
  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      logits = model(TOKENS[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
    if fused:
      offlax.nnx_update(optimizer, model, grads)
    else:
      optimizer.update(model, grads)

  for _ in range(steps):
    step(model, optimizer)


@pytest.mark.slow  # test_params_on_host.py runs the mode
@pytest.mark.parametrize("fused", [True, False])
def test_stacked_decoder_with_host_layers_equals_plain(fused):
  want = Decoder(nnx.Rngs(0), offlax_scan=False)
  train(want, nnx.Optimizer(want, optax.adamw(1e-2), wrt=nnx.Param), 3, fused=False)
  model = Decoder(nnx.Rngs(0))
  blocks_to_host(model)
  tx = offlax.offload(optax.adamw(1e-2), compute="host", chunk_bytes=1024)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train(model, optimizer, 3, fused=fused)
  assert_trees_equal(nnx.state(model), nnx.state(want))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(model.blocks))}
  assert kinds == {"pinned_host"}
  assert model.embed.embedding[...].sharding.memory_kind == "device"


@pytest.mark.slow  # the host tier's and NNX's cases run
def test_lora_with_frozen_base_layers_in_host_memory():
  want = Decoder(nnx.Rngs(0), lora_rank=2, offlax_scan=False)
  opt = nnx.Optimizer(want, optax.adam(1e-2), wrt=nnx.LoRAParam)
  train(want, opt, 3, fused=False, wrt=nnx.LoRAParam)
  model = Decoder(nnx.Rngs(0), lora_rank=2)
  # The frozen base weights in host memory; the adapters (and their state) on the device.
  base = nnx.state(model.blocks, nnx.Not(nnx.LoRAParam))
  nnx.update(model.blocks, jax.device_put(base, HOST))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
  train(model, optimizer, 3, fused=True, wrt=nnx.LoRAParam)
  assert_trees_equal(nnx.state(model), nnx.state(want))
  assert model.blocks.up.kernel[...].sharding.memory_kind == "pinned_host"
  assert model.blocks.up.lora.lora_a[...].sharding.memory_kind == "device"
