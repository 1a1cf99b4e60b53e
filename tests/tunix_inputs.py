"""What the Tunix runners (`tunix_run.py`, `tunix_params_run.py`) feed `PeftTrainer`.

Imported after they set up JAX (their own XLA flags first), so it imports Tunix
itself; one place for the batches and the model inputs both runs compare.
"""

import numpy as np
import qwix
from tunix.sft import peft_trainer
from tunix.sft import utils as sft_utils


def batches(n, vocab_size):
  """`n` batches of 4 x 16 random tokens (the same for every run: a fixed seed)."""
  rng = np.random.default_rng(0)
  for _ in range(n):
    tokens = rng.integers(1, vocab_size, (4, 16)).astype(np.int32)
    yield peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones((4, 16), bool))


def model_input(x):
  """A batch as the models' ``__call__`` takes it."""
  return {
    "input_tokens": x.input_tokens,
    "input_mask": x.input_mask,
    "positions": sft_utils.build_positions_from_mask(x.input_mask),
    "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask),
  }


def with_lora(model):
  """`model` with qwix LoRA adapters (rank 4) on its query and down projections."""
  provider = qwix.LoraProvider(module_path=".*q_proj|.*down_proj", rank=4, alpha=2.0)
  return qwix.apply_lora_to_model(model, provider, **model.get_model_input())
