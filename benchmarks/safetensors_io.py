"""Hugging Face checkpoints into and out of a `LayerStore`: RAM flat as the model grows, disk speed.

What is measured, on one filesystem (a fresh directory under `--dir`, removed at the end):

1. The raw disk: sequential direct-I/O read and write of `--raw-gib` GiB (`_disk.measure_raw`).
2. For each size (`--layers`, default 2 and 8 layers of a Qwen3 with d = 2048, f = 8192: 126 MB
   of bf16 a layer, 131 MB for each of the embedding and the head), in a fresh subprocess: a
   checkpoint in Hugging Face's layout (`model.safetensors` shards of at most 1 GiB) written
   first, its page cache dropped; a Tunix Qwen3 (bf16 params) made by `nnx.eval_shape`, its
   layers in a sparse `LayerStore` (no optimizer state), the rest in `pinned_host`; then
   `offlax.load_safetensors` (timed, with its peak RSS over the process's RSS before it:
   VmHWM), the store's page cache dropped, and `offlax.save_safetensors` from the store into a
   new folder (timed, its peak RSS).
3. Each pass's traffic (the checkpoint's bytes read, the store's written, or the reverse) over
   its wall time, against the raw disk's time for the same traffic (`_disk.raw_seconds`): the
   ratio (goal >= 0.8x).

  python benchmarks/safetensors_io.py [--layers 2 8] [--dir /tmp] [--raw-gib 1]

Results: printed, and `<out>/safetensors_io.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import _common, _disk  # noqa: E402

D, F, HEADS, KV, HEAD_DIM, VOCAB = 2048, 8192, 16, 8, 128, 32_000


def config(layers: int, d=D, f=F, heads=HEADS, kv=KV, head_dim=HEAD_DIM, vocab=VOCAB):
  import jax.numpy as jnp
  from tunix.models.qwen3 import model as qwen3

  return qwen3.ModelConfig(
    num_layers=layers, vocab_size=vocab, embed_dim=d, hidden_dim=f, num_heads=heads,
    head_dim=head_dim, num_kv_heads=kv, rope_theta=1_000_000, norm_eps=1e-6,
    param_dtype=jnp.bfloat16,
  )  # fmt: skip


def write_checkpoint(folder: str, layers: int, d=D, f=F, heads=HEADS, kv=KV, head_dim=HEAD_DIM,
                     vocab=VOCAB) -> int:  # fmt: skip
  """A Qwen3 checkpoint in Hugging Face's layout, a tensor at a time; returns its bytes."""
  import ml_dtypes
  import numpy as np

  from offlax._src.hf import files

  D, F, HEADS, KV, HEAD_DIM, VOCAB = d, f, heads, kv, head_dim, vocab  # noqa: N806
  shapes = {"model.embed_tokens.weight": (VOCAB, D)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes |= {
      p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, D),
      p + "self_attn.k_proj.weight": (KV * HEAD_DIM, D),
      p + "self_attn.v_proj.weight": (KV * HEAD_DIM, D),
      p + "self_attn.o_proj.weight": (D, HEADS * HEAD_DIM),
      p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
      p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
      p + "post_attention_layernorm.weight": (D,), p + "self_attn.q_norm.weight": (HEAD_DIM,),
      p + "self_attn.k_norm.weight": (HEAD_DIM,),
    }  # fmt: skip
  shapes |= {"model.norm.weight": (D,), "lm_head.weight": (VOCAB, D)}
  bf16 = np.dtype(ml_dtypes.bfloat16)
  os.makedirs(folder)
  writer = files.Writer(folder, [(n, bf16, s) for n, s in shapes.items()], 2**30, {"format": "pt"})
  block = (np.random.default_rng(0).standard_normal(2**24, np.float32) * 0.02).astype(bf16)
  for name, shape in shapes.items():
    n = int(np.prod(shape))
    writer.write(name, np.resize(block, n).reshape(shape))
  writer.finish()
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"num_hidden_layers": layers, "hidden_size": D, "vocab_size": VOCAB}, f)
  return _disk.tree_bytes(pathlib.Path(folder))


def child(layers: int, workdir: str) -> dict:
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3

  import offlax

  ckpt, out = os.path.join(workdir, "ckpt"), os.path.join(workdir, "out")
  ckpt_bytes = write_checkpoint(ckpt, layers)
  _disk.drop_page_cache(pathlib.Path(ckpt))
  model = nnx.eval_shape(lambda: qwen3.Qwen3(config(layers), rngs=nnx.Rngs(0)))
  store = offlax.LayerStore.create(os.path.join(workdir, "store"),
                                   offlax.stack_layers(model.layers), progress=False)  # fmt: skip
  offlax.offload_params(model, store=store)
  gc.collect()
  before = _common.proc_status_bytes("VmRSS") or 0
  _common.reset_peak_rss()
  start = time.perf_counter()
  offlax.load_safetensors(model, ckpt, store=store, progress=False)
  load_s = time.perf_counter() - start
  load_rss = _common.peak_rss() - before
  store_bytes = store.n_layers * store.layer_bytes
  _disk.drop_page_cache(pathlib.Path(store.path))
  gc.collect()
  before = _common.proc_status_bytes("VmRSS") or 0
  _common.reset_peak_rss()
  start = time.perf_counter()
  offlax.save_safetensors(model, out, store=store, max_shard_bytes=2**30, progress=False)
  save_s = time.perf_counter() - start
  save_rss = _common.peak_rss() - before
  store.close()
  return {
    "layers": layers, "checkpoint_bytes": ckpt_bytes, "store_param_bytes": store_bytes,
    "layer_bytes": store.layer_bytes, "load_s": load_s, "load_peak_rss_bytes": load_rss,
    "save_s": save_s, "save_peak_rss_bytes": save_rss,
  }  # fmt: skip


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
  parser.add_argument("--dir", default=tempfile.gettempdir())
  parser.add_argument("--out", default=None, help="folder of safetensors_io.json (none: print)")
  parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
  _disk.add_raw_arguments(parser, 1.0)
  args = parser.parse_args(argv)
  if args.child:
    print("RESULT", json.dumps(child(args.child, args.dir)))
    return {}
  # The machine's load (1-minute average, before and after): other work on the cores slows the
  # transposes, which bound both passes.
  results: dict = {"sizes": [], "load_average_1min": [os.getloadavg()[0]]}
  with tempfile.TemporaryDirectory(dir=args.dir, prefix="offlax-safetensors-") as d:
    raw = _disk.measure_raw(pathlib.Path(d), args.raw_gib, args.raw_tool)
    results["raw"] = {k: v for k, v in raw.items() if k.endswith("bytes_per_s")}
    for layers in args.layers:
      work = os.path.join(d, f"l{layers}")
      os.makedirs(work)
      cmd = [sys.executable, os.path.abspath(__file__), "--child", str(layers), "--dir", work]
      done = subprocess.run(cmd, check=True, capture_output=True, text=True)
      r = json.loads(done.stdout.rsplit("RESULT", 1)[1])
      shutil.rmtree(work)
      if not raw.get("error"):
        r["load_vs_raw"] = (
          _disk.raw_seconds(raw, r["checkpoint_bytes"], r["store_param_bytes"]) / r["load_s"]
        )
        r["save_vs_raw"] = (
          _disk.raw_seconds(raw, r["store_param_bytes"], r["checkpoint_bytes"]) / r["save_s"]
        )
      results["sizes"].append(r)
      print(
        f"{layers} layers ({r['checkpoint_bytes'] / 1e9:.2f} GB): load {r['load_s']:.1f} s "
        f"(peak RSS +{r['load_peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"{r.get('load_vs_raw', float('nan')):.2f}x the raw disk), save {r['save_s']:.1f} s "
        f"(peak RSS +{r['save_peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"{r.get('save_vs_raw', float('nan')):.2f}x); a layer is {r['layer_bytes'] / 2**20:.0f} MiB"
      )
  results["load_average_1min"].append(os.getloadavg()[0])
  small, large = results["sizes"][0], results["sizes"][-1]
  for what in ("load", "save"):
    ratio = large[f"{what}_peak_rss_bytes"] / max(1, small[f"{what}_peak_rss_bytes"])
    results[f"{what}_rss_ratio"] = ratio
    print(
      f"{what}: peak RSS at {large['layers']} layers / at {small['layers']} layers: {ratio:.2f}"
    )
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "safetensors_io.json"), "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
