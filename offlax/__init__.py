"""offlax: optimizer state off the accelerator, as an optax wrapper."""

from offlax._src.errors import (
  InvalidTierError,
  LeafTypeError,
  MemoryKindError,
  OffloadError,
  TreeMismatchError,
)
from offlax._src.host_tier import HostTier
from offlax._src.transform import OffloadState, ParamSpec, offload

__version__ = "0.1.0"

__all__ = [
  "HostTier",
  "InvalidTierError",
  "LeafTypeError",
  "MemoryKindError",
  "OffloadError",
  "OffloadState",
  "ParamSpec",
  "TreeMismatchError",
  "offload",
]
