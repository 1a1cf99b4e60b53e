"""Tunix's Llama3, Qwen3 and Gemma3 (their code unedited) with their decoder layers on disk.

``offlax.offload_params(model, store=store)`` finds the model's list of layers
and reads each from the `LayerStore`; the embedding and the final norm go to
host memory. Three steps (`store.update()` for the layers, offlax's host update
for the rest) give the losses, and the first step the gradients, of the same
model with all its params in host memory, bit for bit.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import offlax

pytest.importorskip("tunix")

from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402

SMALL = dict(embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2)
VOCAB, LAYERS = 64, 3


def make_model(family):
  if family == "llama3":
    config = llama3.ModelConfig(num_layers=LAYERS, vocab_size=VOCAB, rope_theta=10_000,
                                norm_eps=1e-5, **SMALL)  # fmt: skip
    return llama3.Llama3(config, rngs=nnx.Rngs(0))
  if family == "qwen3":
    config = qwen3.ModelConfig(num_layers=LAYERS, vocab_size=VOCAB, rope_theta=10_000,
                               norm_eps=1e-6, **SMALL)  # fmt: skip
    return qwen3.Qwen3(config, rngs=nnx.Rngs(0))
  config = dataclasses.replace(
    gemma3.ModelConfig.gemma3_270m(), num_layers=LAYERS, num_embed=VOCAB, sliding_window_size=4,
    param_dtype=jnp.float32, **SMALL,
  )  # fmt: skip
  return gemma3.Gemma3(config, rngs=nnx.Rngs(0))


def loss_fn(model, tokens):
  b, n = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(n), (b, n))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
  logits, _ = model(tokens, positions, None, mask)
  labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
  return optax.softmax_cross_entropy(logits[:, :-1].astype(jnp.float32), labels).mean()


def tokens(step):
  return jax.random.randint(jax.random.key(step), (2, 8), 1, VOCAB)


@pytest.mark.slow  # 15 s a model
@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3"])
def test_tunix_layers_on_disk_train_as_in_host_memory(tmp_path, family):
  tx = lambda: optax.adamw(1e-2, weight_decay=0.1)
  grad = nnx.jit(nnx.value_and_grad(loss_fn))
  update = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))

  def train(model, store=None):
    """Three steps' losses; the first step's gradients (of the layers: as the store got them)."""
    optimizer = nnx.Optimizer(model, offlax.offload(tx(), compute="host"), wrt=nnx.Param)
    losses = []
    for step in range(3):
      loss, grads = grad(model, tokens(step))
      if step == 0:
        first = jax.device_get(nnx.state(grads, nnx.Param))
        layers = first.pop("layers")
        layers = store.read_grads() if store else _stack([layers[i] for i in range(LAYERS)])
      update(model, optimizer, grads)
      if store is not None:
        store.update()
      losses.append(float(loss))
    return losses, first, layers

  stacked = offlax.stack_layers(make_model(family).layers)
  with offlax.LayerStore.create(str(tmp_path / "s"), stacked, optimizer=tx(), progress=False) as s:
    model = offlax.offload_params(make_model(family), store=s)
    assert [type(x).__name__ for x in jax.tree.leaves(nnx.state(model.layers[0], nnx.Param))] == [
      "ArrayImpl"
    ]  # the token: its params are in the store
    got = train(model, s)
  want = train(offlax.offload_params(make_model(family)))
  assert got[0] == want[0]  # the losses
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _stack(trees):
  return jax.tree.map(lambda *x: np.stack(x), *trees)
