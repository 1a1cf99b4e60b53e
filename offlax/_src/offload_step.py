"""One traced `offload` update: its values, computed once, and the coupling of its inner update.

`Step` holds what every strategy of `offlax._src.transform` reads (the flat
slots of the updates and params, the state's layout and items, which slots are
leaves, the extra arguments flattened); `analyze` traces the inner update on
the whole tree and derives which leaves may be updated apart
(`offlax._src.coupling`).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from offlax._src import layout, offload_step
  >>> from offlax._src.host_tier import HostTier
  >>> params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  >>> inner = optax.with_extra_args_support(optax.adam(1e-3))
  >>> state, spec = inner.init(params), layout.ParamSpec.of(params)
  >>> states = layout.StateLayout(state, spec)
  >>> items = states.split(state)
  >>> st = offload_step.Step.of(inner, HostTier(), spec, states, items, params, None, {})
  >>> offload_step.analyze(st).groups
  ((0,), (1,))
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np

from offlax._src import apply as apply_lib
from offlax._src import coupling as coupling_lib
from offlax._src import layout as layout_lib
from offlax._src.layout import ParamSpec


def fill(slots: list[Any], positions: list[int], values: list[Any]) -> list[Any]:
  """`slots` with ``slots[positions[k]] = values[k]``, as a new list."""
  out = list(slots)
  for i, v in zip(positions, values, strict=True):
    out[i] = v
  return out


@dataclasses.dataclass(frozen=True)
class Step:
  """One traced `update`'s values, shared by the strategies of a step.

  Attributes:
    inner: the inner transformation (with extra args support).
    tier: the tier holding the state.
    spec: the params' spec (a device's own shard's, inside ``shard_map``).
    layout: the inner state's layout; `items` its flat items.
    u_slots, p_slots: the flat updates and params (masked slots included).
    extra_args: the extra arguments of ``update``; `extras` and `extra_def`
      flattened, `arrays` the positions of their arrays.
    leaves: the positions of the slots that are leaves (not masked).
  """

  inner: Any
  tier: Any
  spec: ParamSpec
  layout: layout_lib.StateLayout
  items: list[Any]
  u_slots: list[Any]
  p_slots: list[Any] | None
  extra_args: dict[str, Any]
  extras: list[Any]
  extra_def: Any
  arrays: list[int]
  leaves: list[int]

  @classmethod
  def of(cls, inner, tier, spec, layout, items, updates, params, extra_args) -> Step:
    u_slots = jax.tree.leaves(updates, is_leaf=layout_lib.is_masked)
    p_slots = None if params is None else jax.tree.leaves(params, is_leaf=layout_lib.is_masked)
    extras, extra_def = jax.tree.flatten(extra_args)
    arrays = [i for i, x in enumerate(extras) if layout_lib.is_array(x)]
    leaves = [i for i, s in enumerate(spec.shapes) if s is not None]
    return cls(
      inner, tier, spec, layout, items, u_slots, p_slots, extra_args, extras, extra_def, arrays,
      leaves,
    )  # fmt: skip

  @property
  def shapes(self) -> list[Any]:
    """The shapes of the leaves."""
    return [self.spec.shapes[i] for i in self.leaves]

  def at_leaves(self, slots: list[Any]) -> list[Any]:
    """The entries of `slots` (one per param slot) at the leaves."""
    return [slots[i] for i in self.leaves]

  def put(self, slots: list[Any], values: list[Any]) -> list[Any]:
    """`slots` with the leaves' entries replaced by `values`."""
    return fill(slots, self.leaves, values)

  def extra_arrays(self) -> list[Any]:
    """The arrays among the extra arguments, in order."""
    return [self.extras[i] for i in self.arrays]

  def extra(self, arrays: list[Any]) -> dict[str, Any]:
    """The extra arguments with their arrays replaced by `arrays`."""
    return jax.tree.unflatten(self.extra_def, fill(self.extras, self.arrays, arrays))

  def update(self, u_slots, state, p_slots, extra_args, apply=False):
    """The inner update of flat slots: (updates, state), or with `apply` (new params, state)."""
    updates = self.spec.treedef.unflatten(u_slots)
    params = None if p_slots is None else self.spec.treedef.unflatten(p_slots)
    if apply:  # the inner's own fused step where it has one (offlax.adam, master_weights)
      out, new_state = apply_lib.update_and_apply(self.inner, updates, state, params, **extra_args)
    else:
      out, new_state = self.inner.update(updates, state, params, **extra_args)
    return jax.tree.leaves(out, is_leaf=layout_lib.is_masked), new_state


def analyze(st: Step) -> coupling_lib.Coupling:
  """Traces the inner update on the whole tree and derives its coupling."""
  layout, items, leaves, arrays = st.layout, st.items, st.leaves, st.arrays
  if any(np.ndim(x) for x in st.extra_arrays()):
    return coupling_lib.single_group(len(leaves), "an extra argument is a non-scalar array")
  position = {leaf: k for k, leaf in enumerate(leaves)}

  def restricted(keep):
    """The flat inner update of the leaves in `keep`, the others masked as in a slice."""
    kept = [i for i in leaves if i in keep]
    kept_items = [j for j, o in enumerate(layout.owners) if o == coupling_lib.GLOBAL or o in keep]
    mask = lambda slots: [
      layout_lib.MASKED() if i in position and i not in keep else x for i, x in enumerate(slots)
    ]

    def flat_update(u, s, p, e):
      u_slots = fill(mask(st.u_slots), kept, u)
      p_slots = None if p is None else fill(mask(st.p_slots), kept, p)
      s_items = fill([layout_lib.MASK] * len(items), kept_items, s)
      new_u, new_state = st.update(u_slots, layout.merge(s_items), p_slots, st.extra(e))
      new_items = layout.split(new_state)
      return [new_u[i] for i in kept], [new_items[j] for j in kept_items]

    u_args = abstract([st.u_slots[i] for i in kept])
    p_args = None if st.p_slots is None else abstract([st.p_slots[i] for i in kept])
    args = (u_args, abstract([items[j] for j in kept_items]), p_args)
    return flat_update, (*args, abstract(st.extra_arrays()))

  abstract = lambda xs: [
    jax.ShapeDtypeStruct(layout_lib.shape_of(x), layout_lib.dtype_of(x)) for x in xs
  ]
  flat_update, args = restricted(set(leaves))
  jaxpr = jax.make_jaxpr(flat_update)(*args)
  p_args = args[2]
  owner = lambda o: o if o == coupling_lib.GLOBAL else position[o]
  in_owners = (
    list(range(len(leaves)))
    + [owner(o) for o in layout.owners]
    + ([] if p_args is None else list(range(len(leaves))))
    + [coupling_lib.GLOBAL] * len(arrays)
  )
  out_owners = list(range(len(leaves))) + [owner(o) for o in layout.owners]
  coupling = coupling_lib.analyze(jaxpr, in_owners, out_owners, st.shapes)
  reason = (
    None if len(coupling.groups) < 2 else dtype_dependence(restricted, leaves, args[0], jaxpr)
  )
  if reason is None:
    return coupling
  # One slice; each leaf's update is still its own (elementwise leaves stay
  # `splittable`: the NVMe tier on a mesh updates each shard by itself).
  return dataclasses.replace(coupling, groups=(tuple(range(len(leaves))),), reason=reason)


def dtype_dependence(restricted, leaves, u_args, jaxpr) -> str | None:
  """Why the update of some leaves would change if other leaves left the call, or None.

  The coupling analysis follows values, not dtypes; some transformations read
  the dtypes of the whole tree (`optax.inject_hyperparams` casts its
  hyperparameters to the highest float dtype among the params), so a slice
  without the tree's highest dtype would compute in another precision, or
  fail (no common dtype for float16 and bfloat16 without a float32 leaf). For
  a tree of several float dtypes, the leaves of each proper subset of them are
  traced alone (at most 14 traces: four dtypes): a failure, or an operation the
  whole tree does not do (e.g. a cast to another dtype), keeps one slice.
  """
  floats = sorted({str(a.dtype) for a in u_args if jax.dtypes.issubdtype(a.dtype, np.floating)})
  if len(floats) < 2:
    return None
  if len(floats) > 4:
    return f"the params have {len(floats)} float dtypes ({', '.join(floats)})"
  whole = coupling_lib.signatures(jaxpr)  # the whole tree's update
  subsets = [c for n in range(1, len(floats)) for c in itertools.combinations(floats, n)]
  for dtypes in subsets:
    keep = {i for i, a in zip(leaves, u_args, strict=True) if str(a.dtype) in dtypes}
    fn, args = restricted(keep)
    what = f"the update of the {'/'.join(dtypes)} leaves"
    try:
      part = coupling_lib.signatures(jax.make_jaxpr(fn)(*args))
    except Exception as e:  # the inner update's own error: the whole tree avoids it
      first = (str(e).splitlines() or [""])[0][:200]
      return f"{what} fails without the others ({type(e).__name__}: {first})"
    extra = part - whole
    if extra:
      prim, ins, outs = next(iter(extra))
      return (
        f"{what} computes differently without the others "
        f"({prim} of {ins} to {outs} is not in the whole tree's update)"
      )
  return None
