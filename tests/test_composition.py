"""offload composes with optax's wrappers, schedules and extra arguments."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_trees_equal, committed, committed_state, grads_like

import offlax

STREAM = 1024  # small slices, so that every test below streams


@pytest.fixture(params=["device", "host"])
def opts(request):
  """Each test runs in both compute modes (device: streamed in small slices)."""
  return dict(chunk_bytes=STREAM, compute=request.param)


def _params():
  """Committed as an offloaded step returns them: a jitted step compiles once, not twice."""
  k = jax.random.split(jax.random.key(1), 2)
  return committed(
    {
      "w": jax.random.normal(k[0], (32, 16)),
      "b": jnp.zeros(16),
      "v": jax.random.normal(k[1], (40,)),
    }
  )


def _train(tx, steps=3, **extra):
  params = _params()
  state = committed_state(tx.init(params))

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


# Device mode: test_offload_chain's clip-then-adamw and test_multi_transform_and_masked's
# offloads inside optax's wrappers run it against optax by default.
@pytest.mark.slow_except("host")
def test_chain_clip_then_offload(opts):
  _same_training(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(1e-3), **opts)),
  )


@pytest.mark.slow_except("device")
def test_offload_chain(opts):
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  _same_training(inner, offlax.offload(inner, **opts))


@pytest.mark.slow_except("device")
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


@pytest.mark.slow_except("device")
def test_multi_steps_outside_offload(opts):
  """Works on the CPU; on a GPU prefer offload(MultiSteps(...)) (docs/exactness.md)."""
  _same_training(
    optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    optax.MultiSteps(offlax.offload(optax.adam(1e-2), **opts), every_k_schedule=2),
    steps=4,
  )


# Device mode: test_multi_steps_outside_offload[device] streams MultiSteps' steps by default.
@pytest.mark.slow_except("host")
def test_multi_steps_inside_offload(opts):
  inner = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation()
  want_state, got_state = _same_training(inner, offlax.offload(inner, **opts), steps=4)
  acc = optax.tree_utils.tree_get(got_state, "acc_grads")
  assert acc["w"].sharding.memory_kind == "pinned_host"


@pytest.mark.slow_except("device")
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


@pytest.mark.slow_except("device")
def test_schedules(opts):
  schedule = optax.join_schedules(
    [optax.linear_schedule(0.0, 1e-2, 2), optax.exponential_decay(1e-2, 3, 0.5)], [2]
  )
  _same_training(optax.adam(schedule), offlax.offload(optax.adam(schedule), **opts), steps=5)


@pytest.mark.slow  # L-BFGS; test_composition.py passes an extra argument by default
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


@pytest.mark.slow_except("device")
def test_stateless_inner(opts):
  _same_training(optax.sgd(1e-2), offlax.offload(optax.sgd(1e-2), **opts))
  params = _params()
  assert jax.tree.leaves(offlax.offload(optax.sgd(1e-2)).init(params)) == []


@pytest.mark.slow_except("device-float32", "host-bfloat16")
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
  p, s = jax.tree.map(jnp.copy, params), committed_state(tx.init(params))
  want = params, committed_state(tx.init(params))
  for i in range(3):
    old = jax.tree.leaves(s)
    p, s = donated(p, s, grads_like(params, i))
    want = jax.jit(step)(*want, grads_like(params, i))
    assert all(x.is_deleted() for x in old if x.size)
  assert_trees_equal(p, want[0])
  assert_trees_equal(s, want[1])


# -- the fused step and abstract_state through optax's wrappers ----------------------

_MASK = {"w": True, "b": False, "v": True}
_CLIP = optax.clip_by_global_norm(1.0)
_WRAPPED = {
  # offload outermost: its own fused step, whatever it wraps.
  "offload(chain)": ("own", lambda o: o(optax.chain(_CLIP, optax.adam(1e-2)))),
  "offload(masked)": ("own", lambda o: o(optax.masked(optax.adam(1e-2), _MASK))),
  "offload(inject_hyperparams)": (
    "own", lambda o: o(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
  ),
  "offload(MultiSteps)": (
    "own", lambda o: o(optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation())
  ),
  # A wrapper rebuilds the transformation from its (init, update) pair; an offload
  # inside whose updates are the step's is asked to fuse through an extra argument.
  "chain(offload)": ("wrapped", lambda o: optax.chain(_CLIP, o(optax.adam(1e-2)))),
  "masked(offload)": ("wrapped", lambda o: optax.masked(o(optax.adam(1e-2)), _MASK)),
  "inject_hyperparams(offload)": (
    "wrapped",
    lambda o: optax.inject_hyperparams(lambda learning_rate: o(optax.adam(learning_rate)))(
      learning_rate=1e-2
    ),
  ),
  "MultiSteps(offload)": ("own", lambda o: optax.MultiSteps(o(optax.adam(1e-2)), 2)),
  # Updates read by a later transformation, or selected per micro-step: update, then apply.
  "chain(offload, scale)": (None, lambda o: optax.chain(o(optax.adam(1e-2)), optax.scale(0.5))),
  "MultiSteps(offload).gradient_transformation": (
    None, lambda o: optax.MultiSteps(o(optax.adam(1e-2)), 2).gradient_transformation()
  ),
  "multi_transform(offload)": ("wrapped", lambda o: optax.multi_transform(
    {"a": o(optax.adam(1e-2)), "b": optax.sgd(0.1)}, {"w": "a", "b": "b", "v": "a"}
  )),
  # A wrapper whose update takes no extra arguments (optax.lookahead's, a user's own).
  "GradientTransformation(offload)": (None, lambda o: (lambda t: optax.GradientTransformation(
    t.init, lambda u, s, p=None: t.update(u, s, p)
  ))(o(optax.adam(1e-2)))),
}  # fmt: skip


@pytest.mark.slow_except(  # masked(offload): chain(offload) asks a wrapped offload to fuse
  "offload(chain)",
  "chain(offload)",
  "MultiSteps(offload)",
  "chain(offload, scale)",
  "GradientTransformation(offload)",
)
@pytest.mark.parametrize("name", list(_WRAPPED))
def test_wrappers_keep_the_fused_step_and_abstract_state(name, monkeypatch):
  from offlax._src import wrapped_apply
  from offlax._src.apply import fused_update_and_apply

  how, make = _WRAPPED[name]
  tier = offlax.HostTier(chunk_bytes=STREAM)
  tx = make(lambda inner: offlax.offload(inner, tier))
  assert (fused_update_and_apply(tx) is not None) == (how == "own")
  asked = []  # what each offload inside a wrapper was asked: fuse or not, per call
  serve = wrapped_apply.Request.serve
  monkeypatch.setattr(
    wrapped_apply.Request, "serve", lambda r, *a, **k: asked.append(r.fuse) or serve(r, *a, **k)
  )
  params = _params()
  state = committed_state(tx.init(params))

  # The tier of every offload is in the state's structure: abstract_state finds it.
  target = offlax.abstract_state(tx, params)
  assert jax.tree.structure(target) == jax.tree.structure(state)
  kinds = lambda t: [x.sharding.memory_kind for x in jax.tree.leaves(t)]
  assert kinds(target) == kinds(state) and "pinned_host" in kinds(state)
  is_state = lambda x: isinstance(x, offlax.OffloadState)
  found = [x for x in jax.tree.leaves(target, is_leaf=is_state) if is_state(x)]
  assert [x.tier for x in found] == [tier]

  @jax.jit
  def unfused(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(offlax.update_and_apply, static_argnums=0)
  want = got = (params, state)
  for i in range(3):
    want = unfused(*want, grads_like(params, i))
    got = step(tx, grads_like(params, i), got[1], got[0])
  assert_trees_equal(got, want)
  assert any(f is not None and all(f) for f in asked) == (how == "wrapped")


def _keeping(inner, combine):
  """A wrapper whose state is `combine(its state, the inner's updates)`."""

  def init(params):
    return inner.init(params), jax.tree.map(jnp.zeros_like, params)

  def update(updates, state, params=None, **extra):
    updates, inner_state = inner.update(updates, state[0], params, **extra)
    return updates, (inner_state, jax.tree.map(combine, state[1], updates))

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize(
  "combine",
  [  # a wrapper that keeps them reads them as one that sums them does (by default)
    pytest.param(lambda s, u: u, marks=pytest.mark.slow, id="keeps-the-updates"),
    pytest.param(jnp.add, id="sums-the-updates"),
  ],
)
def test_a_wrapper_that_reads_the_updates_gets_them(combine):
  """An offload whose updates a wrapper keeps or sums is not fused: the state stays exact."""
  params = _params()
  tx = _keeping(offlax.offload(optax.adam(1e-2), offlax.HostTier(chunk_bytes=STREAM)), combine)
  want_tx = _keeping(optax.adam(1e-2), combine)
  got, state = params, committed_state(tx.init(params))
  want, want_state = params, committed_state(want_tx.init(params))
  step = jax.jit(offlax.update_and_apply, static_argnums=0)
  for i in range(3):
    got, state = step(tx, grads_like(params, i), state, got)
    updates, want_state = jax.jit(want_tx.update)(grads_like(params, i), want_state, want)
    want = optax.apply_updates(want, updates)
  assert_trees_equal(got, want)
  assert_trees_equal(state[1], want_state[1])
