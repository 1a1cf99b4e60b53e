"""`NVMeTier`'s options (`TierOptions`): checked once, each refusal naming `NVMeTier`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from offlax._src import errors
from offlax._src.nvme.format import DEFAULT_KEEP

DEFAULT_CHUNK = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class TierOptions:
  """The arguments an `NVMeTier` was made with, as given and checked (`NVMeTier` documents each).

  A tier on a mesh makes one tier per device's store with the same options
  (`keywords`).

  Raises:
    InvalidTierError: an option of the wrong type or out of its range; the
      message names the option, as `NVMeTier.<name>`, and the value.

  Example:
    >>> from offlax._src.nvme.tier_options import TierOptions
    >>> TierOptions("/tmp/run", readahead=4).keywords()["readahead"]
    4
    >>> TierOptions("/tmp/run", readahead=0)
    Traceback (most recent call last):
    ...
    offlax._src.errors.InvalidTierError: NVMeTier.readahead must be an int >= 1, got 0.
  """

  path: str | os.PathLike
  cache_bytes: int = 256 * 2**20
  chunk_bytes: int | None = None
  resume: bool = False
  fsync: bool = True
  progress: bool = True
  readahead: int = 2
  keep: int | None = None
  log_every: int | None = None
  step: int | None = None

  def __post_init__(self) -> None:
    for name, value, low in (
      ("cache_bytes", self.cache_bytes, 0),
      ("readahead", self.readahead, 1),
      ("keep", DEFAULT_KEEP if self.keep is None else self.keep, 1),
      ("log_every", 1 if self.log_every is None else self.log_every, 1),
      ("step", 0 if self.step is None else self.step, 0),
    ):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise errors.InvalidTierError(f"NVMeTier.{name} must be an int >= {low}, got {value!r}.")
      if getattr(self, name) is not None:  # a numpy int as a Python int: it goes into JSON
        object.__setattr__(self, name, int(value))
    for name, flag in (("resume", self.resume), ("fsync", self.fsync), ("progress", self.progress)):
      if not isinstance(flag, (bool, np.bool_)):  # "no" would be true
        raise errors.InvalidTierError(f"NVMeTier.{name} must be a bool, got {flag!r}.")
    path: Any = self.path
    if not isinstance(path, (str, os.PathLike)) or not str(path):
      raise errors.InvalidTierError(f"NVMeTier.path must be a directory path, got {path!r}.")
    chunk_bytes: Any = self.chunk_bytes
    if chunk_bytes is not None and (
      isinstance(chunk_bytes, bool)
      or not isinstance(chunk_bytes, (int, np.integer))
      or chunk_bytes <= 0
    ):  # (checked here so that the message names NVMeTier, not its HostTier)
      raise errors.InvalidTierError(
        f"NVMeTier.chunk_bytes must be an int > 0 bytes (or None for the default "
        f"{DEFAULT_CHUNK}), got {chunk_bytes!r}."
      )
    if chunk_bytes is not None:
      object.__setattr__(self, "chunk_bytes", int(chunk_bytes))

  def keywords(self) -> dict[str, Any]:
    """Every option but `path`, as given: `NVMeTier(path, **keywords())` has these options."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "path"}
