"""A store folder's lock (`StoreLock`): one writer or shared readers; a refusal names the holder."""

from __future__ import annotations

import fcntl
import os
import re
import weakref
from typing import Any

from offlax._src import errors
from offlax._src.nvme.format import LAYERS, LOCK, MESH, METADATA

# The stores this process holds open for writing, by path: a second open names the
# first (a notebook cell that ran again), rather than blame another process.
_OPEN: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

# The names a store (or a mesh's stores) writes in its folder.
_STORE_NAME = re.compile(
  "|".join([re.escape(LOCK), re.escape(METADATA), re.escape(MESH), r"gen\d+", r"shard_\d+"])
)


def _lock_pid(fd: int) -> int | None:
  """The PID the lock file's holder wrote into it, or None."""
  try:
    text = os.pread(fd, 32, 0).decode().strip()
    return int(text) if text.isdigit() else None
  except (OSError, ValueError):
    return None


class StoreLock:
  """The lock file (`.lock`) of the store folder at `path`.

  A writer's lock is exclusive and records its holder (a `Store`, whose `owner`
  the refusal of a second open in this process names); readers share theirs.
  The lock is released by `release`, or when this object is collected.

  Example:
    >>> import tempfile
    >>> from offlax._src.nvme.store_lock import StoreLock
    >>> lock = StoreLock(tempfile.mkdtemp())
    >>> lock.acquire(holder=lock)
    >>> lock.held
    True
    >>> lock.release(holder=lock)
  """

  def __init__(self, path: str):
    self.path = path
    self._fd: int | None = None

  @property
  def held(self) -> bool:
    """Whether this object holds the lock (a writer's or a reader's)."""
    return self._fd is not None

  def acquire(self, holder: Any, shared: bool = False) -> None:
    """Creates the folder if needed and takes the writer lock (a reader's, if `shared`).

    Args:
      holder: what holds the lock for writing: a second open in this process
        names it (its `owner`, if it has one), and `release` takes it.
      shared: take a reader's lock, which other readers share.

    Raises:
      StoreError: `path` is not a folder, or cannot be opened.
      StoreMismatchError: `path` holds an `offlax.LayerStore`.
      NotAStoreError: `path` holds other files and no store (a writer's lock only).
      StoreLockedError: another writer holds the lock; the error names it.
    """
    if os.path.lexists(self.path) and not os.path.isdir(self.path):
      raise errors.StoreError(f"NVMe store path {self.path} exists and is not a directory.")
    if os.path.exists(os.path.join(self.path, LAYERS)):
      raise errors.StoreMismatchError(
        f"{self.path} holds an offlax.LayerStore (layers' params, gradients and optimizer "
        "state), not an NVMeTier store: open it with offlax.LayerStore.open, or give the "
        "NVMeTier another folder."
      )
    if not shared:
      _refuse_foreign_folder(self.path)
    try:
      os.makedirs(self.path, mode=0o700, exist_ok=True)
      # O_NOFOLLOW: a symlink planted at .lock must not redirect the lock file.
      fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
      raise errors.StoreError(f"cannot open NVMe store {self.path}: {e}") from e
    try:
      fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
      pid = _lock_pid(fd)
      os.close(fd)
      raise self._locked_error(pid) from None
    if not shared:
      # The holder's PID, for the message another process gets (advisory only).
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
      _OPEN[self.path] = holder
    self._fd = fd

  def _locked_error(self, pid: int | None) -> errors.StoreLockedError:
    holder = _OPEN.get(self.path)
    if holder is not None:
      owner = getattr(holder, "owner", None) or holder
      return errors.StoreLockedError(
        f"NVMe store {self.path} is already open for writing in this process (PID "
        f"{os.getpid()}), by {owner!r}, not closed (a notebook cell run again?). Close it "
        "first: tier.close(), or, if you no longer hold it, error.holder.close() on this "
        "error; then open the store again.",
        pid=os.getpid(),
        holder=owner,
      )
    who = "another process" if pid is None else f"another process (PID {pid})"
    if pid == os.getpid():  # (a store object of ours that the registry lost)
      who = f"this process (PID {pid}), through a store that was not closed"
    return errors.StoreLockedError(
      f"NVMe store {self.path} is open for writing by {who} (lock {LOCK}); stop it, or "
      "open another path.",
      pid=pid,
    )

  def release(self, holder: Any) -> None:
    """Releases the lock, if held; `holder` is the one `acquire` was given."""
    if self._fd is not None:
      if _OPEN.get(self.path) is holder:
        del _OPEN[self.path]
      os.close(self._fd)
      self._fd = None

  def __del__(self) -> None:
    # A store nothing refers to any more (a tier deleted without close, e.g. in a
    # notebook) cannot write again: release its lock, so the path opens again.
    fd = getattr(self, "_fd", None)
    if fd is not None:
      try:
        os.close(fd)
      except OSError:
        pass


def _refuse_foreign_folder(path: str) -> None:
  """Refuses a folder that holds files and no store: a store's files would land among them.

  A store's own names (the lock, the metadata, generations, a mesh's shards) mark
  a folder as offlax's, even one whose store was never committed.
  """
  try:
    names = os.listdir(path)
  except (FileNotFoundError, NotADirectoryError):
    return
  if names and not any(_STORE_NAME.fullmatch(name) for name in names):
    shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    raise errors.NotAStoreError(
      f"NVMe store path {path} holds {len(names)} other file(s) ({shown}) and no offlax store: "
      "a store writes .lock, offlax.json and gen0, gen1, ... there, beside them. Give the tier "
      f"an empty or new folder, e.g. NVMeTier({os.path.join(path, 'offlax-state')!r})."
    )
