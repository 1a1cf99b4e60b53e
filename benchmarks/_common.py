"""What the benchmark scripts share: run metadata, RSS, statistics, arguments, plots, output files.

Private to `benchmarks/`, not part of offlax. Only the standard library is imported at the top:
jax, optax, offlax and matplotlib load inside the functions that need them, so a script can
import this module before deciding whether it needs them at all (as nvme_throughput.py's parent
process does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import signal
import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results"


# -- run metadata and statistics -------------------------------------------------


def environment(devices: bool = False) -> dict[str, Any]:
  """The date (UTC), versions and machine of a run, for the head of a result JSON.

  Keys, in this order: date, jax_version, optax_version, offlax_version, backend, devices (only
  with `devices=True`: `str` of each of `jax.devices()`), cpu_count, platform, python.
  """
  import jax
  import optax

  import offlax

  env: dict[str, Any] = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "jax_version": jax.__version__,
    "optax_version": optax.__version__,
    "offlax_version": offlax.__version__,
    "backend": jax.default_backend(),
  }
  if devices:
    env["devices"] = [str(dev) for dev in jax.devices()]
  env["cpu_count"] = os.cpu_count()
  env["platform"] = platform.platform()
  env["python"] = platform.python_version()
  return env


def maxrss_bytes() -> int:
  """Peak resident set size of this process so far (`ru_maxrss`), in bytes (Linux: KiB * 1024)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _kb_field(path: str, field: str) -> int | None:
  """A `kB` field of a /proc file in bytes; None if unavailable."""
  try:
    with open(path) as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def proc_status_bytes(field: str) -> int | None:
  """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes; None if unavailable."""
  return _kb_field("/proc/self/status", field)


def meminfo_bytes(field: str) -> int | None:
  """A `kB` field of /proc/meminfo in bytes; None if unavailable."""
  return _kb_field("/proc/meminfo", field)


def reset_peak_rss() -> bool:
  """Resets VmHWM to the current RSS (Linux >= 4.0); False if that is not possible."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def peak_rss() -> int:
  """Peak RSS since the last `reset_peak_rss` (VmHWM), or `maxrss_bytes` where there is none."""
  hwm = proc_status_bytes("VmHWM")
  return maxrss_bytes() if hwm is None else hwm


def stats_of(values: Sequence[float], suffix: str = "") -> dict[str, float]:
  """Median, min and max of `values`, keyed `median`, `min`, `max` with `suffix` appended."""
  return {
    f"median{suffix}": statistics.median(values),
    f"min{suffix}": min(values),
    f"max{suffix}": max(values),
  }


def exit_on_sigterm() -> None:
  """Makes SIGTERM raise SystemExit, so `finally` clauses remove a benchmark's data on disk.

  `python -m benchmarks` stops a benchmark that runs past its timeout with SIGTERM.
  """

  def handler(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)

  signal.signal(signal.SIGTERM, handler)


# -- arguments -------------------------------------------------------------------


def add_steps_arguments(parser: argparse.ArgumentParser, steps: int, warmup_help: str) -> None:
  """Adds `--steps` (timed steps per variant, default `steps`) and `--warmup` (default 2)."""
  parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per variant ({steps})")
  parser.add_argument("--warmup", type=int, default=2, help=warmup_help)


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
  """Adds `--out`, the directory for `<name>.json` and `<name>.png` (default `DEFAULT_OUT`)."""
  parser.add_argument(
    "--out",
    type=pathlib.Path,
    default=DEFAULT_OUT,
    help=f"directory for {name}.json/.png ({DEFAULT_OUT})",
  )


def add_dir_argument(parser: argparse.ArgumentParser, what: str) -> None:
  """Adds `--dir`, the filesystem under test (default the temporary directory's, /tmp)."""
  parser.add_argument(
    "--dir",
    type=pathlib.Path,
    default=pathlib.Path(tempfile.gettempdir()),
    help=f"filesystem for {what}: a fresh directory is made (and removed) in it (/tmp)",
  )


def check_steps_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Exits with a usage error unless `--steps` >= 1 and `--warmup` >= 0."""
  if args.steps < 1:
    parser.error("--steps must be >= 1")
  if args.warmup < 0:
    parser.error("--warmup must be >= 0")


# -- plots -----------------------------------------------------------------------


def pyplot() -> Any:
  """`matplotlib.pyplot` on the non-interactive Agg backend (no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def label_above(ax: Any, text: str, xy: tuple[float, float], dy: float) -> None:
  """Writes `text` in 9-point type centred `dy` points above the point `xy` (a bar's top)."""
  ax.annotate(
    text, xy, xytext=(0, dy), textcoords="offset points", ha="center", va="bottom", fontsize=9
  )


Bar = tuple[str, float, float, float, str, str]  # label, median, min, max, color, note


def draw_bars(ax: Any, bars: Sequence[Bar], headroom: float) -> None:
  """`bars` with min-to-max whiskers, each labelled with its median and note."""
  import numpy as np

  x = np.arange(len(bars))
  med = np.array([b[1] for b in bars])
  err = [med - np.array([b[2] for b in bars]), np.array([b[3] for b in bars]) - med]
  ax.bar(x, med, yerr=err, capsize=6, color=[b[4] for b in bars])
  for xi, b in zip(x, bars, strict=True):
    label_above(ax, f"{b[1]:.2f}{b[5]}", (xi, b[3]), dy=3)
  ax.set_xticks(x, [b[0] for b in bars], fontsize=8)
  ax.set_ylim(0, max(b[3] for b in bars) * headroom)


# -- output files ------------------------------------------------------------------


def save_png(fig: Any, path: pathlib.Path, suptitle: str | None = None) -> None:
  """Writes `fig` to `path` as PNG via a temporary file and a rename (atomic), then closes it.

  With `suptitle`: a figure title in 11-point type, then `tight_layout` (for subplots).
  """
  if suptitle is not None:
    fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
  tmp = path.with_suffix(".png.tmp")
  fig.savefig(tmp, format="png")
  import matplotlib.pyplot as plt

  plt.close(fig)
  os.replace(tmp, path)


def write_json(result: dict[str, Any], path: pathlib.Path) -> None:
  """Writes `result` to `path` as indented JSON via a temporary file and a rename (atomic)."""
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(result, indent=2) + "\n")
  os.replace(tmp, path)


def write_outputs(
  result: dict[str, Any],
  out: pathlib.Path,
  name: str,
  plot: Callable[[dict[str, Any], pathlib.Path], None],
  summary_table: Callable[[dict[str, Any]], str],
) -> None:
  """Writes `<out>/<name>.json` and the plot `<out>/<name>.png`, then prints the summary table."""
  out.mkdir(parents=True, exist_ok=True)
  json_path, png_path = out / f"{name}.json", out / f"{name}.png"
  write_json(result, json_path)
  plot(result, png_path)
  print(f"wrote {json_path} and {png_path} ({result['wall_s']:.0f} s in all)\n")
  print(summary_table(result), flush=True)
