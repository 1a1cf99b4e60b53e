"""offload(inner) gives the results of inner, bit for bit, over several steps."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_trees_equal, float_labels, grads_like, model_params
from conftest import run_steps as run

import offlax

OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-3),
  "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  "lion": lambda: optax.lion(1e-4),
  "adafactor": lambda: optax.adafactor(1e-3),
  "lamb": lambda: optax.lamb(1e-3),
  "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.5),
  "adagrad": lambda: optax.adagrad(1e-2),
  "clip_schedule_chain": lambda: optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)),
  ),
  "clip_by_value_chain": lambda: optax.chain(optax.clip(0.5), optax.adam(1e-3, b1=0.8)),
}

# One slice holding the whole state; slices of a few KiB, so that small leaves
# are grouped and the larger ones cut into rows.
CHUNKS = {"one_slice": 2**40, "streamed": 3000}


def with_int_leaves(tx):
  """Real models carry int leaves; optax users route them to set_to_zero."""
  return optax.multi_transform({"float": tx, "int": optax.set_to_zero()}, float_labels)


@pytest.mark.slow  # every optimizer: test_host_adam.py, test_composition.py run the host tier
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bit_identical_to_inner(name):
  params = model_params()
  inner = with_int_leaves(OPTIMIZERS[name]())
  want_params, want_state, want_updates = run(inner, params)
  tiers = [offlax.HostTier(chunk_bytes=c) for c in CHUNKS.values()]
  for tier in [*tiers, offlax.HostTier(compute="host")]:
    got_params, got_state, got_updates = run(offlax.offload(inner, tier), params)
    assert_trees_equal(got_params, want_params)
    assert_trees_equal(got_updates, want_updates)
    assert_trees_equal(got_state.inner_state, want_state)
    for x in jax.tree.leaves(got_state):
      assert x.sharding.memory_kind == ("pinned_host" if x.ndim else "device")


def test_every_array_state_leaf_in_pinned_host_after_init(params):
  state = offlax.offload(optax.adam(1e-3)).init(params)
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    want = "pinned_host" if leaf.ndim else "device"  # the documented scalar rule
    assert leaf.sharding.memory_kind == want, jax.tree_util.keystr(path)
  # The inner structure stays visible to optax's tree utilities.
  assert optax.tree_utils.tree_get(state, "count").sharding.memory_kind == "device"
  mu = optax.tree_utils.tree_get(state, "mu")
  assert jax.tree.structure(mu) == jax.tree.structure(params)


def test_bf16_params_keep_their_dtype(params):
  _, state, updates = run(
    offlax.offload(with_int_leaves(optax.adam(1e-3)), chunk_bytes=512), params
  )
  assert updates["embed"]["table"].dtype == jnp.bfloat16
  assert optax.tree_utils.tree_get(state, "mu")["embed"]["table"].dtype == jnp.bfloat16


def test_min_offload_bytes_keeps_small_leaves_on_device(params):
  tx = offlax.offload(optax.adam(1e-3), min_offload_bytes=65)
  state = tx.init(params)
  mu = optax.tree_utils.tree_get(state, "mu")
  assert mu["layers"][0]["attn"]["kernel"].sharding.memory_kind == "pinned_host"
  assert mu["layers"][0]["norm"]["scale"].sharding.memory_kind == "device"  # 64 bytes
  assert mu["temperature"].sharding.memory_kind == "device"
  assert mu["layers"][1]["mlp"]["bias"].sharding.memory_kind == "device"  # 64 bytes
  _, new_state = jax.jit(tx.update)(grads_like(params, 0), state, params)
  assert jax.tree.map(lambda x: x.sharding.memory_kind, new_state) == jax.tree.map(
    lambda x: x.sharding.memory_kind, state
  )


def test_init_accepts_shape_dtype_structs(params):
  tx = offlax.offload(optax.adamw(1e-3))
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  abstract = jax.eval_shape(tx.init, shapes)
  concrete = tx.init(params)
  assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(
    lambda a: (a.shape, a.dtype), concrete
  )
  state = tx.init(shapes)  # optax's init accepts shapes too
  mu = optax.tree_utils.tree_get(state, "mu")
  assert mu["layers"][0]["attn"]["kernel"].sharding.memory_kind == "pinned_host"
