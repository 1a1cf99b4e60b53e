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

The wrapper changes JAX's answer only where JAX's own pairing put a buffer and
an output of different memory kinds together, the pairing that aborts; every
other program (one memory kind, or kinds JAX saw itself, or a pairing that
happened to match) gets JAX's answer as it was. `offlax` installs it on first
use (docs/patches.md): the first `init` or `update` of an `offload`, and
`offload_params`; ``OFFLAX_NO_PATCHES=1`` leaves JAX as it is. If a JAX version
lacks the function (renamed, or fixed), nothing is patched;
``tests/test_donation.py`` runs the patterns that aborted, so such a version is
noticed, and its canary fails once JAX no longer aborts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from offlax._src import patches

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
    call = lambda kinds_in, kinds_out: set_up_aliases(
      input_output_aliases, avals_in, avals_out, donated_args, kinds_in, kinds_out, *args, **kwargs
    )
    unknown = (
      arg_memory_kinds is None
      or result_memory_kinds is None
      or None in arg_memory_kinds
      or None in result_memory_kinds
    )
    if not (unknown and any(donated_args)):  # kinds JAX saw itself, or nothing donated
      return call(arg_memory_kinds, result_memory_kinds)
    kinds_in, kinds_out = _known(arg_memory_kinds, avals_in), _known(result_memory_kinds, avals_out)
    if _HOST not in kinds_in and _HOST not in kinds_out:  # one memory kind
      return call(arg_memory_kinds, result_memory_kinds)
    try:
      result = call(arg_memory_kinds, result_memory_kinds)
    except ValueError:  # layouts of a buffer and an output it was paired with across kinds
      return call(kinds_in, kinds_out)
    aware = call(kinds_in, kinds_out)
    # JAX pairs greedily by (shape, dtype[, kind]): the two pairings differ only
    # where JAX's own paired a buffer with an output in another memory kind,
    # the pairing that aborts. (`result[1]` only decides JAX's "donated buffers
    # were not usable" warning.)
    return result if (aware[0], aware[2]) == (result[0], result[2]) else aware

  return wrapper


def _wrap(original: Callable[..., Any]) -> Callable[..., Any] | None:
  try:
    params = tuple(inspect.signature(original).parameters)
  except (TypeError, ValueError):  # pragma: no cover
    return None
  if params[: len(_PARAMS)] != _PARAMS:  # pragma: no cover - JAX changed it
    return None
  return _aware(original)


PATCH = patches.register(
  patches.Patch(
    name="donation-memory-kinds",
    target="jax._src.interpreters.mlir._set_up_aliases",
    scope="process",
    upstream=(
      "jit without out_shardings pairs donated buffers with outputs by shape and dtype, "
      "across memory kinds (jax/_src/interpreters/mlir.py, _set_up_aliases: its "
      "TODO(yashkatariya) says the decision belongs after memory placement)"
    ),
    versions="jax 0.10.2 (jaxlib 0.10.2)",
    failure=(
      "a jitted step donating offloaded state aborts the process: \"PjRtBuffer's memory "
      "kind does not match sharding's memory kind\" (one device), or fails (a mesh)"
    ),
  )
)


def install() -> bool:
  """Makes JAX pair donated buffers with outputs in the same memory kind; idempotent.

  Returns:
    Whether the pairing is memory-kind aware now (False: ``OFFLAX_NO_PATCHES``
    is set, or this JAX has no function of the expected signature to wrap).
  """
  try:
    from jax._src.interpreters import mlir
  except ImportError:  # pragma: no cover - JAX moved its internals
    return False
  return patches.replace(PATCH, mlir, "_set_up_aliases", _wrap)
