"""The planner: where an optimizer's state should live, and what that costs per step."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
import optax

from offlax._src import errors, ffi, flax_glue, plan_advice, plan_options
from offlax._src import master as master_lib
from offlax._src.nvme.format import DEFAULT_KEEP
from offlax._src.plan_disk import largest_rest_leaf, layer_leaves, params_on_disk_bytes
from offlax._src.plan_options import parse_bytes as parse_bytes  # the CLI's, and tests'
from offlax._src.plan_options import parse_count as parse_count
from offlax._src.units import format_bytes

GB = 10**9

# Defaults for the estimates, overridable per call. Conservative round figures:
# PCIe 4.0 x16 moves ~25 GB/s each way with pinned buffers; a datacenter NVMe
# SSD ~3 GB/s; offlax.adam's host step ~1.2 G params/s on 2 cores
# (benchmarks/host_adam.py), more with more cores.
BUS_BYTES_PER_S = 25 * GB
DISK_BYTES_PER_S = 3 * GB
HOST_ADAM_PARAMS_PER_S = 1.2e9
# With 8-bit moments (`offlax.adamw(..., state_bits=8)`): 0.82-0.87x the fp32 kernel's
# params per CPU second on the same 2 cores at 64M and 256M (benchmarks/state_bits.py,
# mixed and full step), so ~1.0 G params/s beside the fp32 figure's 1.2.
HOST_ADAM8_PARAMS_PER_S = 1.0e9
# Slices of state the streamed schedule holds on the device at once, compiled by
# XLA:GPU (`benchmarks/gpu_memory.py`): about one where every leaf fits a slice
# (1.1-1.2 at 0.1B), two where leaves are split and a loop fetches the next
# piece during this one (1.7-3.1 at 1B-13B).
SLICES_ON_DEVICE = 2
# Device memory the plan leaves free: XLA's temporaries and fragmentation, the
# runtime and the collectives' buffers need some beyond the figures counted here.
DEVICE_RESERVE = 0.05
# The NVMe tier's RAM: a share caches state, the rest (and at least this many
# slices) is kept for its buffers.
_NVME_CACHE_SHARE = 0.75
_NVME_BUFFERS = 8


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where the state goes and what it costs; see `plan`.

  Attributes:
    mode: ``"device"`` (everything fits: no offload), ``"host"`` (the streamed
      host tier), ``"host_compute"`` (``HostTier(compute="host")``),
      ``"nvme"`` (the NVMe tier), ``"params_host"`` (params, gradients and
      state in host memory: `offlax.scan_layers` and host compute),
      ``"params_host_nvme"`` (the same with the state on the NVMe tier),
      ``"params_nvme"`` (params, gradients and state on disk: `offlax.LayerStore`), or
      ``"none"`` if nothing fits.
    fits: whether the mode fits the given memories.
    chunk_bytes: the slice size the plan assumes.
    fraction: for ``"host"``, the share of the state to offload (the rest fits
      on the device); 1.0 otherwise.
    placement: state leaf key path -> ``"device"``, ``"host"`` or ``"nvme"``.
    bytes: bytes per tier (``device``, ``host``, ``nvme``), parameters,
      gradients and the device's working slices included; ``nvme`` is the
      store on disk: the state ``keep + 1`` times (`NVMeTier`'s generations).
    bus_bytes_per_step: bytes crossing host <-> device per step.
    disk_bytes_per_step: bytes read and written on disk per step.
    overhead_s: estimated extra seconds per step if no transfer overlapped
      compute (an upper bound; the streamed tier hides most of it).
    advice: what to change, when it does not fit or could do better; when it
      does not fit, offlax's own ways out first, each with what it needs.
    assumptions: the figures the estimates used.
    code: the lines that build the optimizer of `mode` (``inner`` stands for
      the optimizer planned); empty for ``"none"``.
  """

  mode: str
  fits: bool
  chunk_bytes: int
  fraction: float
  placement: dict[str, str]
  bytes: dict[str, int]
  bus_bytes_per_step: int
  disk_bytes_per_step: int
  overhead_s: float
  advice: list[str]
  assumptions: dict[str, Any]
  code: str = ""

  def table(self, inner: str = "inner") -> str:
    """A readable summary; `inner`: the optimizer's code, in the code lines."""
    a = self.assumptions
    lines = [
      f"offlax plan: {a['params']:,} params ({format_bytes(a['param_bytes'])}), "
      f"optimizer state {format_bytes(a['state_bytes'])}, "
      f"gradients {format_bytes(a['grad_bytes'])}",
    ]
    if not self.fits:  # no usage or cost of a placement that cannot run
      lines.append(
        f"mode: none (DOES NOT FIT): device {format_bytes(a['device_bytes'])}, host "
        f"{format_bytes(a['host_bytes'])}, nvme {format_bytes(a['nvme_bytes'])}"
      )
      lines += [f"- {x}" for x in self.advice]
      return "\n".join(lines)
    lines.append(f"{'tier':<8}{'uses':>12}{'has':>12}")
    for tier, has in (("device", a["device_bytes"]), ("host", a["host_bytes"])):
      lines.append(f"{tier:<8}{format_bytes(self.bytes[tier]):>12}{format_bytes(has):>12}")
    lines.append(
      f"{'nvme':<8}{format_bytes(self.bytes['nvme']):>12}{format_bytes(a['nvme_bytes']):>12}"
    )
    verdict = "fits"
    lines += [
      f"(the device keeps {a['device_reserve']:.0%} free for XLA's temporaries and the runtime)",
      f"mode: {self.mode} ({verdict}); chunk_bytes {self.chunk_bytes / 2**20:g} MiB"
      + (f", fraction {self.fraction:.2f}" if self.mode == "host" else ""),
      f"per step: {format_bytes(self.bus_bytes_per_step)} over the bus, "
      f"{format_bytes(self.disk_bytes_per_step)} on disk; overhead <= {self.overhead_s:.2f} s "
      f"(bus {format_bytes(a['bus_bytes_per_s'])}/s, disk {format_bytes(a['disk_bytes_per_s'])}/s, "
      f"host Adam {a['host_adam_params_per_s'] / 1e9:.2f} G params/s, no overlap)",
    ]
    if self.code:
      code = re.sub(r"\binner\b", lambda _: inner, self.code)
      lines += ["code:", *(f"  {line}" for line in code.splitlines())]
    lines += [f"- {x}" for x in self.advice]
    return "\n".join(lines)


def plan(
  params: Any,
  tx: optax.GradientTransformation,
  *,
  device_bytes: int,
  host_bytes: int,
  nvme_bytes: int = 0,
  activation_bytes: int = 0,
  chunk_bytes: int = 64 * 2**20,
  bus_bytes_per_s: float = BUS_BYTES_PER_S,
  disk_bytes_per_s: float = DISK_BYTES_PER_S,
  host_adam_params_per_s: float = HOST_ADAM_PARAMS_PER_S,
  layers: int | None = None,
  fused: bool = False,
  update_bytes: int | None = None,
) -> Plan:
  """Chooses where the state of `tx` should live for `params`, and estimates the cost.

  Tries, in order, all on the device, the streamed host tier (offloading only
  the share of the state that does not fit), host compute, then the NVMe tier,
  and returns the first that fits (or, if none does, the closest, with advice).
  When params and gradients do not fit on the device, and `layers` says how
  many stacked layers they have, it tries them in host memory too
  (``params_host``: the device holds the step's working set, `activation_bytes`,
  which the layers' params and gradients pass through; without it, a layer's
  params and gradients; ``python -m offlax plan --layers`` counts it for a
  Llama-shaped model and ``--compile`` measures it), with the state on the
  NVMe tier if RAM is short.
  The device holds the params, their gradients (same dtype), `activation_bytes`
  and, when streaming, slices of `chunk_bytes` (two where leaves are cut into
  pieces, one where every leaf fits a slice); the plan keeps
  `DEVICE_RESERVE` (5%) of `device_bytes` free besides.

  Args:
    params: the params, or their `jax.ShapeDtypeStruct`s.
    tx: the optimizer to offload (the inner one, not wrapped by `offload`).
    device_bytes: accelerator memory available to the step.
    host_bytes: host RAM available to the state.
    nvme_bytes: free disk for an NVMe store (0: none).
    activation_bytes: the step's activations and other temporaries (with params
      in host memory, all of the step's device memory).
    chunk_bytes: the slice size (the tiers' default).
    bus_bytes_per_s: host <-> device bandwidth, each way.
    disk_bytes_per_s: disk bandwidth.
    host_adam_params_per_s: host compute speed of the optimizer step.
    layers: the number of layers the params stack (`offlax.scan_layers`);
      None: params stay on the device. The leaves whose first axis is
      `layers` are the layers'; with params on disk (``params_nvme``) the
      others (embedding, head) stay in RAM with their gradients and state,
      and the update holds a few of the largest layer leaf's slices
      (`plan_disk.params_on_disk_bytes` has the formula): the verdict counts it.
    fused: the step applies with `offlax.update_and_apply`, which keeps no
      updates (without it, `master_weights`' fp32 updates of a leaf streamed
      in pieces are written whole before `optax.apply_updates`).
    update_bytes: with params on disk, the `offlax.LayerStore`'s ``update_bytes`` (its
      update's bytes in flight, leaves cut in row ranges): counted instead of whole leaves
      in flight; where the rest's params, gradients and state do not fit in RAM beside it,
      the rest's state is counted on the NVMe tier (`plan_disk.params_on_disk_bytes`).
      None: whole leaves where they fit in ``host_bytes``, else a budget the size of the
      model's reads (2 layers, in whole GiB), named in the plan's code.

  Returns:
    A `Plan`.

  Raises:
    InvalidOptionError: an option out of its range (`plan_options.LIMITS`:
      e.g. ``device_bytes`` 1 MiB to 1 PB, ``layers`` 1 to 10000, rates above
      0), or over 1e14 params; the message names the command line's flag too.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    >>> p = offlax.plan(
    ...   params, optax.adam(1e-3), device_bytes=10 * 2**20, host_bytes=2**30, chunk_bytes=2**18
    ... )
    >>> p.mode, p.fits, p.bytes["host"]
    ('host', True, 8388608)
  """
  options = {
    "device_bytes": device_bytes, "host_bytes": host_bytes, "nvme_bytes": nvme_bytes,
    "activation_bytes": activation_bytes, "chunk_bytes": chunk_bytes,
    "bus_bytes_per_s": bus_bytes_per_s, "disk_bytes_per_s": disk_bytes_per_s,
    "host_adam_params_per_s": host_adam_params_per_s,
  }  # fmt: skip
  for name, value in options.items():
    plan_options.check(name, value)
  if layers is not None:
    plan_options.check("layers", layers)
  if update_bytes is not None:
    plan_options.check("update_bytes", update_bytes)
  errors.check_transformation(tx, "plan: tx")
  params = flax_glue.unbox(params)
  n_params = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
  plan_options.check("params", n_params)
  flat_state = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, params))[0]
  leaves = [(jax.tree_util.keystr(p), _nbytes(x)) for p, x in flat_state if _nbytes(x)]
  param_bytes = sum(_nbytes(x) for x in jax.tree.leaves(params))
  update_leaves = _update_leaves(tx, params)
  state = sum(b for _, b in leaves)
  big = [(k, b) for k, b in leaves if b > 64]  # scalars stay on the device
  small = state - sum(b for _, b in big)
  fixed = 2 * param_bytes + activation_bytes  # params and gradients
  usable = int(device_bytes * (1 - DEVICE_RESERVE))
  stream_slices = slices = _slices(params, state, n_params, chunk_bytes)
  if not fused:
    slices += _whole_updates(update_leaves, state, chunk_bytes)
  assumptions = {
    "params": n_params,
    "param_bytes": param_bytes,
    "grad_bytes": param_bytes,
    "state_bytes": state,
    "activation_bytes": activation_bytes,
    "device_bytes": device_bytes,
    "device_reserve": DEVICE_RESERVE,
    "host_bytes": host_bytes,
    "nvme_bytes": nvme_bytes,
    "bus_bytes_per_s": bus_bytes_per_s,
    "disk_bytes_per_s": disk_bytes_per_s,
    "host_adam_params_per_s": host_adam_params_per_s,
  }

  # Host compute: no state slices on the device, gradients out, updates back (into
  # the gradients' buffer, or a new one where their dtype differs: master_weights').
  fixed_host = fixed + (0 if fused else _whole_updates(update_leaves, state, 0))

  def make(mode, fits, placement, dev, host, nvme, bus, disk, overhead, advice, fraction=1.0,
           cache=0):  # fmt: skip
    if fits and not activation_bytes and not mode.startswith("params_host"):
      advice = [
        *advice,
        plan_advice.activations_note(dev, usable, fixed + slices + small, fixed_host),
      ]
    return Plan(
      mode,
      fits,
      chunk_bytes,
      fraction,
      placement,
      {"device": dev, "host": host, "nvme": nvme},
      bus,
      disk,
      overhead,
      advice,
      assumptions,
      plan_advice.code(
        mode, fraction, cache, fused or mode.startswith("params_host"), update_bytes
      ),
    )

  everywhere = lambda where: {k: where for k, _ in leaves}
  if fixed + state <= usable:
    return make("device", True, everywhere("device"), fixed + state, 0, 0, 0, 0, 0.0, [])

  # The streamed host tier: offload the largest leaves first (ties in tree order,
  # as HostTier(fraction=) does) until the rest fits beside params and slices.
  room = usable - fixed - slices - small
  placement, on_device = everywhere("device"), sum(b for _, b in big)
  for k, b in sorted(big, key=lambda kb: -kb[1]):
    if on_device <= room:
      break
    placement[k] = "host"
    on_device -= b
  host = state - small - on_device
  if room >= 0 and host <= host_bytes:
    # Rounded down, so that HostTier(fraction=) stops at the same leaf.
    fraction = 1.0 if host == state - small else math.nextafter(host / (state - small), 0)
    return make(
      "host", True, placement, fixed + slices + small + on_device, host, 0,
      2 * host, 0, 2 * host / bus_bytes_per_s, [], fraction,
    )  # fmt: skip
  if fixed_host <= usable and state <= host_bytes:
    bus = 2 * param_bytes
    overhead = bus / bus_bytes_per_s + n_params / host_adam_params_per_s
    return make(
      "host_compute", True, everywhere("host"), fixed_host, state, 0, bus, 0, overhead,
      ["the device cannot hold the streamed slices beside params and gradients: compute on the "
       "host"]
      if room < 0 else [],
    )  # fmt: skip
  # The NVMe tier: RAM caches what it can (a quarter kept for slices and buffers).
  cache = max(0, int(host_bytes * _NVME_CACHE_SHARE) - _NVME_BUFFERS * chunk_bytes)
  on_disk = max(0, state - small - cache)
  # The store holds all of the state (cached arrays too) once per generation.
  store_bytes = (DEFAULT_KEEP + 1) * (state - small)
  nvme_fits = fixed + slices + small <= usable and 0 < on_disk and store_bytes <= nvme_bytes
  if nvme_fits:
    placement = everywhere("device")
    cached = 0
    for k, b in sorted(big, key=lambda kb: kb[1]):
      if cached + b <= cache:
        cached += b
        placement[k] = "host"
      else:
        placement[k] = "nvme"
    # Arrays on disk are read and written; each commit also writes the cached
    # arrays and scalars, so that the store holds the whole state.
    disk = 2 * (state - small - cached) + cached + small
    bus = 2 * (state - small)
    overhead = max(bus / bus_bytes_per_s, disk / disk_bytes_per_s)
    return make(
      "nvme", True, placement, fixed + slices + small, cached + _NVME_BUFFERS * chunk_bytes,
      store_bytes, bus, disk, overhead, [], cache=cache,
    )  # fmt: skip
  store_figures = None  # what params_nvme needs, with layers
  if layers:
    leaf_params, rest_params = layer_leaves(params, layers)
    figures_at = lambda budget: params_on_disk_bytes(
      param_bytes, state, n_params, layers, leaf_params=leaf_params, rest_params=rest_params,
      update_bytes=budget, host_bytes=host_bytes, nvme_ram=_NVME_BUFFERS * chunk_bytes,
      rest_leaf_params=largest_rest_leaf(params, layers),
      read_params=not master_lib.rounds_to_master(tx),
    )  # fmt: skip
    store_figures = figures_at(update_bytes)
    if update_bytes is None and store_figures["ram"] > host_bytes:
      # Whole leaves in flight do not fit: the update by row ranges, its budget the model's
      # reads' (2 layers, whole GiB, at least 1), so the store's RAM is that and the rest's.
      update_bytes = max(1, math.ceil(store_figures["reads"] / 2**30)) * 2**30
      store_figures = figures_at(update_bytes)
  if store_figures is not None and fixed > usable:
    host_plan = _params_on_host(
      make, everywhere, layers, param_bytes, n_params, state, small, activation_bytes, usable,
      host_bytes, nvme_bytes, chunk_bytes, bus_bytes_per_s, disk_bytes_per_s,
      host_adam_params_per_s, store_figures,
    )  # fmt: skip
    if host_plan is not None:
      return host_plan
  figures = plan_advice.Figures(
    param_bytes=param_bytes, state=state, small=small, activation_bytes=activation_bytes,
    usable=usable, device_bytes=device_bytes, host_bytes=host_bytes, nvme_bytes=nvme_bytes,
    chunk_bytes=chunk_bytes, slices=slices, updates=slices - stream_slices,
    n_slices=stream_slices // chunk_bytes,
    smaller_chunk=_smaller_chunk(
      update_leaves, params, state, n_params, chunk_bytes, fused, usable - fixed - small
    ),
    store_bytes=store_bytes, nvme_ram=_NVME_BUFFERS * chunk_bytes,
    host_nvme_ram=2 * param_bytes + int(_NVME_BUFFERS * chunk_bytes / _NVME_CACHE_SHARE) + 1,
    layers=layers, fused=fused, fixed_host=fixed_host, on_disk=store_figures,
  )  # fmt: skip
  advice = plan_advice.ways_out(figures)
  if state > host_bytes and store_bytes > nvme_bytes:
    advice.append(
      f"the optimizer state needs {format_bytes(state)}: add host RAM "
      f"({format_bytes(state - host_bytes)} more than the host has) or NVMe (a store keeps "
      f"{DEFAULT_KEEP + 1} copies: {format_bytes(store_bytes)})"
    )
  return make(
    "none", False, everywhere("host"), fixed, state, 0, 2 * param_bytes, 0, math.inf, advice
  )


def _params_on_host(
  make,
  everywhere,
  layers,
  param_bytes,
  n_params,
  state,
  small,
  activation_bytes,
  usable,
  host_bytes,
  nvme_bytes,
  chunk_bytes,
  bus_bytes_per_s,
  disk_bytes_per_s,
  host_adam_params_per_s,
  on_disk,
) -> Plan | None:
  """Params, gradients and state in host memory (state on disk if RAM is short), or None."""
  layer = param_bytes / layers
  # The layers pass through the step's working set: `activation_bytes` counts it;
  # without it, a layer's params and gradients.
  device = int(activation_bytes or 2 * layer)
  if device > usable:
    return None
  # Each layer's params cross twice (forward, and again in the rematerialised
  # backward pass), its gradients once; the step itself runs on the host.
  bus = 3 * param_bytes
  compute = n_params / host_adam_params_per_s
  why = (
    "params and gradients do not fit on the device: params in host memory, layers "
    f"streamed by offlax.scan_layers ({format_bytes(layer)} per layer), or a Flax NNX model "
    "as it is by offlax.offload_params(model), the step on the host (offlax.update_and_apply, "
    "or nnx.Optimizer's update); device figure: the step's working set, activation_bytes "
    "(or a layer's params and gradients; plan --compile measures it)"
  )
  if 2 * param_bytes + state <= host_bytes:
    return make(
      "params_host", True, everywhere("host"), device, 2 * param_bytes + state, 0, bus, 0,
      bus / bus_bytes_per_s + compute, [why],
    )  # fmt: skip
  cache = max(
    0, int((host_bytes - 2 * param_bytes) * _NVME_CACHE_SHARE) - _NVME_BUFFERS * chunk_bytes
  )
  store_bytes = (DEFAULT_KEEP + 1) * (state - small)
  if cache <= 0 or store_bytes > nvme_bytes:
    return _params_on_disk(
      make, everywhere, param_bytes, n_params, device, host_bytes, nvme_bytes,
      bus_bytes_per_s, disk_bytes_per_s, host_adam_params_per_s, on_disk,
    )  # fmt: skip
  disk = 2 * max(0, state - small - cache) + min(cache, state - small) + small
  bus += 2 * (state - small)
  return make(
    "params_host_nvme", True, everywhere("nvme"), device, 2 * param_bytes + cache, store_bytes,
    bus, disk, max(bus / bus_bytes_per_s, disk / disk_bytes_per_s) + compute, [why],
    cache=cache,
  )  # fmt: skip


def _params_on_disk(
  make, everywhere, param_bytes, n_params, device, host_bytes, nvme_bytes, bus_bytes_per_s,
  disk_bytes_per_s, host_adam_params_per_s, b,
) -> Plan | None:  # fmt: skip
  """Params, gradients and state on disk (`offlax.LayerStore`), or None; `b`: its bytes."""
  if b["ram"] > host_bytes or b["disk"] > nvme_bytes:
    return None
  bus = 3 * param_bytes
  disk_s = b["disk_per_step"] / disk_bytes_per_s
  note = (
    "params, gradients and state do not fit in RAM: all on disk in an offlax.LayerStore "
    f"(docs/nvme_tier.md), a few layers in RAM; every step moves "
    f"{b['disk_per_step'] / n_params:.0f} B/param on disk, {format_bytes(b['disk_per_step'])}: "
    f"at least {disk_s:.0f} s a step at {format_bytes(disk_bytes_per_s)}/s (weigh it against "
    "a machine with the RAM for params_host_nvme)"
  )
  overhead = max(bus / bus_bytes_per_s, disk_s, n_params / host_adam_params_per_s)
  return make(
    "params_nvme", True, everywhere("nvme"), device, b["ram"], b["disk"], bus,
    b["disk_per_step"], overhead, [note, plan_advice.layer_store_ram(b)],
  )  # fmt: skip


def mode_bytes(
  params: Any,
  tx: optax.GradientTransformation,
  mode: str,
  *,
  chunk_bytes: int = 64 * 2**20,
  fused: bool = False,
  activation_bytes: int = 0,
) -> int:
  """The device bytes `plan` counts for `mode`, with all the state it offloads off the device.

  Params, gradients and `activation_bytes`, and besides: for ``device`` the
  whole state; for ``host`` and ``nvme`` the streamed slices, the state's
  scalars and (unless `fused`) the updates written whole; for
  ``host_compute`` (unless `fused`) updates of another dtype than the
  gradients'. A device of ``mode_bytes / (1 - DEVICE_RESERVE)`` holds that mode.

  Args:
    params: the params, or their `jax.ShapeDtypeStruct`s.
    tx: the optimizer to offload (the inner one, not wrapped by `offload`).
    mode: ``"device"``, ``"host"``, ``"host_compute"`` or ``"nvme"``.
    chunk_bytes: the slice size.
    fused: the step applies with `offlax.update_and_apply` (see `plan`).
    activation_bytes: the step's activations and other temporaries.

  Returns:
    Device bytes, as `plan(...).bytes["device"]` gives them when it picks `mode`
    and offloads all of the state's arrays.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> from offlax._src import planner
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    >>> need = planner.mode_bytes(params, optax.adam(1e-3), "host", chunk_bytes=2**18)
    >>> need  # params and gradients (4 MiB each), two slices, adam's step count
    8912900
    >>> p = offlax.plan(
    ...   params, optax.adam(1e-3), device_bytes=10 * 2**20, host_bytes=2**30, chunk_bytes=2**18
    ... )
    >>> p.mode, p.bytes["device"] == need
    ('host', True)
  """
  modes = ("device", "host", "host_compute", "nvme")
  if mode not in modes:
    raise ValueError(f"mode_bytes: mode must be one of {modes}, got {mode!r}.")
  params = flax_glue.unbox(params)
  state_leaves = [_nbytes(x) for x in jax.tree.leaves(jax.eval_shape(tx.init, params))]
  state = sum(state_leaves)
  small = sum(b for b in state_leaves if b <= 64)  # scalars stay on the device
  fixed = 2 * sum(_nbytes(x) for x in jax.tree.leaves(params)) + activation_bytes
  if mode == "device":
    return fixed + state
  if mode == "host_compute":
    return fixed + (0 if fused else _whole_updates(_update_leaves(tx, params), state, 0))
  n_params = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
  slices = _slices(params, state, n_params, chunk_bytes)
  updates = 0 if fused else _whole_updates(_update_leaves(tx, params), state, chunk_bytes)
  return fixed + slices + small + updates


def _slices(params: Any, state_bytes: int, n_params: int, chunk_bytes: int) -> int:
  """Device bytes of the streamed schedule's slices in flight (`SLICES_ON_DEVICE`)."""
  largest = max((int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)), default=0)
  split = largest * state_bytes > chunk_bytes * max(n_params, 1)  # its state needs pieces
  return (SLICES_ON_DEVICE if split else 1) * chunk_bytes


def _smaller_chunk(
  update_leaves: list, params: Any, state: int, n_params: int, chunk_bytes: int, fused: bool,
  room: int,
) -> int:  # fmt: skip
  """The largest chunk_bytes down to 1 MiB (halving) whose streaming fits `room`; 0 if none."""
  chunk = chunk_bytes // 2
  while chunk >= min(2**20, chunk_bytes // 2) and room > 0:
    need = _slices(params, state, n_params, chunk)
    if need <= room and not fused:
      need += _whole_updates(update_leaves, state, chunk)
    if need <= room:
      return chunk
    chunk //= 2
  return 0


def _update_leaves(tx: Any, params: Any) -> list[tuple[int, Any, int, Any]]:
  """Each param leaf's bytes and dtype with its update's (once: `eval_shape` of the update).

  Empty where the update needs extra arguments: no updates of another dtype assumed.
  """
  flat = jax.tree.leaves(params)
  try:
    with ffi.shapes_only():
      state = jax.eval_shape(tx.init, params)
      updates = jax.eval_shape(lambda g, s, p: tx.update(g, s, p)[0], params, state, params)
  except Exception:  # an update that needs extra arguments
    return []
  return [
    (_nbytes(p), np.dtype(p.dtype), _nbytes(u), np.dtype(u.dtype))
    for p, u in zip(flat, jax.tree.leaves(updates), strict=False)
  ]


def _whole_updates(update_leaves: list, state_bytes: int, chunk_bytes: int) -> int:
  """Device bytes of the updates that streaming writes whole when they are not the gradients'.

  A leaf cut into pieces gets its updates written into its gradient's buffer,
  unless they have another dtype (`master_weights`: fp32 updates of bf16
  params); then into a new array, the leaf's size in the updates' dtype.
  `update_leaves`: `_update_leaves`'s.
  """
  param_bytes = sum(p for p, _, _, _ in update_leaves) or 1
  total = 0
  for p, p_dtype, u, u_dtype in update_leaves:
    if p * state_bytes / param_bytes > chunk_bytes and u_dtype != p_dtype:
      total += u
  return total


def _nbytes(x: Any) -> int:
  return int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
