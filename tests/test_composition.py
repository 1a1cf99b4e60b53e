"""offload composes with optax's wrappers, schedules and extra arguments."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_trees_equal, grads_like

import offlax

STREAM = 1024  # small slices, so that every test below streams


@pytest.fixture(params=["device", "host"])
def opts(request):
  """Each test runs in both compute modes (device: streamed in small slices)."""
  return dict(chunk_bytes=STREAM, compute=request.param)


def _params():
  k = jax.random.split(jax.random.key(1), 2)
  return {
    "w": jax.random.normal(k[0], (32, 16)),
    "b": jnp.zeros(16),
    "v": jax.random.normal(k[1], (40,)),
  }


def _train(tx, steps=3, **extra):
  params = _params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  for i in range(steps):
    params, state = step(params, state, grads_like(params, i))
  return params, state


def _same_training(plain, wrapped, steps=3):
  want_params, want_state = _train(plain, steps)
  got_params, got_state = _train(wrapped, steps)
  assert_trees_equal(got_params, want_params)
  return want_state, got_state


def test_chain_clip_then_offload(opts):
  _same_training(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(1e-3), **opts)),
  )


def test_offload_chain(opts):
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  _same_training(inner, offlax.offload(inner, **opts))


def test_inject_hyperparams_readable_and_settable(opts):
  make = lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.1)
  tx = offlax.offload(make(), **opts)
  params = _params()
  state = tx.init(params)
  lr = optax.tree_utils.tree_get(state, "learning_rate")
  assert float(lr) == pytest.approx(1e-3)
  assert lr.sharding.memory_kind == "device"  # scalars stay on the device (HostTier rule)

  state = optax.tree_utils.tree_set(state, learning_rate=jnp.float32(0.5))
  plain = make()
  plain_state = optax.tree_utils.tree_set(plain.init(params), learning_rate=jnp.float32(0.5))
  grads = grads_like(params, 0)
  got, state = jax.jit(tx.update)(grads, state, params)
  want, _ = jax.jit(plain.update)(grads, plain_state, params)
  assert_trees_equal(got, want)
  assert float(optax.tree_utils.tree_get(state, "learning_rate")) == 0.5
  mu = optax.tree_utils.tree_get(state, "mu")
  assert mu["w"].sharding.memory_kind == "pinned_host"


def test_multi_steps_outside_offload(opts):
  """Works on the CPU; on a GPU prefer offload(MultiSteps(...)) (docs/exactness.md)."""
  _same_training(
    optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    optax.MultiSteps(offlax.offload(optax.adam(1e-2), **opts), every_k_schedule=2),
    steps=4,
  )


def test_multi_steps_inside_offload(opts):
  inner = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation()
  want_state, got_state = _same_training(inner, offlax.offload(inner, **opts), steps=4)
  acc = optax.tree_utils.tree_get(got_state, "acc_grads")
  assert acc["w"].sharding.memory_kind == "pinned_host"


def test_multi_transform_and_masked(opts):
  labels = {"w": "adam", "b": "sgd", "v": "adam"}
  _same_training(
    optax.multi_transform({"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-2)}, labels),
    optax.multi_transform(
      {"adam": offlax.offload(optax.adam(1e-3), **opts), "sgd": optax.sgd(1e-2)},
      labels,
    ),
  )
  decay_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  masked = optax.chain(optax.adam(1e-3), optax.masked(optax.add_decayed_weights(0.1), decay_mask))
  _same_training(masked, offlax.offload(masked, **opts))
  masked_inside = optax.masked(offlax.offload(optax.adam(1e-3), **opts), decay_mask)
  _same_training(optax.masked(optax.adam(1e-3), decay_mask), masked_inside)


def test_schedules(opts):
  schedule = optax.join_schedules(
    [optax.linear_schedule(0.0, 1e-2, 2), optax.exponential_decay(1e-2, 3, 0.5)], [2]
  )
  _same_training(optax.adam(schedule), offlax.offload(optax.adam(schedule), **opts), steps=5)


def test_extra_args_reach_the_inner_update(opts):
  """L-BFGS needs value, grad and value_fn; they are passed through unchanged."""
  target = jnp.linspace(-1.0, 1.0, 40)

  def loss(p):
    return jnp.sum((p["v"] - target) ** 2) + jnp.sum(p["w"] ** 2) + jnp.sum((p["b"] - 1) ** 2)

  def solve(tx):
    params = _params()
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      value, grad = jax.value_and_grad(loss)(params)
      updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=loss)
      return optax.apply_updates(params, updates), state

    for _ in range(5):
      params, state = step(params, state)
    return params

  want = solve(optax.lbfgs())
  got = solve(offlax.offload(optax.lbfgs(), **opts))
  assert_trees_equal(got, want)
  assert float(loss(got)) < 1e-3


def test_plain_gradient_transformation_gets_extra_args_support():
  tx = offlax.offload(
    optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s))
  )
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  params = _params()
  updates, _ = tx.update(params, tx.init(params), params, unused_extra=1.0)
  assert_trees_equal(updates, params)


def test_stateless_inner(opts):
  _same_training(optax.sgd(1e-2), offlax.offload(optax.sgd(1e-2), **opts))
  params = _params()
  assert jax.tree.leaves(offlax.offload(optax.sgd(1e-2)).init(params)) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_donating_params_and_state(opts, dtype):
  """The step as optax loops write it, params and state donated: exact, buffers reused."""
  params = jax.tree.map(lambda x: x.astype(dtype), _params())
  inner = optax.adam(1e-3) if dtype == "float32" else offlax.master_weights(optax.adam(1e-3))
  tx = offlax.offload(inner, **opts)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  donated = jax.jit(step, donate_argnums=(0, 1))
  p, s = jax.tree.map(jnp.copy, params), tx.init(params)
  want = params, tx.init(params)
  for i in range(3):
    old = jax.tree.leaves(s)
    p, s = donated(p, s, grads_like(params, i))
    want = jax.jit(step)(*want, grads_like(params, i))
    assert all(x.is_deleted() for x in old if x.size)
  assert_trees_equal(p, want[0])
  assert_trees_equal(s, want[1])
