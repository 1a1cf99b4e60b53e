"""A `LayerStore`'s update with and without a byte budget (``update_bytes``): peak bytes in
flight, peak RSS and time, side by side.

A store of `--layers` layers of one ``--rows x --cols`` bf16 leaf (and a small one), trained
with ``offlax.master_weights(optax.adamw)``: each mode in its own process (its peak RSS its
own), one warm-up step and `--steps` timed; the same params to the bit either way
(`tests/test_layer_store_budget.py`).

  python benchmarks/layer_store_budget.py                 # 4 x 4096 x 4096, 256 MB budget

Writes ``benchmarks/results/layer_store_budget.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import _common  # noqa: E402

MB = 10**6


def one(args: argparse.Namespace, budget: int | None) -> dict[str, Any]:
  """Trains in this process; its figures."""
  import time

  import jax
  import jax.numpy as jnp
  import optax

  import offlax

  n, r, c = args.layers, args.rows, args.cols
  like = {"b": jax.ShapeDtypeStruct((n, c), jnp.bfloat16),
          "w": jax.ShapeDtypeStruct((n, r, c), jnp.bfloat16)}  # fmt: skip
  tx = offlax.master_weights(optax.adamw(1e-3))
  init = lambda i: {"b": jnp.zeros((c,), jnp.bfloat16), "w": jnp.full((r, c), 0.01, jnp.bfloat16)}
  x = jnp.ones((2, r), jnp.bfloat16)  # (--rows == --cols: the layers chain)
  loss = lambda s: jnp.sum(
    offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), x, s)[0]
  ).astype(jnp.float32)
  grad = jax.jit(jax.grad(loss))
  steps = []
  with tempfile.TemporaryDirectory(dir=args.dir) as d:
    store = offlax.LayerStore.create(os.path.join(d, "s"), like, optimizer=tx, init_layer=init,
                                     progress=False, update_bytes=budget)  # fmt: skip
    with store:
      _common.reset_peak_rss()
      for _ in range(args.steps + 1):
        grad(store.source())
        t = time.perf_counter()
        store.update()
        s = store.last_update
        steps.append({"seconds": time.perf_counter() - t, "peak_bytes": s.peak_bytes,
                      "bytes": s.bytes_read + s.bytes_written})  # fmt: skip
  timed = steps[1:]
  return {"update_bytes": budget, "steps": steps, "peak_rss": _common.peak_rss(),
          "peak_bytes": max(s["peak_bytes"] for s in timed),
          "seconds": sorted(s["seconds"] for s in timed)[len(timed) // 2]}  # fmt: skip


def plot(result: dict[str, Any], path) -> None:
  plt = _common.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(12, 4))
  labels = [r["label"] for r in result["runs"]]
  for ax, key, what in zip(axes, ("peak_bytes", "peak_rss", "seconds"),
                           ("MB in flight (Stats.peak_bytes)", "peak RSS, MB", "update, s"),
                           strict=True):  # fmt: skip
    scale = 1 if key == "seconds" else MB
    ax.bar(labels, [r[key] / scale for r in result["runs"]], color=["C0", "C1"])
    ax.set_ylabel(what)
  _common.save_png(fig, path, f"LayerStore update, {result['shape']}: whole leaves vs a budget")


def summary_table(result: dict[str, Any]) -> str:
  lines = [f"{'mode':>22} {'in flight MB':>12} {'peak RSS MB':>11} {'update s':>8}"]
  for r in result["runs"]:
    lines.append(f"{r['label']:>22} {r['peak_bytes'] / MB:>12.0f} {r['peak_rss'] / MB:>11.0f} "
                 f"{r['seconds']:>8.2f}")  # fmt: skip
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--rows", type=int, default=4096)
  ap.add_argument("--cols", type=int, default=4096)
  ap.add_argument("--budget", type=int, default=256 * MB)
  ap.add_argument("--steps", type=int, default=2)
  ap.add_argument("--dir", default=None, help="where the store goes (a temporary folder)")
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: "none" or bytes
  _common.add_out_argument(ap, "layer_store_budget")
  args = ap.parse_args(argv)
  if args.one is not None:
    print(json.dumps(one(args, None if args.one == "none" else int(args.one))))
    return {}
  import time

  start, runs = time.perf_counter(), []
  for budget in (None, args.budget):
    cmd = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]),
           "--one", "none" if budget is None else str(budget)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    run = json.loads(out.strip().splitlines()[-1])
    run["label"] = "whole leaves" if budget is None else f"update_bytes={budget / MB:.0f} MB"
    runs.append(run)
    print(run["label"], run["peak_bytes"], run["peak_rss"], run["seconds"], flush=True)
  result = {**_common.environment(), "shape": f"{args.layers} x {args.rows} x {args.cols} bf16",
            "optimizer": "master_weights(adamw)", "runs": runs,
            "wall_s": time.perf_counter() - start}  # fmt: skip
  _common.write_outputs(result, args.out, "layer_store_budget", plot, summary_table)
  return result


if __name__ == "__main__":
  main()
