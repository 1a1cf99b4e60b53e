"""`OnDisk` placeholders in Flax NNX's state, where orbax refuses to save them.

`OnDisk` is a JAX pytree node without leaves, and NNX's graph flattening puts
such a node in the graph definition, not in the state: `nnx.state(optimizer)`
and `nnx.split(optimizer)` of an NVMe-tier optimizer would hold no trace of its
arrays on disk, and orbax would save that state without a word (issue 34). So
NNX flattens an `OnDisk` here into one `OnDiskVariable` (key ``on_disk``)
holding the placeholder: the state keeps it, JAX still sees no leaf in it (jit
and `nnx.jit` are unchanged), and orbax, meeting the placeholder inside it,
raises `UnsavableStateError` naming `offlax.NVMeStoreSave` (`checkpoint.py`).

The variable is not an ``nnx.optimizer.OptState``: a state filtered to those
(as Tunix's checkpoints are) leaves it out, and such a checkpoint holds the
optimizer's small leaves while the store keeps the arrays (see
``docs/flax.md``). NNX's tree mode (``graph=False``) flattens with JAX alone
and drops the placeholders as JAX does; a restore beside a store that lacks the
state's step then says so (`StaleStateError`).

`layout.OnDisk` calls `register` when it is made with Flax NNX imported, so
before NNX sees a placeholder: `nnx.Optimizer` builds its state (and the
placeholders) with Flax imported.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from flax.nnx import graphlib

KEY = "on_disk"


class OnDiskVariable(nnx.Variable):
  """An NVMe-tier array in NNX's state: holds its `offlax.OnDisk` placeholder, no array.

  Orbax refuses to save it (`offlax.UnsavableStateError`): save the tier's
  store with `offlax.NVMeStoreSave` instead.
  """


def _flatten(x: Any) -> tuple[tuple[tuple[str, Any], ...], None]:
  return ((KEY, OnDiskVariable(x)),), None


def _unflatten(nodes: Any, _: None) -> Any:
  ((_, value),) = nodes
  return value.get_value() if isinstance(value, nnx.Variable) else value


def register(on_disk: type) -> None:
  """Makes NNX flatten `on_disk` (the `OnDisk` class) into an `OnDiskVariable`; idempotent."""
  # An internal API of NNX (flax 0.12.8). Without it NNX drops the placeholders
  # and only the restore-side check (`StaleStateError`) remains.
  register_node = getattr(graphlib, "register_pytree_node_type", None)
  if register_node is not None and on_disk not in graphlib.PYTREE_REGISTRY:
    register_node(on_disk, _flatten, _unflatten)
