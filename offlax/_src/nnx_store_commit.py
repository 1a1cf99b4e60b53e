"""A `LayerStore`'s commit inside `nnx.Optimizer.update`: a trainer's step drives the store.

``offload_params(model, store=store, commit_in_update=True)``: the optimizer's
update of the model (`nnx.Optimizer.update`, as Tunix's `PeftTrainer` calls it in
its jitted train step) ends with the store's commit, ``store.update()``, in a
host callback: a trainer that knows nothing of the store commits it once a step.

The callback's operands are the layers' token gradients (each depends on its
layer's hand-off to the store: the callback runs after the last one) and the
optimizer's step count after this update. The store commits step ``s + 1`` only
where the optimizer's count is ``s + 1``: the rest of the model (its params and
optimizer state, in host memory, saved by the trainer's own checkpointing) and
the layers are then of one step. A rest restored from a checkpoint of another
step than the store's is refused (`StoreMismatchError`) before anything is
committed (the store is closed, its updated layers dropped), naming
``LayerStore.open(..., step=)``.

An optimizer that accumulates gradients over micro-steps (`optax.MultiSteps`,
Tunix's ``gradient_accumulation_steps``) is refused for a model with stored
layers, with or without ``commit_in_update`` (`refuse_accumulation`): the store
would update the layers at every micro-step while the rest waits for the k-th.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import errors, host_callbacks
from offlax._src import nnx_layer_store as stored_lib

# Of a stored layer's class (with `nnx_layer_store.SOURCE`): its store commits in the update.
COMMIT = "_offlax_commit_in_update"


def check(store: Any, commit: bool) -> None:
  """Refuses ``commit_in_update`` for a store that cannot commit inside a step."""
  if not commit:
    return
  mode = getattr(store, "update_mode", None)
  if mode != "backward":
    raise errors.InvalidOptionError(
      "offload_params: commit_in_update=True commits the store's step inside the "
      "optimizer's update, and needs a store made or opened with update='backward' (each "
      f"layer updated in the backward pass; commit waits for the last), got {mode!r}: "
      "LayerStore.create(path, layers, optimizer=tx, update='backward'), or leave "
      "commit_in_update=False and call store.update() after each step."
    )


def commit(optimizer: Any, model: Any, grads: Any) -> None:
  """Commits, after `optimizer`'s update of `model`, each store of it that asked so (above)."""
  from flax import nnx

  refuse_accumulation(optimizer, model, "nnx.Optimizer.update")
  flat = None
  for path, node in nnx.graph.iter_graph(model):
    source = stored_lib.layers_source(node)
    if source is None or not getattr(type(node[0]), COMMIT, False):
      continue
    if flat is None:
      flat = list(nnx.to_flat_state(grads))
    tokens = [
      leaf
      for key, variable in flat
      if key[: len(path)] == path and key[-1] == stored_lib.TOKEN
      for leaf in jax.tree.leaves(variable)
    ]
    if len(tokens) != source.n_layers:
      raise errors.InvalidOptionError(
        f"nnx.Optimizer.update: the store at {source.store.path} commits in the update "
        f"(commit_in_update=True), and the gradients hold {len(tokens)} of its "
        f"{source.n_layers} layers' tokens: differentiate with respect to every nnx.Param "
        "of the model (the layers' LayerTokens are nnx.Params), e.g. nnx.grad(loss)(model)."
      )
    step = optimizer.step[...]  # after this update's increment
    host_callbacks.call(
      functools.partial(_commit, source.store),
      [jax.ShapeDtypeStruct((), jnp.int32)],
      step,
      *tokens,
      *_whole_norms(optimizer.opt_state),
      side_effect=True,
    )


def refuse_accumulation(optimizer: Any, model: Any, where: str) -> None:
  """Refuses an optimizer that accumulates gradients over micro-steps, for a stored model.

  `optax.MultiSteps` (Tunix's ``gradient_accumulation_steps``) and `optax.apply_every`
  hold the rest of the model's update until the k-th micro-step; a store knows nothing
  of them and updates its layers at each step (in the backward pass, or at
  ``store.update()``), and its own accumulation sums where `optax.MultiSteps` takes the
  mean. The optimizer is found by its state, so a wrapped one is too (``offlax.offload(
  optax.MultiSteps(tx, k).gradient_transformation())``).

  Args:
    optimizer: an `nnx.Optimizer`.
    model: its model.
    where: what is refused, for the message.

  Raises:
    InvalidOptionError: `model` has layers in a `LayerStore` and `optimizer` accumulates.
  """
  accumulates = isinstance(optimizer.tx, optax.MultiSteps) or any(
    _is_accumulation(x) for x in jax.tree.leaves(optimizer.opt_state, is_leaf=_is_accumulation)
  )
  stores = stored_lib.stores_of(model) if accumulates else []
  if stores:
    raise errors.InvalidOptionError(
      f"{where}: the model's layers are in the LayerStore at {stores[0].path}, and the "
      "optimizer accumulates gradients over micro-steps (optax.MultiSteps, e.g. Tunix's "
      "TrainingConfig(gradient_accumulation_steps=k), or optax.apply_every): the store "
      "would update its layers at every micro-step while the rest of the model waits for "
      "the k-th. Train without it (gradient_accumulation_steps=None), or accumulate in a "
      "loop of your own: offload_params(model, store=store.source(accumulate=True)) with a "
      "store of update='explicit', store.zero_grads() before the first micro-step and "
      "store.update() after the last (it sums the layers' gradients: sum the rest's alike; "
      "docs/nvme_tier.md, 'Gradient accumulation')."
    )


def _is_accumulation(x: Any) -> bool:
  return isinstance(x, (optax.MultiStepsState, optax.ApplyEvery))


def _whole_norms(opt_state: Any) -> list[Any]:
  """The norms of the whole-model clips in `opt_state` (`whole_norm.WholeNormState`): operands
  of the commit, so that it runs after the rest's part of the norm reached the store."""
  from offlax._src.layer_store.whole_norm import WholeNormState

  is_state = lambda x: isinstance(x, WholeNormState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  return jax.tree.leaves(found)


def _commit(store: Any, step: Any, *tokens: Any) -> np.ndarray:  # (tokens: and the norms)
  """The callback: commits the store's step, the optimizer's `step` (checked)."""
  step, held = int(step), store.step
  if step != held + 1:
    store.close()  # drops the step updated in the backward pass: no later read commits it
    raise errors.StoreMismatchError(
      f"nnx.Optimizer.update: the optimizer's update made step {step}, and the store at "
      f"{store.path} holds step {held}, so it would commit step {held + 1}: the rest of "
      "the model (e.g. restored by the trainer's checkpoint) and the layers are of different "
      "steps. Nothing was committed, and the store was closed. Open it at the rest's step, "
      f"LayerStore.open(path, like, optimizer=tx, update='backward', step={step - 1}) (a "
      "step it keeps: create it with keep= at least the checkpoints' interval + 1), or "
      "restore the rest of the step the store holds."
    )
  store.update()
  return np.zeros((), np.int32)
