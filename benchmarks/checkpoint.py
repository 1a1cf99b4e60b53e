"""Orbax checkpoint save and restore throughput of offloaded Adam state against the raw disk.

What is measured, in one run and on one filesystem (a fresh directory under `--dir`, default
/tmp, removed at the end even on failure):

1. Raw sequential bandwidth of the disk, as nvme_throughput.py measures it (_disk.py: direct I/O,
   16 MiB blocks, fio if installed; before and, with `--raw-passes 2`, again after the
   checkpoints).
2. The host tier: `offlax.offload(optax.adam(1e-3))` on `--params-m` million fp32 params (default
   128M: a 1.02 GB Adam state, in nvme_throughput.py's 40 leaves), after one step so the moments
   hold data zstd cannot squeeze away. Each round saves the state with an orbax
   `CheckpointManager` and `ocp.args.StandardSave(opt_state)`, waits for it and flushes the
   filesystem (syncfs, as the NVMe tier's commit does; the raw figure is flushed too): "save".
   The time until `save` returns, while training would be blocked, is recorded as well. Then,
   with the checkpoint's page cache dropped, it restores into `offlax.abstract_state(...)` (every
   leaf built directly in `pinned_host`): "restore". The first restore is checked against the
   saved state (equal values, same memory kinds). Three times (`--host-modes`): with orbax's
   defaults (asynchronous, OCDBT, zstd), with
   `item_handlers=offlax.checkpoint.checkpoint_handler()` (no zstd, no OCDBT), and with
   `offlax.checkpoint.HostStateSave` / `offlax.checkpoint.HostStateRestore` (raw files by
   direct I/O, the save synchronous).
3. The NVMe tier's store in a checkpoint: the same state written into an `NVMeTier` store
   (`offlax.checkpoint.retier`), then `offlax.checkpoint.NVMeStoreSave(tier)` (a file copy,
   flushed) and `offlax.checkpoint.NVMeStoreRestore(path)` into a new directory, page cache
   dropped before each. A copy reads and writes every byte, so its raw equivalent is
   bytes / raw read + bytes / raw write.

GB/s = Adam state bytes (8 per param; the on-disk size is reported too) / time, median of
`--steps` rounds after `--warmup`, with min and max. Ratio to the raw disk: the raw disk's time for
the same bytes (writes for a save, reads for a restore) / the measured time. The virtual disk of
the development machine drifts by 2x within a minute (raw writes of 1.4 to 3.3 GB/s in one run),
so the disk is measured again just before each timed round (`--raw-gib`, 4 streams) and each
round is divided by its own raw figure ("vs raw", the goal's figure: the median of these paired
ratios); "vs best" divides by the best raw pass of the run instead. Goals (issue 20):
>= 0.8x for the host tier's fastest path (`HostStateSave` / `HostStateRestore`), >= 0.9x for
the NVMe store's; `checkpoint_handler` and orbax's
defaults are reported without one. Peak RSS above the RSS before each phase is recorded (orbax's
default save stages compressed copies of the state; restoring builds a new state). The load
average at the start and end is recorded: on a shared machine the figures vary with it.

Results go to `<out>/checkpoint.json` and `<out>/checkpoint.png`.

  python benchmarks/checkpoint.py                          # 1 GB of state, ~2 min on 2 cores
  python benchmarks/checkpoint.py --params-m 1 --raw-gib 0.02 --steps 1 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Import path: see the comment in nvme_throughput.py.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
  sys.path.append(_REPO_ROOT)
from benchmarks import _common, _disk, _tier_child  # noqa: E402

GB = _disk.GB
MiB = _disk.MiB
LEARNING_RATE = 1e-3
# (key, label, raw-disk directions the operation's bytes take, goal: ratio to the raw disk)
OPERATIONS = (
  ("host_save", "host tier: orbax defaults save", ("write",), None),
  ("host_restore", "host tier: orbax defaults restore", ("read",), None),
  ("fast_save", "host tier: checkpoint_handler save", ("write",), None),
  ("fast_restore", "host tier: checkpoint_handler restore", ("read",), None),
  ("direct_save", "host tier: HostStateSave", ("write",), 0.8),
  ("direct_restore", "host tier: HostStateRestore", ("read",), 0.8),
  ("nvme_save", "NVMe store: NVMeStoreSave", ("read", "write"), 0.9),
  ("nvme_restore", "NVMe store: NVMeStoreRestore", ("read", "write"), 0.9),
)


@dataclasses.dataclass
class Timings:
  """The rounds of one operation: seconds, bytes on disk, peak RSS rise, extra figures."""

  times_s: list[float] = dataclasses.field(default_factory=list)
  disk_bytes: list[int] = dataclasses.field(default_factory=list)
  peak_rss_rise_bytes: list[int] = dataclasses.field(default_factory=list)
  blocking_s: list[float] = dataclasses.field(default_factory=list)
  # The raw disk's write and read bytes/s, measured just before each round (see `rounds`).
  raw: list[dict[str, float]] = dataclasses.field(default_factory=list)

  def timed(self, fn: Callable[[], Any], record: bool) -> Any:
    """Runs `fn` with a fresh peak-RSS mark; records its time and RSS rise if `record`."""
    before = _common.proc_status_bytes("VmRSS") or 0
    _common.reset_peak_rss()
    start = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - start
    if record:
      self.times_s.append(elapsed)
      self.peak_rss_rise_bytes.append(_common.peak_rss() - before)
    return out


def flush(path: pathlib.Path) -> None:
  from offlax._src.nvme.direct_io import syncfs

  syncfs(os.fspath(path))


def make_state(params_m: float) -> tuple[Any, Any, Any]:
  """(inner, params, host-tier state) after one Adam step on random gradients."""
  import jax
  import optax

  import offlax

  shapes = _tier_child.param_shapes(params_m)
  params = _tier_child.random_tree(shapes, seed=0, std=0.02)
  grads = _tier_child.random_tree(shapes, seed=1, std=1e-3)
  inner = optax.adam(LEARNING_RATE)
  tx = offlax.offload(inner)
  params, state = _tier_child.make_step(tx)(params, tx.init(params), grads)
  return inner, params, jax.block_until_ready(state)


def rounds(
  args: argparse.Namespace,
  directory: pathlib.Path,
  body: Callable[[Any, pathlib.Path, bool], None],
  timings: Sequence[Timings],
  handlers: Any = None,
) -> None:
  """Calls `body(manager, round_dir, record)` for `warmup + steps` rounds.

  Each round has its own `CheckpointManager` (with `item_handlers=handlers`) in a new directory,
  removed after it: deleting the previous step through the manager would run beside the next
  save and be timed with it. Before each timed round the raw disk writes and reads
  `--raw-gib` (4 direct-I/O streams, `_disk.raw_python`) and each of `timings` records
  it: the virtual disk here drifts by 2x within a minute, so each round is compared with the
  disk as it was at that moment (the paired ratio), as well as with its best pass.
  """
  import orbax.checkpoint as ocp

  for i in range(args.warmup + args.steps):
    record = i >= args.warmup
    if record and not args.no_paired_raw:
      raw = paired_raw(directory.parent, args.raw_gib)
      for t in timings:
        t.raw.append(raw)
    round_dir = directory / f"round_{i}"
    with ocp.CheckpointManager(round_dir / "ckpt", item_handlers=handlers) as mngr:
      body(mngr, round_dir, record)
    shutil.rmtree(round_dir)


def paired_raw(workdir: pathlib.Path, raw_gib: float) -> dict[str, float]:
  """The raw disk's write and read bytes/s now (a file of `raw_gib` GiB, removed after)."""
  path = workdir / "paired_raw.bin"
  try:
    # At least a block per stream (a smoke run's --raw-gib is smaller).
    nbytes = max(int(raw_gib * _disk.GiB), 4 * _disk.RAW_BLOCK_BYTES)
    raw = _disk.raw_python(path, nbytes, streams=4)
  finally:
    path.unlink(missing_ok=True)
  return {k: raw[k] for k in ("write_bytes_per_s", "read_bytes_per_s")}


def save_and_flush(mngr: Any, item: Any, directory: pathlib.Path) -> float:
  """Saves `item` as step 0 and waits for it, flushed; returns how long `save` blocked."""
  start = time.perf_counter()
  mngr.save(0, args=item)
  blocking = time.perf_counter() - start
  mngr.wait_until_finished()
  flush(directory)
  return blocking


def host_rounds(
  inner: Any,
  params: Any,
  state: Any,
  directory: pathlib.Path,
  args: argparse.Namespace,
  mode: str,
) -> dict[str, Timings]:
  """Orbax save and restore of the host-tier state, timed.

  `mode`: "host" (orbax's defaults), "fast" (`checkpoint_handler`) or "direct"
  (`HostStateSave` / `HostStateRestore`).
  """
  import jax
  import orbax.checkpoint as ocp

  import offlax

  save, restore = Timings(), Timings()
  target = offlax.abstract_state(inner, params)
  checked = []
  if mode == "direct":
    item = ocp.args.Composite(opt=offlax.checkpoint.HostStateSave(state, progress=False))
    load = lambda mngr: mngr.restore(  # noqa: E731
      0, args=ocp.args.Composite(opt=offlax.checkpoint.HostStateRestore(target, progress=False))
    )["opt"]
  else:
    item = ocp.args.StandardSave(state)
    load = lambda mngr: mngr.restore(0, args=ocp.args.StandardRestore(target))  # noqa: E731

  def body(mngr: Any, round_dir: pathlib.Path, record: bool) -> None:
    blocking = save.timed(lambda: save_and_flush(mngr, item, round_dir), record)
    _disk.drop_page_cache(round_dir)
    restored = restore.timed(lambda: jax.block_until_ready(load(mngr)), record)
    if not checked:
      check_restored(state, restored)
      checked.append(True)
    del restored
    if record:
      save.blocking_s.append(blocking)
      save.disk_bytes.append(_disk.tree_bytes(round_dir))

  handlers = offlax.checkpoint.checkpoint_handler() if mode == "fast" else None
  rounds(args, directory, body, (save, restore), handlers)
  return {f"{mode}_save": save, f"{mode}_restore": restore}


def check_restored(saved: Any, restored: Any) -> None:
  """Raises unless `restored` has the values and memory kinds of `saved`."""
  import jax

  kinds = lambda t: jax.tree.map(lambda x: x.sharding.memory_kind, t)  # noqa: E731
  if kinds(saved) != kinds(restored):
    raise AssertionError(f"restored memory kinds {kinds(restored)} != saved {kinds(saved)}")
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
    if not np.array_equal(np.asarray(a), np.asarray(b)):
      raise AssertionError("the restored state differs from the saved one")


def nvme_rounds(
  inner: Any, params: Any, state: Any, workdir: pathlib.Path, args: argparse.Namespace
) -> dict[str, Timings]:
  """`NVMeStoreSave` and `NVMeStoreRestore` of a store holding the values of `state`."""
  import jax
  import orbax.checkpoint as ocp

  import offlax

  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim)  # the moments
  cache, chunk = _tier_child.auto_tier_bytes(state_bytes, None, None)
  store = workdir / "store"
  tier = offlax.NVMeTier(os.fspath(store), cache_bytes=cache, chunk_bytes=chunk, progress=False)
  save, restore = Timings(), Timings()

  def body(mngr: Any, round_dir: pathlib.Path, record: bool) -> None:
    _disk.drop_page_cache(store)
    item = ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreSave(tier))
    save.timed(lambda: save_and_flush(mngr, item, round_dir), record)
    _disk.drop_page_cache(round_dir)
    restored = os.fspath(round_dir / "restored")
    item = ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreRestore(restored, progress=False))
    restore.timed(lambda: mngr.restore(0, args=item), record)
    if record:
      save.disk_bytes.append(_disk.tree_bytes(round_dir / "ckpt"))
      restore.disk_bytes.append(_disk.tree_bytes(pathlib.Path(restored)))

  try:
    offlax.checkpoint.retier(inner, params, state.inner_state, tier)  # writes the store
    rounds(args, workdir / "nvme_ckpt", body, (save, restore))
  finally:
    tier.close()
  return {"nvme_save": save, "nvme_restore": restore}


def summarize(
  timings: Timings,
  directions: Sequence[str],
  goal: float | None,
  state_bytes: int,
  raw: dict[str, Any] | None,
) -> dict[str, Any]:
  """GB/s of the state bytes, the raw disk's time for them, the ratio and its goal, RSS rise."""
  s: dict[str, Any] = {
    "times_s": timings.times_s,
    "time_s": _common.stats_of(timings.times_s),
    "gb_per_s": _common.stats_of([state_bytes / t / GB for t in timings.times_s]),
    "peak_rss_rise_bytes": max(timings.peak_rss_rise_bytes),
  }
  if timings.disk_bytes:
    s["disk_bytes"] = max(timings.disk_bytes)
  if timings.blocking_s:
    s["blocking_s"] = _common.stats_of(timings.blocking_s)
  raw_s = lambda r: sum(state_bytes / r[f"{d}_bytes_per_s"] for d in directions)  # noqa: E731
  if raw is not None:
    s["raw_equivalent_s"] = raw_s(raw)
    s["ratio_vs_best_raw"] = _common.stats_of([raw_s(raw) / t for t in timings.times_s])
  if timings.raw:
    s["paired_raw"] = timings.raw
    s["ratio_vs_paired_raw"] = _common.stats_of(
      [raw_s(r) / t for r, t in zip(timings.raw, timings.times_s, strict=True)]
    )
  # The goal is judged on the paired ratio where there is one (see `rounds`).
  s["ratio_vs_raw"] = s.get("ratio_vs_paired_raw", s.get("ratio_vs_best_raw"))
  if goal is not None:
    s["goal_ratio"] = goal
    s["meets_goal"] = s["ratio_vs_raw"] is not None and s["ratio_vs_raw"]["median"] >= goal
  return s


def summary_table(result: dict[str, Any]) -> str:
  raw = result["raw"]
  lines = [
    f"checkpoint: offlax.offload(optax.adam) state of {result['params'] / 1e6:.1f}M params "
    f"({result['state_bytes'] / GB:.2f} GB) in {result['leaves']} leaves, {result['steps']} "
    f"rounds (+{result['warmup']} warm-up), orbax {result['orbax_version']}, "
    f"{result['cpu_count']} CPUs, {result['wall_s']:.0f} s in all, load average "
    f"{result['loadavg_start'][0]:.1f} at the start, {result['loadavg_end'][0]:.1f} at the end",
  ]
  header = (
    f"{'operation':<40}{'GB/s med':>9}{'min':>7}{'max':>7}{'s med':>7}{'vs raw':>8}{'vs best':>8}"
    f"{'disk GB':>8}{'RSS+ MiB':>9}{'goal':>10}"
  )
  lines += [header, "-" * len(header)]
  if raw.get("error"):
    lines.append(f"raw disk: FAILED: {raw['error']}")
  else:
    for rw in ("write", "read"):
      name = f"raw {rw} ({raw['tool'].split(',')[0]})"
      lines.append(
        f"{name:<40}{raw[f'{rw}_bytes_per_s'] / GB:>9.2f}"
        f"{raw[f'{rw}_bytes_per_s_min'] / GB:>7.2f}{raw[f'{rw}_bytes_per_s_max'] / GB:>7.2f}"
      )
  for key, label, _, goal in OPERATIONS:
    op = result["operations"].get(key)
    if op is None:
      continue
    g, r, best = op["gb_per_s"], op.get("ratio_vs_paired_raw"), op.get("ratio_vs_best_raw")
    verdict = "-" if goal is None else f">={goal}x " + ("ok" if op["meets_goal"] else "NO")
    ratio = f"{r['median']:.2f}x" if r else "-"
    best_ratio = f"{best['median']:.2f}x" if best else "-"
    lines.append(
      f"{label:<40}{g['median']:>9.2f}{g['min']:>7.2f}{g['max']:>7.2f}"
      f"{op['time_s']['median']:>7.2f}{ratio:>8}{best_ratio:>8}"
      + (f"{op['disk_bytes'] / GB:>8.2f}" if "disk_bytes" in op else f"{'-':>8}")
      + f"{op['peak_rss_rise_bytes'] / MiB:>9,.0f}{verdict:>10}"
    )
  for key in ("host_save", "fast_save", "direct_save"):
    save = result["operations"].get(key)
    if save:
      how = "synchronous by design" if key == "direct_save" else "asynchronous checkpointing"
      lines.append(
        f"{key}: orbax save blocks the caller for {save['blocking_s']['median']:.2f} s of its "
        f"{save['time_s']['median']:.2f} s ({how})"
      )
  lines.append(
    "vs raw: the raw disk's time for the same bytes, measured just before each round, / the "
    "round's time (median; the goal's figure); vs best: the same against the best raw pass"
  )
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  bars = _disk.raw_bars(result["raw"])
  colors = {"host": "tab:blue", "fast": "tab:green", "direct": "tab:purple", "nvme": "tab:orange"}
  for key, label, _, _ in OPERATIONS:
    op = result["operations"].get(key)
    if op is not None:
      color = colors[key.split("_")[0]]
      text = label.replace(": ", "\n").replace(" save", "\nsave").replace(" restore", "\nrestore")
      text = text.replace("checkpoint_handler", "checkpoint_\nhandler")
      bars.append(_disk.stats_bar(text, op["gb_per_s"], op.get("ratio_vs_raw"), color))
  fig, ax = plt.subplots(figsize=(14, 6), dpi=120)
  _common.draw_bars(ax, bars, headroom=1.25)
  ax.set_ylabel("GB/s of Adam state (1 GB = 1e9 bytes)")
  ax.set_xlabel("bar: median, whiskers: min to max; raw: sequential direct I/O, same filesystem")
  ax.set_title(
    f"offlax checkpoints through orbax: Adam state of {result['params'] / 1e6:.0f}M params "
    f"({result['state_bytes'] / GB:.2f} GB), timed rounds: {result['steps']}\n"
    f"{result['filesystem'].get('fstype', '?')} on {result['filesystem'].get('device', '?')}, "
    f"{result['cpu_count']} CPUs (load average {result['loadavg_start'][0]:.1f} to "
    f"{result['loadavg_end'][0]:.1f}), orbax {result['orbax_version']} ({result['date'][:10]})",
    fontsize=10,
  )
  ax.grid(axis="y", alpha=0.3)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:gray", *colors.values())]
  ax.legend(handles, ["raw disk", "host tier (orbax defaults)",
                     "host tier (checkpoint.checkpoint_handler)",
                     "host tier (checkpoint.HostStateSave, direct I/O)", "NVMe store (file copy)"],
            fontsize=8, loc="upper right")  # fmt: skip
  fig.tight_layout()
  _common.save_png(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  _tier_child.add_params_argument(parser, params_m=128.0)
  _common.add_steps_arguments(parser, steps=3, warmup_help="untimed rounds first (1)")
  parser.set_defaults(warmup=1)
  _disk.add_raw_arguments(parser, raw_gib=1.0)
  _common.add_dir_argument(parser, "the raw file and the checkpoints")
  parser.add_argument("--no-nvme", action="store_true", help="skip the NVMe store checkpoints")
  parser.add_argument(
    "--host-modes",
    nargs="*",
    choices=("host", "fast", "direct"),
    default=("host", "fast", "direct"),
    help="host-tier saves to time: orbax's defaults, checkpoint_handler, HostStateSave",
  )
  parser.add_argument(
    "--no-paired-raw",
    action="store_true",
    help="no raw pass before each timed round (ratios against the best raw pass only)",
  )
  _common.add_out_argument(parser, "checkpoint")
  args = parser.parse_args(argv)
  _common.check_steps_arguments(parser, args)
  _disk.check_raw_arguments(parser, args)
  if not args.params_m > 0:
    parser.error("--params-m must be > 0")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, writes the JSON and PNG, prints and returns the results."""
  args = parse_args(argv)
  import jax
  import orbax.checkpoint as ocp

  wall_start = time.perf_counter()
  loadavg_start = os.getloadavg()
  args.dir.mkdir(parents=True, exist_ok=True)
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="offlax-ckpt-bench-", dir=args.dir))
  try:
    fs = _disk.filesystem_info(workdir)
    passes = [_disk.raw_pass(workdir, args, "before")]
    inner, params, state = make_state(args.params_m)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    state_bytes = n_params * _tier_child.STATE_BYTES_PER_PARAM
    print(
      f"state: {n_params:,} params, {state_bytes / GB:.2f} GB of Adam moments in host memory",
      flush=True,
    )
    timings: dict[str, Timings] = {}
    for mode in args.host_modes:
      timings.update(host_rounds(inner, params, state, workdir / f"{mode}_ckpt", args, mode))
    if not args.no_nvme:
      timings.update(nvme_rounds(inner, params, state, workdir, args))
    del state
    if args.raw_passes > 1:
      passes.append(_disk.raw_pass(workdir, args, "after"))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)

  raw = _disk.combine_raw(passes)
  raw_ok = None if raw.get("error") else raw
  directions = {key: (d, goal) for key, _, d, goal in OPERATIONS}
  result = {
    "benchmark": "checkpoint",
    **_common.environment(),
    "orbax_version": ocp.__version__,
    "filesystem": fs,
    "params_m": args.params_m,
    "params": n_params,
    "leaves": len(jax.tree.leaves(params)),
    "state_bytes": state_bytes,
    "steps": args.steps,
    "warmup": args.warmup,
    "raw": raw,
    "loadavg_start": loadavg_start,
    "loadavg_end": os.getloadavg(),
    "operations": {
      key: summarize(t, *directions[key], state_bytes, raw_ok) for key, t in timings.items()
    },
  }
  result["wall_s"] = time.perf_counter() - wall_start
  result["ok"] = not raw.get("error")
  _common.write_outputs(result, args.out, "checkpoint", plot, summary_table)
  return result


if __name__ == "__main__":
  _common.exit_on_sigterm()
  sys.exit(0 if main()["ok"] else 1)
