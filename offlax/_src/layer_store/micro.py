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

The model's source hands off a step of one batch (`STEP`); the store's plan (`plan_of`:
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
  """A backward pass's hand-off of its gradients to the store (`LayerStore.put_grads`).

  Attributes:
    accumulate: whether they are combined with the accumulator on disk (a micro-step of a
      gradient accumulation), not written over it.
    last: whether the pass ends an accumulation: each layer is updated with the combination
      as it arrives (``update="backward"``; the explicit mode's last micro-step adds as those
      before it do).
    n: the trainer's micro-step (`optax.MultiSteps`; 0: the accumulator is zeros), or None:
      the store's own accumulation (``source(accumulate=True)``), a sum into what is on disk.
    mean: with a trainer's `n`, `optax.MultiSteps`' running mean (its default), else the sum.
  """

  accumulate: bool = False
  last: bool = False
  n: int | None = None
  mean: bool = False


STEP = Micro()  # a step of one batch: the gradients written over those on disk


def combine(mode: Micro, old: Callable[[], np.ndarray], new: np.ndarray) -> np.ndarray:
  """A micro-step's gradient `new` combined with the accumulator (`old()` reads it).

  Args:
    mode: the micro-step (``mode.accumulate``).
    old: reads the accumulator on disk (not read for a trainer's first micro-step: zeros).
    new: the micro-step's gradient.

  Returns:
    The new accumulator, in `new`'s dtype: optax's ``acc + (g - acc) / (n + 1)`` for a mean.
  """
  if mode.n is None:
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
    return Micro(True, self.n == self.k - 1, self.n, self.mean)

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
