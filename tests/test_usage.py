"""offlax used the way people use optax, orbax and notebooks (issue 18).

AOT lowering from specs of live state, optax's tree utilities, compile counts,
every optax alias with every tier, orbax saves of NVMe state, interrupts, and
reopening a store in the same process.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import offlax


def _params():
  return {"w": jnp.arange(12.0).reshape(4, 3) / 10, "b": jnp.zeros(3)}


def _grads(params, i=0):
  return jax.tree.map(lambda x: jnp.sin(x + i + 1.0), params)


HOST_TIERS = {
  "device": lambda: offlax.HostTier(chunk_bytes=32),
  "host": lambda: offlax.HostTier(compute="host"),
}


def _nvme(path, **kw):
  return offlax.NVMeTier(path, cache_bytes=0, chunk_bytes=32, progress=False, fsync=False, **kw)


def _specs(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _train(tx):
  def train(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return train


# -- 1. AOT lowering from specs of live state ----------------------------------


@pytest.mark.parametrize("mode", HOST_TIERS)
def test_specs_of_live_state_lower_and_export_on_one_device(mode):
  params = _params()
  tx = offlax.offload(optax.adam(1e-3), HOST_TIERS[mode]())
  state = tx.init(params)
  train = jax.jit(_train(tx))
  for _ in range(2):  # the state init returns, then the state a step returns
    specs = _specs((params, state, _grads(params)))
    train.lower(*specs).compile()
    jax.export.export(train, platforms=["cuda"])(*specs)
    params, state = train(params, state, _grads(params))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.inner_state[0].mu)}
  assert kinds == {"pinned_host"}


def test_specs_of_state_committed_like_single_device_params_lower_after_placed():
  """Params committed with a SingleDeviceSharding: the step returns state sharded so too."""
  params = jax.device_put(_params(), jax.devices()[0])
  tx = offlax.offload(optax.adam(1e-3))
  train = jax.jit(_train(tx))
  params, state = train(params, tx.init(params), _grads(params))
  specs = _specs((params, state, _grads(params)))
  with pytest.raises(offlax.MemoryKindError, match=r"offlax\.placed"):
    train.lower(*specs)
  train.lower(*offlax.placed(specs)).compile()


def test_eval_shape_of_init_and_abstract_state_as_lowering_specs():
  params = _params()
  tx = offlax.offload(optax.adam(1e-3))
  shapes = jax.eval_shape(tx.init, params)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
    lambda x: (x.shape, x.dtype), tx.init(params)
  )
  # eval_shape keeps no memory kinds (JAX); abstract_state does, and lowers.
  target = offlax.abstract_state(tx, params)
  jax.jit(_train(tx)).lower(params, target, params).compile()


# -- 2. abstract_state of a chain ---------------------------------------------------


def test_abstract_state_of_a_chain_holding_offload_restores_with_orbax(tmp_path):
  params = _params()
  tx = optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adam(1e-3)))
  state = tx.init(params)
  _, state = jax.jit(tx.update)(_grads(params), state, params)
  target = offlax.abstract_state(tx, params)
  assert isinstance(target, tuple) and isinstance(target[1], offlax.OffloadState)
  assert jax.tree.structure(target) == jax.tree.structure(state)
  assert [x.sharding.memory_kind for x in jax.tree.leaves(target)] == [
    x.sharding.memory_kind for x in jax.tree.leaves(state)
  ]
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=ocp.args.StandardRestore(target))
  want, _ = jax.jit(tx.update)(_grads(params, 1), state, params)
  got, _ = jax.jit(tx.update)(_grads(params, 1), restored, params)
  np.testing.assert_array_equal(got["w"], want["w"])


def test_abstract_state_of_a_chain_refuses_another_tier():
  tx = optax.chain(optax.clip(1.0), offlax.offload(optax.sgd(0.1, 0.9)))
  with pytest.raises(offlax.InvalidTierError, match="omit tier"):
    offlax.abstract_state(tx, _params(), offlax.HostTier(compute="host"))


# -- 3. optax's tree utilities -----------------------------------------------------


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_optax_tree_utilities_work_on_offloaded_state(tier, tmp_path):
  params = _params()
  made = _nvme(str(tmp_path)) if tier == "nvme" else HOST_TIERS[tier]()
  tx = offlax.offload(optax.adam(1e-3), made)
  plain = optax.adam(1e-3)
  state = tx.init(params)
  # map_params re-inits on a placeholder and maps it together with the state.
  mapped = optax.tree.map_params(tx, lambda x: x, state)
  assert jax.tree.structure(mapped) == jax.tree.structure(state)
  shardings = optax.tree.map_params(
    tx, lambda x: x.sharding, state, transform_non_params=lambda x: None
  )
  if tier != "nvme":
    assert shardings.inner_state[0].mu["w"].memory_kind == "pinned_host"
  assert optax.tree.get(mapped, "count") == 0
  set_ = optax.tree.set(state, count=jnp.int32(5))
  assert int(optax.tree.get(set_, "count")) == 5
  # The mapped state (its spec the placeholder's) still updates like plain optax.
  want, _ = plain.update(_grads(params), plain.init(params), params)
  got, _ = jax.jit(tx.update)(_grads(params), mapped, params)
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
  if tier == "nvme":
    made.close()


# -- 4. one compilation ------------------------------------------------------------


def _compiles(tx, params, calls=3):
  counted = []

  def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      counted.append(event)

  state = tx.init(params)
  train = jax.jit(_train(tx))
  grads = [_grads(params, i) for i in range(calls)]  # (eager ops compile too)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for g in grads:
      params, state = train(params, state, g)
    jax.block_until_ready(params)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return len(counted)


def _committed(kind):
  device = jax.devices()[0]
  if kind == "single_device":
    return jax.device_put(_params(), device)
  mesh = jax.sharding.Mesh(np.array([device]), ("batch",))
  return jax.device_put(_params(), NamedSharding(mesh, P()))


@pytest.mark.parametrize("placement", ["single_device", "one_device_mesh"])
@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_jitted_step_compiles_once(tier, placement, tmp_path):
  made = _nvme(str(tmp_path)) if tier == "nvme" else HOST_TIERS[tier]()
  tx = offlax.offload(optax.adam(1e-3), made)
  assert _compiles(tx, _committed(placement)) == 1
  if tier == "nvme":
    made.close()


def test_uncommitted_params_cost_one_more_compile_only():
  """JAX commits what a program that moves memory returns: the params too (README)."""
  assert _compiles(offlax.offload(optax.adam(1e-3)), _params(), calls=4) == 2


# -- 5. every optax alias with every tier -----------------------------------------


def _loss(params):
  return sum(jnp.sum(x**2) for x in jax.tree.leaves(params))


def _alias(name):
  make = getattr(optax, name)
  if name == "polyak_sgd":
    return make()
  if name == "lbfgs":
    return make()
  if name == "noisy_sgd":
    return make(1e-2, key=jax.random.key(0))
  return make(1e-2)


def _extra(name, params):
  if name == "polyak_sgd":
    return {"value": _loss(params)}
  if name == "lbfgs":
    return {"value": _loss(params), "grad": jax.grad(_loss)(params), "value_fn": _loss}
  return {}


ALIASES = (
  "adabelief adadelta adafactor adagrad adam adamax adamaxw adamw adan amsgrad fromage lamb lars "
  "lbfgs lion noisy_sgd novograd optimistic_adam optimistic_adam_v2 optimistic_gradient_descent "
  "polyak_sgd radam rmsprop rprop sgd sign_sgd signum sm3 yogi"
).split()
# States of unusual shape: no arrays, a PRNG key, per-dimension lists, factored
# moments, a line search's extra arguments. The rest run with the slow tests.
UNUSUAL = ("sign_sgd", "fromage", "polyak_sgd", "noisy_sgd", "sm3", "adafactor", "lbfgs")


def test_the_alias_list_is_optaxs():
  from optax._src import alias

  public = {
    n
    for n in dir(alias)
    if not n.startswith("_") and getattr(getattr(alias, n), "__module__", "") == alias.__name__
  }
  assert public - {"Optimizer"} >= set(ALIASES) and set(ALIASES) >= {
    n for n in public if callable(getattr(optax, n, None)) and n != "Optimizer"
  }


@pytest.mark.parametrize(
  "name", [n if n in UNUSUAL else pytest.param(n, marks=pytest.mark.slow) for n in ALIASES]
)
@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_every_optax_alias_works_with_every_tier(name, tier, tmp_path):
  params = _params()
  made = _nvme(str(tmp_path)) if tier == "nvme" else HOST_TIERS[tier]()
  plain, tx = _alias(name), offlax.offload(_alias(name), made)
  plain_state, state = plain.init(params), tx.init(params)
  for i in range(2):
    grads = jax.grad(_loss)(params)
    extra = _extra(name, params)
    want, plain_state = plain.update(grads, plain_state, params, **extra)
    value_fn = extra.pop("value_fn", None)
    got, state = jax.jit(
      lambda g, s, p, e: tx.update(g, s, p, **e, **({"value_fn": value_fn} if value_fn else {}))
    )(grads, state, params, extra)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=f"{name} step {i}")
    params = optax.apply_updates(params, want)
  if tier == "nvme":
    made.close()
    # The store reopens into the same state (a PRNG key is stored as its key data).
    again = _nvme(str(tmp_path), resume=True)
    resumed = offlax.offload(_alias(name), again).init(params)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state), strict=True):
      if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
      np.testing.assert_array_equal(a, b)
    again.close()


# -- 13. messages --------------------------------------------------------------------


def test_nvme_tier_chunk_bytes_error_names_nvme_tier(tmp_path):
  with pytest.raises(offlax.InvalidTierError, match=r"^NVMeTier\.chunk_bytes .* got 0"):
    offlax.NVMeTier(str(tmp_path), chunk_bytes=0)


def test_nested_offload_is_refused_clearly(tmp_path):
  with pytest.raises(offlax.TransformationTypeError, match=r"offload\(offload"):
    offlax.offload(offlax.offload(optax.adam(1e-3)))
  nested = offlax.offload(optax.chain(optax.clip(1.0), offlax.offload(optax.adam(1e-3))))
  with pytest.raises(offlax.TransformationTypeError, match="Offload once"):
    nested.init(_params())


def test_stats_finds_the_offload_state_inside_a_chain():
  tier = offlax.HostTier()
  tx = optax.chain(optax.clip(1.0), offlax.offload(optax.adam(1e-3), tier))
  state = tx.init(_params())
  assert offlax.stats(state, tier) == offlax.stats(state[1], tier)
  assert offlax.stats(state, tier).host_bytes == 2 * 15 * 4
  with pytest.raises(offlax.TreeMismatchError, match="holding none"):
    offlax.stats(optax.adam(1e-3).init(_params()), tier)
