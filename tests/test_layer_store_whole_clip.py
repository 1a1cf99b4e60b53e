"""A global-norm clip over the whole model: layers in a `LayerStore`, the rest on the device.

The store's optimizer is ``optax.chain(optax.clip_by_global_norm(c), tx)``, the rest's
``optax.chain(offlax.clip_by_global_norm(c, store=store), tx)``. The reference is one
``optax.chain(clip, tx)`` over the whole model in memory: each step's gradients from one
jitted function, the chain's update from another. The store and the rest's callback sum the
squares in float32 in another order than XLA: the norm is checked to float32's rounding
(relative 1e-6), and, given the store's norm in place of optax's, the params of layers and
rest to the bit. SGD's step is the scale times the gradient, so a wrong scale fails; Adam's
(slow) is checked to a tolerance, XLA fusing its update with the clip in another program.
Default cases: the clip applying in both modes, and the errors; the rest are slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_layer_update import D, assert_bits, batch, make_layers

import offlax
from offlax._src import errors

SMALL, BIG = 1e-2, 1e6  # a clip that always applies here, one that never does (asserted)


def make_rest():
  return {"emb": jax.random.normal(jax.random.key(7), (D, D)) * 0.3, "head": jnp.full((D,), 0.2)}


def loss(layers, rest, x):
  h = jnp.tanh(x @ rest["emb"])
  h, _ = offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), h, layers)
  return jnp.mean((h @ rest["head"]) ** 2)


grads = jax.jit(jax.grad(loss, argnums=(0, 1)))


def sgd():
  return optax.sgd(1.0)


def adam():
  return optax.adam(1e-2)


def train(path, c, tail, update, steps=2):
  """`steps` steps: layers in a store, the rest's chain clipped by the whole norm; the
  params of both and each step's norm (the store's, and the rest's state's)."""
  store = offlax.LayerStore.create(path, make_layers(jnp.float32), update=update,
                                   optimizer=optax.chain(optax.clip_by_global_norm(c), tail()),
                                   progress=False)  # fmt: skip
  tx = optax.chain(offlax.clip_by_global_norm(c, store=store), tail())

  @jax.jit
  def rest_update(source_grads, rest_grads, state, rest):
    u, state = tx.update(rest_grads, state, rest, layer_grads=source_grads)
    return optax.apply_updates(rest, u), state

  rest, stats = make_rest(), []
  state = tx.init(rest)
  with store:
    for step in range(steps):
      rest, state = rest_update(*grads(store.source(), rest, batch(step, jnp.float32)),
                                state, rest)  # fmt: skip
      store.update(rest=(rest, state))
      stats.append(store.last_update)
      assert float(state[0].norm) == stats[-1].grad_norm  # one norm, for the rest and the layers
    return store.read_params(), rest, stats


def reference(c, tail, steps=2, norms=None):
  """The chain over the whole model in memory; with `norms`, each step's norm is that one
  in place of optax's (its clip's expression, fused with the tail's update as in a chain)."""
  tx, model = (
    optax.chain(optax.clip_by_global_norm(c), tail()),
    (make_layers(jnp.float32), make_rest()),
  )

  @jax.jit
  def given(g, state, params, n):
    g = jax.tree.map(lambda t: jax.lax.select(n < c, t, (t / n.astype(t.dtype)) * c), g)
    u, state = tail().update(g, state, params)
    return optax.apply_updates(params, u), state

  @jax.jit
  def chain(g, state, params):
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  state = tail().init(model) if norms is not None else tx.init(model)
  seen = []
  for step in range(steps):
    g = grads(*model, batch(step, jnp.float32))
    seen.append(float(jax.jit(optax.tree.norm)(g)))
    if norms is None:
      model, state = chain(g, state, model)
    else:
      model, state = given(g, state, model, jnp.float32(norms[step]))
  return model, seen


CASES = [
  pytest.param("explicit", SMALL, id="explicit-clip-applies", marks=pytest.mark.slow),
  pytest.param("backward", SMALL, id="backward-clip-applies"),  # (explicit: the test below)
  pytest.param("explicit", BIG, id="explicit-clip-idle", marks=pytest.mark.slow),
  pytest.param("backward", BIG, id="backward-clip-idle", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("update, c", CASES)
def test_the_whole_model_s_norm_clips_layers_and_rest(tmp_path, update, c):
  layers, rest, stats = train(str(tmp_path / "s"), c, sgd, update)
  # The chain over the model in memory, each step's norm the store's: optax's norm of the
  # same gradients to float32's rounding, and the params to the bit.
  given, norms = reference(c, sgd, norms=[s.grad_norm for s in stats])
  assert all(SMALL * 10 < n < BIG / 10 for n in norms)  # the clip applies, or not
  assert [s.clipped for s in stats] == [c == SMALL] * 2
  np.testing.assert_allclose([s.grad_norm for s in stats], norms, rtol=1e-6)
  assert_bits((layers, rest), given)


@pytest.mark.slow
@pytest.mark.parametrize("update", ["explicit", "backward"])
def test_adam_clipped_by_the_whole_norm(tmp_path, update):
  """Against optax's own chain (its own norm): the params to the norm's rounding."""
  layers, rest, stats = train(str(tmp_path / "s"), SMALL, adam, update)
  (want_layers, want_rest), norms = reference(SMALL, adam)
  np.testing.assert_allclose([s.grad_norm for s in stats], norms, rtol=1e-6)
  for got, want in [(layers, want_layers), (rest, want_rest)]:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_a_store_without_the_clip_or_another_bound_is_refused(tmp_path):
  layers = make_layers(jnp.float32)
  with offlax.LayerStore.create(str(tmp_path / "a"), layers, optimizer=sgd(),
                                progress=False) as store:  # fmt: skip
    with pytest.raises(errors.InvalidOptionError, match=r"no global-norm clip.*"
                       r"optax.chain\(optax.clip_by_global_norm\(0.5\), tx\)"):  # fmt: skip
      offlax.clip_by_global_norm(0.5, store=store)
  with offlax.LayerStore.create(str(tmp_path / "b"), layers, progress=False) as store:
    with pytest.raises(errors.InvalidOptionError, match="no optimizer"):
      offlax.clip_by_global_norm(0.5, store=store)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), sgd())
  with offlax.LayerStore.create(str(tmp_path / "c"), layers, progress=False,
                                optimizer=clipped) as s:  # fmt: skip
    with pytest.raises(errors.InvalidOptionError, match=r"max_norm=0.5, and the store .* "
                       r"clips to max_norm=1.0"):  # fmt: skip
      offlax.clip_by_global_norm(0.5, store=s)
    tx = optax.chain(offlax.clip_by_global_norm(1.0, store=s), sgd())
    rest = make_rest()
    with pytest.raises(errors.InvalidOptionError, match=r"token gradients of 0 of the store's 5 "
                       r"layers.*layer_grads="):  # fmt: skip
      jax.jit(tx.update)(rest, tx.init(rest), rest)  # no layer_grads: unordered, refused


@pytest.mark.parametrize("update", ["explicit", pytest.param("backward", marks=pytest.mark.slow)])
def test_a_step_whose_rest_never_came_is_refused(tmp_path, update):
  """The rest's update left out of a step: `update()` refuses it, nothing committed. Then
  the rest's part (explicit: of the gradients on disk; backward: the step dropped, run again)
  and the step commits."""
  store = offlax.LayerStore.create(str(tmp_path / "s"), make_layers(jnp.float32), update=update,
                                   optimizer=optax.chain(optax.clip_by_global_norm(SMALL), sgd()),
                                   progress=False)  # fmt: skip
  tx = optax.chain(offlax.clip_by_global_norm(SMALL, store=store), sgd())
  with store:
    rest = make_rest()
    gs, gr = grads(store.source(), rest, batch(0, jnp.float32))  # the layers' part only
    with pytest.raises(errors.IncompleteStepError, match="rest's part of it never came"):
      store.update()
    assert store.step == 0
    if update == "backward":  # the step was dropped
      gs, gr = grads(store.source(), rest, batch(0, jnp.float32))
    _, state = jax.jit(tx.update)(gr, tx.init(rest), rest, layer_grads=gs)
    store.update()
    assert store.step == 1 and store.last_update.clipped
    assert store.last_update.grad_norm == float(state[0].norm)


def given_clip(c):
  """optax's clip by a norm given as the extra arg ``norm``, in place of its own."""

  def update(u, state, params=None, *, norm, **extra):
    return jax.tree.map(
      lambda t: jax.lax.select(norm < c, t, (t / norm.astype(t.dtype)) * c), u
    ), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.slow  # compiles NNX steps
@pytest.mark.parametrize("c", [SMALL, BIG], ids=["clip-applies", "clip-idle"])
def test_an_nnx_model_s_optimizer_clips_by_the_whole_norm(tmp_path, c):
  """`offload_params(model, store=, commit_in_update=True)` and `nnx.Optimizer` updating the
  rest (in host memory: inside `offlax.offload`) with the whole-norm clip first, as Tunix's
  trainer steps: the layers' token gradients in the rest's gradients order its callback
  after the hand-offs, and the commit after it. The same model in memory, given the norm:
  layers and rest to the bit; with optax's own norm: to its rounding."""
  from flax import nnx
  from test_layer_store_nnx import Model
  from test_layer_store_nnx import batch as nnx_batch

  from offlax._src import nnx_store_commit

  @nnx.jit
  def step(model, optimizer, x, **norm):
    _, g = nnx.value_and_grad(lambda m: m(x))(model)
    optimizer.update(model, g, **norm)

  @nnx.jit
  def plain_step(model, optimizer, x):  # (its params on the device) and optax's norm
    _, g = nnx.value_and_grad(lambda m: m(x))(model)
    optimizer.update(model, g)
    return optax.tree.norm(nnx.state(g, nnx.Param))

  store = offlax.LayerStore.create(str(tmp_path / "s"), offlax.stack_layers(Model(nnx.Rngs(0)),
                                   "layers"), optimizer=optax.chain(optax.clip_by_global_norm(c),
                                   sgd()), update="backward", progress=False)  # fmt: skip
  with store:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=store, commit_in_update=True)
    tx = optax.chain(offlax.clip_by_global_norm(c, store=store), sgd())
    optimizer = nnx.Optimizer(model, offlax.offload(tx, compute="host"), wrt=nnx.Param)
    assert len(nnx_store_commit._whole_norms(optimizer.opt_state)) == 1  # the commit's operand
    stats = []
    for i in range(2):
      step(model, optimizer, nnx_batch(i))
      assert store.step == i + 1  # committed by the update
      stats.append(store.last_update)
    layers = store.read_params()
  plain = Model(nnx.Rngs(0))
  ref = nnx.Optimizer(plain, optax.chain(optax.clip_by_global_norm(c), sgd()), wrt=nnx.Param)
  norms = [float(plain_step(plain, ref, nnx_batch(i))) for i in range(2)]
  assert [s.clipped for s in stats] == [c == SMALL] * 2
  np.testing.assert_allclose([s.grad_norm for s in stats], norms, rtol=1e-6)
  given = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(given, optax.chain(given_clip(c), sgd()), wrt=nnx.Param)
  for i, s in enumerate(stats):
    step(given, opt, nnx_batch(i), norm=jnp.float32(s.grad_norm))
  assert_bits(layers, offlax.stack_layers(given, "layers"))
  assert_bits(nnx.state(model.embed, nnx.Param), nnx.state(given.embed, nnx.Param))
