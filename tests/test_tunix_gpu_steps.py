"""Tunix's own train step, unedited, compiled for a GPU across offlax's documented uses.

`PeftTrainer._train_step` (its `optax.global_norm(grads)` included) for a tiny Qwen3, with
`offlax.compile_for_gpu`: params in host memory or on the device, adamw or `master_weights`,
streamed or host compute, fp32 or 8-bit state, `gradient_accumulation_steps`, LoRA, a
`LayerStore`, the NVMe tier. Each compiles with no host compute but offlax's own. The CPU
backend runs programs XLA:GPU refuses: before 2026-12-07 every case with params in host memory
failed at the norm, and accumulation on device params ran optax's selects on the host. The two
plain cases run by default (`test_gpu_compile.py`); these are slow (about 15 s each).
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import offlax
from offlax._src import gpu_compile

pytestmark = [
  pytest.mark.slow,
  pytest.mark.skipif(
    not offlax.extend.gpu_compile_available(),
    reason="needs offlax[gpu-compile] (jax-cuda12-plugin)",
  ),
]

CASES = {
  "host-params-streamed": dict(compute="device"),
  "host-params-8bit": dict(bits=8),
  "host-params-8bit-streamed": dict(bits=8, compute="device"),
  "host-params-accumulation": dict(accumulate=2),
  "host-params-accumulation-8bit": dict(accumulate=2, bits=8),
  "device-params": dict(where="device"),
  "device-params-streamed": dict(where="device", compute="device"),
  "device-params-8bit": dict(where="device", bits=8),
  "device-params-accumulation": dict(where="device", accumulate=2),
  "lora-device": dict(where="device", lora=True, master=False),
  "lora-host": dict(lora=True, master=False),
  "layer-store": dict(where="store"),
  "layer-store-commit-in-update": dict(where="store", commit=True),
  "layer-store-bf16-accumulation": dict(where="store", commit=True, own_multi_steps=2),
  "nvme-tier": dict(nvme=True),
}


def tiny_qwen3(master=True, lora=False):
  """Tunix's Qwen3 at tiny dims: bf16 (for `master_weights`) or fp32, with qwix's LoRA or not."""
  from tunix.models.qwen3 import model as qwen3

  dtype = jnp.bfloat16 if master else jnp.float32
  cfg = qwen3.ModelConfig(
    num_layers=2, vocab_size=64, embed_dim=128, hidden_dim=512, num_heads=2, head_dim=64,
    num_kv_heads=1, norm_eps=1e-6, rope_theta=1_000_000, dtype=dtype, param_dtype=dtype,
  )  # fmt: skip
  model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  if lora:
    import qwix

    provider = qwix.LoraProvider(module_path=".*q_proj|.*down_proj", rank=4, alpha=2.0)
    model = qwix.apply_lora_to_model(model, provider, **model.get_model_input())
  return model


def compiled_tunix_step(model, tx, accumulate=None):
  """`PeftTrainer(model, tx)._train_step` on 1 x 32 tokens, compiled for a GPU."""
  from tunix.sft import peft_trainer, utils

  config = peft_trainer.TrainingConfig(
    eval_every_n_steps=1000, max_steps=1, gradient_accumulation_steps=accumulate
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Tunix's own
    trainer = peft_trainer.PeftTrainer(model, tx, config)
  trainer.with_gen_model_input_fn(
    lambda x: {
      "input_tokens": x.input_tokens,
      "input_mask": x.input_mask,
      "positions": utils.build_positions_from_mask(x.input_mask),
      "attention_mask": utils.make_causal_attn_mask(x.input_mask),
    }
  )
  graphdef, state = nnx.split((trainer.model, trainer.optimizer))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, _, grad_norm = trainer._train_step(model, optimizer, batch)
    return nnx.state((model, optimizer)), loss, grad_norm

  batch = peft_trainer.TrainingInput(
    input_tokens=jax.ShapeDtypeStruct((1, 32), jnp.int32),
    input_mask=jax.ShapeDtypeStruct((1, 32), jnp.bool_),
  )
  return offlax.compile_for_gpu(
    jax.jit(step, donate_argnums=0), gpu_compile.state_specs(state), batch
  )


@pytest.mark.parametrize("case", list(CASES))
def test_tunix_peft_trainers_step_compiles_for_gpu(case, tmp_path):
  pytest.importorskip("tunix")
  o = dict(where="host", master=True, compute="host", bits=32, lora=False, nvme=False)
  o |= dict(accumulate=None, commit=False, own_multi_steps=0) | CASES[case]
  model = tiny_qwen3(o["master"], o["lora"])
  inner = offlax.adamw(1e-5, state_bits=o["bits"])
  inner = offlax.master_weights(inner) if o["master"] else inner
  store = None
  if o["where"] == "store":
    kw = dict(update="backward", optimizer=inner) if o["commit"] else {}
    layers = offlax.stack_layers(model.layers)
    store = offlax.LayerStore.create(str(tmp_path / "layers"), layers, progress=False, **kw)
    offlax.offload_params(model, store=store, commit_in_update=o["commit"])
  elif o["where"] == "host":
    offlax.offload_params(model)
  tier = offlax.NVMeTier(tmp_path / "rest", progress=False) if o["nvme"] else None
  tx = offlax.offload(inner, tier) if tier else offlax.offload(inner, compute=o["compute"])
  if o["own_multi_steps"]:  # bf16 layers' accumulation: the store accumulates in their dtype
    tx = optax.MultiSteps(tx, o["own_multi_steps"], accumulator_dtype=jnp.bfloat16)
  try:
    compiled = compiled_tunix_step(model, tx, o["accumulate"])
  finally:
    if store is not None:
      store.close()
  assert compiled.host_compute == (), compiled.table()
