"""Adam with 8-bit moments: `offlax.adam(..., state_bits=8)` and `offlax.adamw(..., state_bits=8)`.

Each step dequantizes both moments (`quantized.py`) to float32, runs
`optax.scale_by_adam`'s own update on them, and quantizes the new moments
again; the update is computed from the new float32 moments (before they are
rounded to 8 bits), as in bitsandbytes. So the results are, bit for bit,
"dequantize, optax's Adam, quantize". In a jitted step XLA fuses the three into
passes over each leaf; leaves too small to quantize run optax's maths on
their float32 (param-dtype) moments.

The state keeps each moment in two trees shaped like the params, so that
every tier recognises them as per-parameter state (`layout.StateLayout`) and
moves, stores and checkpoints them like optax's moments: the codes (``mu``:
int8, ``nu``: uint8, the param's shape; or the moment itself for a leaf kept
in float) and the block scales (``mu_scale``, ``nu_scale``: float32 of
``ceil(size / 256)`` elements; `optax.MaskedNode` for a leaf kept in float).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import errors, quantized

STATE_BITS = (8, 32)


class ScaleByAdam8bitState(NamedTuple):
  """State of Adam with 8-bit moments.

  Attributes:
    count: the step count, as `optax.ScaleByAdamState.count`.
    mu: per leaf, the first moment's int8 codes, or (a small or non-float
      leaf) the moment itself.
    mu_scale: per leaf, the first moment's float32 block scales, or
      `optax.MaskedNode()` where `mu` holds the moment.
    nu: as `mu`, the second moment (uint8 codes).
    nu_scale: as `mu_scale`, the second moment.
  """

  count: Any  # an int32 jax.Array (Any: NamedTuple.count is a method to mypy)
  mu: Any
  mu_scale: Any
  nu: Any
  nu_scale: Any


def check_state_bits(state_bits: Any, where: str) -> int:
  """`state_bits` (None: 32) if offlax supports it (8 or 32), else `InvalidOptionError`."""
  if state_bits is None:
    return 32
  if isinstance(state_bits, jax.Array | np.ndarray):
    raise errors.InvalidOptionError(
      f"{where}: state_bits must be a Python int (8 or 32), got an array: it chooses the "
      "state's structure. Under optax.inject_hyperparams name it static: "
      "optax.inject_hyperparams(offlax.adam, static_args=('state_bits',))."
    )
  if isinstance(state_bits, bool) or state_bits not in STATE_BITS:
    raise errors.InvalidOptionError(
      f"{where}: state_bits must be 8 (8-bit blockwise-quantized moments) or 32 (float32 "
      f"moments, the default), got {state_bits!r}."
    )
  return int(state_bits)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


class _Pair:
  """Two results of one leaf: a pytree leaf (not a tuple, which a param tree may hold)."""

  __slots__ = ("codes", "scales")

  def __init__(self, codes: Any, scales: Any):
    self.codes, self.scales = codes, scales


def _unzip(pairs: Any) -> tuple[Any, Any]:
  return jax.tree.map(lambda p: p.codes, pairs), jax.tree.map(lambda p: p.scales, pairs)


def _quantize_tree(tree: Any, signed: bool, min_size: int) -> tuple[Any, Any]:
  def one(x):
    if quantized.quantizes(x, min_size):
      return _Pair(*quantized.quantize(x, signed))
    return _Pair(x, optax.MaskedNode())

  return _unzip(jax.tree.map(one, tree))


def _dequantize_tree(codes: Any, scales: Any, signed: bool) -> Any:
  def one(c, s):
    return c if _is_masked(s) else quantized.dequantize(c, s, signed)

  return jax.tree.map(one, codes, scales)


def _requantize_tree(values: Any, scales: Any, signed: bool) -> tuple[Any, Any]:
  """`values` quantized where `scales` (the old state's) says the leaf is quantized."""

  def one(v, s):
    return _Pair(v, s) if _is_masked(s) else _Pair(*quantized.quantize(v, signed))

  return _unzip(jax.tree.map(one, values, scales))


def mismatch(state: Any, state_bits: int, where: str) -> errors.TreeMismatchError | None:
  """The error for a state of the other bit width (an 8-bit state given to a 32-bit Adam, ...)."""
  eight = isinstance(state, ScaleByAdam8bitState)
  if eight == (state_bits == 8):
    return None
  got = "an 8-bit Adam state (state_bits=8)" if eight else f"a {type(state).__name__}"
  return errors.TreeMismatchError(
    f"{where} (state_bits={state_bits}) got {got}: a state lives with the optimizer that "
    f"made it. Build the optimizer with state_bits={8 if eight else 32} to use this state "
    "(or restore a checkpoint into the abstract state of that optimizer)."
  )


def block_scales(state: Any) -> list[bool]:
  """Per leaf of `state` (in `jax.tree.leaves` order): whether it is a moment's block scales.

  The leaves of every `ScaleByAdam8bitState`'s ``mu_scale`` and ``nu_scale`` (a leaf kept in
  float has none: `optax.MaskedNode`); their codes are shaped like the params, the scales not.

  Example:
    >>> import jax.numpy as jnp
    >>> state = scale_by_adam_8bit().init({"w": jnp.zeros(5000), "b": jnp.zeros(3)})
    >>> block_scales(state)  # count, mu (b, w), mu_scale (w), nu (b, w), nu_scale (w)
    [False, False, False, True, False, False, True]
  """
  is_8 = lambda x: isinstance(x, ScaleByAdam8bitState)

  def mark(node):
    if not is_8(node):
      return False
    as_ = lambda tree, scales: jax.tree.map(lambda _: scales, tree)
    return ScaleByAdam8bitState(
      as_(node.count, False),
      as_(node.mu, False),
      as_(node.mu_scale, True),
      as_(node.nu, False),
      as_(node.nu_scale, True),
    )

  return jax.tree.leaves(jax.tree.map(mark, state, is_leaf=is_8))


def bits_hint(saved: Iterable[str], target: Iterable[str]) -> str:
  """A sentence for a restore whose saved state and target differ in `state_bits`, else ''.

  Args:
    saved: the saved state's leaf paths (`jax.tree_util.keystr`) or structure.
    target: the target's.

  Returns:
    The sentence, with a leading space, or ''.
  """
  eight = lambda texts: any("mu_scale" in t or "ScaleByAdam8bitState" in t for t in texts)
  saved_8, target_8 = eight(saved), eight(target)
  if saved_8 == target_8:
    return ""
  bits = lambda is_8: "an 8-bit Adam state (state_bits=8)" if is_8 else "a 32-bit Adam state"
  return (
    f" The checkpoint holds {bits(saved_8)} and the target is {bits(target_8)}: build the "
    f"optimizer with state_bits={8 if saved_8 else 32} to restore it."
  )


def scale_by_adam_8bit(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  *,
  nesterov: bool = False,
  min_size: int = quantized.MIN_SIZE,
) -> optax.GradientTransformation:
  """`optax.scale_by_adam` with its moments stored in 8 bits (blockwise, `quantized.py`).

  Args:
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator.
    eps_root: added inside the square root.
    nesterov: Nesterov momentum, as in optax.
    min_size: leaves of fewer elements keep float moments.

  Returns:
    A transformation whose state is a `ScaleByAdam8bitState`.

  Example:
    >>> import jax.numpy as jnp
    >>> from offlax._src.adam8 import scale_by_adam_8bit
    >>> tx = scale_by_adam_8bit()
    >>> state = tx.init({"w": jnp.zeros(5000), "b": jnp.zeros(3)})
    >>> state.mu["w"].dtype, state.nu["w"].dtype, state.mu_scale["w"].shape, state.mu["b"].dtype
    (dtype('int8'), dtype('uint8'), (20,), dtype('float32'))
  """
  inner = optax.scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov)

  def init_fn(params):
    state = inner.init(params)
    mu, mu_scale = _quantize_tree(state.mu, True, min_size)
    nu, nu_scale = _quantize_tree(state.nu, False, min_size)
    return ScaleByAdam8bitState(state.count, mu, mu_scale, nu, nu_scale)

  def update_fn(updates, state, params=None):
    if (error := mismatch(state, 8, "offlax.adam/adamw update")) is not None:
      raise error
    mu = _dequantize_tree(state.mu, state.mu_scale, True)
    nu = _dequantize_tree(state.nu, state.nu_scale, False)
    # optax's own update on the float32 moments: its maths, bit for bit.
    out, new = inner.update(updates, optax.ScaleByAdamState(state.count, mu, nu), params)
    # The update in the gradient's dtype, as optax returns it for a state of the params' dtype.
    out = jax.tree.map(
      lambda u, g, s: u if _is_masked(s) else u.astype(jnp.result_type(g)),
      out,
      updates,
      state.mu_scale,
    )
    mu, mu_scale = _requantize_tree(new.mu, state.mu_scale, True)
    nu, nu_scale = _requantize_tree(new.nu, state.nu_scale, False)
    return out, ScaleByAdam8bitState(new.count, mu, mu_scale, nu, nu_scale)

  return optax.GradientTransformation(init_fn, update_fn)


def adam_8bit(
  learning_rate: optax.ScalarOrSchedule,
  betas: tuple[float, float, float, float],
  weight_decay: Any = None,
  mask: Any = None,
  *,
  nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """`optax.adam` (`weight_decay` None) or `optax.adamw`, on `scale_by_adam_8bit`: optax's chain.

  Args:
    learning_rate: a float or an optax schedule.
    betas: ``(b1, b2, eps, eps_root)``.
    weight_decay: None for Adam, else AdamW's decoupled decay.
    mask: AdamW's mask.
    nesterov: Nesterov momentum.

  Returns:
    The chain, as optax builds `adam`/`adamw` around `scale_by_adam`.
  """
  b1, b2, eps, eps_root = betas
  adam = scale_by_adam_8bit(b1, b2, eps, eps_root, nesterov=nesterov)
  if weight_decay is None:
    return optax.chain(adam, optax.scale_by_learning_rate(learning_rate))
  return optax.chain(
    adam,
    optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )
