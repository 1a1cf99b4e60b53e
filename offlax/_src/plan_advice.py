"""The planner's words: each mode's code, and offlax's own ways out of a plan that does not fit.

`planner.plan` decides; this module says what to write for its decision, and,
when nothing fits, what each of offlax's other placements would need (device,
RAM, disk) beside what the machine has: those come before the ways out of
offlax (more devices, fewer or smaller params), which cost the user more.
"""

from __future__ import annotations

import dataclasses
import math

from offlax._src.units import format_bytes

# `fused`'s step, and the step of params in host memory (docs/params_off_device.md).
_FUSED_STEP = "params, state = offlax.update_and_apply(tx, grads, state, params)  # the apply"
_HOST_PARAMS = (
  "params = offlax.to_host(params)  # layers stacked, run by offlax.scan_layers; "
  "see docs/params_off_device.md"
)


def code(
  mode: str, fraction: float, cache_bytes: int, fused: bool, update_bytes: int | None = None
) -> str:
  """The lines that build the optimizer of `mode`; `inner` stands for the optimizer planned.

  Args:
    mode: a `Plan.mode`.
    fraction: the share of the state offloaded (``"host"``).
    cache_bytes: the NVMe tier's RAM cache (``"nvme"``, ``"params_host_nvme"``).
    fused: whether the plan counted a step applied by `offlax.update_and_apply`.
    update_bytes: a `LayerStore`'s budget for its update (``"params_nvme"``), or None.

  Returns:
    One line per statement; empty for ``"none"``.
  """
  step = [_FUSED_STEP] if fused else []
  nvme = f"tx = offlax.offload(inner, offlax.NVMeTier(path, cache_bytes={cache_bytes}))"
  lines = {
    "device": ["tx = inner  # no offload: everything fits on the device"],
    "host": [
      "tx = offlax.offload(inner" + ("" if fraction == 1.0 else f", fraction={fraction:.3f}") + ")",
      *step,
    ],
    "host_compute": ['tx = offlax.offload(inner, compute="host")', *step],
    "nvme": [nvme, *step],
    "params_host": [_HOST_PARAMS, 'tx = offlax.offload(inner, compute="host")', _FUSED_STEP],
    "params_host_nvme": [_HOST_PARAMS, nvme, _FUSED_STEP],
    "params_nvme": [
      "store = offlax.LayerStore.create(path, layers, optimizer=inner, keep=1, init_layer=..."
      + ("" if update_bytes is None else f", update_bytes={_bytes_code(update_bytes)}")
      + ")",
      "grads = jax.grad(loss)(store.source(), ...)  # offlax.scan_layers over store.source()",
      "# or a Flax NNX model as it is: offlax.offload_params(model, store=store)",
      "store.update(rest=...)  # the layers' step on disk, committed with the rest of the model",
    ],
  }.get(mode, [])
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Figures:
  """What the planner counted, in bytes (see `planner.plan`)."""

  param_bytes: int  # the params; their gradients are as many
  state: int  # the whole optimizer state
  small: int  # its scalars, which stay on the device
  activation_bytes: int
  usable: int  # device memory the plan may fill
  device_bytes: int
  host_bytes: int
  nvme_bytes: int
  chunk_bytes: int
  slices: int  # device bytes of the slices in flight (updates written whole included)
  updates: int  # of those, the updates written whole (master_weights' fp32, not fused)
  n_slices: int  # how many slices of chunk_bytes are in flight
  smaller_chunk: int  # the largest smaller chunk_bytes whose slices fit (0: none)
  store_bytes: int  # an NVMe store of the state (its generations)
  nvme_ram: int  # the least RAM the NVMe tier plans with (its buffers)
  host_nvme_ram: int  # the least RAM of params in host memory with the state on disk
  layers: int | None
  fused: bool
  fixed_host: int  # device bytes of host compute
  on_disk: dict | None = None  # an offlax.LayerStore's bytes (`plan_disk.params_on_disk_bytes`)


def _short(needs: dict[str, int], has: dict[str, int]) -> str:
  """'fits here', or what is short: 'device short by 31.8 GB, disk short by 468.0 GB'."""
  short = [f"{k} short by {format_bytes(needs[k] - has[k])}" for k in needs if needs[k] > has[k]]
  return ", ".join(short) if short else "fits here"


def ways_out(f: Figures) -> list[str]:
  """offlax's own ways out of a plan that does not fit, each with what it needs and lacks.

  In order: params in host memory, the NVMe tier, a smaller `chunk_bytes` or
  `fraction`, `update_and_apply`; the ways beyond offlax come after them.
  """
  p2 = 2 * f.param_bytes  # params and their gradients
  fixed = p2 + f.activation_bytes
  alone = "params, gradients and activations" if f.activation_bytes else "params and gradients"
  has = {"device": f.usable, "RAM": f.host_bytes, "disk": f.nvme_bytes}
  advice = []
  # 1. Params, gradients and state in host memory; the device holds the step's working set.
  if f.layers:
    work = f.activation_bytes or int(2 * f.param_bytes / f.layers)
    counted = format_bytes(work) + (
      " (activation_bytes)" if f.activation_bytes else " (a layer's params and gradients)"
    )
  else:
    work, counted = 0, "the step's working set (plan it with layers=, plan --layers L)"
  in_ram = _short({"device": work, "RAM": p2 + f.state}, has)
  on_disk = _short({"device": work, "RAM": f.host_nvme_ram, "disk": f.store_bytes}, has)
  store = ""
  if f.on_disk is not None:  # 1c. All on disk: an offlax.LayerStore.
    b = f.on_disk
    needs = {"device": work, "RAM": b["ram"], "disk": b["disk"]}
    store = (
      f"; or all on disk in an offlax.LayerStore (docs/nvme_tier.md): {layer_store_ram(b)}, "
      f"disk {format_bytes(b['disk'])} ({_short(needs, has)})"
    )
  advice.append(
    f"params in host memory (offlax.to_host, offlax.scan_layers, the step on the host; "
    f"docs/params_off_device.md): the device holds {counted}; RAM holds params and gradients "
    f"({format_bytes(p2)}) and the state ({format_bytes(f.state)}): "
    f"{format_bytes(p2 + f.state)} ({in_ram}); or the state on the NVMe tier: RAM "
    f"{format_bytes(f.host_nvme_ram)} or more (a cache), disk {format_bytes(f.store_bytes)} "
    f"({on_disk}){store}"
  )
  # 2. The state on the NVMe tier, params and gradients on the device.
  device = fixed + f.slices + f.small
  advice.append(
    f"the NVMe tier (offlax.NVMeTier(path, cache_bytes=...), params on the device): the device "
    f"holds {_device_parts(f)}; RAM {format_bytes(f.nvme_ram)}"
    f" or more (up to {format_bytes(f.state)} caches all of the state), disk "
    f"{format_bytes(f.store_bytes)}, the state {f.store_bytes // max(f.state - f.small, 1)} times "
    f"({_short({'device': device, 'RAM': f.nvme_ram, 'disk': f.store_bytes}, has)})"
  )
  # 3. A smaller chunk_bytes (fewer bytes in flight) or fraction (less state offloaded).
  room = f.usable - fixed - f.small
  if room <= 0:
    advice.append(
      f"a smaller chunk_bytes or fraction cannot help: {alone} alone need {format_bytes(fixed)} of "
      f"the device's {format_bytes(f.usable)} usable"
    )
  elif device > f.usable:
    updates = f" and the updates written whole {format_bytes(f.updates)}" if f.updates else ""
    if f.smaller_chunk:
      mib = f.smaller_chunk / 2**20
      fix = f"chunk_bytes={f.smaller_chunk} (plan --chunk {mib:g}MiB) fits them"
    else:
      fix = "no chunk_bytes down to 1 MiB fits them"
    advice.append(
      f"a smaller chunk_bytes: the {f.n_slices} slices in flight take "
      f"{format_bytes(f.slices - f.updates)} (chunk_bytes {f.chunk_bytes / 2**20:g} MiB)"
      f"{updates}, {format_bytes(room)} is left for them; {fix}"
    )
  else:
    advice.append(
      f"fraction: offloading only part of the state keeps the rest on the device, which has "
      f"{format_bytes(f.usable - device)} for it beside params, gradients and slices; the rest, "
      f"{format_bytes(max(f.state - f.small - (f.usable - device), 0))}, needs the host's RAM "
      f"({format_bytes(f.host_bytes)}) or the NVMe tier"
    )
  # 4. No model-sized updates on the device.
  if not f.fused and fixed <= f.usable < f.fixed_host and f.state <= f.host_bytes:
    advice.append(
      f"host compute needs {format_bytes(f.fixed_host)} of device memory "
      f"({format_bytes(f.usable)} usable): {format_bytes(f.fixed_host - fixed)} of it for the "
      "updates it returns; step with offlax.update_and_apply (plan --fused), which writes the "
      "new params instead"
    )
  # Beyond offlax.
  if fixed > f.usable:
    advice.append(
      f"beyond offlax: {alone} alone need {format_bytes(fixed)} of device memory "
      f"({format_bytes(f.usable)} usable of {format_bytes(f.device_bytes)}): shard them over "
      f"{math.ceil(fixed / f.usable)}+ devices (a jax Mesh), use lower-precision params, "
      "or train fewer of them (LoRA-style adapters)"
    )
  return advice


def _device_parts(f: Figures) -> str:
  """What the device holds beside the state on the NVMe tier, part by part, and their sum."""
  slices = f.slices - f.updates
  parts = [f"params and gradients ({format_bytes(2 * f.param_bytes)})"]
  if f.activation_bytes:
    parts.append(f"activations ({format_bytes(f.activation_bytes)})")
  parts.append(f"{f.n_slices} slice{'s' if f.n_slices != 1 else ''} ({format_bytes(slices)})")
  if f.updates:
    parts.append(
      f"the updates written whole in their own dtype ({format_bytes(f.updates)}; plan --fused "
      "writes none)"
    )
  if f.small >= 10**6:  # scalars (a step count) would only add "4 B"
    parts.append(f"the state's scalars ({format_bytes(f.small)})")
  total = 2 * f.param_bytes + f.activation_bytes + f.slices + f.small
  return f"{', '.join(parts[:-1])} and {parts[-1]}: {format_bytes(total)}"


def _bytes_code(n: int) -> str:
  """`n` bytes as Python: ``12 << 30`` for whole GiB, else the number."""
  return f"{n >> 30} << 30" if n % 2**30 == 0 else str(n)


def layer_store_ram(b: dict) -> str:
  """An `offlax.LayerStore`'s RAM in words, part by part (`plan_disk.params_on_disk_bytes`'s)."""
  budget = b.get("update_bytes")
  if budget is not None and b["update"] >= b["reads"]:
    inflight = (
      f"the update's bytes in flight, LayerStore(update_bytes={_bytes_code(budget)}) "
      f"({format_bytes(b['update'])}: a layer's largest leaf, {b['leaf'] / 1e6:.0f}M params, "
      "cut in row ranges)"
    )
  elif b["update"] >= b["reads"]:
    inflight = (
      f"the update's leaves in flight ({format_bytes(b['update'])}: 4 x in and out of a "
      f"layer's largest leaf, {b['leaf'] / 1e6:.0f}M params)"
    )
  else:
    inflight = f"2 layers read and written ({format_bytes(b['reads'])})"
  if b.get("rest_state") == "nvme":
    rest = (
      " and the params outside the layers with the largest one's gradient (one at a time), "
      "their state on the NVMe tier "
      f"(offlax.offload(tx, offlax.NVMeTier(...)): {format_bytes(b['rest'])} with its buffers)"
    )
  elif b["rest"]:
    rest = (
      " and the params outside the layers with their gradients and state "
      f"({format_bytes(b['rest'])})"
    )
  else:
    rest = ""
  return f"RAM {format_bytes(b['ram'])}: {inflight}{rest}"


def activations_note(used: int, usable: int, streamed: int, host_compute: int) -> str:
  """What a plan that counted no activations leaves for them, and where they are counted.

  Args:
    used: the plan's device bytes.
    usable: device memory the plan may fill.
    streamed: device bytes with all of the state streamed (``fraction=1.0``).
    host_compute: device bytes of host compute.
  """
  return (
    f"activations are counted as 0 (none given): this plan leaves "
    f"{format_bytes(max(usable - used, 0))} of the device's {format_bytes(usable)} usable for "
    f"them; streaming all of the state (fraction=1.0) leaves "
    f"{format_bytes(max(usable - streamed, 0))}, host compute "
    f"{format_bytes(max(usable - host_compute, 0))}; beyond, params go to host memory "
    "(layers=). Count them: activation_bytes= (plan --activations 8GB), or plan --layers L, "
    "which estimates them for a Llama-shaped model of L layers and --tokens"
  )
