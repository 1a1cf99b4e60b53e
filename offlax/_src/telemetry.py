"""What the offload costs: bytes per tier and per step, the NVMe pipeline's I/O, warnings.

`offlax.stats` (`tier.stats`) reads the sizes from the state's structure (no
device sync) and the NVMe tier's counters of its last completed step, which the step's callbacks
keep on the Python side (`DiskTelemetry`), so leaving them on costs a few
clock reads and additions per slice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from offlax._src import errors
from offlax._src.units import format_bytes

logger = logging.getLogger("offlax")

# A step that waits on the disk for more than this share of its time, this many
# steps in a row, is I/O-bound.
STALL_SHARE = 0.5
STALL_STEPS = 3
STALL_MIN_S = 0.25  # shorter steps (small states: the commit's flush dominates) never warn
# XLA's default cap on a GPU's pinned host pool, raised by this variable.
PINNED_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_LIMIT_DEFAULT_GB = 64.0
HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


class OffloadStats(NamedTuple):
  """What an offloaded optimizer state holds where, and what a step moves.

  Sizes come from the state's structure; the `disk_*`, `cache_*`, `io_wait_s`
  and `step_s` fields are the NVMe tier's figures of its last completed step
  (None for the host tier, or before the first step).

  Attributes:
    step: the NVMe store's last committed step (None for the host tier).
    device_bytes: state bytes resident in device memory (partial offload).
    host_bytes: state bytes resident in host RAM (the NVMe tier's cache).
    nvme_bytes: state bytes in the NVMe store's committed generation.
    h2d_bytes: bytes one update moves host -> device: the streamed state, or
      (`compute="host"`) the updates.
    d2h_bytes: bytes one update moves device -> host: the new state, or
      (`compute="host"`) the gradients, plus the params when `update` gets them.
    disk_read_bytes: bytes read from the disk by the last step.
    disk_write_bytes: bytes written to the disk by the last step (cached items
      included: the whole state is on disk after each commit).
    cache_hit_bytes: state bytes the last step found in RAM.
    cache_miss_bytes: state bytes the last step read from disk.
    io_wait_s: seconds the last step's callbacks waited on the disk (reads,
      writes, the commit's flush) rather than handing data to XLA.
    step_s: seconds from the last step's first callback to its commit.
  """

  step: int | None
  device_bytes: int
  host_bytes: int
  nvme_bytes: int
  h2d_bytes: int
  d2h_bytes: int
  disk_read_bytes: int | None = None
  disk_write_bytes: int | None = None
  cache_hit_bytes: int | None = None
  cache_miss_bytes: int | None = None
  io_wait_s: float | None = None
  step_s: float | None = None

  def summary(self) -> str:
    """One line for a log: resident bytes per tier, then the last step's I/O."""
    b = format_bytes
    line = (
      f"offlax: state device {b(self.device_bytes)}, host {b(self.host_bytes)}, "
      f"nvme {b(self.nvme_bytes)}; per step h2d {b(self.h2d_bytes)}, d2h {b(self.d2h_bytes)}"
    )
    if self.step is not None:
      line = f"{line}; committed step {self.step}"
    if self.step_s is not None:
      line = f"{line}; {_io_line(self)}"
    return line


def _io_line(s: Any) -> str:
  share = s.io_wait_s / s.step_s if s.step_s else 0.0
  return (
    f"disk read {format_bytes(s.disk_read_bytes)}, written {format_bytes(s.disk_write_bytes)}; "
    f"waited on I/O {s.io_wait_s:.3g} s of {s.step_s:.3g} s ({share:.0%}); "
    f"cache hits {format_bytes(s.cache_hit_bytes)}, misses {format_bytes(s.cache_miss_bytes)}"
  )


class StepIO(NamedTuple):
  """The NVMe tier's figures of one step (fields as in `OffloadStats`)."""

  disk_read_bytes: int
  disk_write_bytes: int
  cache_hit_bytes: int
  cache_miss_bytes: int
  io_wait_s: float
  step_s: float


class DiskTelemetry:
  """Counters the NVMe tier's step updates from its I/O threads and XLA's callback threads."""

  def __init__(self, log_every: int | None = None):
    self.log_every = log_every
    self.last: StepIO | None = None
    self._lock = threading.Lock()
    self._start: float | None = None
    self._read = self._written = 0
    self._wait = 0.0
    self._stalls = 0  # consecutive I/O-bound steps
    self._warned_stall = False

  def begin(self) -> None:
    """Marks the start of a step (its first callback); later calls are no-ops.

    Counts from before it (an init's writes, a resume's reads) are dropped.
    """
    with self._lock:
      if self._start is None:
        self._start = time.perf_counter()
        self._read = self._written = 0
        self._wait = 0.0

  def bytes_read(self, n: int) -> None:
    with self._lock:
      self._read += n

  def bytes_written(self, n: int) -> None:
    with self._lock:
      self._written += n

  def waited(self, seconds: float) -> None:
    with self._lock:
      self._wait += seconds

  def end(self, step: int, hit_bytes: int, miss_bytes: int) -> StepIO:
    """Closes the step just committed; logs and warns as configured."""
    with self._lock:
      start = self._start if self._start is not None else time.perf_counter()
      last = StepIO(
        self._read, self._written, hit_bytes, miss_bytes, self._wait, time.perf_counter() - start
      )
      self._start, self._read, self._written, self._wait = None, 0, 0, 0.0
    self.last = last
    stalled = last.step_s >= STALL_MIN_S and last.io_wait_s > STALL_SHARE * last.step_s
    self._stalls = self._stalls + 1 if stalled else 0
    if self._stalls >= STALL_STEPS and not self._warned_stall:
      self._warned_stall = True
      warnings.warn(
        f"offlax: the NVMe tier waited on the disk for {last.io_wait_s / last.step_s:.0%} of "
        f"each of the last {STALL_STEPS} steps ({last.io_wait_s:.3g} s of {last.step_s:.3g} s): "
        "the disk bounds the step. Use a faster disk (or several, striped), keep more state in "
        "RAM (a larger NVMeTier(cache_bytes=...)), or the host tier if the state fits in RAM "
        "(`python -m offlax plan`).",
        errors.PerformanceWarning,
        stacklevel=2,
      )
    if self.log_every and step % self.log_every == 0:
      logger.info("NVMe step %d: %s", step, _io_line(last))
    return last


def check_cache(records: Sequence[Any], cache_bytes: int) -> None:
  """Warns when `cache_bytes` of RAM hold little of the state although they could."""
  cold = [r.nbytes for r in records if not r.hot]
  if not cold:
    return
  used = sum(r.nbytes for r in records if r.hot)
  b = format_bytes
  if cache_bytes >= 2**20 and used < cache_bytes / 2:
    warnings.warn(
      f"offlax: NVMeTier(cache_bytes={cache_bytes}) holds only {b(used)}: the cache keeps whole "
      f"state arrays and the smallest one on disk is {b(min(cold))}, so every step reads all "
      f"{b(sum(cold))} of them from disk. Raise cache_bytes to at least "
      f"{min(cold) + used} to cache it, or lower it to free the RAM.",
      errors.PerformanceWarning,
      stacklevel=4,
    )
  free = _free_ram()
  # Small states are not worth a warning (tests, examples); large ones that fit in RAM are.
  if free is not None and 2**30 < sum(cold) + used < free / 2:
    warnings.warn(
      f"offlax: the whole optimizer state ({b(sum(cold) + used)}) would fit in this host's free "
      f"RAM ({b(free)}), yet every step reads {b(sum(cold))} of it from disk: use "
      "offlax.HostTier, or raise NVMeTier(cache_bytes=...).",
      errors.PerformanceWarning,
      stacklevel=4,
    )


def check_pinned(host_bytes: int, platform: str) -> None:
  """Warns when host-tier state nears the GPU's pinned host memory pool."""
  if platform not in ("gpu", "cuda", "rocm"):
    return  # the CPU backend's host memory is ordinary RAM, uncapped
  limit = float(os.environ.get(PINNED_LIMIT_ENV, PINNED_LIMIT_DEFAULT_GB)) * 2**30
  if host_bytes > 0.9 * limit:
    warnings.warn(
      f"offlax: the host tier holds {format_bytes(host_bytes)} of pinned host memory; XLA caps "
      f"the pool at {format_bytes(limit)} ({PINNED_LIMIT_ENV}={limit / 2**30:g}), so allocations "
      f"will fail or spill. Raise it (e.g. {PINNED_LIMIT_ENV}="
      f"{int(host_bytes * 1.25 / 2**30) + 1}) before JAX starts, offload less "
      "(HostTier(fraction=...)), or use the NVMe tier.",
      errors.PerformanceWarning,
      stacklevel=4,
    )


def check_committed(params: Any, platform: str) -> None:
  """Warns on a GPU when params are uncommitted: the jitted step would compile twice.

  JAX commits every output of a program that moves memory, so the params the
  first step returns are committed where the first call's were not, and the
  second call compiles again: minutes for a big model. On the CPU backend a
  compile is cheap, and uncommitted params are what `jnp` makes: no warning.
  """
  if platform not in ("gpu", "cuda", "rocm"):
    return
  loose = [
    jax.tree_util.keystr(path)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.committed
  ]
  if loose:
    warnings.warn(
      f"offlax: params {', '.join(loose[:3])}{' ...' if len(loose) > 3 else ''} are not "
      "committed to a device: the jitted step commits them on its first call and compiles "
      "again on its second (plain optax would not). Commit them first: "
      "params = jax.device_put(params, jax.devices()[0]) (or place them on your mesh).",
      errors.PerformanceWarning,
      stacklevel=4,
    )


def check_hugepages(nvme_bytes: int, platform: str, *, native: bool) -> None:
  """Hints at glibc's huge-page tunable for a large NVMe state on the CPU backend.

  Without offlax's native copies (`native`), slices cross the tier's
  callbacks through fresh buffers (copies of every argument, XLA's results),
  so with 4 KiB pages a step faults once per 4 KiB of state: 8-25% of the step
  in benchmarks/nvme_throughput.py. If transparent huge pages are in
  "madvise" mode, only a process started with the tunable gets them for
  malloc'd memory; nothing can turn it on later. The native copies touch no
  fresh memory: with them the tunable made no difference there.
  """
  if (
    native
    or platform != "cpu"
    or nvme_bytes < 2**30
    or "hugetlb" in os.environ.get("GLIBC_TUNABLES", "")
  ):
    return
  try:
    with open(_THP) as f:
      mode = f.read()
  except OSError:
    return
  if "[madvise]" in mode:
    warnings.warn(
      f"offlax: the NVMe tier streams {format_bytes(nvme_bytes)} through its callbacks (offlax's "
      "native library is off), into buffers allocated afresh each step, and transparent huge "
      "pages are in madvise mode here: start Python "
      f"with {HUGETLB_TUNABLE} in GLIBC_TUNABLES (':'-separated, after any tunables already "
      "set) to get them (steps 8-25% shorter in benchmarks/nvme_throughput.py).",
      errors.PerformanceWarning,
      stacklevel=4,
    )


def check_chunk(chunk_bytes: int, recommended: int, state_bytes: int) -> None:
  """Warns when the slice size is far from the tier's recommended one for this state."""
  if chunk_bytes * 8 < recommended and state_bytes > 256 * chunk_bytes:
    warnings.warn(
      f"offlax: chunk_bytes={chunk_bytes} cuts {format_bytes(state_bytes)} of state into "
      f"{-(-state_bytes // chunk_bytes)} slices; per-slice overheads (transfers, callbacks, "
      f"kernel launches) then dominate. Use chunk_bytes={recommended} (the default).",
      errors.PerformanceWarning,
      stacklevel=4,
    )
  elif chunk_bytes > 16 * recommended and state_bytes > 2 * recommended * 16:
    warnings.warn(
      f"offlax: chunk_bytes={chunk_bytes} needs about {format_bytes(3 * chunk_bytes)} of device "
      f"memory for slices in flight and overlaps transfers with compute only across "
      f"{-(-state_bytes // chunk_bytes)} slices. Use chunk_bytes={recommended} (the default) "
      "unless the planner (`python -m offlax plan`) says otherwise.",
      errors.PerformanceWarning,
      stacklevel=4,
    )


def _free_ram() -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None
