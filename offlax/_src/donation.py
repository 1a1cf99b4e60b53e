"""Donation that respects memory kinds: offlax's fix for a JAX pairing bug.

When a jitted function donates arguments, JAX (0.10) pairs each donated buffer
with an output of the same shape and dtype. It only looks at memory kinds when
the memory kind of *every* argument and *every* output is known, which for an
output needs ``out_shardings``; jits without them (nearly all, and every
trainer's) pair a ``pinned_host`` optimizer-state buffer with a device output of
the same shape, e.g. a param in ``jit(step, donate_argnames="optimizer")`` as
Tunix writes it, and the process aborts at run time ("PjRtBuffer's memory kind
does not match sharding's memory kind"): no Python error, nothing to catch.

Inside ``jit`` JAX types every value with its memory space (``jax.typeof(x)
.memory_space``), so the kinds JAX leaves unknown are known: `install` wraps
JAX's pairing function to fill them in from the types, and JAX's own logic
then pairs host buffers with host outputs and device buffers with device
outputs. A host buffer without a host output of its shape is not reused (JAX
warns that a donated buffer was unusable), as with any unusable donation.

Programs in one memory space are untouched: the wrapper only acts when a
program has a ``pinned_host`` argument or output and JAX could not see the
kinds itself. If a JAX version lacks the function (renamed, or fixed), nothing
is patched; ``tests/test_donation.py`` runs the patterns that aborted, so such
a version is noticed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

# JAX's signature of the function wrapped; another means JAX changed it: leave it.
_PARAMS = (
  "input_output_aliases",
  "avals_in",
  "avals_out",
  "donated_args",
  "arg_memory_kinds",
  "result_memory_kinds",
)
_HOST = "pinned_host"


def _kind_of(aval: Any) -> str:
  """The memory kind JAX's type of a value says it lives in."""
  space = getattr(aval, "memory_space", None)
  return _HOST if space == jax.memory.Space.Host else "device"


def _known(kinds: Sequence[str | None] | None, avals: Sequence[Any]) -> list[str]:
  """`kinds` (from shardings, where given) completed from the values' types."""
  if kinds is None:
    kinds = [None] * len(avals)
  return [k if k is not None else _kind_of(a) for k, a in zip(kinds, avals, strict=True)]


def _aware(set_up_aliases: Callable[..., Any]) -> Callable[..., Any]:
  @functools.wraps(set_up_aliases)
  def wrapper(
    input_output_aliases,
    avals_in,
    avals_out,
    donated_args,
    arg_memory_kinds,
    result_memory_kinds,
    *args,
    **kwargs,
  ):
    unknown = (
      arg_memory_kinds is None
      or result_memory_kinds is None
      or None in arg_memory_kinds
      or None in result_memory_kinds
    )
    if unknown and any(donated_args):
      kinds_in, kinds_out = (
        _known(arg_memory_kinds, avals_in),
        _known(result_memory_kinds, avals_out),
      )
      # Only where host memory takes part: JAX's own pairing is right otherwise.
      if _HOST in kinds_in or _HOST in kinds_out:
        arg_memory_kinds, result_memory_kinds = kinds_in, kinds_out
    return set_up_aliases(
      input_output_aliases,
      avals_in,
      avals_out,
      donated_args,
      arg_memory_kinds,
      result_memory_kinds,
      *args,
      **kwargs,
    )

  wrapper.offlax_memory_kind_aware = True  # type: ignore[attr-defined]
  return wrapper


def install() -> bool:
  """Makes JAX pair donated buffers with outputs in the same memory kind; idempotent.

  Returns:
    Whether the pairing is memory-kind aware now (False: this JAX has no
    function of the expected signature to wrap).
  """
  try:
    from jax._src.interpreters import mlir
  except ImportError:  # pragma: no cover - JAX moved its internals
    return False
  original = getattr(mlir, "_set_up_aliases", None)
  if original is None:  # pragma: no cover - JAX renamed it
    return False
  if getattr(original, "offlax_memory_kind_aware", False):
    return True
  try:
    params = tuple(inspect.signature(original).parameters)
  except (TypeError, ValueError):  # pragma: no cover
    return False
  if params[: len(_PARAMS)] != _PARAMS:  # pragma: no cover - JAX changed it
    return False
  mlir._set_up_aliases = _aware(original)
  return True


INSTALLED = install()
