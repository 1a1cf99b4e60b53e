"""`OnDisk` placeholders in Flax NNX's state, where orbax refuses to save them.

`OnDisk` is a JAX pytree node without leaves, and NNX's graph flattening puts
such a node in the graph definition, not in the state: `nnx.state(optimizer)`
and `nnx.split(optimizer)` of an NVMe-tier optimizer would hold no trace of its
arrays on disk, and orbax would save that state without a word (issue 34). So
NNX flattens an `OnDisk` here into one `OnDiskVariable` (key ``on_disk``)
holding the placeholder: the state keeps it, JAX still sees no leaf in it (jit
and `nnx.jit` are unchanged), and orbax, meeting the placeholder inside it,
raises `UnsavableStateError` naming `offlax.checkpoint.NVMeStoreSave` (`checkpoint.py`).

The variable is an ``nnx.optimizer.OptState``, so a state filtered to those
(as Tunix's `PeftTrainer` checkpoints are) keeps it and is refused too: a
checkpoint of the small leaves alone would be whole only beside the store at
the very step it was saved, which the store keeps for ``keep`` steps at most.
NNX's tree mode (``graph=False``) flattens with JAX alone and drops the
placeholders as JAX does; a restore beside a store that lacks the state's step
then says so (`StaleStateError`).

`layout.OnDisk` calls `register` when it is made with Flax NNX imported, so
before NNX sees a placeholder: `nnx.Optimizer` builds its state (and the
placeholders) with Flax imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
from flax.nnx import graphlib

KEY = "on_disk"
_BOUND = "_offlax_nnx_variable"  # the `OnDiskVariable` an `OnDisk` flattens into


class OnDiskVariable(nnx.optimizer.OptState):
  """An NVMe-tier array in NNX's state: holds its `offlax.extend.OnDisk` placeholder, no array.

  Orbax refuses to save it (`offlax.errors.UnsavableStateError`): save the tier's
  store with `offlax.checkpoint.NVMeStoreSave` instead.
  """


def _flatten(x: Any) -> tuple[tuple[tuple[str, Any], ...], None]:
  # The same variable each time for the same placeholder: NNX tells a graph's
  # variables by identity, and a new one per flatten reads, to `nnx.cached_partial`
  # (Tunix's train step), as a graph changed inside the step.
  variable = x.__dict__.get(_BOUND)
  if variable is None or variable.get_value() != x:
    variable = OnDiskVariable(x)
    object.__setattr__(x, _BOUND, variable)
  return ((KEY, variable),), None


def _unflatten(nodes: Any, _: None) -> Any:
  ((_, value),) = nodes
  if not isinstance(value, nnx.Variable):
    return value
  # A placeholder of this graph's own, bound to its variable: JAX shares a static
  # placeholder between traces, so binding that one would leak a variable across.
  node = dataclasses.replace(value.get_value())
  object.__setattr__(node, _BOUND, value)
  return node


def register(on_disk: type) -> None:
  """Makes NNX flatten `on_disk` (the `OnDisk` class) into an `OnDiskVariable`; idempotent."""
  # An internal API of NNX (flax 0.12.8). Without it NNX drops the placeholders
  # and only the restore-side check (`StaleStateError`) remains.
  register_node = getattr(graphlib, "register_pytree_node_type", None)
  if register_node is not None and on_disk not in graphlib.PYTREE_REGISTRY:
    register_node(on_disk, _flatten, _unflatten)
