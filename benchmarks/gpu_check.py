"""GPU check of the host tier: correctness, device bytes, step time, bandwidth, overlap.

What the CPU cannot show, checked in one run of a few minutes on a GPU machine:

1. correctness: `offlax.offload(optax.adamw)` streamed in small slices (leaves cut into rows and
   rejoined on the host), in one slice, and with `HostTier(compute="host")` (the update under
   `compute_on("device_host")`), and with the NVMe tier (its callbacks move the slices
   between the GPU and the disk), against plain optax on the same GPU, over 3 steps; 8-bit
   state streamed and in host compute against the same 8-bit optimizer on the device; and
   `optax.MultiSteps` around host compute (fp32 and 8-bit) through `update_and_apply`;
2. device memory: `compiled.memory_analysis()` of a jitted AdamW step on ~1B parameters
   (compiled from shapes, nothing allocated), all state on the device vs the host tier vs
   host compute:
   device and host bytes, and device bytes per parameter;
3. step time at a size that fits both ways (median of `--steps` after warm-up, synchronised):
   state on the device vs streamed from `pinned_host` vs host compute, and the overhead ratio
   (goal <= 1.15x for the stream);
4. host<->device bandwidth of one large transfer each way;
5. overlap: the share of the state traffic hidden behind compute,
   1 - (t_stream - t_device) / (state bytes moved / bandwidth);
6. whether offlax's native Adam kernel (an XLA:CPU FFI call) can run inside a
   GPU program's host computation, and how fast (an experiment: its error is
   recorded, not raised);
7. the Flax examples (NNX LM with each tier, Linen) for a few steps;
8. the device's peak bytes in a real step of each offloaded mode beside what
   `offlax.compile_for_gpu` predicts for it without a GPU;
9. params, gradients and state in host memory (`offlax.scan_layers`, host compute,
   `offlax.update_and_apply`) on a Llama-shaped model: the params after 3 steps against the
   same model trained on the device, the device peak against the compiled prediction, and
   the step time of both;
10. a whole Llama train step with the state on the device, streamed and in host compute
   (what the transfers can hide behind), and host compute's step in parts, with each of the
   native kernel's thread pools;
11. the native host step on the CPU backend, all cores and one;
12. `offlax.checkpoint.HostStateSave` / `HostStateRestore` of the host tier's state (its
   `pinned_host` arrays copied out as their files are written): exact, memory kinds kept, GB/s
   against the raw disk measured just before;
13. `offlax.LayerStore`: layers' params, gradients and state on disk, the forward and
   backward pass on the GPU, the update on the CPU, against the same layers in device memory;
14. a Hugging Face Qwen3 checkpoint (256 MB of bf16) loaded into `pinned_host` params by
   `offlax.load_safetensors`: the device's peak grows by at most 16 MiB (no tensor passes
   through device memory; loaded onto the device instead, it grows by the params), and
   `offlax.save_safetensors` gives every tensor back byte for byte;
15. `offlax.LayerStore` at speed: `nvme_params.py` with its passes on the GPU (a ~1B stack of
   Llama-like layers, both update modes): the backward mode's step against the explicit one's,
   the same pass with the layers in host memory, and the step's bytes at raw disk speed;
16. the host step with fp32 against 8-bit Adam state (`state_bits.py` on the CPU backend, 64M
   and 256M params, all cores, about 2 minutes): where a host has more cores per memory
   channel than the CI machine, the fp32 kernel may be bound by memory first.

The sections are in _gpu_correctness.py (1, 7, 12, 13, 14), _gpu_peaks.py (2, 8, 9) and
_gpu_speed.py (3, 4, 6, 10, 11, 15, 16), what they share in _gpu.py; this script runs them,
works out 5 from 3 and 4, and draws the plot and the table.
Each section's result (or error) is written to `<out>/gpu_check.json` as it ends, with a plot
(`gpu_check.png`) and a short table last. `--only` picks sections, `--budget-s` skips those
not started in time (a lent GPU's minutes). On a CPU it runs too (at `--size-scale 0.001` in
the test suite) but its figures mean nothing there.

    python benchmarks/gpu_check.py                   # on the GPU machine, about 8 minutes
    python benchmarks/gpu_check.py --only time train_step_overlap --budget-s 300
    python benchmarks/gpu_check.py --only state_bits_host    # the host kernels alone, ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import _common, _gpu, _gpu_correctness, _gpu_peaks, _gpu_speed  # noqa: E402

SECTIONS = (
  "correctness",
  "native_in_host_compute",
  "memory",
  "measured_vs_compiled",
  "time",
  "train_step_overlap",
  "bandwidth_bytes_per_s",
  "host_compute_parts",
  "params_on_host",
  "examples",
  "host_step_params_per_s",
  "host_state_checkpoint",
  "layer_store",
  "layer_store_nnx",
  "pretrained_checkpoint",
  "layer_store_speed",
  "state_bits_host",
)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size-scale", type=float, default=1.0)
  _common.add_steps_arguments(parser, steps=20, warmup_help="untimed steps after compiling (2)")
  parser.add_argument(
    "--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="the sections to run (all)"
  )
  parser.add_argument(
    "--budget-s",
    type=float,
    default=None,
    help="seconds for the whole run: sections not started by then are skipped (none)",
  )
  _common.add_out_argument(parser, "gpu_check")
  args = parser.parse_args(argv)

  import jax
  import optax

  import offlax

  start = time.perf_counter()
  scale = args.size_scale
  result = {"benchmark": "gpu_check", **_common.environment(devices=True), "size_scale": scale}
  result["memories"] = [m.kind for m in jax.devices()[0].addressable_memories()]
  result["section_s"] = {}
  sections = {
    "correctness": lambda: _gpu_correctness.check_correctness(offlax, optax, jax, np),
    "native_in_host_compute": lambda: _gpu_speed.native_in_host_compute(
      jax, np, sizes=(1 << 20, max(1 << 16, int((1 << 26) * scale)))
    ),
    "memory": lambda: _gpu_peaks.memory_analysis(offlax, optax, jax, 1e9 * scale),
    "measured_vs_compiled": lambda: _gpu_peaks.measured_vs_compiled(
      offlax, optax, jax, 1e9 * scale
    ),
    "time": lambda: _gpu_speed.step_times(
      offlax, optax, jax, 2.5e8 * scale, args.steps, args.warmup
    ),
    "bandwidth_bytes_per_s": lambda: _gpu_speed.bandwidth(jax, int(2**30 * scale) // 4 * 4 or 4096),
    "train_step_overlap": lambda: _gpu_speed.train_step_overlap(
      offlax, optax, jax, scale, min(args.steps, 5)
    ),
    "host_compute_parts": lambda: _gpu_speed.host_compute_parts(
      offlax, optax, jax, 2.5e8 * scale, min(args.steps, 5)
    ),
    "params_on_host": lambda: _gpu_peaks.params_on_host(
      offlax, optax, jax, scale, min(args.steps, 5)
    ),
    "examples": lambda: _gpu_correctness.examples(max(3, int(20 * min(1.0, scale * 100)))),
    "host_step_params_per_s": lambda: _gpu_speed.host_step_threads(scale),
    "host_state_checkpoint": lambda: _gpu_correctness.host_state_checkpoint(
      offlax, optax, jax, 2.5e8 * scale
    ),
    "layer_store": lambda: _gpu_correctness.layer_store(offlax, optax, jax),
    "layer_store_nnx": lambda: _gpu_correctness.layer_store_nnx(offlax, optax, jax),
    "pretrained_checkpoint": lambda: _gpu_correctness.pretrained_checkpoint(
      offlax, optax, jax, scale
    ),
    "layer_store_speed": lambda: _gpu_speed.layer_store_speed(scale),
    "state_bits_host": lambda: _gpu_speed.state_bits_host(scale),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  # One section at a time, the JSON rewritten after each: a run stopped at a time limit (a lent
  # GPU's minutes) keeps what it measured, and one section's error is recorded, not fatal.
  for name in (s for s in SECTIONS if s in args.only):
    elapsed = time.perf_counter() - start
    if args.budget_s is not None and elapsed > args.budget_s:
      result[name] = {"error": f"skipped: {elapsed:.0f} s of the {args.budget_s:g} s budget spent"}
      continue
    print(f"[gpu_check {elapsed:6.1f} s] {name}", flush=True)
    began = time.perf_counter()
    try:
      result[name] = sections[name]()
    except Exception as e:  # recorded: the table shows which section failed and why
      result[name] = {"error": _gpu.error_text(e)}
    result["section_s"][name] = time.perf_counter() - began
    _common.write_json(result, args.out / "gpu_check.json")

  result["overlap"] = overlap(result, scale)
  result["wall_s"] = time.perf_counter() - start
  _common.write_json(result, args.out / "gpu_check.json")
  plot(result, args.out / "gpu_check.png")
  print(table(result))
  return result


def overlap(result: dict, scale: float) -> dict | None:
  """The share of the streamed step's state traffic hidden behind compute, from two sections."""
  t, bw = result.get("time", {}), result.get("bandwidth_bytes_per_s", {})
  if "stream" not in t or "on_device" not in t or not bw or "error" in bw:
    return None
  import jax

  # State bytes moved per streamed step: mu and nu in and out (4 x 4 bytes per parameter).
  n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(_gpu.transformer_shapes(2.5e8 * scale)))
  transfer_s = 16 * n / min(bw.values())
  extra_s = t["stream"]["median_s"] - t["on_device"]["median_s"]
  return {
    "state_bytes_moved": 16 * n,
    "transfer_s_at_bandwidth": transfer_s,
    "extra_step_s": extra_s,
    "hidden_fraction": max(0.0, min(1.0, 1 - extra_s / transfer_s)) if transfer_s else None,
  }


def plot(r: dict, path) -> bool:
  """Step times (log scale) and real device peaks against `compile_for_gpu`'s, when measured.

  Returns whether there was anything to draw (a run of other sections writes no PNG).
  """
  t, peaks = r.get("time", {}), []
  for mode, x in (r.get("measured_vs_compiled") or {}).items():
    if isinstance(x, dict) and x.get("predicted_peak_bytes") and x.get("step_peak_seen"):
      what = {"host": "host compute", "streamed": "streamed host tier"}.get(mode, mode)
      n = x["params_bytes"] / 4  # fp32
      peaks.append((f"{what}\n{n / 1e9:.2g}B AdamW", x["peak_bytes"], x["predicted_peak_bytes"]))
  x = r.get("params_on_host") or {}
  if x.get("predicted_peak_bytes") and x.get("peak_bytes"):
    what = f"params on the host\n{x['n_params'] / 1e6:.0f}M Llama, bf16"
    peaks.append((what, x["peak_bytes"], x["predicted_peak_bytes"]))
  if "on_device" not in t and not peaks:
    return False
  plt = _common.pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
  names = [n for n in ("on_device", "stream", "one_slice", "host_compute", "host_compute_native")
           if n in t]  # fmt: skip
  med = [t[n]["median_s"] * 1e3 for n in names]
  bars = left.bar(range(len(names)), med, color="tab:blue")
  for bar, n, m in zip(bars, names, med, strict=True):
    text = f"{m:.1f} ms" + (f"\n{t[n]['ratio']:.1f}x" if "ratio" in t[n] else "")
    _common.label_above(left, text, (bar.get_x() + bar.get_width() / 2, m), dy=3)
  moved = (r.get("overlap") or {}).get("transfer_s_at_bandwidth")
  if moved:
    left.axhline(moved * 1e3, color="tab:red", linestyle="--", linewidth=1,
                 label="the state in and out at the measured bandwidth")  # fmt: skip
    left.legend(loc="upper left", fontsize=8)
  left.set_yscale("log")
  left.set_ylim(min(med) / 2, max(med) * 8)
  left.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=8)
  left.set_ylabel("AdamW step, 250M fp32 params (ms, median)")
  left.set_title("step time", fontsize=10)
  if peaks:
    x = np.arange(len(peaks))
    real = [p[1] / 1e9 for p in peaks]
    predicted = [p[2] / 1e9 for p in peaks]
    right.bar(x - 0.2, predicted, 0.4, label="compile_for_gpu (no GPU)", color="tab:gray")
    bars = right.bar(x + 0.2, real, 0.4, label="peak_bytes_in_use on the GPU", color="tab:green")
    for bar, a, b in zip(bars, real, predicted, strict=True):
      _common.label_above(right, f"{a / b:.4f}x", (bar.get_x() + bar.get_width() / 2, a), dy=3)
    right.set_xticks(x, [p[0] for p in peaks], fontsize=8)
    right.set_ylabel("device peak (GB)")
    right.set_ylim(0, max(real + predicted) * 1.2)
    right.legend(loc="upper right", fontsize=8)
  right.set_title("device peak: measured vs predicted", fontsize=10)
  title = f"gpu_check on {', '.join(r['devices'])} (jax {r['jax_version']}, {r['date'][:10]})"
  _common.save_png(fig, path, suptitle=title)
  return True


def table(r: dict) -> str:
  """The run in a few lines; a section that failed or did not run says so."""

  def line(name, fmt):
    x = r.get(name)
    if x is None:
      return f"{name}: not run"
    if isinstance(x, dict) and set(x) == {"error"}:
      return f"{name}: FAILED ({x['error'][:200]})"
    try:
      return fmt(x)
    except (KeyError, TypeError) as e:  # a part of the section failed: show it raw
      return f"{name}: {x} ({type(e).__name__}: {e})"

  def correctness(c):
    return "correctness (max|diff| vs optax): " + ", ".join(
      f"{k} {v['max_abs_diff']:.3g}" if "error" not in v else f"{k} FAILED ({v['error'][:80]})"
      for k, v in c.items()
    )

  def memory(m):
    return (
      f"device bytes/param ({m['params']:,} params): on device "
      f"{m['on_device']['device_bytes_per_param']:.2f}, host tier "
      f"{m['host_tier']['device_bytes_per_param']:.2f} (host args "
      f"{m['host_tier']['host_argument_size_in_bytes'] / 2**30:.2f} GiB), host compute "
      f"{m['host_compute']['device_bytes_per_param']:.2f}"
    )

  def times(t):
    return (
      f"step: on device {t['on_device']['median_s'] * 1e3:.1f} ms, stream "
      f"{t['stream']['median_s'] * 1e3:.1f} ms ({t['stream']['ratio']:.3f}x, goal <= 1.15x), "
      f"one slice {t['one_slice']['median_s'] * 1e3:.1f} ms ({t['one_slice']['ratio']:.3f}x), "
      f"host compute {t['host_compute']['median_s'] * 1e3:.1f} ms "
      f"({t['host_compute']['ratio']:.3f}x; with offlax.adamw's native kernel "
      f"{t['host_compute_native']['median_s'] * 1e3:.1f} ms)"
    )

  def state_bits(x):
    ratios = {
      size: {k: round(v, 3) for k, v in row.items() if k.startswith("8-bit / fp32")}
      or row.get("error", "?")
      for size, row in x.items()
      if size.endswith("M")
    }  # fmt: skip
    return f"host step, 8-bit / fp32 Adam state ({x['cpu_count']} CPUs): {ratios}"

  lines = [
    f"gpu_check on {r['devices']} (jax {r['jax_version']}), memories {r['memories']}, "
    f"{r.get('wall_s', 0):.0f} s",
    line("correctness", correctness),
    line("memory", memory),
    line("time", times),
    line(
      "bandwidth_bytes_per_s",
      lambda b: "bandwidth: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in b.items()),
    ),  # fmt: skip
    f"overlap: {r.get('overlap')}",
    line("native_in_host_compute", lambda x: f"native Adam kernel in a GPU host computation: {x}"),
    line("measured_vs_compiled", lambda x: f"device peak, real run vs compile_for_gpu: {x}"),
    line(
      "train_step_overlap", lambda x: f"Llama train step, state on device / streamed / host: {x}"
    ),
    line("host_compute_parts", lambda x: f"host compute's step in parts (s): {x}"),
    line("params_on_host", lambda x: f"params, gradients and state on the host: {x}"),
    line("examples", lambda x: f"examples: {x}"),
    line("host_step_params_per_s", lambda x: f"native host step (params/s, all cores, one): {x}"),
    line("state_bits_host", state_bits),
    line(
      "host_state_checkpoint",
      lambda x: (
        f"HostStateSave / Restore of {x['state_bytes'] / 1e9:.2f} GB: exact {x['exact']}, "
        f"{x['save_gb_per_s']:.2f} / {x['restore_gb_per_s']:.2f} GB/s = "
        f"{x['save_vs_raw']:.2f}x / {x['restore_vs_raw']:.2f}x the raw disk"
      ),
    ),
    line(
      "pretrained_checkpoint",
      lambda x: (
        f"load_safetensors of {x['checkpoint_bytes'] / 1e6:.0f} MB into {x['param_kinds']}: "
        f"device peak +{x['device_peak_growth_bytes']} bytes (bound {x['bound_bytes']}: "
        f"{x['within_bound']}; onto the device +{x['on_device_growth_bytes']}), saved back "
        f"byte-identical {x['save_identical']} ({x['tensors']} tensors)"
      ),
    ),
  ]
  return "\n".join(lines)


def _run_child(spec: str) -> None:
  """Runs one section as `_gpu.in_child` asked (`--child [section, kwargs]`); prints its result."""
  import jax
  import optax

  import offlax

  section, kwargs = json.loads(spec)
  run = {
    "measured_vs_compiled": _gpu_peaks.measured_vs_compiled,
    "host_compute_parts": _gpu_speed.host_compute_parts,
    "params_on_host": _gpu_peaks.params_on_host,
    "pretrained_checkpoint": _gpu_correctness.pretrained_checkpoint,
  }[section]
  print("RESULT " + json.dumps(run(offlax, optax, jax, child=False, **kwargs)), flush=True)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    _run_child(sys.argv[2])
  else:
    main()
