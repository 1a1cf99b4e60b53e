"""Every exception and warning offlax raises or emits.

Each error derives from `OffloadError` and from the builtin exception that fits
(`StoreCorruptedError` is a `ValueError`, `StoreError` an `OSError`), so callers
catch either. Importing this module loads no JAX.

Example:
  >>> import offlax
  >>> from offlax.errors import OffloadError, StoreCorruptedError
  >>> issubclass(StoreCorruptedError, (OffloadError, ValueError))
  True
"""

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
  PartialNormWarning,
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

__all__ = [
  "CheckpointCorruptedError",
  "CheckpointExistsError",
  "CheckpointMismatchError",
  "CheckpointNotFoundError",
  "GradientsOverwrittenWarning",
  "IncompleteStepError",
  "InvalidOptionError",
  "InvalidTargetError",
  "InvalidTierError",
  "LeafTypeError",
  "MemoryKindError",
  "NotAStoreError",
  "OffloadError",
  "PartialNormWarning",
  "PerformanceWarning",
  "StaleStateError",
  "StepNotCommittedWarning",
  "StepNotKeptError",
  "StoreCorruptedError",
  "StoreError",
  "StoreExistsError",
  "StoreLockedError",
  "StoreMismatchError",
  "TransformationTypeError",
  "TreeMismatchError",
  "UnsavableStateError",
]
