"""One process of `test_multiprocess.py`: trains with offloaded state on a 2-process mesh.

Run as `python multiprocess_worker.py PROCESS_ID PORT CKPT_DIR`; prints one JSON
line of results. Each process has 2 CPU devices; the mesh spans both
processes (4 devices). Bit-exactness needs the same XLA flags as the tests.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=2 --xla_disable_hlo_passes=algsimp "
  "--xla_cpu_max_isa=SSE4_2"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port, ckpt_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import offlax  # noqa: E402

mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def global_array(shape, spec, seed):
  """A global array on `mesh`, the same values in every process."""
  value = np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32))
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(shape, sharding, lambda index: value[index])


params = {"w": global_array((32, 16), P("data"), 0), "b": global_array((16,), P(), 1)}


def grads(step):
  return jax.tree.map(lambda x: jnp.sin(x * (step + 1)), params)


def local(tree):
  """This process's shards, as lists of numpy arrays (comparable across runs)."""
  return [[np.asarray(s.data) for s in x.addressable_shards] for x in jax.tree.leaves(tree)]


def same(a, b):
  return all(
    all(np.array_equal(x, y) for x, y in zip(xs, ys, strict=True))
    for xs, ys in zip(local(a), local(b), strict=True)
  )


inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
results = {}
ref_state = inner.init(params)
ref_step = jax.jit(inner.update)
ref = []
for i in range(4):
  u, ref_state = ref_step(grads(i), ref_state, params)
  ref.append(u)


def exact_steps(step, state, steps):
  """`step` at each of `steps`: whether every update equals optax's, and the last state."""
  ok = []
  for i in steps:
    u, state = step(grads(i), state, params)
    ok.append(same(u, ref[i]))
  return all(ok), state


for name, tier in {
  "stream": offlax.HostTier(chunk_bytes=256),
  "zero1": offlax.HostTier(chunk_bytes=256, shard_axis="data"),
  "host": offlax.HostTier(compute="host", shard_axis="data"),
}.items():
  tx = offlax.offload(inner, tier)
  state = tx.init(params)
  step = jax.jit(tx.update)
  exact, state = exact_steps(step, state, range(2))
  mu = state.inner_state[1][0].mu
  results[name] = {
    "exact": exact,
    "kinds": sorted({x.sharding.memory_kind for x in jax.tree.leaves(mu)}),
    "specs": {k: str(v.sharding.spec) for k, v in mu.items()},
    "local_bytes": {k: sum(s.data.nbytes for s in v.addressable_shards) for k, v in mu.items()},
  }
  # An orbax checkpoint of the sharded offloaded state, written by both
  # processes, restored into the target `abstract_state` builds, then 2 steps.
  path = os.path.join(ckpt_dir, name)
  with ocp.CheckpointManager(path) as mngr:
    mngr.save(2, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    target = offlax.abstract_state(inner, params, tier)
    restored = mngr.restore(2, args=ocp.args.StandardRestore(target))
  results[name]["resumed_exact"], restored = exact_steps(step, restored, (2, 3))
  # The same with offlax.checkpoint.HostStateSave: each process writes its own shards' files.
  with ocp.CheckpointManager(path + "_direct") as mngr:
    mngr.save(
      2, args=ocp.args.Composite(opt=offlax.checkpoint.HostStateSave(state, progress=False))
    )
    mngr.wait_until_finished()
    item = offlax.checkpoint.HostStateRestore(target, progress=False)
    direct = mngr.restore(2, args=ocp.args.Composite(opt=item)).opt
  results[name]["direct_resumed_exact"], _ = exact_steps(step, direct, (2, 3))
  results[name]["direct_files"] = sorted(os.listdir(os.path.join(path + "_direct", "2", "opt")))
  results[name]["restored_kinds"] = sorted(
    {x.sharding.memory_kind for x in jax.tree.leaves(restored.inner_state[1][0].mu)}
  )

# The NVMe tier: one store per device under one path, each process writing its
# own devices' stores; the global clip stays outside offload (on global arrays).
store = os.path.join(ckpt_dir, "nvme")
options = dict(chunk_bytes=256, cache_bytes=0, progress=False, fsync=False)
tier = offlax.NVMeTier(store, **options)
tx = optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(1e-2), tier))
state = tx.init(params)
step = jax.jit(tx.update)
exact, state = exact_steps(step, state, range(2))
got = {"exact": exact, "shards": sorted(tier.shards), "step": tier.store.step}
# An orbax checkpoint of the store (each process copies its own shards), restored
# to a new path, reopened there, and 2 more steps.
with ocp.CheckpointManager(os.path.join(ckpt_dir, "nvme_ckpt")) as mngr:
  mngr.save(2, args=ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreSave(tier)))
  mngr.wait_until_finished()
  tier.close()
  restored = os.path.join(ckpt_dir, "nvme_restored")
  mngr.restore(
    2, args=ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreRestore(restored, progress=False))
  )
tier = offlax.NVMeTier(restored, resume=True, **options)
tx = optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(1e-2), tier))
state = tx.init(params)
step = jax.jit(tx.update)
resumed_exact, state = exact_steps(step, state, (2, 3))
got.update(resumed_exact=resumed_exact, resumed_step=tier.store.step)
got["dirs"] = sorted(d for d in os.listdir(restored) if d.startswith("shard_"))
tier.close()
# Resharded for other specs (offlax.checkpoint.reshard: each process reads every shard through
# the shared directory and writes its own devices' stores), then one more step.
new_params = {
  "w": global_array((32, 16), P(None, "data"), 0),
  "b": global_array((16,), P("data"), 1),
}
resharded = os.path.join(ckpt_dir, "nvme_resharded")
got["reshard_step"] = offlax.checkpoint.reshard(
  optax.adamw(1e-2), new_params, restored, resharded, **options
)
tier = offlax.NVMeTier(resharded, resume=True, **options)
tx = optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(1e-2), tier))
state = tx.init(new_params)
like_new = lambda tree: jax.tree.map(lambda x, p: jax.device_put(x, p.sharding), tree, new_params)
g = like_new(grads(4))
adam = ref_state[1][0]
moved = (
  ref_state[0],
  (adam._replace(mu=like_new(adam.mu), nu=like_new(adam.nu)),) + ref_state[1][1:],
)
u, state = jax.jit(tx.update)(g, state, new_params)
got["resharded_exact"] = same(u, ref_step(g, moved, new_params)[0])
got["resharded_shards"] = sorted(tier.shards)
tier.close()
results["nvme"] = got

print("RESULT " + json.dumps({"process": process_id, **results}), flush=True)
jax.distributed.shutdown()
