"""`python -m offlax`'s subcommands: one function each, returning the exit status.

Each imports what it needs when it runs: `plan` checks every option before JAX
loads, `inspect` and `rollback` load no compiler.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from offlax._src.cli_parsers import Parsers


def plan(args: argparse.Namespace, parsers: Parsers) -> int:
  """`plan`: 0 fits, 1 does not fit, 2 a bad option (one line) or a failed `--compile`."""
  # Shapes only, never a device: on a machine without a GPU, the CUDA plugin of the
  # gpu-compile extra would print its failed start (a traceback) for nothing. (Set before
  # JAX's import, read there; not importing JAX here: a bad option stays a one-line error.)
  if args.compile:
    _compile_only()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from offlax._src import errors, plan_cli

  try:
    opts = plan_cli.options(args)  # every option checked before anything is planned
    return plan_cli.run(args, opts)
  except errors.InvalidOptionError as e:
    parsers.command.error(str(e).removeprefix("plan: "))
  return 2  # not reached: error() exits


def compile_step(args: argparse.Namespace, parsers: Parsers) -> int:
  """`compile`: 0 the step fits the target, 1 it does not, 2 a bad option or no compiler."""
  _compile_only()
  from offlax._src import planner

  try:
    n = planner.parse_count(args.params)
    chunk = planner.parse_bytes(args.chunk)
    memory = None if args.device_mem is None else planner.parse_bytes(args.device_mem, True)
  except ValueError as e:
    parsers.main.error(str(e))
  m = compiled(n, args.mode, args.master, chunk, args.layers, args.target, memory, fused=args.fused)
  if m is None:
    return 2
  fused = ", update_and_apply" if args.fused and args.mode != "plain" else ""
  print(f"AdamW step ({args.mode}{', bf16 + fp32 master' if args.master else ''}{fused}) on "
        f"{m.n_params:,} params in {args.layers} layers")  # fmt: skip
  print(m.table())
  return 0 if m.fits else 1


def _compile_only() -> None:
  """Compile only: the CUDA plugin must not start a backend (there may be no GPU)."""
  import jax

  if "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", "cpu")


def compiled(n, mode, master, chunk, layers, target, memory, fraction=1.0, fused=False) -> Any:
  """An AdamW step on a transformer-shaped tree of `n` params, compiled for `target`; or None."""
  import offlax
  from offlax._src import gpu_compile

  if not offlax.extend.gpu_compile_available():
    print("error: XLA's GPU compiler is not installed: pip install 'offlax[gpu-compile]'",
          file=sys.stderr)  # fmt: skip
    return None
  try:
    return gpu_compile.compile_adamw_step(
      n, mode=mode, master=master, chunk_bytes=chunk, layers=layers, fraction=fraction,
      target=target, device_memory_size=memory, fused=fused,
    )  # fmt: skip
  except offlax.errors.OffloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return None


def inspect(args: argparse.Namespace, parsers: Parsers) -> int:
  """`inspect`: 0 every store is whole, 1 a problem found, 2 nothing to inspect there."""
  import offlax

  try:
    reports = offlax.checkpoint.inspect_store(
      args.path, verify=args.verify, progress=not args.no_progress
    )
  except offlax.errors.OffloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for report in reports:
    print(report.format())
  return 0 if all(r.ok for r in reports) else 1


def rollback(args: argparse.Namespace, parsers: Parsers) -> int:
  """`rollback`: 0 the step is current, 1 refused (the store's error, on stderr)."""
  import offlax

  path, step = args.path, args.to
  try:
    offlax.checkpoint.rollback(path, step)
  except offlax.errors.OffloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  how = (
    "LayerStore.open(path, like, ...)" if _is_layer_store(path) else "NVMeTier(path, resume=True)"
  )
  print(f"{path}: step {step} is now current; resume with {how}.")
  return 0


def _is_layer_store(path: str) -> bool:
  from offlax._src.nvme.format import LAYERS

  return os.path.exists(os.path.join(path, LAYERS))
