"""The disk benchmarks' toolkit: the raw disk's sequential bandwidth, the page cache, files.

Private to `benchmarks/`, shared by nvme_throughput.py, checkpoint.py and gpu_check.py: every
figure of theirs against "the raw disk" comes from `measure_raw` (a whole pass, by fio if installed)
or `raw_python` (one measurement with direct I/O), on the filesystem under test. Only the
standard library and NumPy are imported.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import mmap
import os
import pathlib
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import _common

GB = 1e9  # throughput and traffic in decimal GB; RAM in binary MiB/GiB
MiB = 2**20
GiB = 2**30
RAW_BLOCK_BYTES = 16 * MiB
# The raw disk is measured with one stream and with as many as the tier's I/O
# threads (NVMeTier's default 4), each way; the faster counts. A virtual disk
# here gave 1.4 GB/s to one writer and 1.9 GB/s to four.
RAW_STREAMS = (1, 4)


# -- files and the page cache ------------------------------------------------------


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
  """Bytes of the files under `path` (their sizes, not the blocks they take)."""
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
  """Size, free bytes, and (where `df` runs) device, type and `df -hT` of `path`'s filesystem."""
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


# -- raw sequential bandwidth ------------------------------------------------------


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


def raw_seconds(raw: dict[str, Any], read_b: int, write_b: int) -> float:
  """The raw disk's time for the traffic: reading then writing, or both at once if faster."""
  serial = read_b / raw["read_bytes_per_s"] + write_b / raw["write_bytes_per_s"]
  if "mixed_bytes_per_s" not in raw:
    return serial
  # The mixed run moves as much each way; the larger side bounds the same traffic.
  return min(serial, 2 * max(read_b, write_b) / raw["mixed_bytes_per_s"])


# -- arguments ---------------------------------------------------------------------


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
  """Exits with a usage error unless `--raw-gib` > 0."""
  if not args.raw_gib > 0:
    parser.error("--raw-gib must be > 0")


# -- bars --------------------------------------------------------------------------


def raw_bars(raw: dict[str, Any]) -> list[_common.Bar]:
  """The raw disk's read and write GB/s as bars; none if its measurement failed."""
  if raw.get("error"):
    return []
  bars = []
  for rw in ("read", "write"):
    median, lo, hi = (raw[f"{rw}_bytes_per_s{x}"] / GB for x in ("", "_min", "_max"))
    tool = raw["tool"].split(",")[0]
    bars.append((f"raw {rw}\n({tool},\nbest)", median, lo, hi, "tab:gray", ""))
  return bars


def stats_bar(
  label: str, gb_per_s: dict[str, float], ratio: dict | None, color: str
) -> _common.Bar:
  """A bar of a GB/s `stats_of` record, noted with its median ratio to the raw disk if any."""
  note = f"\n{ratio['median']:.2f}x raw" if ratio else ""
  return (label, gb_per_s["median"], gb_per_s["min"], gb_per_s["max"], color, note)
