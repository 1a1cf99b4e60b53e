"""Host compute with 8-bit vs fp32 Adam state: params/s and bytes of state, side by side.

For each size (default 64M and 256M params, the issue's two, in 8 equal
leaves) the host step of ZeRO-Offload is timed with fp32 moments and with 8-bit ones
(`offlax.adamw(..., state_bits=8)`, docs/state_bits.md), every variant in its
own process, the variants interleaved over `--repeats` rounds (this machine's
speed drifts within a minute; see benchmarks/host_adam.py):

- `full step`: `offlax.update_and_apply(offlax.adamw(lr, state_bits=b), ...)` on
  float32 params: one native pass (adam.cc, or adam8.cc for 8 bits);
- `mixed`: the same through `offlax.offload(offlax.master_weights(...),
  HostTier(compute="host"))` on bfloat16 params (fp32 master in the state);
- `8-bit, plain JAX`: the full step with ``OFFLAX_NATIVE=0`` (what a machine
  without a C++ compiler runs).

Each figure is the median params/s over the timed steps of every round (min and
max beside it), in wall time and per second of CPU time (all threads; steadier
when other processes share the cores). Also recorded: the bytes of optimizer state a param (the
moments, and the master for `mixed`). Writes `<out>/state_bits.json` and a bar
chart `<out>/state_bits.png`.

  python benchmarks/state_bits.py
  python benchmarks/state_bits.py --sizes-m 1 --steps 2 --repeats 1 --out /tmp/bench   # quick
  python benchmarks/state_bits.py --variants "fp32 full step" "8-bit full step"   # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import _common  # noqa: E402

LEAVES = 8
LR, WEIGHT_DECAY = 1e-3, 1e-4
VARIANTS = (
  "fp32 full step",
  "8-bit full step",
  "fp32 mixed",
  "8-bit mixed",
  "8-bit full step, plain JAX",
)


def worker(name: str, n: int, steps: int, warmup: int) -> dict[str, Any]:
  """Times `name` in this process: seconds per step and state bytes a param."""
  import jax
  import jax.numpy as jnp

  import offlax

  bits = 8 if name.startswith("8-bit") else 32
  mixed = "mixed" in name
  dtype = jnp.bfloat16 if mixed else jnp.float32
  params = {f"w{i}": jnp.full((n // LEAVES,), 0.5, dtype) for i in range(LEAVES)}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.005), params)
  inner = offlax.adamw(LR, weight_decay=WEIGHT_DECAY, state_bits=bits)
  if mixed:
    tx = offlax.offload(offlax.master_weights(inner), offlax.HostTier(compute="host"))
  else:
    tx = inner
  state = tx.init(params)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  step = jax.jit(lambda p, s, g: offlax.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
  times, cpu_times = [], []
  for i in range(warmup + steps):
    start, cpu_start = time.perf_counter(), time.process_time()
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    if i >= warmup:
      times.append(time.perf_counter() - start)
      cpu_times.append(time.process_time() - cpu_start)
  return {"times": times, "cpu_times": cpu_times, "state_bytes_per_param": state_bytes / n}


def run(name: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
  env = dict(os.environ)
  if name.endswith("plain JAX"):
    env["OFFLAX_NATIVE"] = "0"
  cmd = [sys.executable, __file__, "--worker", name, str(n), str(args.steps), str(args.warmup)]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
  lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
  if out.returncode != 0 or not lines:
    return {"error": ((out.stderr or out.stdout).strip().splitlines() or ["no output"])[-1]}
  return json.loads(lines[-1][len("RESULT ") :])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes-m", type=float, nargs="+", default=[64, 256])
  _common.add_steps_arguments(parser, 5, "untimed steps first (2)")
  parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (3)")
  parser.add_argument(
    "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="what to time (all)"
  )
  _common.add_out_argument(parser, "state_bits")
  args = parser.parse_args(argv)
  _common.check_steps_arguments(parser, args)
  result: dict[str, Any] = {
    "benchmark": "state_bits",
    **_common.environment(),
    "leaves": LEAVES,
    "steps": args.steps,
    "warmup": args.warmup,
    "repeats": args.repeats,
    "sizes": {},
  }
  for size in args.sizes_m:
    n = int(size * 2**20) // LEAVES * LEAVES
    variants = [v for v in VARIANTS if v in args.variants]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(args.repeats):
      for name in variants if r % 2 == 0 else variants[::-1]:
        runs[name].append(run(name, n, args))
    row: dict[str, Any] = {}
    for name, got in runs.items():
      errors = [g["error"] for g in got if "error" in g]
      if errors:
        row[name] = {"error": errors[0]}
        continue
      rates = [n / t for g in got for t in g["times"]]
      cpu_rates = [n / t for g in got for t in g["cpu_times"]]
      row[name] = {
        **_common.stats_of(rates, "_params_per_s"),
        # Params per second of CPU time (all threads): steadier than wall time on a shared
        # machine, where other processes take the cores for part of a step.
        **_common.stats_of(cpu_rates, "_params_per_cpu_s"),
        "state_bytes_per_param": got[0]["state_bytes_per_param"],
      }
    for kind in ("full step", "mixed"):
      a, b = row.get(f"8-bit {kind}", {}), row.get(f"fp32 {kind}", {})
      if "median_params_per_s" in a and "median_params_per_s" in b:
        row[f"8-bit / fp32, {kind}"] = a["median_params_per_s"] / b["median_params_per_s"]
        row[f"8-bit / fp32, {kind}, CPU time"] = (
          a["median_params_per_cpu_s"] / b["median_params_per_cpu_s"]
        )
    result["sizes"][f"{size:g}M"] = row
    print(f"{size:g}M params: {json.dumps(row, indent=1)}", flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "state_bits.json").write_text(json.dumps(result, indent=1) + "\n")
  plot(result, args.out / "state_bits.png")
  return result


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  sizes = result["sizes"]
  fig, axes = plt.subplots(1, len(sizes), figsize=(9 * len(sizes), 4.5), squeeze=False)
  colors = {"fp32": "tab:blue", "8-bit": "tab:orange"}
  for ax, (size, row) in zip(axes[0], sizes.items(), strict=True):
    bars = [
      (
        name.replace(", ", "\n"),
        row[name]["median_params_per_s"] / 1e6,
        row[name]["min_params_per_s"] / 1e6,
        row[name]["max_params_per_s"] / 1e6,
        colors[name.split()[0]],
        f"\n{row[name]['state_bytes_per_param']:.2f} B/param",
      )
      for name in VARIANTS
      if "median_params_per_s" in row.get(name, {})
    ]
    _common.draw_bars(ax, bars, headroom=1.35)
    ax.set_ylabel("M params/s (median, min-max)")
    ax.set_title(f"{size} params, host step ({result.get('cpu_count', '?')} CPUs)")
  _common.save_png(fig, path, "Adam state: fp32 vs 8-bit (blockwise), host compute")


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    name, n, steps, warmup = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    print("RESULT " + json.dumps(worker(name, n, steps, warmup)), flush=True)
  else:
    main()
