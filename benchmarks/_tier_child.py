"""One tier's Adam training steps, measured in a fresh process: the model, the step, the child.

Private to `benchmarks/`, shared by nvme_throughput.py (which documents the measurement, its
part 2 and 3), scaling.py and checkpoint.py (the model and the step). `run_child` starts this file
as a script (`--child tier`, `host` or `compute`); the child reports, as JSON on stdout after
`CHILD_MARKER`, its step times and its RSS: right after allocating params and grads (the baseline)
and the peak (VmHWM, reset before each phase: init, compile and warm-up, timed steps). Only the
standard library and NumPy are imported at the top: the parent process imports no JAX.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Import path: see the comment in nvme_throughput.py (run_child starts this file as a script).
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
  sys.path.append(_REPO_ROOT)
from benchmarks import _common, _disk  # noqa: E402

GB, MiB = _disk.GB, _disk.MiB
LEARNING_RATE = 1e-3
# Where transparent huge pages are in "madvise" mode, this glibc tunable (read
# when a process starts) makes malloc advise them. While the tier's slices
# crossed its callbacks through fresh buffers, it made steps 8-25% shorter;
# with the native copies it made no difference. The "hugetlb" run measures the
# tier with it, beside the default.
# offlax's telemetry.HUGETLB_TUNABLE, spelled out: this process imports no JAX.
HUGETLB = "glibc.malloc.hugetlb=1"
NUM_MATRICES = 32
MATRIX_COLS = (1024, 4096, 2048, 8192)
NUM_VECTORS = 8
VECTOR_LEN = 4096
DEFAULT_CACHE_BYTES = 64 * MiB
DEFAULT_CHUNK_BYTES = 16 * MiB  # NVMeTier's default (64 MiB ran 18% slower a step here)
STATE_BYTES_PER_PARAM = 8  # Adam: mu and nu, fp32
CHILD_MARKER = "OFFLAX_NVME_CHILD_RESULT "


# -- model -------------------------------------------------------------------------


def param_shapes(params_m: float) -> dict[str, tuple[int, ...]]:
  """About `params_m` million fp32 params: 32 matrices of varied width, 8 vectors."""
  total = max(int(params_m * 1e6), NUM_MATRICES + NUM_VECTORS)
  vec = min(VECTOR_LEN, max(1, total // 1000))
  per_matrix = max(1, (total - NUM_VECTORS * vec) // NUM_MATRICES)
  shapes: dict[str, tuple[int, ...]] = {}
  for i in range(NUM_MATRICES):
    cols = min(MATRIX_COLS[i % len(MATRIX_COLS)], per_matrix)
    shapes[f"w{i:02d}"] = (max(1, round(per_matrix / cols)), cols)
  for i in range(NUM_VECTORS):
    shapes[f"b{i:02d}"] = (vec,)
  return shapes


def auto_tier_bytes(state_bytes: int, cache: int | None, chunk: int | None) -> tuple[int, int]:
  """cache_bytes (64 MiB) and chunk_bytes (16 MiB), capped so most small states stay on disk."""
  if cache is None:
    cache = min(DEFAULT_CACHE_BYTES, state_bytes // 32)
  if chunk is None:
    chunk = min(DEFAULT_CHUNK_BYTES, max(MiB, state_bytes // 8))
  return cache, chunk


def add_params_argument(parser: argparse.ArgumentParser, params_m: float) -> None:
  """Adds `--params-m`, the model size in million fp32 params (default `params_m`)."""
  parser.add_argument(
    "--params-m", type=float, default=params_m,
    help=f"million fp32 params; the Adam state is {STATE_BYTES_PER_PARAM} bytes per param "
    f"({params_m:g}: {params_m * 1e6 * STATE_BYTES_PER_PARAM / GB:.2f} GB)",
  )  # fmt: skip


# -- the child: one tier variant, or the plain-optax reference ---------------------


class CallbackTimer:
  """Times (only) the NVMe tier's callbacks and store calls, per step.

  Wraps methods of `offlax._src.nvme.pipeline.Reader` and of one `Store`; missing
  names (the tier changed) leave the breakdown empty rather than failing.
  """

  NAMES = ("read_callback", "write_callback", "commit_callback", "commit_flush")

  def __init__(self):
    self._lock = threading.Lock()
    self.totals = dict.fromkeys(self.NAMES, 0.0)
    self.available = False
    self._undo: list[Callable[[], None]] = []

  def _wrap(self, owner: Any, attr: str, name: str) -> None:
    original = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return original(*args, **kwargs)
      finally:
        with self._lock:
          self.totals[name] += time.perf_counter() - start

    setattr(owner, attr, timed)
    self._undo.append(lambda: setattr(owner, attr, original))

  def install(self, store: Any) -> None:
    try:
      from offlax._src.nvme import pipeline

      reader = pipeline.Reader
      for attr in ("_read", "_write_slice", "commit"):
        getattr(reader, attr)
      store.commit  # noqa: B018
    except (ImportError, AttributeError):
      return
    # What the read and write callbacks run, whether the data then crosses by
    # the native copy or through the callback itself.
    self._wrap(reader, "_read", "read_callback")
    self._wrap(reader, "_write_slice", "write_callback")
    self._wrap(reader, "commit", "commit_callback")
    self._wrap(store, "commit", "commit_flush")
    self.available = True

  def take(self) -> dict[str, float]:
    with self._lock:
      out, self.totals = self.totals, dict.fromkeys(self.NAMES, 0.0)
    return out if self.available else {}

  def uninstall(self) -> None:
    while self._undo:
      self._undo.pop()()


def make_step(tx: Any) -> Callable[..., Any]:
  import jax
  import optax

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def random_tree(shapes: dict[str, tuple[int, ...]], seed: int, std: float) -> Any:
  import jax.numpy as jnp

  rng = np.random.default_rng(seed)
  return {
    k: jnp.array(std * rng.standard_normal(s, dtype=np.float32), copy=True)
    for k, s in shapes.items()
  }


def child_main(args: argparse.Namespace) -> dict[str, Any]:
  """One measurement in a fresh process: `tier` (with args.fsync), `host` or `compute`."""
  import jax
  import optax

  import offlax

  out: dict[str, Any] = {"mode": args.child, "fsync": bool(args.fsync), "pid": os.getpid()}
  out["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
  out["rss_after_import_bytes"] = _common.proc_status_bytes("VmRSS")
  shapes = param_shapes(args.params_m)
  params = random_tree(shapes, seed=0, std=0.02)
  grads = random_tree(shapes, seed=1, std=1e-3)
  jax.block_until_ready((params, grads))
  out["baseline_rss_bytes"] = _common.proc_status_bytes("VmRSS")  # params + grads + runtime
  out["peak_reset_supported"] = _common.reset_peak_rss()
  log = functools.partial(print, file=sys.stderr, flush=True)
  label = {
    "tier": f"tier fsync={bool(args.fsync)}",
    "host": "host tier",
    "compute": "plain optax.adam",
  }[args.child]

  tier = None
  timer = CallbackTimer()
  store_dir = pathlib.Path(args.store)
  try:
    if args.child == "tier":
      tier = offlax.NVMeTier(
        store_dir,
        cache_bytes=args.cache_bytes,
        chunk_bytes=args.chunk_bytes,
        readahead=args.readahead,
        fsync=bool(args.fsync),
        progress=False,
      )
      tx = offlax.offload(optax.adam(LEARNING_RATE), tier)
    elif args.child == "host":  # for scaling.py: the same step with the state in host memory
      tx = offlax.offload(optax.adam(LEARNING_RATE))
    else:
      tx = optax.adam(LEARNING_RATE)

    start = time.perf_counter()
    state = tx.init(params)
    jax.block_until_ready(state)
    out["init_s"] = time.perf_counter() - start
    out["peak_rss_init_bytes"] = _common.peak_rss()
    if tier is not None:
      records = tier.store.records
      out["state_bytes"] = sum(r.size * np.dtype(r.dtype).itemsize for r in records)
      out["cold_bytes"] = sum(r.size * np.dtype(r.dtype).itemsize for r in records if not r.hot)
      out["hot_arrays"] = sum(r.hot for r in records)
      out["cold_arrays"] = sum(not r.hot for r in records)
      out["store_bytes_after_init"] = _disk.tree_bytes(store_dir)
      timer.install(tier.store)
      log(
        f"[{label}] init wrote {out['state_bytes'] / GB:.2f} GB in {out['init_s']:.1f} s "
        f"({out['state_bytes'] / out['init_s'] / GB:.2f} GB/s); "
        f"{out['cold_arrays']} arrays on disk, {out['hot_arrays']} cached"
      )

    _common.reset_peak_rss()
    step = make_step(tx)  # compiled by the first warm-up step
    times, syncs, breakdowns, cache_evicted = [], [], [], []
    for n in range(args.warmup + args.steps):
      if tier is not None and not args.warm_cache:
        cached = _common.meminfo_bytes("Cached")
        _disk.drop_page_cache(store_dir)
        after = _common.meminfo_bytes("Cached")
        cache_evicted.append(None if cached is None or after is None else cached - after)
      timer.take()
      disk_before = _disk.device_bytes(store_dir) if tier is not None else None
      start = time.perf_counter()
      params, state = step(params, state, grads)
      jax.block_until_ready((params, state))
      elapsed = time.perf_counter() - start
      breakdown = timer.take()
      disk_after = _disk.device_bytes(store_dir) if disk_before is not None else None
      sync_s = None
      if tier is not None and not args.fsync:
        start = time.perf_counter()
        os.sync()  # the writes the step left in the page cache
        sync_s = time.perf_counter() - start
      if n < args.warmup:
        out.setdefault("warmup_s", []).append(elapsed)
        out["peak_rss_compile_bytes"] = _common.peak_rss()
        out["rss_before_steps_bytes"] = _common.proc_status_bytes("VmRSS")
        _common.reset_peak_rss()
        log(f"[{label}] compile + warm-up step {n + 1}: {elapsed:.1f} s")
        continue
      times.append(elapsed)
      syncs.append(sync_s)
      breakdowns.append(breakdown)
      if disk_before is not None and disk_after is not None:
        moved = [a - b for a, b in zip(disk_after, disk_before, strict=True)]
        out.setdefault("device_bytes_read_written", []).append(moved)
      extra = "" if sync_s is None else f", writeback (os.sync) {sync_s:.2f} s"
      log(f"[{label}] step {n + 1 - args.warmup}/{args.steps}: {elapsed:.2f} s{extra}")
    out["peak_rss_steps_bytes"] = _common.peak_rss()
    out["times_s"] = times
    out["writeback_s"] = syncs if tier is not None and not args.fsync else None
    out["breakdown_s"] = breakdowns if timer.available else None
    out["page_cache_evicted_bytes"] = cache_evicted or None
    out["warm_cache"] = bool(args.warm_cache)
    if tier is not None:
      out["step_after"] = int(state.step)
  finally:
    timer.uninstall()
    if tier is not None:
      tier.close()
    shutil.rmtree(store_dir, ignore_errors=True)
  out["ru_maxrss_bytes"] = _common.maxrss_bytes()
  return out


def run_child(
  args: argparse.Namespace,
  mode: str,
  fsync: bool,
  store: pathlib.Path,
  cache: int,
  chunk: int,
  *,
  hugetlb: bool = False,
) -> dict[str, Any]:
  """Runs `child_main` in a fresh interpreter; its result, or an `error` record.

  `hugetlb`: glibc's malloc asks for transparent huge pages (`GLIBC_TUNABLES`,
  read when a process starts), see `HUGETLB`.
  """
  cmd = [
    sys.executable,
    str(pathlib.Path(__file__).resolve()),
    "--child", mode,
    "--fsync", str(int(fsync)),
    "--store", str(store),
    "--params-m", repr(args.params_m),
    "--steps", str(args.steps),
    "--warmup", str(args.warmup),
    "--cache-bytes", str(cache),
    "--chunk-bytes", str(chunk),
    "--readahead", str(args.readahead),
  ]  # fmt: skip
  if args.warm_cache:
    cmd.append("--warm-cache")
  env = dict(os.environ)
  if hugetlb:
    env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), HUGETLB)))
  start = time.perf_counter()
  try:
    proc = subprocess.run(
      cmd, stdout=subprocess.PIPE, text=True, timeout=args.child_timeout, env=env
    )
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {args.child_timeout} s", "wall_s": args.child_timeout}
  finally:
    shutil.rmtree(store, ignore_errors=True)
  wall_s = time.perf_counter() - start
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(CHILD_MARKER):
      result = json.loads(line[len(CHILD_MARKER) :])
      result["wall_s"] = wall_s
      return result
  tail = proc.stdout[-2000:]
  return {"error": f"child exited with {proc.returncode} and no result; stdout: {tail}"}


# -- the child's command line ------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs `child_main` with `argv` as `run_child` passes it; prints the result after `CHILD_MARKER`.

  An error is reported the same way (an `error` record with its traceback), for the parent.
  """
  parser = argparse.ArgumentParser(description="one measurement of run_child's (internal)")
  parser.add_argument("--child", choices=("tier", "host", "compute"), required=True)
  parser.add_argument("--fsync", type=int, default=1)
  parser.add_argument("--store", required=True)
  parser.add_argument("--params-m", type=float, required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--warmup", type=int, required=True)
  parser.add_argument("--cache-bytes", type=int)
  parser.add_argument("--chunk-bytes", type=int)
  parser.add_argument("--readahead", type=int, default=2)
  parser.add_argument("--warm-cache", action="store_true")
  args = parser.parse_args(argv)
  try:
    child = child_main(args)
  except BaseException as e:  # reported to the parent, which records the traceback
    traceback.print_exc()
    child = {"error": "".join(traceback.format_exception(e))}
  print(CHILD_MARKER + json.dumps(child), flush=True)
  return child


if __name__ == "__main__":
  _common.exit_on_sigterm()
  sys.exit(1 if "error" in main() else 0)
