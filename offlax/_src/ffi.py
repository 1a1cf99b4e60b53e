"""offlax's native library: XLA FFI handlers for XLA:CPU, built on first use.

The sources in `native/` (`adam.cc`: the host Adam kernel; `adam8.cc`: its 8-bit
state version; `slices.cc`: the NVMe tier's copies between XLA's buffers and its
slice buffers; `transpose.cc`: a matrix transpose for checkpoint loads and saves,
called by ctypes; `common.h`: what the two Adam kernels share) are compiled
into one shared library with the system C++ compiler, cached in
``$OFFLAX_CACHE_DIR`` (default ``~/.cache/offlax``) under a name keyed by the
sources and headers, the flags, the jaxlib headers and the CPU, and registered with XLA
for the CPU platform and for the host computations of GPU programs
(`plugin_ffi.py`). If the build or a registration fails, or ``OFFLAX_NATIVE=0``,
`available()` is False and every user falls back to plain JAX, with the same
results.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import fcntl
import hashlib
import logging
import os
import pathlib
import platform
import re
import subprocess
import tempfile
import threading

import jax

from offlax._src import plugin_ffi

_LOG = logging.getLogger("offlax")
_NATIVE = pathlib.Path(__file__).parent / "native"
_SOURCES = ("adam.cc", "adam8.cc", "slices.cc", "transpose.cc")
_HEADERS = ("common.h",)  # included by sources: part of the cache key, so an edit rebuilds
_FLAGS = ["-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"]

# FFI target name -> the handler's symbol in the library.
TARGETS = {
  "offlax_adam_f32": "OfflaxAdamF32",
  "offlax_adam_moments_f32": "OfflaxAdamMomentsF32",
  "offlax_adam_step": "OfflaxAdamStep",
  "offlax_adam8_step": "OfflaxAdam8Step",
  "offlax_to_slice": "OfflaxToSlice",
  "offlax_from_slice": "OfflaxFromSlice",
}

# Targets elementwise in their first n operands (placeholders among them are
# constants), the rest being hyperparameters: the offload schedule may cut
# their leaves into slices (`coupling.py`).
ELEMENTWISE = {"offlax_adam_moments_f32": 3, "offlax_adam_f32": 4, "offlax_adam_step": 5}

_lock = threading.Lock()
_registered: bool | None = None
_library: ctypes.CDLL | None = None
_library_tried = False  # a failed build (or OFFLAX_NATIVE=0) is not tried again
_shapes_only = contextvars.ContextVar("offlax_ffi_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
  """Within it, `available` builds nothing: for tracing that only wants shapes.

  The native and plain-JAX paths give the same shapes and dtypes, so the planner's
  `jax.eval_shape` of an update need not compile the library (seconds, on a fresh
  machine) to learn them.
  """
  token = _shapes_only.set(True)
  try:
    yield
  finally:
    _shapes_only.reset(token)


def available() -> bool:
  """Builds (once per machine) and registers the library; False if it cannot.

  False without building under `shapes_only` while nothing is registered yet.
  """
  global _registered
  with _lock:
    if _registered is None and _shapes_only.get():
      return False
    if _registered is None:
      _registered = _register()
    return _registered


def library() -> ctypes.CDLL | None:
  """The built library, for its plain C functions (ctypes releases the GIL); None if none.

  Built once per machine (as for `available`), without registering anything with XLA.
  """
  global _library, _library_tried
  with _lock:
    if not _library_tried:
      _library, _library_tried = _load(), True
    return _library


def _load() -> ctypes.CDLL | None:
  if os.environ.get("OFFLAX_NATIVE", "1") == "0":
    return None
  try:
    return ctypes.CDLL(str(_build()))
  except (OSError, subprocess.SubprocessError) as e:
    _LOG.warning("offlax: native library unavailable, using numpy: %s", e)
    return None


def on_cpu(native, default, *args):
  """`native(*args)` in code XLA compiles for the CPU, when the library is there; else `default`.

  The platform is chosen when lowering (`jax.lax.platform_dependent`), so a GPU
  program, or its export for CUDA, runs `default` and never names the
  library's targets; `native` and `default` return the same types.
  """
  if not available():
    return default(*args)
  return jax.lax.platform_dependent(*args, cpu=native, default=default)


def _register() -> bool:
  if os.environ.get("OFFLAX_NATIVE", "1") == "0":
    return False
  try:
    library = ctypes.CDLL(str(_build()))
    handlers = {name: getattr(library, symbol) for name, symbol in TARGETS.items()}
  except (OSError, subprocess.SubprocessError, AttributeError) as e:
    _LOG.warning("offlax: native library unavailable, using plain JAX: %s", e)
    return False
  # The plugins first: a GPU program that names a target its host computation
  # cannot find aborts the process, so no registration at all if one fails.
  addresses = {name: ctypes.cast(fn, ctypes.c_void_p).value or 0 for name, fn in handlers.items()}
  if not plugin_ffi.register_for_plugin_hosts(addresses):
    return False
  for name, fn in handlers.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
  return True


def _flags() -> list[str]:
  """Compiler flags; no FMA where XLA:CPU is told not to use it (as it then does not)."""
  isa = re.search(r"--xla_cpu_max_isa=(\w+)", os.environ.get("XLA_FLAGS", ""))
  if isa and isa.group(1).upper() in ("SSE4_2", "AVX", "NEON"):
    return [*_FLAGS, "-mno-fma"]
  return list(_FLAGS)


def _build() -> pathlib.Path:
  """Compiles the sources into the cache directory, unless the library is there."""
  include = jax.ffi.include_dir()
  flags = _flags()
  sources = [_NATIVE / name for name in _SOURCES]
  headers = [_NATIVE / name for name in _HEADERS]
  key = hashlib.sha256()
  parts = (s.read_bytes() for s in (*sources, *headers))
  for part in (*parts, " ".join(flags).encode(), include.encode()):
    key.update(part)
  key.update(_cpu_id())  # what -march=native compiled for
  cache = pathlib.Path(
    os.environ.get("OFFLAX_CACHE_DIR")
    or pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "offlax"
  )
  target = cache / f"offlax-{key.hexdigest()[:16]}.so"
  if target.exists():
    return target
  cache.mkdir(parents=True, exist_ok=True)
  # One builder at a time (pytest's workers, a job's processes): the others wait for its
  # library rather than compile the same sources beside it on the same cores.
  with open(cache / f"{target.name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if target.exists():
      return target
    compiler = os.environ.get("CXX", "c++")
    # Built beside the target and renamed: concurrent builders never load half a file.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
      out = pathlib.Path(tmp) / target.name
      # Each source compiled by its own process, at once (the first use waits for the
      # slowest, not the sum), then linked.
      objects = [pathlib.Path(tmp) / f"{s.stem}.o" for s in sources]
      compiles = [
        [compiler, *flags, "-fPIC", "-c", f"-I{include}", str(s), "-o", str(o)]
        for s, o in zip(sources, objects, strict=True)
      ]
      runs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for c in compiles]  # fmt: skip
      try:
        for cmd, proc in zip(compiles, runs, strict=True):
          _, stderr = proc.communicate(timeout=600)
          if proc.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {stderr.strip()[-2000:]}")
      finally:
        for proc in runs:  # the others, after a failure
          if proc.poll() is None:
            proc.kill()
            proc.wait()
      cmd = [compiler, *flags, "-shared", *map(str, objects), "-o", str(out)]
      run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
      if run.returncode != 0:
        raise OSError(f"{' '.join(cmd)} failed: {run.stderr.strip()[-2000:]}")
      os.replace(out, target)
  return target


def _cpu_id() -> bytes:
  """What -march=native compiles for: the machine and its CPU's flags."""
  flags = ""
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line for line in f if line.startswith("flags")), "")
  except OSError:
    pass
  return f"{platform.machine()} {flags}".encode()
