"""Which leaves an optimizer's update couples, read off its jaxpr.

Streaming updates the state in slices, each a separate call of the inner
`update` on part of the tree. That is exact only where the inner update of one
leaf never reads another leaf (Adam: yes; global-norm clipping: no), and a leaf
may be cut into row slices only where its update is elementwise (Adam: yes;
LAMB's per-leaf trust ratio, Adafactor's factored moments: no). Rather than a
list of known optimizers, we trace the inner update once and follow every value
through the jaxpr, so user-written transformations get the same guarantee.

Each value is classified as one of:
  * uniform: depends on no leaf and is a scalar or a broadcast of one (the step
    count, a learning rate); slicing a leaf cannot change it;
  * elem(i): same shape as leaf i and an elementwise function of leaf i's
    arrays and uniform values, so the k-th element depends only on the k-th
    elements of leaf i;
  * other: anything else, with the set of leaves it depends on.
Values derived from PRNG primitives are tracked too: keys are commonly split
per leaf, so their values depend on how many leaves a call sees.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np
from jax._src import config as jax_config

from offlax._src import ffi

GLOBAL = -1  # owner of a state leaf that belongs to no parameter (e.g. count)

# Whether offlax's native kernels (`ffi.ELEMENTWISE`) may be cut into slices. In a
# GPU program they must be, as their JAX twins are: whole leaves broke the device
# bound and doubled host compute's host temp under XLA:GPU (tests/test_gpu_compile.py).
# On the CPU backend cutting buys nothing and costs copies: a whole leaf is updated
# in place, a cut one is sliced out and written back (the host step 6-11x slower,
# benchmarks/host_adam.py). Unset: decided by JAX's default backend. A JAX config
# state (env OFFLAX_SPLIT_NATIVE=always|never), not a plain context variable: it is
# part of the trace context, so a step traced once for the CPU is traced again,
# not reused from JAX's caches, when `compile_for_gpu` lowers it for CUDA.
_SPLIT_NATIVE = jax_config.optional_enum_state(
  name="offlax_split_native",
  enum_values=["always", "never"],
  default=None,
  help="Cut offlax's native optimizer kernels into slices (always in GPU programs).",
  include_in_trace_context=True,
)


def split_native() -> bool:
  """Whether the update being traced may cut offlax's native kernels into slices."""
  forced = _SPLIT_NATIVE.value
  return jax.default_backend() != "cpu" if forced is None else forced == "always"


def splitting_native(split: bool) -> contextlib.AbstractContextManager:
  """Traces inside cut (or keep whole) offlax's native kernels, whatever the backend.

  `offlax.compile_for_gpu` traces with True: it lowers for CUDA from a CPU machine.
  """
  return _SPLIT_NATIVE("always" if split else "never")


_ELEMENTWISE = frozenset(
  """
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj
convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2
expm1 floor ge gt imag integer_pow is_finite le lgamma digamma log log1p
logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem
round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor
""".split()
)
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})
# Primitives that call their body once: analysed by following the body. Loops
# and conditionals are not listed and count as coupling all their operands.
_CALLS = frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
  }
)


@dataclasses.dataclass(frozen=True)
class _Val:
  deps: frozenset[int] = frozenset()
  elem: int | None = None
  uniform: bool = False
  random: bool = False


_UNIFORM = _Val(uniform=True)


@dataclasses.dataclass(frozen=True)
class Coupling:
  """What the schedule may do with each leaf.

  Attributes:
    groups: leaf indices that must be updated in the same call, each group in
      tree order; together they cover every leaf once.
    splittable: leaves whose update is elementwise, so it may be applied to
      row slices of the leaf.
    reason: why all leaves form one group, or None.
  """

  groups: tuple[tuple[int, ...], ...]
  splittable: frozenset[int]
  reason: str | None = None


def single_group(num_leaves: int, reason: str) -> Coupling:
  return Coupling((tuple(range(num_leaves)),) if num_leaves else (), frozenset(), reason)


def analyze(
  jaxpr: jex.ClosedJaxpr,
  in_owners: Sequence[int],
  out_owners: Sequence[int],
  leaf_shapes: Sequence[tuple[int, ...]],
) -> Coupling:
  """Derives the coupling of `jaxpr`'s outputs to its inputs.

  Args:
    jaxpr: the traced inner update, flat inputs to flat outputs.
    in_owners: for each input, the index of the leaf it belongs to or GLOBAL.
    out_owners: the same for each output.
    leaf_shapes: the shape of each leaf's update.

  Returns:
    The `Coupling` of the leaves.
  """
  n = len(leaf_shapes)
  inputs = []
  for var, owner in zip(jaxpr.jaxpr.invars, in_owners, strict=True):
    shape = tuple(var.aval.shape)
    if owner == GLOBAL:
      inputs.append(_Val(uniform=shape == (), random=_is_key(var.aval)))
    else:
      inputs.append(_Val(frozenset({owner}), owner if shape == leaf_shapes[owner] else None))
  consts = [_const(c) for c in jaxpr.consts]
  try:
    outputs = _run(jaxpr.jaxpr, consts, inputs)
  except _Effectful as e:
    return single_group(n, f"the update has a side effect ({e})")

  parent = list(range(n))

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  splittable = set(i for i, s in enumerate(leaf_shapes) if len(s) and 0 not in s)
  for val, owner in zip(outputs, out_owners, strict=True):
    if owner == GLOBAL:
      if val.deps:
        return single_group(
          n, "a state leaf that belongs to no parameter depends on the parameters"
        )
      continue
    if val.random:
      return single_group(n, "the update of a leaf uses random numbers")
    for d in val.deps:
      parent[find(d)] = find(owner)
    if not (val.elem == owner or (val.uniform and not val.deps)):
      splittable.discard(owner)
  groups: dict[int, list[int]] = {}
  for i in range(n):
    groups.setdefault(find(i), []).append(i)
  ordered = tuple(tuple(g) for g in sorted(groups.values()))
  for g in ordered:
    if len(g) > 1:
      splittable.difference_update(g)
  return Coupling(ordered, frozenset(splittable))


class _Effectful(Exception):
  pass


def _is_key(aval) -> bool:
  return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def _const(value) -> _Val:
  return _UNIFORM if np.ndim(value) == 0 else _Val()


def _run(jaxpr: jex.Jaxpr, consts: Sequence[_Val], inputs: Sequence[_Val]) -> list[_Val]:
  env: dict[jex.Var, _Val] = {}

  def read(v) -> _Val:
    if isinstance(v, jex.Literal):
      return _const(v.val)
    return env[v]

  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, inputs, strict=True))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _eqn(eqn, ins)
    for v, val in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, jex.DropVar):
        env[v] = val
  return [read(v) for v in jaxpr.outvars]


def _eqn(eqn: jex.JaxprEqn, ins: list[_Val]) -> list[_Val]:
  name = eqn.primitive.name
  if eqn.effects:
    raise _Effectful(name)
  deps = frozenset().union(*(v.deps for v in ins))
  random = any(v.random for v in ins) or name.startswith(("random_", "threefry"))
  n_out = len(eqn.outvars)
  sub = _call_body(eqn)
  if sub is not None:
    body, consts = sub
    return _run(body, consts, ins)
  if name == "cond" and ins[0].uniform:  # e.g. `jax.lax.platform_dependent`
    return _branches(eqn.params["branches"], ins[1:])
  if name == "platform_index":  # the platform compiled for: one value for every slice
    return [_UNIFORM] * n_out
  if name == "ffi_call" and eqn.params.get("target_name") in ffi.ELEMENTWISE and split_native():
    return _elementwise_call(eqn, ins, deps, random)
  if name in _ELEMENTWISE:
    varying = [v for v in ins if not v.uniform]
    if not varying:
      return [_Val(uniform=True, random=random)] * n_out
    elems = {v.elem for v in varying}
    if len(elems) == 1 and None not in elems:
      return [_Val(deps, elems.pop(), random=random)] * n_out
  elif name in _SHAPE_ONLY and ins[0].uniform:
    return [_Val(uniform=True, random=random)] * n_out
  elif name == "broadcast_in_dim" and _shape(eqn.outvars[0]) == _shape(eqn.invars[0]):
    return [ins[0]]
  return [_Val(deps, random=random)] * n_out


def signatures(jaxpr: jex.ClosedJaxpr) -> collections.Counter:
  """The operations of `jaxpr`, as a multiset of (primitive, operand and result types).

  Equations that hold other jaxprs (calls, loops, conditionals) count as the
  operations of their bodies, not as themselves: a call over a whole tree and
  one over part of it then differ only in the operations of the leaves left
  out. So the update of some leaves computes as it does within the whole
  tree (same operations in the same dtypes) only if its signatures are a
  sub-multiset of the whole tree's.
  """
  out: collections.Counter = collections.Counter()

  def types(vs) -> tuple:
    return tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in vs if hasattr(v.aval, "dtype"))

  def walk(j: jex.Jaxpr) -> None:
    for eqn in j.eqns:
      bodies = [
        b.jaxpr if isinstance(b, jex.ClosedJaxpr) else b
        for p in eqn.params.values()
        for b in (p if isinstance(p, (tuple, list)) else (p,))
        if isinstance(b, (jex.ClosedJaxpr, jex.Jaxpr))
      ]
      if bodies:
        for b in bodies:
          walk(b)
      else:
        out[(eqn.primitive.name, types(eqn.invars), types(eqn.outvars))] += 1

  walk(jaxpr.jaxpr)
  return out


def _branches(branches: Sequence[jex.ClosedJaxpr], ins: list[_Val]) -> list[_Val]:
  """A conditional whose branch is the same for every slice: what every branch agrees on."""
  outs = [_run(b.jaxpr, [_const(c) for c in b.consts], ins) for b in branches]
  return [
    vals[0]
    if all(v == vals[0] for v in vals)
    else _Val(frozenset().union(*(v.deps for v in vals)), random=any(v.random for v in vals))
    for vals in zip(*outs, strict=True)
  ]


def _elementwise_call(eqn: jex.JaxprEqn, ins: list[_Val], deps, random) -> list[_Val]:
  """A native kernel elementwise in its leading operands (`ffi.ELEMENTWISE`).

  Its other operands (hyperparameters) must not depend on the leaves; its
  results of its first operand's shape are then elementwise in the same leaf.
  """
  n = ffi.ELEMENTWISE[eqn.params["target_name"]]
  elems = {v.elem for v in ins[:n] if not v.uniform}
  if any(v.deps for v in ins[n:]) or len(elems) != 1 or None in elems:
    return [_Val(deps, random=random)] * len(eqn.outvars)
  elem, shape = elems.pop(), _shape(eqn.invars[0])
  return [
    _Val(deps, elem, random=random) if _shape(v) == shape else _Val(deps, random=random)
    for v in eqn.outvars
  ]


def _shape(var: Any) -> tuple[int, ...]:
  return tuple(var.aval.shape)


def _call_body(eqn: jex.JaxprEqn):
  """The body of a call-like primitive (jit, custom_jvp_call, ...), if any."""
  if eqn.primitive.name not in _CALLS:
    return None
  for param in eqn.params.values():
    if isinstance(param, jex.ClosedJaxpr):
      body, consts = param.jaxpr, [_const(c) for c in param.consts]
    elif isinstance(param, jex.Jaxpr):
      body, consts = param, [_Val()] * len(param.constvars)
    else:
      continue
    if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
      return body, consts
  return None
