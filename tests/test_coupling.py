"""The coupling analysis and the schedule built from it."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import scale_by_highest_dtype

import offlax
from offlax._src import coupling, ffi, schedule
from offlax._src.layout import ParamSpec
from offlax._src.offload_step import Step
from offlax._src.offload_step import analyze as analyze_step

SHAPES = {"a": (8, 4), "b": (4,), "c": (3, 5)}


def _analyze(inner, params=None, **extra):
  params = params or {k: jnp.ones(s) for k, s in SHAPES.items()}
  from offlax._src.host_tier import HostTier
  from offlax._src.layout import StateLayout

  inner = optax.with_extra_args_support(inner)
  state = inner.init(params)
  spec = ParamSpec.of(params)
  layout = StateLayout(state, spec)
  step = Step.of(inner, HostTier(), spec, layout, layout.split(state), params, params, extra)
  assert step.leaves == list(range(len(spec.shapes)))
  return analyze_step(step)


@pytest.mark.parametrize(
  "inner",
  [
    optax.adam(1e-3),
    optax.sgd(0.1, momentum=0.9),
    optax.lion(1e-3),
    optax.adagrad(0.1),
    optax.rmsprop(1e-3),
  ],
)
def test_elementwise_optimizers_are_separable_and_splittable(inner):
  c = _analyze(inner)
  assert c.groups == ((0,), (1,), (2,)) and c.reason is None
  assert c.splittable == {0, 1, 2}


@pytest.mark.parametrize(
  "inner",
  [
    offlax.adamw(1e-3),
    offlax.adam(1e-3, native_update=True),
    offlax.master_weights(offlax.adamw(1e-3)),
  ],
  ids=["moments-kernel", "update-kernel", "whole-step-kernel"],
)
def test_offlax_native_kernels_are_splittable(inner):
  """A `platform_dependent` choice of an elementwise FFI kernel or its JAX twin is elementwise.

  In GPU programs (`compile_for_gpu` traces so); on the CPU backend each leaf stays whole,
  updated in place (cutting it would only copy its slices out and back).
  """
  assert ffi.available()
  tree = {"a": jnp.ones(4)}
  jaxpr = str(jax.make_jaxpr(inner.update)(tree, inner.init(tree), tree))
  assert "platform_index" in jaxpr and "ffi_call" in jaxpr
  with coupling.splitting_native(True):
    c = _analyze(inner)
  assert c.groups == ((0,), (1,), (2,)) and c.splittable == {0, 1, 2}
  assert jax.default_backend() == "cpu" and not coupling.split_native()
  c = _analyze(inner)
  assert c.groups == ((0,), (1,), (2,)) and c.splittable == frozenset()


def test_an_unknown_ffi_call_couples_its_operands():
  def update(u, state, params=None):
    del params
    out = jax.ShapeDtypeStruct((20,), jnp.float32)
    flat = jnp.concatenate([u["a"].ravel(), u["b"].ravel(), u["c"].ravel()[:-7]])
    mixed = jax.ffi.ffi_call("offlax_to_slice", out)(flat)  # not in ffi.ELEMENTWISE
    return {k: x + mixed[0] for k, x in u.items()}, state

  c = _analyze(optax.GradientTransformation(lambda p: optax.EmptyState(), update))
  assert c.groups == ((0, 1, 2),) and not c.splittable


def test_per_leaf_reductions_are_separable_not_splittable():
  c = _analyze(optax.lamb(1e-3))
  assert c.groups == ((0,), (1,), (2,))
  assert c.splittable == frozenset()


def test_adafactor_keeps_factored_leaves_whole():
  params = {"big": jnp.ones((256, 256)), "vec": jnp.ones(7)}
  c = _analyze(optax.adafactor(1e-3, min_dim_size_to_factor=128), params)
  assert c.groups == ((0,), (1,))
  assert 0 not in c.splittable  # factored: row and column means


def test_global_norm_clip_couples_everything():
  c = _analyze(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
  assert c.groups == ((0, 1, 2),) and c.splittable == frozenset()


def test_global_state_depending_on_leaves_is_one_group():
  c = _analyze(optax.apply_if_finite(optax.adam(1e-3), 2))
  assert len(c.groups) == 1 and "belongs to no parameter" in c.reason


def test_random_noise_is_one_group():
  c = _analyze(optax.chain(optax.add_noise(0.1, 0.5, 0), optax.sgd(0.1)))
  assert len(c.groups) == 1 and "random" in c.reason


def test_side_effects_make_one_group():
  def noisy_update(updates, state, params=None):
    jax.debug.print("step")
    return updates, state

  c = _analyze(optax.GradientTransformation(lambda p: optax.EmptyState(), noisy_update))
  assert len(c.groups) == 1 and "side effect" in c.reason


def test_cross_leaf_user_transform_groups_the_coupled_pair():
  def couple(updates, state, params=None):
    return {**updates, "a": updates["a"] + jnp.sum(updates["c"])}, state

  c = _analyze(optax.GradientTransformation(lambda p: optax.EmptyState(), couple))
  assert c.groups == ((0, 2), (1,))
  assert c.splittable == {1}


def test_non_scalar_extra_args_make_one_group():
  inner = optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), lambda u, s, p=None, **kw: (u, s)
  )
  c = _analyze(inner, grad={k: jnp.ones(s) for k, s in SHAPES.items()})
  assert len(c.groups) == 1 and "extra argument" in c.reason


# A slice of one element is the schedule's slowest case; 7 elements as well.
@pytest.mark.parametrize(
  "chunk",
  [
    pytest.param(1, marks=pytest.mark.slow),
    pytest.param(7, marks=pytest.mark.slow),
    64,
    100,
    1000,
    10**6,
  ],
)
def test_schedule_bounds_slices_and_covers_every_element(chunk):
  shapes = [(8, 4), (4,), (3, 5), (), (0, 3), (100,)]
  leaf_bytes = [2 * 4 * max(1, int(jnp.prod(jnp.array(s)))) if s else 8 for s in shapes]
  leaf_bytes[4] = 0
  c = coupling.Coupling(((0,), (1,), (2, 3), (4,), (5,)), frozenset({0, 1, 5}))
  slices = schedule.build(c, shapes, leaf_bytes, chunk)
  covered: dict[int, list] = {}
  for pieces in slices:
    size = 0
    for p in pieces:
      covered.setdefault(p.leaf, []).append(p)
      if p.start is None:
        size += leaf_bytes[p.leaf]
      else:
        rows = int(jnp.prod(jnp.array(shapes[p.leaf]))) if p.flat else shapes[p.leaf][0]
        size += leaf_bytes[p.leaf] // rows * (p.stop - p.start)
    unsplittable = all(p.start is None for p in pieces) and len({p.leaf for p in pieces}) <= 2
    assert (
      size <= chunk
      or (len(pieces) <= 2 and unsplittable)
      or (len(pieces) == 1 and p.stop - p.start == 1)
    ), (chunk, pieces, size)
  assert sorted(covered) == list(range(len(shapes)))
  for leaf in (0, 1, 5):
    x = jnp.arange(int(jnp.prod(jnp.array(shapes[leaf])))).reshape(shapes[leaf])
    parts = [p.take(x) for p in covered[leaf]]
    assert (schedule.join(covered[leaf], parts, shapes[leaf]) == x).all()
  # Coupled leaves 2 and 3 always share a slice.
  assert any({p.leaf for p in s} >= {2, 3} for s in slices)


MIXED = {
  "a": jnp.linspace(-1, 1, 32).reshape(8, 4),
  "b": jnp.linspace(-1, 1, 4).astype(jnp.bfloat16),
  "c": jnp.linspace(-1, 1, 15).reshape(3, 5).astype(jnp.float16),
}


@pytest.mark.parametrize("inner", [optax.adam(1e-3), optax.adamw(1e-3), optax.lion(1e-3)])
def test_mixed_dtypes_alone_do_not_couple(inner):
  c = _analyze(inner, MIXED)
  assert c.reason is None
  assert len(c.groups) == 3


@pytest.mark.parametrize(
  "inner, why",
  [
    (scale_by_highest_dtype(0.1), "computes differently"),
    (optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "fails without the others"),
  ],
)
def test_a_dependence_on_the_tree_dtypes_keeps_one_slice(inner, why):
  """Traced on part of the tree, the update would cast or compute in another dtype, or fail."""
  c = _analyze(inner, MIXED)
  assert len(c.groups) == 1
  assert why in c.reason
