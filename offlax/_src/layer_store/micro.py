"""A trainer's gradient accumulation (`optax.MultiSteps`) carried out by a `LayerStore`.

Tunix's ``gradient_accumulation_steps`` wraps the optimizer in `optax.MultiSteps`:
each micro-step's gradients go into a running mean, ``acc + (g - acc) / (n + 1)``
(or a sum, ``use_grad_mean=False``), and the k-th micro-step updates with it. With
``offload_params(model, store=store, commit_in_update=True)`` and a store of
``update="backward"`` the store does the same for its layers (`Plan`): the
micro-steps before the last combine each layer's gradient into the accumulator on
disk (`grads.GradientWriter`), the last combines it with the accumulator as the
worker updates the layer (`backward`), the same expression in the same dtype, so
the layers get optax's mean to the bit (float32; another dtype rounds each
operation where XLA may keep more precision between them).

The model's source hands off with ``accumulate=False``; the store's plan (`plan_of`:
the `nnx.Optimizer` made last for its model sets it, or clears it) says what the
hand-off of the pass in flight does instead (`Plan.mode`, a `Micro`). The commit in
the update (`nnx_store_commit`) tells the plan which micro-step comes next, from
the optimizer's own `optax.MultiStepsState`, and commits after the k-th.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from offlax._src import errors


class Micro(NamedTuple):
  """A micro-step's hand-off (the ``accumulate`` that `LayerStore.put_grads` passes on).

  Attributes:
    n: the micro-step's index in its accumulation (0: the first, the accumulator zeros).
    last: whether it is the k-th: the layer is updated with the accumulated gradient.
    mean: `optax.MultiSteps`' running mean (its default), else the sum.
  """

  n: int
  last: bool
  mean: bool


def combine(mode: Any, old: Callable[[], np.ndarray], new: np.ndarray) -> np.ndarray:
  """A micro-step's gradient `new` combined with the accumulator (`old()` reads it).

  Args:
    mode: True (the store's own accumulation: a sum) or a `Micro`.
    old: reads the accumulator on disk (not read for a `Micro`'s first micro-step: zeros).
    new: the micro-step's gradient.

  Returns:
    The new accumulator, in `new`'s dtype: optax's ``acc + (g - acc) / (n + 1)`` for a mean.
  """
  if not isinstance(mode, Micro):
    return old() + new
  acc = np.zeros_like(new) if mode.n == 0 else old()
  if not mode.mean:
    return new + acc
  return acc + (new - acc) / np.asarray(mode.n + 1, new.dtype)  # (in `new`'s dtype, as optax)


class Plan:
  """Which micro-step of the trainer's accumulation the next backward pass is.

  Args:
    path: the store's path, for the messages.
    k: the micro-steps an update takes (`optax.MultiSteps`' k).
    n: the micro-step the next pass is (the optimizer's ``mini_step``).
    mean: whether optax takes the mean (``use_grad_mean``).
  """

  def __init__(self, path: str, k: int, n: int, mean: bool):
    self.path, self.k, self.n, self.mean = path, k, n, mean
    self.started = False  # a pass of micro-step `n` handed off a layer

  def mode(self, first: bool) -> Micro:
    """The hand-off of the pass in flight (`first`: its first layer, L-1).

    Raises:
      IncompleteStepError: a pass of this micro-step came before and its update did not end
        (an error in the step): its gradients are in the accumulator already.
    """
    if first and self.started:
      raise errors.IncompleteStepError(
        f"LayerStore {self.path}: micro-step {self.n} of {self.k} of the optimizer's gradient "
        "accumulation (optax.MultiSteps) is run again, and an earlier run of it stopped after "
        "its backward pass had put gradients into the accumulator on disk: they would count "
        "twice. Make the trainer (its nnx.Optimizer) again, or restore a checkpoint: its "
        "accumulation starts afresh at micro-step 0."
      )
    self.started = self.started or first
    return Micro(self.n, self.n == self.k - 1, self.mean)

  def advance(self, mini_step: int, k: int) -> bool:
    """After a micro-step (the commit's callback): the optimizer's ``mini_step`` and k after
    it. Returns whether it was the k-th (the store then commits).

    Raises:
      StoreMismatchError: the optimizer's count is not the plan's (e.g. a trainer's state
        restored in the middle of an accumulation): the accumulator on disk is not its.
    """
    done, was = self.n, self.k
    expected = (done + 1) % was
    if mini_step != expected:
      raise errors.StoreMismatchError(
        f"nnx.Optimizer.update: the optimizer's gradient accumulation (optax.MultiSteps) is "
        f"at micro-step {mini_step} of {k}, and the LayerStore at {self.path} accumulated "
        f"{expected} (of {was}): the accumulator on disk is not the optimizer's (a state "
        "restored in the middle of an accumulation?). Restore a state saved at the end of an "
        "update (Tunix saves there), or make the optimizer again."
      )
    self.n, self.k, self.started = mini_step, k, False
    return mini_step == 0


# Each store's plan, where a trainer's optimizer made one (`nnx_store_commit.accumulation`).
_PLANS: weakref.WeakKeyDictionary[Any, Plan] = weakref.WeakKeyDictionary()


def plan_of(store: Any) -> Plan | None:
  """The plan of `store`'s trainer (the optimizer made last for its model), or None."""
  return _PLANS.get(store)


def set_plan(store: Any, plan: Plan | None) -> None:
  """Gives `store` the plan of the optimizer made for its model (None: one that does not
  accumulate)."""
  if plan is None:
    _PLANS.pop(store, None)
  else:
    _PLANS[store] = plan
