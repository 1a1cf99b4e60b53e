"""Runs every benchmark, then prints and writes a summary table: goal, measured, met?

  python -m benchmarks                     # all of them, sized for 2 cores / 24 GiB: < 15 min
  python -m benchmarks --quick --out /tmp/bench        # tiny sizes, seconds each (the tests)
  python -m benchmarks --only scaling checkpoint       # some of them

Each benchmark runs as its own subprocess (`python -m benchmarks.<name>`), so its memory figures
and its peak RSS (the largest of its processes, from `wait4`) are its own, and a crash stops
only it. Each writes `<out>/<name>.json` and `<out>/<name>.png`; this script then writes
`<out>/summary.json` and `<out>/summary.md` and prints the table last, with each benchmark's
wall time against its share of the 15 minutes. `gpu_check` runs only where JAX's backend is a
GPU; elsewhere its row says "needs GPU: not run".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# Run as `python -m benchmarks` from the repository root, or as a file from anywhere.
_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
  sys.path.append(str(_REPO_ROOT))
from benchmarks import _common  # noqa: E402

TOTAL_BUDGET_S = 15 * 60

Row = dict[str, Any]  # benchmark, measure, goal, measured, met (True, False or None: no goal)


def _row(benchmark: str, measure: str, goal: str, measured: str, met: bool | None) -> Row:
  return {"benchmark": benchmark, "measure": measure, "goal": goal, "measured": measured,
          "met": met}  # fmt: skip


def _span(stats: dict[str, float], fmt: str, unit: str) -> str:
  """`median unit (min to max)` of a `_common.stats_of` record."""
  m, lo, hi = (format(stats[k], fmt) for k in ("median", "min", "max"))
  return f"{m}{unit} ({lo} to {hi})"


# -- what each benchmark's JSON says against its goal ------------------------------


def rows_host_overhead(r: dict[str, Any]) -> list[Row]:
  goal = r["goal_ratio"]
  times = {v["name"]: v for v in r["variants"]}
  ratio = r["ratios"]["offlax"]
  return [
    _row(
      "host_overhead",
      "host tier (device compute) step / plain optax step",
      f"<= {goal:.2f}x",
      f"{ratio:.3f}x ({times['offlax']['median_s'] * 1e3:.1f} vs "
      f"{times['optax']['median_s'] * 1e3:.1f} ms, {r['params'] / 1e6:.0f}M params)",
      ratio <= goal,
    )  # fmt: skip
  ]


def rows_host_adam(r: dict[str, Any]) -> list[Row]:
  rows = []
  # ZeRO-Offload's mixed-precision host step and the CPU-only full step, each
  # against DeepSpeed's equivalent, at every size and thread count.
  for name, goal in r["goals"].items():
    measure = f"{name} params/s / {goal['vs']}"
    target = f">= {goal['ratio']:.1f}x"
    if r["torch_skipped"]:
      rows.append(_row("host_adam", measure, target, "skipped: no torch env", None))
      continue
    cores = max(r["threads"])  # the goal is the machine's; one thread is reported beside it
    ratios = {
      s: row["ratios"][name]
      for s, row in r["sizes"].items()
      if name in row["ratios"] and row["threads"] == cores
    }
    spread = {s: row.get("ratio_spread", {}).get(name) for s, row in r["sizes"].items()}
    measured = (
      ", ".join(
        f"{s} {x:.2f}x" + (f" ({spread[s]['min']:.2f}-{spread[s]['max']:.2f})" if spread[s] else "")
        for s, x in ratios.items()
      )
      or "not measured"
    )
    met = min(ratios.values()) >= goal["ratio"] if ratios else None
    rows.append(_row("host_adam", measure, target, measured, met))
  return rows


def rows_nvme_throughput(r: dict[str, Any]) -> list[Row]:
  goal, t = r["goal_ratio"], r["tier"].get("fsync", {})
  if "error" in t or "ratio_vs_raw" not in t:
    return [_row("nvme_throughput", "NVMe tier state GB/s / raw disk", f">= {goal}x", "FAILED",
                 False)]  # fmt: skip
  peak = t["peak_rss_above_baseline_bytes"]
  huge = " (glibc.malloc.hugetlb=1)" if "hugetlb" in t.get("glibc_tunables", "") else ""
  rows = [
    _row(
      "nvme_throughput", f"NVMe tier state GB/s / raw direct-I/O disk (fsync=True){huge}",
      f">= {goal}x",
      _span(t["ratio_vs_raw"], ".2f", "x") + f", {t['gb_per_s']['median']:.2f} GB/s",
      t["ratio_vs_raw"]["median"] >= goal,
    ),
    _row(
      "nvme_throughput", "NVMe tier peak RSS above params+grads", "vs cache_bytes (report)",
      f"{peak / 2**20:,.0f} MiB = {peak / r['cache_bytes']:.1f}x cache_bytes "
      f"({r['cache_bytes'] / 2**20:.3g} MiB), {peak / r['state_bytes']:.0%} of the state",
      None,
    ),
  ]  # fmt: skip
  huge_run = r["tier"].get("hugetlb", {})
  if "ratio_vs_raw" in huge_run:
    rows.insert(1, _row(
      "nvme_throughput", "the same, started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1", "report",
      _span(huge_run["ratio_vs_raw"], ".2f", "x")
      + f", {huge_run['gb_per_s']['median']:.2f} GB/s",
      None,
    ))  # fmt: skip
  return rows


def rows_scaling(r: dict[str, Any]) -> list[Row]:
  goal = r["goal_loglog_slope"]
  rows = []
  for tier, s in r["tiers"].items():
    ok = [p for p in s["points"] if "error" not in p]
    sizes = f"{ok[0]['params'] / 1e6:.0f}M-{ok[-1]['params'] / 1e6:.0f}M" if ok else ""
    for what, fit, per in (("step time", "time_fit", "ns_per_param"),
                           ("RAM", "ram_fit", "ram_bytes_per_param")):  # fmt: skip
      f = s[fit]
      measure = f"{tier} tier {what} vs params {sizes}: log-log slope"
      if f is None:
        rows.append(_row("scaling", measure, f"<= {goal}", "fewer than 2 sizes", None))
        continue
      unit = "ns/param" if per == "ns_per_param" else "B/param"
      each = ", ".join(f"{p[per]:.2f}" for p in ok)
      rows.append(
        _row(
          "scaling",
          measure,
          f"<= {goal}",
          f"{f['loglog_slope']:.2f} ({unit}: {each})",
          f["loglog_slope"] <= goal,
        )  # fmt: skip
      )
  return rows


def rows_checkpoint(r: dict[str, Any]) -> list[Row]:
  labels = {
    "host_save": "host tier orbax save (orbax defaults)",
    "host_restore": "host tier orbax restore (orbax defaults)",
    "fast_save": "host tier orbax save (offlax.checkpoint.checkpoint_handler)",
    "fast_restore": "host tier orbax restore (offlax.checkpoint.checkpoint_handler)",
    "direct_save": "host tier orbax save (offlax.checkpoint.HostStateSave)",
    "direct_restore": "host tier orbax restore (offlax.checkpoint.HostStateRestore)",
    "nvme_save": "NVMe store NVMeStoreSave",
    "nvme_restore": "NVMe store NVMeStoreRestore",
  }
  rows = []
  for key, op in r["operations"].items():
    ratio = op.get("ratio_vs_raw")
    measured = _span(op["gb_per_s"], ".2f", " GB/s") + (
      f" = {ratio['median']:.2f}x raw (paired)" if ratio else ""
    )
    goal = op.get("goal_ratio")
    rows.append(_row("checkpoint", f"{labels[key]} GB/s vs raw disk ({r['state_bytes'] / 1e9:.2f}"
                     " GB)", "report" if goal is None else f">= {goal}x", measured,
                     None if goal is None else op["meets_goal"]))  # fmt: skip
  return rows


def rows_gpu_check(r: dict[str, Any]) -> list[Row]:
  rows = []
  what = "streamed host tier step / state on the device (GPU)"
  t = r.get("time", {}).get("stream")
  if t is None:  # the section failed or was skipped: its error is in the JSON
    rows.append(_row("gpu_check", what, "<= 1.15x", "not measured", False))
  else:
    rows.append(_row("gpu_check", what, "<= 1.15x", f"{t['ratio']:.3f}x", t["ratio"] <= 1.15))
  train = r.get("train_step_overlap") or {}
  for mode in ("stream", "host_compute"):
    if "ratio" in train.get(mode, {}):
      what = f"Llama train step ({train['n_params'] / 1e6:.0f}M, {train['tokens']} tokens), {mode}"
      rows.append(_row("gpu_check", f"{what} / state on the device (GPU)", "report",
                       f"{train[mode]['ratio']:.3f}x", None))  # fmt: skip
  diffs = {k: v.get("max_abs_diff") for k, v in r.get("correctness", {}).items()}
  if diffs:
    worst = max(diffs.values(), key=lambda d: float("inf") if d is None else d)
    what = "max abs difference from optax after the steps, every mode (GPU)"
    got = "failed" if worst is None else f"{worst:.3g}"
    rows.append(_row("gpu_check", what, "<= 1e-6", got, worst is not None and worst <= 1e-6))
  runs = dict(r.get("measured_vs_compiled") or {})
  runs["params on the host"] = r.get("params_on_host") or {}
  for mode, x in runs.items():
    if not (isinstance(x, dict) and x.get("predicted_peak_bytes") and x.get("peak_bytes")):
      continue
    ratio = x["peak_bytes"] / x["predicted_peak_bytes"]
    mode = {"host": "host compute", "streamed": "streamed host tier"}.get(mode, mode)
    rows.append(
      _row("gpu_check", f"device peak on the GPU / compile_for_gpu's ({mode})", "0.95-1.05x",
           f"{ratio:.4f}x ({x['peak_bytes'] / 1e9:.3f} GB)", 0.95 <= ratio <= 1.05)
    )  # fmt: skip
  hf = r.get("pretrained_checkpoint") or {}
  if hf.get("device_peak_growth_bytes") is not None:
    what, growth = "load_safetensors into pinned_host: device peak growth (GPU)", hf[
      "device_peak_growth_bytes"
    ]  # fmt: skip
    rows.append(_row("gpu_check", what, f"<= {hf['bound_bytes'] / 2**20:.0f} MiB",
                     f"{growth / 2**20:.2f} MiB", bool(hf["within_bound"])))  # fmt: skip
  if "save_identical" in hf:
    rows.append(_row("gpu_check", "save_safetensors after load: tensors byte-identical", "yes",
                     str(hf["save_identical"]), bool(hf["save_identical"])))  # fmt: skip
  return rows


def rows_gpu_memory(r: dict[str, Any]) -> list[Row]:
  rows = []
  for run in r["runs"]:
    if run["mode"] == "plain":
      continue
    what = (
      f"{run['params'] / 1e9:.2g}B {run['mode']}{' bf16+master' if run['master'] else ''}"
      f"{' update_and_apply' if run.get('fused') else ''}"
    )
    rows.append(
      _row(
        "gpu_memory",
        f"device B/param, XLA:GPU ({what})",
        f"<= {run['bound'] / run['params']:.2f}",
        f"{run['device_per_param']:.2f}",
        bool(run["within_bound"]) and not run["host_compute"],
      )
    )
  return rows


def rows_params_offload(r: dict[str, Any]) -> list[Row]:
  goals = {"13b": 8e9}  # the 13B step within 8 GB (on a 24 GB GPU); the others: fit
  rows = []
  for run in r["runs"]:
    if not run["offloaded"]:
      continue
    goal = goals.get(run["model"], run["target_memory"])
    rows.append(
      _row(
        "params_offload",
        f"device GB, whole step, XLA:GPU ({run['model']} on {run['target']})",
        f"<= {goal / 1e9:.3g}",
        f"{run['device_peak'] / 1e9:.2f}",
        run["device_peak"] <= goal and not run["host_compute"],
      )
    )
  return rows


@dataclasses.dataclass(frozen=True)
class Benchmark:
  name: str
  full: tuple[str, ...]  # arguments of the default run, sized for 2 cores / 24 GiB
  quick: tuple[str, ...]  # arguments of --quick: tiny sizes, seconds
  budget_s: float  # its share of the 15 minutes of the default run
  rows: Callable[[dict[str, Any]], list[Row]]
  needs_gpu: bool = False
  takes_dir: bool = False  # measures a filesystem: gets --dir


BENCHMARKS = (
  Benchmark("host_overhead", (), ("--size-scale", "0.01", "--steps", "2"), 120,
            rows_host_overhead),
  # 64M and 256M (about 5 minutes with DeepSpeed); the script alone adds 1B.
  Benchmark("host_adam", ("--sizes-m", "64", "256", "--steps", "5", "--repeats", "2"),
            ("--sizes-m", "0.1", "--threads", "1", "--steps", "1", "--repeats", "1"), 300,
            rows_host_adam),
  Benchmark("nvme_throughput", ("--no-nofsync", "--steps", "5", "--time-budget-s", "220"),
            ("--params-m", "2", "--raw-gib", "0.05", "--steps", "1", "--no-nofsync",
             "--no-plain-malloc", "--raw-passes", "1"),
            240, rows_nvme_throughput, takes_dir=True),
  Benchmark("scaling", (),
            ("--host-sizes-m", "1", "2", "--nvme-sizes-m", "1", "2", "--steps", "1"),
            180, rows_scaling, takes_dir=True),
  Benchmark("checkpoint", (),
            ("--params-m", "1", "--raw-gib", "0.02", "--steps", "1", "--raw-passes", "1"),
            120, rows_checkpoint, takes_dir=True),
  # 0.1B and 1B (about 3 minutes: host compute compiles slowest); the script adds 7B and 13B.
  Benchmark("gpu_memory", ("--sizes-b", "0.1", "1"), ("--sizes-b", "0.01"), 180,
            rows_gpu_memory),
  # The 13B and 70B-shaped train steps with params and gradients on the host (about 30 s).
  Benchmark("params_offload", (), ("--model", "tiny"), 60, rows_params_offload),
  Benchmark("gpu_check", (), ("--size-scale", "0.001", "--steps", "2"), 300, rows_gpu_check,
            needs_gpu=True),
)  # fmt: skip
NAMES = tuple(b.name for b in BENCHMARKS)


# -- running -------------------------------------------------------------------


def probe_environment() -> dict[str, Any]:
  """`_common.environment()` from a subprocess.

  Not in this process: on a GPU machine JAX would claim most of the GPU's memory here, for the
  whole run, and the benchmarks run beside this process.
  """
  code = "import json; from benchmarks import _common; print(json.dumps(_common.environment()))"
  proc = subprocess.run([sys.executable, "-c", code], cwd=_REPO_ROOT, capture_output=True,
                        text=True, check=False, timeout=300)  # fmt: skip
  if proc.returncode != 0:
    raise SystemExit(f"cannot import jax, optax and offlax:\n{proc.stderr}")
  return json.loads(proc.stdout.splitlines()[-1])


def run_one(bench: Benchmark, args: argparse.Namespace) -> dict[str, Any]:
  """Runs one benchmark in a subprocess; its status, wall time, peak RSS and summary rows."""
  cmd = [sys.executable, "-m", f"benchmarks.{bench.name}",
         *(bench.quick if args.quick else bench.full), "--out", str(args.out)]  # fmt: skip
  if bench.takes_dir and args.dir is not None:
    cmd += ["--dir", str(args.dir)]
  print(f"\n=== {bench.name}: {' '.join(cmd[1:])}", flush=True)
  json_path = args.out / f"{bench.name}.json"
  start = time.time()
  proc = subprocess.Popen(cmd, cwd=_REPO_ROOT)
  # SIGTERM first: nvme_throughput and scaling then remove their data on disk.
  timer = threading.Timer(args.timeout_s, proc.send_signal, (signal.SIGTERM,))
  timer.start()
  try:
    _, status, usage = os.wait4(proc.pid, 0)
  finally:
    timer.cancel()
  proc.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait again
  record: dict[str, Any] = {
    "command": cmd[1:],
    "returncode": proc.returncode,
    "wall_s": time.time() - start,
    "budget_s": bench.budget_s,
    "peak_rss_bytes": usage.ru_maxrss * 1024,  # the largest of its processes (Linux: KiB)
  }
  # A JSON from an earlier run is not this run's result.
  if not json_path.exists() or json_path.stat().st_mtime < start:
    record["status"] = f"FAILED: exit {proc.returncode}, no {json_path.name}"
    record["rows"] = [_row(bench.name, "-", "-", record["status"], False)]
    return record
  record["status"] = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
  try:
    record["rows"] = bench.rows(json.loads(json_path.read_text()))
  except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
    record["rows"] = [_row(bench.name, "-", "-", f"unreadable result: {e!r}", False)]
  return record


def met_text(met: bool | None) -> str:
  return {True: "yes", False: "NO", None: "-"}[met]


def summary_markdown(summary: dict[str, Any]) -> str:
  lines = [
    f"# offlax benchmarks: summary ({summary['date']}, {'quick' if summary['quick'] else 'full'}"
    f" run, {summary['cpu_count']} CPUs, {summary['backend']} backend, jax "
    f"{summary['jax_version']})",
    "",
    "| benchmark | measure | goal | measured (median (min to max)) | met? |",
    "| --- | --- | --- | --- | --- |",
  ]
  lines += [
    f"| {r['benchmark']} | {r['measure']} | {r['goal']} | {r['measured']} | {met_text(r['met'])} |"
    for r in summary["rows"]
  ]
  lines += ["", "| benchmark | status | wall s | budget s | peak RSS GiB |", "| --- | --- | --- |"
            " --- | --- |"]  # fmt: skip
  for name, b in summary["benchmarks"].items():
    wall = f"{b['wall_s']:.0f}" if "wall_s" in b else "-"
    rss = f"{b['peak_rss_bytes'] / 2**30:.2f}" if "peak_rss_bytes" in b else "-"
    lines.append(f"| {name} | {b['status']} | {wall} | {b['budget_s']:.0f} | {rss} |")
  lines.append(f"\nTotal wall time {summary['wall_s']:.0f} s (budget {TOTAL_BUDGET_S} s).")
  return "\n".join(lines) + "\n"


def summary_table(summary: dict[str, Any]) -> str:
  rows = summary["rows"]
  cols = ("benchmark", "measure", "goal", "measured", "met?")
  cells = [[r["benchmark"], r["measure"], r["goal"], r["measured"], met_text(r["met"])]
           for r in rows]  # fmt: skip
  widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
  fmt = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths, strict=True))  # noqa: E731
  lines = ["", "=== summary " + "=" * 60, fmt(cols), fmt(["-" * w for w in widths])]
  lines += [fmt(c) for c in cells]
  lines.append("")
  for name, b in summary["benchmarks"].items():
    if "wall_s" in b:
      over = "" if summary["quick"] or b["wall_s"] <= b["budget_s"] else " OVER BUDGET"
      lines.append(
        f"{name:<16} {b['status']:<28} {b['wall_s']:>6.0f} s (budget {b['budget_s']:.0f} s"
        f"{over}), peak RSS {b['peak_rss_bytes'] / 2**30:.2f} GiB"
      )
    else:
      lines.append(f"{name:<16} {b['status']}")
  lines.append(f"total {summary['wall_s']:.0f} s (budget {TOTAL_BUDGET_S} s for the full run)")
  return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds per benchmark")
  parser.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME",
                      help=f"run only these ({', '.join(NAMES)})")  # fmt: skip
  parser.add_argument(
    "--timeout-s", type=float, default=1800, help="stop a benchmark after this long (1800)"
  )
  parser.add_argument(
    "--dir", type=pathlib.Path,
    help="filesystem for the disk benchmarks (nvme_throughput, scaling, checkpoint) (/tmp)",
  )  # fmt: skip
  _common.add_out_argument(parser, "<name>")  # and summary.json, summary.md
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  start = time.time()
  args.out.mkdir(parents=True, exist_ok=True)
  env = probe_environment()
  benchmarks: dict[str, dict[str, Any]] = {}
  rows: list[Row] = []
  for bench in BENCHMARKS:
    if args.only and bench.name not in args.only:
      benchmarks[bench.name] = {"status": "not run (--only)", "budget_s": bench.budget_s}
      continue
    if bench.needs_gpu and env["backend"] != "gpu":
      status = f"needs GPU: not run (backend {env['backend']})"
      benchmarks[bench.name] = {"status": status, "budget_s": bench.budget_s}
      rows.append(_row(bench.name, "GPU checks (see gpu_check.py)", "-", status, None))
      continue
    benchmarks[bench.name] = run_one(bench, args)
    rows += benchmarks[bench.name]["rows"]
    print(f"=== {bench.name}: {benchmarks[bench.name]['wall_s']:.0f} s", flush=True)
  summary = {
    "benchmark": "summary",
    **env,
    "quick": args.quick,
    "only": args.only,
    "rows": rows,
    "benchmarks": benchmarks,
    "wall_s": time.time() - start,
  }
  _common.write_json(summary, args.out / "summary.json")
  (args.out / "summary.md").write_text(summary_markdown(summary))
  print(summary_table(summary), flush=True)
  return summary


if __name__ == "__main__":
  outcome = main()
  sys.exit(0 if all(b["status"] == "ok" or "not run" in b["status"]
                    for b in outcome["benchmarks"].values()) else 1)  # fmt: skip
