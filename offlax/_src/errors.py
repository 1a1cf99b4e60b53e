"""The offlax exception hierarchy.

Every error offlax raises derives from :class:`OffloadError` and from the
builtin exception that fits, so callers may catch either.
"""


class OffloadError(Exception):
  """Base class of every error raised by offlax."""


class InvalidTierError(OffloadError, ValueError):
  """A tier was configured with an invalid option."""


class InvalidOptionError(OffloadError, ValueError, TypeError):
  """A function was given options that do not go together, an invalid value, or an unknown one.

  A `TypeError` too: Python raises one for an unknown keyword argument.
  """


class MemoryKindError(OffloadError, ValueError):
  """A memory kind is unknown, or a device does not offer it."""


class TreeMismatchError(OffloadError, ValueError):
  """Two pytrees that must have the same structure do not."""


class LeafTypeError(OffloadError, TypeError):
  """A pytree leaf is not an array."""


class StoreError(OffloadError, OSError):
  """An NVMe store cannot be opened, read or written."""


class StoreLockedError(StoreError):
  """A process (this one, or another) holds an NVMe store open for writing.

  Attributes:
    pid: the process holding the store open, when known (else None).
    holder: when it is this process, the `NVMeTier` (or store) holding it:
      ``error.holder.close()`` releases it.
  """

  def __init__(self, message: str, pid: int | None = None, holder: object = None):
    super().__init__(message)
    self.pid = pid
    self.holder = holder


class NotAStoreError(StoreError, FileExistsError):
  """An NVMe store was to be created in a folder that holds other files and no store."""


class StoreExistsError(OffloadError, FileExistsError):
  """`init` found a store where it was asked to create one."""


class StoreCorruptedError(OffloadError, ValueError):
  """An NVMe store's metadata or data fails its checks."""


class StoreMismatchError(TreeMismatchError):
  """An NVMe store holds the state of another optimizer or parameter tree."""


class UnsavableStateError(OffloadError, TypeError):
  """A checkpointer was given NVMe-tier state, whose arrays live in the store, not the tree."""


class StaleStateError(OffloadError, RuntimeError):
  """An NVMe-tier state older than the store's last commit was updated."""


class StepNotKeptError(OffloadError, LookupError):
  """A rollback asked for a step that the NVMe store does not keep."""


class PerformanceWarning(UserWarning):
  """The configuration works but costs speed or memory; the message says what to change."""


class GradientsOverwrittenWarning(UserWarning):
  """A backward pass overwrote a `LayerStore`'s gradients before `update()` used them.

  Most often a forgotten ``store.update()``: the store stays at its step. A
  warning, not an error: the hand-off runs in a host callback inside the
  compiled step, where an exception would surface late, wrapped by XLA,
  with the step half written; and dropping a step's gradients on purpose
  (a step skipped after a non-finite loss) is legitimate.
  """


class PartialNormWarning(UserWarning):
  """A gradient norm was taken over a tree without the gradients of a `LayerStore`'s layers.

  The backward pass hands each stored layer's gradient to the store, and the
  model's gradients hold only a zero token for it: ``optax.global_norm`` of
  them (Tunix logs it as ``grad_norm``) is the norm of the rest of the model.
  """


class StepNotCommittedWarning(UserWarning):
  """A `LayerStore(update="backward")` step was committed late or dropped.

  Its layers were updated in the backward pass and ``store.update()`` did not
  commit them before the next read of the layers or ``zero_grads`` (then they
  are committed without ``rest``; an ``update(rest=...)`` still adds it), or
  before ``close`` (then they are dropped, as is a step whose backward pass
  stopped short, at the next backward pass or ``close``).
  """


class IncompleteStepError(OffloadError, RuntimeError):
  """A `LayerStore(update="backward")` step lacks layers (nothing to commit, nothing committed),
  or a backward pass came before `update()` committed the step before it (refused)."""


class CheckpointNotFoundError(OffloadError, FileNotFoundError):
  """A Hugging Face checkpoint folder, or a shard its index names, is missing."""


class CheckpointCorruptedError(OffloadError, ValueError):
  """A checkpoint's file is cut short, or its header or index is damaged."""


class CheckpointMismatchError(OffloadError, ValueError):
  """A checkpoint does not fit the model: a tensor too many or missing, a shape, dtype or config."""


class CheckpointExistsError(OffloadError, FileExistsError):
  """`save_safetensors` was to write into a folder that holds files."""


class InvalidTargetError(OffloadError, ValueError):
  """`compile_for_gpu` was given a GPU target it does not know."""


class TransformationTypeError(OffloadError, TypeError):
  """An argument that must be an optax GradientTransformation is not one."""


def check_transformation(tx: object, where: str) -> None:
  """Raises `TransformationTypeError` unless `tx` has optax's `init` and `update`.

  Duck-typed, as optax is: any object with callable `init` and `update` passes.
  """
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    hint = " (call it: optax.adam(1e-3), not optax.adam)" if callable(tx) else ""
    raise TransformationTypeError(
      f"{where} must be an optax GradientTransformation, got {type(tx).__name__} {tx!r:.60}{hint}."
    )
