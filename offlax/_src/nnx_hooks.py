"""What Flax and optax need for params in host memory: patches acting only on offlax's case.

`offlax.offload_params` installs three (``docs/patches.md`` lists them): the two
below and `optax.MultiSteps.init`'s (`offlax._src.multi_steps`); each
hands every call through to the original except where that would fail or
compute on host memory.

`nnx.Optimizer.update` runs ``tx.update`` and then `optax.apply_updates`. For
params in host memory that is a model-sized updates buffer, then compute on
host memory, which XLA's GPU compiler converts into slow host compute of its
own. Trainers call it as it is (Tunix's `PeftTrainer`): an optimizer whose
transformation is or holds an `offlax.offload` (`offlax.update_and_apply`
fuses it, inside optax's wrappers too) and whose params are (some of them) in
host memory runs `offlax.nnx_update`.

`optax.global_norm` of gradients in host memory (Tunix logs it every step)
sums each host leaf's squares in a host computation: JAX refuses the sum of a
host array with a device one.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from offlax._src import apply, host_params, memory, multi_steps, patches

OPTIMIZER_UPDATE = patches.register(
  patches.Patch(
    name="nnx-optimizer-fused-update",
    target="flax.nnx.Optimizer.update",
    scope="process",
    upstream=(
      "Optimizer.update runs tx.update, then optax.apply_updates on the params "
      "(flax/nnx/training/optimizer.py): for params in host memory, a model-sized updates "
      "tree and compute on host memory"
    ),
    versions="flax 0.12.8, jax 0.10.2",
    failure=(
      "Tunix 0.1.7's PeftTrainer with offload_params raises 'memory_space of all inputs "
      "passed to add must be the same' in apply_updates (on a GPU, XLA converts it into "
      "host compute after a model-sized updates buffer)"
    ),
  )
)
GLOBAL_NORM = patches.register(
  patches.Patch(
    name="optax-global-norm-host-leaves",
    target="optax.global_norm",
    scope="process",
    upstream=(
      "global_norm squares each leaf and adds a device zero for its imaginary part "
      "(optax/tree_utils/_tree_math.py _square): a host leaf meets a device value"
    ),
    versions="optax 0.2.8, jax 0.10.2",
    failure=(
      "Tunix 0.1.7's train step (grad_norm = optax.global_norm(grads)) raises "
      "'memory_space of all inputs passed to add must be the same' for gradients in host memory"
    ),
  )
)


def install() -> None:
  """Installs both patches (idempotent; nothing under ``OFFLAX_NO_PATCHES``)."""
  import optax
  from flax import nnx

  patches.replace(OPTIMIZER_UPDATE, nnx.Optimizer, "update", _fused_update)
  patches.replace(GLOBAL_NORM, optax, "global_norm", _host_aware_norm)
  multi_steps.install()


def _fused_update(original: Any) -> Any:
  @functools.wraps(original)
  def update(self, model, grads, /, **kwargs):
    if not fuses(self, model):
      return original(self, model, grads, **kwargs)
    from offlax._src.flax_glue import nnx_update

    nnx_update(self, model, grads, **kwargs)
    return None  # the update was applied slice by slice: no updates tree exists

  return update


def _host_aware_norm(original: Any) -> Any:
  @functools.wraps(original)
  def global_norm(updates):
    if not memory.any_on_host(updates):
      return original(updates)
    return host_params.global_norm(updates)

  return global_norm


def fuses(optimizer: Any, model: Any) -> bool:
  """Whether `optimizer.update(model, ...)` runs offlax's fused update."""
  from flax import nnx

  tx, state = optimizer.tx, optimizer.opt_state
  if apply.fused_update_and_apply(tx) is None and not apply.holds_offload_state(state):
    return False  # no offload inside: Flax's update is the step
  params = nnx.state(model, optimizer.wrt, graph=getattr(optimizer, "graph", None))
  return memory.any_on_host(jax.tree.leaves(nnx.as_pure(params)))
