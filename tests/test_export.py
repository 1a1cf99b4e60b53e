"""The jitted train step lowers for CUDA with explicit host-offload annotations.

The CPU backend elides transfers and accepts programs a GPU compile rejects, so
every supported composition is exported for CUDA: that type-checks memory
spaces and shows the `annotate_device_placement` calls XLA's host offloader
acts on. A jaxpr walk adds what export does not check: host-resident values are
only sliced, joined or moved, never computed on.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import grads_like, model_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import offlax

# Moving, slicing and joining are what XLA's host offloader accepts on host
# buffers; anything else would be compute on host memory.
# What a host value may go through outside the host computation: moves, slicing in and
# writing back (in place), reshapes (a leaf cut flat) and the barriers that order slices.
# Not `concatenate`: XLA:GPU turns a concatenate of host arrays into slow host compute.
_HOST_OPS = {
  "device_put", "slice", "dynamic_slice", "dynamic_update_slice", "reshape",
  "optimization_barrier",
}  # fmt: skip
_NESTED = ("cond", "jit", "pjit", "closed_call", "scan", "while")


def _float_params():
  params = model_params()
  del params["steps_seen"]
  return params


MODES = ("device", "host")

COMPOSITIONS = {
  "adamw": lambda m: offlax.offload(optax.adamw(1e-3), compute=m, chunk_bytes=2048),
  "one_slice": lambda m: offlax.offload(optax.adamw(1e-3), compute=m),
  "clip_then_offload": lambda m: optax.chain(
    optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(1e-3), compute=m, chunk_bytes=2048)
  ),
  "offload_chain": lambda m: offlax.offload(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), compute=m, chunk_bytes=2048
  ),
  "inject_hyperparams": lambda m: offlax.offload(
    optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), compute=m, chunk_bytes=2048
  ),
  # MultiSteps outside offload selects old/new state with jnp.where, which is
  # compute on host memory; inside, the accumulators are offloaded too.
  "multi_steps": lambda m: offlax.offload(
    optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2).gradient_transformation(),
    compute=m,
    chunk_bytes=2048,
  ),
  "masked": lambda m: offlax.offload(
    optax.masked(optax.adam(1e-3), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    compute=m,
    chunk_bytes=2048,
  ),
  "multi_transform": lambda m: optax.multi_transform(
    {"a": offlax.offload(optax.adam(1e-3), compute=m, chunk_bytes=2048), "b": optax.sgd(1e-2)},
    lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", p),
  ),
  "lion_schedule": lambda m: offlax.offload(
    optax.lion(optax.linear_schedule(1e-3, 0.0, 100)), compute=m, chunk_bytes=700
  ),
  "adafactor": lambda m: offlax.offload(optax.adafactor(1e-3), compute=m, chunk_bytes=2048),
}


def _step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _specs(tree, mesh):
  def spec(x):
    kind = x.sharding.memory_kind
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, P(), memory_kind=kind)
    )

  return jax.tree.map(spec, tree)


def _main_signature(module: str) -> tuple[str, str]:
  header = re.search(r"func\.func public @main\((.*?)\) -> \((.*?)\) \{", module, re.S)
  assert header, "no main function in the exported module"
  return header.group(1), header.group(2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", COMPOSITIONS)
def test_exports_for_cuda_with_host_annotations(name, mode):
  params = _float_params()
  tx = COMPOSITIONS[name](mode)
  state = tx.init(params)
  grads = grads_like(params, 0)
  mesh = jax.make_mesh((1,), ("d",))
  host_leaves = sum(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state))
  assert host_leaves > 0

  exported = jax.export.export(jax.jit(_step(tx), keep_unused=True), platforms=["cuda"])(
    *(_specs(t, mesh) for t in (params, state, grads))
  )
  module = exported.mlir_module()
  to_host = re.findall(r'annotate_device_placement.*_xla_buffer_placement = "pinned_host"', module)
  to_device = re.findall(r'annotate_device_placement.*_xla_buffer_placement = "device"', module)
  assert to_host and to_device, "expected transfers in both directions"
  args, results = _main_signature(module)
  assert args.count('mhlo.memory_kind = "pinned_host"') == host_leaves
  assert results.count('mhlo.memory_kind = "pinned_host"') == host_leaves
  assert ('_xla_compute_type = "host"' in module) == (mode == "host")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", COMPOSITIONS)
def test_host_values_are_only_moved_or_sliced(name, mode):
  """Outside the host computation (`compute_on`, host mode only), that is."""
  params = _float_params()
  tx = COMPOSITIONS[name](mode)
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(_step(tx))(params, state, grads_like(params, 0))
  allowed = _HOST_OPS | ({"compute_on"} if mode == "host" else set())
  bad = list(_compute_on_host(jaxpr.jaxpr, allowed))
  assert not bad, f"computation on host-resident values: {bad[:5]}"
  assert (mode == "host") == any(e.primitive.name == "compute_on" for e in _eqns(jaxpr.jaxpr))


def _is_host(v) -> bool:
  return getattr(getattr(v, "aval", None), "memory_space", None) == jax.memory.Space.Host


def _eqns(jaxpr):
  """Every equation, in nested jaxprs too (except inside `compute_on`)."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name == "cond":
      for branch in eqn.params["branches"]:
        yield from _eqns(branch.jaxpr)
    elif eqn.primitive.name in ("jit", "pjit", "closed_call", "scan"):
      yield from _eqns(eqn.params["jaxpr"].jaxpr)
    elif eqn.primitive.name == "while":  # the streamed loops over a leaf's pieces
      yield from _eqns(eqn.params["body_jaxpr"].jaxpr)


def _compute_on_host(jaxpr, allowed):
  for eqn in _eqns(jaxpr):
    name = eqn.primitive.name
    nested = name in _NESTED
    if not nested and name not in allowed and any(_is_host(v) for v in eqn.invars):
      yield name


def test_counts_transfers_per_slice():
  """A leaf cut into pieces streams them in one loop: its transfers are written once."""
  params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
  mesh = jax.make_mesh((1,), ("d",))
  counts, loops = {}, {}
  for chunk in (2**40, 4096):
    tx = offlax.offload(optax.adam(1e-3), chunk_bytes=chunk)
    state = tx.init(params)
    module = jax.export.export(jax.jit(_step(tx)), platforms=["cuda"])(
      *(_specs(t, mesh) for t in (params, state, params))
    ).mlir_module()
    counts[chunk] = module.count('_xla_buffer_placement = "device"')
    loops[chunk] = module.count("stablehlo.while")
  # With 4 KiB slices w's mu and nu (8 KiB each) are cut into four row ranges
  # each, streamed by one loop whose body moves one piece of each: the program
  # has as many transfers as with one slice, and one loop more.
  assert counts[4096] == counts[2**40]
  assert (loops[2**40], loops[4096]) == (0, 1)
