"""Hugging Face checkpoints into and out of a `LayerStore`: RAM flat as the model grows, disk speed.

What is measured, on one filesystem (a fresh directory under `--dir`, removed at the end):

1. The raw disk: sequential direct-I/O read and write of `--raw-gib` GiB (`_disk.measure_raw`),
   before the passes and (`--raw-passes 2`) after them; the best of the two each way (the
   virtual disk here drifts between 1 and 2.8 GB/s within minutes).
2. For each size (`--layers`, default 2 and 8 layers of a Qwen3 with d = 2048, f = 8192: 126 MB
   of bf16 a layer, 131 MB for each of the embedding and the head), in a fresh subprocess: a
   checkpoint in Hugging Face's layout (`model.safetensors` shards of at most 1 GiB) written
   first; a Tunix Qwen3 (bf16 params) made by `nnx.eval_shape`, its layers in a sparse
   `LayerStore` (no optimizer state), the rest in `pinned_host`; then `--repeat` times (3):
   `offlax.load_safetensors` (the checkpoint's page cache dropped first) and
   `offlax.save_safetensors` from the store (the store's page cache dropped first) over the
   same new folder. Each pass: its wall time, the process's CPU time (all threads), and its
   peak RSS over the process's RSS before it (VmHWM; the first pass's, into the abstract
   model, is reported).
3. Each pass's traffic (the checkpoint's bytes read, the store's written, or the reverse) over
   its best wall time, against the raw disk's time for the same traffic (`_disk.raw_seconds`):
   the ratio (goal >= 0.8x); and its CPU seconds per GB of traffic, which the machine's other
   work does not change (what bounds the pass where the cores are busy).

  python benchmarks/safetensors_io.py [--layers 2 8] [--repeat 3] [--dir /tmp] [--raw-gib 1]

Results: printed, and `<out>/safetensors_io.json` and `.png` (the run before beside it, where
the JSON holds one under ``before``).
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


def child(layers: int, workdir: str, repeat: int) -> dict:
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3

  import offlax

  ckpt, out = os.path.join(workdir, "ckpt"), os.path.join(workdir, "out")
  ckpt_bytes = write_checkpoint(ckpt, layers)
  model = nnx.eval_shape(lambda: qwen3.Qwen3(config(layers), rngs=nnx.Rngs(0)))
  store = offlax.LayerStore.create(os.path.join(workdir, "store"),
                                   offlax.stack_layers(model.layers), progress=False)  # fmt: skip
  offlax.offload_params(model, store=store)
  runs: dict[str, list[dict]] = {"load": [], "save": []}

  def timed(what: str, drop: str, run) -> None:
    """One pass, the page cache of what it reads dropped first: its wall and CPU time, peak RSS."""
    _disk.drop_page_cache(pathlib.Path(drop))
    gc.collect()
    before = _common.proc_status_bytes("VmRSS") or 0
    _common.reset_peak_rss()
    cpu, start = time.process_time(), time.perf_counter()
    run()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    runs[what].append({"s": wall, "cpu_s": cpu, "peak_rss_bytes": _common.peak_rss() - before})

  for _ in range(repeat):  # the same checkpoint into the same store, saved over the same folder
    timed("load", ckpt, lambda: offlax.load_safetensors(model, ckpt, store=store, progress=False))
    timed("save", store.path, lambda: offlax.save_safetensors(
      model, out, store=store, max_shard_bytes=2**30, overwrite=True, progress=False))  # fmt: skip
  store.close()
  r: dict = {"layers": layers, "checkpoint_bytes": ckpt_bytes, "layer_bytes": store.layer_bytes,
             "store_param_bytes": store.n_layers * store.layer_bytes}  # fmt: skip
  for what, done in runs.items():
    best = min(done, key=lambda x: x["s"])  # the machine's other work slows a run, never speeds it
    r[f"{what}_s"], r[f"{what}_cpu_s"] = best["s"], best["cpu_s"]
    # The first pass's: into the abstract model, as a user's load (a later load into the loaded
    # model holds its old values too, until it sets the new ones).
    r[f"{what}_peak_rss_bytes"] = done[0]["peak_rss_bytes"]
    r[f"{what}_runs"] = done
  return r


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
  parser.add_argument("--repeat", type=int, default=3, help="passes each way per size, best kept")
  parser.add_argument("--dir", default=tempfile.gettempdir())
  parser.add_argument("--out", default=None, help="folder of safetensors_io.json/png (none: print)")
  parser.add_argument(
    "--before", default=None,
    help="a safetensors_io.json of the code before a change: kept under 'before', plotted beside",
  )  # fmt: skip
  parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
  _disk.add_raw_arguments(parser, 1.0)
  args = parser.parse_args(argv)
  if args.child:
    print("RESULT", json.dumps(child(args.child, args.dir, args.repeat)))
    return {}
  # The machine's load (1-minute average, before and after): other work on the cores slows the
  # passes' CPU work (transposes, copies, checksums), not the raw disk's.
  results: dict = {"sizes": [], "load_average_1min": [os.getloadavg()[0]], "repeat": args.repeat}
  with tempfile.TemporaryDirectory(dir=args.dir, prefix="offlax-safetensors-") as d:
    passes = [_disk.raw_pass(pathlib.Path(d), args, "before")]
    for layers in args.layers:
      work = os.path.join(d, f"l{layers}")
      os.makedirs(work)
      cmd = [sys.executable, os.path.abspath(__file__), "--child", str(layers), "--dir", work,
             "--repeat", str(args.repeat)]  # fmt: skip
      done = subprocess.run(cmd, check=True, capture_output=True, text=True)
      results["sizes"].append(json.loads(done.stdout.rsplit("RESULT", 1)[1]))
      shutil.rmtree(work)
    if args.raw_passes > 1:  # again after, to catch a drift of the disk's speed
      passes.append(_disk.raw_pass(pathlib.Path(d), args, "after"))
  raw = _disk.combine_raw(passes)
  results["raw"] = raw
  results["load_average_1min"].append(os.getloadavg()[0])
  for r in results["sizes"]:
    traffic = {"load": (r["checkpoint_bytes"], r["store_param_bytes"]),
               "save": (r["store_param_bytes"], r["checkpoint_bytes"])}  # fmt: skip
    for what, (read_b, write_b) in traffic.items():
      r[f"{what}_cpu_s_per_gb"] = r[f"{what}_cpu_s"] / ((read_b + write_b) / 1e9)
      if not raw.get("error"):
        r[f"{what}_raw_s"] = _disk.raw_seconds(raw, read_b, write_b)
        r[f"{what}_vs_raw"] = r[f"{what}_raw_s"] / r[f"{what}_s"]
    print(
      f"{r['layers']} layers ({r['checkpoint_bytes'] / 1e9:.2f} GB): load {r['load_s']:.2f} s "
      f"(CPU {r['load_cpu_s']:.2f} s, peak RSS +{r['load_peak_rss_bytes'] / 2**20:.0f} MiB, "
      f"{r.get('load_vs_raw', float('nan')):.2f}x the raw disk), save {r['save_s']:.2f} s "
      f"(CPU {r['save_cpu_s']:.2f} s, peak RSS +{r['save_peak_rss_bytes'] / 2**20:.0f} MiB, "
      f"{r.get('save_vs_raw', float('nan')):.2f}x); a layer is {r['layer_bytes'] / 2**20:.0f} MiB"
    )
  small, large = results["sizes"][0], results["sizes"][-1]
  for what in ("load", "save"):
    ratio = large[f"{what}_peak_rss_bytes"] / max(1, small[f"{what}_peak_rss_bytes"])
    results[f"{what}_rss_ratio"] = ratio
    print(
      f"{what}: peak RSS at {large['layers']} layers / at {small['layers']} layers: {ratio:.2f}"
    )
  if args.before:
    with open(args.before) as f:
      before = json.load(f)
    results["before"] = {k: v for k, v in before.items() if k != "before"}
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    _common.write_json(results, pathlib.Path(args.out) / "safetensors_io.json")
    plot(results, pathlib.Path(args.out) / "safetensors_io.png")
  return results


def plot(results: dict, path: pathlib.Path) -> None:
  """Each pass's speed against the raw disk's, per size; the run before (``before``) beside it."""
  if results["raw"].get("error"):
    return
  plt = _common.pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.2))
  runs = [("before", results["before"])] if "before" in results else []
  runs.append(("now", results))
  bars = []
  for name, run in runs:
    for r in run["sizes"]:
      for what, color in (("load", "tab:blue"), ("save", "tab:orange")):
        if f"{what}_vs_raw" in r:
          label = f"{what}\n{r['layers']} layers\n{name}"
          x = r[f"{what}_vs_raw"]
          bars.append((label, x, x, x, color if name == "now" else "tab:gray", "x"))
  _common.draw_bars(ax, bars, headroom=1.3)
  ax.axhline(0.8, color="tab:red", linestyle="--", linewidth=1)
  ax.set_ylabel("x the raw disk's speed (goal 0.8)")
  raw = results["raw"]
  title = (
    f"load_safetensors / save_safetensors vs the raw disk (read "
    f"{raw['read_bytes_per_s'] / 1e9:.2f}, write {raw['write_bytes_per_s'] / 1e9:.2f} GB/s), "
    f"load average {results['load_average_1min'][0]:.1f}"
  )
  _common.save_png(fig, path, title)


if __name__ == "__main__":
  main()
