"""Capacity: Tunix's Llama 3.1 405B on one H200 and Llama3-70B on one 80 GB GPU, layers on disk.

Each model, unedited and abstract (`nnx.eval_shape`: never materialized), has its decoder
layers in a sparse `offlax.LayerStore` (``offload_params(model, store=)``: a compile writes
nothing) and the rest (embedding, final norm, head) in host memory; the whole train step
(forward, backward, ``nnx.Optimizer.update`` of the rest, AdamW on an fp32 master, 1 x 2048
tokens) is compiled with XLA's GPU compiler (`offlax.compile_for_gpu`) at reduced depths
(``--depths``; every Tunix layer compiles unrolled) and the device peak and the program's host
buffers are extrapolated linearly to the full depth (126 and 80 layers).

RAM is the program's host buffers plus the store's: the update's budget
(``LayerStore(update_bytes=)``, `--update-bytes`) or, when larger, the model's reads (2 layers).
With ``--rest-state nvme`` (405B's default) the rest's optimizer state lives on the NVMe tier
(``offlax.offload(tx, offlax.NVMeTier(...))``, slices of `--nvme-chunk`, 1 GiB as the results
were made; 64 MiB compile as fast, the tier's slices of a leaf being one loop) rather than in
host memory, and
the compile has it so: the tier's init of the abstract params writes nothing and gives the
state a new store would give (its items on disk, `OnDisk`). The program's host buffers are then
the rest's params and gradients (and the tier's small items cached in RAM), measured; the tier's
slices in flight (8 of 64 MiB, the planner's count) are added.

The planner (`offlax.plan`, as ``python -m offlax plan --model NAME ... --update-bytes B``)
counts the same: its device and host figures against the compile's (goal: within 10%).

  python benchmarks/capacity.py                       # 405B at 2 and 4 layers, 70B at 2 and 4
  python benchmarks/capacity.py --models llama3_70b --depths 2 4 8
  python benchmarks/capacity.py --models llama3p1_405b --depths 126 --out /tmp/cap  # full depth

Writes ``benchmarks/results/capacity.{json,png}``.
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
NVME_BUFFERS = 8 * 64 * 2**20  # the planner's `_NVME_BUFFERS` slices of its default chunk
# Per model: the target, its memory, the RAM goal (issue 44.5), the store's budget, where the
# rest's state lives, and the disk.
SETUPS = {
  "llama3p1_405b": {"device_mem": "141GB", "host_goal": 64 * GB, "update_bytes": 16 * GB,
                    "rest_state": "nvme", "nvme": "16TB"},
  "llama3_70b": {"device_mem": "80GB", "host_goal": 48 * GB, "update_bytes": 4 * GB,
                 "rest_state": "host", "nvme": "4TB"},
}  # fmt: skip


def planned(name: str, setup: dict[str, Any]) -> dict[str, Any]:
  """The planner's verdict and figures for `name` (`offlax.plan`, the CLI's call)."""
  import jax.numpy as jnp
  import optax

  import offlax
  from offlax._src import plan_models, plan_options

  shape = plan_models.load(name, tunix_offload.TOKENS)  # a Tunix config: its step unrolled
  model = shape.model
  params = plan_models.params(model, jnp.bfloat16)
  tx = offlax.master_weights(optax.adamw(1e-3))
  size = lambda key: int(plan_options.parse_bytes(setup[key]))
  p = offlax.plan(params, tx, device_bytes=size("device_mem"), host_bytes=setup["host_goal"],
                  nvme_bytes=size("nvme"), activation_bytes=shape.device_bytes(),
                  layers=model.layers, update_bytes=setup["update_bytes"])  # fmt: skip
  return {"mode": p.mode, "fits": p.fits, "device": p.bytes["device"], "host": p.bytes["host"],
          "nvme": p.bytes["nvme"], "advice": list(p.advice)}  # fmt: skip


def measure(
  name: str, depths: list[int], rest_state: str | None = None, nvme_chunk: int = 1 << 30
) -> dict[str, Any]:
  """The step compiled at `depths`, extrapolated to the full depth; RAM counted (above).

  A single depth is the figure at that depth (the full one: measured, not extrapolated).
  """
  import offlax

  setup = {**SETUPS[name], "rest_state": rest_state or SETUPS[name]["rest_state"]}
  case = tunix_offload.CASES[name]
  cfg = tunix_offload.config(case)
  full = cfg.num_layers
  runs = []
  for layers in depths:
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
      tier = None
      if setup["rest_state"] == "nvme":  # abstract: the compile writes no store
        tier = offlax.NVMeTier(os.path.join(d, "rest"), chunk_bytes=nvme_chunk, progress=False)
      c, n = tunix_offload.compile_step(
        case, layers, store=os.path.join(d, "layers"), rest_tier=tier
      )
    wall = time.perf_counter() - t
    print(f"{name}, {layers} layers ({n / 1e9:.2f}B params): {wall:.0f} s\n{c.table()}", flush=True)
    runs.append({"layers": layers, "n_params": n, "device_peak": c.device_peak,
                 "host_bytes": c.host_peak, "compile_s": wall,
                 "target_memory": c.target.device_memory_size,
                 "host_compute": list(c.host_compute)})  # fmt: skip
  out: dict[str, Any] = {"runs": runs, "layers": full, **setup}
  # XLA's own host compute (an op on host memory it moved to the CPU): none is the goal.
  out["host_compute"] = sorted({op for r in runs for op in r["host_compute"]})
  for key in ("device_peak", "host_bytes"):
    intercept, slope = tunix_offload.fit_line([(r["layers"], r[key]) for r in runs])
    out[key] = intercept + slope * full
    out[f"{key}_per_layer"] = slope
  d, v = cfg.embed_dim, cfg.vocab_size
  rest_params = 2 * v * d + d  # embedding, head, final norm
  layer_params = (runs[-1]["n_params"] - rest_params) / runs[-1]["layers"]
  out["rest_params"], out["layer_params"] = rest_params, layer_params
  host = out["host_bytes"]
  if setup["rest_state"] == "nvme":  # the compiled program's, and the tier's slices in flight
    host = host + NVME_BUFFERS
    out["nvme_chunk"] = nvme_chunk
  reads = 2 * layer_params * 2  # the model's reads: 2 layers of bf16 params
  out["program_host"] = host
  out["store_ram"] = max(setup["update_bytes"], reads)
  out["ram"] = host + out["store_ram"]
  out["plan"] = planned(name, setup)
  out["plan_vs_compile"] = {"device": out["plan"]["device"] / out["device_peak"],
                            "host": out["plan"]["host"] / out["ram"]}  # fmt: skip
  return out


def plot(result: dict[str, Any], path) -> None:
  plt = _common.pyplot()
  names = list(result["models"])
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  panels = (("device_peak", "target_memory", "device GB"), ("ram", "host_goal", "RAM GB"))
  for ax, (key, goal, what) in zip(axes, panels, strict=True):
    for i, name in enumerate(names):
      m = result["models"][name]
      got = m[key] / GB
      want = (m["runs"][0]["target_memory"] if goal == "target_memory" else m[goal]) / GB
      plan = (m["plan"]["device"] if key == "device_peak" else m["plan"]["host"]) / GB
      how = (
        "compiled"
        if {r["layers"] for r in m["runs"]} == {m["layers"]}
        else "compiled (extrapolated)"
      )
      ax.bar(i - 0.2, got, 0.4, color="C0", label=how if not i else None)
      ax.bar(i + 0.2, plan, 0.4, color="C1", label="offlax plan" if not i else None)
      ax.plot([i - 0.45, i + 0.45], [want, want], "k--", label="the goal" if not i else None)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(what)
    ax.legend(fontsize=7)
  _common.save_png(fig, path, "Layers in a LayerStore: device peak and RAM at full depth")


def summary_table(result: dict[str, Any]) -> str:
  lines = [f"{'model':>14} {'layers':>6} {'device GB':>9} {'plan':>6} {'RAM GB':>7} {'plan':>6}"]
  for name, m in result["models"].items():
    lines.append(
      f"{name:>14} {m['layers']:>6} {m['device_peak'] / GB:>9.1f} {m['plan']['device'] / GB:>6.1f}"
      f" {m['ram'] / GB:>7.1f} {m['plan']['host'] / GB:>6.1f}"
    )
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", nargs="+", choices=list(SETUPS), default=list(SETUPS))
  ap.add_argument("--depths", type=int, nargs="+", default=[2, 4])
  ap.add_argument("--rest-state", choices=["nvme", "host"], default=None,
                  help="where the rest's optimizer state lives (default: the model's)")  # fmt: skip
  ap.add_argument("--nvme-chunk", type=int, default=1 << 30,
                  help="the NVMe tier's slices, bytes (1 GiB, the results')")  # fmt: skip
  _common.add_out_argument(ap, "capacity")
  args = ap.parse_args(argv)
  import offlax

  if not offlax.extend.gpu_compile_available():
    raise SystemExit("XLA's GPU compiler is not installed: pip install -e '.[gpu-compile]'")
  start = time.perf_counter()
  models = {
    name: measure(name, args.depths, args.rest_state, args.nvme_chunk) for name in args.models
  }
  result = {**_common.environment(), "depths": args.depths, "models": models,
            "wall_s": time.perf_counter() - start}  # fmt: skip
  _common.write_outputs(result, args.out, "capacity", plot, summary_table)
  return result


if __name__ == "__main__":
  main()
