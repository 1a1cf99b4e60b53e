"""`adam` and `adamw`: optax's, with the moments updated by one native pass on the CPU.

The host step of Adam is memory-bound. XLA:CPU compiles `optax.adam` into one
loop per moment and one for the update (fused with `optax.apply_updates`):
40 bytes of traffic per fp32 parameter. These factories return
transformations with optax's state and results, bit for bit, whose moments
are updated, for each float32 leaf of an XLA:CPU program, by a small C++
kernel (`native/adam.cc`, called through the XLA FFI on XLA's intra-op
threads) that reads the gradient and both moments once and writes the moments
in place: 36 bytes. The update stays in JAX, in optax's expressions, so that
XLA fuses it into `apply_updates` and rounds it as it rounds optax's program.

With `native_update=True` the kernel writes the update too (24 bytes): the
host's share of a step whose update leaves the host (`HostTier(compute="host")`).

The whole step in one pass (`offlax.update_and_apply`, and
`offlax.master_weights` around these factories): the kernel reads the
gradient (float32 or bfloat16), both moments and the param (or its fp32
master) and writes them back in place, and with a master also the new
low-precision param (`update_and_apply`: 28 bytes per bf16 param, against 34
for DeepSpeedCPUAdam on the master plus the copy into the bf16 param) or its
exact fp32 update (`update`). Its update is optax's expression as written:
bit-identical to optax when XLA evaluates as written, to rounding under XLA's
defaults (tests/test_host_adam.py states the tolerances).

Threads: each call splits its arrays into 256 KiB chunks shared by the calling
thread and XLA:CPU's intra-op pool (one thread per core the process may run
on), or offlax's own pool of as many where XLA gives a call fewer than two
threads (a GPU program's host computation ran at one core's speed);
``OFFLAX_NATIVE_THREADS=n`` caps them (e.g. to leave cores to a data loader),
``OFFLAX_NATIVE_POOL=xla|own`` forces a pool, ``OFFLAX_NATIVE_DEBUG=1`` says
on stderr which one a call used.

On other platforms (a GPU program outside its host computation, which JAX
lowers for the CPU) and for leaves the kernel does not cover, the same
arithmetic runs as plain JAX, or optax itself runs. The
kernel is compiled with the system C++ compiler on first use and cached
(`ffi.py`); if that fails, or `OFFLAX_NATIVE=0`, plain JAX runs everywhere,
with the same results.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from offlax._src import adam8, errors, ffi, host_adam8
from offlax._src import apply as apply_lib
from offlax._src.adam_maths import (  # noqa: F401 (OUT_*, Hyper, step_hyper: this module's API too)
  OUT_DELTA,
  OUT_NONE,
  OUT_PARAM,
  Hyper,
  adam_leaf,
  step_hyper,
)
from offlax._src.adam_maths import moments as _moments
from offlax._src.adam_maths import placeholder as _placeholder

_TARGET = "offlax_adam_f32"
_MOMENTS = "offlax_adam_moments_f32"
_WHOLE_STEP = "offlax_adam_step"

_STEP_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  mu_dtype: Any = None,
  *,
  nesterov: bool = False,
  native_update: bool = False,
  state_bits: int | None = None,
) -> AdamTransformation:
  """`optax.adam`, with the moments updated by one native pass on XLA:CPU.

  Same arguments, state and results (bit for bit) as `optax.adam`. In an
  XLA:CPU program the moments of each float32 leaf are updated in place by a
  C++ kernel (an XLA FFI call, built with the system compiler on first use and
  cached in ``$OFFLAX_CACHE_DIR``, default ``~/.cache/offlax``;
  ``OFFLAX_NATIVE=0`` turns it off); the update is computed as optax computes
  it, so XLA fuses it into `optax.apply_updates`. Elsewhere (a GPU program,
  other dtypes) plain JAX or optax itself runs. Use it as the inner
  transformation of `offload(..., HostTier(compute="host"))`, or anywhere
  `optax.adam` goes.

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator.
    eps_root: added inside the square root.
    mu_dtype: dtype of the first moment; anything but None or float32 runs
      `optax.adam` itself.
    nesterov: Nesterov momentum; True runs `optax.adam` itself.
    native_update: the kernel writes the update too, in the same pass over
      memory as the moments (24 bytes per parameter instead of 32 for a step
      whose update is written out). Meant for ``HostTier(compute="host")``,
      where the update is written out to cross back to the device anyway (the
      host's share of a ZeRO-Offload step). The moments stay bit-identical to
      optax's; the update agrees with optax's to 2e-6 relative, since XLA
      rounds optax's update in a form that depends on the program around it.
    state_bits: 32 (or None: float32 moments, optax's state) or 8: both moments
      stored blockwise-quantized in one byte an element (docs/state_bits.md;
      `adam8.py`), updated as "dequantize, optax's Adam, quantize"; leaves
      of fewer than 4096 elements keep float32 moments.

  Returns:
    An `AdamTransformation` (an `optax.GradientTransformationExtraArgs`, with
    a fused `update_and_apply`) with `optax.adam`'s state.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> params = {"w": jnp.linspace(-1.0, 1.0, 5)}
    >>> grads = {"w": jnp.full(5, 0.5)}
    >>> tx, ref = offlax.adam(1e-2), optax.adam(1e-2)
    >>> u, _ = jax.jit(tx.update)(grads, tx.init(params))
    >>> r, _ = jax.jit(ref.update)(grads, ref.init(params))
    >>> bool((u["w"] == r["w"]).all())
    True
  """
  if adam8.check_state_bits(state_bits, "offlax.adam") == 8:
    return _eight_bit("offlax.adam", learning_rate, (b1, b2, eps, eps_root), mu_dtype, nesterov)
  reference = optax.adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)
  return _fused(
    reference, learning_rate, (b1, b2, eps, eps_root), None, None, nesterov, mu_dtype, native_update
  )


def adamw(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  mu_dtype: Any = None,
  weight_decay: float = 1e-4,
  mask: Any = None,
  *,
  nesterov: bool = False,
  native_update: bool = False,
  state_bits: int | None = None,
) -> AdamTransformation:
  """`optax.adamw`, with the moments updated by one native pass on XLA:CPU.

  Same arguments, state and results (bit for bit) as `optax.adamw`; see `adam`.
  A `weight_decay` schedule, or a `mask` that is not a tree of Python bools
  shaped like the params (after calling it, if callable), runs `optax.adamw`
  itself.

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator.
    eps_root: added inside the square root.
    mu_dtype: dtype of the first moment (see `adam`).
    weight_decay: decoupled weight decay.
    mask: which leaves are decayed, as in `optax.adamw`.
    nesterov: Nesterov momentum; True runs `optax.adamw` itself.
    native_update: the kernel writes the update too (see `adam`).
    state_bits: 32 or 8 (see `adam`).

  Returns:
    An `AdamTransformation` (an `optax.GradientTransformationExtraArgs`, with
    a fused `update_and_apply`) with `optax.adamw`'s state;
    `update` requires `params`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, offlax
    >>> params = {"w": jnp.linspace(-1.0, 1.0, 5), "b": jnp.ones(2)}
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> mask = {"w": True, "b": False}
    >>> tx, ref = offlax.adamw(1e-2, mask=mask), optax.adamw(1e-2, mask=mask)
    >>> u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    >>> r, _ = jax.jit(ref.update)(grads, ref.init(params), params)
    >>> all(bool((u[k] == r[k]).all()) for k in params)
    True
  """
  if adam8.check_state_bits(state_bits, "offlax.adamw") == 8:
    betas = (b1, b2, eps, eps_root)
    return _eight_bit("offlax.adamw", learning_rate, betas, mu_dtype, nesterov, weight_decay, mask)
  reference = optax.adamw(
    learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=nesterov
  )
  return _fused(
    reference,
    learning_rate,
    (b1, b2, eps, eps_root),
    weight_decay,
    mask,
    nesterov,
    mu_dtype,
    native_update,
  )


def _eight_bit(where, learning_rate, betas, mu_dtype, nesterov, weight_decay=None, mask=None):
  """`adam`/`adamw` with 8-bit moments (`adam8.py`), with the native step on XLA:CPU.

  optax's chain around `scale_by_adam_8bit`; where the native library runs
  (`host_adam8.py`), each step's leaves run its kernels instead, with the
  chain's results.
  """
  if mu_dtype is not None and jnp.dtype(mu_dtype) != jnp.float32:
    raise errors.InvalidOptionError(
      f"{where}: mu_dtype={mu_dtype!r} does not go with state_bits=8 (the first moment is "
      "stored in 8 bits, computed in float32); leave mu_dtype unset."
    )
  tx = adam8.adam_8bit(learning_rate, betas, weight_decay, mask, nesterov=nesterov)
  decays = weight_decay is not None and not (
    isinstance(weight_decay, (int, float)) and weight_decay == 0.0
  )
  fusable = not nesterov and not callable(weight_decay)

  def leaves_of(grads, state, weights, low):
    """Per leaf (g, m, v, scales, w, low, decay), or None where the native path does not apply."""
    flags = _decay_flags(grads, mask) if decays else None
    leaves, treedef = jax.tree.flatten(grads)
    adam_state = state[0]
    m, v = jax.tree.leaves(adam_state.mu), jax.tree.leaves(adam_state.nu)
    # Each leaf's scales (an array, or MaskedNode for float moments), aligned with its codes:
    # a slice's state masks the leaves outside it in every tree, these too.
    scales = lambda codes, t: [b.value for b in jax.tree.leaves(jax.tree.map(_Box, codes, t))]
    ms, vs = scales(adam_state.mu, adam_state.mu_scale), scales(adam_state.nu, adam_state.nu_scale)
    w = [None] * len(leaves) if weights is None else jax.tree.leaves(weights)
    lo = w if low is None else jax.tree.leaves(low)
    if not (fusable and leaves and flags is not False and ffi.available()):
      return None
    if not len(m) == len(v) == len(ms) == len(vs) == len(w) == len(lo) == len(leaves):
      return None
    rows = zip(leaves, m, v, ms, vs, w, lo, flags or [False] * len(leaves), strict=True)
    return treedef, list(rows)

  def eligible(rows, whole: bool) -> bool:
    for g, m, v, _, _, w, lo, d in rows:
      if host_adam8.native_leaf(g, m, v):
        if (whole or d) and not (w.dtype == jnp.float32 and lo.dtype in _STEP_DTYPES):
          return False
      elif whole and not _step_dtypes([g], [m], [v], [w], [lo]):
        return False
      elif not whole and not (_all_f32([g], [m], [v]) and (not d or w.dtype == jnp.float32)):
        return False
    return True

  def update_fn(updates, state, params=None, **extra_args):
    if (error := adam8.mismatch(state[0], 8, f"{where} update")) is not None:
      raise error
    if decays and params is None:
      raise ValueError(f"{where}: update needs params (the weight decay reads them).")
    found = leaves_of(updates, state, params if decays else None, None)
    if found is None or not eligible(found[1], whole=False):
      return tx.update(updates, state, params, **extra_args)
    treedef, rows = found
    count_inc, lr_state, hyper = step_hyper(
      state, learning_rate, betas, weight_decay if decays else 0.0
    )
    vector = hyper.vector(moments_only=False)
    moments_vector = hyper.vector(moments_only=True)
    out = []
    for g, m, v, ms, vs, w, _, d in rows:
      if host_adam8.native_leaf(g, m, v):
        u, (m, ms, vs_codes, vs_scale), _ = host_adam8.leaf_step(
          g, (m, ms, v, vs), w, None, hyper, vector, d, host_adam8.OUT_UPDATE
        )
        out.append((u, m, ms, vs_codes, vs_scale))
      else:
        u, m, v = _step(g, m, v, w, hyper, moments_vector, d, False)
        out.append((u, m, ms, v, vs))
    u, mu, mu_scale, nu, nu_scale = (treedef.unflatten(list(x)) for x in zip(*out, strict=True))
    new = adam8.ScaleByAdam8bitState(count_inc, mu, mu_scale, nu, nu_scale)
    return u, (new, *state[1:-1], lr_state)

  def whole_step(grads, state, weights, low=None, *, out=OUT_NONE):
    """As `AdamTransformation.whole_step`, on the 8-bit state."""
    if (error := adam8.mismatch(state[0], 8, f"{where} update")) is not None:
      raise error
    found = leaves_of(grads, state, weights, low)
    if found is None or not eligible(found[1], whole=True):
      return None
    treedef, rows = found
    count_inc, lr_state, hyper = step_hyper(
      state, learning_rate, betas, weight_decay if decays else 0.0
    )
    vector = hyper.vector(moments_only=False)
    new = []
    for g, m, v, ms, vs, w, lo, d in rows:
      if host_adam8.native_leaf(g, m, v):
        r, (m, ms, v, vs), w = host_adam8.leaf_step(g, (m, ms, v, vs), w, lo, hyper, vector, d, out)
      else:
        r, m, v, w = _whole_step(g, m, v, w, lo, hyper, vector, d, out)
      new.append((r, m, ms, v, vs, w))
    result, mu, mu_scale, nu, nu_scale, w = (
      treedef.unflatten(list(x)) for x in zip(*new, strict=True)
    )
    adam_state = adam8.ScaleByAdam8bitState(count_inc, mu, mu_scale, nu, nu_scale)
    return result, (adam_state, *state[1:-1], lr_state), w

  def update_and_apply_fn(grads, state, params, **extra_args):
    done = whole_step(grads, state, params)
    if done is None:
      updates, state = update_fn(grads, state, params, **extra_args)
      return optax.apply_updates(params, updates), state
    return done[0], done[1]

  return AdamTransformation(tx.init, update_fn, update_and_apply_fn, whole_step)


class _Box:
  """One leaf's value as a pytree leaf (MaskedNode is a node without leaves; a list, a node)."""

  __slots__ = ("value",)

  def __init__(self, _, value):
    self.value = value


def _check_32(state) -> None:
  """Refuses an 8-bit state (`state_bits=8`) handed to this float32-state Adam."""
  if (error := adam8.mismatch(state[0], 32, "offlax.adam/adamw update")) is not None:
    raise error


def _fused(reference, learning_rate, betas, weight_decay, mask, nesterov, mu_dtype, native_update):
  b1, b2, eps, eps_root = betas
  fusable = (
    not nesterov
    and (mu_dtype is None or jnp.dtype(mu_dtype) == jnp.float32)
    and not callable(weight_decay)
  )
  # optax skips a weight decay that is a constant zero (no `+ 0 * p`).
  decays = weight_decay is not None and not (
    isinstance(weight_decay, (int, float)) and weight_decay == 0.0
  )

  def hyperparameters(state):
    return step_hyper(state, learning_rate, betas, weight_decay if decays else 0.0)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    _check_32(state)
    adam_state = state[0]
    if decays and params is None:
      raise ValueError("offlax.adamw: update needs params (the weight decay reads them).")
    flags = _decay_flags(updates, mask) if decays else None
    leaves, treedef = jax.tree.flatten(updates)
    fused = leaves and fusable and flags is not False
    if not (fused and _all_f32(leaves, adam_state.mu, adam_state.nu)):
      return reference.update(updates, state, params)
    count_inc, lr_state, hyper = hyperparameters(state)
    vector = hyper.vector(moments_only=not native_update)
    p_leaves = jax.tree.leaves(params) if decays else [None] * len(leaves)
    out = [
      _step(g, m, v, p, hyper, vector, d, native_update)
      for g, m, v, p, d in zip(
        leaves,
        jax.tree.leaves(adam_state.mu),
        jax.tree.leaves(adam_state.nu),
        p_leaves,
        flags or [False] * len(leaves),
        strict=True,
      )
    ]
    new_u, mu, nu = (treedef.unflatten(list(x)) for x in zip(*out, strict=True))
    new_adam = adam_state._replace(count=count_inc, mu=mu, nu=nu)
    return new_u, (new_adam, *state[1:-1], lr_state)

  def whole_step(grads, state, weights, low=None, *, out=OUT_NONE):
    """The whole step of `weights` in one native pass, or None where it does not apply.

    `weights`: the params (``out=OUT_NONE``: returns the new params), or a
    float32 master of the params `low` (``OUT_DELTA``: returns the rounded
    new master minus `low`, as `master_weights` does; ``OUT_PARAM``: the new
    params, the new master rounded). Returns ``(result, new_state,
    new_weights)``.
    """
    _check_32(state)
    adam_state = state[0]
    flags = _decay_flags(grads, mask) if decays else None
    leaves, treedef = jax.tree.flatten(grads)
    w_leaves = jax.tree.leaves(weights)
    low_leaves = w_leaves if low is None else jax.tree.leaves(low)
    if not (
      leaves
      and fusable
      and flags is not False
      and ffi.available()
      and _step_dtypes(leaves, adam_state.mu, adam_state.nu, w_leaves, low_leaves)
    ):
      return None
    count_inc, lr_state, hyper = hyperparameters(state)
    vector = hyper.vector(moments_only=False)
    new = [
      _whole_step(g, m, v, w, lo, hyper, vector, d, out)
      for g, m, v, w, lo, d in zip(
        leaves,
        jax.tree.leaves(adam_state.mu),
        jax.tree.leaves(adam_state.nu),
        w_leaves,
        low_leaves,
        flags or [False] * len(leaves),
        strict=True,
      )
    ]
    result, mu, nu, w = (treedef.unflatten(list(x)) for x in zip(*new, strict=True))
    new_adam = adam_state._replace(count=count_inc, mu=mu, nu=nu)
    return result, (new_adam, *state[1:-1], lr_state), w

  def update_and_apply_fn(grads, state, params, **extra_args):
    """`offlax.update_and_apply` of this transformation: the whole step in one pass."""
    done = whole_step(grads, state, params)
    if done is None:
      updates, state = update_fn(grads, state, params, **extra_args)
      return optax.apply_updates(params, updates), state
    new_params, state, _ = done
    return new_params, state

  return AdamTransformation(reference.init, update_fn, update_and_apply_fn, whole_step)


class AdamTransformation(apply_lib.FusedTransformation):
  """What `adam` and `adamw` return: a `FusedTransformation` with its `whole_step`.

  ``whole_step(grads, state, weights, low=None, *, out=OUT_NONE)`` runs the
  whole step in one native pass, or returns None where it does not apply;
  `master_weights` runs it on its float32 master.
  """

  whole_step: Any = None

  def __new__(cls, init, update, update_and_apply=None, whole_step=None):
    self = super().__new__(cls, init, update, update_and_apply)
    self.whole_step = whole_step
    return self


def _all_f32(leaves, mu, nu) -> bool:
  others = jax.tree.leaves(mu) + jax.tree.leaves(nu)
  return len(others) == 2 * len(leaves) and all(
    isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray) and x.dtype == jnp.float32
    for x in leaves + others
  )


def _step_dtypes(grads, mu, nu, weights, low) -> bool:
  """Whether the whole-step kernel covers these leaves (float32 state, f32/bf16 in and out)."""
  f32 = [*jax.tree.leaves(mu), *jax.tree.leaves(nu), *weights]
  if not len(f32) == 3 * len(grads) == 3 * len(low):
    return False
  arrays = (jax.Array, jax.ShapeDtypeStruct, np.ndarray)
  return all(isinstance(x, arrays) and x.dtype == jnp.float32 for x in f32) and all(
    isinstance(x, arrays) and x.dtype in _STEP_DTYPES for x in (*grads, *low)
  )


def _decay_flags(updates, mask) -> list[bool] | bool:
  """Which leaves `mask` decays, or False where the fused path cannot tell."""
  n = len(jax.tree.leaves(updates))
  if mask is None:
    return [True] * n
  tree = mask(updates) if callable(mask) else mask
  try:
    flat = jax.tree.leaves(jax.tree.map(lambda _, m: m, updates, tree))
  except (ValueError, TypeError):
    return False  # a prefix or otherwise shaped mask: optax.masked's rules apply
  if len(flat) != n or not all(isinstance(m, bool | np.bool_) for m in flat):
    return False
  return [bool(m) for m in flat]


def _step(g, m, v, p, hyper: Hyper, vector, decay: bool, native_update: bool):
  """One leaf: moments by the native kernel on XLA:CPU, else by JAX; update by JAX.

  The update is left to XLA, in optax's expressions, so that XLA fuses it with
  what consumes it (`optax.apply_updates`: one pass over the params) and
  rewrites it exactly as it rewrites optax's program; with `native_update`
  the kernel writes it too.
  """
  whole = lambda g, m, v, p, vector: adam_leaf(g, m, v, p, hyper, decay)
  if not g.size:
    return whole(g, m, v, p, vector)
  if native_update:
    kernel = functools.partial(fused_update, decay=decay)
    p = _placeholder() if p is None else p  # read only with decay; not g, which XLA would copy
    return ffi.on_cpu(kernel, whole, g, m, v, p, vector)
  plain = lambda g, m, v, vector: _moments(g, m, v, hyper)
  moments = lambda g, m, v: ffi.on_cpu(_native_moments, plain, g, m, v, vector)
  return adam_leaf(g, m, v, p, hyper, decay, moments)


def _whole_step(g, m, v, w, low, hyper: Hyper, vector, decay: bool, out: int):
  """One leaf's whole step: (result, m, v, w); see `whole_step` in `_fused`.

  Native on XLA:CPU; elsewhere (a GPU program) plain JAX with the same
  expressions as optax, `optax.apply_updates` and `master_weights`.
  """

  def plain(g, m, v, w, low, vector):
    del vector
    update, m, v = adam_leaf(g.astype(jnp.float32), m, v, w, hyper, decay)
    new_w = optax.apply_updates(w, update)
    if out == OUT_NONE:
      return new_w, m, v, new_w
    new_low = new_w.astype(low.dtype)
    result = new_low if out == OUT_PARAM else new_low.astype(w.dtype) - low.astype(w.dtype)
    return result, m, v, new_w

  if not g.size:
    return plain(g, m, v, w, low, vector)

  def native(g, m, v, w, low, vector):
    f32 = jax.ShapeDtypeStruct(g.shape, jnp.float32)
    result = {
      OUT_NONE: jax.ShapeDtypeStruct((1,), jnp.float32),  # unused
      OUT_DELTA: f32,
      OUT_PARAM: jax.ShapeDtypeStruct(g.shape, low.dtype),
    }[out]
    # In place: the state and w into their buffers, new params over the old.
    aliases = {1: 1, 2: 2, 3: 3} | ({4: 0} if out == OUT_PARAM else {})
    call = jax.ffi.ffi_call(_WHOLE_STEP, (result, f32, f32, f32), input_output_aliases=aliases)
    placeholder = _placeholder() if out == OUT_NONE else low  # read only with a master
    r, m, v, new_w = call(g, m, v, w, placeholder, vector, decay=decay, out=np.int32(out))
    return (new_w if out == OUT_NONE else r), m, v, new_w

  return ffi.on_cpu(native, plain, g, m, v, w, low, vector)


def _native_moments(g, m, v, vector):
  out = jax.ShapeDtypeStruct(g.shape, jnp.float32)
  # In place: XLA copies a moment first only if it is still used afterwards.
  call = jax.ffi.ffi_call(_MOMENTS, (out, out), input_output_aliases={1: 0, 2: 1})
  return call(g, m, v, vector)


def fused_update(g, m, v, p, vector, *, decay: bool):
  """The whole Adam step of one leaf in one native pass: (update, m, v).

  What `adam(..., native_update=True)` runs on XLA:CPU, and in a host
  computation: the host's share of a step whose update leaves the host
  (ZeRO-Offload). Call `native_available()` first.
  """
  out = jax.ShapeDtypeStruct(g.shape, jnp.float32)
  # In place: the update into the gradient's buffer, the moments into theirs.
  call = jax.ffi.ffi_call(_TARGET, (out, out, out), input_output_aliases={0: 0, 1: 1, 2: 2})
  return call(g, m, v, p, vector, decay=decay)


def native_available() -> bool:
  """Whether the kernel runs: offlax's native library built and registered (`ffi.available`)."""
  return ffi.available()
