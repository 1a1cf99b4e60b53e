"""Device and host memory of an AdamW step as XLA's GPU compiler allocates it, no GPU needed.

Each variant's step (`offlax._src.gpu_compile.update_step`: gradients made inside the step and
kept whole, params and state donated) is compiled for a GPU target from shapes only
(`offlax.compile_for_gpu`), for transformer-shaped trees of 0.1B to 13B parameters:

- ``plain``: optax's AdamW with its state on the device;
- ``streamed``: `offlax.offload(adamw)`, the state in `pinned_host`, streamed through the device;
- ``host``: `offlax.offload(adamw, compute="host")`, the update on the host CPU;
- the same three with bf16 params and `offlax.master_weights` (fp32 master in the state);
- each offlax mode twice: applied by `optax.apply_updates`, and fused with its update by
  `offlax.update_and_apply` (``fused``: each slice writes its new params in place).

The bound checked: device bytes <= params + gradients + 4 slices (`chunk_bytes` of state each;
with `master_weights` applied by optax + its fp32 updates, written whole for a leaf streamed in
pieces; fused, no updates are kept),
with no instruction XLA had to convert into host compute; host temporaries <= 4 slices for host
compute (the state updated in place). Offloaded variants are compiled for a device just big
enough for the bound (XLA's scheduler otherwise spends free memory on early transfers); plain
optax for the whole target. Writes `gpu_memory.json` and `gpu_memory.png`.

    python benchmarks/gpu_memory.py                       # 0.1B, 1B, 7B, 13B (a few minutes)
    python benchmarks/gpu_memory.py --sizes-b 0.1 1       # quicker
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

SLICES = 4  # the bound: params + gradients + this many slices
MODES = ("plain", "streamed", "host")


def planned(params, mode: str, master: bool, chunk_bytes: int, fused: bool) -> int | None:
  """The planner's device bytes for `mode` (``streamed`` or ``host``), on a device sized for it.

  `offlax.plan` returns the first mode that fits, so it is given a device just
  big enough for that mode (state off the device): its figure is then the one
  to compare with the compiled step's. None where the planner would not offload.
  """
  import optax

  import offlax
  from offlax._src import planner

  tx = offlax.master_weights(optax.adamw(1e-3)) if master else optax.adamw(1e-3)
  planned_mode = {"streamed": "host", "host": "host_compute"}[mode]
  need = planner.mode_bytes(params, tx, planned_mode, chunk_bytes=chunk_bytes, fused=fused)
  device = int((need + 1024) / (1 - planner.DEVICE_RESERVE)) + 1  # (1 KiB for rounding)
  p = offlax.plan(params, tx, device_bytes=device, host_bytes=10**15, chunk_bytes=chunk_bytes,
                  fused=fused)  # fmt: skip
  if p.mode != planned_mode:
    return None  # a model so small that its slices outweigh its state: no offload planned
  return p.bytes["device"]


def measure(
  n_params: float, mode: str, master: bool, target: str, chunk_bytes: int, layers: int,
  fused: bool = False,
):  # fmt: skip
  import jax

  from offlax._src import gpu_compile

  params = gpu_compile.transformer_params(
    n_params, layers=layers, dtype="bfloat16" if master else "float32"
  )
  n = sum(x.size for x in jax.tree.leaves(params))
  param_bytes = n * (2 if master else 4)
  # Params + gradients + 4 slices; with master_weights + its fp32 updates, which a
  # leaf streamed in pieces has written whole before `optax.apply_updates`.
  updates = 4 * n if master and not fused else 0
  bound = 2 * param_bytes + updates + SLICES * chunk_bytes
  # XLA's scheduler uses free device memory to run transfers early; compiled for
  # a device just big enough (it aims at 80% of the memory), it shows what the
  # step needs. Plain optax is compiled for the whole target.
  memory = None if mode == "plain" else int(bound / 0.8)
  start = time.perf_counter()
  m = gpu_compile.compile_adamw_step(
    n_params, mode=mode, master=master, chunk_bytes=chunk_bytes, layers=layers,
    target=target, device_memory_size=memory, fused=fused,
  )  # fmt: skip
  result = {
    "params": n,
    "mode": mode,
    "master": master,
    "fused": fused,
    "compile_s": time.perf_counter() - start,
    "device": m.device,
    "host": m.host,
    "device_peak": m.device_peak,
    "host_peak": m.host_peak,
    "device_per_param": m.device_peak / n,
    "host_per_param": m.host_peak / n,
    "copies_in_flight": m.copies_in_flight,
    "host_compute": list(m.host_compute),
    "bound": bound,
    "device_memory_size": m.target.device_memory_size,
    # Slices-worth of bytes beyond params, gradients (and fp32 updates).
    "slices_used": (m.device_peak - bound) / chunk_bytes + SLICES,
    "within_bound": None if mode == "plain" else m.device_peak <= bound,
    # The planner's figure for this mode, and how far the compiled peak is from it.
    "planned": None if mode == "plain" else planned(params, mode, master, chunk_bytes, fused),
    "host_temp_ok": None if mode != "host" else m.host["temp"] <= SLICES * chunk_bytes,
  }
  if result["planned"] is not None:
    result["plan_error"] = result["planned"] / m.device_peak - 1
  return result


def plot(result: dict[str, Any], path) -> None:
  plt = _common.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  for ax, master in zip(axes, (False, True), strict=True):
    for mode, style in zip(MODES, ("o-", "s-", "^-"), strict=True):
      for fused in (False, True):
        rows = [r for r in result["runs"]
                if r["mode"] == mode and r["master"] == master and r["fused"] == fused]  # fmt: skip
        if rows:
          ax.plot([r["params"] / 1e9 for r in rows], [r["device_per_param"] for r in rows],
                  style if not fused else style[0] + "--",
                  label=mode + (", update_and_apply" if fused else ""))  # fmt: skip
    rows = [r for r in result["runs"]
            if r["mode"] == "streamed" and r["master"] == master and not r["fused"]]  # fmt: skip
    if rows:
      what = "params + grads + fp32 updates" if master else "params + grads"
      ax.plot([r["params"] / 1e9 for r in rows], [r["bound"] / r["params"] for r in rows], "k:",
              label=f"{what} + {SLICES} slices")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("parameters (billions)")
    ax.set_title("bf16 params + fp32 master" if master else "fp32 params")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("device bytes per parameter (compiled peak)")
  axes[0].legend(fontsize=8)
  _common.save_png(fig, path, f"AdamW step, XLA:GPU buffer assignment ({result['target']})")


def summary_table(result: dict[str, Any]) -> str:
  head = [("params", 8), ("master", 6), ("mode", 9), ("fused", 5), ("device B/p", 10)]
  head += [("host B/p", 9), ("bound B/p", 9), ("ok", 4), ("slices", 6), ("converted", 9)]
  head += [("plan B/p", 8), ("plan err", 8)]
  lines = [" ".join(f"{name:>{width}}" for name, width in head)]
  for r in result["runs"]:
    ok = {None: "-", True: "yes", False: "NO"}[r["within_bound"]]
    lines.append(
      f"{r['params'] / 1e9:>7.2f}B {str(r['master']):>6} {r['mode']:>9} {str(r['fused']):>5} "
      f"{r['device_per_param']:>10.2f} {r['host_per_param']:>9.2f} "
      f"{r['bound'] / r['params']:>9.2f} {ok:>4} {r['slices_used']:>6.1f} "
      f"{len(r['host_compute']):>9} "
      + (
        f"{r['planned'] / r['params']:>8.2f} {r['plan_error']:>+8.1%}"
        if r["planned"] is not None
        else f"{'-':>8} {'-':>8}"
      )
    )
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes-b", type=float, nargs="+", default=[0.1, 1, 7, 13])
  parser.add_argument("--target", default="h100", help="a GPU target of offlax.compile_for_gpu")
  parser.add_argument("--chunk-mib", type=int, default=64, help="HostTier.chunk_bytes (64 MiB)")
  parser.add_argument("--layers", type=int, default=16)
  _common.add_out_argument(parser, "gpu_memory")
  args = parser.parse_args(argv)
  import offlax

  if not offlax.extend.gpu_compile_available():
    raise SystemExit("XLA's GPU compiler is not installed: pip install -e '.[gpu-compile]'")
  start = time.perf_counter()
  runs = []
  for size in args.sizes_b:
    for master in (False, True):
      for mode, fused in [(m, f) for m in MODES for f in (False, True) if m != "plain" or not f]:
        r = measure(
          size * 1e9, mode, master, args.target, args.chunk_mib * 2**20, args.layers, fused
        )
        runs.append(r)
        what = f"{mode}{' update_and_apply' if fused else ''}"
        print(f"{size:g}B master={master} {what}: {r['device_per_param']:.2f} B/param on the "
              f"device, {r['host_per_param']:.2f} on the host ({r['compile_s']:.0f} s)",
              flush=True)  # fmt: skip
  result = {
    **_common.environment(),
    "target": args.target,
    "chunk_bytes": args.chunk_mib * 2**20,
    "slices_in_bound": SLICES,
    "runs": runs,
    "wall_s": time.perf_counter() - start,
  }
  _common.write_outputs(result, args.out, "gpu_memory", plot, summary_table)
  return result


if __name__ == "__main__":
  main()
