"""offlax: optimizer state off the accelerator, as an optax wrapper."""

from offlax._src import donation as _donation  # noqa: F401  (installs the donation fix)
from offlax._src.apply import apply_updates, update_and_apply
from offlax._src.checkpoint import (
  NVMeStoreRestore,
  NVMeStoreSave,
  abstract_state,
  placed,
  reshard,
  retier,
)
from offlax._src.errors import (
  InvalidOptionError,
  InvalidTargetError,
  InvalidTierError,
  LeafTypeError,
  MemoryKindError,
  OffloadError,
  PerformanceWarning,
  StaleStateError,
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
from offlax._src.flax_glue import nnx_update
from offlax._src.gpu_compile import CompiledMemory, GpuTarget, compile_for_gpu
from offlax._src.gpu_compile import available as gpu_compile_available
from offlax._src.host_adam import adam, adamw
from offlax._src.host_checkpoint import HostStateRestore, HostStateSave
from offlax._src.host_params import fetch, to_host
from offlax._src.host_tier import HostTier
from offlax._src.inspector import LeafReport, StoreReport, inspect_store
from offlax._src.layers import scan_layers
from offlax._src.layout import OnDisk, ParamSpec
from offlax._src.master import MasterWeightsState, master_weights
from offlax._src.nvme.rollback import rollback
from offlax._src.nvme.tier import NVMeTier
from offlax._src.orbax_options import checkpoint_handler
from offlax._src.planner import Plan, plan
from offlax._src.telemetry import OffloadStats
from offlax._src.tier import OffloadState, Tier, TierIO, stats
from offlax._src.transform import offload

__version__ = "0.1.0"

__all__ = [
  "CompiledMemory",
  "GpuTarget",
  "HostStateRestore",
  "HostStateSave",
  "HostTier",
  "InvalidOptionError",
  "InvalidTargetError",
  "InvalidTierError",
  "LeafReport",
  "LeafTypeError",
  "MasterWeightsState",
  "MemoryKindError",
  "NVMeStoreRestore",
  "NVMeStoreSave",
  "NVMeTier",
  "OffloadError",
  "OffloadState",
  "OffloadStats",
  "OnDisk",
  "ParamSpec",
  "PerformanceWarning",
  "Plan",
  "StaleStateError",
  "StepNotKeptError",
  "StoreCorruptedError",
  "StoreError",
  "StoreExistsError",
  "StoreLockedError",
  "StoreMismatchError",
  "StoreReport",
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
  "master_weights",
  "nnx_update",
  "offload",
  "placed",
  "plan",
  "reshard",
  "retier",
  "rollback",
  "scan_layers",
  "stats",
  "to_host",
  "update_and_apply",
]
