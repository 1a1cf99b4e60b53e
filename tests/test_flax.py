"""Flax NNX and Linen train with offloaded state exactly as with the plain optimizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal
from flax import linen, nnx
from flax.training import train_state

import offlax

X = jnp.linspace(-1.0, 1.0, 64).reshape(16, 4)
Y = jnp.sin(X.sum(axis=1, keepdims=True))


def _tiers(tmp_path):
  return {
    "host": lambda: offlax.HostTier(chunk_bytes=256),
    "host_compute": lambda: offlax.HostTier(compute="host"),
    "nvme": lambda: offlax.NVMeTier(
      str(tmp_path / "store"), chunk_bytes=512, cache_bytes=0, progress=False
    ),
  }


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(4, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def _nnx_run(tx, steps=4):
  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, X, Y)) for _ in range(steps)]
  return model, optimizer, losses


@functools.cache
def _nnx_reference():
  """Plain optax's run, the same for every tier: trained (and compiled) once per process."""
  return _nnx_run(optax.adamw(1e-2))


@pytest.mark.parametrize("tier", ["host", "host_compute", "nvme"])
def test_nnx_optimizer(tier, tmp_path):
  want_model, _, want_losses = _nnx_reference()
  made = _tiers(tmp_path)[tier]()
  model, optimizer, losses = _nnx_run(offlax.offload(optax.adamw(1e-2), made))
  assert losses == want_losses and losses[-1] < losses[0]
  assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param))
  _check_placed(jax.tree.leaves(nnx.state(optimizer.opt_state)), made)


def _check_placed(state_leaves, tier):
  """Arrays in pinned_host; for the NVMe tier (no cache here) none in RAM and 4 commits."""
  kinds = {x.sharding.memory_kind for x in state_leaves if np.ndim(x)}
  if isinstance(tier, offlax.NVMeTier):
    assert kinds == set() and tier.store.step == 4
    tier.close()
  else:
    assert kinds == {"pinned_host"}


class LinenMLP(linen.Module):
  @linen.compact
  def __call__(self, x):
    return linen.Dense(1)(jax.nn.relu(linen.Dense(32)(x)))


def _linen_run(tx, steps=4):
  module = LinenMLP()
  params = module.init(jax.random.key(0), X)["params"]
  state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)

  @jax.jit
  def step(state, x, y):
    loss_fn = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(steps):
    state, loss = step(state, X, Y)
    losses.append(float(loss))
  return state, losses


@pytest.mark.parametrize(
  "tier",
  [
    "host",
    pytest.param("host_compute", marks=pytest.mark.slow),
    pytest.param("nvme", marks=pytest.mark.slow),
  ],
)
def test_linen_train_state(tier, tmp_path):
  want, want_losses = _linen_run(optax.adamw(1e-2))
  made = _tiers(tmp_path)[tier]()
  got, losses = _linen_run(offlax.offload(optax.adamw(1e-2), made))
  assert losses == want_losses and losses[-1] < losses[0]
  assert_trees_equal(got.params, want.params)
  assert int(got.step) == 4
  _check_placed(jax.tree.leaves(got.opt_state), made)


def test_nnx_state_keeps_its_memory_kind_where_frameworks_place_it_by_specs():
  """What Tunix does with an optimizer's state: both keep pinned_host (flax_glue's two fixes).

  A JAX or Flax release that changes either function makes this fail here, in
  the default run, rather than in Tunix's slow end-to-end test.
  """
  from flax import nnx
  from jax.sharding import PartitionSpec as P

  model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, offlax.offload(optax.adam(1e-3)), wrt=nnx.Param)
  mu = optimizer.opt_state.inner_state[0].mu["kernel"]
  assert mu.get_metadata()["memory_kind"] == "pinned_host"
  mesh = jax.make_mesh((1,), ("d",))
  # Tunix's restore target: shardings from the state's metadata.
  shardings = nnx.get_named_sharding(nnx.state(optimizer.opt_state), mesh)
  kinds = {s.memory_kind for s in jax.tree.leaves(shardings) if s.memory_kind}
  assert kinds == {"pinned_host", "device"}  # the moments, and the step count
  # Tunix's _shard_optimizer: an eager constraint of the state by its partition specs.
  state = nnx.state(optimizer.opt_state)
  with mesh:  # as Tunix enters its mesh
    moved = jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
    plain = jax.lax.with_sharding_constraint(mu[...], P())  # not in offlax's Variable: JAX's
  assert {x.sharding.memory_kind for x in jax.tree.leaves(moved) if x.ndim} == {"pinned_host"}
  assert plain.sharding.memory_kind == "device"
