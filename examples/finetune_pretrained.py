"""Fine-tune a Hugging Face checkpoint (Tunix's Qwen3 or Llama3) off the device, and save one.

  python examples/finetune_pretrained.py                      # a tiny Qwen3 checkpoint, made here
  python examples/finetune_pretrained.py Qwen3-14B --out Qwen3-14B-tuned [--store /nvme/layers]

The model is made from its ``config.json`` under `nnx.eval_shape` (nothing
allocated), its params moved to host memory (`offlax.offload_params`), or its
decoder layers to a `LayerStore` on disk (``--store``), and then filled by
`offlax.load_safetensors`: each tensor straight from the file into pinned host
memory or the store, never the whole model on the device (nor, with a store,
in RAM). ``--steps`` steps on a batch of counting sequences follow: with the
params in host memory through Tunix's `PeftTrainer` (the optimizer's update on
the host CPU), with a store through a plain loop (each layer's gradient to the
store, ``store.update()`` applying AdamW a layer at a time). Then
`offlax.save_safetensors` writes the model back out, with the source's names,
layouts and dtypes and its config.json and tokenizer files. Without a
checkpoint, a tiny Qwen3 one is written first (random weights), so the whole
run takes seconds on a CPU. Needs Tunix (docs/pretrained.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import offlax  # noqa: E402

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            head_dim=16, num_key_value_heads=2, vocab_size=128)  # fmt: skip


def make_tiny_checkpoint(folder: str) -> str:
  """A tiny Qwen3 in Hugging Face's layout (random weights, bf16), with config.json."""
  from safetensors.numpy import save_file

  d, n, k, h = TINY["hidden_size"], TINY["num_attention_heads"], TINY["num_key_value_heads"], 16
  f, v = TINY["intermediate_size"], TINY["vocab_size"]
  shapes = {
    "model.embed_tokens.weight": (v, d),
    "model.norm.weight": (d,),
    "lm_head.weight": (v, d),
  }
  for i in range(TINY["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes |= {
      p + "self_attn.q_proj.weight": (n * h, d), p + "self_attn.k_proj.weight": (k * h, d),
      p + "self_attn.v_proj.weight": (k * h, d), p + "self_attn.o_proj.weight": (d, n * h),
      p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,),
      p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
      p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
      p + "post_attention_layernorm.weight": (d,),
    }  # fmt: skip
  rng = np.random.default_rng(0)
  import ml_dtypes

  tensors = {
    name: (np.ones(s) if len(s) == 1 else rng.standard_normal(s) * 0.1).astype(ml_dtypes.bfloat16)
    for name, s in shapes.items()
  }
  os.makedirs(folder, exist_ok=True)
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **TINY,
            "rope_theta": 1_000_000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}  # fmt: skip
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
  return folder


def tunix_model(checkpoint: str):
  """The Tunix model class and config of a checkpoint's config.json (Qwen3 or Llama3)."""
  with open(os.path.join(checkpoint, "config.json")) as f:
    hf = json.load(f)
  arch = (hf.get("architectures") or [""])[0]
  common = dict(
    num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
    hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
    head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
    num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
    rope_theta=int(hf.get("rope_theta", 10_000)), norm_eps=hf.get("rms_norm_eps", 1e-6),
  )  # fmt: skip
  if arch == "Qwen3ForCausalLM":
    from tunix.models.qwen3 import model as qwen3

    dtype = jnp.bfloat16 if hf.get("torch_dtype") == "bfloat16" else jnp.float32
    tied = bool(hf.get("tie_word_embeddings"))
    config = qwen3.ModelConfig(**common, use_tied_embedding=tied, param_dtype=dtype)
    return qwen3.Qwen3, config
  if arch == "LlamaForCausalLM":
    from tunix.models.llama3 import model as llama3

    config = llama3.ModelConfig(**common, weight_tying=bool(hf.get("tie_word_embeddings")))
    return llama3.Llama3, config
  raise SystemExit(f"{checkpoint}: architecture {arch!r}; this example knows Qwen3 and Llama3.")


def counting_batch(vocab_size: int, batch: int = 4, length: int = 16) -> np.ndarray:
  """Rows that count up by one from a random start: a pattern a model learns."""
  starts = np.random.default_rng(0).integers(1, vocab_size, (batch, 1))
  return ((starts - 1 + np.arange(length)) % (vocab_size - 1) + 1).astype(np.int32)


def loss_fn(model, input_tokens, input_mask, positions, attention_mask):
  logits, _ = model(input_tokens, positions, None, attention_mask)
  logits = logits[:, :-1].astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, input_tokens[:, 1:])
  mask = input_mask[:, 1:].astype(jnp.float32)
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def inputs(tokens: np.ndarray) -> dict:
  b, n = tokens.shape
  return dict(
    input_tokens=jnp.asarray(tokens), input_mask=jnp.ones((b, n), bool),
    positions=jnp.broadcast_to(jnp.arange(n), (b, n)),
    attention_mask=jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n)),
  )  # fmt: skip


def train_in_host_memory(model, tokens: np.ndarray, steps: int, lr: float) -> list[float]:
  """`steps` steps of Tunix's PeftTrainer, the params and optimizer state in host memory."""
  from tunix.sft import peft_trainer
  from tunix.sft import utils as sft_utils

  tx = offlax.offload(offlax.master_weights(optax.adamw(lr)), compute="host")
  config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps)
  trainer = peft_trainer.PeftTrainer(model, tx, config)

  def model_input(x):
    return {
      "input_tokens": x.input_tokens, "input_mask": x.input_mask,
      "positions": sft_utils.build_positions_from_mask(x.input_mask),
      "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask),
    }  # fmt: skip

  batch = peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones(tokens.shape, bool))
  trainer.with_gen_model_input_fn(model_input).with_loss_fn(loss_fn)
  trainer.train([batch] * steps)
  return [float(x) for x in trainer.metrics_logger.get_metric_history("", "loss", "train")]


def train_with_store(model, store, tokens: np.ndarray, steps: int, lr: float) -> list[float]:
  """`steps` steps: the layers' gradients to the store and its update, the rest's on the host."""
  optimizer = nnx.Optimizer(model, offlax.offload(optax.adamw(lr), compute="host"), wrt=nnx.Param)
  grad = nnx.jit(nnx.value_and_grad(lambda m, x: loss_fn(m, **x)))
  update = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))
  losses = []
  for _ in range(steps):
    loss, grads = grad(model, inputs(tokens))
    update(model, optimizer, grads)
    store.update()
    losses.append(float(loss))
  return losses


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("checkpoint", nargs="?", help="a Hugging Face folder (none: a tiny one)")
  parser.add_argument("--out", help="the fine-tuned checkpoint's folder (default: a temporary one)")
  parser.add_argument("--store", help="a folder for a LayerStore of the decoder layers")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args(argv)
  work = tempfile.mkdtemp(prefix="offlax-finetune-")
  checkpoint = args.checkpoint or make_tiny_checkpoint(os.path.join(work, "tiny-qwen3"))
  out = args.out or os.path.join(work, "tuned")
  cls, config = tunix_model(checkpoint)
  model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
  store = None
  if args.store:
    tx = offlax.master_weights(optax.adamw(args.lr))
    store = offlax.LayerStore.create(args.store, offlax.stack_layers(model.layers), optimizer=tx)
  offlax.offload_params(model, store=store)
  offlax.load_safetensors(model, checkpoint, store=store)
  tokens = counting_batch(config.vocab_size)
  if store is None:
    losses = train_in_host_memory(model, tokens, args.steps, args.lr)
  else:
    losses = train_with_store(model, store, tokens, args.steps, args.lr)
  offlax.save_safetensors(model, out, store=store)
  if store is not None:
    store.close()
  where = "a LayerStore" if store is not None else "pinned_host"
  print(f"loaded {checkpoint} (layers in {where}); losses {[round(x, 4) for x in losses]}")
  print(f"saved {out}: {', '.join(sorted(os.listdir(out)))}")
  return {"checkpoint": checkpoint, "out": out, "losses": losses}


if __name__ == "__main__":
  main(sys.argv[1:])
