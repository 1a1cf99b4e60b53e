"""Orbax checkpoints of offloaded state: round trips, async saves, plain optax checkpoints."""

import jax
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_trees_equal, grads_like, model_params

import offlax


def _params():
  params = model_params()
  del params["steps_seen"]
  params["head"] = params["head"][:1]  # orbax cannot save zero-size arrays (plain optax neither)
  return params


def _steps(tx, params, state, start, stop):
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  for i in range(start, stop):
    updates, state = step(params, state, grads_like(params, i))
    params = optax.apply_updates(params, updates)
  return params, state


def _kinds(tree):
  return jax.tree.map(lambda x: x.sharding.memory_kind, tree)


def test_async_round_trip_resumes_bit_exactly(tmp_path):
  params, inner = _params(), optax.adamw(1e-3)
  tier = offlax.HostTier(chunk_bytes=1024, select="mu|nu")
  tx = offlax.offload(inner, tier)
  want, _ = _steps(tx, params, tx.init(params), 0, 5)

  p3, s3 = _steps(tx, params, tx.init(params), 0, 3)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  with ocp.CheckpointManager(tmp_path, options=options) as mngr:
    mngr.save(3, args=ocp.args.StandardSave(s3))
    _steps(tx, p3, s3, 3, 5)  # training goes on while the save finishes
    mngr.wait_until_finished()
    target = offlax.abstract_state(inner, params, tier)
    assert _kinds(target) == _kinds(s3)
    restored = mngr.restore(3, args=ocp.args.StandardRestore(target))
  assert _kinds(restored) == _kinds(s3)
  assert restored.spec == s3.spec
  got, _ = _steps(tx, p3, restored, 3, 5)
  assert_trees_equal(got, want)


def test_plain_optax_checkpoint_restores_into_offload(tmp_path):
  params, inner = _params(), optax.adam(1e-3)
  want, _ = _steps(inner, params, inner.init(params), 0, 5)
  p3, plain = _steps(inner, params, inner.init(params), 0, 3)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(3, args=ocp.args.StandardSave(plain))
    mngr.wait_until_finished()
    target = offlax.abstract_state(inner, params)
    state = target._replace(
      inner_state=mngr.restore(3, args=ocp.args.StandardRestore(target.inner_state))
    )
  assert state.inner_state[0].mu["layers"][0]["mlp"]["kernel"].sharding.memory_kind == (
    "pinned_host"
  )
  got, _ = _steps(offlax.offload(inner), p3, state, 3, 5)
  assert_trees_equal(got, want)


def test_abstract_state_is_placed_like_init():
  params = _params()
  tier = offlax.HostTier(fraction=0.5)
  tx = offlax.offload(optax.adamw(1e-3), tier)
  abstract = offlax.abstract_state(optax.adamw(1e-3), params, tier)
  state = tx.init(params)
  assert _kinds(abstract) == _kinds(state)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), abstract) == jax.tree.map(
    lambda x: (x.shape, x.dtype), state
  )


def test_abstract_state_refuses_the_nvme_tier(tmp_path):
  with pytest.raises(offlax.InvalidTierError, match="NVMeTier"):
    offlax.abstract_state(optax.adam(1e-3), _params(), offlax.NVMeTier(str(tmp_path)))
