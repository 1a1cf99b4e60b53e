"""A leading `optax.clip_by_global_norm` in a `LayerStore`'s optimizer (`split`, `GlobalNorm`).

A global-norm clip is not elementwise: every gradient's scale depends on the
norm over all of them, known only once the last layer's gradient is. The
store runs it in two parts. The rest of the chain (``tail``; the clip's
stateless slot dropped, so the state stored is the tail's) is elementwise and runs
a layer at a time as before; the norm is summed on the host as the gradients
pass there (`sum_squares`, float32 per leaf per layer, `GlobalNorm`), and where
the clip applies each gradient is scaled by optax's own expression
(`scale_gradient`) before the tail's update.

The clip is recognised, not guessed: the chain's and the clip's update
functions are compared, code object for code object, with those the installed
optax makes (`_optax_codes`), and their closures read by name (the same code
has the same free variables, so a match always has them). Anything else, a
clip elsewhere in the chain, inside `offlax.master_weights`, in a nested chain
or `optax.named_chain`, or a clip of one's own, is not taken apart: the
elementwise check then refuses it, naming the form that is (`not_recognised`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import errors

CHUNK = 1 << 20  # elements a `sum_squares` dot takes at once


@functools.cache
def _optax_codes() -> tuple[Any, Any, Any, Any]:
  """What optax's own chain (update, init), clip and extra-args wrapper are made of."""
  clip = optax.clip_by_global_norm(1.0)
  chain = optax.chain(clip)
  return (
    chain.update.__code__,
    clip.update.__code__,
    optax.with_extra_args_support(clip).update.__code__,
    chain.init.__code__,
  )


HOW = (
  "give the clip as the first element of a flat optax.chain: "
  "optimizer=optax.chain(optax.clip_by_global_norm(c), tx), tx elementwise (e.g. "
  "offlax.master_weights(offlax.adamw(1e-3)))"
)


class Split(NamedTuple):
  """An optimizer split at its leading clip (`split`).

  Attributes:
    tail: the chain without the clip, its state the rest's alone (the clip has none): for
      ``optax.chain(clip, tx)``, `tx`'s update and state, so a store made with `tx` opens
      with the clip added, and back.
    max_norm: the clip's ``max_norm``, as given to optax (None: no clip).
  """

  tail: Any
  max_norm: Any


def _free(fn: Any, name: str) -> Any:
  """The value of the free variable `name` of the closure `fn`."""
  return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def _clip_of(update: Any) -> Any:
  """The ``max_norm`` of `update` if it is optax's clip_by_global_norm (or it wrapped for extra
  args), else None."""
  _, clip, extra_args, _ = _optax_codes()
  code = getattr(update, "__code__", None)
  if code is extra_args:
    update = _free(update, "tx").update
    code = getattr(update, "__code__", None)
  return _free(update, "max_norm") if code is clip else None


def split(optimizer: Any) -> Split:
  """`optimizer` as its leading global-norm clip and the rest of the chain.

  Args:
    optimizer: an optax `GradientTransformation`.

  Returns:
    ``Split(tail, max_norm)``: for ``optax.chain(optax.clip_by_global_norm(c), *rest)``,
    ``optax.chain(*rest)`` (``rest[0]`` itself where it is alone) and ``c``; for any other
    optimizer, the optimizer itself and None.
  """
  update, init = optimizer.update, optimizer.init
  codes = _optax_codes()
  if (
    getattr(update, "__code__", None) is not codes[0]
    or getattr(init, "__code__", None) is not codes[3]
  ):
    return Split(optimizer, None)
  update_fns, init_fns = _free(update, "update_fns"), _free(init, "init_fns")
  max_norm = _clip_of(update_fns[0]) if update_fns else None
  if max_norm is None:
    return Split(optimizer, None)
  inits, updates = init_fns[1:], update_fns[1:]
  if len(updates) == 1:  # the usual chain(clip, tx): tx's own state, tree for tree
    return Split(optax.GradientTransformationExtraArgs(inits[0], updates[0]), max_norm)

  def tail_init(params):
    return tuple(fn(params) for fn in inits)

  def tail_update(grads, state, params=None, **extra_args):
    new_state = []
    for s, fn in zip(state, updates, strict=True):
      grads, s = fn(grads, s, params, **extra_args)
      new_state.append(s)
    return grads, tuple(new_state)

  return Split(optax.GradientTransformationExtraArgs(tail_init, tail_update), max_norm)


def state_init(optimizer: Any) -> Any:
  """The ``init`` of the state a store keeps for `optimizer`: its `split` tail's (a leading
  clip has no state)."""
  return split(optimizer).tail.init


def sum_squares(x: np.ndarray) -> np.float32:
  """The sum of the squares of `x`'s elements, in float32 (a gradient slot of one layer).

  float32 whatever `x`'s dtype: a bf16 sum over a layer's millions of elements would lose
  the norm. A BLAS dot per `CHUNK` elements, converted to float32 a chunk at a time (RAM: 4
  MiB, not a float32 copy of the leaf), the chunks' sums added in order: deterministic.
  """
  flat = np.ascontiguousarray(x).reshape(-1)
  wide = np.complex64 if np.iscomplexobj(flat) else np.float32  # |x|^2, as optax's `_square`
  total = np.float32(0)
  for start in range(0, flat.size, CHUNK):
    part = flat[start : start + CHUNK].astype(wide, copy=False)
    total = np.float32(total + np.vdot(part, part).real)
  return total


def norm_dtype(records: list[dict]) -> np.dtype:
  """The dtype optax's norm of the gradients has: that of the sum of their leaves' sums of
  squares (each real: a complex64 leaf's is float32)."""
  reals = [np.empty(0, np.dtype(r["dtype"])).real.dtype for r in records]
  return np.dtype(jnp.result_type(*reals))


class GlobalNorm(NamedTuple):
  """The global norm of a step's gradients, as optax's clip sees it.

  Attributes:
    norm: the norm, a 0-d array of optax's dtype (`norm_dtype`).
    applies: whether the clip scales the gradients (optax: ``not norm < max_norm``, so a
      NaN norm applies, and gives NaNs as optax does).
  """

  norm: np.ndarray
  applies: bool


def global_norm(squares: np.ndarray, records: list[dict], max_norm: Any, rest: Any = None,
                dtype: Any = None) -> GlobalNorm:  # fmt: skip
  """The norm from `squares` (float32, [layer, leaf]), as optax's `clip_by_global_norm`.

  optax sums each leaf's squares, adds the leaves' sums in their dtype and takes the root
  (`optax.tree.norm`); here each leaf's layers are added in float32 first, then the leaves in
  tree order, then `rest` (the rest of the model's sum, `whole_norm`), the total cast to that
  dtype before the root, as optax's would be.

  Args:
    squares: the sum of squares of each layer's gradient leaf (`sum_squares`).
    records: the store's param records (the leaves' dtypes).
    max_norm: the clip's ``max_norm``.
    rest: the float32 sum of squares of the rest of the model's gradients, or None.
    dtype: the norm's dtype (with `rest`: the whole model's); None: `norm_dtype(records)`.

  Returns:
    The `GlobalNorm`.
  """
  per_leaf = np.asarray(np.sum(squares, axis=0, dtype=np.float32))
  total = np.float32(0)
  for s in per_leaf:  # the leaves in tree order, as optax's tree sum
    total = np.float32(total + s)
  if rest is not None:
    total = np.float32(total + np.float32(rest))
  dtype = norm_dtype(records) if dtype is None else np.dtype(dtype)
  with jax.default_device(jax.devices("cpu")[0]):
    norm = jnp.sqrt(jnp.asarray(total).astype(dtype))
    applies = not bool(norm < max_norm)
  return GlobalNorm(np.asarray(norm), applies)


def scale_gradient(g: Any, norm: Any, max_norm: Any) -> Any:
  """`g` clipped, where the clip applies: optax's expression, ``(g / norm) * max_norm``, in
  `g`'s dtype (traced inside the jitted leaf update).

  Under optax's own ``select`` on ``norm < max_norm`` too (False where this runs): XLA
  simplifies a bare ``(g / norm) * max_norm`` into other roundings than optax's chain has.
  """
  return jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


def not_recognised(path: str, why: str) -> errors.InvalidOptionError:
  """The error for an optimizer that couples a leaf's elements (`step.check_elementwise`)."""
  return errors.InvalidOptionError(
    f"LayerStore: the optimizer's update of leaf {path} is not elementwise ({why}), so "
    "applying it a layer at a time would change it. Use an elementwise optimizer (Adam, "
    "AdamW, SGD, Lion, offlax.master_weights of them). For a global-norm clip, " + HOW + ": the "
    "store sums the norm as the gradients reach the host and scales them as optax does."
  )
