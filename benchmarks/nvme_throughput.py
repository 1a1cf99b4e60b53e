"""Sustained state throughput of `offlax.NVMeTier` against the raw disk, and its RAM footprint.

What is measured, in one run and on one filesystem (a fresh directory under
`--dir`, default /tmp, removed at the end even on failure; its `df` is printed):

1. Raw sequential bandwidth of the disk: a file of `--raw-gib` GiB is written,
   fsynced, then read back, in 16 MiB blocks with direct I/O (`O_DIRECT`), by
   `fio` when it is installed, otherwise by a Python loop over page-aligned
   (mmap) buffers. Write and read GB/s are reported separately. This is done
   before and again after the tier runs (`--raw-passes 2`), so a drift of the
   disk's speed shows; the figure used is total bytes / total time.
2. The NVMe tier's throughput during training steps: `optax.adam(1e-3)` on
   `--params-m` million fp32 parameters (default 320M: a 2.56 GB Adam state, two
   moments of 4 bytes per parameter) in 40 leaves (32 matrices and 8 bias-like
   vectors), offloaded with `offlax.offload(optax.adam(1e-3), NVMeTier(...))`,
   `cache_bytes` of 64 MiB and the tier's default `chunk_bytes`, 16 MiB (capped
   at 1/32 and 1/8 of the state for small `--params-m`, so most of it still
   lives on disk and is streamed in several slices). `tx.init` is timed (the initial
   write of the whole state). The step is
   `params, state = jit(step, donate_argnums=(0, 1))(params, state, grads)`, with
   `tx.update` and `optax.apply_updates`. Two untimed warm-up steps come first:
   the state `tx.init` returns holds uncommitted scalars (`count`, `step`) that
   the step returns committed, so the second call compiles the step again.
   Then `--steps` steps are timed, each up to `jax.block_until_ready`.
   Each step reads every on-disk byte once and writes the whole state once (the
   on-disk arrays as they are updated, the cached ones at the commit), so
   GB/s = (bytes read + bytes written) / step time. The ratio to the raw disk
   compares step time with the time the raw disk needs for the same traffic:
   `bytes_read / raw_read + bytes_written / raw_write` (reading, then writing),
   or, if less, the same traffic at the rate measured with readers and writers
   at once (as the tier moves it), shown as "raw combined" GB/s; the goal is
   >= 0.8x. Each raw rate is the best of 1 and 4 concurrent streams (the tier
   has 4 I/O threads).
   The run is done with `fsync=True` (the default: every commit is flushed) and,
   if the whole run is then still expected to end within `--time-budget-s`,
   with `fsync=False`. Both start every step with a cold page cache for the
   store (`os.sync` and `posix_fadvise(DONTNEED)` on its files, outside the
   timed region; `--warm-cache` skips this), as for a state larger than RAM;
   otherwise reads of a 2.56 GB state on a machine with more RAM would come
   from the page cache. With `fsync=False` the step's writes only reach the
   page cache; the `os.sync` after each step that flushes them is timed too
   ("writeback"), and the sustained figure including it is reported.
   For context, the same jitted step with plain `optax.adam` (state in RAM) is
   timed: the pure compute part of a step.
   Where the time of a tier step goes is recorded by wrapping (timing only)
   the tier's callbacks: waiting for reads, writing updated slices (to the page
   cache), and the commit (cached arrays written, then the flush and the
   metadata rename).
3. Host RAM: each measurement of part 2 runs in a fresh subprocess
   (benchmarks/_tier_child.py), which reports as JSON on stdout its RSS right after allocating
   params and grads (the baseline) and its peak RSS (VmHWM, reset with
   /proc/self/clear_refs before each phase: init, compile and warm-up, timed
   steps; `ru_maxrss` over the whole process as well). The summary gives the
   peak during the timed steps above the baseline, against `cache_bytes` and
   against the state size, and the part of it that is transient within the
   steps (peak minus the RSS right before them: what compiling left behind is
   not in it). The plain-optax subprocess gives the same figures for reference.

Results go to `<out>/nvme_throughput.json` and a bar plot `<out>/nvme_throughput.png`
(GB/s of the disk and of the tier; RAM of the tier against cache and state).

Reproduce (from the repository root):

  python benchmarks/nvme_throughput.py                      # 320M params, 2 GiB raw file
  python benchmarks/nvme_throughput.py --dir /mnt/nvme --steps 5
  python benchmarks/nvme_throughput.py --params-m 2 --raw-gib 0.05 --steps 1 --out /tmp/bench

Disk: the raw file, later two generations of the state (5.2 GB at the default
size). Memory: params and grads (2.56 GB) in each subprocess, plus the Adam
state (another 2.56 GB) for the plain-optax reference. Takes a few minutes at
the default size on a disk of about 2 GB/s.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# benchmarks/_common.py holds what the benchmark scripts share (_disk.py the disk benchmarks'
# toolkit, _tier_child.py the measured steps). It is imported as `benchmarks._common` however
# this file is run: `python -m benchmarks.<name>` has the repository root on sys.path already,
# while `python benchmarks/<name>.py` (only this directory on sys.path; also how run_child starts
# its subprocess) and loading the file by path with
# importlib.util.spec_from_file_location (no parent package, so no relative import either) do not;
# hence the repository root, this directory's parent, is added when missing. Appended, not
# prepended, so installed packages (offlax itself) still come first.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
  sys.path.append(_REPO_ROOT)
from benchmarks import _common, _disk, _tier_child  # noqa: E402

GB, MiB, GiB = _disk.GB, _disk.MiB, _disk.GiB
GOAL_RATIO = 0.8


# -- reporting ---------------------------------------------------------------

# The tier runs: (name in tables, key in the results, plot colour).
TIER_RUNS = (
  ("fsync=True", "fsync", "tab:blue"),
  ("fsync=True, glibc.malloc.hugetlb=1", "hugetlb", "tab:purple"),
  ("fsync=False", "nofsync", "tab:orange"),
)


def summarize_tier(child: dict[str, Any], raw: dict[str, Any] | None) -> dict[str, Any]:
  """Derived figures of one tier run: traffic, GB/s, ratio to the raw disk, RAM."""
  if "error" in child:
    return {"error": child["error"]}
  read_b, write_b = child["cold_bytes"], child["state_bytes"]
  moved = read_b + write_b
  times = child["times_s"]
  s: dict[str, Any] = {
    "bytes_read_per_step": read_b,
    "bytes_written_per_step": write_b,
    "step_s": _common.stats_of(times),
    "gb_per_s": _common.stats_of([moved / t / GB for t in times]),
    "init_gb_per_s": child["state_bytes"] / child["init_s"] / GB,
    "glibc_tunables": child.get("glibc_tunables", ""),
    "peak_rss_above_baseline_bytes": child["peak_rss_steps_bytes"] - child["baseline_rss_bytes"],
    "peak_rss_rise_during_steps_bytes": (
      child["peak_rss_steps_bytes"] - child["rss_before_steps_bytes"]
      if child.get("rss_before_steps_bytes")
      else None
    ),
    "peak_rss_above_baseline_whole_bytes": max(
      child["peak_rss_init_bytes"], child.get("peak_rss_compile_bytes", 0),
      child["peak_rss_steps_bytes"], child["ru_maxrss_bytes"],
    ) - child["baseline_rss_bytes"],
  }  # fmt: skip
  if raw is not None:
    s["raw_equivalent_s"] = raw_s = _disk.raw_seconds(raw, read_b, write_b)
    s["ratio_vs_raw"] = _common.stats_of([raw_s / t for t in times])
  if child.get("writeback_s"):
    total = [t + w for t, w in zip(times, child["writeback_s"], strict=True)]
    s["step_plus_writeback_s"] = _common.stats_of(total)
    s["gb_per_s_incl_writeback"] = _common.stats_of([moved / t / GB for t in total])
    if raw is not None:
      s["ratio_vs_raw_incl_writeback"] = _common.stats_of(
        [s["raw_equivalent_s"] / t for t in total]
      )
  if child.get("device_bytes_read_written"):
    moved_by_disk = child["device_bytes_read_written"]
    s["device_bytes_per_step"] = {
      rw: statistics.median(m[i] for m in moved_by_disk) for i, rw in enumerate(("read", "written"))
    }
  if child.get("breakdown_s"):
    keys = child["breakdown_s"][0].keys()
    s["breakdown_median_s"] = {
      k: statistics.median(b[k] for b in child["breakdown_s"]) for k in keys
    }
  return s


def verdict(ratio: float | None) -> str:
  if ratio is None:
    return "n/a"
  return f"{ratio:.2f}x {'>=' if ratio >= GOAL_RATIO else '<'} {GOAL_RATIO}x " + (
    "(OK)" if ratio >= GOAL_RATIO else "(BELOW GOAL)"
  )


def summary_table(result: dict[str, Any]) -> str:
  raw, fs = result["raw"], result["filesystem"]
  tiers, load = result["tier"], result["loadavg_1m_before_after"]
  lines = [
    f"nvme_throughput: optax.adam state of {result['params'] / 1e6:.1f}M fp32 params "
    f"({result['state_bytes'] / GB:.2f} GB) in {result['leaves']} leaves, cache_bytes "
    f"{result['cache_bytes'] / MiB:.0f} MiB, chunk_bytes {result['chunk_bytes'] / MiB:.0f} MiB, "
    f"{result['steps']} timed steps (+{result['warmup']} warm-up)",
    f"filesystem: {fs['path']} on {fs.get('device', '?')} ({fs.get('fstype', '?')}), "
    f"{fs['free_bytes'] / GiB:.0f} GiB free; page cache "
    f"{'warm' if result['warm_cache'] else 'dropped before each step'}; "
    f"{result['cpu_count']} CPUs (load average {load[0]:.1f} at start, {load[1]:.1f} at end), "
    f"jax {result['jax_version']} ({result['backend']}), {result['wall_s']:.0f} s in all",
  ]
  header = f"{'measurement':<44} {'GB/s med':>9} {'min':>6} {'max':>6} {'step s':>7} {'vs raw':>7}"
  lines += [header, "-" * len(header)]

  def row(name, gbps=None, lo=None, hi=None, step=None, ratio=None):
    f = lambda x, w, p: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"
    lines.append(
      f"{name:<44} {f(gbps, 9, 2)} {f(lo, 6, 2)} {f(hi, 6, 2)} {f(step, 7, 2)} "
      + (f"{ratio:>6.2f}x" if ratio is not None else f"{'-':>7}")
    )

  if raw.get("error"):
    lines.append(f"raw disk: FAILED: {raw['error']}")
  else:
    tool = raw["tool"]
    n = len([p for p in raw["passes"] if "error" not in p])
    for rw in ("write", "read"):
      row(
        f"raw {rw} ({tool}, {raw['bytes'] / GiB:.2g} GiB x{n})", raw[f"{rw}_bytes_per_s"] / GB,
        raw[f"{rw}_bytes_per_s_min"] / GB, raw[f"{rw}_bytes_per_s_max"] / GB,
      )  # fmt: skip
    if "mixed_bytes_per_s" in raw:
      row(
        "raw mixed (reading and writing at once)", raw["mixed_bytes_per_s"] / GB,
        raw["mixed_bytes_per_s_min"] / GB, raw["mixed_bytes_per_s_max"] / GB,
      )  # fmt: skip
    if result.get("raw_combined_gb_per_s"):
      row("raw combined (tier's read/write mix)", result["raw_combined_gb_per_s"])
  for name, key, _ in TIER_RUNS:
    t = tiers.get(key)
    if key in result["skipped"]:
      lines.append(f"tier step, {name}: {result['skipped'][key]}")
    if t is None:
      continue
    if "error" in t:
      lines.append(f"tier {name}: FAILED: {t['error'].strip().splitlines()[-1]}")
      continue
    row(f"tier init write, {name}", t["init_gb_per_s"])
    g, st, r = t["gb_per_s"], t["step_s"], t.get("ratio_vs_raw", {})
    row(f"tier step, {name}", g["median"], g["min"], g["max"], st["median"], r.get("median"))
    if "gb_per_s_incl_writeback" in t:
      g, st = t["gb_per_s_incl_writeback"], t["step_plus_writeback_s"]
      r = t.get("ratio_vs_raw_incl_writeback", {})
      row(f"tier step + writeback, {name}", g["median"], g["min"], g["max"], st["median"],
          r.get("median"))  # fmt: skip
  c = result.get("compute")
  if c and "error" not in c:
    row("plain optax.adam step in RAM (compute)", step=c["step_s"]["median"])
  elif c:
    lines.append(f"plain optax.adam: FAILED: {c['error'].strip().splitlines()[-1]}")

  compute_s = c["step_s"]["median"] if c and "error" not in c else None
  for name, key, _ in TIER_RUNS:
    t = tiers.get(key)
    b = t.get("breakdown_median_s") if t and "error" not in t else None
    if b:
      step_s = t["step_s"]["median"]
      other = step_s - b["read_callback"] - b["write_callback"] - b["commit_callback"]
      lines.append(
        f"tier {name} step {step_s:.2f} s = read callbacks {b['read_callback']:.2f} + write"
        f" callbacks {b['write_callback']:.2f} + commit {b['commit_callback']:.2f} (flush"
        f" {b['commit_flush']:.2f}) + rest {other:.2f} s"
        + ("" if compute_s is None else f" (plain adam step: {compute_s:.2f} s)")
      )
  for name, key, _ in TIER_RUNS:
    t = tiers.get(key)
    d = t.get("device_bytes_per_step") if t and "error" not in t else None
    if d:
      lines.append(
        f"tier {name}: the disk's own counters per step (median): read {d['read'] / GB:.2f} GB,"
        f" written {d['written'] / GB:.2f} GB (the step's state traffic: read"
        f" {t['bytes_read_per_step'] / GB:.2f} GB,"
        f" written {t['bytes_written_per_step'] / GB:.2f} GB)"
      )
  for name, key, _ in TIER_RUNS:
    t = tiers.get(key)
    if t and "error" not in t:
      peak = t["peak_rss_above_baseline_bytes"]
      lines.append(
        f"RAM, tier {name}: peak RSS during steps above params+grads {peak / MiB:,.0f} MiB = "
        f"{peak / result['cache_bytes']:.1f}x cache_bytes, {peak / result['state_bytes']:.0%} of "
        f"the state ({result['state_bytes'] / MiB:,.0f} MiB); whole process "
        f"{t['peak_rss_above_baseline_whole_bytes'] / MiB:,.0f} MiB above"
      )
      rise = t["peak_rss_rise_during_steps_bytes"]
      if rise is not None:
        lines.append(
          f"  of which transient within the timed steps (peak minus RSS before them): "
          f"{rise / MiB:,.0f} MiB = {rise / result['cache_bytes']:.1f}x cache_bytes"
        )
  if compute_s is not None:
    peak = c["peak_rss_steps_bytes"] - c["baseline_rss_bytes"]
    lines.append(
      f"RAM, plain optax.adam: peak RSS during steps above params+grads {peak / MiB:,.0f} MiB "
      f"(its state alone is {result['state_bytes'] / MiB:,.0f} MiB)"
    )
  verdicts = []
  for name, key, _ in TIER_RUNS:
    t = tiers.get(key)
    if t and "error" not in t and "ratio_vs_raw" in t:
      verdicts.append(f"{name} {verdict(t['ratio_vs_raw']['median'])}")
  lines.append(
    f"tier step vs raw disk for the same traffic, goal >= {GOAL_RATIO:.1f}x: "
    + ("; ".join(verdicts) if verdicts else "n/a")
  )
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  raw, tiers = result["raw"], result["tier"]
  bars = _disk.raw_bars(raw)
  if bars and result.get("raw_combined_gb_per_s"):
    v = result["raw_combined_gb_per_s"]
    bars.append(("raw combined\n(tier's R+W mix)", v, v, v, "dimgray", ""))
  for name, key, color in TIER_RUNS:
    label = "tier step\n" + name.replace(", ", "\n")
    t = tiers.get(key)
    if t and "error" not in t:
      bars.append(_disk.stats_bar(label, t["gb_per_s"], t.get("ratio_vs_raw"), color))
      if "gb_per_s_incl_writeback" in t:
        wb = t["gb_per_s_incl_writeback"], t.get("ratio_vs_raw_incl_writeback")
        bars.append(_disk.stats_bar(label + "\n+ writeback", *wb, "navajowhite"))

  fig, (ax, ax2) = plt.subplots(
    1, 2, figsize=(14, 6), dpi=120, gridspec_kw={"width_ratios": [1.7, 1]}
  )
  if bars:
    _common.draw_bars(ax, bars, headroom=1.2)
  if result.get("raw_combined_gb_per_s"):
    ax.axhline(
      GOAL_RATIO * result["raw_combined_gb_per_s"], color="tab:red", linestyle="--",
      linewidth=1, label=f"goal: {GOAL_RATIO:.1f}x raw combined",
    )  # fmt: skip
    ax.legend(loc="upper right", fontsize=9)
  ax.set_ylabel("GB/s (1 GB = 1e9 bytes)")
  ax.set_title(
    "sequential disk bandwidth (O_DIRECT) vs NVMe-tier step throughput\n"
    "(tier: state bytes read + written per step / step time)",
    fontsize=10,
  )
  ax.grid(axis="y", alpha=0.3)

  mem = [("cache_bytes", result["cache_bytes"], "tab:green")]
  for name, key, color in TIER_RUNS:
    label = "tier\n" + name.replace(", ", "\n")
    t = tiers.get(key)
    if t and "error" not in t:
      mem.append((label, t["peak_rss_above_baseline_bytes"], color))
  mem.append(("full Adam\nstate", result["state_bytes"], "tab:gray"))
  c = result.get("compute")
  if c and "error" not in c:
    peak = c["peak_rss_steps_bytes"] - c["baseline_rss_bytes"]
    mem.append(("plain\noptax.adam", peak, "silver"))
  x = np.arange(len(mem))
  vals = np.array([m[1] for m in mem]) / MiB
  ax2.bar(x, vals, color=[m[2] for m in mem])
  for xi, v in zip(x, vals, strict=True):
    _common.label_above(ax2, f"{v:,.0f} MiB", (xi, v), dy=3)
  ax2.set_xticks(x, [m[0] for m in mem], fontsize=8)
  ax2.set_ylim(0, max(vals) * 1.18)
  ax2.set_ylabel("MiB of host RAM")
  ax2.set_title(
    "host RAM: cache_bytes, peak RSS during the timed steps\nabove params + grads, state size",
    fontsize=10,
  )
  ax2.grid(axis="y", alpha=0.3)
  fs = result["filesystem"]
  title = (
    f"offlax NVMeTier: Adam, {result['params'] / 1e6:.0f}M params "
    f"({result['state_bytes'] / GB:.2f} GB state), {result['steps']} steps, "
    f"{fs.get('fstype', '?')} on {fs.get('device', '?')}; whiskers: min to max"
  )
  _common.save_png(fig, path, suptitle=title)


# -- main --------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  _tier_child.add_params_argument(parser, params_m=320.0)
  _disk.add_raw_arguments(parser, raw_gib=2.0)
  _common.add_steps_arguments(
    parser, steps=3,
    warmup_help="untimed steps after init (2: the second step compiles again, see the docstring)",
  )  # fmt: skip
  _common.add_dir_argument(parser, "the raw file and the stores")
  _common.add_out_argument(parser, "nvme_throughput")
  parser.add_argument(
    "--cache-mib", type=float, default=None,
    help="NVMeTier cache_bytes in MiB (64, capped at 1/32 of the state)",
  )  # fmt: skip
  parser.add_argument(
    "--chunk-mib", type=float, default=None,
    help="NVMeTier chunk_bytes in MiB (16, the tier's default, capped at 1/8 of the state)",
  )  # fmt: skip
  parser.add_argument(
    "--readahead", type=int, default=2, help="NVMeTier readahead: slices read ahead (2)"
  )
  parser.add_argument("--no-nofsync", action="store_true", help="skip the fsync=False run")
  parser.add_argument(
    "--no-hugetlb", action="store_true",
    help=f"skip the fsync=True run started with GLIBC_TUNABLES={_tier_child.HUGETLB} "
    "(run if time allows)",
  )  # fmt: skip
  parser.add_argument(
    "--time-budget-s", type=float, default=600,
    help="run the fsync=False variant only if the whole run should still end within this (600)",
  )  # fmt: skip
  parser.add_argument("--no-compute", action="store_true", help="skip the plain-optax reference")
  parser.add_argument(
    "--warm-cache", action="store_true",
    help="do not evict the store's page cache before each step",
  )  # fmt: skip
  parser.add_argument(
    "--child-timeout", type=float, default=1800, help="seconds per subprocess (1800)"
  )
  args = parser.parse_args(argv)
  _common.check_steps_arguments(parser, args)
  if not args.params_m > 0:
    parser.error("--params-m must be > 0")
  _disk.check_raw_arguments(parser, args)
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, writes the JSON and PNG, prints and returns the results."""
  args = parse_args(argv)
  # Only _common.environment() uses these, at the end; imported before the clock starts so that
  # their import time stays out of wall_s.
  import jax  # noqa: F401
  import optax  # noqa: F401

  import offlax  # noqa: F401

  wall_start = time.perf_counter()
  load_before = os.getloadavg()
  shapes = _tier_child.param_shapes(args.params_m)
  n_params = sum(math.prod(s) for s in shapes.values())
  state_bytes = n_params * _tier_child.STATE_BYTES_PER_PARAM
  cache, chunk = _tier_child.auto_tier_bytes(
    state_bytes,
    None if args.cache_mib is None else int(args.cache_mib * MiB),
    None if args.chunk_mib is None else int(args.chunk_mib * MiB),
  )
  print(
    f"model: {n_params:,} fp32 params ({n_params * 4 / GB:.2f} GB) in {len(shapes)} leaves; "
    f"Adam state {state_bytes / GB:.2f} GB; cache_bytes {cache / MiB:.1f} MiB, "
    f"chunk_bytes {chunk / MiB:.1f} MiB",
    flush=True,
  )

  args.dir.mkdir(parents=True, exist_ok=True)
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="offlax-nvme-bench-", dir=args.dir))
  try:
    fs = _disk.filesystem_info(workdir)
    print(fs["df"] or f"{workdir}: {fs['free_bytes'] / GiB:.1f} GiB free", flush=True)
    block = _disk.RAW_BLOCK_BYTES
    raw_bytes = max(1, math.ceil(args.raw_gib * GiB / block)) * block
    need = max(raw_bytes, 2 * state_bytes) * 1.1 + 256 * MiB
    if fs["free_bytes"] < need:
      raise SystemExit(
        f"{workdir}: {fs['free_bytes'] / GiB:.1f} GiB free, the benchmark needs "
        f"{need / GiB:.1f} GiB (raw file, then two generations of the state)"
      )

    passes = [_disk.raw_pass(workdir, args, "before")]

    runs = [("fsync", "tier", True)]
    if not args.no_compute:
      runs.append(("compute", "compute", True))
    if not args.no_hugetlb:
      runs.append(("hugetlb", "tier", True))
    if not args.no_nofsync:
      runs.append(("nofsync", "tier", False))
    children: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for key, mode, fsync in runs:
      elapsed = time.perf_counter() - wall_start
      if key in ("hugetlb", "nofsync") and "wall_s" in children["fsync"]:
        # "If time allows": it does the same work as the fsync=True run.
        expected = elapsed + children["fsync"]["wall_s"]
        if expected > args.time_budget_s:
          skipped[key] = (
            f"skipped: would end at about {expected:.0f} s, over --time-budget-s "
            f"{args.time_budget_s:.0f} (the fsync=True run took "
            f"{children['fsync']['wall_s']:.0f} s)"
          )
          print(f"-- {key} {skipped[key]} --", flush=True)
          continue
      print(f"-- subprocess: {key} --", flush=True)
      children[key] = _tier_child.run_child(
        args, mode, fsync, workdir / f"store_{key}", cache, chunk, hugetlb=key == "hugetlb"
      )
      if "error" in children[key]:
        print(f"{key} FAILED:\n{children[key]['error']}", flush=True)
    if args.raw_passes > 1:  # again after the tier, to catch a drift of the disk's speed
      passes.append(_disk.raw_pass(workdir, args, "after"))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)

  raw = _disk.combine_raw(passes)
  raw_ok = None if raw.get("error") else raw
  tier = {k: summarize_tier(children[k], raw_ok) for _, k, _ in TIER_RUNS if k in children}
  compute = children.get("compute")
  if compute is not None and "error" not in compute:
    compute = {**compute, "step_s": _common.stats_of(compute["times_s"])}
  combined = None  # raw GB/s for the tier's read/write mix (harmonic combination)
  first = next((t for t in tier.values() if "raw_equivalent_s" in t), None)
  if first is not None:
    moved = first["bytes_read_per_step"] + first["bytes_written_per_step"]
    combined = moved / first["raw_equivalent_s"] / GB

  result = {
    "benchmark": "nvme_throughput",
    **_common.environment(),
    "filesystem": fs,
    "params_m": args.params_m,
    "params": n_params,
    "leaves": len(shapes),
    "leaf_shapes": {k: list(s) for k, s in shapes.items()},
    "state_bytes": state_bytes,
    "cache_bytes": cache,
    "chunk_bytes": chunk,
    "steps": args.steps,
    "warmup": args.warmup,
    "warm_cache": args.warm_cache,
    "goal_ratio": GOAL_RATIO,
    "raw": raw,
    "raw_combined_gb_per_s": combined,
    "tier": tier,
    "compute": compute,
    "children": children,
    "skipped": skipped,
  }
  result["wall_s"] = time.perf_counter() - wall_start
  result["loadavg_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
  result["ok"] = (
    not raw.get("error")
    and all("error" not in c for c in children.values())
  )  # fmt: skip

  _common.write_outputs(result, args.out, "nvme_throughput", plot, summary_table)
  return result


if __name__ == "__main__":
  _common.exit_on_sigterm()
  outcome = main()
  sys.exit(0 if outcome.get("ok", "error" not in outcome) else 1)
