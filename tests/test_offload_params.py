"""`offlax.offload_params`: any Flax NNX model's params in host memory, the model's code unedited.

Each model is trained beside the same model on the device, rematerialised the
same way (a layer's recomputation rounds as the layer does, see
``docs/params_off_device.md``): the params must be equal bit for bit, in
``pinned_host`` after training, with the gradients in host memory.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_trees_equal, committed, committed_state
from flax import nnx

import offlax

D = 8


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class ListModel(nnx.Module):
  """Layers in an `nnx.List` looped over in Python; a tied embedding used by two methods."""

  def __init__(self, rngs, layers=2, remat=False):
    self.embed = nnx.Embed(11, D, rngs=rngs)
    self.layers = nnx.List([Block(rngs) for _ in range(layers)])
    self.remat = remat

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = nnx.remat(lambda m, x: m(x))(layer, x) if self.remat else layer(x)
    return self.embed.attend(x)


class MLP(nnx.Module):
  """No repeated blocks."""

  def __init__(self, rngs):
    self.a = nnx.Linear(D, 16, rngs=rngs)
    self.b = nnx.Linear(16, 11, rngs=rngs)

  def __call__(self, tokens):
    return self.b(jax.nn.relu(self.a(jax.nn.one_hot(tokens, D))))


class Stacked(nnx.Module):
  """Layers made by `nnx.vmap`, run by `nnx.scan` (params stacked on a first axis)."""

  def __init__(self, rngs, layers=3, remat=False):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.embed = nnx.Embed(11, D, rngs=rngs)
    self.blocks = make(rngs)
    self.remat = remat

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return nnx.remat(lambda b, x: b(x))(block, x) if self.remat else block(x)

    return self.embed.attend(run(self.embed(tokens), self.blocks))


TOKENS = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


def loss_fn(model):
  logits = model(TOKENS[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()


def train(model, tx, steps=3, wrt=nnx.Param, traces=None):
  """The losses of `steps` steps; `traces` (a list) gets one item per trace of the step."""
  optimizer = nnx.Optimizer(model, tx, wrt=wrt)

  @nnx.jit
  def step(model, optimizer):
    if traces is not None:
      traces.append(1)  # Python runs only when JAX traces (and then compiles) the step
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
    optimizer.update(model, grads)  # Flax's own call: offlax's fused update where it applies
    return loss

  return [float(step(model, optimizer)) for _ in range(steps)]


def compiled_step(model, tx, norm=False):
  """``(compile_for_gpu of the model's whole train step with tx, the nnx.Optimizer)``; with
  `norm`, the step also returns ``optax.global_norm(grads)``, as Tunix's does."""
  from offlax._src import gpu_compile

  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    out = (loss, optax.global_norm(grads)) if norm else loss
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), out

  step = jax.jit(step, donate_argnums=0)  # XLA:GPU needs its simplifier: conftest.py gives it
  return offlax.compile_for_gpu(step, gpu_compile.state_specs(state)), optimizer


def kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize(
  "make, remat",
  [
    (ListModel, True),
    pytest.param(MLP, False, marks=pytest.mark.slow),
    pytest.param(Stacked, True, marks=pytest.mark.slow),
  ],
  ids=["list-of-layers", "mlp", "nnx-scan"],
)
def test_trains_as_on_the_device(make, remat):
  want_model = make(nnx.Rngs(0), remat=True) if remat else make(nnx.Rngs(0))
  want = train(want_model, optax.adamw(1e-2))
  model = make(nnx.Rngs(0))
  assert offlax.offload_params(model) is model
  assert kinds(nnx.state(model, nnx.Param)) == {"pinned_host"}
  traces = []
  got = train(model, offlax.offload(optax.adamw(1e-2), compute="host"), traces=traces)
  assert kinds(nnx.state(model, nnx.Param)) == {"pinned_host"}
  # One compile: the optimizer's step counter starts committed as the step returns it.
  assert len(traces) == 1
  if make is not Stacked:
    assert got == want
    assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param))
    return
  # Inside `nnx.scan` each of a block's sub-modules is its own rematerialised unit (the
  # block owns no params itself), and the reference rematerialises the whole block: their
  # XLA:CPU fusions round differently, by an ulp of a step's loss.
  assert got == pytest.approx(want, rel=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(want_model, nnx.Param)), strict=True):  # fmt: skip
    assert jnp.max(jnp.abs(jax.device_get(a) - jax.device_get(b))) < 1e-6


@pytest.mark.slow  # a list of layers trains bit-exact by default
def test_gradients_land_in_host_memory_and_equal_the_devices():
  want = nnx.jit(nnx.grad(loss_fn))(ListModel(nnx.Rngs(0), remat=True))
  model = offlax.offload_params(ListModel(nnx.Rngs(0)))
  grads = nnx.jit(nnx.grad(loss_fn))(model)
  assert kinds(nnx.state(grads)) == {"pinned_host"}
  assert_trees_equal(nnx.state(grads), nnx.state(want))


@pytest.mark.parametrize("offload_activations", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_wrapped_methods_and_eager_calls(offload_activations):
  model = offlax.offload_params(ListModel(nnx.Rngs(0)), offload_activations=offload_activations)
  want = ListModel(nnx.Rngs(0))
  # `attend` (the tied embedding's decode) and `__call__` of the embedding both fetch.
  assert jnp.array_equal(model(TOKENS), want(TOKENS))  # eagerly
  grads = nnx.jit(nnx.grad(loss_fn))(model)
  assert kinds(nnx.state(grads)) == {"pinned_host"}


@pytest.mark.slow  # a list of layers trains bit-exact by default
def test_lora_adapters_stay_on_the_device():
  class Lora(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.LoRALinear(D, D, lora_rank=2, rngs=rngs)
      self.b = nnx.LoRALinear(D, 11, lora_rank=2, rngs=rngs)

    def __call__(self, tokens):
      return self.b(self.a(jax.nn.one_hot(tokens, D)))

  want_model = Lora(nnx.Rngs(0))
  want = train(want_model, optax.adam(1e-2), wrt=nnx.LoRAParam)
  model = offlax.offload_params(Lora(nnx.Rngs(0)), wrt=nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
  got = train(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
  assert got == want
  assert_trees_equal(nnx.state(model), nnx.state(want_model))
  assert model.a.kernel[...].sharding.memory_kind == "pinned_host"
  assert model.a.lora.lora_a[...].sharding.memory_kind == "device"


@pytest.mark.slow  # a list of layers trains bit-exact by default
def test_master_weights_with_bf16_params():
  """bf16 params, fp32 master in host memory: optax's results to bf16 rounding.

  Not bit for bit: the first step is (gradients and params equal), later steps
  differ by a bf16 ulp here and there, which the next steps carry. Every unit is
  rematerialised here, the tied embedding included, where the reference keeps the
  embedding's bf16 products from the forward pass; the rounding that differs was
  not traced further (see docs/tunix_full_finetune.md).
  """

  def bf16(model):
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
    return model

  tx = offlax.master_weights(optax.adamw(1e-2))
  want_model = bf16(ListModel(nnx.Rngs(0), remat=True))
  want = train(want_model, tx)
  model = offlax.offload_params(bf16(ListModel(nnx.Rngs(0))))
  got = train(model, offlax.offload(tx, compute="host"))
  assert got[0] == want[0]
  assert got == pytest.approx(want, rel=1e-4)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(want_model, nnx.Param)), strict=True):  # fmt: skip
    a, b = (jax.device_get(x).astype(jnp.float32) for x in (a, b))
    assert jnp.all(jnp.abs(a - b) <= 2 * 2**-8 * jnp.maximum(jnp.abs(b), 1e-3))  # 2 bf16 ulps


def test_onload_params_is_the_inverse():
  model = offlax.offload_params(ListModel(nnx.Rngs(0)))
  want = ListModel(nnx.Rngs(0))
  offlax.onload_params(model)
  assert kinds(nnx.state(model, nnx.Param)) == {"device"}
  assert type(model.layers[0]) is Block
  assert nnx.graphdef(model) == nnx.graphdef(want)
  with pytest.raises(offlax.errors.InvalidOptionError, match="not given to offload_params"):
    offlax.onload_params(model)


def test_an_abstract_model_gets_host_specs():
  model = nnx.eval_shape(lambda: ListModel(nnx.Rngs(0)))
  offlax.offload_params(model)
  specs = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(isinstance(s, jax.ShapeDtypeStruct) for s in specs)
  assert {s.sharding.memory_kind for s in specs} == {"pinned_host"}


def test_bad_input():
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  with pytest.raises(offlax.errors.InvalidOptionError, match=r"already offloaded.*model\.a"):
    offlax.offload_params(model)
  with pytest.raises(offlax.errors.InvalidOptionError, match="expected a Flax NNX module"):
    offlax.offload_params({"w": jnp.ones(3)})

  class Outside(nnx.Module):
    """Reads its child's param from its own method, which offlax does not wrap."""

    def __init__(self, rngs):
      self.a = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
      return x @ self.a.kernel[...]

  model = offlax.offload_params(Outside(nnx.Rngs(0)))
  with pytest.raises(offlax.errors.MemoryKindError, match=r"model\.a"):
    nnx.jit(lambda m: m(jnp.ones((1, D))))(model)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.complex64])
def test_the_norm_of_host_gradients_is_optaxs_to_the_bit(dtype):
  """`host_params.global_norm` (the hook Tunix's `grad_norm` calls): equal-shaped, 1-D, 3-D and
  device leaves mixed, passed flat to one host computation: optax's norm, bit for bit."""
  from offlax._src import host_params

  keys = jax.random.split(jax.random.key(0), 7)
  # XLA:CPU sums most draws of a (16, 11) or (7, 300) array in another order than flat.
  shapes = [(16, 11), (11,), (16, 11), (128, 2, 64), (3,), (7, 300), (16, 11)]
  tree = [10 * jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True)]
  mixed = [offlax.to_host(x) if i != 4 else x for i, x in enumerate(tree)]
  norm, want = jax.jit(host_params.global_norm), jax.jit(optax.global_norm)
  got = norm(mixed)
  assert_trees_equal(got, want(tree))
  assert got.sharding.memory_kind == "device"
  for x, y in zip(mixed, tree, strict=True):  # one leaf alone: no rounding of a total hides it
    assert_trees_equal(norm([x, y]), want([y, y]))


def test_the_norm_of_a_steps_host_gradients_is_summed_from_their_device_values():
  """A step's gradients of params in host memory are copies the backward pass made of device
  values; the norm sums those (`memory.device_source`, JAX's tracing record: a JAX that keeps
  it elsewhere fails here) and runs no host computation, and it is optax's norm of the
  gradients, bit for bit. Program inputs in host memory take the host computation (above)."""
  from offlax._src import memory

  model = offlax.offload_params(ListModel(nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  found = []

  def step(state):
    grads = nnx.grad(loss_fn)(nnx.merge(graphdef, state))
    found.extend(memory.device_source(g) is not None for g in jax.tree.leaves(grads))
    on_device = jax.tree.map(memory.to_device, grads)
    return optax.global_norm(grads), optax.global_norm.__wrapped__(on_device)

  assert "device_host" not in str(jax.make_jaxpr(step)(state))  # no host computation
  assert found and all(found), found
  got, want = jax.jit(step)(state)
  assert_trees_equal(got, want)
  assert memory.device_source(jax.tree.leaves(state)[0]) is None  # not traced: no record


def test_flax_still_needs_the_optimizer_patch():
  """Canary (docs/patches.md): Flax's update and optax's norm still fail on host params."""
  from offlax._src import nnx_hooks

  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  optimizer = nnx.Optimizer(model, offlax.offload(optax.sgd(0.1), compute="host"), wrt=nnx.Param)
  grads = nnx.jit(nnx.grad(loss_fn))(model)
  assert nnx_hooks.fuses(optimizer, model)
  original_norm = optax.global_norm.__wrapped__
  # Flax's update still applies a whole updates tree itself (on the CPU backend compute on
  # host memory runs; XLA's GPU compiler converts it into host compute).
  source = inspect.getsource(nnx.Optimizer.update.__wrapped__)
  assert "optax.apply_updates(" in source
  with pytest.raises(ValueError, match="memory_space"):
    jax.jit(original_norm)(nnx.state(grads))
  with pytest.raises(ValueError, match="Memory kind mismatch"):
    optax.MultiSteps.init.__wrapped__(optax.MultiSteps(optax.sgd(0.1), 2), nnx.state(model))


def test_to_host_installs_the_multi_steps_init_patch():
  """Plain JAX, no `offload_params`: `optax.MultiSteps(offload(...)).init` of params that
  `offlax.to_host` placed makes its accumulator in host memory (optax's own init raises JAX's
  "Memory kind mismatch" there: the canary above)."""
  from offlax._src import multi_steps, patches

  patches.uninstall(multi_steps.INIT)
  tx = optax.MultiSteps(offlax.offload(optax.adamw(1e-2), compute="host"), 2)
  host = offlax.to_host({"w": jnp.ones((4, 3)), "b": jnp.zeros(3)})
  assert patches.installed(multi_steps.INIT)
  state = tx.init(host)
  assert kinds(state.acc_grads) == {"pinned_host"}


@pytest.mark.parametrize("grads_in", ["host", "device"])
def test_multi_steps_accumulates_in_host_memory(grads_in):
  """`optax.MultiSteps` around a fused offload: optax's results, the accumulator in host memory.

  Gradients on the device (plain `jax.grad` of host params fetched by hand) are
  added into the host accumulator on the host: it stays there.
  """
  from offlax._src import nnx_hooks

  nnx_hooks.install()
  params = committed({"w": jax.random.normal(jax.random.key(0), (16, 8)), "b": jnp.ones(8)})
  plain = optax.MultiSteps(optax.adamw(1e-2), 3)
  fused = optax.MultiSteps(offlax.offload(optax.adamw(1e-2), compute="host"), 3)
  want, want_state = params, committed_state(plain.init(params))  # each step compiles once
  got = offlax.to_host(params)
  state = committed_state(fused.init(got))
  assert kinds(state.acc_grads) == {"pinned_host"}

  @jax.jit
  def plain_step(p, s, g):
    u, s = plain.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(functools.partial(offlax.update_and_apply, fused))
  for i in range(5):
    grads = jax.tree.map(functools.partial(lambda i, x: jnp.sin(x * (i + 1)), i), params)
    want, want_state = plain_step(want, want_state, grads)
    if grads_in == "host":
      grads = jax.device_put(grads, jax.memory.Space.Host)
    got, state = step(grads, state, got)
    assert kinds(state.acc_grads) == {"pinned_host"}
  assert_trees_equal(got, want)
  assert_trees_equal(state.acc_grads, want_state.acc_grads)
  assert int(state.gradient_step) == int(want_state.gradient_step) == 1
  assert kinds(got) == kinds(state.acc_grads) == {"pinned_host"}


def test_multi_steps_through_nnx_optimizer_on_device_params_is_fused():
  """Tunix's ``gradient_accumulation_steps`` with params on the device: `nnx.Optimizer.update`
  runs the fused step (optax's update selected every offloaded state leaf with `jnp.where`
  each micro-step, on the host CPU under XLA:GPU), optax's results bit for bit.

  No `offload_params` here: offload's first `init` on NNX Variables installs the patch.
  """
  from offlax._src import nnx_hooks, patches

  patches.uninstall(nnx_hooks.OPTIMIZER_UPDATE)
  model, want_model = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
  tx = optax.MultiSteps(offlax.offload(optax.adamw(1e-2), compute="host"), 2)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert patches.installed(nnx_hooks.OPTIMIZER_UPDATE)
  assert nnx_hooks.fuses(optimizer, model)
  other = MLP(nnx.Rngs(0))  # no MultiSteps: Flax's own update
  assert not nnx_hooks.fuses(
    nnx.Optimizer(other, offlax.offload(optax.sgd(0.1)), wrt=nnx.Param), other
  )
  want = nnx.Optimizer(want_model, optax.MultiSteps(optax.adamw(1e-2), 2), wrt=nnx.Param)
  step = nnx.jit(lambda m, o: o.update(m, nnx.grad(loss_fn)(m)))
  for _ in range(5):
    step(model, optimizer)
    step(want_model, want)
  assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param))
  acc = nnx.state(optimizer, nnx.optimizer.OptState)["opt_state"]["acc_grads"]
  want_acc = nnx.state(want, nnx.optimizer.OptState)["opt_state"]["acc_grads"]
  assert_trees_equal(acc, want_acc)


@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_multi_steps_on_device_params_compiles_for_gpu_with_no_host_selects():
  """The fused step above, compiled by XLA:GPU: no compute but the update's on the host (optax's
  own update had two `select_n` a state leaf there)."""
  c, _ = compiled_step(
    MLP(nnx.Rngs(0)), optax.MultiSteps(offlax.offload(optax.adamw(1e-2), compute="host"), 2)
  )
  assert c.host_compute == (), c.table()


@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_the_norm_of_host_gradients_adds_no_host_copy_on_a_gpu():
  """Tunix's `optax.global_norm(grads)` beside the update, params in host memory, compiled by
  XLA:GPU: the host bytes are the step's without the norm. Summed from the host copies,
  XLA:GPU hoisted the reshape into the host computation to the device and copied each 2-D
  gradient to the host a second time (twice the gradients' host bytes)."""
  tx = offlax.offload(optax.adamw(1e-2), compute="host")
  plain, _ = compiled_step(offlax.offload_params(MLP(nnx.Rngs(0))), tx)
  normed, _ = compiled_step(offlax.offload_params(MLP(nnx.Rngs(0))), tx, norm=True)
  assert normed.host == plain.host, (normed.table(), plain.table())
  assert normed.host_compute == (), normed.table()


@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_multi_steps_around_host_compute_compiles_for_gpu():
  """Tunix's ``gradient_accumulation_steps`` with params in host memory, compiled by XLA:GPU.

  The accumulator's host computation took each gradient in the layout XLA's dot chose for
  it ({0,1}) and XLA:GPU's layout assignment failed ("The async-start expects the async
  shape ... to match"); the CPU backend never saw it (the test above checks the numbers).
  """
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  tx = optax.MultiSteps(offlax.offload(optax.adamw(1e-2), compute="host"), 2)
  c, optimizer = compiled_step(model, tx)
  acc = nnx.state(optimizer, nnx.optimizer.OptState)["opt_state"]["acc_grads"]
  acc_bytes = sum(x.nbytes for x in jax.tree.leaves(acc))
  params_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  # Params, accumulator and moments stay in host memory, and so does the whole update.
  assert c.host["argument"] >= 4 * params_bytes == 4 * acc_bytes, c.table()
  assert c.device["argument"] < params_bytes, c.table()
  assert c.host_compute == (), c.table()


@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
@pytest.mark.parametrize("where", ["device", "pinned_host"])
def test_multi_steps_with_8bit_host_compute_compiles_for_gpu(where):
  """`offlax.update_and_apply` of ``MultiSteps(offload(adamw(state_bits=8), compute="host"))``.

  Its k-th micro-step ran in a `lax.cond`, and XLA:GPU refused the moves to host memory
  inside the branch ("Expected computation ... to be called only by one caller and that
  caller to be a While"); it is now a loop of 0 or 1 trips (the numbers: the tests above).
  """
  from offlax._src import gpu_compile, nnx_hooks

  nnx_hooks.install()  # MultiSteps' init of host params (as Tunix's trainer installs it)
  params = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}
  if where == "pinned_host":
    params = offlax.to_host(params)
  tx = optax.MultiSteps(offlax.offload(offlax.adamw(1e-3, state_bits=8), compute="host"), 2)
  state = tx.init(params)

  def step(params, state, x):
    def loss(p):
      p = jax.tree.map(lambda w: jax.device_put(w, jax.memory.Space.Device), p)
      return jnp.mean(jax.nn.relu(x @ p["a"]) @ p["b"])

    return offlax.update_and_apply(tx, jax.grad(loss)(params), state, params)

  step = jax.jit(step, donate_argnums=(0, 1))
  x = jnp.ones((8, 64))
  c = offlax.compile_for_gpu(step, params, gpu_compile.state_specs(state), x)
  assert c.host_compute == (), c.table()


def test_a_multi_steps_accumulator_places_as_tunix_restores_it():
  """Tunix restores the optimizer state at `nnx.get_named_sharding(state, mesh)`, the mesh of
  its first array (offlax's one-device mesh for host params). The accumulator of
  `optax.MultiSteps` kept the params' sharding names (here ('tp', None)) and the restore raised
  "Resource axis: tp ... is not found in mesh"; it says where it lives, as `offload`'s state
  does (tests/test_tunix_peft_store.py resumes Tunix's trainer so, slow)."""

  class Sharded(nnx.Module):
    def __init__(self, rngs):
      # As Tunix makes its params (it turns flax_always_shard_variable off at import).
      self.w = nnx.Param(rngs.params.normal((16, 8)), sharding=("tp", None), eager_sharding=False)

  model = offlax.offload_params(Sharded(nnx.Rngs(0)))
  tx = optax.MultiSteps(offlax.offload(optax.adamw(1e-2), compute="host"), 2)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  state = nnx.state(optimizer, nnx.optimizer.OptState)
  mesh = next(
    x.sharding.mesh for x in jax.tree.leaves(state)
    if isinstance(x.sharding, jax.sharding.NamedSharding)
  )  # fmt: skip
  shardings = nnx.get_named_sharding(state, mesh)
  acc = jax.tree.leaves(shardings["opt_state"]["acc_grads"])
  assert acc and all(s.memory_kind == "pinned_host" for s in acc), acc


@pytest.mark.slow  # two unrolled compiles: 40 s on an idle 2-core machine
@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_compiled_step_keeps_device_memory_flat_in_depth():
  """Tunix's Qwen3 (tiny dims, wide MLP), whole step compiled by XLA's GPU compiler.

  A layer adds its saved input and a few activations to the device peak, not
  its params: were each layer's fetched params held on the device (fetches
  hoisted, a Python loop's default), each would add its bf16 bytes, 6.5 MB.
  """
  qwen3 = pytest.importorskip("tunix.models.qwen3.model")
  import dataclasses

  base = qwen3.ModelConfig(
    num_layers=2, vocab_size=64, embed_dim=256, hidden_dim=4096, num_heads=2, head_dim=64,
    num_kv_heads=1, norm_eps=1e-6, rope_theta=10_000, dtype=jnp.bfloat16,
    param_dtype=jnp.bfloat16,
  )  # fmt: skip
  tokens = jax.ShapeDtypeStruct((1, 64), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, 64, 64), jnp.bool_)

  def compiled(layers):
    cfg = dataclasses.replace(base, num_layers=layers)
    model = offlax.offload_params(nnx.eval_shape(lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))))
    tx = offlax.offload(offlax.master_weights(optax.adamw(1e-5)), compute="host")
    optimizer = nnx.eval_shape(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), model)
    # eval_shape types the state as device memory: its specs from abstract_state instead.
    specs = jax.tree.leaves(offlax.abstract_state(tx, nnx.as_pure(nnx.state(model, nnx.Param))))
    boxes = jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for box, spec in zip(boxes, specs, strict=True):
      box.set_value(spec)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, tokens, mask):
      model, optimizer = nnx.merge(graphdef, state)

      def loss_fn(model):
        logits, _ = model(tokens, tokens, None, mask)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), loss

    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # With the algebraic simplifier (the suite's XLA_FLAGS disable it; XLA:GPU needs it).
    step = jax.jit(step, donate_argnums=0)
    c = offlax.compile_for_gpu(step, state, tokens, mask, target="l4")
    return c, 2 * n

  (two, _), (four, param_bytes) = compiled(2), compiled(4)
  layer_bytes = 2 * sum(
    x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
      lambda: qwen3.DecoderLayer(base, rngs=nnx.Rngs(0))), nnx.Param))
  )  # fmt: skip
  for c in (two, four):
    assert c.host_compute == ()  # no instruction converted to host compute
    assert c.device["argument"] < param_bytes / 100  # params and optimizer state in host memory
  assert four.device_peak < param_bytes  # less than the bf16 gradients alone: those go to host
  assert (four.device_peak - two.device_peak) / 2 < layer_bytes / 2, (two.table(), four.table())


def test_multi_steps_with_a_skip_function_and_device_params_runs_optax():
  """A skip function has no fused path: optax's update then `apply_updates`, as before."""
  params = {"w": jax.random.normal(jax.random.key(0), (16, 8))}
  inner = optax.adamw(1e-2)
  plain = optax.MultiSteps(inner, 2, should_skip_update_fn=optax.skip_not_finite)
  tx = optax.MultiSteps(offlax.offload(inner), 2, should_skip_update_fn=optax.skip_not_finite)
  want, want_state, got, state = params, plain.init(params), params, tx.init(params)
  for i in range(4):
    grads = jax.tree.map(lambda x, i=i: jnp.cos(x * (i + 1)), params)
    updates, want_state = plain.update(grads, want_state, want)
    want = optax.apply_updates(want, updates)
    got, state = offlax.update_and_apply(tx, grads, state, got)
  assert_trees_equal(got, want)


def test_a_list_filter_is_accepted():
  model = offlax.offload_params(MLP(nnx.Rngs(0)), wrt=[nnx.Param])
  assert kinds(nnx.state(model, nnx.Param)) == {"pinned_host"}


@pytest.mark.slow  # test_composition.py wraps offloads by default
def test_an_offload_inside_an_optax_wrapper_trains_in_nnx():
  """`nnx.Optimizer` with ``masked(offload(...))``: the offload's fused update, as on the device."""
  mask = lambda params: jax.tree.map(lambda _: True, params)
  want_model = ListModel(nnx.Rngs(0), remat=True)
  want = train(want_model, optax.masked(optax.adamw(1e-2), mask))
  from offlax._src import nnx_hooks

  model = offlax.offload_params(ListModel(nnx.Rngs(0)))
  tx = optax.masked(offlax.offload(optax.adamw(1e-2), compute="host"), mask)
  # Flax's own update would apply a whole updates tree (XLA:CPU lets it compute on host memory).
  assert nnx_hooks.fuses(nnx.Optimizer(model, tx, wrt=nnx.Param), model)
  got = train(model, tx)
  assert got == want
  assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param))
  assert kinds(nnx.state(model, nnx.Param)) == {"pinned_host"}


def test_a_tied_embedding_s_gradient_is_summed_on_the_device():
  """`ListModel`'s one `nnx.Embed` is read by ``__call__`` and by ``attend`` (a tied head, as
  Gemma 3's): its two uses' gradients are added on the device, then copied to host memory
  once; not copied twice and added in host memory, which XLA:GPU does as host compute
  (the test below). `test_trains_as_on_the_device`'s list-of-layers case trains it to the bit."""
  model = offlax.offload_params(ListModel(nnx.Rngs(0), layers=0))  # the embedding alone
  graphdef, state = nnx.split(model)
  jaxpr = str(jax.make_jaxpr(lambda s: nnx.grad(loss_fn)(nnx.merge(graphdef, s)))(state))
  adds = [line for line in jaxpr.splitlines() if f"[11,{D}] = add_any" in line]
  assert len(adds) == 1 and "<host>" not in adds[0], adds


@pytest.mark.slow  # a GPU compile (14 s on a busy 2-core machine); the test above by default
@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
def test_a_tied_embedding_compiles_to_no_host_compute():
  """The tied `ListModel`'s whole step (offlax's host AdamW), compiled by XLA:GPU: no
  instruction on host memory converted into host compute (was the add of the embedding's
  two gradients, ``add_any``, every step)."""
  model = offlax.offload_params(ListModel(nnx.Rngs(0)))
  c, _ = compiled_step(model, offlax.offload(optax.adamw(1e-2), compute="host"))
  assert c.host_compute == (), c.table()
