"""`offlax.offload_params(model, store=...)`: an NNX model's list of layers on disk.

The reference trains the same model with its params in host memory
(`offload_params` without a store: each layer rematerialised alike, so bf16
rounds alike): the gradients from one jitted function, the optax update from
another (two programs, as the store's step is: one XLA program fusing both may
round differently).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import offlax
from offlax._src import errors

D, L = 8, 3


class Block(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32, d=D):
    self.lin = nnx.Linear(d, d, param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.norm = nnx.RMSNorm(d, param_dtype=dtype, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(self.norm(x)))


class Model(nnx.Module):
  def __init__(self, rngs, n=L, dtype=jnp.float32, d=D):
    self.embed = nnx.Linear(4, d, param_dtype=dtype, dtype=dtype, rngs=rngs)
    self.layers = nnx.List([Block(rngs, dtype, d) for _ in range(n)])

  def __call__(self, x):
    x = self.embed(x)
    for layer in self.layers:
      x = layer(x)
    return jnp.mean(x.astype(jnp.float32) ** 2)


def stacked(layers):
  return offlax.stack_layers(layers)


def _stack(trees):
  return jax.tree.map(lambda *x: jnp.stack(x), *[trees[i] for i in range(len(trees))])


def batch(step, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(step), (2, 4)).astype(dtype)


grad = nnx.jit(nnx.value_and_grad(lambda model, x: model(x)))


@nnx.jit
def train_step(model, optimizer, x):
  """A training step: the loss of `model` on `x`, its gradients, `optimizer.update`."""
  loss, grads = nnx.value_and_grad(lambda m: m(x))(model)
  optimizer.update(model, grads)
  return loss


def reference(tx, steps, dtype):
  """Losses and stacked layer params after `steps` steps with the params in host memory."""
  model = offlax.offload_params(Model(nnx.Rngs(0), dtype=dtype))
  params = jax.device_get(nnx.state(model, nnx.Param))
  state = tx.init(params)
  update = jax.jit(
    lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  )
  losses = []
  for step in range(steps):
    loss, grads = grad(model, batch(step, dtype))
    params, state = update(jax.device_get(grads), state, params)
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, _host()), params))
    losses.append(float(loss))
  return losses, stacked(offlax.onload_params(model).layers)


def _host():
  return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def on_store(tmp_path, tx, dtype, **kwargs):
  model = Model(nnx.Rngs(0), dtype=dtype)
  store = offlax.LayerStore.create(str(tmp_path / "layers"), stacked(model.layers), optimizer=tx,
                                   progress=False, **kwargs)  # fmt: skip
  return offlax.offload_params(model, store=store), store


def assert_bits(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  "make_tx, dtype",
  [
    (lambda: optax.adam(1e-2), jnp.float32),
    pytest.param(
      lambda: offlax.master_weights(optax.adamw(1e-2, weight_decay=0.1)),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
  ],
  ids=["adam", "master-adamw"],
)
def test_layers_on_disk_train_bit_for_bit(tmp_path, make_tx, dtype):
  want_losses, want = reference(make_tx(), 3, dtype)
  model, store = on_store(tmp_path, make_tx(), dtype)
  with store:
    # The model's other params (the embedding) in host memory, updated by offlax on the host.
    optimizer = nnx.Optimizer(model, offlax.offload(make_tx(), compute="host"), wrt=nnx.Param)

    losses = []
    for i in range(3):
      losses.append(float(train_step(model, optimizer, batch(i, dtype))))
      assert store.update() == i + 1
    assert losses == want_losses
    assert_bits(store.read_params(), want)
    # Between steps a layer holds no data: only one-element placeholders and its token.
    layer = nnx.state(model.layers[0])
    assert {x.shape for x in jax.tree.leaves(layer)} == {(1,), ()}
    assert nnx.state(model.layers[0], nnx.Param)["_offlax_token"][...] == 0.0


def train_nnx(tmp_path, make_tx, dtype, update, steps=3):
  """`steps` steps of the model with its layers in a store in mode `update`."""
  model, store = on_store(tmp_path / update, make_tx(), dtype, update=update)
  with store:
    optimizer = nnx.Optimizer(model, offlax.offload(make_tx(), compute="host"), wrt=nnx.Param)

    losses = []
    for i in range(steps):
      losses.append(float(train_step(model, optimizer, batch(i, dtype))))
      rest = nnx.state(model, nnx.All(nnx.Param, nnx.Not(offlax.LayerToken)))
      assert store.update(rest={"params": rest, "optimizer": nnx.state(optimizer)}) == i + 1
    return losses, store.read_params(), store.read_state()


@pytest.mark.slow
def test_update_in_the_backward_pass_trains_bit_for_bit(tmp_path):
  """`update="backward"`: the same params and state as the explicit `update()`, and as optax."""
  make_tx, dtype = lambda: offlax.master_weights(optax.adamw(1e-2, weight_decay=0.1)), jnp.bfloat16
  want_losses, want = reference(make_tx(), 3, dtype)
  losses, params, state = train_nnx(tmp_path, make_tx, dtype, "backward")
  assert losses == want_losses
  assert_bits(params, want)
  e_losses, e_params, e_state = train_nnx(tmp_path, make_tx, dtype, "explicit")
  assert losses == e_losses
  assert_bits(params, e_params)
  assert_bits(state, e_state)


def test_accumulate_adds_microbatch_gradients(tmp_path):
  model, store = on_store(tmp_path, optax.sgd(0.1), jnp.float32)
  plain = Model(nnx.Rngs(0))
  with store:
    source = store.source(accumulate=True)
    offlax.onload_params(model)
    offlax.offload_params(model, store=source)
    store.zero_grads()
    grads = nnx.jit(nnx.grad(lambda m, x: m(x)))
    for i in range(2):
      grads(model, batch(i))
    want = [_stack(grads(plain, batch(i))["layers"]) for i in range(2)]
    assert_bits(store.read_grads(), jax.tree.map(lambda a, b: a + b, *want))


def test_onload_reads_the_committed_layers_back(tmp_path):
  model, store = on_store(tmp_path, optax.sgd(0.1), jnp.float32)
  with store:
    nnx.jit(nnx.grad(lambda m, x: m(x)))(model, batch(0))
    store.update()
    offlax.onload_params(model)
    assert type(model.layers[0]) is Block
    assert type(model.layers[0].lin.kernel) is nnx.Param
    assert "_offlax_token" not in vars(model.layers[0])
    assert_bits(stacked(model.layers), store.read_params())
    assert model.embed.kernel[...].sharding.memory_kind == "device"
    model(batch(1))  # a plain model again


def test_store_that_does_not_match_is_refused(tmp_path):
  model = Model(nnx.Rngs(0))
  other = Model(nnx.Rngs(0), n=L + 1)
  with offlax.LayerStore.create(str(tmp_path / "a"), stacked(other.layers), progress=False) as s:
    with pytest.raises(errors.StoreMismatchError, match=r"model.layers has 3 layers, the store 4"):
      offlax.offload_params(model, store=s)
  bf16 = Model(nnx.Rngs(0), dtype=jnp.bfloat16)
  with offlax.LayerStore.create(str(tmp_path / "b"), stacked(bf16.layers), progress=False) as s:
    with pytest.raises(
      errors.StoreMismatchError,
      match=r"model.layers\[0\]\['lin'\]\['bias'\].value is float32\[8\], the store's leaf "
      r"\['lin'\]\['bias'\].value is bfloat16\[8\]",
    ):
      offlax.offload_params(model, store=s)
  assert type(model.layers[0]) is Block  # nothing changed
  with pytest.raises(errors.InvalidOptionError, match="store= takes an offlax.LayerStore"):
    offlax.offload_params(model, store=str(tmp_path / "a"))


def test_a_store_backed_model_is_not_offloaded_twice(tmp_path):
  model, store = on_store(tmp_path, None, jnp.float32)
  with store, pytest.raises(errors.InvalidOptionError, match="already offloaded"):
    offlax.offload_params(model, store=store)


def test_stack_layers(tmp_path):
  model = Model(nnx.Rngs(0))
  got = offlax.stack_layers(model.layers)
  assert got["lin"]["kernel"].shape == (L, D, D)
  np.testing.assert_array_equal(got["lin"]["kernel"][1], model.layers[1].lin.kernel[...])
  abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
  shapes = offlax.stack_layers(abstract.layers)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
    lambda x: (x.shape, x.dtype), got
  )
  # A store made from the shapes, written a layer at a time, holds the same layers.
  init = lambda i: nnx.state(model.layers[i], nnx.Param)
  with offlax.LayerStore.create(str(tmp_path / "s"), shapes, init_layer=init, progress=False) as s:
    assert_bits(s.read_params(), got)
    offlax.offload_params(abstract, store=s)  # an abstract model takes the store too
  mixed = [Block(nnx.Rngs(0)), Block(nnx.Rngs(0), dtype=jnp.bfloat16)]
  with pytest.raises(
    errors.StoreMismatchError,
    match=r"layer 1 has \['lin'\]\['bias'\].value bfloat16\[8\] where layer 0 has "
    r"\['lin'\]\['bias'\].value float32\[8\]",
  ):
    offlax.stack_layers(mixed)


@pytest.mark.slow
@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_compiles_for_gpu_with_flat_device_and_host_memory(tmp_path):
  """Each layer read after the one before (forward) or after (backward): more layers, same peak.

  The reads wait for the layer's inputs, or its output's cotangent, through a
  barrier; the gradient hand-off precedes the layer below's backward pass.
  Host memory holds the embedding only, where params in host memory grow.
  """
  d, layer_bytes = 512, (512 * 512 + 2 * 512) * 2
  peaks, hosts, host_mode = [], [], []
  for n in (2, 4):
    for store_mode in (True, False):
      model = nnx.eval_shape(lambda n=n: Model(nnx.Rngs(0), n=n, dtype=jnp.bfloat16, d=d))
      if store_mode:
        store = offlax.LayerStore.create(str(tmp_path / str(n)), offlax.stack_layers(model.layers))
        offlax.offload_params(model, store=store)
      else:
        offlax.offload_params(model)
      graphdef, state = nnx.split(model)
      step = lambda state, x, g=graphdef: nnx.grad(lambda net: net(x))(nnx.merge(g, state))
      m = offlax.compile_for_gpu(step, state, jnp.ones((4, 4), jnp.bfloat16), target="h100")
      if store_mode:
        store.close()
        # per layer: a read forward, a read again backward, a gradient hand-off
        assert m.hlo.count('custom_call_target="xla_ffi_python_gpu_callback"') == 3 * n
        peaks.append(m.device_peak)
        hosts.append(m.host["argument"])
      else:
        host_mode.append(m.host["argument"])
  # Two more layers add their saved inputs (4 x 512 bf16 each), not their params.
  assert 0 <= peaks[1] - peaks[0] < layer_bytes / 10, peaks
  assert hosts[0] == hosts[1] == 4 * d * 2 + d * 2  # the embedding
  assert host_mode[1] - host_mode[0] == 2 * layer_bytes


def _accumulating_loop(model, make_tx, k, store=None):
  """Two steps of `k` micro-steps: the gradients summed, one update a step; the losses."""
  optimizer = nnx.Optimizer(model, offlax.offload(make_tx(), compute="host"), wrt=nnx.Param)
  update = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))
  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
  losses = []
  for step in range(2):
    if store is not None:
      store.zero_grads()
    total = None
    for m in range(k):
      loss, grads = grad(model, batch(k * step + m))
      losses.append(float(loss))
      total = grads if total is None else add(total, grads)
    update(model, optimizer, total)
    if store is not None:
      assert store.update() == step + 1
  return losses


@pytest.mark.slow  # 8 to 15 s on the shared machine (two models compiled)
def test_accumulation_in_a_loop_of_your_own_trains_on_the_sum(tmp_path):
  """The way out that the refusal of `optax.MultiSteps` with a store names (`nnx_store_commit`):
  ``store=store.source(accumulate=True)``, `zero_grads` and `update` around the micro-steps, the
  rest's gradients summed alike: the params of the same loop with them in host memory, bit for
  bit (the store sums as ``jnp.add`` does)."""
  make_tx, k = lambda: optax.adamw(1e-2, weight_decay=0.1), 2
  reference = offlax.offload_params(Model(nnx.Rngs(0)))
  want_losses = _accumulating_loop(reference, make_tx, k)
  like = stacked(Model(nnx.Rngs(0)).layers)
  with offlax.LayerStore.create(
    str(tmp_path / "s"), like, optimizer=make_tx(), progress=False
  ) as s:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=s.source(accumulate=True))
    assert _accumulating_loop(model, make_tx, k, s) == want_losses
    assert_bits(s.read_params(), stacked(offlax.onload_params(reference).layers))
  assert_bits(nnx.state(model.embed), nnx.state(reference.embed))
