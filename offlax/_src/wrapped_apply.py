"""`update_and_apply` through optax's wrappers: an `offload` whose updates are final applies them.

optax's wrappers (``optax.chain``, ``optax.masked``,
``optax.inject_hyperparams``) rebuild a transformation from ``(init, update)``
closures, so the fused step of an `offload` inside one is out of sight. They
pass extra arguments down to it, though, and `update_and_apply` passes one,
`ARG`, holding a `Request`:

1. A first trace (`jax.make_jaxpr`, run never) in which each `offload`
   returns fresh placeholders for its updates finds whose updates are the
   wrapper's result and read by nothing else: an `offload` last in a chain, or
   inside ``masked`` or ``inject_hyperparams``. One followed by another
   transformation (``chain(offload(...), scale)``), or whose updates the
   wrapper keeps or reads for its state, is not.
2. In the step's trace those offloads run their fused update, writing the new
   params over the old, and return their input in place of updates nobody
   reads; every other `offload` runs its update. The step then takes the
   fused offloads' params and applies the remaining updates as optax does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

ARG = "offlax_apply"

_is_none = lambda x: x is None  # noqa: E731 (optax's apply_updates keeps None updates)


@dataclasses.dataclass
class Request:
  """What `update_and_apply` asks of the offloads inside a wrapper, in their call order.

  Attributes:
    fuse: per offload call, whether it runs its fused step; None while probing.
    outputs: per offload call, its output leaves: the placeholders while
      probing, then the new params of a fused call (an empty list otherwise).
  """

  fuse: tuple[bool, ...] | None = None
  outputs: list[list[Any]] = dataclasses.field(default_factory=list)

  def serve(self, updates: Any, state: Any, params: Any, update: Any, apply: Any) -> tuple:
    """An offload's ``update`` under this request; `update`, `apply`: its own two steps."""
    k = len(self.outputs)
    if self.fuse is None:
      placeholders = jax.tree.map(lambda u: jnp.array(u, copy=True), updates)
      self.outputs.append(jax.tree.leaves(placeholders))
      return placeholders, state
    if k < len(self.fuse) and self.fuse[k] and params is not None:
      new_params, new_state = apply(updates, state, params)
      self.outputs.append(jax.tree.leaves(new_params))
      return updates, new_state
    self.outputs.append([])
    return update(updates, state, params)


def update_and_apply(
  tx: Any, grads: Any, state: Any, params: Any, extra_args: dict[str, Any], apply_updates: Any
) -> tuple[Any, Any] | None:
  """`tx`'s step with the offloads inside it fused where their updates are final.

  Returns None where no offload inside can fuse (the caller runs ``tx.update``
  and `apply_updates` as usual).
  """
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    return None  # its update takes no extra argument (optax.lookahead, a user's own)
  flat: tuple[list[Any], Any] = jax.tree.flatten(params, is_leaf=_is_none)
  p_leaves, p_def = flat
  probe = Request()

  def probed(grads, state, params):
    updates, new_state = tx.update(grads, state, params, **extra_args, **{ARG: probe})
    return updates, new_state, probe.outputs

  try:
    closed, (updates, new_state, _) = jax.make_jaxpr(probed, return_shape=True)(
      grads, state, params
    )
  except TypeError as e:
    if ARG not in str(e):
      raise
    return None  # a transformation inside takes no extra arguments: update, then apply
  u_leaves, u_def = jax.tree.flatten(updates, is_leaf=_is_none)
  if u_def != p_def or not probe.outputs:
    return None
  found, fuse = _final(closed.jaxpr, u_leaves, len(jax.tree.leaves(new_state)), probe.outputs)
  if not any(fuse):
    return None
  request = Request(fuse)
  updates, new_state = tx.update(grads, state, params, **extra_args, **{ARG: request})
  u_leaves = jax.tree.leaves(updates, is_leaf=_is_none)
  new = []
  for p, u, source in zip(p_leaves, u_leaves, found, strict=True):
    if source is not None and fuse[source[0]]:
      new.append(request.outputs[source[0]][source[1]])
    else:
      new.append(apply_updates(p, u))
  return jax.tree.unflatten(p_def, new), new_state


def _final(
  jaxpr: Any, u_leaves: list[Any], n_state: int, outputs: list[list[Any]]
) -> tuple[list[tuple[int, int] | None], tuple[bool, ...]]:
  """Which offload calls' updates are the step's, read from the probe's jaxpr.

  The probe returns the updates, the new state and each call's placeholders.
  A call's updates are final when each placeholder is one of the updates, in
  the state nowhere, and read by no equation (a later transformation, or a
  state that sums them, would read it). Returns, per update leaf, the (call,
  leaf) it is or None, and per call whether it fuses.
  """
  n_u = sum(u is not None for u in u_leaves)
  outvars = jaxpr.outvars
  u_vars, state_vars = outvars[:n_u], set(map(id, outvars[n_u : n_u + n_state]))
  placeholders: dict[int, tuple[int, int]] = {}
  at = n_u + n_state
  for k, out in enumerate(outputs):
    for i in range(len(out)):
      placeholders[id(outvars[at])] = (k, i)
      at += 1
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
  inputs = set(map(id, jaxpr.invars)) | set(map(id, jaxpr.constvars))
  shared = read | state_vars | inputs  # a placeholder here is not (only) the step's update
  vars_of = iter(u_vars)
  found = [None if u is None else placeholders.get(id(next(vars_of))) for u in u_leaves]
  fuse = tuple(
    bool(out)
    and all((k, i) in found for i in range(len(out)))
    and not any(placeholders.get(v) == (k, i) for v in shared)
    for k, out in enumerate(outputs)
  )
  return found, fuse
