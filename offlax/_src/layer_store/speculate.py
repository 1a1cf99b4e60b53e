"""A global-norm clip in the backward pass: speculate, then validate (`Speculation`).

With ``update="backward"`` each layer is updated as its gradient arrives, before
the norm over all of them is known. As SuperOffload does, the worker updates
with the speculative scale 1 (the clip not applying, the common case once
training settles) while it writes each gradient to the store's gradient slots
behind (`grads.GradientWriter.keep`, its sum of squares noted); after the
last layer the worker knows the norm (`clip.global_norm`) and validates, and the
commit waits for the worker, so nothing speculated is ever committed. Where the clip
does not apply, the step is the unclipped chain's to the bit, for 2 bytes a
parameter more written (bf16 gradients; 4 with fp32 ones). Where it applies,
every layer is updated again from the committed generation, untouched until
the commit, with the gradients read back and scaled as optax does, into the
same free generation: the explicit `update()`'s step (params, gradients and
state read, params and state written), 30 bytes a parameter more with an fp32
master and Adam.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np

from offlax._src import errors
from offlax._src.layer_store import clip as clip_lib
from offlax._src.layer_store import micro
from offlax._src.layer_store import step as layer_step
from offlax._src.layer_store.grads import GradientWriter
from offlax._src.layer_store.handoff import Aborted, Handoff
from offlax._src.layer_store.slots import Slots


class Speculation:
  """The update functions of the backward pass's worker, and a leading clip's validation.

  Args:
    optimizer: the store's optimizer (`clip.split`: a leading global-norm clip, or none).
    treedef: one layer's tree structure.
    slots: the store's open files.
    writer: the store's gradient writer (keeps the gradients for a redo).
    budget: the most bytes a step holds in flight (`ranges`), or None (whole leaves).

  Attributes:
    updates: each leaf's update (`step.layer_update`).
    max_norm: the clip's ``max_norm``, or None (no clip: `keep` and `validate` do nothing).
    budget: as given, checked (`step.check_budget`).
  """

  def __init__(self, optimizer: Any, treedef: Any, slots: Slots, writer: GradientWriter,
               budget: int | None = None):  # fmt: skip
    self.updates = layer_step.layer_update(optimizer, treedef, slots.records)
    self.max_norm = clip_lib.split(optimizer).max_norm
    self.budget = layer_step.check_budget(slots, self.updates, budget)
    self._slots, self._writer = slots, writer
    self.whole: Any = None  # a clip by the whole model's norm (`whole_norm.attach`)
    # The leaves kept this step (`keep`): all of them, and the layers' squares are the step's.
    self._kept, self._all_kept = 0, threading.Event()
    self._handoff = Handoff(slots.n_layers, writer.queued, micro.STEP)  # the step's (`start`)

  def settle(self, handoff: Handoff, path: str) -> bool:
    """After a step dropped (its worker ended, `handoff` its): its kept gradients' writes waited
    for, so none lands after a `zero_grads`; where the step ended an accumulation, they went
    over the sum on disk: marked spent (`GradientWriter.check_sum`). Returns whether it was.
    A failed write is said (a warning): its slot's squares stay unknown, read when needed."""
    e = self._writer.settle_kept()
    if e is not None:
      warnings.warn(
        errors.StepNotCommittedWarning(
          f"LayerStore {path}: a gradient kept for the global-norm clip's redo of the step "
          f"dropped was not written ({e}); the next step writes it again."
        ),
        stacklevel=4,
      )
    spent = self.max_norm is not None and handoff.mode.last and handoff.started
    if spent:
      self._writer.spend()
    return spent

  def keep(self, i: int, k: int, grad: np.ndarray) -> np.ndarray:
    """`grad`, leaf `k` of layer `i`'s gradient as the worker updates with it, kept for a
    redo (written behind, `grads.GradientWriter.keep`) where there is a clip."""
    if self.max_norm is not None:  # (a dropped step's kept writes: settled when dropped)
      self._writer.keep(i, k, grad)
      self._kept += 1
      if self._kept == self._slots.n_layers * len(self._slots.records):
        self._all_kept.set()
    return grad

  def start(self, handoff: Handoff) -> Handoff:
    """A new step, its `handoff`: none of its leaves kept yet, its whole norm not known."""
    self._kept, self._handoff = 0, handoff
    self._all_kept.clear()
    if self.whole is not None:
      self.whole.clear()
    return handoff

  def layer_squares(self) -> np.ndarray:
    """The layers' sums of squares of the step in flight, once the worker kept every leaf
    (`whole_norm.WholeNorm.arrive`, from the rest's callback); `IncompleteStepError` where
    the step was dropped first (its worker failed: `update()` says why)."""
    handoff = self._handoff
    while not self._all_kept.wait(0.05):
      try:
        handoff.check()
      except Aborted:
        raise errors.IncompleteStepError(
          f"LayerStore {self._slots.path}: the step's update in the backward pass stopped "
          "before the whole model's norm was known; store.update() says why."
        ) from None
    return self._writer.kept_squares()

  def validate(self, stats: layer_step.Stats, gen: int, target: int, step: int,
               where: list[tuple[int, int]], abort: Any = None) -> layer_step.Stats:  # fmt: skip
    """`stats` of the step speculated into `target`, validated: redone from `gen` where the
    clip applies.

    Args:
      stats: the worker's (`step.run`'s) stats.
      gen: the committed generation, the step's params and state before.
      target: the free generation the worker wrote.
      step: the step being made.
      where: a list the unit of a failed redo is appended to.
      abort: called before each unit of the redo, raises to stop it (`step.run`).

    Returns:
      The step's stats, with its norm, the redo's moves added where it ran.

    Raises:
      OSError, StoreError, StoreCorruptedError: a gradient's write, or the redo's reads or
        writes, failed: the free generation is not to be committed.
    """
    if self.max_norm is None:
      return stats
    records = self._slots.records
    if self.whole is not None:  # the rest's callback gives it (`whole_norm`)
      norm = self.whole.wait(abort if abort is not None else lambda: None)
    else:
      norm = clip_lib.global_norm(self._writer.squares(), records, self.max_norm)
    kept = self._slots.n_layers * sum(r["slot"] for r in records)  # the gradients written
    stats = stats._replace(
      bytes_written=stats.bytes_written + kept, grad_norm=float(norm.norm), clipped=norm.applies
    )
    if not norm.applies:
      return stats
    try:
      redo = layer_step.run(self._slots, self.updates, gen, target, step=step, show=False,
                            where=where, norm=norm.norm, abort=abort,
                            budget=self.budget)  # fmt: skip
    except OSError as e:  # said as the redo's: the worker's error names the layer and leaf
      raise errors.StoreError(e.errno, f"the global-norm clip's redo: {e.strerror or e}") from e
    return stats._replace(
      seconds=stats.seconds + redo.seconds,
      bytes_read=stats.bytes_read + redo.bytes_read,
      bytes_written=stats.bytes_written + redo.bytes_written,
      read_seconds=stats.read_seconds + redo.read_seconds,
      write_seconds=stats.write_seconds + redo.write_seconds,
      compute_seconds=stats.compute_seconds + redo.compute_seconds,
      peak_bytes=max(stats.peak_bytes, redo.peak_bytes),
    )
