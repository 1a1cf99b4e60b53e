"""Full fine-tuning of a Tunix Qwen3 with its params in host memory, in an unmodified PeftTrainer.

  python examples/tunix_full_finetune.py                                # a tiny Qwen3, on the CPU
  python examples/tunix_full_finetune.py --compile rtx4090 --layers 2   # Qwen3-14B's step, compiled

The first trains a tiny Qwen3 (random weights) for a few steps on one batch of
counting sequences, a pattern it learns, so the loss falls from about ln(128)
= 4.85: the bf16 params, their gradients and the optimizer state (fp32 master,
moments) all in host memory, each decoder layer's params fetched to the device
where it runs. The second compiles the same train step for Qwen3-14B (1 x 2048
tokens) with XLA's GPU compiler for the named target, from shapes alone
(nothing is allocated), and prints its memory (needs ``offlax[gpu-compile]``).
Both need Tunix; docs/tunix_full_finetune.md installs it and explains the output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@contextlib.contextmanager
def notices_once():
  """Passes on what the block writes to the process's stderr, each notice once.

  With the GPU compiler installed and no GPU, each of the CUDA plugin's libraries
  prints "Could not find cuda drivers on your machine" from C++ as it loads (four
  times at jax's import and its backends' start). The timestamps differ; the rest
  is the same notice.
  """
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      seen = set()
      for line in captured.read().decode(errors="replace").splitlines(keepends=True):
        notice = re.sub(r"^[IWEF]\d{4} [\d:.]+\s+\d+ ", "", line)  # absl's prefix: time, thread
        if notice not in seen:
          seen.add(notice)
          sys.stderr.write(line)
      sys.stderr.flush()


with notices_once():
  import jax

  jax.devices()  # the backends start here, and the CUDA plugin loads again

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import offlax  # noqa: E402

TINY = dict(
  num_layers=2, vocab_size=128, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
  num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6,
)  # fmt: skip
GB = 1e9


def optimizer_tx(learning_rate: float) -> optax.GradientTransformation:
  # bf16 params, an fp32 master copy in the state; the update on the host CPU.
  return offlax.offload(offlax.master_weights(optax.adamw(learning_rate)), compute="host")


def loss_fn(model, input_tokens, input_mask, positions, attention_mask):
  """Next-token cross-entropy over the unmasked targets, from integer labels.

  Tunix's default loss builds one-hot labels of the whole vocabulary (151,936
  wide for Qwen3-14B: 2.1 GB more device memory at 2048 tokens); integer labels
  give the same loss without them, as `benchmarks/tunix_offload.py` computes it.
  """
  logits, _ = model(input_tokens, positions, None, attention_mask)
  logits = logits[:, :-1].astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, input_tokens[:, 1:])
  mask = input_mask[:, 1:].astype(jnp.float32)
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def bf16(model: nnx.Module) -> nnx.Module:
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  return model


def counting_batch(vocab_size: int, batch: int = 4, length: int = 32):
  """Rows that count up by one from a random start (1..vocab-1, wrapping): a pattern to learn."""
  starts = np.random.default_rng(0).integers(1, vocab_size, (batch, 1))
  return ((starts - 1 + np.arange(length)) % (vocab_size - 1) + 1).astype(np.int32)


def train(steps: int, learning_rate: float = 3e-3) -> list[float]:
  """`steps` steps of PeftTrainer on the same batch; returns the loss of each."""
  from tunix.models.qwen3 import model as qwen3
  from tunix.sft import peft_trainer
  from tunix.sft import utils as sft_utils

  config = qwen3.ModelConfig(**TINY, remat_config=qwen3.RematConfig.DECODER)
  model = offlax.offload_params(bf16(qwen3.Qwen3(config, rngs=nnx.Rngs(0))))
  trainer = peft_trainer.PeftTrainer(
    model,
    optimizer_tx(learning_rate),
    peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps),
  )

  def model_input(x):
    return {
      "input_tokens": x.input_tokens,
      "input_mask": x.input_mask,
      "positions": sft_utils.build_positions_from_mask(x.input_mask),
      "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask),
    }

  tokens = counting_batch(TINY["vocab_size"])
  batch = peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones(tokens.shape, bool))
  trainer.with_gen_model_input_fn(model_input).with_loss_fn(loss_fn)
  trainer.train([batch] * steps)
  losses = [float(x) for x in trainer.metrics_logger.get_metric_history("", "loss", "train")]
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
  print(f"losses {[round(x, 4) for x in losses]}; params in {sorted(kinds)}")
  return losses


def compile_step(config, target: str, tokens: int = 2048) -> offlax.extend.CompiledMemory:
  """The train step of `config`'s Qwen3, bf16, compiled for `target` from shapes."""
  from tunix.models.qwen3 import model as qwen3

  config = dataclasses.replace(config, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  model = offlax.offload_params(nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0))))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.as_pure(params)  # arrays, as the optimizer sees them
  tx = optimizer_tx(1e-5)
  opt_state = offlax.abstract_state(tx, params)

  def step(params, opt_state, rest, batch):
    def loss(params):
      model = nnx.merge(graphdef, params, rest)
      return loss_fn(model, batch, jnp.ones(batch.shape, bool), positions, mask)

    grads = jax.grad(loss)(params)
    return offlax.update_and_apply(tx, grads, opt_state, params)

  positions = jnp.arange(tokens)[None]
  mask = jnp.tril(jnp.ones((1, tokens, tokens), bool))
  batch = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  return offlax.compile_for_gpu(
    step, params, opt_state, rest, batch, target=target, n_params=n_params,
    donate_argnums=(0, 1),
  )  # fmt: skip


def report(memory: offlax.extend.CompiledMemory, layers: int, of_layers: int) -> str:
  """The compiled step's memory, one figure a line, each saying what it counts (10^9-byte GB)."""
  n, d, h = memory.n_params, memory.device, memory.host
  key, _, card = memory.target.name.partition(" (")
  io_bytes = d["argument"] + d["output"] - d["alias"]
  lines = [
    f"model: Qwen3-14B, {layers} of its {of_layers} layers, {n / 1e9:.2f}B params in bf16; "
    "AdamW with an fp32 master, on the host CPU; 1 x 2048 tokens",
    f"target: {key} ({card}",
    f"its memory, as CUDA reports it: {memory.target.device_memory_size / GB:.1f} GB "
    "(GB here are 10^9 bytes; a card's name counts GiB, 2^30)",
    f"device peak: {memory.device_peak / GB:.2f} GB, "
    + ("fits" if memory.fits else "DOES NOT FIT"),
    f"  the step's inputs and outputs on the device (the token ids): {io_bytes / 1e3:.1f} kB",
    "  working memory (activations, logits, one layer's params and gradients at a time): "
    f"{d['temp'] / GB:.2f} GB",
    f"host peak (pinned host memory): {memory.host_peak / GB:.1f} GB, "
    f"{memory.host_peak / n:.1f} B/param",
    "  params and optimizer state (bf16 params 2 B/param; fp32 master and two moments 12): "
    f"{h['argument'] / GB:.1f} GB",
    f"  gradients, bf16 (2 B/param): {(h['output'] - h['alias'] + h['temp']) / GB:.1f} GB",
    f"host<->device copies in flight at most: {memory.copies_in_flight} "
    "(layers' params fetched ahead of their use)",
    "compute XLA moved to the host CPU because it ran on host memory: "
    + (", ".join(memory.host_compute[:5]) if memory.host_compute else "none"),
  ]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--compile", metavar="TARGET", help="compile Qwen3-14B's step for TARGET")
  parser.add_argument("--layers", type=int, help="with --compile: this many of its 40 layers")
  args = parser.parse_args(argv)
  try:
    import tunix  # noqa: F401
  except ImportError as e:
    raise SystemExit(f"{e}: install Tunix as docs/tunix_full_finetune.md#install shows") from e
  if args.compile and not offlax.extend.gpu_compile_available():
    raise SystemExit(
      "--compile needs XLA's GPU compiler: install it as docs/tunix_full_finetune.md#install shows"
    )
  if args.compile:
    from tunix.models.qwen3 import model as qwen3

    config = qwen3.ModelConfig.qwen3_14b()
    layers = args.layers or config.num_layers
    memory = compile_step(dataclasses.replace(config, num_layers=layers), args.compile)
    print(report(memory, layers, config.num_layers))
    return {"device_peak": memory.device_peak, "fits": memory.fits}
  return {"losses": train(args.steps)}


if __name__ == "__main__":
  main()
