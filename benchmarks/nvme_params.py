"""Params, gradients and optimizer state on disk (`offlax.LayerStore`): RAM flat as the model grows.

What is measured, in one run and on one filesystem (a fresh directory under `--dir`, default
/tmp, removed at the end; its free space is checked first):

1. The raw disk: sequential direct-I/O write and read of `--raw-gib` GiB, and both at once
   (`_disk.measure_raw`, as `nvme_throughput.py`).
2. For each size (`--sizes`, default 0.5B and 1.8B params), in a fresh subprocess: a stack of
   Llama-like layers (four d x d matrices and a d x f, f x d MLP, d = 2048, ~28M params a
   layer) in bf16, AdamW with an fp32 master (`offlax.master_weights(offlax.adamw(...))`,
   the native kernel on the CPU), `keep=1`. The store is written a layer at a time
   (`init_layer`). Then `--steps` steps: the loss's gradients through `offlax.scan_layers`
   over `store.source()` (each layer read from disk, read again in the backward pass, its
   gradient written back), then `store.update()` (params, gradients and state read a layer
   at a time, AdamW on the CPU, params and state written and committed). Peak RSS of the
   whole subprocess (VmHWM), against the 8 GB goal and against the model's training state
   (params + gradients + master + moments: 16 bytes a parameter). Each size runs twice, side
   by side (`--modes`): ``explicit`` as above, and ``backward``
   (`LayerStore.create(..., update="backward")`: each layer updated by a host worker as its
   gradient reaches the host in the backward pass, no gradient on disk; `store.update()`
   waits for the last layer and commits). Per step: the step's time (forward, backward,
   update, commit), and the bytes a parameter it moved, from the store's counters
   (`bytes_read`, `bytes_written`).
3. The update's I/O against the raw disk: its bytes read and written over its wall time, and
   the ratio of the time the raw disk needs for the same traffic (`_disk.raw_seconds`) to
   the update's time (goal >= 0.8x). The forward/backward pass's traffic and time too.
4. The speed goals of the update in the backward pass (issue 44): its step against the
   explicit mode's (goal <= 0.7x), and against the larger of the same forward+backward pass
   with the layers in host memory (``pinned_host``, `offlax.to_host`; measured in its own
   subprocess, `--no-ram-baseline` leaves it out) and the step's bytes at the raw disk's
   speed (goal <= 1.15x). With no GPU the pass and the update share the CPU cores: the
   overlap these goals count on needs the pass on a device (`gpu_check.py`'s
   `layer_store_speed` runs this script there).
5. `python -m offlax inspect` of the store after the steps (exit status and summary line).
6. Compiled for a GPU (`--compile`, default a100-80gb): Llama-70B (`llama.MODELS["70b"]`), bf16
   params, AdamW with an fp32 master, 1 x 2048 tokens, its layers in a sparse `LayerStore` (the
   embedding, head and norm in host memory, host compute), beside the params-in-host-memory
   step of the same model: the device peak (goal: within that mode's 16 GB) and the program's
   host buffers; with the planner's RAM figure for the store's pool and update
   (`planner.params_on_disk_bytes`), the RAM in all (goal <= 64 GB).

  python benchmarks/nvme_params.py [--sizes 0.5 1.8] [--steps 3] [--dir /tmp]
                                   [--modes explicit backward] [--no-ram-baseline]
                                   [--state-bits 8]

`--state-bits 8`: the store's AdamW keeps 8-bit moments (`offlax.adamw(..., state_bits=8)`):
about 12 bytes a parameter fewer a step (docs/nvme_tier.md, "8-bit optimizer state").

Results: `<out>/nvme_params.json` and `<out>/nvme_params.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import _common, _disk  # noqa: E402

D, F, TOKENS = 2048, 2816, 8
LAYER_PARAMS = 4 * D * D + 2 * D * F
RSS_GOAL = 8e9
RATIO_GOAL = 0.8


def layer_like(n: int, d: int, f: int):
  import jax
  import jax.numpy as jnp

  s = lambda *shape: jax.ShapeDtypeStruct((n, *shape), jnp.bfloat16)
  return {"q": s(d, d), "k": s(d, d), "v": s(d, d), "o": s(d, d), "up": s(d, f), "down": s(f, d)}


def init_layer(i: int, d: int, f: int):
  import numpy as np
  from ml_dtypes import bfloat16

  rng = np.random.default_rng(i)
  m = lambda a, b: (rng.standard_normal((a, b), np.float32) / np.sqrt(a)).astype(bfloat16)
  return {"q": m(d, d), "k": m(d, d), "v": m(d, d), "o": m(d, d), "up": m(d, f), "down": m(f, d)}


def block(h, p):
  import jax
  import jax.numpy as jnp

  a = jnp.tanh(h @ p["q"]) * (h @ p["k"])
  h = h + ((a * (h @ p["v"])) @ p["o"]) * 0.1
  return h + (jax.nn.gelu(h @ p["up"]) @ p["down"]) * 0.1, None


def grads_fn():
  """The jitted loss and gradients of the layers (a `store.source()` or the stacked arrays)."""
  import jax
  import jax.numpy as jnp

  import offlax

  @jax.jit
  def grads(layers, x):
    loss = lambda s, x: jnp.mean(offlax.scan_layers(block, x, s)[0].astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss)(layers, x)

  return grads


def ram_child(n_layers: int, steps: int, d: int, f: int) -> dict[str, Any]:
  """The baseline: the same forward+backward pass with the layers in host memory."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import offlax

  layers = [init_layer(i, d, f) for i in range(n_layers)]
  stacked = offlax.to_host(jax.device_put(jax.tree.map(lambda *ls: np.stack(ls), *layers)))
  del layers
  grads, x = grads_fn(), jax.random.normal(jax.random.key(0), (TOKENS, d)).astype(jnp.bfloat16)
  rows = []
  for _ in range(steps):
    start = time.perf_counter()
    loss, g = jax.block_until_ready(grads(stacked, x))
    rows.append({"loss": float(loss), "forward_backward_s": time.perf_counter() - start})
    del g
  return {"steps": rows, "peak_rss_bytes": _common.peak_rss()}


def child(path: str, n_layers: int, steps: int, d: int, f: int, mode: str,
          bits: int = 32) -> dict[str, Any]:  # fmt: skip
  """One size in one mode: create, `steps` steps, RSS and I/O figures (JSON on stdout)."""
  import jax
  import jax.numpy as jnp

  import offlax

  if mode == "ram":
    return ram_child(n_layers, steps, d, f)
  tx = offlax.master_weights(offlax.adamw(1e-4, weight_decay=0.01, state_bits=bits))
  start = time.perf_counter()
  store = offlax.LayerStore.create(
    path, layer_like(n_layers, d, f), optimizer=tx, keep=1, progress=False,
    init_layer=lambda i: init_layer(i, d, f), update=mode,
  )  # fmt: skip
  create_s = time.perf_counter() - start

  grads = grads_fn()
  x = jax.random.normal(jax.random.key(0), (TOKENS, d)).astype(jnp.bfloat16)
  rows = []
  for step in range(steps):
    moved = store.bytes_read, store.bytes_written
    start = time.perf_counter()
    loss, _ = grads(store.source(), x)
    store.flush_grads()  # the backward pass's hand-offs (explicit: the gradient writes) done
    backward_s = time.perf_counter() - start
    store.update()  # backward: waits for the worker's last layers, commits
    step_s = time.perf_counter() - start
    u = store.last_update
    read, written = store.bytes_read - moved[0], store.bytes_written - moved[1]
    rows.append({"loss": float(loss), "forward_backward_s": backward_s, "step_s": step_s,
                 "after_backward_s": step_s - backward_s, "step_bytes_read": read,
                 "step_bytes_written": written, **u._asdict()})  # fmt: skip
    print(f"{mode} step {step + 1}: loss {float(loss):.5f}, forward+backward {backward_s:.1f} s, "
          f"step {step_s:.1f} s, {(read + written) / (n_layers * (4 * d * d + 2 * d * f)):.1f} "
          "bytes a "
          "param", file=sys.stderr, flush=True)  # fmt: skip
  store.close()
  return {"create_s": create_s, "steps": rows, "peak_rss_bytes": _common.peak_rss()}


def run_size(workdir: pathlib.Path, billions: float, steps: int, d: int, f: int,
             modes: list[str], ram: bool = True, bits: int = 32) -> dict[str, Any]:  # fmt: skip
  """One size in each of `modes`, one fresh subprocess each; the first mode's figures on top.
  With `ram`, the baseline too (`ram_child`), under ``"ram"``. `bits`: Adam's moments'
  ``state_bits`` in the store (the baseline's stay 32)."""
  n_layers = max(2, round(billions * 1e9 / (4 * d * d + 2 * d * f)))
  n_params = n_layers * (4 * d * d + 2 * d * f)
  baseline = {}
  if ram:
    cmd = [sys.executable, __file__, "--child", "-", str(n_layers), str(steps), str(d), str(f),
           "ram", "32"]  # fmt: skip
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    baseline["ram"] = json.loads(done.stdout.splitlines()[-1])
  runs = {}
  for mode in modes:
    path = workdir / f"store-{billions:g}b-{mode}"
    cmd = [sys.executable, __file__, "--child", str(path), str(n_layers), str(steps), str(d),
           str(f), mode, str(bits)]  # fmt: skip
    print(f"{n_params / 1e9:.2f}B params ({n_layers} layers): {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    out = json.loads(done.stdout.splitlines()[-1])
    out["disk_bytes"] = _disk.tree_bytes(path)
    inspect = subprocess.run([sys.executable, "-m", "offlax", "inspect", str(path)],
                             capture_output=True, text=True)  # fmt: skip
    out["inspect"] = {"returncode": inspect.returncode, "output": inspect.stdout[-2000:]}
    for row in out["steps"]:
      row["bytes_per_param"] = (row["step_bytes_read"] + row["step_bytes_written"]) / n_params
    shutil.rmtree(path)
    runs[mode] = out
  return {
    "n_params": n_params, "n_layers": n_layers,
    # bf16 params + grads, fp32 master + two moments (8-bit: a byte and a 256th of a scale each)
    "train_state_bytes": int((16 if bits == 32 else 10 + 2 * 4 / 256) * n_params),
    "state_bits": bits,
    **runs[modes[0]], "modes": runs, **baseline,
  }  # fmt: skip


def compiled(target: str, workdir: pathlib.Path) -> dict[str, Any]:
  """Llama-70B's step with its layers on disk, and in host memory, compiled for `target`."""
  from offlax._src import llama, planner

  m = llama.MODELS["70b"]
  out: dict[str, Any] = {"model": str(m), "n_params": m.n_params, "target": target}
  for mode, kw in (("layers_on_disk", {"layer_store": str(workdir / "sparse")}),
                   ("params_host", {})):  # fmt: skip
    start = time.perf_counter()
    c = llama.compile_step(m, target, **kw)
    out[mode] = {
      "device_peak": c.device_peak, "host_peak": c.host_peak, "host": c.host,
      "host_compute": list(c.host_compute), "compile_s": time.perf_counter() - start,
    }  # fmt: skip
  layer_params = m.layers * m.layer_params
  rest = m.n_params - layer_params
  bytes_ = planner.params_on_disk_bytes(2 * layer_params, 12 * layer_params, layer_params, m.layers)
  out["store_ram_bytes"] = bytes_["ram"]  # the read pool and the update's leaves in flight
  out["ram_bytes"] = out["layers_on_disk"]["host_peak"] + bytes_["ram"]
  out["rest_params"] = rest
  return out


def io_figures(size: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
  """The update's GB/s and its ratio to the raw disk, per step (the first is warm-up too).

  Of the explicit mode's `update()` wherever it ran, whatever the order of ``--modes``: the
  backward mode's update runs during the backward pass, its time is not the update's I/O.
  """
  modes = size.get("modes", {})
  mode = "explicit" if "explicit" in modes else next(iter(modes), None)
  out = []
  for s in modes[mode]["steps"] if mode else size["steps"]:
    moved = s["bytes_read"] + s["bytes_written"]
    raw_s = _disk.raw_seconds(raw, s["bytes_read"], s["bytes_written"])
    out.append({"bytes_per_s": moved / s["seconds"], "ratio_vs_raw": raw_s / s["seconds"]})
  return {"mode": mode, "per_step": out, "best_ratio": max(o["ratio_vs_raw"] for o in out),
          "median_ratio": sorted(o["ratio_vs_raw"] for o in out)[len(out) // 2]}  # fmt: skip


def speed_goals(size: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
  """The backward mode's median step against the explicit one's (goal <= 0.7x) and against
  the larger of the params-in-RAM forward+backward pass and its bytes at raw disk speed
  (goal <= 1.15x); what of them the run measured."""
  modes, out = size["modes"], {}
  if "backward" not in modes:
    return out
  b = median_step(modes["backward"])
  out["disk_s"] = _disk.raw_seconds(raw, b["step_bytes_read"], b["step_bytes_written"])
  if "explicit" in modes:
    out["vs_explicit"] = b["step_s"] / median_step(modes["explicit"])["step_s"]
  if "ram" in size:
    times = sorted(r["forward_backward_s"] for r in size["ram"]["steps"][1:] or
                   size["ram"]["steps"])  # fmt: skip
    out["ram_forward_backward_s"] = times[len(times) // 2]
    out["vs_bound"] = b["step_s"] / max(out["ram_forward_backward_s"], out["disk_s"])
  return out


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
  sizes = result["sizes"]
  names = [f"{s['n_params'] / 1e9:.1f}B" for s in sizes]
  xs = range(len(sizes))
  a.bar([x - 0.2 for x in xs], [s["train_state_bytes"] / 1e9 for s in sizes], 0.4,
        label="training state (16 B/param)")  # fmt: skip
  a.bar([x + 0.2 for x in xs], [s["peak_rss_bytes"] / 1e9 for s in sizes], 0.4, label="peak RSS")
  a.axhline(RSS_GOAL / 1e9, color="red", ls="--", label="goal: RSS <= 8 GB")
  a.axhline(24 * 2**30 / 1e9, color="gray", ls=":", label="this machine's RAM")
  a.set_xticks(list(xs), names)
  a.set_ylabel("GB")
  a.set_title("RAM: params, grads and state on disk")
  a.legend(fontsize=8)
  ratios = [s["io"]["median_ratio"] for s in sizes]
  b.bar(names, ratios, color="tab:green")
  b.axhline(RATIO_GOAL, color="red", ls="--", label="goal >= 0.8x")
  b.set_ylabel("update I/O time at raw speed / update time")
  b.set_title("update() against the raw disk (median step)")
  b.legend(fontsize=8)
  modes = list(sizes[0]["modes"])
  width = 0.8 / len(modes)
  for m, mode in enumerate(modes):
    times = [median_step(s["modes"][mode])["step_s"] for s in sizes]
    c.bar([x + (m - (len(modes) - 1) / 2) * width for x in xs], times, width, label=mode)
    for x, s in zip(xs, sizes, strict=True):
      bpp = median_step(s["modes"][mode])["bytes_per_param"]
      c.text(x + (m - (len(modes) - 1) / 2) * width, 0, f"{bpp:.0f} B/p", ha="center",
             va="bottom", fontsize=7)  # fmt: skip
  c.set_xticks(list(xs), names)
  c.set_ylabel("s per step (forward, backward, update, commit)")
  c.set_title("a step by update mode (median; bytes a param)")
  c.legend(fontsize=8)
  _common.save_png(fig, path, suptitle=f"offlax.LayerStore, {result['environment_line']}")


def median_step(run: dict[str, Any]) -> dict[str, Any]:
  """The step of median time among a run's steps past the first (compiles), else the first."""
  steps = sorted(run["steps"][1:] or run["steps"], key=lambda row: row["step_s"])
  return steps[len(steps) // 2]


def summary_table(result: dict[str, Any]) -> str:
  raw = result["raw"]
  lines = [f"raw disk: write {raw['write_bytes_per_s'] / 1e9:.2f} GB/s, read "
           f"{raw['read_bytes_per_s'] / 1e9:.2f} GB/s, both at once "
           f"{raw.get('mixed_bytes_per_s', 0) / 1e9:.2f} GB/s"]  # fmt: skip
  for s in result["sizes"]:
    last = s["steps"][-1]
    lines.append(
      f"{s['n_params'] / 1e9:.2f}B ({s['n_layers']} layers): peak RSS "
      f"{s['peak_rss_bytes'] / 1e9:.2f} GB (goal <= 8; state {s['train_state_bytes'] / 1e9:.1f} "
      f"GB), disk {s['disk_bytes'] / 1e9:.1f} GB; update {last['seconds']:.1f} s moving "
      f"{(last['bytes_read'] + last['bytes_written']) / 1e9:.1f} GB, ratio vs raw "
      f"{s['io']['median_ratio']:.2f}x (goal >= 0.8); forward+backward "
      f"{last['forward_backward_s']:.1f} s; inspect exit {s['inspect']['returncode']}"
    )
    for mode, run in s["modes"].items():
      m = median_step(run)
      lines.append(
        f"  update={mode!r}: step {m['step_s']:.2f} s (forward+backward "
        f"{m['forward_backward_s']:.2f} s, then {m['after_backward_s']:.2f} s to the commit), "
        f"{m['bytes_per_param']:.1f} bytes "
        f"a param a step (read {m['step_bytes_read'] / 1e9:.2f} GB, written "
        f"{m['step_bytes_written'] / 1e9:.2f} GB), peak RSS {run['peak_rss_bytes'] / 1e9:.2f} GB"
      )
    g = s.get("speed", {})
    if "vs_explicit" in g:
      lines.append(f"  backward / explicit step time: {g['vs_explicit']:.2f}x (goal <= 0.7)")
    if "vs_bound" in g:
      lines.append(
        f"  backward step / max(forward+backward with the params in RAM "
        f"{g['ram_forward_backward_s']:.2f} s, its bytes at raw disk speed {g['disk_s']:.2f} s)"
        f": {g['vs_bound']:.2f}x (goal <= 1.15)"
      )
  c = result.get("compiled")
  if c:
    d, h = c["layers_on_disk"], c["params_host"]
    lines.append(
      f"70B compiled for {c['target']}: layers on disk: device peak {d['device_peak'] / 1e9:.2f} "
      f"GB (params in host memory: {h['device_peak'] / 1e9:.2f}; goal 16), program's host "
      f"buffers {d['host_peak'] / 1e9:.1f} GB + the store's pool and update "
      f"{c['store_ram_bytes'] / 1e9:.1f} GB = RAM {c['ram_bytes'] / 1e9:.1f} GB (goal <= 64; "
      f"params in host memory: {h['host_peak'] / 1e9:.0f} GB)"
    )
  return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1.8], help="billions")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--width", type=int, default=D, help="d (f = 1.375 d)")
  parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
  parser.add_argument("--state-bits", type=int, default=32, choices=[32, 8],
                      help="Adam's moments in the store: 32 bits or 8")  # fmt: skip
  modes = ["explicit", "backward"]
  parser.add_argument("--modes", nargs="+", default=modes, choices=modes, help="update= modes")
  parser.add_argument("--compile", default="a100-80gb", help="GPU target, or 'none' (a100-80gb)")
  parser.add_argument("--no-ram-baseline", dest="ram", action="store_false",
                      help="leave out the pass with the params in RAM")  # fmt: skip
  _disk.add_raw_arguments(parser, raw_gib=4.0)
  _common.add_dir_argument(parser, "the stores and the raw-disk file")
  _common.add_out_argument(parser, "nvme_params")
  args = parser.parse_args(argv)
  if args.child:
    path, n, steps, d, f, mode, bits = args.child
    print(json.dumps(child(path, int(n), int(steps), int(d), int(f), mode, int(bits))))
    return {}
  d, f = args.width, int(args.width * 1.375) // 64 * 64
  need = max(args.sizes) * 1e9 * (2 * 14 + 2) * 1.05 + args.raw_gib * 2**30 * 2
  free = shutil.disk_usage(args.dir).free
  print(f"{args.dir}: {free / 1e9:.1f} GB free, the run needs {need / 1e9:.1f} GB", flush=True)
  if free < need:
    raise SystemExit(
      f"not enough disk in {args.dir}: {free / 1e9:.1f} GB free, need {need / 1e9:.1f}"
    )
  start = time.perf_counter()
  env = _common.environment()
  result: dict[str, Any] = {"benchmark": "nvme_params", **env, "sizes": []}
  result["environment_line"] = f"{env.get('cpu_count', '?')} CPUs"
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="offlax-nvme-params-", dir=args.dir))
  try:
    if args.compile != "none":
      result["compiled"] = compiled(args.compile, workdir)
    result["raw"] = _disk.combine_raw([_disk.raw_pass(workdir, args, "before")])
    for b in args.sizes:
      size = run_size(workdir, b, args.steps, d, f, args.modes, args.ram, args.state_bits)
      size["io"] = io_figures(size, result["raw"])
      size["speed"] = speed_goals(size, result["raw"])
      result["sizes"].append(size)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  result["wall_s"] = time.perf_counter() - start
  _common.write_outputs(result, args.out, "nvme_params", plot, summary_table)
  return result


if __name__ == "__main__":
  main()
