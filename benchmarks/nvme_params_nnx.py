"""Tunix's Llama3-70B, unedited, with its decoder layers on NVMe, compiled for an 80 GB GPU.

``offlax.offload_params(model, store=store)`` reads each decoder layer from a
`LayerStore` (here a sparse one: a compile writes nothing) and puts the rest
of the model (embedding, final norm, head) in host memory; the whole train
step (forward, backward, ``nnx.Optimizer.update`` of the rest with AdamW on an
fp32 master, 1 x 2048 tokens) is compiled with XLA's GPU compiler. Beside it,
the same model with all its params in host memory (`offload_params` without a
store, `benchmarks/tunix_offload.py`'s step).

Tunix's models loop over a Python list of layers, so every layer compiles
unrolled (seconds to a minute here): the figures are compiled at reduced depths
(``--depths``, default 2 4 8 16) and extrapolated linearly to 80 layers. The
program's host buffers are what RAM must hold besides the store's pool and
update (`LayerStore`: a few layers).

  python benchmarks/nvme_params_nnx.py                   # Llama3-70B at 2, 4, 8, 16 layers
  python benchmarks/nvme_params_nnx.py --model tiny --depths 2 4   # seconds: the smoke run

Writes ``benchmarks/results/nvme_params_nnx.{json,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import _common, tunix_offload  # noqa: E402

GB = 10**9
MODES = {"store": "layers on NVMe (offload_params(store=))", "host": "params in host memory"}


def plot(result: dict[str, Any], path) -> None:
  plt = _common.pyplot()
  fig, (device, host) = plt.subplots(1, 2, figsize=(12, 4.5))
  for (mode, label), color in zip(MODES.items(), ("C0", "C1"), strict=True):
    pts = sorted((r["layers"], r) for r in result["runs"] if r["mode"] == mode)
    full, xs = result["summary"][mode], [p[0] for p in pts]
    for ax, key in ((device, "device_peak"), (host, "host_bytes")):
      ys = [p[1][key] / GB for p in pts]
      ax.plot(xs, ys, "o-", color=color, label=f"{label} (compiled)")
      ax.plot([xs[-1], result["summary"]["layers"]], [ys[-1], full[key] / GB], "o--",
              color=color, mfc="none", label="extrapolated to the full depth")  # fmt: skip
  for ax, what in ((device, "device GB at the compiled peak"), (host, "host buffers, GB")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel(what)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  device.axhline(result["target_memory"] / GB, color="k", ls=":", lw=1, label="the GPU's memory")
  device.legend(fontsize=7)
  _common.save_png(fig, path, f"Tunix {result['model']}: layers on NVMe vs in host memory")


def summary_table(result: dict[str, Any]) -> str:
  s = result["summary"]
  lines = [f"{'mode':>6} {'layers':>6} {'device GB':>10} {'host GB':>9}  (extrapolated)"]
  for mode in MODES:
    lines.append(
      f"{mode:>6} {s['layers']:>6} {s[mode]['device_peak'] / GB:>10.2f} "
      f"{s[mode]['host_bytes'] / GB:>9.1f}"
    )
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=["llama3_70b", "qwen3_14b", "tiny"], default="llama3_70b")
  ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16])
  _common.add_out_argument(ap, "nvme_params_nnx")
  args = ap.parse_args(argv)
  import offlax

  if not offlax.extend.gpu_compile_available():
    raise SystemExit("XLA's GPU compiler is not installed: pip install -e '.[gpu-compile]'")
  case = tunix_offload.CASES[args.model]
  full = tunix_offload.config(case).num_layers
  start, runs = time.perf_counter(), []
  for layers in args.depths:
    for mode in MODES:
      t = time.perf_counter()
      with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "layers") if mode == "store" else None
        c, n = tunix_offload.compile_step(case, layers, store=store)
      target_memory = c.target.device_memory_size
      wall = time.perf_counter() - t
      print(f"\n{args.model}, {layers} layers ({n / 1e9:.2f}B params), {MODES[mode]}, {wall:.0f} s")
      print(c.table(), flush=True)
      runs.append({
        "mode": mode, "layers": layers, "n_params": n, "device": c.device, "host": c.host,
        "device_peak": c.device_peak, "host_bytes": c.host_peak,
        "host_compute": list(c.host_compute), "compile_s": wall,
        "callbacks": c.hlo.count('custom_call_target="xla_ffi_python_gpu_callback"'),
      })  # fmt: skip
  summary: dict[str, Any] = {"layers": full}
  for mode in MODES:
    mine = [r for r in runs if r["mode"] == mode]
    summary[mode] = {}
    for key in ("device_peak", "host_bytes"):
      intercept, slope = tunix_offload.fit_line([(r["layers"], r[key]) for r in mine])
      summary[mode][key] = intercept + slope * full
      summary[mode][f"{key}_per_layer"] = slope
  result = {
    **_common.environment(), "model": args.model, "target": case.target,
    "target_memory": target_memory,
    "tokens": case.tokens, "runs": runs, "summary": summary,
    "wall_s": time.perf_counter() - start,
  }  # fmt: skip
  _common.write_outputs(result, args.out, "nvme_params_nnx", plot, summary_table)
  return result


if __name__ == "__main__":
  main()
