"""Params, gradients and optimizer state off the device: a Llama-shaped step compiled for a GPU.

Compiles the whole step (forward, backward, AdamW with an fp32 master, apply)
with XLA's GPU compiler, on this machine, without a GPU (`offlax.compile_for_gpu`):
the bf16 params in ``pinned_host`` memory, their layers stacked and run by
`offlax.scan_layers` (rematerialised, saved layer inputs in host memory), the
gradients returned to host memory, and the optimizer step on the host CPU with
`offlax.update_and_apply` (the new params written over the old). Beside it,
the same model trained the plain way (params, gradients and state on the
device), which does not fit.

  python benchmarks/params_offload.py                 # 13B on 24 GB, 70B on 80 GB
  python benchmarks/params_offload.py --model 13b --target h100

Writes ``benchmarks/results/params_offload.{json,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import _common  # noqa: E402
from offlax._src import llama  # noqa: E402

# "tiny" is the quick run's (seconds); the default run compiles 13b for 24 GB and 70b for 80 GB.
MODELS = {
  **llama.MODELS,
  "tiny": llama.Llama(layers=2, d=256, ffn=512, vocab=512, heads=4, tokens=128),
}
TARGETS = {"13b": "rtx4090", "70b": "a100-80gb", "tiny": "l4"}


def plot(result: dict[str, Any], path) -> None:
  plt = _common.pyplot()
  runs = result["runs"]
  names = sorted({r["model"] for r in runs}, key=[r["model"] for r in runs].index)
  fig, ax = plt.subplots(figsize=(7, 4.2))
  x = range(len(names))
  modes = ((False, "plain (all on the device)"), (True, "offlax: params, grads, state on the host"))
  for k, (offloaded, label) in enumerate(modes):
    peaks = [next(r["device_peak"] for r in runs if r["model"] == n and r["offloaded"] == offloaded)
             for n in names]  # fmt: skip
    ax.bar([i + (k - 0.5) * 0.38 for i in x], [p / 1e9 for p in peaks], 0.38, label=label)
  for i, n in enumerate(names):
    memory = next(r["target_memory"] for r in runs if r["model"] == n)
    ax.plot(
      [i - 0.45, i + 0.45], [memory / 1e9] * 2, "k--", label="the GPU's memory" if i == 0 else None
    )
  ax.set_xticks(list(x), [f"{n}\n{next(r['target'] for r in runs if r['model'] == n)}"
                          for n in names])  # fmt: skip
  ax.set_yscale("log")
  ax.set_ylabel("device GB at the compiled peak")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  _common.save_png(fig, path, "Whole train step, XLA:GPU buffer assignment")


def summary_table(result: dict[str, Any]) -> str:
  lines = [f"{'model':>6} {'params':>7} {'target':>28} {'mode':>8} {'device GB':>9} "
           f"{'host GB':>8} {'fits':>5} {'converted':>9}"]  # fmt: skip
  for r in result["runs"]:
    lines.append(
      f"{r['model']:>6} {r['n_params'] / 1e9:>6.1f}B {r['target']:>28} "
      f"{'offlax' if r['offloaded'] else 'plain':>8} {r['device_peak'] / 1e9:>9.2f} "
      f"{r['host_peak'] / 1e9:>8.1f} {str(r['fits']):>5} {len(r['host_compute']):>9}"
    )
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(MODELS), nargs="+", default=["13b", "70b"])
  ap.add_argument("--target", help="GPU target (default: rtx4090 for 13b, a100-80gb for 70b)")
  _common.add_out_argument(ap, "params_offload")
  args = ap.parse_args(argv)
  import offlax

  if not offlax.extend.gpu_compile_available():
    raise SystemExit("XLA's GPU compiler is not installed: pip install -e '.[gpu-compile]'")
  start = time.perf_counter()
  runs = []
  for name in args.model:
    m, target = MODELS[name], args.target or TARGETS[name]
    for offloaded in (True, False):
      t = time.perf_counter()
      c = llama.compile_step(m, target, offloaded=offloaded)
      what = "offlax: params, grads, state off the device" if offloaded else "plain (all on device)"
      print(f"\n{name} ({m.n_params / 1e9:.1f}B params), {what}, {time.perf_counter() - t:.0f} s")
      print(c.table(), flush=True)
      runs.append({
        "model": name, "n_params": m.n_params, "target": c.target.name,
        "target_memory": c.target.device_memory_size, "offloaded": offloaded,
        "device": c.device, "host": c.host, "device_peak": c.device_peak,
        "host_peak": c.host_peak, "fits": c.fits, "host_compute": list(c.host_compute),
      })  # fmt: skip
  result = {**_common.environment(), "runs": runs, "wall_s": time.perf_counter() - start}
  _common.write_outputs(result, args.out, "params_offload", plot, summary_table)
  return result


if __name__ == "__main__":
  main()
