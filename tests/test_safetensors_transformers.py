"""A saved checkpoint as Hugging Face `transformers` reads it: the reference implementation.

A tiny float32 Qwen3 and Llama3 checkpoint in `transformers`' own layout (its
``config.json``, from its config class), loaded by `offlax.load_safetensors`
into Tunix's model, trained a step, saved by `offlax.save_safetensors`, then
loaded by ``transformers.AutoModelForCausalLM.from_pretrained``: its logits
equal the trained Tunix model's within float32 rounding (two implementations
of the same maths: the order of the sums and RoPE's rounding differ, so not bit
for bit; the bound is 1e-4 of the logits' scale, a wrong layout or a missing
transpose changes them by their whole scale). Slow (each family compiles a
training step, and `transformers` builds its model); skipped where PyTorch or
`transformers` is missing (`.ci/run`'s extras install them: docs/development.md).
"""

import inspect
import json
import os

import numpy as np
import optax
import pytest
from flax import nnx

import offlax

torch = pytest.importorskip("torch", reason="needs torch: transformers' models run on it")
transformers = pytest.importorskip(
  "transformers", reason="needs transformers: the reference implementation"
)
pytest.importorskip("tunix", reason="needs google-tunix: the Llama3/Qwen3 models are Tunix's")

from test_safetensors import (  # noqa: E402
  TOKENS,
  VOCAB,
  abstract_model,
  config_of,
  hf_tensors,
  logits,
  logits_of,
  safetensors_numpy,
)
from tunix.models.llama3 import model as llama3  # noqa: E402


def hf_config(family, config):
  """`transformers`' config of the same model as Tunix's `config` (untied head, no biases)."""
  common = dict(
    vocab_size=VOCAB, hidden_size=config.embed_dim, intermediate_size=config.hidden_dim,
    num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
    rms_norm_eps=config.norm_eps, tie_word_embeddings=False, max_position_embeddings=64,
    attention_bias=False, rope_theta=config.rope_theta,
  )  # fmt: skip
  if family == "llama3":
    # Tunix's Llama3 calls its apply_rope without config.rope_theta, so with that function's
    # default, 1e6 (Meta's Llama3 uses 5e5): the same model in transformers has theta 1e6.
    common["rope_theta"] = inspect.signature(llama3.apply_rope).parameters["rope_theta"].default
  if family == "qwen3":
    return transformers.Qwen3Config(**common)
  return transformers.LlamaConfig(**common, mlp_bias=False)


def write_source(folder, family, config):
  """A checkpoint as `transformers` writes one: its config.json, float32 tensors."""
  os.makedirs(folder)
  hf_config(family, config).to_json_file(os.path.join(folder, "config.json"))
  tensors = hf_tensors(family, config)
  safetensors_numpy.save_file(tensors, os.path.join(folder, "model.safetensors"),
                              metadata={"format": "pt"})  # fmt: skip
  return str(folder)


def transformers_logits(folder):
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  model.eval()
  with torch.no_grad():
    out = model(torch.from_numpy(np.asarray(TOKENS, np.int64)))
  return out.logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_a_saved_fine_tune_loads_in_transformers_with_the_same_logits(tmp_path, family):
  config = config_of(family)
  source = write_source(tmp_path / "source", family, config)
  model = offlax.load_safetensors(abstract_model(family, config), source, progress=False)
  # The untrained model first: offlax's load of transformers' checkpoint computes its logits.
  np.testing.assert_allclose(
    np.asarray(logits_of(model, TOKENS)), transformers_logits(source), rtol=1e-4, atol=1e-4
  )
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss = lambda m: np.float32(1) * (logits(m, TOKENS) ** 2).mean()
    optimizer.update(model, nnx.grad(loss)(model))

  for _ in range(3):
    step(model, optimizer)
  out = offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  read = lambda folder: json.load(open(os.path.join(folder, "config.json")))  # noqa: SIM115
  assert read(out) == read(source)  # copied: transformers builds the same model class
  want = np.asarray(logits_of(model, TOKENS))
  got = transformers_logits(out)
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
  # Training moved the logits far beyond that bound: the check sees the trained weights.
  assert np.abs(transformers_logits(source) - got).max() > 100 * 1e-4 * scale
