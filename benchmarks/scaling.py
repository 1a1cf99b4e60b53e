"""How step time and host RAM grow with the optimizer state, host tier and NVMe tier.

What is measured: for each size, one fresh subprocess runs the jitted Adam step of
nvme_throughput.py (`tx.update` + `optax.apply_updates`, params and state donated, the same 40
fp32 leaves: 32 matrices, 8 vectors) with

- the host tier, `offlax.offload(optax.adam(1e-3))` (state in `pinned_host` memory), at
  `--host-sizes-m` (default 16, 32, 64, 128, 256 million params: 128 MB to 2 GB of state);
- the NVMe tier, `offlax.offload(optax.adam(1e-3), NVMeTier(...))` with a 64 MiB cache
  (`fsync=True`, page cache of the store dropped before each step, so the state comes from the
  disk), at `--nvme-sizes-m` (default 32, 64, 128: every size beyond the cache).

Each size reports the median, min and max step time of `--steps` steps after `--warmup`, and the
peak RSS during the timed steps above the RSS with params and gradients allocated (what the
optimizer state costs in RAM; one subprocess per size, so one size's peak is not another's).
For each tier the figures are fitted two ways: a straight line, time = fixed + per-param cost x
params (least squares; its per-param cost in ns, fixed part in ms), and a power law, the slope of
log(time) against log(params): 1.0 is linear growth, the goal is <= 1.1 (no worse than linear),
for the step time and for the RAM. Per-param costs at each size are in the table and the JSON.

On the CPU backend the host tier's `pinned_host` is ordinary RAM, so its RAM figure is the state
itself plus the step's temporaries; the NVMe tier's is its cache and slices plus the updates tree
that `update` returns (in RAM on the CPU backend, see nvme_throughput.py), which grows with the
params too.

Results go to `<out>/scaling.json` and `<out>/scaling.png` (log-log: step time and RAM against
params, with the straight-line fits).

  python benchmarks/scaling.py                       # ~3 min on 2 cores
  python benchmarks/scaling.py --host-sizes-m 1 2 --nvme-sizes-m 1 2 --steps 1 --out /tmp/b
"""

from __future__ import annotations

import argparse
import math
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# Import path: see the comment in nvme_throughput.py.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
  sys.path.append(_REPO_ROOT)
from benchmarks import _common, _tier_child  # noqa: E402

GOAL_SLOPE = 1.1  # log-log slope: <= 1.1 is linear growth (or better) within noise
TIERS = {"host": "host tier (pinned_host)", "nvme": "NVMe tier (64 MiB cache)"}


def measure(tier: str, params_m: float, args: argparse.Namespace, workdir: pathlib.Path) -> dict:
  """One size of one tier in a fresh subprocess (_tier_child.py's); its record."""
  shapes = _tier_child.param_shapes(params_m)
  n_params = sum(math.prod(s) for s in shapes.values())
  state_bytes = n_params * _tier_child.STATE_BYTES_PER_PARAM
  cache, chunk = _tier_child.auto_tier_bytes(state_bytes, None, None)
  child_args = argparse.Namespace(
    params_m=params_m, steps=args.steps, warmup=args.warmup, warm_cache=False, readahead=2,
    child_timeout=args.child_timeout,
  )  # fmt: skip
  mode = "tier" if tier == "nvme" else "host"
  child = _tier_child.run_child(
    child_args, mode, True, workdir / f"{tier}_{params_m:g}", cache, chunk
  )
  record: dict[str, Any] = {"params_m": params_m, "params": n_params, "state_bytes": state_bytes}
  if "error" in child:
    print(f"{TIERS[tier]}, {params_m:g}M params FAILED:\n{child['error']}", flush=True)
    return {**record, "error": child["error"]}
  if tier == "nvme":
    record["cache_bytes"], record["chunk_bytes"] = cache, chunk
  ram = child["peak_rss_steps_bytes"] - child["baseline_rss_bytes"]
  step = _common.stats_of(child["times_s"], suffix="_s")
  record.update(
    step,
    times_s=child["times_s"],
    ns_per_param=step["median_s"] / n_params * 1e9,
    peak_rss_above_baseline_bytes=ram,
    ram_bytes_per_param=ram / n_params,
    ram_per_state_byte=ram / state_bytes,
    subprocess_wall_s=child["wall_s"],
  )
  print(
    f"{TIERS[tier]}, {n_params / 1e6:.1f}M params: step {step['median_s'] * 1e3:.1f} ms "
    f"({record['ns_per_param']:.2f} ns/param), RAM above params+grads {ram / 2**20:,.0f} MiB "
    f"({record['ram_per_state_byte']:.2f}x the state), {child['wall_s']:.0f} s",
    flush=True,
  )
  return record


def fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float] | None:
  """The line y = intercept + slope * x, and the log-log slope; None below 2 sizes.

  Least squares on relative residuals (weights 1/y): the sizes span 16x, and plain least squares
  would fit the largest sizes only, leaving the small ones far off the line on a log scale.
  """
  if len(xs) < 2 or len(set(xs)) < 2:
    return None
  x, y = np.asarray(xs, float), np.asarray(ys, float)
  weight = 1.0 / np.maximum(np.abs(y), 1e-12)
  slope, intercept = np.polyfit(x, y, 1, w=weight)
  residual = (y - (intercept + slope * x)) * weight
  spread = float(np.sum(((y - np.average(y, weights=weight**2)) * weight) ** 2))
  return {
    "slope": float(slope),
    "intercept": float(intercept),
    "r2": 1.0 - float(np.sum(residual**2)) / spread if spread else 1.0,  # of the weighted fit
    "loglog_slope": float(np.polyfit(np.log(x), np.log(np.maximum(y, 1e-12)), 1)[0]),
  }


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
  """The fits of one tier's sizes: step time (s) and RAM (bytes) against params."""
  ok = [p for p in points if "error" not in p]
  xs = [p["params"] for p in ok]
  return {
    "time_fit": fit(xs, [p["median_s"] for p in ok]),
    "ram_fit": fit(xs, [p["peak_rss_above_baseline_bytes"] for p in ok]),
  }


def verdict(slope: float | None) -> str:
  if slope is None:
    return "n/a"
  ok = slope <= GOAL_SLOPE
  return f"{slope:.2f} {'<=' if ok else '>'} {GOAL_SLOPE} ({'OK' if ok else 'OVER GOAL'})"


def summary_table(result: dict[str, Any]) -> str:
  lines = [
    f"scaling: Adam step, {result['steps']} timed steps (+{result['warmup']} warm-up) per size,"
    f" one subprocess per size, {result['cpu_count']} CPUs, jax {result['jax_version']}"
    f" ({result['backend']})",
  ]
  header = (
    f"{'tier':<26}{'params':>9}{'state MB':>10}{'step ms':>10}{'min':>9}{'max':>9}"
    f"{'ns/param':>10}{'RAM MiB':>9}{'RAM/state':>10}"
  )
  lines += [header, "-" * len(header)]
  for tier, label in TIERS.items():
    for p in result["tiers"].get(tier, {}).get("points", []):
      if "error" in p:
        lines.append(f"{label:<26}{p['params_m']:>8g}M  FAILED: {p['error'].splitlines()[-1]}")
        continue
      lines.append(
        f"{label:<26}{p['params'] / 1e6:>8.1f}M{p['state_bytes'] / 1e6:>10,.0f}"
        f"{p['median_s'] * 1e3:>10.1f}{p['min_s'] * 1e3:>9.1f}{p['max_s'] * 1e3:>9.1f}"
        f"{p['ns_per_param']:>10.2f}{p['peak_rss_above_baseline_bytes'] / 2**20:>9,.0f}"
        f"{p['ram_per_state_byte']:>9.2f}x"
      )
  for tier, label in TIERS.items():
    s = result["tiers"].get(tier)
    if not s:
      continue
    t, r = s["time_fit"], s["ram_fit"]
    if t is None or r is None:
      lines.append(f"{label}: fewer than 2 sizes measured, no fit")
      continue
    lines.append(
      f"{label}: step = {t['intercept'] * 1e3:.1f} ms + {t['slope'] * 1e9:.2f} ns/param "
      f"(R^2 {t['r2']:.3f}); RAM = {r['intercept'] / 2**20:,.0f} MiB + "
      f"{r['slope']:.2f} B/param (R^2 {r['r2']:.3f})"
    )
    lines.append(
      f"  log-log slope, goal <= {GOAL_SLOPE} (linear): step time {verdict(t['loglog_slope'])}; "
      f"RAM {verdict(r['loglog_slope'])}"
    )
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5.5), dpi=120)
  colors = {"host": "tab:blue", "nvme": "tab:orange"}
  for tier, label in TIERS.items():
    s = result["tiers"].get(tier)
    points = [p for p in (s or {}).get("points", []) if "error" not in p]
    if not points:
      continue
    x = np.array([p["params"] for p in points], float)
    med = np.array([p["median_s"] for p in points]) * 1e3
    err = [med - np.array([p["min_s"] for p in points]) * 1e3,
           np.array([p["max_s"] for p in points]) * 1e3 - med]  # fmt: skip
    ram = np.array([p["peak_rss_above_baseline_bytes"] for p in points]) / 2**20
    ax_t.errorbar(x / 1e6, med, yerr=err, fmt="o", capsize=4, color=colors[tier], label=label)
    ax_m.plot(x / 1e6, ram, "o", color=colors[tier], label=f"{label}: peak RSS above params+grads")
    grid = np.geomspace(x.min(), x.max(), 50)
    for ax, f, scale, unit in ((ax_t, s["time_fit"], 1e3, "ms"), (ax_m, s["ram_fit"], 2**-20, "")):
      if f is None:
        continue
      per = f"{f['slope'] * 1e9:.2f} ns/param" if unit == "ms" else f"{f['slope']:.1f} B/param"
      ax.plot(
        grid / 1e6, (f["intercept"] + f["slope"] * grid) * scale, "--", color=colors[tier],
        linewidth=1, label=f"{tier} linear fit: {per}, log-log slope {f['loglog_slope']:.2f}",
      )  # fmt: skip
  all_x = [p["params"] for s in result["tiers"].values() for p in s["points"] if "error" not in p]
  if all_x:
    grid = np.geomspace(min(all_x), max(all_x), 50)
    state = grid * _tier_child.STATE_BYTES_PER_PARAM / 2**20
    ax_m.plot(grid / 1e6, state, ":", color="tab:gray", label="Adam state size (8 B/param)")
  ticker = plt.matplotlib.ticker
  for ax in (ax_t, ax_m):
    ax.set_xscale("log")
    ax.set_yscale("log")
    # Plain numbers, not 2x10^1: ticks at the measured sizes.
    ticks = sorted(set(all_x))
    ax.set_xticks([t / 1e6 for t in ticks], [f"{t / 1e6:.3g}" for t in ticks])
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("parameters (millions, fp32; log scale)")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  ax_t.set_ylabel("time per Adam step (ms, log scale)")
  ax_t.set_title("step time: median, whiskers min to max", fontsize=10)
  ax_m.set_ylabel("host RAM (MiB, log scale)")
  ax_m.set_title("peak RSS during the timed steps above params + grads", fontsize=10)
  title = (
    f"offlax scaling: Adam state growing, {result['steps']} steps per size after "
    f"{result['warmup']}, {result['cpu_count']} CPUs, {result['backend']} backend "
    f"({result['date'][:10]})"
  )
  _common.save_png(fig, path, suptitle=title)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--host-sizes-m", type=float, nargs="*", default=[16, 32, 64, 128, 256],
    help="host-tier sizes, million params (16 32 64 128 256); none to skip",
  )  # fmt: skip
  parser.add_argument(
    "--nvme-sizes-m", type=float, nargs="*", default=[32, 64, 128],
    help="NVMe-tier sizes, million params (32 64 128); none to skip",
  )  # fmt: skip
  _common.add_steps_arguments(
    parser, steps=5, warmup_help="untimed steps first (2: the NVMe tier's second step compiles)"
  )
  _common.add_dir_argument(parser, "the NVMe stores")
  parser.add_argument(
    "--child-timeout", type=float, default=900, help="seconds per subprocess (900)"
  )
  _common.add_out_argument(parser, "scaling")
  args = parser.parse_args(argv)
  _common.check_steps_arguments(parser, args)
  if any(not s > 0 for s in args.host_sizes_m + args.nvme_sizes_m):
    parser.error("sizes must be > 0")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, writes the JSON and PNG, prints and returns the results."""
  args = parse_args(argv)
  wall_start = time.perf_counter()
  sizes = {"host": args.host_sizes_m, "nvme": args.nvme_sizes_m}
  tiers: dict[str, dict[str, Any]] = {}
  args.dir.mkdir(parents=True, exist_ok=True)
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="offlax-scaling-", dir=args.dir))
  try:
    for tier, label in TIERS.items():
      if sizes[tier]:
        print(f"-- {label}: {', '.join(f'{s:g}M' for s in sizes[tier])} params --", flush=True)
        points = [measure(tier, s, args, workdir) for s in sizes[tier]]
        tiers[tier] = {"points": points, **summarize(points)}
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  result = {
    "benchmark": "scaling",
    **_common.environment(),
    "steps": args.steps,
    "warmup": args.warmup,
    "goal_loglog_slope": GOAL_SLOPE,
    "state_bytes_per_param": _tier_child.STATE_BYTES_PER_PARAM,
    "tiers": tiers,
  }
  result["wall_s"] = time.perf_counter() - wall_start
  result["ok"] = all("error" not in p for t in tiers.values() for p in t["points"])
  _common.write_outputs(result, args.out, "scaling", plot, summary_table)
  return result


if __name__ == "__main__":
  _common.exit_on_sigterm()
  sys.exit(0 if main()["ok"] else 1)
