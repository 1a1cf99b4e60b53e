"""`python -m offlax`'s argument parsers: one small function per subcommand.

Building them imports nothing but argparse, so that `plan` refuses bad input
before JAX loads (its import alone takes 1-2 s).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NamedTuple


class CommandParser(argparse.ArgumentParser):
  """A command's parser whose errors are one line (``prog: error: ...``), exit status 2."""

  def error(self, message: str):  # type: ignore[override]
    if self.prog.endswith(" plan"):  # argparse's own errors ("expected one argument"): the range
      from offlax._src import plan_options

      for limit in plan_options.LIMITS.values():
        if re.search(f"{limit.flag}\\b(?!-)", message) and limit.text not in message:
          message += f"; {limit.what} must be {limit.text}"
    self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def add_plan(sub: Any) -> argparse.ArgumentParser:
  """`plan`: where the optimizer state should live. Its options in `--help`'s order."""
  p = sub.add_parser("plan", help="where the optimizer state should live, and what it costs")
  _plan_model(p)
  _plan_memory(p)
  _plan_step(p)
  _plan_speeds(p)
  p.add_argument(
    "--compile", metavar="TARGET", default=None,
    help="also compile the chosen mode's step for this GPU (e.g. h100) and print its memory",
  )  # fmt: skip
  return p


def _plan_model(p: argparse.ArgumentParser) -> None:
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


def _plan_memory(p: argparse.ArgumentParser) -> None:
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


_UPDATE_BYTES = (
  "params on disk (a LayerStore): its update's bytes in flight, LayerStore(update_bytes=), e.g. "
  "16GB (default: whole leaves where they fit in RAM, else 2 layers' reads); the rest's state "
  "goes to the NVMe tier where RAM is short"
)


def _plan_step(p: argparse.ArgumentParser) -> None:
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
  p.add_argument("--update-bytes", default=None, help=_UPDATE_BYTES)
  p.add_argument(
    "--layers", default=None,
    help="stacked layers (1 to 10000): lets the plan keep params and gradients in host memory",
  )  # fmt: skip
  p.add_argument(
    "--fused", action="store_true",
    help="the step applies with offlax.update_and_apply (no updates kept on the device)",
  )  # fmt: skip


def _plan_speeds(p: argparse.ArgumentParser) -> None:
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


def add_compile(sub: Any) -> argparse.ArgumentParser:
  """`compile`: an AdamW step compiled for a GPU target, and its memory."""
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
  return p


def add_inspect(sub: Any) -> argparse.ArgumentParser:
  """`inspect`: a store's or a checkpoint's steps, arrays and checksums."""
  p = sub.add_parser(
    "inspect",
    help="an NVMe store's, a LayerStore's or an orbax checkpoint's steps, arrays, checksums",
  )
  p.add_argument("path", help="an NVMe store directory or an orbax checkpoint directory")
  p.add_argument("--verify", action="store_true", help="reread every chunk, check checksums")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p


def add_rollback(sub: Any) -> argparse.ArgumentParser:
  """`rollback`: an earlier kept step of a store made current."""
  p = sub.add_parser(
    "rollback", help="make an earlier kept step of an NVMe store or a LayerStore current"
  )
  p.add_argument("path", help="the NVMe store's or the LayerStore's directory")
  p.add_argument("--to", type=int, required=True, metavar="STEP", help="a kept step")
  return p


class Parsers(NamedTuple):
  """What a command reports its usage errors through (exit status 2)."""

  main: argparse.ArgumentParser  # `python -m offlax`'s: `compile`'s errors, usage first
  command: argparse.ArgumentParser  # the command's own: one line (`CommandParser`)
