"""A small decoder-only transformer LM in Flax NNX, its AdamW state offloaded.

Run from the repository root (a few minutes on 2 CPU cores):

    python examples/lm_nnx.py --tier host --steps 300
    python examples/lm_nnx.py --tier host_compute --steps 300
    python examples/lm_nnx.py --tier nvme --steps 300 --dir /tmp/offlax-lm
    python examples/lm_nnx.py --tier host_compute --params-on-host --steps 300

It learns characters of a text made here (no download): sentences of a tiny
grammar with counting and agreement. The optimizer is
`nnx.Optimizer(model, offlax.offload(offlax.adamw(...), tier), wrt=nnx.Param)`:

- `--tier host`: the moments in `pinned_host`, streamed through the jitted step;
- `--tier host_compute`: the moments in `pinned_host`, updated on the host CPU;
- `--tier nvme`: the moments on disk under `--dir` (a small RAM cache);
- `--tier none`: plain optax, for comparison.

The layers are stacked (`nnx.vmap`) and run by `offlax.scan_layers`, which
rematerialises each in the backward pass. With `--params-on-host` the layers'
params live in `pinned_host` memory too: each step fetches one layer at a time,
their gradients come back to host memory, and `offlax.nnx_update` writes the
new params over the old on the host (the way a model too big for the device
trains: see docs/params_off_device.md).

Every `--ckpt-every` steps orbax saves the model and optimizer under
`--dir/ckpt` (asynchronously; the NVMe tier's store with `offlax.checkpoint.NVMeStoreSave`;
with `--host-state-save` the host tiers' optimizer state with
`offlax.checkpoint.HostStateSave`, raw files by direct I/O, before `save` returns);
`--resume` continues from the latest one, after a kill at any moment: the
store, which commits every step and may be ahead of the checkpoint, is
replaced by the checkpoint's copy, and `NVMeTier(step=...)` checks that it is
at the params' step. The loss curve goes to `--dir/loss.png`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

import offlax


def corpus(n_sentences: int = 4000, seed: int = 0) -> str:
  """Sentences of a small grammar: numbers, agreement, a little arithmetic."""
  rng = np.random.default_rng(seed)
  animals = ["cat", "dog", "fox", "owl", "bee"]
  verbs = [("sees", "see"), ("likes", "like"), ("finds", "find")]
  words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
  out = []
  for _ in range(n_sentences):
    a, b = rng.choice(animals, 2)
    k = int(rng.integers(1, 5))
    v = verbs[int(rng.integers(len(verbs)))]
    subject = f"the {a}" if k == 1 else f"{words[k]} {a}s"
    x, y = rng.integers(0, 5, 2)
    out.append(f"{subject} {v[0] if k == 1 else v[1]} the {b}. {words[x]} and {words[y]} "
               f"make {words[x + y]}.")  # fmt: skip
  return " ".join(out)


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
  def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):  # one Block whose params are stacked along a first axis
      return Block(dim, heads, rngs)

    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, dim)) * 0.02)
    self.blocks = make_blocks(rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    mask = nnx.make_causal_mask(tokens)
    graphdef, layers = nnx.split(self.blocks)
    layer = lambda x, params: (nnx.merge(graphdef, params)(x, mask), None)
    x, _ = offlax.scan_layers(layer, x, layers)  # fetches each layer kept in host memory
    return self.head(self.norm(x))


def make_tier(name: str, directory: pathlib.Path, step: int | None):
  """The tier; for the NVMe tier `step` is the checkpoint's step to resume at (None: new)."""
  if name == "host":
    return offlax.HostTier(chunk_bytes=256 * 1024)
  if name == "host_compute":
    return offlax.HostTier(compute="host")
  if name == "nvme":
    return offlax.NVMeTier(
      str(directory / "store"),
      cache_bytes=64 * 1024,
      chunk_bytes=256 * 1024,
      resume=step is not None,
      step=step,
    )
  return None


def restore_store(mngr: ocp.CheckpointManager, step: int, directory: pathlib.Path) -> None:
  """Replaces the NVMe store by the copy checkpointed at `step`.

  The store commits every step, so after a kill it may be ahead of the last
  checkpoint; the checkpoint's copy is at the checkpoint's step. Restored
  beside it first: a kill during this leaves the checkpoint to restore again.
  """
  store, restoring = directory / "store", directory / "store.restoring"
  shutil.rmtree(restoring, ignore_errors=True)
  mngr.restore(
    step, args=ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreRestore(str(restoring), False))
  )
  shutil.rmtree(store, ignore_errors=True)
  os.rename(restoring, store)


def main(argv: list[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tier", choices=("host", "host_compute", "nvme", "none"), default="host")
  parser.add_argument(
    "--params-on-host", action="store_true", help="the layers' params in pinned_host memory"
  )
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--dir", type=pathlib.Path, default=None, help="checkpoints, store, plot")
  parser.add_argument("--ckpt-every", type=int, default=50)
  parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
  parser.add_argument(
    "--host-state-save",
    action="store_true",
    help="save the host tiers' optimizer state with offlax.checkpoint.HostStateSave (direct I/O)",
  )
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  directory = args.dir or pathlib.Path(tempfile.mkdtemp(prefix="offlax-lm-"))
  directory.mkdir(parents=True, exist_ok=True)

  text = corpus()
  chars = sorted(set(text))
  data = np.array([chars.index(c) for c in text], np.int32)
  model = LM(len(chars), args.dim, 4, args.layers, args.seq, nnx.Rngs(0))
  if args.params_on_host:
    if args.tier == "none":
      parser.error("--params-on-host needs an offlax tier (--tier host_compute is the one to use)")
    nnx.update(model.blocks, offlax.to_host(nnx.state(model.blocks)))
  # The NVMe tier's moments are in its store (committed every step), which orbax
  # saves with offlax.checkpoint.NVMeStoreSave; the other tiers' state is a pytree of arrays.
  nvme = args.tier == "nvme"
  options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
  mngr = ocp.CheckpointManager((directory / "ckpt").absolute(), options=options)
  start = mngr.latest_step() if args.resume else None
  if nvme and start is not None:
    restore_store(mngr, start, directory)
  elif nvme and args.resume:  # killed before the first checkpoint: start again
    shutil.rmtree(directory / "store", ignore_errors=True)
  tier = make_tier(args.tier, directory, start)
  # In host compute the update is written out to cross back to the device, so the
  # native kernel writes it too, in the same pass as the moments.
  inner = offlax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, args.lr, 20, 1000),
    weight_decay=0.01,
    native_update=args.tier == "host_compute",
  )
  tx = inner if tier is None else offlax.offload(inner, tier)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    # optimizer.update(model, grads), with each slice's new params written in place
    # (params in host memory are updated by the host CPU, never by device compute).
    offlax.nnx_update(optimizer, model, grads)
    return loss

  def checkpoint_args(save: bool):
    if nvme:  # the model, and the store (the whole optimizer state) beside it
      model_state = {"model": nnx.state(model), "step": optimizer.step[...]}
      if save:
        return ocp.args.Composite(
          model=ocp.args.StandardSave(model_state), opt=offlax.checkpoint.NVMeStoreSave(tier)
        )
      target = jax.tree.map(ocp.utils.to_shape_dtype_struct, model_state)
      return ocp.args.Composite(model=ocp.args.StandardRestore(target))
    if args.host_state_save:  # the model by orbax, the optimizer as raw files by direct I/O
      model_state, opt_state = nnx.state(model), nnx.state(optimizer)
      if save:
        return ocp.args.Composite(
          model=ocp.args.StandardSave(model_state),
          opt=offlax.checkpoint.HostStateSave(opt_state, progress=False),
        )
      model_state, opt_state = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, (model_state, opt_state)
      )
      return ocp.args.Composite(
        model=ocp.args.StandardRestore(model_state),
        opt=offlax.checkpoint.HostStateRestore(opt_state, progress=False),
      )
    if save:
      return ocp.args.StandardSave(nnx.state((model, optimizer)))
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state((model, optimizer)))
    return ocp.args.StandardRestore(target)

  if start is not None:
    restored = mngr.restore(start, args=checkpoint_args(save=False))
    if nvme:  # the optimizer state came from the store, at step `start`
      nnx.update(model, restored.model["model"])
      optimizer.step[...] = restored.model["step"]
    elif args.host_state_save:
      nnx.update(model, restored.model)
      nnx.update(optimizer, restored.opt)
    else:
      nnx.update((model, optimizer), restored)
  start = start or 0
  print(f"{args.tier}: {sum(x.size for x in jax.tree.leaves(nnx.state(model))):,} params, "
        f"{len(chars)} characters, starting at step {start}")  # fmt: skip

  rng = np.random.default_rng(start)
  losses = []
  bar = tqdm(range(start, start + args.steps), disable=args.no_progress, desc="train")
  for step in bar:
    rows = rng.integers(0, len(data) - args.seq - 1, args.batch)
    tokens = jnp.asarray(np.stack([data[r : r + args.seq + 1] for r in rows]))
    loss = float(train_step(model, optimizer, tokens))
    losses.append(loss)
    bar.set_postfix(loss=f"{loss:.3f}")
    if (step + 1) % args.ckpt_every == 0 or step + 1 == start + args.steps:
      mngr.save(step + 1, args=checkpoint_args(save=True))
  mngr.wait_until_finished()
  mngr.close()
  if isinstance(tier, offlax.NVMeTier):
    tier.close()
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(optimizer)) if x.ndim}
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; optimizer arrays in RAM: {sorted(kinds)}")
  plot(losses, start, directory / "loss.png")
  return losses[-1]


def plot(losses: list[float], start: int, path: pathlib.Path) -> None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no loss plot (pip install matplotlib)")
    return
  fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
  ax.plot(range(start + 1, start + len(losses) + 1), losses)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/char)")
  ax.set_title("Character LM, AdamW state offloaded by offlax")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  print(f"loss curve: {os.fspath(path)}")


if __name__ == "__main__":
  main()
