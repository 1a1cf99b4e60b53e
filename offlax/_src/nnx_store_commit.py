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

Gradient accumulation (`accumulation`): an `optax.MultiSteps` around the
optimizer (Tunix's ``gradient_accumulation_steps``) is carried out by the store
(`layer_store.micro`): the callback then gets the optimizer's micro-step too,
and commits after the k-th, its count the optimizer's ``gradient_step``. Any
other accumulation (a store that does not commit in the update, `optax.MultiSteps`
inside `offlax.offload`, `optax.apply_every`) is refused when the `nnx.Optimizer`
is made: the store would update its layers at every micro-step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import errors, host_callbacks, multi_steps
from offlax._src import nnx_layer_store as stored_lib
from offlax._src.layer_store import micro

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

  accumulation(optimizer, model, "nnx.Optimizer.update")
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
    step, callback = optimizer.step[...], functools.partial(_commit, source.store)  # (after)
    if isinstance(optimizer.tx, optax.MultiSteps):  # its micro-step, and k after it
      state = optimizer.opt_state
      k = multi_steps.layers_accumulation(optimizer.tx, state.gradient_step[...])[0]
      step, callback = state.gradient_step[...], functools.partial(_micro_step, source.store)
      tokens = [state.mini_step[...], jnp.asarray(k, jnp.int32), *tokens]
    host_callbacks.call(
      callback,
      [jax.ShapeDtypeStruct((), jnp.int32)],
      step,
      *tokens,
      *_whole_norms(optimizer.opt_state),
      side_effect=True,
    )


def accumulation(optimizer: Any, model: Any, where: str) -> None:
  """An optimizer that accumulates gradients over micro-steps, for a model with stored layers.

  `optax.MultiSteps` (Tunix's ``gradient_accumulation_steps``) and `optax.apply_every`
  hold the rest of the model's update until the k-th micro-step. An `optax.MultiSteps`
  around the optimizer, for stores that commit in the update (``commit_in_update=True``,
  ``update="backward"``), is carried out by the stores (`layer_store.micro`): made at
  setup (`where` ``"nnx.Optimizer"``), each store's `micro.Plan` starts at the optimizer's
  micro-step. Any other is refused: the store would update its layers at each step. The
  optimizer is found by its state, so a wrapped one is too (``offlax.offload(
  optax.MultiSteps(tx, k).gradient_transformation())``).

  Args:
    optimizer: an `nnx.Optimizer`.
    model: its model.
    where: ``"nnx.Optimizer"`` (setup) or ``"nnx.Optimizer.update"`` (its trace).

  Raises:
    InvalidOptionError: the accumulation cannot be carried out (the message says why).
  """
  accumulates = isinstance(optimizer.tx, optax.MultiSteps) or any(
    _is_accumulation(x) for x in jax.tree.leaves(optimizer.opt_state, is_leaf=_is_accumulation)
  )
  sources = _sources(model) if accumulates or where == "nnx.Optimizer" else []
  if not accumulates:
    for source, _ in sources:  # the optimizer made last drives the store
      micro.set_plan(source.store, None)
    return
  if not sources:
    return
  why = _cannot_accumulate(optimizer, sources)
  if why is None and where == "nnx.Optimizer":
    state = optimizer.opt_state
    k, mean, _ = multi_steps.layers_accumulation(optimizer.tx, state.gradient_step[...])
    for source, _ in sources:
      plan = micro.Plan(source.store.path, int(k), int(state.mini_step[...]), mean)
      micro.set_plan(source.store, plan)
  elif why is None and any(micro.plan_of(s.store) is None for s, _ in sources):
    why = "the optimizer was made without offlax's setup (nnx.Optimizer, as patched)"
  if why is not None:
    raise errors.InvalidOptionError(
      f"{where}: the model's layers are in the LayerStore at {sources[0][0].store.path}, and "
      "the optimizer accumulates gradients over micro-steps (optax.MultiSteps, e.g. Tunix's "
      "TrainingConfig(gradient_accumulation_steps=k), or optax.apply_every), which the store "
      f"cannot carry out here: {why}. Otherwise the store would update its layers at every "
      "micro-step while the rest of the model waits for the k-th. Accumulate with "
      "optax.MultiSteps(tx, k) around the optimizer (as Tunix does) and a store that commits "
      "in the update (LayerStore.create(..., update='backward'), offload_params(model, "
      "store=store, commit_in_update=True)); train without it "
      "(gradient_accumulation_steps=None); or accumulate in a loop of your own: "
      "offload_params(model, store=store.source(accumulate=True)) with a store of "
      "update='explicit', store.zero_grads() before the first micro-step and store.update() "
      "after the last (it sums: sum the rest's gradients alike; docs/nvme_tier.md)."
    )


def _sources(model: Any) -> list[tuple[Any, bool]]:
  """Each stored list of `model`'s source, and whether it commits in the update."""
  from flax import nnx

  found = []
  for _, node in nnx.graph.iter_graph(model):
    source = stored_lib.layers_source(node)
    if source is not None:
      found.append((source, bool(getattr(type(node[0]), COMMIT, False))))
  return found


def _cannot_accumulate(optimizer: Any, sources: list[tuple[Any, bool]]) -> str | None:
  """Why the stores cannot carry out `optimizer`'s accumulation, or None."""
  from offlax._src.layer_store import clip

  tx = optimizer.tx
  if not isinstance(tx, optax.MultiSteps):
    return "the accumulation is not an optax.MultiSteps around the optimizer"
  if not all(commit for _, commit in sources):
    return "the store does not commit in the update (offload_params(commit_in_update=True))"
  dtype = multi_steps.layers_accumulation(tx, 0)[2]
  if dtype is None:
    return "the optax.MultiSteps has a should_skip_update_fn"
  other = {r["dtype"] for s, _ in sources for r in s.store.grad_records if r["dtype"] != dtype}
  if other:  # (the accumulator on disk: the store's accumulator_dtype, else the layers')
    return (
      f"the optax.MultiSteps accumulates in {dtype} and the store in {sorted(other)}: make "
      f"the store with LayerStore.create(..., accumulator_dtype=jnp.{dtype}) (Tunix's "
      "gradient_accumulation_steps=k makes optax's float32 default), or give PeftTrainer "
      f"optax.MultiSteps(tx, k, accumulator_dtype=jnp.{sorted(other)[0]}) as its optimizer "
      "and gradient_accumulation_steps=None (its counters then count micro-steps)"
    )
  clipped = _whole_norms(optimizer.opt_state) or any(
    clip.split(s.store.optimizer).max_norm is not None for s, _ in sources
  )
  if clipped:
    return "the optimizer has a global-norm clip"
  return None


def _is_accumulation(x: Any) -> bool:
  return isinstance(x, (optax.MultiStepsState, optax.ApplyEvery))


def _whole_norms(opt_state: Any) -> list[Any]:
  """The norms of the whole-model clips in `opt_state` (`whole_norm.WholeNormState`): operands
  of the commit, so that it runs after the rest's part of the norm reached the store."""
  from offlax._src.layer_store.whole_norm import WholeNormState

  is_state = lambda x: isinstance(x, WholeNormState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  return jax.tree.leaves(found)


def _micro_step(store: Any, step: Any, mini_step: Any, k: Any, *tokens: Any) -> np.ndarray:
  """The callback of a micro-step (`optax.MultiSteps`' `step`, its ``gradient_step``, and
  ``mini_step`` and k after it): commits the store's step after the k-th."""
  try:
    plan = micro.plan_of(store)
    if plan is None:
      raise _made_since(store, "without")
    done = plan.advance(int(mini_step), int(k))
  except errors.OffloadError:
    store.close()  # drops a step updated in the backward pass: no later read commits it
    raise
  return _commit_step(store, step) if done else np.zeros((), np.int32)


def _made_since(store: Any, accumulation: str) -> Exception:
  return errors.InvalidOptionError(
    f"nnx.Optimizer.update: an nnx.Optimizer {accumulation} gradient accumulation "
    f"(optax.MultiSteps) was made for the model since this one, and the LayerStore at "
    f"{store.path} follows the optimizer made last. Nothing was committed, and the store was "
    "closed: open it again, and train with the optimizer made last (or make this one again)."
  )


def _commit(store: Any, step: Any, *tokens: Any) -> np.ndarray:  # (tokens: and the norms)
  """The callback: commits the store's step, the optimizer's `step` (checked)."""
  if micro.plan_of(store) is not None:  # the passes handed off as micro-steps: no step
    store.close()
    raise _made_since(store, "with")
  return _commit_step(store, step)


def _commit_step(store: Any, step: Any) -> np.ndarray:
  """Commits the store's step, the optimizer's `step` (checked)."""
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
