"""Params, gradients and optimizer state off the device: a Llama-shaped train step compiled for a GPU.

Compiles the whole step (forward, backward, AdamW with an fp32 master, apply)
with XLA's GPU compiler, on this machine, without a GPU (`offlax.compile_for_gpu`):
the bf16 params in ``pinned_host`` memory, their layers stacked and run by
`offlax.scan_layers` (rematerialised, saved layer inputs in host memory), the
gradients returned to host memory, and the optimizer step on the host CPU with
`offlax.update_and_apply` (the new params written over the old). Beside it,
the same model trained the plain way (params, gradients and state on the
device), which does not fit.

  python benchmarks/params_offload.py                 # 13B on 24 GB, 70B on 80 GB
  python benchmarks/params_offload.py --model 13b --target rtx4090

Writes ``benchmarks/results/params_offload.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import offlax
from offlax._src.llama import MODELS, compile_step


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(MODELS), action="append")
  ap.add_argument("--target", help="GPU target (default: rtx4090 for 13b, a100-80gb for 70b)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = ap.parse_args(argv)
  if not offlax.gpu_compile_available():
    print("needs XLA's GPU compiler: pip install 'offlax[gpu-compile]'", file=sys.stderr)
    return 2
  defaults = {"13b": "rtx4090", "70b": "a100-80gb"}
  rows = []
  for name in args.model or ["13b", "70b"]:
    m, target = MODELS[name], args.target or defaults[name]
    for offloaded in (True, False):
      t = time.perf_counter()
      c = compile_step(m, target, offloaded=offloaded)
      what = "offlax: params, grads, state off the device" if offloaded else "plain (all on device)"
      print(f"\n{name} ({m.n_params / 1e9:.1f}B params), {what}, {time.perf_counter() - t:.0f} s")
      print(c.table())
      rows.append({
        "model": name, "n_params": m.n_params, "target": c.target.name, "offloaded": offloaded,
        "device": c.device, "host": c.host, "device_peak": c.device_peak,
        "host_peak": c.host_peak, "fits": c.fits, "host_compute": list(c.host_compute),
      })  # fmt: skip
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "params_offload.json"), "w") as f:
    json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
