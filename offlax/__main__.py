"""`python -m offlax plan|compile|inspect|rollback`: the planner, GPU compiler and store tools."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m offlax", description="offlax tools")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("plan", help="where the optimizer state should live, and what it costs")
  p.add_argument("--params", help="number of parameters, e.g. 7B, 350M, 13e9")
  p.add_argument(
    "--model", default=None,
    help="a Tunix model config (qwen3_14b, llama3p1_8b, ...) or a JSON file of shapes "
    "(layers, d, ffn, vocab, heads, kv_heads): its exact params and layers",
  )  # fmt: skip
  p.add_argument("--device-mem", required=True, help="accelerator memory, e.g. 24GB")
  p.add_argument("--host-mem", required=True, help="host RAM for the state, e.g. 128GB")
  p.add_argument("--nvme", default="0", help="free disk for an NVMe store, e.g. 2TB (0)")
  p.add_argument(
    "--activations", default=None,
    help="activations and temporaries (0; with --layers, counted for a Llama of --tokens)",
  )  # fmt: skip
  p.add_argument(
    "--tokens", type=int, default=2048,
    help="batch x sequence, for the activations --layers counts (2048)",
  )  # fmt: skip
  p.add_argument("--param-dtype", default="bfloat16", help="dtype of the params (bfloat16)")
  p.add_argument(
    "--optimizer", choices=("adam", "adamw", "sgd", "adafactor"), default="adamw",
    help="the inner optimizer (adamw)",
  )  # fmt: skip
  p.add_argument(
    "--master", action="store_true",
    help="fp32 master weights in the state (offlax.master_weights), as mixed precision does",
  )  # fmt: skip
  p.add_argument("--chunk", default="64MiB", help="slice size (64MiB)")
  p.add_argument(
    "--layers", type=int, default=None,
    help="stacked layers: lets the plan keep params and gradients in host memory too",
  )  # fmt: skip
  p.add_argument(
    "--fused", action="store_true",
    help="the step applies with offlax.update_and_apply (no updates kept on the device)",
  )  # fmt: skip
  p.add_argument("--bus-gbps", type=float, help="host<->device GB/s each way (25)")
  p.add_argument("--disk-gbps", type=float, help="disk GB/s (3)")
  p.add_argument("--host-adam-gps", type=float, help="host optimizer step, G params/s (1.2)")
  p.add_argument(
    "--measure", action="store_true",
    help="measure bus, disk (in --nvme-path) and host Adam speed on this machine first",
  )  # fmt: skip
  p.add_argument("--nvme-path", default=None, help="directory --measure writes to (temp)")
  p.add_argument(
    "--measure-disk", metavar="PATH", default=None,
    help="measure the disk's direct-I/O speed in PATH (512 MiB written and read) first",
  )  # fmt: skip
  p.add_argument(
    "--compile", metavar="TARGET", default=None,
    help="also compile the chosen mode's step for this GPU (e.g. h100) and print its memory",
  )  # fmt: skip
  p = sub.add_parser(
    "compile",
    help="compile an AdamW step for a GPU with XLA's GPU compiler (no GPU needed); its memory",
  )
  p.add_argument("--params", required=True, help="parameters, e.g. 7e9 or 7B")
  p.add_argument("--target", default="h100", help="h100, h200, a100-40gb, a100-80gb, rtx4090, l4")
  p.add_argument("--device-mem", default=None, help="override the target's memory, e.g. 24GB")
  p.add_argument(
    "--mode", choices=("plain", "streamed", "host"), default="streamed",
    help="plain optax, the streamed host tier, or host compute (streamed)",
  )  # fmt: skip
  p.add_argument("--master", action="store_true", help="bf16 params + fp32 master weights")
  p.add_argument(
    "--fused", action="store_true",
    help="apply with offlax.update_and_apply (each slice writes its params) instead of optax",
  )  # fmt: skip
  p.add_argument("--chunk", default="64MiB", help="slice size (64MiB)")
  p.add_argument("--layers", type=int, default=16, help="transformer layers (16)")
  p = sub.add_parser(
    "inspect",
    help="an NVMe store's, a LayerStore's or an orbax checkpoint's steps, arrays, checksums",
  )
  p.add_argument("path", help="an NVMe store directory or an orbax checkpoint directory")
  p.add_argument("--verify", action="store_true", help="reread every chunk, check checksums")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p = sub.add_parser("rollback", help="make an earlier kept step of an NVMe store current")
  p.add_argument("path", help="the NVMe store directory")
  p.add_argument("--to", type=int, required=True, metavar="STEP", help="a kept step")
  args = parser.parse_args(argv)
  if args.command == "inspect":
    return _inspect(args.path, args.verify, not args.no_progress)
  if args.command == "rollback":
    return _rollback(args.path, args.to)
  if args.command == "compile" or getattr(args, "compile", None):
    import os

    import jax

    # Compile only: the CUDA plugin must not start a backend (there may be no GPU).
    if "JAX_PLATFORMS" not in os.environ:
      jax.config.update("jax_platforms", "cpu")
  if args.command == "compile":
    return _compile(parser, args)

  import jax
  import jax.numpy as jnp
  import optax

  import offlax
  from offlax._src import planner

  try:
    sizes = {
      name: planner.parse_bytes(text, unit_required=True)
      for name, text in (
        ("device_bytes", args.device_mem),
        ("host_bytes", args.host_mem),
        ("nvme_bytes", args.nvme),
        ("activation_bytes", args.activations or "0"),
        ("chunk_bytes", args.chunk),
      )
    }
    model = None  # a Llama of these shapes: the working set counted, the step compiled
    if args.model:
      from offlax._src import llama

      model = llama.from_config(args.model, tokens=args.tokens)
      args.layers = model.layers
      print(f"--model {args.model}: {model} ({model.n_params / 1e9:.2f}B params)")
    elif args.params is None:
      parser.error("plan needs --params or --model")
    n = model.n_params if model is not None else planner.parse_count(args.params)
    dtype = jnp.dtype(args.param_dtype)
  except (ValueError, TypeError) as e:
    parser.error(str(e))
  rates: dict[str, Any] = {}
  if args.measure:
    from offlax._src import measure

    rates = measure.all(args.nvme_path)
    print("measured: " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()))
  if args.measure_disk is not None:
    from offlax._src import measure

    try:
      rates["disk_bytes_per_s"] = measure.disk(args.measure_disk, 512 * 2**20)
    except OSError as e:
      parser.error(f"--measure-disk {args.measure_disk}: {e}")
    print(f"measured: disk {rates['disk_bytes_per_s'] / 1e9:.2f} GB/s in {args.measure_disk}")
  for key, flag, scale in (
    ("bus_bytes_per_s", args.bus_gbps, 1e9),
    ("disk_bytes_per_s", args.disk_gbps, 1e9),
    ("host_adam_params_per_s", args.host_adam_gps, 1e9),
  ):
    if flag is not None:
      rates[key] = flag * scale
  leaf = 1 << 26  # leaves of up to 64M params, like a large model's matrices
  shapes = {f"w{i:05d}": jax.ShapeDtypeStruct((min(leaf, n - i * leaf),), dtype)
            for i in range(-(-n // leaf))}  # fmt: skip
  inner = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "sgd": lambda: optax.sgd(1e-3, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-3),
  }[args.optimizer]()
  tx = offlax.master_weights(inner) if args.master else inner
  if args.layers:
    from offlax._src import llama

    model = model or llama.shaped(n, args.layers, tokens=args.tokens)
    if args.activations is None:
      sizes["activation_bytes"] = model.device_bytes()
      print(f"working set on the device: {planner.format_bytes(sizes['activation_bytes'])} "
            f"(estimated for {model}: XLA's attention, remat)")  # fmt: skip
  result = offlax.plan(shapes, tx, **sizes, **rates, layers=args.layers, fused=args.fused)
  param_bytes = n * dtype.itemsize
  if (
    not result.fits
    and not args.layers
    and args.activations is None
    and 2 * param_bytes > sizes["device_bytes"] * (1 - planner.DEVICE_RESERVE)
  ):
    # Params and gradients too big for the device: a usual decoder of this size can keep
    # them in host memory, which the plan can only weigh knowing the layers.
    from offlax._src import llama

    layers = _usual_layers(n)
    usual = llama.shaped(n, layers, tokens=args.tokens)
    counted = {**sizes, "activation_bytes": usual.device_bytes()}
    other = offlax.plan(shapes, tx, **counted, **rates, layers=layers, fused=True)
    if other.fits:
      print(
        f"assuming a usual decoder of this size ({usual}; pass --layers L, or --model NAME "
        "for a Tunix config or a JSON file of shapes, for exact figures):"
      )
      result, model, args.layers = other, usual, layers
  inner_code = {
    "adam": "optax.adam(1e-3)",
    "adamw": "optax.adamw(1e-3)",
    "sgd": "optax.sgd(1e-3, momentum=0.9)",
    "adafactor": "optax.adafactor(1e-3)",
  }[args.optimizer]
  if args.master:
    inner_code = f"offlax.master_weights({inner_code})"
  print(result.table(inner=inner_code))
  if result.mode == "params_nvme" and model is not None:
    rest = model.n_params - model.layers * model.layer_params  # embedding, head, final norm
    extra = rest * (2 * dtype.itemsize + result.assumptions["state_bytes"] / n)
    print(f"- the params outside the layers ({rest / 1e9:.2f}B: embedding, head, final norm) "
          f"stay in RAM with their gradients and state: {planner.format_bytes(extra)} more, "
          f"{planner.format_bytes(result.bytes['host'] + extra)} in all")  # fmt: skip
    if result.bytes["host"] + extra > sizes["host_bytes"]:
      short = result.bytes["host"] + extra - sizes["host_bytes"]
      print(f"- RAM short by {planner.format_bytes(short)} once those are counted: keep their "
            "optimizer state on the NVMe tier (offlax.NVMeTier), or add RAM")  # fmt: skip
      return 1
  if result.mode == "params_nvme" and "disk_bytes_per_s" not in rates:
    print(f"- the disk's {planner.DISK_BYTES_PER_S / 1e9:g} GB/s is assumed (a datacenter NVMe "
          "SSD): --measure-disk PATH measures yours, --disk-gbps sets it")  # fmt: skip
  if result.fits and args.activations is None and not args.layers:
    _with_layers(n, shapes, tx, sizes, rates, args)
  mode = {"device": "plain", "host": "streamed", "host_compute": "host"}.get(result.mode)
  if args.compile and result.mode == "params_host":
    return _compile_params_host(model, args.compile, result)
  if args.compile and mode is None:
    print(f"--compile: nothing to compile for mode {result.mode!r}", file=sys.stderr)
  if args.compile and mode is not None:
    m = _compiled(
      n, mode, args.master, sizes["chunk_bytes"], 16, args.compile, None, result.fraction,
      fused=args.fused,
    )  # fmt: skip
    if m is None:
      return 2
    planned = result.bytes["device"] / n
    print(
      f"compiled ({mode}, {args.compile}): device {m.device_peak / n:.2f} B/param "
      f"(plan {planned:.2f}), host {m.host_peak / n:.2f} B/param"
    )
  return 0 if result.fits else 1


def _with_layers(n: int, shapes: Any, tx: Any, sizes: dict, rates: dict, args: Any) -> None:
  """Prints the plan with the activations of a Llama of a usual layer count counted."""
  import offlax
  from offlax._src import llama, planner

  layers = _usual_layers(n)
  model = llama.shaped(n, layers, tokens=args.tokens)
  counted = {**sizes, "activation_bytes": model.device_bytes()}
  other = offlax.plan(shapes, tx, **counted, **rates, layers=layers, fused=args.fused)
  fraction = f", fraction {other.fraction:.2f}" if other.mode == "host" else ""
  verdict = "fits" if other.fits else "DOES NOT FIT"
  print(
    f"- with --layers {layers} (a Llama-shaped model, --tokens {args.tokens}): a working set of "
    f"{planner.format_bytes(counted['activation_bytes'])}; mode {other.mode} ({verdict})"
    f"{fraction}, device {planner.format_bytes(other.bytes['device'])}"
  )


def _usual_layers(n: int) -> int:
  """A usual decoder's layer count for `n` params: 17 at 1B, 32 at 7B, 39 at 13B, 69 at 70B."""
  return max(1, round(n ** (1 / 3) / 60))


def _compile_params_host(m: Any, target: str, result: Any) -> int:
  """Compiles the whole train step of the Llama-shaped model `m` (`llama.Llama`)."""
  from offlax._src import llama

  try:
    compiled = llama.compile_step(m, target)
  except ImportError as e:
    print(f"--compile: {e}", file=sys.stderr)
    return 2
  print(
    f"compiled (params_host, {target}, {m}): device {compiled.device_peak / 1e9:.2f} GB "
    f"(plan {result.bytes['device'] / 1e9:.2f} GB), host {compiled.host_peak / 1e9:.1f} GB "
    f"(plan {result.bytes['host'] / 1e9:.1f} GB)" + ("" if compiled.fits else "; DOES NOT FIT")
  )
  return 0 if compiled.fits else 1


def _compile(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  from offlax._src import planner

  try:
    n = planner.parse_count(args.params)
    chunk = planner.parse_bytes(args.chunk)
    memory = None if args.device_mem is None else planner.parse_bytes(args.device_mem, True)
  except ValueError as e:
    parser.error(str(e))
  m = _compiled(
    n, args.mode, args.master, chunk, args.layers, args.target, memory, fused=args.fused
  )
  if m is None:
    return 2
  fused = ", update_and_apply" if args.fused and args.mode != "plain" else ""
  print(f"AdamW step ({args.mode}{', bf16 + fp32 master' if args.master else ''}{fused}) on "
        f"{m.n_params:,} params in {args.layers} layers")  # fmt: skip
  print(m.table())
  return 0 if m.fits else 1


def _compiled(n, mode, master, chunk, layers, target, memory, fraction=1.0, fused=False) -> Any:
  """An AdamW step on a transformer-shaped tree of `n` params, compiled for `target`; or None."""
  import offlax
  from offlax._src import gpu_compile

  if not offlax.gpu_compile_available():
    print("error: XLA's GPU compiler is not installed: pip install 'offlax[gpu-compile]'",
          file=sys.stderr)  # fmt: skip
    return None
  try:
    return gpu_compile.compile_adamw_step(
      n, mode=mode, master=master, chunk_bytes=chunk, layers=layers, fraction=fraction,
      target=target, device_memory_size=memory, fused=fused,
    )  # fmt: skip
  except offlax.OffloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return None


def _inspect(path: str, verify: bool, progress: bool) -> int:
  import offlax

  try:
    reports = offlax.inspect_store(path, verify=verify, progress=progress)
  except offlax.OffloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for report in reports:
    print(report.format())
  return 0 if all(r.ok for r in reports) else 1


def _rollback(path: str, step: int) -> int:
  import offlax

  try:
    offlax.rollback(path, step)
  except offlax.OffloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"{path}: step {step} is now current; resume with NVMeTier(path, resume=True).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
