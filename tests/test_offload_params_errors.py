"""`offload_params` with the optimizers a new user tries: the right ones train, the others say why.

Params in host memory need their optimizer inside `offlax.offload`: with host
compute (the documented way) or streamed through the device, both bit for bit
with plain optax on the device, a clip by the global norm included. Plain optax
in `nnx.Optimizer` fails in JAX with a memory-kind error; offlax's hooks turn
it into `offlax.errors.MemoryKindError` naming the param and the fix.
"""

import inspect

import jax
import optax
import pytest
from conftest import assert_trees_equal
from flax import nnx
from test_offload_params import MLP, TOKENS, kinds

import offlax
from offlax._src import nnx_hooks, patches


def loss_fn(model):
  """Scaled so that the gradients' global norm is far above 1 (about 170): a clip at 1 applies."""
  logits = model(TOKENS[:, :-1])
  return 50.0 * optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()


def train(model, tx, steps=2):
  """Losses and gradient norms of `steps` steps of `nnx.Optimizer(model, tx)`."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    norm = optax.global_norm(nnx.as_pure(grads))  # offlax's hook for host gradients
    optimizer.update(model, grads)
    return loss, norm

  return [tuple(float(v) for v in step(model, optimizer)) for _ in range(steps)], optimizer


def test_plain_optax_in_nnx_optimizer_names_the_fix():
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  with pytest.raises(offlax.errors.MemoryKindError) as info:
    nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  message = str(info.value)
  assert isinstance(info.value, ValueError)
  assert 'offlax.offload(tx, compute="host")' in message
  assert "docs/params_off_device.md" in message
  assert "model.a.bias (16,) (and 3 more) is in host memory" in message, message
  assert "Memory kind mismatch" in message  # JAX's own words, last
  # The way out it names trains.
  nnx.Optimizer(model, offlax.offload(optax.adamw(1e-2), compute="host"), wrt=nnx.Param)


def test_plain_optax_built_inside_jit_fails_at_its_update_naming_the_fix():
  """Inside `jit` optax's init passes (its moments on the device); the update then fails."""
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  optimizer = nnx.jit(lambda m: nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param))(model)

  @nnx.jit
  def step(model, optimizer):
    optimizer.update(model, nnx.grad(loss_fn)(model))

  with pytest.raises(
    offlax.errors.MemoryKindError, match=r"nnx.Optimizer update: param model\.a\."
  ):
    step(model, optimizer)


def test_other_errors_and_device_models_are_flax_own():
  offlax.offload_params(MLP(nnx.Rngs(1)))  # the hooks are installed
  model = MLP(nnx.Rngs(0))
  assert nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param).step[...] == 0

  def init(params):
    raise ValueError("Memory kind mismatch, from the user's own init")

  failing = optax.GradientTransformation(init, optax.adamw(1e-2).update)
  with pytest.raises(ValueError) as info:  # a device model: not offlax's error
    nnx.Optimizer(model, failing, wrt=nnx.Param)
  assert type(info.value) is ValueError
  host = offlax.offload_params(MLP(nnx.Rngs(0)))
  failing = optax.GradientTransformation(lambda p: 1 / 0, optax.adamw(1e-2).update)
  with pytest.raises(ZeroDivisionError):
    nnx.Optimizer(host, failing, wrt=nnx.Param)


def test_flax_and_optax_still_fail_with_jax_error():
  """Canary (docs/patches.md, nnx-optimizer-init-host-params): without the hook, JAX's words.

  Red: optax's init makes its zeros where the params are; drop the hook and its entry.
  """
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  assert patches.installed(nnx_hooks.OPTIMIZER_INIT) or patches.disabled()
  patches.uninstall(nnx_hooks.OPTIMIZER_INIT)
  try:
    with pytest.raises(ValueError, match="Memory kind mismatch") as info:
      nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    assert not isinstance(info.value, offlax.errors.OffloadError)
  finally:
    nnx_hooks.install()


# Host compute is the documented way (test_offload_params.py trains it by default).
_MODES = [pytest.param("host", marks=pytest.mark.slow), "device"]


@pytest.mark.parametrize("compute", _MODES, ids=["host-compute", "streamed"])
def test_offloaded_optimizer_equals_optax_on_the_device(compute):
  """Host compute (docs/params_off_device.md) and the streamed update: both as plain optax.

  Streamed, each slice's state and params go to the device and the new params
  come back to host memory: the same update, bit for bit.
  """
  want_model = MLP(nnx.Rngs(0))
  want, _ = train(want_model, optax.adamw(1e-2))
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  got, optimizer = train(model, offlax.offload(optax.adamw(1e-2), compute=compute))
  assert got == want
  assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param))
  assert kinds(nnx.state(model, nnx.Param)) == {"pinned_host"}
  moments = [x for x in jax.tree.leaves(optimizer.opt_state) if x.ndim]
  assert moments and kinds(moments) == {"pinned_host"}


@pytest.mark.parametrize(
  "compute",
  ["host", pytest.param("device", marks=pytest.mark.slow)],
  ids=["host-compute", "streamed"],
)
def test_clip_by_global_norm_inside_the_offload_equals_optax(compute):
  """`offload(chain(clip_by_global_norm(1.0), adamw))`: the clip applies, bit for bit.

  Inside the offload the update runs on values typed as device values (host
  compute) or on the device (streamed): optax's `tree.norm` needs no patch.
  """
  chain = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  want_model = MLP(nnx.Rngs(0))
  want, _ = train(want_model, chain())
  assert all(norm > 10 for _, norm in want)  # the clip scales every step's gradients
  unclipped = MLP(nnx.Rngs(0))
  train(unclipped, optax.adamw(1e-2))
  with pytest.raises(AssertionError):  # the clip changed the run
    assert_trees_equal(nnx.state(unclipped, nnx.Param), nnx.state(want_model, nnx.Param))
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  got, _ = train(model, offlax.offload(chain(), compute=compute))
  assert got == want
  assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param))


def test_clip_outside_the_offload_is_refused_with_the_way_out():
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  clip = optax.clip_by_global_norm(1.0)
  tx = optax.chain(clip, offlax.offload(optax.adamw(1e-2), compute="host"))
  with pytest.raises(
    offlax.errors.MemoryKindError, match=r"offlax\.offload\(optax\.chain\(\.\.\.\)"
  ):
    train(model, tx, steps=1)


def test_another_error_naming_a_memory_space_is_the_transformations_own():
  """`update_and_apply` recognises JAX's error by its operands' memory spaces, not its text."""

  def update(updates, state, params=None):
    raise ValueError("memory_space: the transformation's own check failed")

  own = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
  model = offlax.offload_params(MLP(nnx.Rngs(0)))
  tx = optax.chain(own, offlax.offload(optax.adamw(1e-2), compute="host"))
  with pytest.raises(ValueError, match="the transformation's own check failed") as info:
    train(model, tx, steps=1)
  assert not isinstance(info.value, offlax.errors.OffloadError)


def test_the_global_norm_hook_covers_what_tunix_calls_and_not_the_clip():
  """Canary of `optax-global-norm-host-leaves`'s scope (docs/patches.md).

  Tunix calls `optax.global_norm` (the hook's target); `clip_by_global_norm`
  calls `optax.tree.norm`, which the hook leaves alone: patched, a clip
  outside the offload would compute on host memory instead of being refused.
  Red: Tunix or optax changed the call; move or drop the hook.
  """
  offlax.offload_params(MLP(nnx.Rngs(0)))
  assert getattr(optax.global_norm, "__offlax_patch__", None) == (
    None if patches.disabled() else "optax-global-norm-host-leaves"
  )
  assert not hasattr(optax.tree.norm, "__offlax_patch__")
  assert "optax.tree.norm(updates)" in inspect.getsource(optax.clip_by_global_norm)
  trainer = pytest.importorskip("tunix.sft.peft_trainer")
  assert "optax.global_norm(grads)" in inspect.getsource(trainer)
