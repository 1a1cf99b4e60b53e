"""offlax: optimizer state off the accelerator, as an optax wrapper.

The top level holds the names a user starts with; three namespaces hold the
rest: `offlax.errors` (every exception and warning), `offlax.checkpoint`
(orbax handlers and store tools) and `offlax.extend` (the tier protocol, the
types the functions return, the unfused pieces). ``docs/api.md`` lists them.

`import offlax` loads neither JAX, orbax, tensorstore nor flax: every name
loads its module on first use (`__getattr__`), so `python -m offlax plan`
refuses bad input at once. It replaces nothing of JAX, Flax, optax or orbax:
each patch (docs/patches.md) is installed on first use, by the first
`offload(...).init` or `offload_params`.
"""

import importlib as _importlib
import typing as _typing

from offlax._src import lazy as _lazy

_NAMES: dict[str, str | tuple[str, str]] = {
  "HostTier": "offlax._src.host_tier",
  "LayerStore": "offlax._src.layer_store.store",
  "LayerToken": "offlax._src.nnx_layer_store",
  "NVMeTier": "offlax._src.nvme.tier",
  "OffloadState": "offlax._src.tier",
  "abstract_state": "offlax._src.checkpoint",
  "adam": "offlax._src.host_adam",
  "adamw": "offlax._src.host_adam",
  "clip_by_global_norm": "offlax._src.layer_store.whole_norm",
  "compile_for_gpu": "offlax._src.gpu_compile",
  "fetch": "offlax._src.host_params",
  "load_safetensors": "offlax._src.hf.load",
  "master_weights": "offlax._src.master",
  "nnx_update": "offlax._src.nnx_hooks",
  "offload": "offlax._src.transform",
  "offload_params": "offlax._src.nnx_params",
  "onload_params": "offlax._src.nnx_params",
  "placed": "offlax._src.checkpoint",
  "plan": "offlax._src.planner",
  "save_safetensors": "offlax._src.hf.save",
  "scan_layers": "offlax._src.layers",
  "stack_layers": "offlax._src.nnx_layer_store",
  "stats": "offlax._src.tier",
  "to_host": "offlax._src.host_params",
  "update_and_apply": "offlax._src.apply",
}
_NAMESPACES = ("checkpoint", "errors", "extend")
# The names that left the top level, by their new module: still reachable as
# `offlax.<name>` for one more release, with a DeprecationWarning naming the new path.
_MOVED = {
  name: namespace
  for namespace, names in {
    "offlax.errors": (
      "CheckpointCorruptedError", "CheckpointExistsError", "CheckpointMismatchError",
      "CheckpointNotFoundError", "GradientsOverwrittenWarning", "InvalidOptionError",
      "InvalidTargetError", "InvalidTierError", "LeafTypeError", "MemoryKindError",
      "NotAStoreError", "OffloadError", "PerformanceWarning", "StaleStateError",
      "StepNotKeptError", "StoreCorruptedError", "StoreError", "StoreExistsError",
      "StoreLockedError", "StoreMismatchError", "TransformationTypeError",
      "TreeMismatchError", "UnsavableStateError",
    ),
    "offlax.checkpoint": (
      "HostStateRestore", "HostStateSave", "LeafReport", "NVMeStoreRestore", "NVMeStoreSave",
      "StoreReport", "checkpoint_handler", "inspect_store", "reshard", "retier", "rollback",
    ),
    "offlax.extend": (
      "CompiledMemory", "GpuTarget", "MasterWeightsState", "OffloadStats", "OnDisk",
      "ParamSpec", "Plan", "StoredParam", "Tier", "TierIO", "apply_updates",
      "gpu_compile_available",
    ),
  }.items()
  for name in names
}  # fmt: skip

if _typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and the API docs
  from offlax import checkpoint, errors, extend
  from offlax._src.apply import update_and_apply
  from offlax._src.checkpoint import abstract_state, placed
  from offlax._src.gpu_compile import compile_for_gpu
  from offlax._src.hf.load import load_safetensors
  from offlax._src.hf.save import save_safetensors
  from offlax._src.host_adam import adam, adamw
  from offlax._src.host_params import fetch, to_host
  from offlax._src.host_tier import HostTier
  from offlax._src.layer_store.store import LayerStore
  from offlax._src.layer_store.whole_norm import clip_by_global_norm
  from offlax._src.layers import scan_layers
  from offlax._src.master import master_weights
  from offlax._src.nnx_hooks import nnx_update
  from offlax._src.nnx_layer_store import LayerToken, stack_layers
  from offlax._src.nnx_params import offload_params, onload_params
  from offlax._src.nvme.tier import NVMeTier
  from offlax._src.planner import plan
  from offlax._src.tier import OffloadState, stats
  from offlax._src.transform import offload


def __getattr__(name: str) -> _typing.Any:
  if name in _NAMESPACES:
    value = _importlib.import_module(f"{__name__}.{name}")
  elif name in _MOVED:  # not cached: each old path's use warns
    return _lazy.moved(name, _MOVED[name])
  else:
    value = _lazy.load(__name__, _NAMES, name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:  # the public names: no `_lazy`, nor a moved name
  return _lazy.public_names(globals())


__version__ = "0.1.0"

__all__ = [
  "HostTier",
  "LayerStore",
  "LayerToken",
  "NVMeTier",
  "OffloadState",
  "abstract_state",
  "adam",
  "adamw",
  "checkpoint",
  "clip_by_global_norm",
  "compile_for_gpu",
  "errors",
  "extend",
  "fetch",
  "load_safetensors",
  "master_weights",
  "nnx_update",
  "offload",
  "offload_params",
  "onload_params",
  "placed",
  "plan",
  "save_safetensors",
  "scan_layers",
  "stack_layers",
  "stats",
  "to_host",
  "update_and_apply",
]
