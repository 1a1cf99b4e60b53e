"""Host-side Adam throughput: offlax host compute vs optax vs DeepSpeed and torch CPU Adam.

For each size (default 16M, 64M and 256M fp32 params, in 8 equal leaves) one
Adam step (update the moments, update the params) is timed, in one run:

- offlax host compute: `offlax.offload(offlax.adam(1e-3), offlax.HostTier(compute="host"))`,
  the jitted step `tx.update` + `optax.apply_updates`, params and state donated;
  on a GPU machine this step runs on the host CPU under
  `compute_on("device_host")`, on the CPU backend it is the same XLA:CPU code;
- `offlax.adam(1e-3)` and plain `optax.adam(1e-3)` in the same jitted step;
- offlax host compute, update only: the same tier with
  `offlax.adam(1e-3, native_update=True)`, the jitted `tx.update` alone
  (gradients and state donated, fresh gradients each step made before the
  clock starts): the host's share of a ZeRO-Offload step, where the
  accelerator adds the update to its params. The native kernel reads the
  gradient and both moments and writes the moments and the update, in one pass;
- DeepSpeedCPUAdam (`deepspeed.ops.adam`, SIMD C++, in place) and torch's
  fused CPU Adam (`torch.optim.Adam(fused=True)`), run by a second Python that
  has torch and deepspeed (`--torch-python`; by default this interpreter if it
  imports them, else `benchmarks/.venv-torch/bin/python`). They are not
  dependencies of offlax: make that environment with

    python -m venv benchmarks/.venv-torch
    benchmarks/.venv-torch/bin/pip install torch==2.13.0 deepspeed ninja numpy

  (a CPU build of torch: a plain `pip install torch` may fetch a CUDA build of
  several GB).
  Without it they are skipped with the reason printed.

Each figure is the median params/s of `--steps` steps after `--warmup` steps,
with min and max; the ratio to DeepSpeedCPUAdam is the goal (>= 1.0x). Writes
`<out>/host_adam.json` and a bar chart `<out>/host_adam.png`.

  python benchmarks/host_adam.py
  python benchmarks/host_adam.py --sizes-m 1 --steps 2 --out /tmp/bench   # quick
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
LR = 1e-3
TORCH_VENV = pathlib.Path(__file__).resolve().parent / ".venv-torch" / "bin" / "python"

# Run by the torch Python: times DeepSpeedCPUAdam and torch's fused Adam.
_TORCH_SCRIPT = """
import json, sys, time
import torch
n, leaves, steps, warmup, lr = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                int(sys.argv[4]), float(sys.argv[5]))
torch.set_num_threads(int(sys.argv[6]))
out = {"torch_version": torch.__version__, "threads": torch.get_num_threads()}

def bench(make):
  params = [torch.nn.Parameter(torch.full((n // leaves,), 0.5)) for _ in range(leaves)]
  for p in params:
    p.grad = torch.full_like(p, 0.005)
  opt = make(params)
  for _ in range(warmup):
    opt.step()
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t)
  return times

try:
  import deepspeed
  from deepspeed.ops.adam import DeepSpeedCPUAdam
  out["deepspeed_version"] = deepspeed.__version__
  out["DeepSpeedCPUAdam"] = bench(lambda ps: DeepSpeedCPUAdam(ps, lr=lr, adamw_mode=False))
except Exception as e:
  out["DeepSpeedCPUAdam_error"] = f"{type(e).__name__}: {e}"
try:
  out["torch fused Adam"] = bench(lambda ps: torch.optim.Adam(ps, lr=lr, fused=True))
except Exception as e:
  out["torch fused Adam_error"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


JAX_VARIANTS = (
  "offlax host compute",
  "offlax.adam (native moments)",
  "plain optax (XLA:CPU)",
  "offlax host compute, update only",
)


def jax_times(name: str, n: int, steps: int, warmup: int) -> list[float]:
  import jax
  import jax.numpy as jnp
  import optax

  import offlax

  params = {f"w{i}": jnp.full((n // LEAVES,), 0.5, jnp.float32) for i in range(LEAVES)}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.005), params)
  if name == "offlax host compute, update only":
    return update_times(params, steps, warmup)
  if name == "offlax host compute":
    tx = offlax.offload(offlax.adam(LR), offlax.HostTier(compute="host"))
  elif name == "offlax.adam (native moments)":
    tx = offlax.adam(LR)
  else:
    tx = optax.adam(LR)
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return times


def update_times(params: Any, steps: int, warmup: int) -> list[float]:
  """What the host computes per step when the update leaves the host, as in ZeRO-Offload.

  `tx.update` alone with `offlax.adam(native_update=True)` in host compute:
  the gradient, both moments in, the update and both moments out, in one
  pass, the update written over the (donated) gradient. Fresh gradients each
  step, made before the clock starts.
  """
  import jax
  import jax.numpy as jnp

  import offlax
  from offlax._src import host_adam

  if not host_adam.native_available():
    raise RuntimeError("the native kernel did not build")
  tx = offlax.offload(offlax.adam(LR, native_update=True), offlax.HostTier(compute="host"))
  # Gradients donated too, and first: jax 0.10 pairs donated buffers with outputs
  # by shape and dtype, so the updates must take the gradients' buffers, not the
  # state's (docs/exactness.md, "Donation").
  update = jax.jit(tx.update, donate_argnums=(0, 1))
  state = tx.init(params)
  times = []
  for i in range(warmup + steps):
    grads = jax.block_until_ready(jax.tree.map(lambda x: jnp.full_like(x, 0.005), params))
    start = time.perf_counter()
    updates, state = update(grads, state)
    jax.block_until_ready((updates, state))
    del updates
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return times


def torch_python(arg: str | None) -> tuple[str | None, str]:
  """The Python to run torch and DeepSpeed with, or None and why not."""
  candidates = [arg] if arg else [sys.executable, str(TORCH_VENV)]
  for python in candidates:
    if not python or not os.path.exists(python):
      continue
    probe = subprocess.run(
      [python, "-c", "import torch, deepspeed"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode == 0:
      return python, ""
  return None, (
    f"no Python with torch and deepspeed ({', '.join(c for c in candidates if c)}); "
    "see this script's docstring to make benchmarks/.venv-torch"
  )


def torch_times(python: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
  cmd = [python, "-c", _TORCH_SCRIPT, str(n), str(LEAVES), str(args.steps), str(args.warmup)]
  cmd += [str(LR), str(os.cpu_count() or 1)]
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
  lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
  if run.returncode != 0 or not lines:
    return {"error": (run.stderr or run.stdout).strip().splitlines()[-1:]}
  return json.loads(lines[-1][len("RESULT ") :])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes-m", type=float, nargs="+", default=[16, 64, 256])
  parser.add_argument("--torch-python", help="a Python with torch and deepspeed")
  _common.add_steps_arguments(parser, 7, "untimed steps first (2)")
  _common.add_out_argument(parser, "host_adam")
  args = parser.parse_args(argv)
  _common.check_steps_arguments(parser, args)
  start = time.perf_counter()
  python, why = torch_python(args.torch_python)
  if python is None:
    print(f"DeepSpeedCPUAdam and torch fused Adam skipped: {why}", flush=True)
  result: dict[str, Any] = {
    "benchmark": "host_adam",
    **_common.environment(),
    "leaves": LEAVES,
    "steps": args.steps,
    "warmup": args.warmup,
    "goal_ratio_vs_deepspeed": 1.0,
    "torch_skipped": why or None,
    "sizes": {},
  }
  for size_m in args.sizes_m:
    n = max(LEAVES, int(size_m * 1e6) // LEAVES * LEAVES)
    row: dict[str, Any] = {"params": n, "variants": {}}
    for name in JAX_VARIANTS:
      row["variants"][name] = jax_times(name, n, args.steps, args.warmup)
      print(f"{size_m:g}M {name}: {n / min(row['variants'][name]) / 1e9:.2f} G params/s (best)")
    if python is not None:
      out = torch_times(python, n, args)
      for name in ("DeepSpeedCPUAdam", "torch fused Adam"):
        if name in out:
          row["variants"][name] = out[name]
          print(f"{size_m:g}M {name}: {n / min(out[name]) / 1e9:.2f} G params/s (best)")
        else:
          row.setdefault("errors", {})[name] = out.get(f"{name}_error", out.get("error"))
          print(f"{size_m:g}M {name}: skipped: {row['errors'][name]}")
      row["torch"] = {k: v for k, v in out.items() if k.endswith("version") or k == "threads"}
    row["params_per_s"] = {
      name: _common.stats_of([n / t for t in times]) for name, times in row["variants"].items()
    }
    ds = row["params_per_s"].get("DeepSpeedCPUAdam")
    row["ratio_vs_deepspeed"] = (
      {k: v["median"] / ds["median"] for k, v in row["params_per_s"].items()} if ds else None
    )
    result["sizes"][f"{size_m:g}M"] = row
  result["wall_s"] = time.perf_counter() - start
  _common.write_outputs(result, args.out, "host_adam", plot, summary_table)
  return result


def summary_table(result: dict[str, Any]) -> str:
  lines = [
    f"host_adam: one Adam step over {result['leaves']} fp32 leaves, median of {result['steps']}"
    f" steps after {result['warmup']} (min-max), {result['cpu_count']} CPUs",
    f"{'size':>6}  {'variant':<30}{'G params/s':>11}{'min':>7}{'max':>7}{'vs DeepSpeed':>14}",
  ]
  for size, row in result["sizes"].items():
    for name, s in row["params_per_s"].items():
      ratio = row["ratio_vs_deepspeed"]
      r = f"{ratio[name]:.2f}x" if ratio else "-"
      lines.append(
        f"{size:>6}  {name:<30}{s['median'] / 1e9:>11.2f}{s['min'] / 1e9:>7.2f}"
        f"{s['max'] / 1e9:>7.2f}{r:>14}"
      )
  if result["torch_skipped"]:
    lines.append(f"DeepSpeed/torch skipped: {result['torch_skipped']}")
  else:
    for name in ("offlax host compute, update only", "offlax host compute"):
      ratios = [
        row["ratio_vs_deepspeed"][name]
        for row in result["sizes"].values()
        if row["ratio_vs_deepspeed"] and name in row["ratio_vs_deepspeed"]
      ]
      verdict = "meets" if ratios and min(ratios) >= 1.0 else "BELOW"
      lines.append(
        f"{name} vs DeepSpeedCPUAdam, goal >= 1.0x: "
        f"{', '.join(f'{r:.2f}x' for r in ratios)} ({verdict} goal)"
      )
    lines.append(
      "(a full step writes the params, as DeepSpeed's does; 'update only' writes the update over "
      "the gradient, the host's share of a ZeRO-Offload step)"
    )
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  sizes = list(result["sizes"])
  names = list(dict.fromkeys(n for row in result["sizes"].values() for n in row["params_per_s"]))
  fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
  width = 0.8 / max(1, len(names))
  for i, name in enumerate(names):
    xs, meds, lo, hi = [], [], [], []
    for j, size in enumerate(sizes):
      s = result["sizes"][size]["params_per_s"].get(name)
      if s:
        xs.append(j + (i - (len(names) - 1) / 2) * width)
        meds.append(s["median"] / 1e9)
        lo.append((s["median"] - s["min"]) / 1e9)
        hi.append((s["max"] - s["median"]) / 1e9)
    ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=name)
  ax.set_xticks(range(len(sizes)), [f"{s} params" for s in sizes])
  ax.set_ylabel("Adam step throughput (G params/s, median; bars: min-max)")
  ax.set_title(f"Host-side Adam step, {result['cpu_count']} CPU cores ({result['date'][:10]})")
  fig.legend(loc="outside lower center", ncols=3)
  _common.save_png(fig, path)


if __name__ == "__main__":
  main()
