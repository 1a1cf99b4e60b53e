"""What Flax and optax need for params in host memory: patches acting only on offlax's case.

`offlax.offload_params` installs four (``docs/patches.md`` lists them): the three
below and `optax.MultiSteps.init`'s (`offlax._src.multi_steps`); each
hands every call through to the original except where that would fail or
compute on host memory. `offload`'s first `init` on NNX Variables installs the
update's alone (`install_update`): `optax.MultiSteps` around an offload is fused
for params on the device too.

`nnx.Optimizer.update` runs ``tx.update`` and then `optax.apply_updates`. For
params in host memory that is a model-sized updates buffer, then compute on
host memory, which XLA's GPU compiler converts into slow host compute of its
own. Trainers call it as it is (Tunix's `PeftTrainer`): an optimizer whose
transformation is or holds an `offlax.offload` (`offlax.update_and_apply`
fuses it, inside optax's wrappers too) and whose params are (some of them) in
host memory runs `offlax.nnx_update`. Either update then commits the `LayerStore` of
a model given to ``offload_params(store=..., commit_in_update=True)``
(`nnx_store_commit`).

`optax.global_norm` of gradients in host memory (Tunix logs it every step)
sums each host leaf's squares in a host computation: JAX refuses the sum of a
host array with a device one.

`nnx.Optimizer(model, optax.adamw(...))` on params in host memory fails in
optax's init (or, built inside ``jit``, in its update) with JAX's memory-kind
error, which names neither the param nor the fix: the constructor and the
update turn that error, and only it, into `offlax.errors.MemoryKindError` saying
that such params need ``offlax.offload(tx, compute="host")``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import optax

from offlax._src import (
  apply,
  errors,
  host_params,
  memory,
  multi_steps,
  nnx_paths,
  patches,
  sharding,
)
from offlax._src.layer_store import whole_norm

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
OPTIMIZER_INIT = patches.register(
  patches.Patch(
    name="nnx-optimizer-init-host-params",
    target="flax.nnx.Optimizer.__init__",
    scope="process",
    upstream=(
      "Optimizer.__init__ runs tx.init on the params where they are "
      "(flax/nnx/training/optimizer.py); optax's jnp.zeros_like of a pinned_host array, "
      "outside jit, builds a device buffer under a host sharding"
    ),
    versions="flax 0.12.8, optax 0.2.8, jax 0.10.2",
    failure=(
      "nnx.Optimizer(model, optax.adamw(...)) after offload_params raises JAX's 'Memory kind "
      "mismatch with xla::PjRtBuffers', which names neither the param nor the fix"
    ),
  )
)

# The fix a memory-kind error of Flax's optimizer on host params names.
FIX = (
  'nnx.Optimizer(model, offlax.offload(tx, compute="host"), wrt=...): offload\'s init makes '
  "the state in host memory and its update runs on the host CPU where the params lie "
  "(docs/params_off_device.md)"
)


def install() -> None:
  """Installs the patches (idempotent; nothing under ``OFFLAX_NO_PATCHES``)."""
  from flax import nnx

  install_update()
  patches.replace(OPTIMIZER_INIT, nnx.Optimizer, "__init__", _explained_init)
  # optax.global_norm only, the name Tunix calls: not optax.tree.norm, which
  # clip_by_global_norm calls. Inside offlax.offload it sees device-typed values and
  # needs nothing; outside, the clip computes on host memory, and its failure here is
  # what makes offlax refuse it (`update_and_apply`: put it inside the offload).
  patches.replace(GLOBAL_NORM, optax, "global_norm", _host_aware_norm)
  multi_steps.install()


def install_update() -> None:
  """Installs `nnx.Optimizer.update`'s patch alone: at `offlax.offload`'s first `init` on NNX
  Variables, for `optax.MultiSteps` around it with params on the device (`fuses`)."""
  from flax import nnx

  patches.replace(OPTIMIZER_UPDATE, nnx.Optimizer, "update", _fused_update)


def _fused_update(original: Any) -> Any:
  @functools.wraps(original)
  def update(self, model, grads, /, **kwargs):
    from offlax._src import nnx_store_commit

    if not fuses(self, model):
      try:
        out = original(self, model, grads, **kwargs)
      except ValueError as e:
        error = _host_params_error("update", model, self.wrt, e)
        if error is None:
          raise
        raise error from e
      nnx_store_commit.commit(self, model, grads)
      return out
    nnx_update(self, model, grads, **kwargs)
    nnx_store_commit.commit(self, model, grads)  # the layers' step, with the rest's (its module)
    return None  # the update was applied slice by slice: no updates tree exists

  return update


def _explained_init(original: Any) -> Any:
  @functools.wraps(original)
  def init(self, model, tx, *args, **kwargs):
    try:
      original(self, model, tx, *args, **kwargs)
    except ValueError as e:
      error = _host_params_error("init", model, kwargs.get("wrt"), e)
      if error is None:
        raise
      raise error from e
    from offlax._src import nnx_store_commit

    # At setup (Tunix's trainer builds it in its constructor), not at the first step's trace.
    nnx_store_commit.accumulation(self, model, "nnx.Optimizer")
    if fuses(self, model):
      _commit_step_counter(self, model)

  return init


def _commit_step_counter(optimizer: Any, model: Any) -> None:
  """`optimizer.step` committed as the fused update returns it.

  Flax creates the counter uncommitted; the jitted step returns it committed
  like the params (`sharding.on_one_device`), so the step's second call would
  miss its cache (an input typed otherwise) and compile the whole step again.
  Only for params on one device: on a mesh of several the step returns the
  counter replicated over it, as JAX places an uncommitted scalar beside them.
  """
  from flax import nnx

  params = nnx.as_pure(nnx.state(model, optimizer.wrt, graph=getattr(optimizer, "graph", None)))
  arrays = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
  step = optimizer.step[...]
  if not arrays or not isinstance(step, jax.Array) or isinstance(step, jax.core.Tracer):
    return
  devices = set().union(*(x.devices() for x in arrays))
  if len(devices) != 1:
    return
  (device,) = devices
  mesh = sharding.one_device_target(params, device)
  optimizer.step.set_value(sharding.on_one_device(step, mesh, device))


def _host_params_error(where: str, model: Any, wrt: Any, e: ValueError) -> Exception | None:
  """offlax's error for `e` where it is JAX's memory-kind error on params in host memory.

  The memory-kind errors Flax's optimizer meets on such params: optax's init
  (``Memory kind mismatch``) or its update and `apply_updates` (``memory_space
  of all inputs``). None for every other error, and for this one on a model
  without host params: the caller re-raises it as it is.
  """
  from flax import nnx

  text = str(e)
  jax_memory_error = "Memory kind mismatch" in text or "memory_space" in text
  if isinstance(e, errors.OffloadError) or not jax_memory_error or wrt is None:
    return None
  host = [
    (path, x)
    for path, variable in nnx.to_flat_state(nnx.state(model, wrt))
    for x in jax.tree.leaves(nnx.as_pure(variable))
    if memory.on_host(x)
  ]
  if not host:
    return None
  path, x = host[0]
  more = f" (and {len(host) - 1} more)" if len(host) > 1 else ""
  return errors.MemoryKindError(
    f"nnx.Optimizer {where}: param {nnx_paths.name(path)} {tuple(x.shape)}{more} is in host "
    f"memory (offlax.offload_params), and the optimizer's {where} ran on it as on a device "
    f"array. Params in host memory need the whole optimizer inside offlax.offload with host "
    f"compute: {FIX}. (JAX: {text.splitlines()[0]})"
  )


def _host_aware_norm(original: Any) -> Any:
  @functools.wraps(original)
  def global_norm(updates):
    _warn_if_layers_stored(updates)
    if not memory.any_on_host(updates):
      return original(updates)
    return host_params.global_norm(updates)

  return global_norm


def _warn_if_layers_stored(updates: Any) -> None:
  """Warns where `updates` holds stored layers' tokens: their gradients went to the store."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
  tokens = sum(whole_norm.is_token(path) for path in paths)
  if tokens:
    warnings.warn(
      errors.PartialNormWarning(
        f"optax.global_norm: {tokens} of these gradients are tokens of layers kept in an "
        "offlax.LayerStore, whose gradients the backward pass handed to the store, so this "
        "is the norm of the rest of the model only (embedding, head, norms), not of the "
        "whole model's gradients. A clip by the whole model's norm: "
        "offlax.clip_by_global_norm(c, store=store) first in the rest's optimizer, the "
        "store's optimizer optax.chain(optax.clip_by_global_norm(c), tx); its norm is "
        "store.last_update.grad_norm (docs/nvme_tier.md)."
      ),
      stacklevel=3,
    )


def fuses(optimizer: Any, model: Any) -> bool:
  """Whether `optimizer.update(model, ...)` runs offlax's fused update."""
  from flax import nnx

  tx, state = optimizer.tx, optimizer.opt_state
  fused = apply.fused_update_and_apply(tx) is not None
  if not fused and not apply.holds_offload_state(state):
    return False  # no offload inside: Flax's update is the step
  params = nnx.state(model, optimizer.wrt, graph=getattr(optimizer, "graph", None))
  if memory.any_on_host(jax.tree.leaves(nnx.as_pure(params))):
    return True
  # Params on the device: Flax's update is the step, but for `optax.MultiSteps` (Tunix's
  # gradient_accumulation_steps) around a fused step. Its own update selects every state
  # leaf with `jnp.where` each micro-step, which XLA:GPU runs on the host CPU for state in
  # host memory; the fused step updates the state at the k-th micro-step only.
  return isinstance(tx, optax.MultiSteps) and fused


def nnx_update(optimizer: Any, model: Any, grads: Any, /, **kwargs: Any) -> None:
  """`optimizer.update(model, grads)` with the update fused with its apply (`update_and_apply`).

  `nnx.Optimizer.update` runs ``tx.update`` and then `optax.apply_updates`,
  which for params in host memory is compute on host memory (XLA's GPU
  compiler converts it into slow host compute of its own) after a model-sized
  updates buffer. With `offlax.offload` as the optimizer's transformation this
  writes the new params slice by slice instead; the result is the same.

  Args:
    optimizer: an `nnx.Optimizer` built on `model`.
    model: the model whose params `optimizer` updates (its ``wrt`` filter).
    grads: the gradients, from `nnx.grad` of `model`.
    **kwargs: extra arguments of ``tx.update``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, offlax.offload(optax.sgd(0.1)), wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, optimizer, x):
    ...   grads = nnx.grad(lambda m: m(x).sum())(model)
    ...   offlax.nnx_update(optimizer, model, grads)
    >>> step(model, optimizer, jnp.ones((1, 2)))
    >>> int(optimizer.step[...])
    1
  """
  from flax import nnx

  graph = getattr(optimizer, "graph", None)
  state = lambda tree, *filters: nnx.state(tree, *filters, graph=graph)
  params = nnx.as_pure(state(model, optimizer.wrt))
  grads = nnx.as_pure(state(grads, optimizer.wrt))
  new_params, new_state = apply.update_and_apply(
    optimizer.tx, grads, nnx.as_pure(optimizer.opt_state), params, **nnx.as_pure(kwargs)
  )
  nnx.update(model, new_params)
  nnx.update(optimizer.opt_state, state(new_state))
  optimizer.step[...] += 1
