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


@pytest.mark.slow
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
  assert _spaces(restored) == _spaces(s3)
  assert restored.spec.same(s3.spec)
  got, state = _steps(tx, p3, restored, 3, 5)
  assert_trees_equal(got, want)
  assert _kinds(state) == _kinds(s3)  # the state stayed in its tier


def _spaces(tree):
  return jax.tree.map(lambda x: jax.typeof(x).memory_space, tree)


def test_restored_host_arrays_are_typed_as_device_arrays(tmp_path):
  """Why `placed` exists (a SingleDeviceSharding target); if JAX fixes it, it is a no-op."""
  x = jax.device_put(jax.numpy.ones(8), jax.memory.Space.Host)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave({"x": x}))
    mngr.wait_until_finished()
    target = {"x": ocp.utils.to_shape_dtype_struct(x)}
    raw = mngr.restore(1, args=ocp.args.StandardRestore(target))
  fixed = offlax.placed(raw)
  assert raw["x"].sharding.memory_kind == fixed["x"].sharding.memory_kind == "pinned_host"
  assert jax.typeof(fixed["x"]).memory_space == jax.memory.Space.Host
  # offload refuses the unfixed state rather than move it to the device.
  params = {"w": jax.numpy.ones(8)}
  tx = offlax.offload(optax.sgd(0.1, momentum=0.9))
  state = tx.init(params)
  bad = jax.tree.map(lambda x: raw["x"] if x.ndim else x, state)
  with pytest.raises(offlax.errors.MemoryKindError, match=r"state leaf .*trace.* offlax.placed"):
    tx.update(params, bad, params)


@pytest.mark.slow  # long; the other checkpoint tests cover it
def test_plain_optax_checkpoint_restores_into_offload(tmp_path):
  params, inner = _params(), optax.adam(1e-3)
  want, _ = _steps(inner, params, inner.init(params), 0, 5)
  p3, plain = _steps(inner, params, inner.init(params), 0, 3)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(3, args=ocp.args.StandardSave(plain))
    mngr.wait_until_finished()
    target = offlax.abstract_state(inner, params)
    restored = mngr.restore(3, args=ocp.args.StandardRestore(target.inner_state))
    state = target._replace(inner_state=offlax.placed(restored))
  assert state.inner_state[0].mu["layers"][0]["mlp"]["kernel"].sharding.memory_kind == (
    "pinned_host"
  )
  got, state = _steps(offlax.offload(inner), p3, state, 3, 5)
  assert_trees_equal(got, want)
  assert state.inner_state[0].mu["head"][0].sharding.memory_kind == "pinned_host"


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
  # The offload transformation itself stands for its inner transformation and tier.
  assert offlax.abstract_state(tx, params) == abstract
  assert offlax.abstract_state(tx, params, offlax.HostTier(fraction=0.5)) == abstract  # equal
  with pytest.raises(offlax.errors.InvalidTierError, match="different tier"):
    offlax.abstract_state(tx, params, offlax.HostTier())


def test_abstract_state_of_the_nvme_tier_writes_nothing(tmp_path):
  """The NVMe tier's abstract state: what a new store would give (its arrays `OnDisk`), for a
  compile; no store is written (its checkpoint is its store, NVMeStoreSave)."""
  tier = offlax.NVMeTier(str(tmp_path / "s"), cache_bytes=0, progress=False)
  state = offlax.abstract_state(optax.adam(1e-3), _params(), tier)
  is_disk = lambda x: isinstance(x, offlax.extend.OnDisk)
  assert any(is_disk(x) for x in jax.tree.leaves(state.inner_state, is_leaf=is_disk))
  assert not (tmp_path / "s").exists()


@pytest.mark.slow  # a dtype change in a store with a cache; without one runs
def test_host_tier_checkpoint_into_an_nvme_store_and_back(tmp_path):
  params, inner = _params(), optax.adamw(1e-3)
  want, _ = _steps(inner, params, inner.init(params), 0, 7)
  host = offlax.offload(inner)
  p3, s3 = _steps(host, params, host.init(params), 0, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=ocp.args.StandardSave(s3))
    mngr.wait_until_finished()
    target = offlax.abstract_state(inner, params)
    restored = mngr.restore(3, args=ocp.args.StandardRestore(target))

  # host-tier checkpoint -> a new NVMe store, two steps there
  tier = offlax.NVMeTier(str(tmp_path / "store"), chunk_bytes=3000, cache_bytes=0, progress=False)
  on_disk = offlax.checkpoint.retier(inner, params, restored.inner_state, tier)
  assert not any(x.ndim for x in jax.tree.leaves(on_disk))  # every array in the store
  nvme = offlax.offload(inner, tier)
  p5, s5 = _steps(nvme, p3, on_disk, 3, 5)
  # ... and back to the host tier for the last two
  back = offlax.checkpoint.retier(inner, params, tier.read_state(s5), offlax.HostTier())
  tier.close()
  got, state = _steps(host, p5, back, 5, 7)
  assert_trees_equal(got, want)
  assert _kinds(state) == _kinds(s3)


def test_retier_refuses_another_optimizers_state(tmp_path):
  params = _params()
  with pytest.raises(offlax.errors.TreeMismatchError, match="not one of this optimizer.*structure"):
    offlax.checkpoint.retier(optax.adam(1e-3), params, optax.sgd(0.1, momentum=0.9).init(params),
                             offlax.HostTier())  # fmt: skip
  other = dict(params, temperature=jax.numpy.ones(2))
  with pytest.raises(
    offlax.errors.TreeMismatchError, match=r"leaf \[0\]\.mu\['temperature'\] is float32\[2\]"
  ):
    offlax.checkpoint.retier(
      optax.adam(1e-3), params, optax.adam(1e-3).init(other), offlax.HostTier()
    )


@pytest.mark.slow  # docs/checkpoints.md's blocks run it by default
def test_nvme_store_in_an_orbax_checkpoint(tmp_path):
  params, inner = _params(), optax.adam(1e-3)
  want, _ = _steps(inner, params, inner.init(params), 0, 5)
  options = dict(chunk_bytes=3000, cache_bytes=600, progress=False)
  tier = offlax.NVMeTier(str(tmp_path / "store"), **options)
  tx = offlax.offload(inner, tier)
  p3, s3 = _steps(tx, params, tx.init(params), 0, 3)
  manager_options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=manager_options) as mngr:
    mngr.save(
      3,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(p3), opt=offlax.checkpoint.NVMeStoreSave(tier)
      ),
    )
    _steps(tx, p3, s3, 3, 5)  # the store moves on; the checkpoint keeps step 3
    mngr.wait_until_finished()
    tier.close()
    restored = mngr.restore(
      3,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, p3)),
        opt=offlax.checkpoint.NVMeStoreRestore(str(tmp_path / "restored"), progress=False),
      ),
    )
  assert restored.opt == 3, f"the checkpoint holds store step {restored.opt}, expected 3"
  tier = offlax.NVMeTier(str(tmp_path / "restored"), resume=True, **options)
  tx = offlax.offload(inner, tier)
  got, _ = _steps(tx, restored.params, tx.init(params), 3, 5)
  tier.close()
  assert_trees_equal(got, want)
  with pytest.raises(offlax.errors.StoreExistsError, match="already holds"):
    offlax._src.nvme.copies.copy_store(str(tmp_path / "store"), str(tmp_path / "restored"))
