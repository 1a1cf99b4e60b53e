"""Run by `test_sharding.py` in a subprocess: offloaded state on an 8-device CPU mesh.

Prints one JSON line: for each mesh kind (Explicit and Auto axes) and tier
variant, whether two steps match plain optax on the same mesh bit for bit, the
sharding and memory kind of every state leaf, the bytes each device holds, and
whether the jitted step exports for CUDA with those shardings and memory kinds.
"""

import dataclasses
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
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import offlax  # noqa: E402
from offlax._src import ffi, host_tier, sharding  # noqa: E402
from offlax._src.nvme.store import Store  # noqa: E402


@dataclasses.dataclass(frozen=True)
class InitOnHost(offlax.HostTier):
  """A `HostTier` whose `init` takes the path of params on a GPU (the state made on the host)."""

  def init(self, inner, params, spec):
    on_accelerator = host_tier._on_accelerator
    host_tier._on_accelerator = lambda params: True
    try:
      return super().init(inner, params, spec)
    finally:
      host_tier._on_accelerator = on_accelerator


TIERS = {
  "stream": lambda: offlax.HostTier(chunk_bytes=512),
  "zero1": lambda: offlax.HostTier(chunk_bytes=512, shard_axis="data"),
  "host": lambda: offlax.HostTier(compute="host"),
  "host_zero1": lambda: offlax.HostTier(compute="host", shard_axis="data"),
  "stream_init_on_host": lambda: InitOnHost(chunk_bytes=512),
  "host_zero1_init_on_host": lambda: InitOnHost(compute="host", shard_axis="data"),
}


def run(axis_type):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  params, grads = make_params(mesh, 2)
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
      "compiles": count_compiles(tx, params, grads[0]),
    }
  return out


COMPILES = [0]


def _count(event, duration, **kw):
  if event == "/jax/core/compile/backend_compile_duration":
    COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def count_compiles(tx, params, grad):
  """XLA compilations over three calls of a jitted train step (one, as for plain optax)."""
  state = tx.init(params)

  @jax.jit
  def train(params, state, grad):
    updates, state = tx.update(grad, state, params)
    return optax.apply_updates(params, updates), state

  before = COMPILES[0]
  for _ in range(3):
    params, state = train(params, state, grad)
  jax.block_until_ready(params)
  return COMPILES[0] - before


def nvme_tier(path, **kw):
  return offlax.NVMeTier(path, chunk_bytes=1024, cache_bytes=300, progress=False, fsync=False, **kw)


def same(tree, want):
  return all(
    bool(jnp.array_equal(a, b)) and a.sharding.is_equivalent_to(b.sharding, a.ndim)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(want), strict=True)
  )


def run_nvme(axis_type, base):
  """The NVMe tier on the mesh: one store per device, exact, resumed, refused elsewhere."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  params, grads = make_params(mesh, 4)
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  ref_step = jax.jit(inner.update)
  ref_state, ref, states = inner.init(params), [], []
  for g in grads:
    u, ref_state = ref_step(g, ref_state, params)
    ref.append(u)
    states.append(ref_state)
  path = os.path.join(base, "store")
  # The global clip outside offload sees global arrays; adamw runs per shard.
  tx = lambda tier: optax.chain(
    optax.clip_by_global_norm(1.0), offlax.offload(optax.adamw(1e-2), tier)
  )
  compile_tier = nvme_tier(os.path.join(base, "compiles"))
  out_compiles = count_compiles(tx(compile_tier), params, grads[0])
  compile_tier.close()
  tier = nvme_tier(path)
  opt = tx(tier)
  state = opt.init(params)
  step = jax.jit(opt.update)
  exact = []
  for i in range(2):
    u, state = step(grads[i], state, params)
    exact.append(same(u, ref[i]))
  out = {"exact": exact, "step": int(state[1].step), "shards": sorted(tier.shards)}
  out["compiles"] = out_compiles
  tier.close()
  # The same with the slices carried by the callbacks (as on a GPU) instead of
  # offlax's native copies.
  registered, ffi._registered = ffi._registered, False
  try:
    callback_tier = nvme_tier(os.path.join(base, "store_callback"))
    opt = tx(callback_tier)
    state, step = opt.init(params), jax.jit(opt.update)
    out["exact_callback"] = []
    for i in range(2):
      u, state = step(grads[i], state, params)
      out["exact_callback"].append(same(u, ref[i]))
    callback_tier.close()
  finally:
    ffi._registered = registered
  # What each device's store holds: its shard of every state array, nothing more.
  stored, shapes, nbytes, disk = True, {}, {}, {}
  want = states[1][1]  # adamw's state after 2 steps, as offload(adamw) stores it
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(want)[0]}
  for i, device in enumerate(mesh.devices.flat):
    store = Store(os.path.join(path, f"shard_{i:05d}"), fsync=False)
    store.read_metadata()
    nbytes[i] = sum(r.nbytes for r in store.records)
    committed = os.path.join(store.path, f"gen{store.generation}")
    chunks = [os.path.join(d, f) for d, _, fs in os.walk(committed) for f in fs if "/c" in d]
    disk[i] = sum(os.path.getsize(c) - 4 for c in chunks)  # each chunk file ends in a crc32c
    for r in store.records:
      got = store.result(store.read(r.index, 0, r.size)).reshape(r.shape)
      (shard,) = [s for s in flat[r.path].addressable_shards if s.device == device]
      stored &= bool(np.array_equal(got, np.asarray(shard.data)))
      shapes[r.path] = list(r.shape)
  out.update(stored=stored, shard_shapes=shapes, shard_bytes=nbytes, disk_bytes=disk)
  # Reopened on the same mesh: continues bit for bit.
  tier = nvme_tier(path, resume=True)
  opt = tx(tier)
  state = opt.init(params)
  u, state = jax.jit(opt.update)(grads[2], state, params)
  out["resumed_exact"] = same(u, ref[2]) and int(state[1].step) == 3
  tier.close()
  # A crash between two shards' commits: one shard a step behind. Reopening
  # rolls the others back to its step, and training continues from there.
  offlax.checkpoint.rollback(os.path.join(path, "shard_00005"), 2)
  tier = nvme_tier(path, resume=True)
  opt = tx(tier)
  state = opt.init(params)
  steps = [
    Store(os.path.join(path, f"shard_{i:05d}"), fsync=False).read_metadata()["step"]
    for i in range(8)
  ]
  u, state = jax.jit(opt.update)(grads[2], state, params)
  out["agreed"] = {"steps": steps, "exact": same(u, ref[2])}
  tier.close()
  # Elsewhere: another mesh, another spec, a coupled update inside offload.
  errors = {}
  other = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  elsewhere = {
    "mesh": jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(other, x.sharding.spec)), params
    ),
    "spec": {**params, "v": jax.device_put(params["v"], NamedSharding(mesh, P("data")))},
  }
  for name, where in elsewhere.items():
    try:
      tx(nvme_tier(path, resume=True)).init(where)
      errors[name] = "accepted"
    except offlax.errors.StoreMismatchError as e:
      errors[name] = str(e)
  big = {"w": jax.device_put(jnp.ones((256, 256)), NamedSharding(mesh, P("data")))}
  for name, (opt, where) in {
    "coupled": (inner, params),
    "lamb": (optax.lamb(1e-3), params),  # a per-leaf norm: needs the leaf's other shards
    "factored": (optax.adafactor(1e-3), big),  # state shaped unlike its param
  }.items():
    coupled = offlax.offload(opt, nvme_tier(os.path.join(base, name)))
    try:
      jax.jit(coupled.update)(where, coupled.init(where), where)
      errors[name] = "accepted"
    except offlax.errors.InvalidTierError as e:
      errors[name] = str(e)
  try:  # a sharded store opened for params on no mesh
    offlax.offload(optax.adamw(1e-2), nvme_tier(path, resume=True)).init(
      jax.tree.map(np.asarray, params)
    )
    errors["no_mesh"] = "accepted"
  except offlax.errors.StoreMismatchError as e:
    errors["no_mesh"] = str(e)
  try:  # keep=1: a shard a step ahead after a crash could not go back
    offlax.offload(optax.adamw(1e-2), nvme_tier(os.path.join(base, "keep1"), keep=1)).init(params)
    errors["keep1"] = "accepted"
  except offlax.errors.InvalidTierError as e:
    errors["keep1"] = str(e)
  # A step that failed on one shard was committed by the others: no snapshot of that.
  tier = nvme_tier(path, resume=True)
  tx(tier).init(params)
  tier.shards[5].store.manifest.step -= 1  # (as if its last step had failed)
  try:
    tier.snapshot(os.path.join(base, "snapshot"))
    errors["mixed_snapshot"] = "accepted"
  except offlax.errors.StoreError as e:
    errors["mixed_snapshot"] = str(e)
  tier.shards[5].store.manifest.step += 1
  tier.close()
  out["errors"] = errors
  # A plain optax state moved into a sharded store (`retier`) continues exactly.
  tier = nvme_tier(os.path.join(base, "retier"))
  moved = offlax.checkpoint.retier(optax.adamw(1e-2), params, states[1][1], tier)
  u, _ = jax.jit(tx(tier).update)(grads[2], (states[1][0], moved), params)
  out["retier_exact"] = same(u, ref[2])
  tier.close()
  # Resharded (offlax.checkpoint.reshard) for another mesh, other specs, or no mesh: the
  # step after it is exact there, sharded as those params.
  resharded = {}
  targets = {**elsewhere, "none": jax.tree.map(np.asarray, params)}
  for name, where in targets.items():
    dest = os.path.join(base, f"reshard_{name}")
    step_of = offlax.checkpoint.reshard(
      optax.adamw(1e-2), where, path, dest, progress=False, fsync=False
    )
    tier = nvme_tier(dest, resume=True)
    opt = tx(tier)
    state = opt.init(where)
    g = jax.tree.map(
      lambda x, p: jax.device_put(x, p.sharding) if hasattr(p, "sharding") else np.asarray(x),
      grads[3],
      where,
    )
    # Plain optax's step there, from its state after 3 steps moved there (the
    # global norm's sums may round differently on another mesh).
    adam = states[2][1][0]
    put = lambda tree, where=where: jax.tree.map(
      lambda x, p: jax.device_put(np.asarray(x), getattr(p, "sharding", None)), tree, where
    )
    moved_state = (
      states[2][0],
      (adam._replace(count=np.asarray(adam.count), mu=put(adam.mu), nu=put(adam.nu)),)
      + states[2][1][1:],
    )
    want = ref_step(g, moved_state, where)[0]
    u, state = jax.jit(opt.update)(g, state, where)
    resharded[name] = {
      "step": step_of,
      "exact": all(np.array_equal(np.asarray(u[n]), np.asarray(want[n])) for n in params),
      "sharded_like_params": all(
        u[n].sharding.is_equivalent_to(where[n].sharding, u[n].ndim)
        for n in params
        if hasattr(where[n], "sharding")
      ),
      "shards": sorted(tier.shards),
    }
    tier.close()
  out["resharded"] = resharded
  # An update that reads the tree's dtypes (a constant cast to the highest one):
  # each device runs it in one slice, and it is still elementwise, per shard.
  mixed = {
    n: jax.device_put(
      jnp.linspace(-1, 1, 512, dtype=d).reshape(64, 8), NamedSharding(mesh, P("data"))
    )
    for n, d in (("a", jnp.float32), ("b", jnp.bfloat16))
  }

  def scale_by_highest_dtype(updates, state, params=None):
    c = jnp.asarray(0.3, optax.tree.dtype(updates, "highest"))
    return jax.tree.map(lambda g: (g * c).astype(g.dtype), updates), state

  reads_dtypes = optax.chain(
    optax.GradientTransformation(lambda p: optax.EmptyState(), scale_by_highest_dtype),
    optax.sgd(0.1, momentum=0.9),
  )
  opt = offlax.offload(reads_dtypes, nvme_tier(os.path.join(base, "mixed")))
  state, ref_state = opt.init(mixed), reads_dtypes.init(mixed)
  mixed_exact = []
  for i in range(2):
    g = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 2)), mixed)
    u, state = jax.jit(opt.update)(g, state, mixed)
    want, ref_state = jax.jit(reads_dtypes.update)(g, ref_state, mixed)
    mixed_exact.append(same(u, want))
  out["mixed_dtypes_exact"] = mixed_exact
  # The block of each mesh position, as offlax.checkpoint.reshard computes it, is JAX's.
  sizes = dict(mesh.shape)
  bounds = lambda index: [s.indices(n) for s, n in zip(index, (64, 32), strict=True)]
  out["blocks_match"] = all(
    bounds(sharding.block_index((64, 32), spec, sizes, i))
    == bounds(NamedSharding(mesh, spec).devices_indices_map((64, 32))[d])
    for spec in (P("data"), P(None, "model"), P(("model", "data")), P("model", "data"), P())
    for i, d in enumerate(mesh.devices.flat)
  )
  # Rolled back from the sharded root: every shard's store.
  read_step = lambda i: Store(os.path.join(path, f"shard_{i:05d}"), fsync=False).read_metadata()
  before = sorted({read_step(i)["step"] for i in range(8)})
  offlax.checkpoint.rollback(path, before[0] - 1)
  out["root_rollback"] = {
    "before": before,
    "after": sorted({read_step(i)["step"] for i in range(8)}),
  }
  return out


def make_params(mesh, n_grads):
  """Params of four sharding cases on `mesh`, and `n_grads` gradients."""
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
  grads = [jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), params) for i in range(n_grads)]
  return params, grads


results = {}
# argv[2], if given: the mesh kinds to run ("explicit,auto"); the default run asks for one.
kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["explicit", "auto"]
for t in (AxisType.Explicit, AxisType.Auto):
  name = str(t).split(".")[-1].lower()
  if name not in kinds:
    continue
  results[name] = run(t)
  results[name]["nvme"] = run_nvme(t, os.path.join(sys.argv[1], name))
print("RESULT " + json.dumps(results), flush=True)
sys.exit(0)
