"""Full fine-tuning of a Tunix Qwen3 with its params in host memory, in an unmodified PeftTrainer.

  python examples/tunix_full_finetune.py                      # a tiny Qwen3, on the CPU
  python examples/tunix_full_finetune.py --compile rtx4090    # Qwen3-14B's step, compiled

The first trains a tiny Qwen3 (random weights) for a few steps: the bf16
params, their gradients and the optimizer state (fp32 master, moments) all in
host memory, each decoder layer's params fetched to the device where it runs.
The second compiles the whole train step of Qwen3-14B (1 x 2048 tokens) with
XLA's GPU compiler for the named target, from shapes alone (nothing is
allocated), and prints its device memory (needs ``offlax[gpu-compile]``).
See docs/tunix_full_finetune.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import offlax  # noqa: E402

TINY = dict(
  num_layers=2, vocab_size=128, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
  num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6,
)  # fmt: skip


def optimizer_tx(learning_rate: float) -> optax.GradientTransformation:
  # bf16 params, an fp32 master copy in the state; the update on the host CPU.
  return offlax.offload(offlax.master_weights(optax.adamw(learning_rate)), compute="host")


def bf16(model: nnx.Module) -> nnx.Module:
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  return model


def train(steps: int) -> list[float]:
  from tunix.models.qwen3 import model as qwen3
  from tunix.sft import peft_trainer
  from tunix.sft import utils as sft_utils

  config = qwen3.ModelConfig(**TINY, remat_config=qwen3.RematConfig.DECODER)
  model = offlax.offload_params(bf16(qwen3.Qwen3(config, rngs=nnx.Rngs(0))))
  trainer = peft_trainer.PeftTrainer(
    model, optimizer_tx(1e-3), peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps)
  )

  def model_input(x):
    return {
      "input_tokens": x.input_tokens,
      "input_mask": x.input_mask,
      "positions": sft_utils.build_positions_from_mask(x.input_mask),
      "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask),
    }

  rng = np.random.default_rng(0)
  batches = [
    peft_trainer.TrainingInput(
      input_tokens=rng.integers(1, TINY["vocab_size"], (2, 32)).astype(np.int32),
      input_mask=np.ones((2, 32), bool),
    )
    for _ in range(steps)
  ]
  trainer.with_gen_model_input_fn(model_input).train(batches)
  losses = [float(x) for x in trainer.metrics_logger.get_metric_history("", "loss", "train")]
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
  print(f"losses {[round(x, 4) for x in losses]}; params in {sorted(kinds)}")
  return losses


def compile_step(config, target: str, tokens: int = 2048) -> offlax.CompiledMemory:
  """The whole train step of `config`'s Qwen3, bf16, compiled for `target` from shapes."""
  from tunix.models.qwen3 import model as qwen3

  config = dataclasses.replace(config, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  model = offlax.offload_params(nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0))))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.as_pure(params)  # arrays, as the optimizer sees them
  tx = optimizer_tx(1e-5)
  opt_state = offlax.abstract_state(tx, params)

  def step(params, opt_state, rest, batch):
    def loss_fn(params):
      logits, _ = nnx.merge(graphdef, params, rest)(batch, positions, None, mask)
      labels = jax.nn.one_hot(batch[:, 1:], logits.shape[-1], dtype=logits.dtype)
      return optax.softmax_cross_entropy(logits[:, :-1], labels).mean()

    grads = jax.grad(loss_fn)(params)
    return offlax.update_and_apply(tx, grads, opt_state, params)

  positions = jnp.arange(tokens)[None]
  mask = jnp.tril(jnp.ones((1, tokens, tokens), bool))
  batch = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  return offlax.compile_for_gpu(
    step, params, opt_state, rest, batch, target=target, n_params=n_params,
    donate_argnums=(0, 1),
  )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--compile", metavar="TARGET", help="compile Qwen3-14B's step for TARGET")
  parser.add_argument("--layers", type=int, help="with --compile: this many of its 40 layers")
  args = parser.parse_args(argv)
  if args.compile:
    from tunix.models.qwen3 import model as qwen3

    config = qwen3.ModelConfig.qwen3_14b()
    if args.layers:
      config = dataclasses.replace(config, num_layers=args.layers)
    memory = compile_step(config, args.compile)
    print(memory.table())
    return {"device_peak": memory.device_peak, "fits": memory.fits}
  return {"losses": train(args.steps)}


if __name__ == "__main__":
  main()
