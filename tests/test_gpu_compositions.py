"""Every documented composition of an NNX model's train step compiles for a GPU.

XLA's GPU compiler (`offlax.compile_for_gpu`) rejects programs the CPU backend runs: a
host computation given a gradient in the layout a dot chose for it, a move to host memory
inside a `lax.cond` branch. Each failed here before its fix (this sweep found three); the
tests that pin each one run by default (`test_offload_params.py`, `test_state_bits.py`).
Here the whole grid, slow: the wrappers of docs/exactness.md, fp32 and 8-bit state, the
update streamed through the device or computed on the host, params on the device or in
host memory (`offlax.offload_params`). Each step returns its gradients' global norm, as
Tunix's `PeftTrainer` does (its own step: `test_tunix_gpu_steps.py`).
"""

import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import offlax
from offlax._src import gpu_compile

pytestmark = [
  pytest.mark.slow,  # 64 GPU compiles, about 2 minutes on 2 cores
  pytest.mark.skipif(
    not offlax.extend.gpu_compile_available(),
    reason="needs offlax[gpu-compile] (jax-cuda12-plugin)",
  ),
]


def _adamw(bits):
  return offlax.adamw(1e-3, state_bits=bits)


def _all(params):
  return jax.tree.map(lambda _: True, params)


_INJECTED = optax.inject_hyperparams(offlax.adamw, static_args=("state_bits",))

# Each a function of (state_bits, compute): the optimizer an nnx.Optimizer is given.
FORMS = {
  "offload": lambda b, c: offlax.offload(_adamw(b), compute=c),
  "master": lambda b, c: offlax.offload(offlax.master_weights(_adamw(b)), compute=c),
  "chain_clip_outside": lambda b, c: optax.chain(
    optax.clip_by_global_norm(1.0), offlax.offload(_adamw(b), compute=c)
  ),
  "chain_clip_inside": lambda b, c: offlax.offload(
    optax.chain(optax.clip_by_global_norm(1.0), _adamw(b)), compute=c
  ),
  "multi_steps": lambda b, c: optax.MultiSteps(offlax.offload(_adamw(b), compute=c), 2),
  "multi_steps_master": lambda b, c: optax.MultiSteps(
    offlax.offload(offlax.master_weights(_adamw(b)), compute=c), 2
  ),
  "masked": lambda b, c: optax.masked(offlax.offload(_adamw(b), compute=c), _all),
  "inject_hyperparams": lambda b, c: offlax.offload(_INJECTED(1e-3, state_bits=b), compute=c),
}


class MLP(nnx.Module):
  def __init__(self, dtype, rngs):
    self.a = nnx.Linear(64, 256, param_dtype=dtype, rngs=rngs)
    self.b = nnx.Linear(256, 64, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x.astype(self.a.kernel.dtype))))


@pytest.mark.parametrize(
  "form, bits, compute, where",
  list(itertools.product(FORMS, (32, 8), ("device", "host"), ("device", "pinned_host"))),
)
def test_the_train_step_compiles_for_gpu(form, bits, compute, where):
  dtype = jnp.bfloat16 if form.endswith("master") else jnp.float32
  model = MLP(dtype, nnx.Rngs(0))
  if where == "pinned_host":
    model = offlax.offload_params(model)
  tx = FORMS[form](bits, compute)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, x):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    grad_norm = optax.global_norm(grads)  # as Tunix's train step logs it
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), grad_norm

  step = jax.jit(step, donate_argnums=0)
  args = gpu_compile.state_specs(state), jnp.ones((8, 64))
  if form == "chain_clip_outside" and where == "pinned_host":
    # The clip would compute on the host's gradients outside offload: refused, with the way out.
    with pytest.raises(offlax.errors.MemoryKindError, match=r"offlax.offload\(optax.chain"):
      offlax.compile_for_gpu(step, *args)
    return
  c = offlax.compile_for_gpu(step, *args)
  assert c.host_compute == (), c.table()
