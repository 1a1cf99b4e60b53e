"""The model's reads of a layer store (`ReadAhead`): a pool reading the next layers ahead.

The scan asks for its layers one by one (`LayerStore.fetch`, a callback): the
forward pass 0, 1, ..., L-1, the rematerialised backward pass L-1, ..., 0. The
pool guesses the direction from the last two layers asked for and reads the
next ones in it, at most ``pool_layers`` layers held or in flight; a layer
asked for twice in a row (the backward pass starting where the forward pass
ended) turns it round. A wrong guess is dropped.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


class ReadAhead:
  """Layers read ahead of the scan, in the direction it goes.

  Attributes:
    pool_layers: the most layers held in RAM, asked for or read ahead.
    peak_held: the most layers held at once so far (for tests).
  """

  def __init__(self, read: Callable[[int], list[np.ndarray]], n_layers: int, pool_layers: int):
    self._read, self._n_layers, self.pool_layers = read, n_layers, pool_layers
    self._lock = threading.Lock()
    self._ahead: dict[int, concurrent.futures.Future] = {}
    self._last: int | None = None
    self._direction = 1
    self._held = 0
    self.peak_held = 0
    self._forget: list[Callable[[], None]] = []  # more layers' copies to forget at `drop`
    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, pool_layers - 1), "offlax-layers")

  def fetch(self, i: Any) -> list[np.ndarray]:
    """Layer `i`: from the pool, reading the next layers ahead."""
    i = int(i)
    with self._lock:
      if self._last is not None and abs(i - self._last) == 1:
        self._direction = i - self._last
      elif self._last == i:  # the backward pass starts on the layer the forward pass ended on
        self._direction = -self._direction
      self._last = i
      future = self._ahead.pop(i, None)
      wanted = [i + self._direction * d for d in range(1, self.pool_layers)]
      wanted = [j for j in wanted if 0 <= j < self._n_layers]
      for j in [j for j in self._ahead if j not in wanted]:  # a wrong guess: drop it
        self._drop(self._ahead.pop(j))
      if future is None:  # not read ahead: read now (a corrupt slot raises here, holding nothing)
        future = concurrent.futures.Future()
        future.set_result(self._read(i))
        self._held += 1
      self.peak_held = max(self.peak_held, self._held)
      for j in wanted:
        if j not in self._ahead:
          self._held += 1
          self.peak_held = max(self.peak_held, self._held)
          self._ahead[j] = self._pool.submit(self._read, j)
    try:
      return future.result()
    finally:
      with self._lock:
        self._held -= 1  # the device has its copy once the callback returns

  def _drop(self, future: concurrent.futures.Future) -> None:
    if not future.cancel():
      concurrent.futures.wait([future])
    self._held -= 1

  def on_drop(self, forget: Callable[[], None]) -> None:
    """Calls `forget` at each `drop`: it forgets other copies of the layers read."""
    self._forget.append(forget)

  def drop(self) -> None:
    """Forgets the layers read ahead (before a commit replaces their generation), and the
    copies kept elsewhere (`on_drop`)."""
    with self._lock:
      for j in list(self._ahead):
        self._drop(self._ahead.pop(j))
      self._last = None
    for forget in self._forget:
      forget()

  def close(self) -> None:
    """Ends the reads."""
    self._pool.shutdown(wait=True, cancel_futures=True)
    self._ahead.clear()
