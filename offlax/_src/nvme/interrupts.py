"""Ctrl-C during a step whose callbacks run in the calling thread: held until the call returns.

On XLA:CPU a step's callbacks may run in the thread that called the step, the
main thread, where Python raises `KeyboardInterrupt`. Raised inside a callback it
fails the step (as a `JaxRuntimeError`, which `except KeyboardInterrupt` misses),
possibly after its commit, losing its result. Raised between the callbacks or in
JAX's dispatch code, it loses the result as well. So a Ctrl-C that comes while a
callback runs is held back until the call of the step has returned to the code
that made it, and raised at that code's next line: the line that called the step
has assigned its result, and the store and the state held agree.

The moment is found by a trace function of the caller's frame (`sys.settrace`,
the means of `pdb`), installed only while an interrupt is held, not by a delay: a
delay long enough on an idle machine is too short on a busy one. Where a tracer is
installed already (a debugger, coverage), the interrupt is raised once the main
thread is seen outside the call.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

# Frames of these packages are a step's dispatch or its callbacks, not the caller's code.
_LIBRARY = ("jax", "jaxlib", "offlax", "flax")

# The poll of the fallback (a tracer is installed): a check of one stack, no delay.
_POLL_S = 0.002

_held: _Hold | None = None


@contextlib.contextmanager
def deferred():
  """Around a callback of the step: a Ctrl-C meanwhile is held (main thread only).

  Only Python's own SIGINT handler is replaced: a program's own handler is left
  to see the signal as it was.
  """
  if (
    threading.current_thread() is not threading.main_thread()
    or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
  ):
    yield
    return
  previous = signal.signal(signal.SIGINT, _hold)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _library(frame: FrameType) -> bool:
  name = frame.f_globals.get("__name__") or ""
  return name.split(".", 1)[0] in _LIBRARY


def _caller(frame: FrameType | None) -> FrameType | None:
  """The frame that called the step: the first outside JAX's frames around the callback.

  Inside them lie the callback's own frames (offlax's, or a test's replacement of
  one), so the search starts once a JAX frame has been passed.
  """
  seen_jax = False
  while frame is not None:
    if _library(frame):
      name = frame.f_globals.get("__name__") or ""
      seen_jax = seen_jax or name.split(".", 1)[0] in ("jax", "jaxlib")
    elif seen_jax:
      return frame
    frame = frame.f_back
  return None


def _hold(signum: int, frame: Any) -> None:
  """The SIGINT handler inside a callback: holds the interrupt until the step's call returns."""
  global _held
  if _held is not None:  # one held already: the same Ctrl-C, or a second while the step runs
    return
  caller = _caller(frame)
  if caller is None:  # not a step's callback after all: as Python would
    raise KeyboardInterrupt
  _held = _Hold(caller)
  if sys.gettrace() is None:
    _held.trace(caller)
    sys.settrace(_held.calls)
  else:
    threading.Thread(target=_held.poll, name="offlax-interrupt", daemon=True).start()


class _Hold:
  """A held Ctrl-C: raised at the caller's next line, once the step's call has returned.

  `caller` is the frame that called the step; `lasti` the instruction of that call.
  Only the caller's frame is traced: a line event there comes after the line that
  called the step has run to its end (in a loop, at the jump back too). Frames
  called meanwhile (the step's callbacks, finalizers) are not traced. If the caller
  returns first, the hold goes on in the frame it returns to.
  """

  def __init__(self, caller: FrameType):
    self.caller, self.lasti = caller, caller.f_lasti

  def calls(self, frame: FrameType, event: str, arg: Any) -> None:
    """The thread's trace function: traces no frame called while the interrupt is held."""
    return None

  def trace(self, frame: FrameType) -> None:
    self.caller = frame
    frame.f_trace_lines = True
    frame.f_trace = self.lines

  def lines(self, frame: FrameType, event: str, arg: Any) -> Any:
    """The caller's trace function."""
    if frame is not self.caller:
      return None
    if event == "line":
      frame.f_trace = None
      self._release()
      raise KeyboardInterrupt
    if event == "return":
      frame.f_trace = None
      if frame.f_back is None:  # the program's end: nothing left to lose
        self._release()
        raise KeyboardInterrupt
      self.trace(frame.f_back)
    return self.lines

  def _release(self) -> None:
    global _held
    sys.settrace(None)
    _held = None

  def poll(self) -> None:
    """The fallback beside a tracer: waits until the main thread has left the call."""
    global _held
    main = threading.main_thread().ident
    while True:
      frame = sys._current_frames().get(main)  # type: ignore[arg-type]
      stack = []
      while frame is not None:
        stack.append(frame)
        frame = frame.f_back
      if self.caller not in stack or self.caller.f_lasti != self.lasti:
        break
      time.sleep(_POLL_S)
    _held = None
    _thread.interrupt_main()
