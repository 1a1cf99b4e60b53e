"""The offlax exception hierarchy.

Every error offlax raises derives from :class:`OffloadError` and from the
builtin exception that fits, so callers may catch either.
"""


class OffloadError(Exception):
  """Base class of every error raised by offlax."""


class InvalidTierError(OffloadError, ValueError):
  """A tier was configured with an invalid option."""


class MemoryKindError(OffloadError, ValueError):
  """A memory kind is unknown, or a device does not offer it."""


class TreeMismatchError(OffloadError, ValueError):
  """Two pytrees that must have the same structure do not."""


class LeafTypeError(OffloadError, TypeError):
  """A pytree leaf is not an array."""
