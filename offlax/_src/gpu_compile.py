"""What XLA's GPU compiler allocates for a step, compiled on a machine without a GPU.

XLA:GPU's host offloader, scheduler and buffer assignment decide a step's device
memory; the CPU backend elides transfers and accepts programs the GPU compiler
rewrites. With the `jax-cuda12-plugin` wheels installed (`offlax[gpu-compile]`;
no driver, no CUDA libraries), `jax.experimental.topologies` gives compile-only
CUDA devices from a target description, and the compiled executable reports
its buffer assignment. Nothing is allocated: a 70B step compiles in seconds.

Shardings on the topology's devices have no memories and silently drop
``pinned_host``, which compiles a wrong program; so the step is lowered with
shardings on a CPU-device mesh and the StableHLO (which carries the memory
kinds) is compiled for the target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from offlax._src import coupling, errors, host_callbacks
from offlax._src.units import format_bytes


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """The facts XLA's GPU compiler needs about a GPU (a `GpuTargetConfigProto`).

  The figures are the cards' published specifications; `device_memory_size`
  is the memory the CUDA runtime reports (a little under the nominal size).
  XLA's scheduler uses it as the memory limit, so a step that does not fit
  compiles to a schedule that tries to fit.
  """

  name: str
  compute_capability: tuple[int, int]
  core_count: int
  device_memory_size: int
  memory_bandwidth: int
  l2_cache_size: int
  clock_rate_ghz: float
  shared_memory_per_core: int
  shared_memory_per_block_optin: int
  threads_per_core_limit: int = 2048
  fpus_per_core: int = 128

  def with_memory(self, device_memory_size: int | None) -> GpuTarget:
    """This target with another device memory size (a MIG slice, a smaller SKU)."""
    if device_memory_size is None:
      return self
    return dataclasses.replace(self, device_memory_size=int(device_memory_size))

  def config(self) -> str:
    """The target as `GpuTargetConfigProto` text, with the fields jaxlib 0.10 knows."""
    major, minor = self.compute_capability
    info = {
      "threads_per_block_limit": 1024,
      "threads_per_warp": 32,
      "shared_memory_per_block": 49152,
      "shared_memory_per_core": self.shared_memory_per_core,
      "threads_per_core_limit": self.threads_per_core_limit,
      "core_count": self.core_count,
      "fpus_per_core": self.fpus_per_core,
      "block_dim_limit_x": 2**31 - 1,
      "block_dim_limit_y": 65535,
      "block_dim_limit_z": 65535,
      "memory_bandwidth": self.memory_bandwidth,
      "l2_cache_size": self.l2_cache_size,
      "clock_rate_ghz": self.clock_rate_ghz,
      "device_memory_size": self.device_memory_size,
      "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
      "registers_per_core_limit": 65536,
      "registers_per_block_limit": 65536,
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in info.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
    lines += [
      'platform_name: "CUDA"',
      "dnn_version_info { major: 9 minor: 8 patch: 0 }",
      f'device_description_str: "{self.name}"',
    ]
    return "\n".join(lines) + "\n"


GB = 10**9
TARGETS: dict[str, GpuTarget] = {
  t.name.split()[0]: t
  for t in (
    GpuTarget("h100 (NVIDIA H100 80GB HBM3, SXM)", (9, 0), 132, 85_520_809_984,
              3_350 * GB, 50 * 2**20, 1.98, 233_472, 232_448),
    GpuTarget("h200 (NVIDIA H200 141GB HBM3e)", (9, 0), 132, 151_397_597_184,
              4_800 * GB, 50 * 2**20, 1.98, 233_472, 232_448),
    GpuTarget("a100-40gb (NVIDIA A100-SXM4-40GB)", (8, 0), 108, 42_298_834_944,
              1_555 * GB, 40 * 2**20, 1.41, 167_936, 166_912, fpus_per_core=64),
    GpuTarget("a100-80gb (NVIDIA A100-SXM4-80GB)", (8, 0), 108, 85_093_613_568,
              2_039 * GB, 40 * 2**20, 1.41, 167_936, 166_912, fpus_per_core=64),
    GpuTarget("rtx4090 (NVIDIA GeForce RTX 4090, 24 GB)", (8, 9), 128, 25_393_692_672,
              1_008 * GB, 72 * 2**20, 2.52, 102_400, 101_376, threads_per_core_limit=1536),
    GpuTarget("l4 (NVIDIA L4, 24 GB)", (8, 9), 58, 23_580_639_232,
              300 * GB, 48 * 2**20, 2.04, 102_400, 101_376, threads_per_core_limit=1536),
  )
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """A step's buffer assignment, as XLA's GPU compiler made it.

  Attributes:
    target: the GPU compiled for.
    device: device bytes: ``argument``, ``output``, ``alias`` (outputs written
      into donated arguments) and ``temp``.
    host: the same for host memory (``pinned_host`` buffers).
    n_params: the parameter count the per-parameter figures divide by, if given.
    copies_in_flight: the most host<->device copies started and not yet done at
      one point of the schedule (of any one computation: a loop body counts once).
    host_compute: instructions XLA converted to host compute because they
      computed on host memory (slow; empty in a good program). offlax's own
      host computations (``HostTier(compute="host")``) are not among them.
    hlo: the optimized HLO text.
  """

  target: GpuTarget
  device: dict[str, int]
  host: dict[str, int]
  n_params: int | None
  copies_in_flight: int
  host_compute: tuple[str, ...]
  hlo: str = dataclasses.field(repr=False)

  @property
  def device_peak(self) -> int:
    """Device bytes the step needs at its peak: arguments, new outputs and temporaries."""
    d = self.device
    return d["argument"] + d["output"] - d["alias"] + d["temp"]

  @property
  def host_peak(self) -> int:
    """Host bytes the step needs: arguments, new outputs and temporaries."""
    h = self.host
    return h["argument"] + h["output"] - h["alias"] + h["temp"]

  @property
  def fits(self) -> bool:
    """Whether the device peak fits the target's memory."""
    return self.device_peak <= self.target.device_memory_size

  def per_param(self, nbytes: int) -> float:
    """`nbytes` per parameter (needs `n_params`)."""
    if not self.n_params:
      raise ValueError("per_param needs the parameter count: pass n_params= to compile_for_gpu.")
    return nbytes / self.n_params

  def table(self) -> str:
    """A readable summary."""
    n = self.n_params
    per = lambda b: f" ({b / n:.2f} B/param)" if n else ""
    lines = [f"compiled for {self.target.name}, {format_bytes(self.target.device_memory_size)}"]
    for name, d in (("device", self.device), ("host", self.host)):
      parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in d.items())
      lines.append(f"{name:<7}{parts}")
    lines.append(
      f"peak   device {format_bytes(self.device_peak)}{per(self.device_peak)}, "
      f"host {format_bytes(self.host_peak)}{per(self.host_peak)}; "
      + ("fits" if self.fits else "DOES NOT FIT")
    )
    lines.append(f"host<->device copies in flight at most: {self.copies_in_flight}")
    if self.host_compute:
      lines.append(
        f"XLA converted {len(self.host_compute)} instruction(s) on host memory into slow host "
        f"compute: {', '.join(self.host_compute[:5])}"
      )
    return "\n".join(lines)


def available() -> bool:
  """Whether XLA's GPU compiler can be loaded here (the `jax-cuda12-plugin` wheels)."""
  try:
    _topology(TARGETS["h100"])
  except Exception:
    return False
  return True


def compile_for_gpu(
  fn: Callable[..., Any],
  *args: Any,
  target: str | GpuTarget = "h100",
  device_memory_size: int | None = None,
  n_params: int | None = None,
  compiler_options: dict[str, str] | None = None,
  **jit_kwargs: Any,
) -> CompiledMemory:
  """Compiles `fn(*args)` with XLA's GPU compiler for `target` and reads its memory.

  Args:
    fn: the step, jitted or not (then `jax.jit(fn, **jit_kwargs)`); donate its
      arguments as the real training loop does, or the figures count them twice.
    *args: arrays or `jax.ShapeDtypeStruct`s. Their shardings carry the memory
      kinds (``pinned_host`` state); a `SingleDeviceSharding` becomes a
      one-device `NamedSharding`, which keeps its memory kind.
    target: a name in `TARGETS` (``h100``, ``h200``, ``a100-40gb``,
      ``a100-80gb``, ``rtx4090``, ``l4``) or a `GpuTarget`.
    device_memory_size: overrides the target's device memory (bytes).
    n_params: parameter count, for the per-parameter figures.
    compiler_options: XLA options for this compile, over those of ``XLA_FLAGS``
      (as `jax.stages.Lowered.compile`'s), e.g. ``{"xla_disable_hlo_passes": ""}``.
    **jit_kwargs: passed to `jax.jit` when `fn` is not jitted.

  Returns:
    A `CompiledMemory`.

  Raises:
    ImportError: the GPU compiler is not installed (``pip install offlax[gpu-compile]``).

  Example:
    >>> import jax, jax.numpy as jnp, offlax
    >>> m = offlax.compile_for_gpu(lambda x: x * 2, jnp.ones((1024,)), target="l4")
    >>> m.device["argument"], m.device["output"], m.host_compute
    (4096, 4096, ())
  """
  if isinstance(target, str):
    if target not in TARGETS:
      raise errors.InvalidTargetError(
        f"compile_for_gpu: unknown target {target!r}; known: {', '.join(TARGETS)} "
        "(or pass an offlax.extend.GpuTarget)."
      )
    target = TARGETS[target]
  target = target.with_memory(device_memory_size)
  topology = _topology(target)
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn, **jit_kwargs)
  specs = jax.tree.map(_spec, args)
  # offlax's native kernels cut into slices as in any GPU program (`coupling.split_native`).
  # offlax's host callbacks (layers on disk) lowered as on a GPU (`host_callbacks`).
  with coupling.splitting_native(True), host_callbacks.lowering_for_gpu():
    lowered = jitted.trace(*specs).lower(lowering_platforms=("cuda",))
  from jax._src import compiler
  from jax._src.lib import _jax

  module = lowered.compiler_ir("stablehlo")
  options = compiler.get_compile_options(
    num_replicas=1, num_partitions=1, device_assignment=None,
    env_options_overrides=compiler_options,
  )  # fmt: skip
  with _stderr_to_string() as log:
    executable = topology.devices[0].client.compile(
      module, _jax.DeviceList(tuple(topology.devices[:1])), options
    )
  stats = executable.get_compiled_memory_stats()
  hlo = executable.hlo_modules()[0].to_string()
  fields = ("argument", "output", "alias", "temp")
  return CompiledMemory(
    target=target,
    device={k: int(getattr(stats, f"{k}_size_in_bytes")) for k in fields},
    host={k: int(getattr(stats, f"host_{k}_size_in_bytes")) for k in fields},
    n_params=n_params,
    copies_in_flight=copies_in_flight(hlo),
    host_compute=tuple(re.findall(_CONVERTED, log.getvalue())),
    hlo=hlo,
  )


def transformer_params(
  n_params: float, *, layers: int = 16, dtype: Any = "float32", vocab: int = 0
) -> dict[str, Any]:
  """`ShapeDtypeStruct`s of a transformer-shaped tree of about `n_params` parameters.

  Each layer has ``qkv (d, 3d)``, ``out (d, d)``, ``up (d, 4d)``, ``down (4d, d)``,
  ``bias (4d,)`` and ``scale (d,)``; with `vocab`, an ``embed (vocab, d)`` table too.
  Specs carry a one-device `NamedSharding` on the first CPU device.
  """
  d = max(8, int((n_params / (layers * 12)) ** 0.5) // 8 * 8)
  shapes: dict[str, Any] = {}
  for i in range(layers):
    shapes[f"layer{i:03d}"] = {
      "qkv": (d, 3 * d), "out": (d, d), "up": (d, 4 * d), "down": (4 * d, d),
      "bias": (4 * d,), "scale": (d,),
    }  # fmt: skip
  if vocab:
    shapes["embed"] = (vocab, d)
  sharding = one_device(None)
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jax.numpy.dtype(dtype), sharding=sharding),
    shapes,
    is_leaf=lambda s: isinstance(s, tuple),
  )


def update_step(tx: Any, *, fused: bool = False) -> Callable[..., Any]:
  """A training step's optimizer half: ``(params, state, x) -> (params, state)``.

  The gradients are made inside the step, as a backward pass makes them, and
  kept whole (an optimization barrier: XLA cannot fuse them into the update),
  so the figures count params + gradients + state + what the update adds;
  jit it with ``donate_argnums=(0, 1)``. `fused`: `offlax.update_and_apply`
  instead of ``tx.update`` and `optax.apply_updates`.
  """
  import optax

  from offlax._src.apply import update_and_apply

  def step(params, state, x):
    # Whole arrays that depend on the params, as a backward pass's outputs are.
    grads = jax.lax.optimization_barrier(jax.tree.map(lambda p: p * x.astype(p.dtype), params))
    if fused:
      return update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def compile_adamw_step(
  n_params: float,
  *,
  mode: str = "streamed",
  master: bool = False,
  chunk_bytes: int = 64 * 2**20,
  layers: int = 16,
  fraction: float = 1.0,
  fused: bool = False,
  **compile_options: Any,
) -> CompiledMemory:
  """An AdamW `update_step` on `transformer_params(n_params)`, compiled by `compile_for_gpu`.

  `mode`: ``plain`` (optax), ``streamed`` or ``host`` (`offload` with that
  compute); `master`: bf16 params with `master_weights`. The params and state
  are donated; `fused`: the step applies with `offlax.update_and_apply`.
  `compile_options` go to `compile_for_gpu` (``target``, ``device_memory_size``).
  """
  import optax

  from offlax._src.master import master_weights
  from offlax._src.transform import offload

  dtype = "bfloat16" if master else "float32"
  params = transformer_params(n_params, layers=layers, dtype=dtype)
  tx: Any = optax.adamw(1e-3)
  tx = master_weights(tx) if master else tx
  if mode == "plain":
    state = jax.eval_shape(tx.init, params)
  else:
    compute = "host" if mode == "host" else "device"
    tx = offload(tx, chunk_bytes=chunk_bytes, compute=compute, fraction=fraction)
    from offlax._src.checkpoint import abstract_state

    state = abstract_state(tx, params)
  step = jax.jit(update_step(tx, fused=fused and mode != "plain"), donate_argnums=(0, 1))
  n = sum(x.size for x in jax.tree.leaves(params))
  return compile_for_gpu(
    step, params, state_specs(state), jax.ShapeDtypeStruct((), dtype), n_params=n,
    **compile_options,
  )  # fmt: skip


def state_specs(state: Any) -> Any:
  """`ShapeDtypeStruct`s of a state (or its abstract state) that keep their memory kinds."""
  return jax.tree.map(_spec, state)


def one_device(memory_kind: str | None) -> jax.sharding.NamedSharding:
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("_offlax",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind)


# XLA's host offloader logs each instruction it moves to the host this way.
_CONVERTED = r'Found an instruction \("([^"]+)"\) which does device compute in host memory'


def copies_in_flight(hlo: str) -> int:
  """The most asynchronous host<->device transfers outstanding at once in `hlo`'s schedule.

  Counts, per computation in schedule order, the async starts whose shapes
  name host memory (``S(5)``) and that are not yet done.
  """
  most = 0
  for body in re.split(r"\n(?=\S)", hlo):  # one computation per block
    open_: set[str] = set()
    for line in body.splitlines():
      m = re.match(r"\s*(?:ROOT )?%(\S+) = .*?\b([\w-]+-start|[\w-]+-done)\((.*)", line)
      if not m:
        continue
      name, op, operands = m.groups()
      if op.endswith("-start") and "S(5)" in line:
        open_.add(name)
      elif op.endswith("-done"):
        for operand in re.findall(r"%([\w.-]+)", operands):
          open_.discard(operand)
      most = max(most, len(open_))
  return most


_TOPOLOGIES: dict[GpuTarget, Any] = {}


def _topology(target: GpuTarget) -> Any:
  if target not in _TOPOLOGIES:
    from jax.experimental import topologies

    try:
      _TOPOLOGIES[target] = topologies.get_topology_desc(
        "", "cuda", target_config=target.config(), topology="1x1x1"
      )
    except Exception as e:
      raise ImportError(
        "XLA's GPU compiler is not available: install offlax[gpu-compile] "
        f"(jax-cuda12-plugin and jax-cuda12-pjrt at jax {jax.__version__}, --no-deps), and "
        "on a machine without a GPU run with JAX_PLATFORMS=cpu "
        f"({type(e).__name__}: {str(e)[:200]})"
      ) from e
  return _TOPOLOGIES[target]


def _spec(x: Any) -> Any:
  """`x` as a `ShapeDtypeStruct` whose sharding keeps its memory kind."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    return x
  sharding = getattr(x, "sharding", None)
  if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
    sharding = one_device(getattr(sharding, "memory_kind", None))
  elif (
    isinstance(sharding, jax.sharding.NamedSharding)
    and sharding.mesh.devices.flat[0].platform != "cpu"
  ):
    sharding = _on_cpus(sharding)
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _on_cpus(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """`sharding` on a CPU-device mesh of the same shape: what lowering for the target needs.

  On a machine with a GPU, arrays live on it; lowered with their own shardings
  beside CPU-placed arguments, the step would mix platforms.
  """
  devices = sharding.mesh.devices
  cpus = jax.devices("cpu")
  if devices.size > len(cpus):
    raise errors.InvalidTargetError(
      f"compile_for_gpu: a mesh of {devices.size} devices needs as many CPU devices to lower "
      f"on, and there are {len(cpus)}; set XLA_FLAGS=--xla_force_host_platform_device_count="
      f"{devices.size} before JAX starts."
    )
  mesh = jax.sharding.Mesh(
    np.array(cpus[: devices.size]).reshape(devices.shape), sharding.mesh.axis_names
  )
  return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


@contextlib.contextmanager
def _stderr_to_string() -> Iterator[Any]:
  """Captures what native code writes to file descriptor 2 (XLA's log) in this block."""

  class Log:
    text = ""

    def getvalue(self) -> str:
      return self.text

  log = Log()
  with tempfile.TemporaryFile(mode="w+b") as f:
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
      yield log
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      log.text = f.read().decode(errors="replace")
      # Pass the rest through: only the offloader's notes are ours to report.
      quiet = ("host_offloader", "cudart_stub", "InitializeLog", "stack_frame_id")
      rest = [line for line in log.text.splitlines(True) if not any(q in line for q in quiet)]
      os.write(2, "".join(rest).encode())
