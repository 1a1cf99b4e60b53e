"""Lazy attributes of offlax's public modules: each name loads its `_src` module on first use.

`import offlax` (and `import offlax.errors`, `offlax.checkpoint`, `offlax.extend`)
imports no JAX, so `python -m offlax plan` refuses bad input at once. Each
public module holds a table of its names (`{name: "offlax._src.module"}`, or
`(module, attribute)` where the attribute has another name) and takes its
module `__getattr__` and `__dir__` from `attributes`.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

# The modules that import orbax or tensorstore. `offlax._src.checkpoint` is imported
# before any of them: it registers orbax's refusal of NVMe-tier state in a
# StandardSave, which must be in place once such state can exist.
CHECKPOINT_FIRST = "offlax._src.checkpoint"
NEEDS_CHECKPOINT = frozenset({
  "offlax._src.checkpoint",
  "offlax._src.hf.load",
  "offlax._src.hf.save",
  "offlax._src.host_checkpoint",
  "offlax._src.inspector",
  "offlax._src.layer_store.store",
  "offlax._src.nnx_layer_store",
  "offlax._src.nvme.rollback",
  "offlax._src.nvme.tier",
  "offlax._src.orbax_options",
})  # fmt: skip


def load(where: str, table: dict[str, str | tuple[str, str]], name: str) -> Any:
  """The value of public name `name` of module `where`, from its `_src` module.

  Args:
    where: the public module asking (`offlax.checkpoint`), for the error.
    table: its names: ``{name: module}`` or ``{name: (module, attribute)}``.
    name: the name asked for.

  Returns:
    The value.

  Raises:
    AttributeError: `name` is not in `table`.
  """
  entry = table.get(name)
  if entry is None:
    raise AttributeError(f"module {where!r} has no attribute {name!r}")
  module, attr = (entry, name) if isinstance(entry, str) else entry
  if module in NEEDS_CHECKPOINT:
    importlib.import_module(CHECKPOINT_FIRST)
  return getattr(importlib.import_module(module), attr)


def public_names(namespace: dict[str, Any]) -> list[str]:
  """A public module's `dir()`: its `__all__` and dunders, not its private imports."""
  return sorted(set(namespace["__all__"]) | {n for n in namespace if n.startswith("__")})


def attributes(
  where: str, table: dict[str, str | tuple[str, str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """Module `where`'s `__getattr__` (each name loaded once by `load`, then kept) and `__dir__`."""
  namespace = vars(sys.modules[where])

  def __getattr__(name: str) -> Any:
    namespace[name] = value = load(where, table, name)
    return value

  def __dir__() -> list[str]:
    return public_names(namespace)

  return __getattr__, __dir__


def moved(name: str, namespace: str) -> Any:
  """`offlax.<name>`, which moved to `namespace`: its value, with a `DeprecationWarning`.

  The old paths work for one more release, then go: the warning names the new one.
  """
  warnings.warn(
    f"offlax.{name} moved to {namespace}.{name}; the old path works for one more release.",
    DeprecationWarning,
    stacklevel=3,  # the user's line: past `offlax.__getattr__` and this function
  )
  return getattr(importlib.import_module(namespace), name)
