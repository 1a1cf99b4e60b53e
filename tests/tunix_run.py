"""Run by `test_tunix.py` in a subprocess: offlax in an unmodified Tunix `PeftTrainer`.

``python tunix_run.py DEVICES`` trains a tiny Llama3 (random weights) with
``offlax.offload(optax.adamw(...))`` and with plain ``optax.adamw``, full
fine-tuning and LoRA (qwix), streamed and host compute; with DEVICES=2 on an
("fsdp", "tp") mesh entered as Tunix's CLI does (``with mesh:``). A case
``*-resume`` saves a checkpoint after two steps and resumes it in a fresh
trainer for two more. Prints one JSON line ``RESULT {...}``: per case the
losses, whether the params equal plain optax's bit for bit, and the memory
kinds of the optimizer's array leaves after the constructor (which restores)
and after training.
"""

import json
import os
import sys
import tempfile
import warnings

DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 1
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
warnings.simplefilter("ignore", DeprecationWarning)

import contextlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import tunix_inputs  # noqa: E402  (beside this file)
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.rl import reshard  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402

import offlax  # noqa: E402

CONFIG = llama3.ModelConfig(
  num_layers=2,
  vocab_size=64,
  embed_dim=32,
  hidden_dim=64,
  num_heads=4,
  head_dim=8,
  num_kv_heads=2,
  rope_theta=10_000,
  norm_eps=1e-5,
)
STEPS = 4


def make_model(lora, mesh):
  model = llama3.Llama3(CONFIG, rngs=nnx.Rngs(0))
  if lora:
    model = tunix_inputs.with_lora(model)
  if mesh is not None:
    model = reshard.reshard_model_to_mesh(model, mesh)
  return model


def kinds(trainer):
  state = nnx.state(trainer.optimizer, nnx.optimizer.OptState)
  return sorted({x.sharding.memory_kind for x in jax.tree.leaves(state) if x.ndim})


def moment_specs(trainer):
  """Each first moment's PartitionSpec, by its path from `mu` on (offlax's and optax's alike)."""
  state = nnx.state(trainer.optimizer, nnx.optimizer.OptState)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  out = {}
  for path, x in flat:
    key = jax.tree_util.keystr(path)
    if "['mu']" in key:
      out[key[key.index("['mu']") :]] = _canonical(x.sharding)
  return out


def _canonical(sharding):
  """A sharding's spec without axes of size 1 and trailing Nones: equal when the layout is."""
  if not isinstance(sharding, jax.sharding.NamedSharding):  # one device: nothing sharded
    return "[]"
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape, strict=True))
  entries = []
  for entry in sharding.spec:
    names = entry if isinstance(entry, tuple) else (entry,)
    names = tuple(n for n in names if n is not None and sizes[n] > 1)
    entries.append(names or None)
  while entries and entries[-1] is None:
    entries.pop()
  return str(entries)


def train(tx, lora, mesh, steps, checkpoints=None, interval=1):
  """Trains to `steps` (resuming from `checkpoints` if it has one, saving every `interval`)."""
  model = make_model(lora, mesh)
  options = ocp.CheckpointManagerOptions(save_interval_steps=interval, max_to_keep=2)
  config = peft_trainer.TrainingConfig(
    eval_every_n_steps=1000,
    max_steps=steps,
    checkpoint_root_directory=checkpoints,
    checkpointing_options=options,
  )
  trainer = peft_trainer.PeftTrainer(model, tx, config)
  trainer.with_gen_model_input_fn(tunix_inputs.model_input)
  after_init = kinds(trainer)
  try:
    trainer.train(tunix_inputs.batches(steps, CONFIG.vocab_size))
  except Exception:
    # A refused save: let the writes orbax started for the other items end first.
    with contextlib.suppress(Exception):
      trainer.checkpoint_manager.close()
    raise
  history = trainer.metrics_logger.get_metric_history("", "loss", "train")
  params = nnx.state(model, nnx.LoRAParam if lora else nnx.Param)
  return {
    "losses": [float(x) for x in history],
    "params_np": jax.tree.map(np.asarray, params),
    "kinds_after_init": after_init,
    "kinds_after": kinds(trainer),
    "specs": moment_specs(trainer),
    "param_specs": {
      jax.tree_util.keystr(k): _canonical(x.sharding)
      for k, x in jax.tree_util.tree_flatten_with_path(params)[0]
    },
  }


def _sharding(run):
  """How many moments are sharded, and how many are replicated where their param is sharded."""
  specs, params = run["specs"], run["param_specs"]
  return {
    "sharded": sum(spec != "[]" for spec in specs.values()),
    "replicated_of_sharded": sorted(
      k for k, spec in specs.items() if spec == "[]" and params[k[len("['mu']") :]] != "[]"
    ),
  }


def same(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(x.tobytes() == y.tobytes() for x, y in zip(la, lb, strict=True))


def main():
  mesh = None
  if DEVICES > 1:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, DEVICES), ("fsdp", "tp"))
  out = {}
  with mesh if mesh is not None else contextlib.nullcontext():
    for lora in (False, True):
      kind = "lora" if lora else "full"
      want = train(optax.adamw(1e-2), lora, mesh, STEPS)
      for compute in ("device", "host"):
        print("CASE", f"{kind}-{compute}", flush=True)
        got = train(offlax.offload(optax.adamw(1e-2), compute=compute), lora, mesh, STEPS)
        out[f"{kind}-{compute}"] = {
          "losses": got["losses"],
          "want_losses": want["losses"],
          "params_exact": same(got["params_np"], want["params_np"]),
          "kinds_after": got["kinds_after"],
          **_sharding(got),
        }
      print("CASE", f"{kind}-resume", flush=True)
      with tempfile.TemporaryDirectory() as d:
        tx = offlax.offload(optax.adamw(1e-2))
        first = train(tx, lora, mesh, STEPS // 2, checkpoints=d)
        resumed = train(tx, lora, mesh, STEPS, checkpoints=d)
      out[f"{kind}-resume"] = {
        "losses": first["losses"] + resumed["losses"],
        "want_losses": want["losses"],
        "params_exact": same(resumed["params_np"], want["params_np"]),
        "kinds_after_init": resumed["kinds_after_init"],
        "kinds_after": resumed["kinds_after"],
        **_sharding(resumed),
      }
  if DEVICES == 1:
    out.update(nvme_cases())
  print("RESULT", json.dumps(out), flush=True)


def nvme_cases():
  """The NVMe tier in the trainer: training is exact, and Tunix's checkpointing is refused.

  Tunix checkpoints `nnx.state(optimizer, nnx.optimizer.OptState)`, which holds an
  `OnDiskVariable` for each array in the store: orbax refuses the save
  (`UnsavableStateError`, naming `offlax.checkpoint.NVMeStoreSave`), and no step of a checkpoint
  without the moments is left to restore.
  """
  want = train(optax.adamw(1e-2), False, None, STEPS)
  out = {}
  with tempfile.TemporaryDirectory() as d:
    print("CASE", "full-nvme", flush=True)
    # No cache: every moment on disk, as in a model over the default cache_bytes.
    with opened(f"{d}/store", cache_bytes=0) as tier:
      got = train(offlax.offload(optax.adamw(1e-2), tier), False, None, STEPS)
    out["full-nvme"] = _nvme_result(got["losses"], want, got)
  # Orbax goes on writing the model's item of a Composite whose other item it refused,
  # into a temporary folder it removes meanwhile: what is left there is not a checkpoint.
  with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
    print("CASE", "full-nvme-checkpoint", flush=True)
    error = ""
    with opened(f"{d}/store", cache_bytes=0) as tier:
      try:
        train(offlax.offload(optax.adamw(1e-2), tier), False, None, STEPS, f"{d}/c", 2)
      except Exception as e:  # noqa: BLE001 (whatever Tunix lets through, as it does)
        error = f"{type(e).__name__}: {e}"
    saved = sorted(os.listdir(f"{d}/c")) if os.path.isdir(f"{d}/c") else []
    out["full-nvme-checkpoint"] = {"error": error, "saved": saved}
  return out


@contextlib.contextmanager
def opened(path, **options):
  tier = offlax.NVMeTier(path, progress=False, **options)
  try:
    yield tier
  finally:
    tier.close()


def _nvme_result(losses, want, got):
  return {
    "losses": losses,
    "want_losses": want["losses"],
    "params_exact": same(got["params_np"], want["params_np"]),
    "kinds_after": got["kinds_after"],
  }


if __name__ == "__main__":
  main()
