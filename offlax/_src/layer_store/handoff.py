"""What the backward pass hands the update in the backward pass's worker (`backward`).

`Handoff`: the gradients handed off by the backward pass, in its order (layer
L-1 first), until the worker takes them, at most ``queued`` layers waiting.
`KeptReads`: the params of the last layers the model read, taken by the update
rather than read again.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from offlax._src import errors
from offlax._src.layer_store.micro import Micro


class Aborted(Exception):
  """The step in flight was dropped: its worker stops waiting for gradients."""


class Handoff:
  """The gradients handed off by the backward pass, in its order, until the worker takes them."""

  def __init__(self, n_layers: int, queued: int, mode: Micro):
    self._n, self._queued = n_layers, queued
    self._cond = threading.Condition()
    self._layers: dict[int, list[np.ndarray]] = {}
    self._next, self._aborted = n_layers - 1, False  # layer L-1's gradient comes first
    self.mode = mode  # ``mode.last``: the step ends an accumulation, with the sum on disk
    self.where: list[tuple[int, int]] = []  # the unit where its worker failed (`step.run`)
    self.read_bytes = 0  # what its update read from disk beside `step.run`'s own reads
    self.interrupted = False  # aborted by Ctrl-C in `update`: its worker may outlive the call

  @property
  def complete(self) -> bool:
    """Whether every layer's gradient has arrived."""
    return self._next < 0

  @property
  def started(self) -> bool:
    """Whether some layer's gradient has arrived."""
    return self._next < self._n - 1

  @property
  def arrived(self) -> int:
    """How many layers' gradients have arrived."""
    return self._n - 1 - self._next

  @property
  def due(self) -> int:
    """The layer whose gradient comes next (-1: none, the step whole)."""
    return self._next

  def put(self, i: int, leaves: list[np.ndarray]) -> None:
    """Layer `i`'s gradient, waiting while ``queued`` layers wait for the worker."""
    with self._cond:
      if i != self._next:
        self._aborted = True
        self._cond.notify_all()
        raise errors.InvalidOptionError(
          f"LayerStore(update='backward'): layer {i}'s gradient reached the host where layer "
          f"{self._next}'s was due; this mode updates the layers in the backward pass's order "
          "(L-1 down to 0, as offlax.scan_layers and offload_params hand them off). Nothing "
          "was committed. Open the store with update='explicit' for another order."
        )
      while len(self._layers) >= self._queued and not self._aborted:
        self._cond.wait()
      if not self._aborted:
        self._layers[i] = leaves
      self._next -= 1
      self._cond.notify_all()

  def take(self, i: int, k: int) -> np.ndarray:
    """Leaf `k` of layer `i`'s gradient, waited for; the layer dropped after its last leaf."""
    with self._cond:
      while i not in self._layers and not self._aborted:
        self._cond.wait()
      if self._aborted:
        raise Aborted
      leaves = self._layers[i]
      if k == len(leaves) - 1:
        del self._layers[i]
        self._cond.notify_all()
      return leaves[k]

  def check(self) -> None:
    """Raises `Aborted` where the step was dropped (`step.run`'s ``abort``: a clip's redo)."""
    with self._cond:
      if self._aborted:
        raise Aborted

  def abort(self) -> None:
    """Stops the worker's waits and drops the gradients queued."""
    with self._cond:
      self._aborted, self._layers = True, {}
      self._cond.notify_all()


class KeptReads:
  """The layers' params the model read last (a few), for the update to take them (`take`)."""

  def __init__(self, keep: int):
    self._keep, self._lock = keep, threading.Lock()  # its own lock: see `BackwardStep._lock`
    self._layers: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()

  def put(self, i: int, leaves: list[np.ndarray]) -> None:
    """Layer `i` as the model read it; the oldest dropped beyond ``keep`` (RAM bounded)."""
    with self._lock:
      self._layers[i] = leaves
      self._layers.move_to_end(i)
      while len(self._layers) > self._keep:  # the forward pass's
        self._layers.popitem(last=False)

  def take(self, i: int, k: int) -> np.ndarray | None:
    """Leaf `k` of layer `i`, or None (not kept); the layer dropped after its last leaf."""
    with self._lock:
      leaves = self._layers.get(i)
      if leaves is not None and k == len(leaves) - 1:
        del self._layers[i]
    return None if leaves is None else leaves[k]

  def clear(self) -> None:
    """Forgets them all (a commit: they are of the generation before)."""
    with self._lock:
      self._layers.clear()
