"""Run by `test_tunix_params.py` in a subprocess: Tunix models with their params in host memory.

``python tunix_params_run.py CASE...`` trains tiny Tunix models (random
weights) in an unmodified `PeftTrainer`, ``offlax.offload_params(model)`` with
``offlax.offload(tx, compute="host")``, and the same model on the device with
plain optax. Both rematerialise each decoder layer (Tunix's
``RematConfig.DECODER``), so they round alike: see ``docs/params_off_device.md``.
Prints one JSON line ``RESULT {...}``: per case the losses of both runs, the
largest param difference, and the memory kinds of the params after the
constructor (which restores a checkpoint) and after training.
"""

import dataclasses
import json
import os
import sys
import tempfile
import warnings

os.environ["JAX_PLATFORMS"] = "cpu"
# A case named "*-mesh" runs on a ("fsdp", "tp") mesh of 2 CPU devices, entered as Tunix's CLI
# enters it; the flag must be set before JAX starts.
if any(a.endswith("-mesh") for a in sys.argv[1:]):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  ).strip()
warnings.simplefilter("ignore", DeprecationWarning)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import tunix_inputs  # noqa: E402  (beside this file)
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402

import offlax  # noqa: E402

SMALL = dict(vocab_size=64, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2)
LLAMA = llama3.ModelConfig(num_layers=2, rope_theta=10_000, norm_eps=1e-5, **SMALL)
QWEN = qwen3.ModelConfig(num_layers=2, rope_theta=10_000, norm_eps=1e-6, **SMALL)
STEPS = 20
HOST_BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def make_model(family, lora=False, dtype=None, mesh=None):
  if family == "llama3":
    config = dataclasses.replace(LLAMA, remat_config=llama3.RematConfig.DECODER)
    model = llama3.Llama3(config, rngs=nnx.Rngs(0))
  else:
    config = dataclasses.replace(QWEN, remat_config=qwen3.RematConfig.DECODER)
    model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
  if dtype is not None:
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), params))
  if lora:
    model = tunix_inputs.with_lora(model)
  if mesh is not None:
    from tunix.rl import reshard

    model = reshard.reshard_model_to_mesh(model, mesh)
  return model


def kinds(model, wrt=nnx.Param):
  return sorted({x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(model, wrt))})


def train(model, tx, steps, checkpoints=None, accumulate=None):
  options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=2)
  config = peft_trainer.TrainingConfig(
    eval_every_n_steps=1000,
    max_steps=steps,
    checkpoint_root_directory=checkpoints,
    checkpointing_options=options,
    gradient_accumulation_steps=accumulate,
  )
  trainer = peft_trainer.PeftTrainer(model, tx, config)
  trainer.with_gen_model_input_fn(tunix_inputs.model_input)
  after_init = kinds(model)
  trainer.train(tunix_inputs.batches(steps * (accumulate or 1), SMALL["vocab_size"]))
  history = trainer.metrics_logger.get_metric_history("", "loss", "train")
  return [float(x) for x in history], after_init


def compare(want_model, model, want_losses, losses, wrt=nnx.Param, **extra):
  a = jax.tree.leaves(nnx.state(want_model, wrt))
  b = jax.tree.leaves(nnx.state(model, wrt))
  diff = max(
    float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
    for x, y in zip(a, b, strict=True)
  )
  exact = all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b, strict=True))
  return {
    "losses": losses,
    "want_losses": want_losses,
    "params_exact": exact,
    "max_diff": diff,
    "kinds_after": kinds(model),
    **extra,
  }


def full(family, dtype=None, master=False):
  tx = offlax.master_weights(optax.adamw(1e-2)) if master else optax.adamw(1e-2)
  want_model = make_model(family, dtype=dtype)
  want, _ = train(want_model, tx, STEPS)
  model = offlax.offload_params(make_model(family, dtype=dtype))
  got, _ = train(model, offlax.offload(tx, compute="host"), STEPS)
  return compare(want_model, model, want, got)


def resume(family):
  want_model = make_model(family)
  want, _ = train(want_model, optax.adamw(1e-2), STEPS)
  tx = offlax.offload(optax.adamw(1e-2), compute="host")
  with tempfile.TemporaryDirectory() as d:
    first, _ = train(offlax.offload_params(make_model(family)), tx, STEPS // 2, d)
    model = offlax.offload_params(make_model(family))
    second, after_init = train(model, tx, STEPS, d)
  return compare(want_model, model, want, first + second, kinds_after_init=after_init)


def lora(family):
  want_model = make_model(family, lora=True)
  want, _ = train(want_model, optax.adamw(1e-2), STEPS)
  model = offlax.offload_params(make_model(family, lora=True), wrt=HOST_BASE)
  got, _ = train(model, optax.adamw(1e-2), STEPS)
  out = compare(want_model, model, want, got, wrt=nnx.Param)
  out["kinds_after"] = kinds(model, HOST_BASE)
  out["adapter_kinds"] = kinds(model, nnx.LoRAParam)
  return out


def accumulate(family):
  want_model = make_model(family)
  want, _ = train(want_model, optax.adamw(1e-2), 4, accumulate=2)
  model = offlax.offload_params(make_model(family))
  got, _ = train(model, offlax.offload(optax.adamw(1e-2), compute="host"), 4, accumulate=2)
  return compare(want_model, model, want, got)


def _specs(model):
  """Each param's layout: its spec without axes of size 1 (XLA drops them) or trailing Nones."""
  out = {}
  for k, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
    sizes = dict(zip(x.sharding.mesh.axis_names, x.sharding.mesh.devices.shape, strict=True))
    entries = []
    for entry in x.sharding.spec:
      names = entry if isinstance(entry, tuple) else (entry,)
      entries.append(tuple(n for n in names if n is not None and sizes[n] > 1) or None)
    while entries and entries[-1] is None:
      entries.pop()
    out[jax.tree_util.keystr(k)] = str(entries)
  return out


def on_mesh(family):
  """Tunix's sharding annotations kept: each param sharded in host memory as annotated."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, 2), ("fsdp", "tp"))
  with mesh:
    want_model = make_model(family, mesh=mesh)
    annotated = _specs(want_model)
    want, _ = train(want_model, optax.adamw(1e-2), STEPS // 4)
    model = offlax.offload_params(make_model(family, mesh=mesh))
    got, _ = train(model, offlax.offload(optax.adamw(1e-2), compute="host"), STEPS // 4)
  specs = _specs(model)
  return compare(
    want_model, model, want, got,
    specs_as_annotated=specs == annotated,
    sharded=sum("tp" in spec for spec in specs.values()),
  )  # fmt: skip


CASES = {
  "llama3-full": lambda: full("llama3"),
  "qwen3-full": lambda: full("qwen3"),
  "llama3-master": lambda: full("llama3", dtype=np.dtype("bfloat16"), master=True),
  "llama3-resume": lambda: resume("llama3"),
  "llama3-lora": lambda: lora("llama3"),
  "llama3-accumulate": lambda: accumulate("llama3"),
  "llama3-mesh": lambda: on_mesh("llama3"),
}


def main(names):
  out = {}
  for name in names:
    print("CASE", name, flush=True)
    try:
      out[name] = CASES[name]()
    except Exception as e:  # noqa: BLE001 (reported per case)
      out[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
  print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:] or list(CASES))
