"""LoRA fine-tuning with Tunix's `PeftTrainer`, the AdamW state in host memory, and a resume.

Run from the repository root (needs ``pip install -c constraints google-tunix``
with jax pinned, see docs/flax.md, "Tunix"):

    python examples/tunix_lora.py --steps 20 --dir /tmp/offlax-tunix

The only change to a Tunix fine-tune is the optimizer:
``offlax.offload(optax.adamw(...))`` instead of ``optax.adamw(...)``. The model
is a tiny Llama3 with random weights (it learns a fixed set of random token
sequences); qwix adds LoRA adapters to its attention and MLP projections.
The script trains half the steps, saving checkpoints, then builds a fresh
model and trainer on the same directory: Tunix restores the adapters and the
optimizer state (into host memory) and the run continues where it stopped.
``--compute host`` runs AdamW on the host CPU instead of streaming the state.
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import qwix
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.sft import peft_trainer
from tunix.sft import utils as sft_utils

import offlax

CONFIG = llama3.ModelConfig(
  num_layers=2,
  vocab_size=128,
  embed_dim=64,
  hidden_dim=128,
  num_heads=4,
  head_dim=16,
  num_kv_heads=2,
  rope_theta=10_000,
  norm_eps=1e-5,
)


def lora_model(seed: int) -> nnx.Module:
  model = llama3.Llama3(CONFIG, rngs=nnx.Rngs(seed))
  provider = qwix.LoraProvider(module_path=".*_proj", rank=8, alpha=16.0)
  return qwix.apply_lora_to_model(
    model, provider, rngs=nnx.Rngs(seed + 1), **model.get_model_input()
  )


def batches(n: int, batch: int = 8, length: int = 32):
  """`n` batches drawn from 16 fixed random sequences (learnable by heart)."""
  rng = np.random.default_rng(0)
  corpus = rng.integers(1, CONFIG.vocab_size, (16, length)).astype(np.int32)
  for _ in range(n):
    tokens = corpus[rng.integers(0, len(corpus), batch)]
    yield peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones_like(tokens, bool))


def model_input(x: peft_trainer.TrainingInput) -> dict:
  return {
    "input_tokens": x.input_tokens,
    "input_mask": x.input_mask,
    "positions": sft_utils.build_positions_from_mask(x.input_mask),
    "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask),
  }


def trainer(directory: str, steps: int, compute: str) -> peft_trainer.PeftTrainer:
  config = peft_trainer.TrainingConfig(
    eval_every_n_steps=10_000,
    max_steps=steps,
    checkpoint_root_directory=directory,
    checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=5, max_to_keep=2),
  )
  tx = offlax.offload(optax.adamw(3e-3), compute=compute)  # the one change
  return peft_trainer.PeftTrainer(lora_model(0), tx, config).with_gen_model_input_fn(model_input)


def memory_kinds(t: peft_trainer.PeftTrainer) -> list[str]:
  state = nnx.state(t.optimizer, nnx.optimizer.OptState)
  return sorted({x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim})


def losses(t: peft_trainer.PeftTrainer) -> list[float]:
  return [float(x) for x in t.metrics_logger.get_metric_history("", "loss", "train")]


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
  parser.add_argument("--compute", choices=("device", "host"), default="device")
  args = parser.parse_args(argv)
  directory = args.dir or tempfile.mkdtemp(prefix="offlax-tunix-")
  half = args.steps // 2

  first = trainer(directory, half, args.compute)
  first.train(batches(half))
  print(f"steps 1-{half}: loss {losses(first)[0]:.4f} -> {losses(first)[-1]:.4f}")

  # A new process would do the same: a fresh model and trainer on the directory.
  second = trainer(directory, args.steps, args.compute)
  restored, restored_step = memory_kinds(second), second.train_steps
  print(f"restored step {restored_step} into {restored} memory")
  second.train(batches(args.steps))
  print(f"steps {half + 1}-{args.steps}: loss -> {losses(second)[-1]:.4f}")
  print(f"optimizer state in {memory_kinds(second)} memory")
  return {
    "first": losses(first),
    "second": losses(second),
    "restored_step": restored_step,
    "restored_kinds": restored,
    "kinds": memory_kinds(second),
  }


if __name__ == "__main__":
  main()
