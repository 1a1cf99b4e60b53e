"""Run by `test_sharding.py` in a subprocess: offloaded state on an 8-device CPU mesh.

Prints one JSON line: for each mesh kind (Explicit and Auto axes) and tier
variant, whether two steps match plain optax on the same mesh bit for bit, the
sharding and memory kind of every state leaf, the bytes each device holds, and
whether the jitted step exports for CUDA with those shardings and memory kinds.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=8 --xla_disable_hlo_passes=algsimp "
  "--xla_cpu_max_isa=SSE4_2"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import offlax  # noqa: E402

TIERS = {
  "stream": lambda: offlax.HostTier(chunk_bytes=512),
  "zero1": lambda: offlax.HostTier(chunk_bytes=512, shard_axis="data"),
  "host": lambda: offlax.HostTier(compute="host"),
  "host_zero1": lambda: offlax.HostTier(compute="host", shard_axis="data"),
}


def run(axis_type):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  k = jax.random.split(jax.random.key(0), 4)
  layout = {
    "w": ((64, 32), P("data", None)),  # cut along axis 1, the one no mesh axis shards
    "m": ((32, 16), P("data", "model")),  # every axis sharded: moves whole
    "v": ((128,), P()),  # replicated: ZeRO-1 shards its state over "data"
    "r": ((6, 6), P()),  # no axis divisible by 4: stays replicated under ZeRO-1
  }
  params = {
    name: jax.device_put(jax.random.normal(key, shape), NamedSharding(mesh, spec))
    for key, (name, (shape, spec)) in zip(k, layout.items(), strict=True)
  }
  grads = [jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), params) for i in range(2)]
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  ref_step = jax.jit(inner.update)
  ref_state, ref = inner.init(params), []
  for g in grads:
    u, ref_state = ref_step(g, ref_state, params)
    ref.append(u)
  out = {}
  for name, make in TIERS.items():
    tx = offlax.offload(inner, make())
    state0 = tx.init(params)
    state, exact = state0, True
    step = jax.jit(tx.update)
    for g, want in zip(grads, ref, strict=True):
      u, state = step(g, state, params)
      exact &= all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want), strict=True)
      )
      exact &= all(u[n].sharding.is_equivalent_to(params[n].sharding, u[n].ndim) for n in params)
    leaves = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state.inner_state)[0]:
      leaves[jax.tree_util.keystr(path)] = {
        "spec": str(x.sharding.spec),
        "kind": x.sharding.memory_kind,
        "mesh": x.sharding.mesh == mesh if hasattr(x.sharding, "mesh") else False,
        "device_bytes": max(s.data.nbytes for s in x.addressable_shards),
      }
    abstract = offlax.abstract_state(inner, params, make())
    same_target = all(
      a.sharding == b.sharding
      for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(state0), strict=True)
    )
    specs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      (grads[0], state0, params),
    )
    try:
      text = jax.export.export(jax.jit(tx.update), platforms=["cuda"])(*specs).mlir_module()
      exported = {
        "ok": True,
        "placements": text.count("annotate_device_placement"),
        "host_args": text.count('mhlo.memory_kind = "pinned_host"'),
        "sharded": '{"data"}' in text,
      }
    except Exception as e:  # the test prints it
      exported = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    out[name] = {
      "exact": exact,
      "leaves": leaves,
      "abstract_state": same_target,
      "export": exported,
    }
  return out


results = {str(t).split(".")[-1].lower(): run(t) for t in (AxisType.Explicit, AxisType.Auto)}
mesh = jax.make_mesh((8,), ("data",))
try:
  sharded = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))}
  offlax.offload(optax.adam(1e-3), offlax.NVMeTier(sys.argv[1], progress=False)).init(sharded)
  results["nvme"] = "accepted"
except offlax.InvalidTierError as e:
  results["nvme"] = str(e)
print("RESULT " + json.dumps(results), flush=True)
sys.exit(0)
