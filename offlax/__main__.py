"""`python -m offlax plan|compile|inspect|rollback`: the planner, GPU compiler and store tools."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any


class _Parser(argparse.ArgumentParser):
  """A command's parser whose errors are one line (``prog: error: ...``), exit status 2."""

  def error(self, message: str):  # type: ignore[override]
    if self.prog.endswith(" plan"):  # argparse's own errors ("expected one argument"): the range
      from offlax._src import plan_options

      for limit in plan_options.LIMITS.values():
        if re.search(f"{limit.flag}\\b(?!-)", message) and limit.text not in message:
          message += f"; {limit.what} must be {limit.text}"
    self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m offlax", description="offlax tools")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  p = sub.add_parser("plan", help="where the optimizer state should live, and what it costs")
  p.add_argument("--params", help="number of parameters, e.g. 7B, 350M, 13e9")
  p.add_argument(
    "--model", default=None,
    help="a Tunix model config (qwen3_14b, llama3p1_8b, ...) or a JSON file of shapes "
    "(layers, d, ffn, vocab, heads, kv_heads): its exact params and layers",
  )  # fmt: skip
  p.add_argument(
    "--hf-config", metavar="PATH", default=None,
    help="a Hugging Face checkpoint folder or its config.json: the model's exact params and layers",
  )  # fmt: skip
  p.add_argument("--device-mem", required=True, help="accelerator memory, e.g. 24GB")
  p.add_argument("--host-mem", required=True, help="host RAM for the state, e.g. 128GB")
  p.add_argument("--nvme", default="0", help="free disk for an NVMe store, e.g. 2TB (0)")
  p.add_argument(
    "--activations", default=None,
    help="activations and temporaries (0; with --layers, counted for a Llama of --tokens)",
  )  # fmt: skip
  p.add_argument(
    "--tokens", default="2048",
    help="batch x sequence, for the activations --layers counts (2048; 1 to 1e8)",
  )  # fmt: skip
  p.add_argument(
    "--param-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
    help="dtype of the params (bfloat16)",
  )  # fmt: skip
  p.add_argument(
    "--optimizer", choices=("adam", "adamw", "sgd", "adafactor"), default="adamw",
    help="the inner optimizer (adamw)",
  )  # fmt: skip
  p.add_argument(
    "--master", action="store_true",
    help="fp32 master weights in the state (offlax.master_weights), as mixed precision does",
  )  # fmt: skip
  p.add_argument(
    "--state-bits", type=int, choices=(32, 8), default=32,
    help="Adam's moments in 32 bits, or 8 (offlax.adamw(..., state_bits=8): ~1 byte each)",
  )  # fmt: skip
  p.add_argument("--chunk", default="64MiB", help="slice size (64MiB; 4KiB to 16GiB)")
  p.add_argument(
    "--layers", default=None,
    help="stacked layers (1 to 10000): lets the plan keep params and gradients in host memory",
  )  # fmt: skip
  p.add_argument(
    "--fused", action="store_true",
    help="the step applies with offlax.update_and_apply (no updates kept on the device)",
  )  # fmt: skip
  p.add_argument("--bus-gbps", help="host<->device GB/s each way (25)")
  p.add_argument("--disk-gbps", help="disk GB/s (3)")
  p.add_argument("--host-adam-gps", help="host optimizer step, G params/s (1.2)")
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
  p = sub.add_parser(
    "rollback", help="make an earlier kept step of an NVMe store or a LayerStore current"
  )
  p.add_argument("path", help="the NVMe store's or the LayerStore's directory")
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
  from offlax._src import errors, plan_cli

  plan_parser = sub.choices["plan"]
  try:
    opts = plan_cli.options(args)  # every option checked before anything is planned
    return plan_cli.run(args, opts)
  except errors.InvalidOptionError as e:
    plan_parser.error(str(e).removeprefix("plan: "))
  return 2  # not reached: error() exits


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
  how = (
    "LayerStore.open(path, like, ...)" if _is_layer_store(path) else "NVMeTier(path, resume=True)"
  )
  print(f"{path}: step {step} is now current; resume with {how}.")
  return 0


def _is_layer_store(path: str) -> bool:
  import os

  from offlax._src.nvme.format import LAYERS

  return os.path.exists(os.path.join(path, LAYERS))


if __name__ == "__main__":
  sys.exit(main())
