"""The update in the backward pass (`LayerStore.create(..., update="backward")`).

As ZeRO-Infinity's overlapped step and LoHan's active gradient offloading: the
backward pass hands each layer's gradient to the host (`LayerStore.put_grads`,
layers L-1, ..., 0), and rather than writing it to disk for a later `update`,
a worker thread updates that layer at once: the same `step.run` over the same
units with the same jitted update functions as `update()` (so the result is
the same to the bit), its master and moments read ahead in the backward pass's
order while the device computes the layers above, its new params and state
written into the free generation behind. The gradient never touches the disk,
and the layer's params are taken as the backward pass read them (`BackwardStep.read`):
30 bytes a parameter a step with an fp32 master and Adam, against 36.

The step commits at its end, by the same manifest rename (`commits`), after
its last layer: `update(rest=...)` waits for the worker and commits; a kill
before leaves the last committed step whole. The step's end must come before
the next step's forward pass reads the layers: a read that finds a step whose
layers are all updated and not committed commits it first (without ``rest``)
and warns (`StepNotCommittedWarning`), so a forgotten `update()` is never
silent, and the forward pass always reads committed layers; an `update(rest=)`
after it writes the rest into that step. A backward pass that finds a step
handed off whole and not committed, no read between (two gradients of one
source in one program), is refused: its gradients are of the params before
that step. A failed worker (a read or write of the disk) drops its step, said
at `update()` or the next read (layer and leaf). A rest that cannot be written
or a failed commit keeps the step for another `update()`. `close` waits for the
steps dispatched, drops a step not committed, and warns where any layer came.

RAM: the gradients of at most ``queued`` layers wait for the worker (the
backward pass waits beyond: the device's hand-off blocks), the params of at
most ``queued + 2`` layers as the model read them, plus `step.run`'s leaves in
flight.

Gradient accumulation: the micro-steps before the last
(``source(accumulate=True)``) add their gradients into those on disk, as in
the ``"explicit"`` mode (`grads.GradientWriter`, RAM bounded alike); the
last (``source(accumulate=True, last=True)``) hands each layer's gradient to
the worker, which adds the sum on disk to it (the same expression,
`micro.combine`) and updates the layer at once: the sum is never written.

A leading `optax.clip_by_global_norm` (`clip`): the worker updates with scale 1
and keeps the gradients on disk; after the last layer it redoes the step from
the committed generation where the clip applies (`speculate.Speculation`),
before the commit.
"""

from __future__ import annotations

import concurrent.futures
import errno
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from offlax._src import errors
from offlax._src.layer_store import clip as clip_lib
from offlax._src.layer_store import micro
from offlax._src.layer_store import ranges as ranges_lib
from offlax._src.layer_store import rest as layer_rest
from offlax._src.layer_store import step as layer_step
from offlax._src.layer_store.commits import Commits
from offlax._src.layer_store.grads import GradientWriter
from offlax._src.layer_store.handoff import Handoff, KeptReads
from offlax._src.layer_store.read_ahead import ReadAhead
from offlax._src.layer_store.slots import Slots
from offlax._src.layer_store.speculate import Speculation
from offlax._src.nvme.pipeline import wait_for_dispatched_steps

MODES = ("explicit", "backward")


def check_mode(update: Any, optimizer: Any, where: str) -> str:
  """`update` if it is a mode the store can run with `optimizer`, else `InvalidOptionError`."""
  if update not in MODES:
    raise errors.InvalidOptionError(
      f"{where}: update={update!r}; choose update='explicit' (store.update() runs the "
      "optimizer after the backward pass) or update='backward' (each layer updated as its "
      "gradient reaches the host, store.update() commits)."
    )
  if update == "backward" and optimizer is None:
    raise errors.InvalidOptionError(
      f"{where}: update='backward' updates each layer in the backward pass with the store's "
      "optimizer, and none was given: pass optimizer= (an elementwise optax transformation, "
      "e.g. offlax.master_weights(offlax.adamw(1e-3))), or leave update='explicit'."
    )
  return update


def refuse(mode: str, what: str, path: str) -> None:
  """Refuses `what` (a use of the gradients on disk) in the ``"backward"`` mode, which has none."""
  if mode == "backward":
    raise errors.InvalidOptionError(
      f"LayerStore {path}: {what} needs the gradients on disk, and update='backward' keeps "
      "none (each layer is updated as its gradient arrives; only accumulation's micro-steps "
      "before the last add theirs there). To read the gradients, open the store with "
      "update='explicit' (the default): LayerStore.open(path, like, optimizer=tx)."
    )


def hand_off(accumulate: bool, last: bool, path: str, mode: str, grads: Any) -> micro.Micro:
  """What `LayerStore.source(accumulate=, last=)` asks of the hand-off (a `micro.Micro`).

  ``last`` only in the ``"backward"`` mode: in the explicit one the last micro-step adds its
  gradients as those before do, and the same value keeps one compiled step for both.
  With ``accumulate``, `grads` (the store's `GradientWriter` or `BackwardStep`) refuses a
  sum a dropped step wrote over (`IncompleteStepError`: `zero_grads`, then the micro-steps
  again), rather than adding to it.
  """
  if last and not accumulate:
    raise errors.InvalidOptionError(
      f"LayerStore {path}: source(last=True) ends a gradient accumulation: pass "
      "source(accumulate=True, last=True) for the last micro-step, source(accumulate=True) "
      "for those before (store.zero_grads() first), or neither for a step of one batch."
    )
  if accumulate:
    grads.check_sum(path)
  return micro.Micro(bool(accumulate), bool(last and mode == "backward"))


def step_parts(
  update: str, optimizer: Any, treedef: Any, slots: Slots, commits: Commits, queued: int,
  progress: bool, reads: ReadAhead, budget: int | None = None,
) -> tuple[Any, Any]:  # fmt: skip
  """A store's step (`update()`'s, or None) and what takes the backward pass's gradients.

  ``"explicit"``: `step.LayerStep` and `grads.GradientWriter`; ``"backward"``: one
  `BackwardStep` for both.
  """
  clipped = optimizer is not None and clip_lib.split(optimizer).max_norm is not None
  writer = GradientWriter(slots, queued, lambda: commits.step, optimizer is not None, clipped)
  if update == "backward":  # the writer for accumulation's micro-steps
    both = BackwardStep(optimizer, treedef, slots, commits, writer, reads, budget)
    return both, both
  step = None
  if optimizer is not None:
    step = layer_step.LayerStep(optimizer, treedef, slots, commits, progress, writer.squares,
                                budget)  # fmt: skip
  elif budget is not None:
    layer_step.check_budget(slots, [], budget)
  return step, writer


class BackwardStep:
  """The layers' update in the backward pass, committed at the step's end (module docstring).

  It takes the place of both the gradient writer (`put`, `flush`, `used`, `zero`, `close`)
  and `update()`'s step (calling it commits the step in flight).

  Args:
    optimizer: the elementwise optax transformation (`step.check_elementwise`).
    treedef: one layer's tree structure.
    slots: the store's open files.
    commits: the store's manifest and committed step.
    writer: the gradients' writer, for accumulation's micro-steps before the last (its
      ``queued``: the most layers' gradients waiting for the worker too).
    reads: the model's reads (`read_ahead.ReadAhead`): dropped before a commit, and with
      them the layers kept here.
    budget: the most bytes the worker's step holds in flight (`ranges`), or None.
  """

  def __init__(self, optimizer: Any, treedef: Any, slots: Slots, commits: Commits,
               writer: GradientWriter, reads: ReadAhead, budget: int | None = None):  # fmt: skip
    self._slots, self._commits, self._drop_reads = slots, commits, reads.drop
    # a leading clip: validated; the budget checked
    self.spec = Speculation(optimizer, treedef, slots, writer, budget)
    self._writer = writer
    # The step in flight's hand-off: one per step, so a worker of a step dropped (or cut
    # short by Ctrl-C) never takes the next step's gradients.
    self._handoff = Handoff(slots.n_layers, writer.queued, micro.STEP)
    self._worker = concurrent.futures.ThreadPoolExecutor(1, "offlax-backward-update")
    self._lock = threading.RLock()
    self._run: concurrent.futures.Future | None = None  # the step in flight's worker
    self._target = 0
    self._late: layer_step.Stats | None = None  # a step a read committed, without rest
    self._kept = KeptReads(writer.queued + 2)  # the layers the model read last, for `_param`
    reads.on_drop(self._forget_kept)  # a commit or a rewrite: of the generation before

  def read(self, i: Any, fetch: Callable[[Any], list[np.ndarray]]) -> list[np.ndarray]:
    """Layer `i` for the model (a callback, by `fetch`), kept: the update's params. A step
    updated and not committed is committed first (`before_read`). The backward pass reads
    layer i just before it hands off its gradient: the update takes the params from here."""
    self.before_read()
    leaves = fetch(i)
    self._kept.put(int(i), leaves)
    return leaves

  def _forget_kept(self) -> None:
    """Forgets the layers kept, unless a step's worker, in flight, is to take them. One
    interrupted (Ctrl-C in `update`) is waited for: its generation is to be rewritten."""
    with self._lock:
      if self._handoff.interrupted:
        self._drop(None)
      if self._run is None:
        self._kept.clear()

  def _handed(self, handoff: Handoff, gen: int, i: int, k: int, rows: list[int | None],
              flight: ranges_lib.Flight) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Leaf `k` of layer `i`'s gradient from `handoff` (plus the sum on disk, ending an
    accumulation) and its params of generation `gen`, as the model read them (else read now)."""
    grad = handoff.take(i, k)
    if handoff.mode.last:
      grad, read = _plus_sum_on_disk(self._slots, k, i, grad, rows[k], flight, handoff.mode)
      handoff.read_bytes += read
    param = self._kept.take(i, k)
    if param is None:  # not kept (another reader's order): read now
      param = self._slots.read_slot("params", gen, k, i)
      handoff.read_bytes += param.nbytes
    return self.spec.keep(i, k, grad), param  # (kept for a clip's redo)

  def put(self, mode: micro.Micro, i: Any, *grads: np.ndarray) -> np.ndarray:
    """Layer `i`'s gradients (a callback): copied out, the layer updated by the worker. A
    micro-step before the last (`mode`) adds them into those on disk instead; the last adds
    those on disk to them (refused where spent: `check_sum`)."""
    if mode.accumulate and not mode.last:
      return self._writer.put(mode, i, *grads)
    i = int(i)
    leaves = [np.array(g) for g in grads]  # a copy: the callback's buffers are XLA's
    with self._lock:
      if i == self._slots.n_layers - 1:  # a new step's first layer
        self._refuse_second_pass()
        self._drop(_CUT)  # one cut short (its backward pass failed)
        if mode.last:
          self._writer.check_sum(self._commits.path)  # a step dropped wrote over the sum
          self._writer.wait_writes()  # the micro-steps' sums on disk before the worker reads
        self._start(mode)
      elif self._run is None:
        raise _outside(i, self._slots.n_layers)
      handoff = self._handoff  # this step's, taken under the lock
    handoff.put(i, leaves)
    return np.zeros((), np.float32)

  def _refuse_second_pass(self) -> None:
    """Raises `IncompleteStepError` where a step handed off whole is not committed: with no
    read between (two gradients of one source in one program), committing it would update
    the second pass's gradients, taken at the params before, against those after. It stays."""
    run = self._run
    if run is None or not self._handoff.complete:
      return
    if run.done() and run.exception() is not None:  # nothing to keep: dropped, said
      raise self._failed("LayerStore (the next backward pass)")
    raise _second_pass(self._commits.path, self._commits.step + 1)

  def _start(self, mode: micro.Micro) -> None:
    commits = self._commits
    self._writer.settle_kept()  # (none: a step dropped settles its own, `_settle`)
    self._target, self._late = commits.free_generation(), None
    self._handoff = self.spec.start(Handoff(self._slots.n_layers, self._writer.queued, mode))
    layers = range(self._slots.n_layers - 1, -1, -1)
    self._run = self._worker.submit(
      self._work, self._handoff, commits.generation, self._target, commits.step + 1, layers
    )

  def _work(self, handoff: Handoff, gen: int, target: int, step: int, layers: Any) -> Any:
    try:
      updates, flight = self.spec.updates, ranges_lib.Flight()
      rows = layer_step.plan(self._slots, updates, self.spec.budget)
      handed = lambda i, k: self._handed(handoff, gen, i, k, rows, flight)
      stats = layer_step.run(self._slots, updates, gen, target, step=step, show=False,
                             layers=layers, handed=handed, where=handoff.where,
                             budget=self.spec.budget, flight=flight)  # fmt: skip
      stats = stats._replace(bytes_read=stats.bytes_read + handoff.read_bytes)
      return self.spec.validate(stats, gen, target, step, handoff.where, handoff.check)
    except BaseException:
      handoff.abort()  # the backward pass's hand-offs no longer wait for it
      raise

  def before_read(self) -> bool:
    """Commits a step whose layers are all updated (a model's read, `zero`), warning; or False.

    Raises:
      StoreError, IncompleteStepError: the worker of that step failed (`_failed`): dropped.
    """
    with self._lock:
      if self._handoff.interrupted:  # Ctrl-C in `update`: its worker waited for, dropped
        self._drop(None)
      if self._run is None or not self._handoff.complete:
        return False
      if self._run.exception() is not None:  # waits for the worker, as the commit would
        raise self._failed("LayerStore (a read of the layers)")
      step = self._commits.step + 1
      self._late = self(None)  # `update(rest=)` may still add the rest to it
      warnings.warn(_committed_late(self._commits.path, step), stacklevel=2)
      return True

  def _failed(self, where: str) -> Exception:
    """The worker's failure, its step dropped: the error that says where and the way out."""
    run, commits = self._run, self._commits
    assert run is not None
    e = run.exception()
    self._run = None
    self._kept.clear()
    spent = self.spec.settle(self._handoff, self._commits.path)
    return _failure(where, commits, self._slots.records, self._handoff.where, e, spent)

  def __call__(self, rest: Any) -> layer_step.Stats:
    """Waits for the step in flight's last layer, writes `rest`, flushes and commits.

    Where a read committed the step already (`before_read`), writes `rest` into it. A rest
    that cannot be written, or a failed commit, keeps the step for a later call.

    Raises:
      IncompleteStepError: no backward pass handed off every layer since the last commit.
      StoreError: a read or write failed; nothing was committed.
    """
    commits = self._commits
    with self._lock:
      if self._run is None and self._late is not None:
        late, self._late = self._late, None  # (kept where the rest's write fails)
        try:
          return _late_rest(self._commits, rest, late)
        except BaseException:
          self._late = late
          raise
      if self._run is None or not self._handoff.complete:
        arrived = self._handoff.started and self._run is not None
        self._drop(None)
        raise _incomplete(commits.step, self._handoff if arrived else None)
      layer_rest.check_leaves(rest)  # before the step is waited for: it stays
      self._drop_reads()  # of the generation this step replaces
      try:
        # Ctrl-C: the step aborted, `_run` kept (its worker may still run, after a second
        # one): the next read, update, zero or rewrite waits for it and drops it (`_drop`)
        stats = _result(self._run, self._handoff)
      except Exception as e:
        raise self._failed("LayerStore.update") from e
      try:
        rest_records = None
        if rest is not None:
          rest_records = layer_rest.write(commits.path, self._target, rest, fsync=commits.fsync)
        if commits.fsync:
          self._slots.sync(self._target)
        commits.commit(self._target, rest_records)
      except OSError as e:
        raise _not_committed(commits, e) from e
      self._run = None
      self._kept.clear()  # of the generation before
      return stats

  def _drop(self, why: str | None) -> None:
    """Drops the step in flight, not committed: the worker stopped, its writes left. ``_run``
    is cleared once the worker has ended (interrupted while waiting, a later call waits again)."""
    run = self._run
    if run is None:
      return
    self._handoff.abort()
    concurrent.futures.wait([run])  # handoff.Aborted, or the worker's own error: nothing committed
    self._run = None
    self._kept.clear()
    spent = self.spec.settle(self._handoff, self._commits.path)  # the sum written over?
    if why is not None or spent:  # `why`: what became of the step, for the warning
      warnings.warn(_dropped(self._commits, why, spent), stacklevel=3)

  def check_sum(self, path: str) -> None:
    """Before a micro-step (`hand_off`): drops a step cut short, refuses a spent sum."""
    if self._run is not None and not self._handoff.complete:
      self._drop_cut()
    self._writer.check_sum(path)

  def _drop_cut(self) -> None:
    """Drops a step cut short, its pass's callbacks waited for (outside the lock: they take it)."""
    self._writer.flush()
    with self._lock:
      if self._run is not None and not self._handoff.complete:
        self._drop(_CUT)

  def flush(self) -> None:
    """Waits for the steps dispatched (their hand-offs, micro-steps' writes), not the worker."""
    self._writer.flush()

  def used(self) -> None:
    """The gradients on disk were used (an accumulation's last micro-step was committed)."""
    self._writer.used()

  def zero(self) -> None:
    """Zeros the gradients on disk, a step whose worker may read them committed first (warning)."""
    # A jitted backward pass returns before its callbacks run: waited for, its step is whole
    # (committed here) or cut short (dropped, its kept writes settled before the zeros).
    self._writer.flush()
    self.before_read()
    self._drop_cut()
    self._writer.zero()

  def close(self) -> None:
    """Waits for the steps dispatched (their hand-offs); drops a step not committed, warning
    where its backward pass handed off any layer; ends the worker, forgets the layers kept."""
    wait_for_dispatched_steps()  # a jitted backward pass returns before its callbacks run
    with self._lock:
      self._drop(_dropped_at_close(self._handoff, self._slots.n_layers))
      self._kept.clear()
    self._worker.shutdown(wait=True)
    self._writer.close()


_CUT = "its backward pass stopped before handing off every layer"


def _plus_sum_on_disk(slots: Slots, k: int, i: int, grad: np.ndarray, rows: int | None,
                      flight: ranges_lib.Flight,
                      mode: micro.Micro) -> tuple[np.ndarray, int]:  # fmt: skip
  """`grad`, the worker's own copy of the last micro-step's gradient, plus the accumulated sum
  on disk (leaf `k`, layer `i`), and the bytes read: whole, or with a budget a range of `rows`
  rows at a time added into `grad` (`ranges.plan`), each read counted in `flight` while held.
  A trainer's micro-step (`mode.n`) combines them as its optimizer does. A store's
  ``accumulator_dtype`` (the sum's) combines in it, the result rounded to `grad`'s dtype, the
  layers' (as `optax.MultiSteps` casts its accumulator for the optimizer)."""
  if mode.n == 0:  # (a trainer's k = 1: no accumulator on disk)
    return micro.combine(mode, lambda: grad, grad), 0
  if rows is None:
    parts: Iterable[tuple[Any, np.ndarray]] = [(None, slots.read_slot("grads", 0, k, i))]
  else:
    parts = ((slice(r.start, r.stop), on_disk)
             for r, on_disk in ranges_lib.read_checked(slots, "grads", 0, k, i, rows))  # fmt: skip
  read = 0
  for where, on_disk in parts:
    flight.add(on_disk.nbytes)
    wide = lambda g: g.astype(on_disk.dtype, copy=False)  # noqa: B023 (exact: a wider float)
    if where is None:  # whole (a 0-d leaf too)
      grad = micro.combine(mode, lambda: on_disk, wide(grad)).astype(grad.dtype, copy=False)  # noqa: B023
    else:  # (assigned: rounded to `grad`'s dtype)
      grad[where] = micro.combine(mode, lambda: on_disk, wide(grad[where]))  # noqa: B023
    read += on_disk.nbytes
    flight.sub(on_disk.nbytes)
  return grad, read


def _dropped_at_close(handoff: Handoff, n_layers: int) -> str | None:
  """Why `close()` drops the step in flight, for its warning; None where nothing needs saying
  (no layer handed off, or Ctrl-C in `update()`, which said it)."""
  if handoff.interrupted:
    return None
  if handoff.complete:
    return "its layers were all updated, and update() was not called before close()"
  if handoff.started:
    return (
      f"its backward pass had handed off {handoff.arrived} of the {n_layers} layers' "
      "gradients when close() came"
    )
  return None


def _dropped(commits: Commits, why: str | None, spent: bool) -> Warning:
  """The warning of a step dropped: `why`, and whether it had written over the sum (`spent`)."""
  if spent:
    why = (why or "update() came before its backward pass handed off every layer") + (
      "; its last micro-step had written its gradients over those accumulated on disk: call "
      "store.zero_grads() and run the step's micro-steps again"
    )
  return errors.StepNotCommittedWarning(
    f"LayerStore {commits.path}: step {commits.step + 1} was dropped, not committed: {why}. "
    f"The store holds step {commits.step}."
  )


def _second_pass(path: str, step: int) -> Exception:
  return errors.IncompleteStepError(
    f"LayerStore(update='backward') {path}: a backward pass began handing "
    f"off the layers while step {step}'s, all handed off and updated, were not committed: "
    "call update() between backward passes. This mode refuses two backward passes of one "
    "source in one program (the second's gradients, of the params before, would update "
    f"the params after); nothing of this pass was used, and step {step} is kept: "
    "store.update() commits it. Take one gradient per step, or accumulate them with "
    "source(accumulate=True) and source(accumulate=True, last=True)."
  )


def _committed_late(path: str, step: int) -> Warning:
  return errors.StepNotCommittedWarning(
    f"LayerStore {path}: step {step}'s layers were updated in the "
    "backward pass, and the next pass read the layers before store.update() committed "
    "them: committed now, without rest= (a store.update(rest=...) before the next "
    f"backward pass still writes the rest of the model into step {step}). Call "
    "store.update(rest=...) at each step's end (after its backward pass, before the "
    "next read of the layers) to commit the rest of the model with the layers."
  )


def _failure(
  where: str, commits: Commits, records: list, at_unit: list, e: Any, spent: bool = False
) -> Exception:
  """The worker's failure `e`: the error that says where (`at_unit`) and the way out."""
  at = ""
  if at_unit:
    i, k = at_unit[0]
    at = f" at layer {i}, leaf {records[k]['path']}"
  full = isinstance(e, OSError) and e.errno == errno.ENOSPC
  msg = (
    f"{where}: step {commits.step + 1} was not committed: the update in the backward pass "
    f"failed{at} ({getattr(e, 'strerror', None) or e}); nothing of it was committed, "
    f"{commits.path} still holds step {commits.step}, whole: "
    + ("free space on the disk, then " if full else "")
    + (
      "call store.zero_grads() and run the step's micro-steps again (its last micro-step "
      "had written its gradients over those accumulated on disk, kept for the clip's redo)."
      if spent
      else "run the step again (update='backward' keeps no gradients to update from)."
    )
  )
  if isinstance(e, OSError):
    return errors.StoreError(e.errno, msg)
  if isinstance(e, errors.StoreCorruptedError):  # a slot failed its checksum: said as such
    return errors.StoreCorruptedError(msg)
  return errors.IncompleteStepError(msg)


def _incomplete(step: int, cut: Handoff | None) -> Exception:
  """`update()` with no step whole: none begun, or one cut short (`cut`, dropped)."""
  if cut is None:
    what = f"no backward pass handed off the layers' gradients since step {step}"
  else:
    n = cut.arrived + cut.due + 1
    what = (
      f"the backward pass since step {step} handed off the gradients of layers {n - 1} "
      f"down to {cut.due + 1} only ({cut.arrived} of {n}; layer {cut.due}'s was due next: "
      "it stopped, an error in the step?); its updates are dropped"
    )
  return errors.IncompleteStepError(
    f"LayerStore.update: no step to commit: {what} (update='backward' updates each layer in "
    f"the backward pass and update() commits them). The store holds step {step}, whole: "
    "run the step's forward and backward pass, then update()."
  )


def _not_committed(commits: Commits, e: OSError) -> Exception:
  return errors.StoreError(
    e.errno,
    f"LayerStore.update: step {commits.step + 1} was not committed ({e.strerror or e}); "
    f"{commits.path} still holds step {commits.step}, whole, and step "
    f"{commits.step + 1}'s layers, updated: "
    + ("free space on the disk, then " if e.errno == errno.ENOSPC else "")
    + "call update() again.",
  )


def _result(run: concurrent.futures.Future, handoff: Handoff) -> Any:
  """The worker's result; interrupted (Ctrl-C), its step's `handoff` is aborted and the
  worker waited for before the error goes on: no worker outlives its step."""
  try:
    return run.result()
  except BaseException as e:
    handoff.interrupted = not isinstance(e, Exception)  # Ctrl-C: the worker is reaped later
    handoff.abort()
    concurrent.futures.wait([run])
    raise


def _late_rest(commits: Commits, rest: Any, late: layer_step.Stats) -> layer_step.Stats:
  """`rest` written into the step a read committed without it (`before_read`); its stats."""
  if rest is not None:
    try:
      records = layer_rest.write(commits.path, commits.generation, rest, fsync=commits.fsync)
      commits.add_rest(records)
    except OSError as e:
      raise errors.StoreError(
        e.errno,
        f"LayerStore.update: the rest of step {commits.step} (committed by a read of the "
        f"layers, without rest=) was not written ({e.strerror or e}); {commits.path} holds "
        f"step {commits.step} without it: call update(rest=...) again.",
      ) from e
  return late


def _outside(i: int, n: int) -> Exception:
  return errors.IncompleteStepError(
    f"LayerStore(update='backward'): layer {i}'s gradient reached the host outside a step "
    f"(layer {n - 1}'s comes first); nothing was updated. Run the step's backward pass whole "
    "(offlax.scan_layers hands layer L-1 off first), or open the store with "
    "update='explicit' to hand the layers off in another order."
  )
