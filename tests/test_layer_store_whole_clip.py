"""A global-norm clip over the whole model: layers in a `LayerStore`, the rest on the device.

The store's optimizer is ``optax.chain(optax.clip_by_global_norm(c), tx)``, the rest's
``optax.chain(offlax.clip_by_global_norm(c, store=store), tx)``. The reference is one
``optax.chain(clip, tx)`` over the whole model in memory: each step's gradients from one
jitted function, the chain's update from another. Given the store's norm in place of
optax's, the params of layers and rest are the reference's to the bit, with SGD and with
Adam, in both update modes, with gradient accumulation and with leaves updated in row ranges
(`update_bytes`). The norm itself is not XLA's to the bit, and cannot be: XLA:CPU sums a
stacked leaf's squares in one reduction over all its layers in an order of its own (here a
loop LLVM vectorises, the running total carried from layer to layer; YNNPACK's kernel for
larger leaves), where the store sums each layer's gradient as it reaches the host, in the
backward pass's order (L-1 down to 0), and adds the layers' sums; float32 addition does not
associate, so the two sums may differ in their last bits (docs/nvme_tier.md). The norm is
checked to float32's rounding (relative 1e-6), and the params against optax's own chain to
the ulps such a norm moves them (`test_adam_clipped_by_the_whole_norm`).
Default cases: Adam clipped in the backward mode, accumulating within a byte budget, and the
errors; the rest are slow.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_layer_store_budget as budget_test
import test_layer_update
from test_layer_update import assert_bits

import offlax
from offlax._src import errors

SMALL, BIG = 1e-2, 1e6  # a clip that always applies here, one that never does (asserted)


class Model(NamedTuple):
  """The layers' params and a step's input (``batch(step)``); the rest is `make_rest(d)`."""

  layers: Any
  batch: Any
  d: int


TINY = Model(
  lambda: test_layer_update.make_layers(jnp.float32),
  lambda step: test_layer_update.batch(step, jnp.float32),
  test_layer_update.D,
)
# leaves large enough for `update_bytes` to cut w in row ranges (a direct-I/O block is 4 rows)
CUT = Model(budget_test.make_layers, budget_test.batch, budget_test.D)


def make_rest(d=TINY.d):
  return {"emb": jax.random.normal(jax.random.key(7), (d, d)) * 0.3, "head": jnp.full((d,), 0.2)}


def loss(layers, rest, x):
  h = jnp.tanh(x @ rest["emb"])
  h, _ = offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), h, layers)
  return jnp.mean((h @ rest["head"]) ** 2)


grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))  # an accumulation's sum


def sgd():
  return optax.sgd(1.0)


def adam():
  return optax.adam(1e-2)


def adamw():
  return optax.adamw(1e-2, weight_decay=0.1)


def train(path, c, tail, update, steps=2, micro=1, model=TINY, budget=None):
  """`steps` steps of `micro` batches each (summed: the store's accumulation, and the rest's
  gradients added as they come): layers in a store, the rest's chain clipped by the whole
  norm; the params of both and each step's stats (the store's norm, the rest's state's)."""
  store = offlax.LayerStore.create(path, model.layers(), update=update, update_bytes=budget,
                                   optimizer=optax.chain(optax.clip_by_global_norm(c), tail()),
                                   progress=False)  # fmt: skip
  tx = optax.chain(offlax.clip_by_global_norm(c, store=store), tail())

  @jax.jit
  def rest_update(source_grads, rest_grads, state, rest):
    u, state = tx.update(rest_grads, state, rest, layer_grads=source_grads)
    return optax.apply_updates(rest, u), state

  rest, stats = make_rest(model.d), []
  state = tx.init(rest)
  with store:
    for step in range(steps):
      rest_grads = None
      if micro > 1:
        store.zero_grads()
      for m in range(micro):
        source = store.source() if micro == 1 else store.source(accumulate=True,
                                                                last=m == micro - 1)  # fmt: skip
        source_grads, g = grads(source, rest, model.batch(micro * step + m))
        rest_grads = g if rest_grads is None else add(rest_grads, g)
      rest, state = rest_update(source_grads, rest_grads, state, rest)  # the last micro-step's
      store.update(rest=(rest, state))
      stats.append(store.last_update)
      assert float(state[0].norm) == stats[-1].grad_norm  # one norm, for the rest and the layers
    if budget is not None:
      assert 0 < stats[-1].peak_bytes <= budget
    return store.read_params(), rest, stats


def reference(c, tail, steps=2, norms=None, micro=1, model=TINY):
  """The chain over the whole model in memory (each step's gradients the sum of `micro`
  batches'); with `norms`, each step's norm is that one in place of optax's (its clip's
  expression, in one program with the tail's update as in a chain); and optax's norms."""
  tx, params = (
    optax.chain(optax.clip_by_global_norm(c), tail()),
    (model.layers(), make_rest(model.d)),
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

  state = tail().init(params) if norms is not None else tx.init(params)
  seen = []
  for step in range(steps):
    g = grads(*params, model.batch(micro * step))
    for m in range(1, micro):
      g = add(g, grads(*params, model.batch(micro * step + m)))
    seen.append(float(jax.jit(optax.tree.norm)(g)))
    if norms is None:
      params, state = chain(g, state, params)
    else:
      params, state = given(g, state, params, jnp.float32(norms[step]))
  return params, seen


# All slow: by default the clip applying in the backward mode is checked to the bit by
# `test_accumulation_and_ranges_clipped_by_the_whole_norm[adam-both-backward]` (Adam, whose
# params a norm an ulp away changes: a wrong scale fails as with SGD), the explicit mode's
# norm by `test_a_step_whose_rest_never_came_is_refused[explicit]`.
CASES = [
  pytest.param("explicit", SMALL, id="explicit-clip-applies", marks=pytest.mark.slow),
  pytest.param("backward", SMALL, id="backward-clip-applies", marks=pytest.mark.slow),
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


@pytest.mark.slow  # (default: Adam in `test_accumulation_and_ranges_clipped_by_the_whole_norm`)
@pytest.mark.parametrize("update", ["explicit", "backward"])
def test_adam_clipped_by_the_whole_norm(tmp_path, update):
  """Given the store's norm: the params to the bit. Against optax's own chain: here its norm is
  the store's at the 1st step, an ulp away at the 2nd (the same gradients, summed in another
  order), and the params are within an ulp of each leaf's largest magnitude (measured: a
  flip of the last bit where the update rounds the other way). Not a bound: the steps after
  a norm an ulp away start from other params, whose differences training can grow."""
  layers, rest, stats = train(str(tmp_path / "s"), SMALL, adamw, update, steps=3)
  norms = [s.grad_norm for s in stats]
  given, own = reference(SMALL, adamw, steps=3, norms=norms)
  assert_bits((layers, rest), given)
  (want_layers, want_rest), own = reference(SMALL, adamw, steps=3)
  np.testing.assert_allclose(norms, own, rtol=1e-6)
  want = jax.tree.leaves((want_layers, want_rest))
  for a, b in zip(jax.tree.leaves((layers, rest)), want, strict=True):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=0, atol=np.spacing(np.max(np.abs(b))))


WAYS = {  # micro-steps, model and update_bytes
  "accumulated": (2, TINY, None),
  "ranges": (1, CUT, budget_test.BUDGET),  # w cut in ranges of rows (peak within, asserted)
  "both": (2, CUT, budget_test.BUDGET),
}


@pytest.mark.slow_except("adam-both-backward")
@pytest.mark.parametrize("update", ["explicit", "backward"])
@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("tail", [adam, sgd], ids=["adam", "sgd"])
def test_accumulation_and_ranges_clipped_by_the_whole_norm(tmp_path, tail, way, update):
  """Gradients accumulated over 2 micro-steps (the rest's summed by the caller, its update
  in the last micro-step), leaves updated in row ranges (`update_bytes`), or both: the norm
  is that of the sums, optax's to float32's rounding; given it, the params to the bit."""
  micro, model, budget = WAYS[way]
  layers, rest, stats = train(str(tmp_path / "s"), SMALL, tail, update, micro=micro,
                              model=model, budget=budget)  # fmt: skip
  norms = [s.grad_norm for s in stats]
  given, own = reference(SMALL, tail, norms=norms, micro=micro, model=model)
  assert all(s.clipped for s in stats)
  np.testing.assert_allclose(norms, own, rtol=1e-6)
  assert_bits((layers, rest), given)


def test_a_store_without_the_clip_or_another_bound_is_refused(tmp_path):
  layers = TINY.layers()
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
  store = offlax.LayerStore.create(str(tmp_path / "s"), TINY.layers(), update=update,
                                   optimizer=optax.chain(optax.clip_by_global_norm(SMALL), sgd()),
                                   progress=False)  # fmt: skip
  tx = optax.chain(offlax.clip_by_global_norm(SMALL, store=store), sgd())
  with store:
    rest = make_rest()
    gs, gr = grads(store.source(), rest, TINY.batch(0))  # the layers' part only
    with pytest.raises(errors.IncompleteStepError, match="rest's part of it never came"):
      store.update()
    assert store.step == 0
    if update == "backward":  # the step was dropped
      gs, gr = grads(store.source(), rest, TINY.batch(0))
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
@pytest.mark.parametrize("tail", [sgd, adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("c", [SMALL, BIG], ids=["clip-applies", "clip-idle"])
def test_an_nnx_model_s_optimizer_clips_by_the_whole_norm(tmp_path, c, tail):
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
                                   tail()), update="backward", progress=False)  # fmt: skip
  with store:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=store, commit_in_update=True)
    tx = optax.chain(offlax.clip_by_global_norm(c, store=store), tail())
    optimizer = nnx.Optimizer(model, offlax.offload(tx, compute="host"), wrt=nnx.Param)
    assert len(nnx_store_commit._whole_norms(optimizer.opt_state)) == 1  # the commit's operand
    stats = []
    for i in range(2):
      step(model, optimizer, nnx_batch(i))
      assert store.step == i + 1  # committed by the update
      stats.append(store.last_update)
    layers = store.read_params()
  plain = Model(nnx.Rngs(0))
  ref = nnx.Optimizer(plain, optax.chain(optax.clip_by_global_norm(c), tail()), wrt=nnx.Param)
  norms = [float(plain_step(plain, ref, nnx_batch(i))) for i in range(2)]
  assert [s.clipped for s in stats] == [c == SMALL] * 2
  np.testing.assert_allclose([s.grad_norm for s in stats], norms, rtol=1e-6)
  given = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(given, optax.chain(given_clip(c), tail()), wrt=nnx.Param)
  for i, s in enumerate(stats):
    step(given, opt, nnx_batch(i), norm=jnp.float32(s.grad_norm))
  assert_bits(layers, offlax.stack_layers(given, "layers"))
  assert_bits(nnx.state(model.embed, nnx.Param), nnx.state(given.embed, nnx.Param))
