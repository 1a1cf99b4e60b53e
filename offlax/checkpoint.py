"""Checkpoints of offloaded optimizer state, orbax-style: handlers, their arguments, store tools.

- The host tier's state is a pytree of arrays: save it with orbax's
  ``ocp.args.StandardSave`` through `checkpoint_handler()` (recommended:
  asynchronous, at disk speed), or with `HostStateSave` / `HostStateRestore`
  (raw files by direct I/O, faster where the page cache is slow; blocking).
- The NVMe tier's store is saved and restored with `NVMeStoreSave` /
  `NVMeStoreRestore` (orbax refuses its state in a ``StandardSave``).
- `inspect_store`, `rollback`, `reshard` and `retier` read, roll back, re-shard
  and move a state between tiers. The restore target of either tier is
  `offlax.abstract_state`, at the top level beside `offlax.placed`.

Importing this module loads no JAX or orbax: each name loads its module on
first use (``docs/checkpoints.md``).

Example:
  >>> import offlax.checkpoint
  >>> sorted(offlax.checkpoint.__all__)[:2]
  ['HostStateRestore', 'HostStateSave']
"""

import typing as _typing

from offlax._src import lazy as _lazy

_NAMES: dict[str, str | tuple[str, str]] = {
  "HostStateRestore": "offlax._src.host_checkpoint",
  "HostStateSave": "offlax._src.host_checkpoint",
  "LeafReport": "offlax._src.inspector",
  "NVMeStoreRestore": "offlax._src.checkpoint",
  "NVMeStoreSave": "offlax._src.checkpoint",
  "StoreReport": "offlax._src.inspector",
  "checkpoint_handler": "offlax._src.orbax_options",
  "inspect_store": "offlax._src.inspector",
  "reshard": "offlax._src.checkpoint",
  "retier": "offlax._src.checkpoint",
  "rollback": "offlax._src.nvme.rollback",
}

if _typing.TYPE_CHECKING:  # what the lazy names are, for type checkers and the API docs
  from offlax._src.checkpoint import NVMeStoreRestore, NVMeStoreSave, reshard, retier
  from offlax._src.host_checkpoint import HostStateRestore, HostStateSave
  from offlax._src.inspector import LeafReport, StoreReport, inspect_store
  from offlax._src.nvme.rollback import rollback
  from offlax._src.orbax_options import checkpoint_handler


__getattr__, __dir__ = _lazy.attributes(__name__, _NAMES)  # dir: no `_lazy`, `_typing`


__all__ = [
  "HostStateRestore",
  "HostStateSave",
  "LeafReport",
  "NVMeStoreRestore",
  "NVMeStoreSave",
  "StoreReport",
  "checkpoint_handler",
  "inspect_store",
  "reshard",
  "retier",
  "rollback",
]
