"""A global-norm clip over the whole model: layers in a `LayerStore`, the rest on the device.

``offlax.clip_by_global_norm(c, store=store)`` is the first element of the
rest's optax chain (embedding, head, final norm), the store's optimizer
``optax.chain(optax.clip_by_global_norm(c), tx)``. Both then clip by one norm,
that of every gradient of the model, as one ``optax.chain(clip, tx)`` over the
model in memory does:

1. Inside the jitted step, the rest's update sums its gradients' squares in
   float32 (`optax.tree.norm` of them cast) and hands the sum to the host by a
   callback whose operands are the layers' token gradients too: each depends on
   its layer's hand-off to the store, so the callback runs after the last one.
2. On the host (`WholeNorm.arrive`) the layers' sums of squares are known (the
   explicit mode's gradient writes waited for; ``update="backward"``: the
   worker's kept gradients), the whole norm is `clip.global_norm` of both (the
   layers' leaves, then the rest), and it goes back to the device, where the rest's
   gradients are scaled by optax's own expression.
3. The store's clip takes the same norm for the same step: `update()` in the
   explicit mode, the speculation's validation in the backward mode (`speculate`).
   A step whose rest's part never came is refused (`IncompleteStepError`).

The norm is a few float32 roundings from XLA's, another order of the sums that no
store can follow: XLA sums a stacked leaf in one reduction over its layers, in an
order of its own, where the layers' gradients reach the host one by one, last
first. Given the norm, layers and rest are optax's to the bit, Adam's too (the
clip's expression and the tail's update round alike in the store's program of a
leaf and in one program of the whole tree).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import errors, host_callbacks
from offlax._src.layer_store import clip as clip_lib

TOKEN = "_offlax_token"  # a stored NNX layer's token attribute (`nnx_layer_store` uses it)


class WholeNormState(NamedTuple):
  """The state of `clip_by_global_norm(c, store=)`.

  Attributes:
    norm: the whole model's gradient norm its last update clipped by, float32 (0 before).
  """

  norm: jax.Array


class WholeNorm:
  """The host's side of a whole-model clip: one step's norm, for the store and the rest.

  Args:
    max_norm: the clip's ``max_norm`` (the store's).
    records: the store's param records.
    path: the store's directory (for errors).
    layer_squares: the layers' sums of squares of the step, float32 [layer, leaf], waited
      for (`step.LayerStep.layer_squares`, `speculate.Speculation.layer_squares`).
  """

  def __init__(self, max_norm: Any, records: list[dict], path: str,
               layer_squares: Callable[[], np.ndarray]):  # fmt: skip
    self.max_norm, self._records, self._path = max_norm, records, path
    self._layer_squares = layer_squares
    self._cond = threading.Condition()
    self._norm: clip_lib.GlobalNorm | None = None
    self._missing: Exception | None = None  # the step ended without the rest's part (`end`)

  def arrive(self, rest: np.ndarray, dtype: Any) -> np.ndarray:
    """The callback: the rest's sum of squares `rest`; returns the whole norm (`dtype`)."""
    squares = self._layer_squares()
    norm = clip_lib.global_norm(squares, self._records, self.max_norm, rest, dtype)
    with self._cond:
      self._norm = norm
      self._cond.notify_all()
    return np.asarray(norm.norm)

  def end(self, step: int) -> None:
    """`update()`, its step's programs run (waited for): a rest's part not come never will,
    and the norm's waits (`wait`, `take`) raise `IncompleteStepError`."""
    with self._cond:
      if self._norm is None:
        self._missing = missing(self._path, step)
        self._cond.notify_all()

  def take(self, step: int) -> clip_lib.GlobalNorm:
    """The whole norm of `step` (explicit `update()`), or `IncompleteStepError`."""
    norm = self._norm
    if norm is None:
      raise missing(self._path, step)
    return norm

  def wait(self, abort: Callable[[], None]) -> clip_lib.GlobalNorm:
    """The whole norm, waited for (the backward mode's worker); `abort` raises to stop, and
    so does a step ended without it (`end`)."""
    with self._cond:
      while self._norm is None:
        abort()
        if self._missing is not None:
          raise self._missing
        self._cond.wait(0.05)
      return self._norm

  def clear(self) -> None:
    """Forgets the norm (a step committed, or a new one begun)."""
    with self._cond:
      self._norm, self._missing = None, None


def missing(path: str, step: int) -> errors.IncompleteStepError:
  """The error of a step whose rest's part never reached the store."""
  return errors.IncompleteStepError(
    f"LayerStore.update: step {step} of {path} clips by the whole model's norm "
    "(offlax.clip_by_global_norm(c, store=store) in the rest's optimizer), and the rest's "
    "part of it never came: the rest's optimizer was not applied after the backward pass. "
    "Nothing was committed. Apply it, tx.update(rest_grads, state, rest, "
    "layer_grads=source_grads), then store.update(rest=...): to this step's gradients with "
    "update='explicit' (the layers' are still on disk); with update='backward' the step was "
    "dropped: run it again, the rest's update with it."
  )


def part_of(update: Any) -> Any:
  """The part of a store's step (`LayerStore._update`) that runs its clip: a `step.LayerStep`,
  or a `backward.BackwardStep`'s `speculate.Speculation`."""
  return getattr(update, "spec", update)


def attach(store: Any, part: Any, max_norm: Any) -> WholeNorm:
  """The store's `WholeNorm` for `max_norm`, made once into its step's `part` (`step.LayerStep`,
  `speculate.Speculation`: ``whole``, ``layer_squares``); `InvalidOptionError` where its
  optimizer has no leading clip, or one of another ``max_norm``."""
  have = None if store.optimizer is None else clip_lib.split(store.optimizer).max_norm
  if have is None:
    raise errors.InvalidOptionError(
      f"offlax.clip_by_global_norm(store=): the store at {store.path} has "
      + ("no optimizer" if store.optimizer is None else "no global-norm clip in its optimizer")
      + ", so its layers would not be clipped by the whole norm: open or create it with "
      f"optimizer=optax.chain(optax.clip_by_global_norm({max_norm!r}), tx)."
    )
  if not np.array_equal(np.asarray(have), np.asarray(max_norm)):
    raise errors.InvalidOptionError(
      f"offlax.clip_by_global_norm(store=): max_norm={max_norm!r}, and the store at "
      f"{store.path} clips to max_norm={have!r}: one norm clips the whole model, to one "
      "bound. Pass the store's max_norm, or open the store with the clip you mean."
    )
  if part.whole is None:
    part.whole = WholeNorm(have, store.records, store.path, part.layer_squares)
  return part.whole


def clip_by_global_norm(max_norm: Any, *, store: Any) -> optax.GradientTransformationExtraArgs:
  """optax's ``clip_by_global_norm`` over the whole model, its layers in `store`.

  The first element of the rest's chain: ``optax.chain(offlax.clip_by_global_norm(c,
  store=store), tx)``, the store made with ``optax.chain(optax.clip_by_global_norm(c), tx)``.
  The rest's gradients and the layers' are clipped by the norm of all of them (module
  docstring). Its update needs the layers' token gradients, which order it after the
  hand-offs: in the gradients (an NNX model of `offload_params(store=)`: its `LayerToken`s),
  or as ``layer_grads=`` (the gradient of ``store.source()``).

  Args:
    max_norm: the clip's bound, the store's clip's.
    store: the `LayerStore` of the model's layers.

  Returns:
    An optax transformation (extra args: ``layer_grads``), its state `WholeNormState`.

  Raises:
    InvalidOptionError: the store has no clip, or one of another ``max_norm``; at trace
      time, the update got none of the layers' token gradients.
  """
  whole = store.whole_norm(max_norm)

  def init_fn(params: Any) -> WholeNormState:
    del params
    return WholeNormState(jnp.zeros((), jnp.float32))

  def update_fn(updates: Any, state: WholeNormState, params: Any = None, *,
                layer_grads: Any = None, **extra: Any) -> tuple[Any, WholeNormState]:  # fmt: skip
    del params, extra
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    rest = [x for key, x in flat if not is_token(key)]
    tokens = [x for key, x in flat if is_token(key)] + jax.tree.leaves(layer_grads)
    _check_tokens(tokens, store)
    wide = [x.astype(jnp.complex64 if jnp.iscomplexobj(x) else jnp.float32) for x in rest]
    squares = optax.tree.norm(wide, squared=True)
    reals = [np.empty(0, x.dtype).real.dtype for x in rest]  # optax's norm's dtype
    dtype = jnp.result_type(*reals, clip_lib.norm_dtype(store.records))
    [norm] = host_callbacks.call(
      lambda s, *_: whole.arrive(s, dtype), [jax.ShapeDtypeStruct((), dtype)], squares, *tokens,
      side_effect=True,
    )  # fmt: skip
    trigger = norm < max_norm

    def clip_fn(t):  # optax's expression
      return jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

    leaves = [clip_fn(x) for _, x in flat]
    return jax.tree.unflatten(treedef, leaves), WholeNormState(norm.astype(jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def is_token(key: Any) -> bool:
  """Whether a leaf's key path is a stored NNX layer's token's."""
  return any(getattr(k, "key", getattr(k, "name", None)) == TOKEN for k in key)


def _check_tokens(tokens: list[Any], store: Any) -> None:
  """Refuses an update that does not depend on every layer's hand-off (trace time)."""
  count = sum(int(np.prod(np.shape(t))) for t in tokens)
  if count < store.n_layers:
    raise errors.InvalidOptionError(
      "offlax.clip_by_global_norm(store=): the update got the token gradients of "
      f"{count} of the store's {store.n_layers} layers ({store.path}); it needs them all, so "
      "that it runs after every layer's gradient reached the store. Pass the gradient of "
      "store.source() as layer_grads= (tx.update(rest_grads, state, rest, "
      "layer_grads=source_grads)); an NNX model of offload_params(store=) has them in its "
      "gradients (differentiate with respect to every nnx.Param)."
    )
