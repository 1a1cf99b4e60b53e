"""Every change offlax makes to another library's code: declared here, made through here.

A `Patch` names what it changes, the upstream behaviour it works around, the
versions it was written against and what fails without it; docs/patches.md
lists each one (``tests/test_patches.py`` checks the page against
`registered()`). Two scopes:

* ``"object"``: an attribute of one object offlax made or was given (an orbax
  handler it builds, an optimizer it is part of), set with `set_on`. Nothing
  outside that object changes.
* ``"process"``: a function of JAX or Flax that code outside offlax calls
  (Tunix's trainer, a user's ``jax.jit``), replaced with `replace` by a wrapper
  that acts only where the original fails and hands everything else through
  unchanged. ``OFFLAX_NO_PATCHES=1`` in the environment turns all of them off
  (read when each is installed); each has a canary test that runs its failure
  with the patch off and fails once upstream no longer needs it.

No other module of offlax assigns attributes of other libraries
(``tests/test_architecture.py`` checks it).

Example:
  >>> import types
  >>> from offlax._src import patches
  >>> target = types.SimpleNamespace(double=lambda x: 2 * x)
  >>> patch = patches.register(patches.Patch(
  ...   name="example", target="target.double", scope="process",
  ...   upstream="double(None) raises", versions="none", failure="a TypeError",
  ... ))
  >>> def wrap(double):
  ...   return lambda x: 0 if x is None else double(x)
  >>> patches.replace(patch, target, "double", wrap)
  True
  >>> target.double(None), target.double(3)
  (0, 6)
  >>> patches.uninstall(patch)
  >>> target.double(3)
  6
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

ENV = "OFFLAX_NO_PATCHES"
_MARK = "__offlax_patch__"


@dataclasses.dataclass(frozen=True)
class Patch:
  """One change to another library's code, as docs/patches.md lists it.

  Attributes:
    name: a short, unique name (the heading of its section in docs/patches.md).
    target: what it changes, as a dotted path (``module.function``, or
      ``Class.attribute`` for an attribute of instances).
    scope: ``"process"`` (a library's function, for every caller) or
      ``"object"`` (an attribute of one object offlax made or was given).
    upstream: the upstream behaviour worked around, where it is in the source.
    versions: the versions it was written and tested against.
    failure: what happens without it.
  """

  name: str
  target: str
  scope: Literal["process", "object"]
  upstream: str
  versions: str
  failure: str


# The modules that declare offlax's patches (docs/patches.md lists what they declare).
MODULES = (
  "offlax._src.donation",
  "offlax._src.flax_glue",
  "offlax._src.multi_steps",
  "offlax._src.nnx_hooks",
  "offlax._src.orbax_options",
)

_REGISTRY: dict[str, Patch] = {}
# Per installed process patch: the (owner, attribute, original) it replaced.
_ORIGINALS: dict[str, list[tuple[Any, str, Any]]] = {}


def register(patch: Patch) -> Patch:
  """Adds `patch` to the list docs/patches.md must show; returns it (idempotent per name)."""
  known = _REGISTRY.setdefault(patch.name, patch)
  if known != patch:
    raise ValueError(f"two patches named {patch.name!r}: {known} and {patch}")
  return patch


def registered() -> tuple[Patch, ...]:
  """Every patch declared so far (the modules that declare them imported)."""
  return tuple(_REGISTRY.values())


def declared() -> tuple[Patch, ...]:
  """offlax's own patches: those its `MODULES` declare (imported here; one loads orbax)."""
  out: list[Patch] = []
  for name in MODULES:
    out += [v for v in vars(importlib.import_module(name)).values() if isinstance(v, Patch)]
  return tuple(out)


def disabled() -> bool:
  """Whether ``OFFLAX_NO_PATCHES`` is set (to anything but ``0`` or empty)."""
  return os.environ.get(ENV, "") not in ("", "0")


def replace(
  patch: Patch,
  owner: Any,
  attr: str,
  wrap: Callable[[Any], Callable[..., Any] | None],
  *,
  also: Sequence[tuple[Any, str]] = (),
) -> bool:
  """Replaces ``owner.attr`` with ``wrap(owner.attr)`` for the whole process; idempotent.

  Args:
    patch: the registered process patch this is.
    owner: the module (or class) holding the function.
    attr: the function's name in `owner`.
    wrap: makes the replacement from the original, or returns None where the
      original is not the one it was written for (a changed signature): then
      nothing is replaced.
    also: other ``(owner, name)`` places that re-export the same function;
      each is replaced only where it still holds the original.

  Returns:
    Whether the replacement is in place (False: ``OFFLAX_NO_PATCHES`` is set,
    `owner` has no `attr`, or `wrap` declined).
  """
  if patch.scope != "process" or _REGISTRY.get(patch.name) != patch:
    raise ValueError(f"replace takes a registered process patch, got {patch}")
  if disabled():
    return False
  original = getattr(owner, attr, None)
  if original is None:
    return False
  if getattr(original, _MARK, None) == patch.name:
    return True
  wrapper = wrap(original)
  if wrapper is None:
    return False
  setattr(wrapper, _MARK, patch.name)
  wrapper.__wrapped__ = original  # type: ignore[attr-defined]
  replaced = []
  for o, a in ((owner, attr), *also):
    if getattr(o, a, None) is original:
      replaced.append((o, a, original))
      setattr(o, a, wrapper)
  _ORIGINALS[patch.name] = replaced
  return True


def installed(patch: Patch) -> bool:
  """Whether the process patch `patch` is in place now."""
  return patch.name in _ORIGINALS


def uninstall(patch: Patch) -> None:
  """Puts back what `replace` replaced for `patch` (for tests: the patch's absence)."""
  for owner, attr, original in _ORIGINALS.pop(patch.name, ()):
    if getattr(getattr(owner, attr, None), _MARK, None) == patch.name:
      setattr(owner, attr, original)


def set_on(patch: Patch, obj: Any, attr: str, value: Any) -> None:
  """Sets ``obj.attr`` for one object offlax made or was given: an ``"object"`` patch.

  Unlike `replace` it is not turned off by ``OFFLAX_NO_PATCHES``: it changes
  nothing but `obj`.

  Raises:
    AttributeError: `obj` has no `attr` (the library changed: the patch would
      do nothing, silently).
  """
  if patch.scope != "object" or _REGISTRY.get(patch.name) != patch:
    raise ValueError(f"set_on takes a registered object patch, got {patch}")
  if not hasattr(obj, attr):
    raise AttributeError(
      f"{patch.name}: {type(obj).__name__} has no attribute {attr!r}, which "
      f"{patch.versions} has ({patch.target}); see docs/patches.md."
    )
  setattr(obj, attr, value)
