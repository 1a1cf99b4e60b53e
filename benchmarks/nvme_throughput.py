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
   (`--child`), which reports as JSON on stdout its RSS right after allocating
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
import concurrent.futures
import functools
import json
import math
import mmap
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# benchmarks/_common.py holds what the benchmark scripts share. It is imported as
# `benchmarks._common` however this file is run: `python -m benchmarks.<name>` has the repository
# root on sys.path already, while `python benchmarks/<name>.py` (only this directory on sys.path;
# also how run_child starts the subprocess) and loading the file by path with
# importlib.util.spec_from_file_location (no parent package, so no relative import either) do not;
# hence the repository root, this directory's parent, is added when missing. Appended, not
# prepended, so installed packages (offlax itself) still come first.
_REPO_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
  sys.path.append(_REPO_ROOT)
from benchmarks import _common  # noqa: E402

GB = 1e9  # throughput and traffic in decimal GB; RAM in binary MiB/GiB
MiB = 2**20
GiB = 2**30
LEARNING_RATE = 1e-3
GOAL_RATIO = 0.8
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
RAW_BLOCK_BYTES = 16 * MiB
# The raw disk is measured with one stream and with as many as the tier's I/O
# threads (NVMeTier's default 4), each way; the faster counts. A virtual disk
# here gave 1.4 GB/s to one writer and 1.9 GB/s to four.
RAW_STREAMS = (1, 4)
STATE_BYTES_PER_PARAM = 8  # Adam: mu and nu, fp32
CHILD_MARKER = "OFFLAX_NVME_CHILD_RESULT "


# -- model -------------------------------------------------------------------


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


# -- memory and files ----------------------------------------------------------


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


def reset_peak_rss() -> bool:
  """Resets VmHWM to the current RSS (Linux >= 4.0); False if that is not possible."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def peak_rss() -> int:
  hwm = proc_status_bytes("VmHWM")
  return _common.maxrss_bytes() if hwm is None else hwm


def meminfo_bytes(field: str) -> int | None:
  """A `kB` field of /proc/meminfo in bytes; None if unavailable."""
  return _kb_field("/proc/meminfo", field)


def device_bytes(path: pathlib.Path) -> tuple[int, int] | None:
  """Bytes read and written so far by the block device holding `path` (Linux), or None.

  The device's own counters: what the disk moved, page cache and all.
  """
  dev = os.stat(path).st_dev
  try:
    with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
      fields = f.read().split()
    return int(fields[2]) * 512, int(fields[6]) * 512  # sectors of 512 bytes
  except (OSError, IndexError, ValueError):
    return None


def tree_bytes(path: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_page_cache(path: pathlib.Path) -> None:
  """Flushes dirty data, then evicts the page cache of every file under `path`."""
  os.sync()
  for p in path.rglob("*"):
    if p.is_file() and not p.is_symlink():
      fd = os.open(p, os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def filesystem_info(path: pathlib.Path) -> dict[str, Any]:
  usage = shutil.disk_usage(path)
  info: dict[str, Any] = {
    "path": str(path),
    "total_bytes": usage.total,
    "free_bytes": usage.free,
    "df": None,
  }
  if shutil.which("df"):
    proc = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode == 0:
      info["df"] = proc.stdout.rstrip()
      lines = proc.stdout.split("\n")
      if len(lines) > 1 and len(lines[1].split()) >= 2:
        info["device"], info["fstype"] = lines[1].split()[:2]
  return info


# -- 1. raw sequential bandwidth -----------------------------------------------


def raw_fio(fio: str, path: pathlib.Path, nbytes: int, streams: int = 1) -> dict[str, Any]:
  """Sequential write, then read, of `nbytes` with fio (direct I/O, 16 MiB blocks).

  `streams` jobs run at once, each on its own part of the file.
  """
  out: dict[str, Any] = {"tool": "fio", "direct": True}
  part = nbytes // streams // RAW_BLOCK_BYTES * RAW_BLOCK_BYTES
  for rw, label in (("write", "write"), ("read", "read")):
    cmd = [
      fio,
      "--name=offlax-raw",
      f"--filename={path}",
      f"--size={part}",
      f"--numjobs={streams}",
      f"--offset_increment={part}",
      "--group_reporting",
      f"--bs={RAW_BLOCK_BYTES}",
      "--direct=1",
      "--ioengine=psync",
      f"--rw={rw}",
      "--end_fsync=1",
      "--output-format=json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    out[f"{label}_bytes_per_s"] = fio_bandwidth(proc.stdout, rw)
  out["bytes"] = part * streams
  return out


def fio_bandwidth(text: str, rw: str) -> float:
  """Bytes/s of the `rw` side of fio's JSON output (warnings before the JSON allowed)."""
  job = json.loads(text[text.index("{") :])["jobs"][0][rw]
  if job.get("bw_bytes"):
    return float(job["bw_bytes"])
  return job["io_bytes"] / (job["runtime"] / 1e3)  # runtime in ms


def raw_python(path: pathlib.Path, nbytes: int, streams: int = 1) -> dict[str, Any]:
  """Sequential write (then fsync) and read of `nbytes` with O_DIRECT in 16 MiB blocks.

  `streams` threads run at once, each on its own part of the file. Falls back
  to buffered I/O plus fsync and `posix_fadvise(DONTNEED)` before the read
  where the filesystem refuses O_DIRECT (tmpfs).
  """
  blocks = nbytes // RAW_BLOCK_BYTES // streams  # per stream
  # Page-aligned, as O_DIRECT needs; incompressible data.
  bufs = [mmap.mmap(-1, RAW_BLOCK_BYTES) for _ in range(streams)]
  for buf in bufs:
    buf.write(np.random.default_rng(0).bytes(RAW_BLOCK_BYTES))
  direct = hasattr(os, "O_DIRECT")

  def run(fd: int, io: Callable[[int, mmap.mmap, int], int]) -> float:
    """Seconds for every stream to move its blocks with `io(fd, buffer, offset)`."""

    def stream(i: int) -> None:
      for b in range(blocks):
        offset = (i * blocks + b) * RAW_BLOCK_BYTES
        if io(fd, bufs[i], offset) != RAW_BLOCK_BYTES:
          raise OSError(f"short transfer at {offset} of {path}")

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
      list(pool.map(stream, range(streams)))  # raises a stream's error
    return time.perf_counter() - start

  def write(flags: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
    try:
      start = time.perf_counter()
      run(fd, lambda fd, buf, offset: os.pwrite(fd, buf, offset))
      os.fsync(fd)
      return time.perf_counter() - start
    finally:
      os.close(fd)

  try:
    write_s = write(os.O_DIRECT if direct else 0)
  except OSError:
    if not direct:
      raise
    direct = False  # the filesystem does not do direct I/O
    write_s = write(0)
  if not direct:
    drop_page_cache(path.parent)
  fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
  try:
    read_s = run(fd, lambda fd, buf, offset: os.preadv(fd, [buf], offset))
  finally:
    os.close(fd)
  for buf in bufs:
    buf.close()
  done = blocks * streams * RAW_BLOCK_BYTES
  return {
    "tool": "python O_DIRECT" if direct else "python buffered (no O_DIRECT) + fsync",
    "direct": direct,
    "bytes": done,
    "write_s": write_s,
    "read_s": read_s,
    "write_bytes_per_s": done / write_s,
    "read_bytes_per_s": done / read_s,
  }


def raw_mixed(read_path: pathlib.Path, write_path: pathlib.Path, streams: int) -> float:
  """Bytes/s of the disk reading `read_path` while writing as much to `write_path`.

  `streams` readers and `streams` writers at once (O_DIRECT, 16 MiB blocks),
  as the tier reads slices ahead while writing earlier ones back.
  """
  nbytes = read_path.stat().st_size
  blocks = nbytes // RAW_BLOCK_BYTES // streams
  bufs = [mmap.mmap(-1, RAW_BLOCK_BYTES) for _ in range(2 * streams)]  # page-aligned
  for buf in bufs[streams:]:
    buf.write(np.random.default_rng(1).bytes(RAW_BLOCK_BYTES))  # incompressible data
  rfd = os.open(read_path, os.O_RDONLY | os.O_DIRECT)
  wfd = os.open(write_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)

  def stream(i: int) -> None:
    reading = i < streams
    for b in range(blocks):
      offset = (i % streams * blocks + b) * RAW_BLOCK_BYTES
      if reading:
        n = os.preadv(rfd, [bufs[i]], offset)
      else:
        n = os.pwrite(wfd, bufs[i], offset)
      if n != RAW_BLOCK_BYTES:
        raise OSError(f"short transfer at {offset}")

  try:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2 * streams) as pool:
      list(pool.map(stream, range(2 * streams)))
    os.fsync(wfd)
    elapsed = time.perf_counter() - start
  finally:
    os.close(rfd)
    os.close(wfd)
    for buf in bufs:
      buf.close()
    write_path.unlink(missing_ok=True)
  return 2 * blocks * streams * RAW_BLOCK_BYTES / elapsed


def raw_pass(workdir: pathlib.Path, args: argparse.Namespace, when: str) -> dict[str, Any]:
  """One raw write+read pass; an `error` record instead of raising."""
  try:
    raw = measure_raw(workdir, args.raw_gib, args.raw_tool)
  except (OSError, RuntimeError, ValueError, KeyError) as e:
    print(f"raw sequential measurement ({when}) failed: {type(e).__name__}: {e}", flush=True)
    return {"when": when, "error": f"{type(e).__name__}: {e}"}
  print(
    f"raw sequential ({when}, {raw['tool']}, {raw['bytes'] / GiB:.2g} GiB): write "
    f"{raw['write_bytes_per_s'] / GB:.2f} GB/s, read {raw['read_bytes_per_s'] / GB:.2f} GB/s",
    flush=True,
  )
  return {"when": when, **raw}


def combine_raw(passes: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The raw figures over all passes: the best pass each way, and the per-pass range."""
  ok = [p for p in passes if "error" not in p]
  if not ok:
    return {"error": passes[0]["error"], "passes": list(passes)}
  out: dict[str, Any] = {"tool": ok[0]["tool"], "direct": ok[0]["direct"], "bytes": ok[0]["bytes"]}
  for rw in ("write", "read", "mixed"):
    if not all(f"{rw}_bytes_per_s" in p for p in ok):
      continue
    rates = [p[f"{rw}_bytes_per_s"] for p in ok]
    # The best pass: the disk's speed drifts (1.4 to 2.4 GB/s within minutes
    # on the virtual disk here), and the goal is measured against its best.
    out[f"{rw}_bytes_per_s"] = max(rates)
    out[f"{rw}_bytes_per_s_min"], out[f"{rw}_bytes_per_s_max"] = min(rates), max(rates)
  out["passes"] = list(passes)
  return out


def add_params_argument(parser: argparse.ArgumentParser, params_m: float) -> None:
  """Adds `--params-m`, the model size in million fp32 params (default `params_m`)."""
  parser.add_argument(
    "--params-m", type=float, default=params_m,
    help=f"million fp32 params; the Adam state is {STATE_BYTES_PER_PARAM} bytes per param "
    f"({params_m:g}: {params_m * 1e6 * STATE_BYTES_PER_PARAM / GB:.2f} GB)",
  )  # fmt: skip


def add_raw_arguments(parser: argparse.ArgumentParser, raw_gib: float) -> None:
  """Adds the raw-disk measurement's `--raw-gib`, `--raw-passes` and `--raw-tool`."""
  parser.add_argument(
    "--raw-gib", type=float, default=raw_gib, help=f"GiB of the raw-disk file ({raw_gib:g})"
  )
  parser.add_argument(
    "--raw-passes", type=int, choices=(1, 2), default=2,
    help="raw-disk passes: 1 before the measurements, 2 also after them (2)",
  )  # fmt: skip
  parser.add_argument(
    "--raw-tool", choices=("auto", "fio", "python"), default="auto",
    help="raw-disk tool: fio if installed, else a Python O_DIRECT loop (auto)",
  )  # fmt: skip


def check_raw_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  if not args.raw_gib > 0:
    parser.error("--raw-gib must be > 0")


def measure_raw(workdir: pathlib.Path, raw_gib: float, tool: str) -> dict[str, Any]:
  """The disk's sequential direct-I/O bandwidth each way: the best of `RAW_STREAMS`."""
  blocks = max(1, math.ceil(raw_gib * GiB / RAW_BLOCK_BYTES))
  blocks = -(-blocks // max(RAW_STREAMS)) * max(RAW_STREAMS)  # whole blocks per stream
  nbytes = blocks * RAW_BLOCK_BYTES
  path = workdir / "raw_sequential.bin"
  fio = shutil.which("fio")
  if tool == "fio" and not fio:
    raise RuntimeError("--raw-tool fio: fio is not installed")
  runs, mixed = {}, {}
  try:
    for streams in RAW_STREAMS:
      if fio and tool != "python":
        runs[streams] = raw_fio(fio, path, nbytes, streams)
      else:
        runs[streams] = raw_python(path, nbytes, streams)
    if all(r["direct"] for r in runs.values()):
      with open(path, "r+b") as f:
        f.truncate(nbytes)  # fio may have written whole blocks only
      for streams in RAW_STREAMS:
        mixed[streams] = raw_mixed(path, workdir / "raw_mixed.bin", streams)
  finally:
    path.unlink(missing_ok=True)
  first = runs[RAW_STREAMS[0]]
  out: dict[str, Any] = {
    "tool": f"{first['tool']}, best of {' and '.join(map(str, RAW_STREAMS))} streams",
    "direct": all(r["direct"] for r in runs.values()),
    "bytes": nbytes,
  }
  for rw in ("write", "read"):
    out[f"{rw}_bytes_per_s"] = max(r[f"{rw}_bytes_per_s"] for r in runs.values())
  out["streams"] = {
    str(n): {
      **{f"{rw}_bytes_per_s": r[f"{rw}_bytes_per_s"] for rw in ("write", "read")},
      **({"mixed_bytes_per_s": mixed[n]} if n in mixed else {}),
    }
    for n, r in runs.items()
  }
  if mixed:
    out["mixed_bytes_per_s"] = max(mixed.values())
  return out


# -- 2./3. the subprocess: one tier variant, or the plain-optax reference -------


class CallbackTimer:
  """Times (only) the NVMe tier's callbacks and store calls, per step.

  Wraps methods of `offlax._src.nvme.pipeline._Reader` and of one `Store`; missing
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

      reader = pipeline._Reader
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
  out["rss_after_import_bytes"] = proc_status_bytes("VmRSS")
  shapes = param_shapes(args.params_m)
  params = random_tree(shapes, seed=0, std=0.02)
  grads = random_tree(shapes, seed=1, std=1e-3)
  jax.block_until_ready((params, grads))
  out["baseline_rss_bytes"] = proc_status_bytes("VmRSS")  # params + grads + runtime
  out["peak_reset_supported"] = reset_peak_rss()
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
    out["peak_rss_init_bytes"] = peak_rss()
    if tier is not None:
      records = tier.store.records
      out["state_bytes"] = sum(r.size * np.dtype(r.dtype).itemsize for r in records)
      out["cold_bytes"] = sum(r.size * np.dtype(r.dtype).itemsize for r in records if not r.hot)
      out["hot_arrays"] = sum(r.hot for r in records)
      out["cold_arrays"] = sum(not r.hot for r in records)
      out["store_bytes_after_init"] = tree_bytes(store_dir)
      timer.install(tier.store)
      log(
        f"[{label}] init wrote {out['state_bytes'] / GB:.2f} GB in {out['init_s']:.1f} s "
        f"({out['state_bytes'] / out['init_s'] / GB:.2f} GB/s); "
        f"{out['cold_arrays']} arrays on disk, {out['hot_arrays']} cached"
      )

    reset_peak_rss()
    step = make_step(tx)  # compiled by the first warm-up step
    times, syncs, breakdowns, cache_evicted = [], [], [], []
    for n in range(args.warmup + args.steps):
      if tier is not None and not args.warm_cache:
        cached = meminfo_bytes("Cached")
        drop_page_cache(store_dir)
        after = meminfo_bytes("Cached")
        cache_evicted.append(None if cached is None or after is None else cached - after)
      timer.take()
      disk_before = device_bytes(store_dir) if tier is not None else None
      start = time.perf_counter()
      params, state = step(params, state, grads)
      jax.block_until_ready((params, state))
      elapsed = time.perf_counter() - start
      breakdown = timer.take()
      disk_after = device_bytes(store_dir) if disk_before is not None else None
      sync_s = None
      if tier is not None and not args.fsync:
        start = time.perf_counter()
        os.sync()  # the writes the step left in the page cache
        sync_s = time.perf_counter() - start
      if n < args.warmup:
        out.setdefault("warmup_s", []).append(elapsed)
        out["peak_rss_compile_bytes"] = peak_rss()
        out["rss_before_steps_bytes"] = proc_status_bytes("VmRSS")
        reset_peak_rss()
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
    out["peak_rss_steps_bytes"] = peak_rss()
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
    s["raw_equivalent_s"] = raw_s = raw_seconds(raw, read_b, write_b)
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


def raw_seconds(raw: dict[str, Any], read_b: int, write_b: int) -> float:
  """The raw disk's time for the traffic: reading then writing, or both at once if faster."""
  serial = read_b / raw["read_bytes_per_s"] + write_b / raw["write_bytes_per_s"]
  if "mixed_bytes_per_s" not in raw:
    return serial
  # The mixed run moves as much each way; the larger side bounds the same traffic.
  return min(serial, 2 * max(read_b, write_b) / raw["mixed_bytes_per_s"])


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


Bar = tuple[str, float, float, float, str, str]  # label, median, min, max, color, note


def raw_bars(raw: dict[str, Any]) -> list[Bar]:
  """The raw disk's read and write GB/s as bars; none if its measurement failed."""
  if raw.get("error"):
    return []
  bars = []
  for rw in ("read", "write"):
    median, lo, hi = (raw[f"{rw}_bytes_per_s{x}"] / GB for x in ("", "_min", "_max"))
    tool = raw["tool"].split(",")[0]
    bars.append((f"raw {rw}\n({tool},\nbest)", median, lo, hi, "tab:gray", ""))
  return bars


def stats_bar(label: str, gb_per_s: dict[str, float], ratio: dict | None, color: str) -> Bar:
  """A bar of a GB/s `stats_of` record, noted with its median ratio to the raw disk if any."""
  note = f"\n{ratio['median']:.2f}x raw" if ratio else ""
  return (label, gb_per_s["median"], gb_per_s["min"], gb_per_s["max"], color, note)


def draw_bars(ax: Any, bars: Sequence[Bar], headroom: float) -> None:
  """`bars` with min-to-max whiskers, each labelled with its median and note."""
  x = np.arange(len(bars))
  med = np.array([b[1] for b in bars])
  err = [med - np.array([b[2] for b in bars]), np.array([b[3] for b in bars]) - med]
  ax.bar(x, med, yerr=err, capsize=6, color=[b[4] for b in bars])
  for xi, b in zip(x, bars, strict=True):
    _common.label_above(ax, f"{b[1]:.2f}{b[5]}", (xi, b[3]), dy=3)
  ax.set_xticks(x, [b[0] for b in bars], fontsize=8)
  ax.set_ylim(0, max(b[3] for b in bars) * headroom)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  plt = _common.pyplot()
  raw, tiers = result["raw"], result["tier"]
  bars = raw_bars(raw)
  if bars and result.get("raw_combined_gb_per_s"):
    v = result["raw_combined_gb_per_s"]
    bars.append(("raw combined\n(tier's R+W mix)", v, v, v, "dimgray", ""))
  for name, key, color in TIER_RUNS:
    label = "tier step\n" + name.replace(", ", "\n")
    t = tiers.get(key)
    if t and "error" not in t:
      bars.append(stats_bar(label, t["gb_per_s"], t.get("ratio_vs_raw"), color))
      if "gb_per_s_incl_writeback" in t:
        bars.append(stats_bar(label + "\n+ writeback", t["gb_per_s_incl_writeback"],
                              t.get("ratio_vs_raw_incl_writeback"), "navajowhite"))  # fmt: skip

  fig, (ax, ax2) = plt.subplots(
    1, 2, figsize=(14, 6), dpi=120, gridspec_kw={"width_ratios": [1.7, 1]}
  )
  if bars:
    draw_bars(ax, bars, headroom=1.2)
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
  add_params_argument(parser, params_m=320.0)
  add_raw_arguments(parser, raw_gib=2.0)
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
    help=f"skip the fsync=True run started with GLIBC_TUNABLES={HUGETLB} (run if time allows)",
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
  # Internal: one measurement in a subprocess.
  parser.add_argument("--child", choices=("tier", "host", "compute"), help=argparse.SUPPRESS)
  parser.add_argument("--fsync", type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--store", help=argparse.SUPPRESS)
  parser.add_argument("--cache-bytes", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--chunk-bytes", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  _common.check_steps_arguments(parser, args)
  if not args.params_m > 0:
    parser.error("--params-m must be > 0")
  check_raw_arguments(parser, args)
  if args.child and not args.store:
    parser.error("--child needs --store")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, writes the JSON and PNG, prints and returns the results."""
  args = parse_args(argv)
  if args.child:
    try:
      child = child_main(args)
    except BaseException as e:  # reported to the parent, which records the traceback
      traceback.print_exc()
      child = {"error": "".join(traceback.format_exception(e))}
    print(CHILD_MARKER + json.dumps(child), flush=True)
    return child

  # Only _common.environment() uses these, at the end; imported before the clock starts so that
  # their import time stays out of wall_s.
  import jax  # noqa: F401
  import optax  # noqa: F401

  import offlax  # noqa: F401

  wall_start = time.perf_counter()
  load_before = os.getloadavg()
  shapes = param_shapes(args.params_m)
  n_params = sum(math.prod(s) for s in shapes.values())
  state_bytes = n_params * STATE_BYTES_PER_PARAM
  cache, chunk = auto_tier_bytes(
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
    fs = filesystem_info(workdir)
    print(fs["df"] or f"{workdir}: {fs['free_bytes'] / GiB:.1f} GiB free", flush=True)
    raw_bytes = max(1, math.ceil(args.raw_gib * GiB / RAW_BLOCK_BYTES)) * RAW_BLOCK_BYTES
    need = max(raw_bytes, 2 * state_bytes) * 1.1 + 256 * MiB
    if fs["free_bytes"] < need:
      raise SystemExit(
        f"{workdir}: {fs['free_bytes'] / GiB:.1f} GiB free, the benchmark needs "
        f"{need / GiB:.1f} GiB (raw file, then two generations of the state)"
      )

    passes = [raw_pass(workdir, args, "before")]

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
      children[key] = run_child(
        args, mode, fsync, workdir / f"store_{key}", cache, chunk, hugetlb=key == "hugetlb"
      )
      if "error" in children[key]:
        print(f"{key} FAILED:\n{children[key]['error']}", flush=True)
    if args.raw_passes > 1:  # again after the tier, to catch a drift of the disk's speed
      passes.append(raw_pass(workdir, args, "after"))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)

  raw = combine_raw(passes)
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
