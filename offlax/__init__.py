"""offlax: optimizer state off the accelerator, as an optax wrapper.

`import offlax` loads neither JAX, orbax, tensorstore nor flax: every name but
the exceptions loads its module on first use (`__getattr__`).
It replaces nothing of JAX, Flax, optax or orbax: each patch (docs/patches.md) is
installed on first use, by the first `offload(...).init` or `offload_params`.
"""

import importlib
from typing import TYPE_CHECKING, Any

from offlax._src.errors import (
  CheckpointCorruptedError,
  CheckpointExistsError,
  CheckpointMismatchError,
  CheckpointNotFoundError,
  GradientsOverwrittenWarning,
  IncompleteStepError,
  InvalidOptionError,
  InvalidTargetError,
  InvalidTierError,
  LeafTypeError,
  MemoryKindError,
  NotAStoreError,
  OffloadError,
  PerformanceWarning,
  StaleStateError,
  StepNotCommittedWarning,
  StepNotKeptError,
  StoreCorruptedError,
  StoreError,
  StoreExistsError,
  StoreLockedError,
  StoreMismatchError,
  TransformationTypeError,
  TreeMismatchError,
  UnsavableStateError,
)

# Every other name loads its module on first use (`__getattr__`): `import offlax`
# imports no JAX, so `python -m offlax plan` refuses bad input at once.
_LAZY = {
  "offlax._src.apply": ("apply_updates", "update_and_apply"),
  "offlax._src.flax_glue": ("nnx_update",),
  "offlax._src.gpu_compile": ("CompiledMemory", "GpuTarget", "compile_for_gpu"),
  "offlax._src.host_adam": ("adam", "adamw"),
  "offlax._src.host_params": ("fetch", "to_host"),
  "offlax._src.host_tier": ("HostTier",),
  "offlax._src.layers": ("scan_layers",),
  "offlax._src.layout": ("OnDisk", "ParamSpec"),
  "offlax._src.master": ("MasterWeightsState", "master_weights"),
  "offlax._src.nnx_params": ("offload_params", "onload_params"),
  "offlax._src.planner": ("Plan", "plan"),
  "offlax._src.telemetry": ("OffloadStats",),
  "offlax._src.tier": ("OffloadState", "Tier", "TierIO", "stats"),
  "offlax._src.transform": ("offload",),
}
# The names whose modules import orbax or tensorstore, by module: loaded on first use,
# after the checkpoint module (see `__getattr__`).
_CHECKPOINT_LAZY = {
  "offlax._src.checkpoint": (
    "NVMeStoreRestore",
    "NVMeStoreSave",
    "abstract_state",
    "placed",
    "reshard",
    "retier",
  ),
  "offlax._src.hf.load": ("load_safetensors",),
  "offlax._src.hf.save": ("save_safetensors",),
  "offlax._src.host_checkpoint": ("HostStateRestore", "HostStateSave"),
  "offlax._src.inspector": ("LeafReport", "StoreReport", "inspect_store"),
  "offlax._src.nnx_layer_store": ("LayerToken", "StoredParam", "stack_layers"),
  "offlax._src.layer_store.store": ("LayerStore",),
  "offlax._src.nvme.rollback": ("rollback",),
  "offlax._src.nvme.tier": ("NVMeTier",),
  "offlax._src.orbax_options": ("checkpoint_handler",),
}
_LAZY_MODULE = {
  name: module for table in (_LAZY, _CHECKPOINT_LAZY) for module, names in table.items()
  for name in names
}  # fmt: skip
_RENAMED = {"gpu_compile_available": ("offlax._src.gpu_compile", "available")}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and the API docs
  from offlax._src.apply import apply_updates, update_and_apply
  from offlax._src.checkpoint import (
    NVMeStoreRestore,
    NVMeStoreSave,
    abstract_state,
    placed,
    reshard,
    retier,
  )
  from offlax._src.flax_glue import nnx_update
  from offlax._src.gpu_compile import CompiledMemory, GpuTarget, compile_for_gpu
  from offlax._src.gpu_compile import available as gpu_compile_available
  from offlax._src.hf.load import load_safetensors
  from offlax._src.hf.save import save_safetensors
  from offlax._src.host_adam import adam, adamw
  from offlax._src.host_checkpoint import HostStateRestore, HostStateSave
  from offlax._src.host_params import fetch, to_host
  from offlax._src.host_tier import HostTier
  from offlax._src.inspector import LeafReport, StoreReport, inspect_store
  from offlax._src.layer_store.store import LayerStore
  from offlax._src.layers import scan_layers
  from offlax._src.layout import OnDisk, ParamSpec
  from offlax._src.master import MasterWeightsState, master_weights
  from offlax._src.nnx_layer_store import LayerToken, StoredParam, stack_layers
  from offlax._src.nnx_params import offload_params, onload_params
  from offlax._src.nvme.rollback import rollback
  from offlax._src.nvme.tier import NVMeTier
  from offlax._src.orbax_options import checkpoint_handler
  from offlax._src.planner import Plan, plan
  from offlax._src.telemetry import OffloadStats
  from offlax._src.tier import OffloadState, Tier, TierIO, stats
  from offlax._src.transform import offload


def __getattr__(name: str) -> Any:
  module, attr = _RENAMED.get(name, (_LAZY_MODULE.get(name), name))
  if module is None:
    raise AttributeError(f"module 'offlax' has no attribute {name!r}")
  if module in _CHECKPOINT_LAZY:
    # The checkpoint module first: it registers orbax's refusal of NVMe-tier state
    # in a StandardSave, which must be in place once such state can exist.
    importlib.import_module("offlax._src.checkpoint")
  value = getattr(importlib.import_module(module), attr)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
  "CheckpointCorruptedError",
  "CheckpointExistsError",
  "CheckpointMismatchError",
  "CheckpointNotFoundError",
  "CompiledMemory",
  "GpuTarget",
  "GradientsOverwrittenWarning",
  "IncompleteStepError",
  "HostStateRestore",
  "HostStateSave",
  "HostTier",
  "InvalidOptionError",
  "InvalidTargetError",
  "InvalidTierError",
  "LayerStore",
  "LayerToken",
  "LeafReport",
  "LeafTypeError",
  "MasterWeightsState",
  "MemoryKindError",
  "NVMeStoreRestore",
  "NVMeStoreSave",
  "NVMeTier",
  "NotAStoreError",
  "OffloadError",
  "OffloadState",
  "OffloadStats",
  "OnDisk",
  "ParamSpec",
  "PerformanceWarning",
  "Plan",
  "StaleStateError",
  "StepNotCommittedWarning",
  "StepNotKeptError",
  "StoreCorruptedError",
  "StoreError",
  "StoreExistsError",
  "StoreLockedError",
  "StoreMismatchError",
  "StoreReport",
  "StoredParam",
  "Tier",
  "TierIO",
  "TransformationTypeError",
  "TreeMismatchError",
  "UnsavableStateError",
  "abstract_state",
  "adam",
  "adamw",
  "apply_updates",
  "checkpoint_handler",
  "compile_for_gpu",
  "fetch",
  "gpu_compile_available",
  "inspect_store",
  "load_safetensors",
  "master_weights",
  "nnx_update",
  "offload",
  "offload_params",
  "onload_params",
  "placed",
  "plan",
  "reshard",
  "retier",
  "rollback",
  "save_safetensors",
  "scan_layers",
  "stack_layers",
  "stats",
  "to_host",
  "update_and_apply",
]
