"""Offloaded state on a Mesh: 8 CPU devices (in a subprocess), and the sharding rules."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import offlax
from offlax._src import coupling as coupling_lib
from offlax._src import schedule, sharding

HERE = os.path.dirname(os.path.abspath(__file__))
# The last two make their state as `init` does for params on a GPU (in a host computation).
TIERS = ("stream", "zero1", "host", "host_zero1", "stream_init_on_host", "host_zero1_init_on_host")
MESHES = ("explicit", "auto")


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
  """One run of `sharded_run.py` with 8 devices; the other tests keep one device.

  It runs the mesh kinds the selected tests ask for (the default run: Auto axes).
  """
  here = request.node.nodeid.split("::")[0]
  kinds = [
    m
    for m in MESHES
    if any(
      f"{m}]" in i.nodeid or f"-{m}-" in i.nodeid or f"[{m}-" in i.nodeid
      for i in request.session.items
      if i.nodeid.startswith(here)
    )
  ]
  env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
  script = os.path.join(HERE, "sharded_run.py")
  out = subprocess.run(
    [sys.executable, script, str(tmp_path_factory.mktemp("nvme")), ",".join(kinds or MESHES)],
    capture_output=True, text=True, timeout=600, env=env,
  )  # fmt: skip
  lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT ") :])


def _spec(text):
  """A printed PartitionSpec without its trailing Nones: P('data', None) == P('data',)."""
  entries = [e.strip() for e in text[2:-1].split(",") if e.strip()]
  while entries and entries[-1] == "None":
    entries.pop()
  return tuple(entries)


@pytest.mark.slow  # the 8-device run; test_multi_device_example trains on a mesh
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("tier", TIERS)
def test_bit_exact_with_optax_on_the_same_mesh(results, mesh, tier):
  # Two steps of clip_by_global_norm + adamw: updates equal, sharded as their params.
  assert results[mesh][tier]["exact"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("tier", TIERS)
def test_state_is_sharded_in_each_devices_host_memory(results, mesh, tier):
  leaves = results[mesh][tier]["leaves"]
  zero1 = "zero1" in tier
  want = {
    "m": ("'data'", "'model'"),
    "w": ("'data'",),
    "v": ("'data'",) if zero1 else (),  # replicated param: ZeRO-1 shards its state
    "r": (),  # (6, 6): no axis divisible by 4, stays replicated
  }
  for moment in ("mu", "nu"):
    for name, spec in want.items():
      leaf = leaves[f"[1][0].{moment}['{name}']"]
      assert (leaf["kind"], leaf["mesh"], _spec(leaf["spec"])) == ("pinned_host", True, spec)
    # Per device: v (128 fp32) is 512 B replicated, a quarter of it under ZeRO-1.
    assert leaves[f"[1][0].{moment}['v']"]["device_bytes"] == (128 if zero1 else 512)
    assert leaves[f"[1][0].{moment}['w']"]["device_bytes"] == 64 * 32 * 4 // 4
  count = leaves["[1][0].count"]
  assert (count["kind"], count["mesh"], _spec(count["spec"])) == ("device", True, ())


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("tier", TIERS)
def test_sharded_step_exports_for_cuda(results, mesh, tier):
  exported = results[mesh][tier]["export"]
  assert exported["ok"], exported.get("error")
  assert exported["sharded"] and exported["placements"] > 0
  assert exported["host_args"] == 16  # mu and nu of 4 params, in and out, in pinned host memory


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("tier", TIERS)
def test_abstract_state_has_the_shardings_of_init(results, mesh, tier):
  assert results[mesh][tier]["abstract_state"]


# Per device, fp32: w (64 x 32 on "data") 2048 B, m (32 x 16 on both axes) 256 B,
# v (128) and r (6 x 6) replicated, 512 B and 144 B; mu and nu of each, and the count.
SHARD_BYTES = 2 * (2048 + 256 + 512 + 144) + 4


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_nvme_tier_on_the_mesh_is_exact_with_optax(results, mesh):
  # clip_by_global_norm outside offload, adamw inside: two steps, bit for bit,
  # updates sharded as their params; then reopened on the same mesh, a third.
  got = results[mesh]["nvme"]
  assert got["exact"] == [True, True] and got["step"] == 2
  assert got["exact_callback"] == [True, True]  # the slices carried by the callbacks
  assert got["resumed_exact"]
  assert got["retier_exact"]  # a plain optax state retiered into a sharded store


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_nvme_tier_on_the_mesh_with_an_update_that_reads_the_tree_dtypes(results, mesh):
  """A constant cast to the tree's highest dtype: one slice per device, not refused, exact."""
  assert results[mesh]["nvme"]["mixed_dtypes_exact"] == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_nvme_tier_keeps_one_store_per_device_with_only_its_shard(results, mesh):
  got = results[mesh]["nvme"]
  assert got["shards"] == list(range(8))
  # Each store's arrays equal that device's shard of optax's state after 2 steps.
  assert got["stored"]
  shapes = got["shard_shapes"]
  for moment in ("mu", "nu"):
    assert shapes[f"[0].{moment}['w']"] == [16, 32]  # a quarter of (64, 32): "data" is 4
    assert shapes[f"[0].{moment}['m']"] == [8, 8]  # an eighth of (32, 16)
    assert shapes[f"[0].{moment}['v']"] == [128]  # replicated: whole on every device
  # Bytes on disk: the committed generation's chunk files hold the shard, no more.
  assert got["shard_bytes"] == got["disk_bytes"] == {str(i): SHARD_BYTES for i in range(8)}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_nvme_store_resharded_for_another_mesh_continues_exactly(results, mesh):
  # offlax.checkpoint.reshard writes the store for a (2, 4) mesh, for other specs on the same
  # mesh, and for params on no mesh; the next step there equals plain optax's
  # from the same state, sharded as those params.
  resharded = results[mesh]["nvme"]["resharded"]
  assert set(resharded) == {"mesh", "spec", "none"}
  assert results[mesh]["nvme"]["blocks_match"]  # each position's block, as JAX places it
  for name, got in resharded.items():
    assert got["step"] == 3 and got["exact"] and got["sharded_like_params"], (name, got)
    assert got["shards"] == ([] if name == "none" else list(range(8)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_nvme_shards_a_step_apart_resume_from_the_common_step(results, mesh):
  # One shard's store rolled back a step, as a crash between commits leaves it:
  # reopening brings the others back to its step, and the next step is exact.
  agreed = results[mesh]["nvme"]["agreed"]
  assert agreed["steps"] == [2] * 8 and agreed["exact"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_nvme_tier_refuses_another_mesh_or_a_coupled_update(results, mesh):
  errors = results[mesh]["nvme"]["errors"]
  assert "written on a mesh {'data': 4, 'model': 2}" in errors["mesh"]
  assert "these params are on a mesh {'data': 2, 'model': 4}" in errors["mesh"]
  assert "param ['v'] is sharded as P() in the store, P('data',) now" in errors["spec"]
  assert "offlax.checkpoint.reshard(inner, params, path, new_path)" in errors["spec"]
  assert "offlax.checkpoint.reshard(inner, params, path, new_path)" in errors["mesh"]
  assert "sharded param(s) ['m'], ['w'] needs the other shards" in errors["coupled"]
  assert "optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(" in errors["coupled"]
  assert "sharded param(s) ['m'], ['w'] needs the other shards" in errors["lamb"]
  assert "state leaf [0].v_row['w'] is shaped [256], unlike its param ['w']" in errors["factored"]
  assert "holds the state of params sharded on a mesh" in errors["no_mesh"]
  assert "these params are on no mesh" in errors["no_mesh"]
  assert "NVMeTier(keep=1) on a mesh" in errors["keep1"] and "keep >= 2" in errors["keep1"]
  assert "a step failed on some of them" in errors["mixed_snapshot"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_nvme_rollback_of_a_sharded_root_rolls_back_every_shard(results, mesh):
  got = results[mesh]["nvme"]["root_rollback"]
  assert len(got["before"]) == 1 and got["after"] == [got["before"][0] - 1]


# -- the rules, in this process --------------------------------------------------

MESH = AbstractMesh((4, 2), ("data", "model"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_jitted_step_compiles_once_on_the_mesh(results, mesh):
  """Three calls of a jitted train step, each tier: one XLA compilation, as plain optax."""
  compiles = {tier: results[mesh][tier]["compiles"] for tier in TIERS}
  compiles["nvme"] = results[mesh]["nvme"]["compiles"]
  assert compiles == dict.fromkeys(compiles, 1)


def test_zero1_state_spec():
  assert sharding.state_spec((64, 32), P(), MESH, "data") == P("data", None)
  assert sharding.state_spec((6, 32), P(), MESH, "data") == P(None, "data")
  assert sharding.state_spec((6, 6), P(), MESH, "data") == P(None, None)
  assert sharding.state_spec((64, 32), P("data"), MESH, "data") == P("data", None)
  assert sharding.state_spec((64, 32), P("model"), MESH, "data") == P("model", "data")
  # No free dimension: the first sharded one whose shards "data" still divides.
  assert sharding.state_spec((1, 64), P(None, "model"), MESH, "data") == P(None, ("model", "data"))
  assert sharding.state_spec((1, 6), P(None, "model"), MESH, "data") == P(None, "model")
  assert sharding.state_spec((64, 32), P("model"), MESH, None) == P("model", None)


def test_cut_axis_avoids_every_sharded_axis():
  assert sharding.cut_axis((64, 32), P("data")) == 1
  assert sharding.cut_axis((64, 32), P(), P(None, "data")) == 0
  assert sharding.cut_axis((64, 32), P("data", "model")) is None
  assert sharding.cut_axis((1, 32), P()) == 1  # a length-1 axis cannot be cut
  assert sharding.shards(P("data", "model"), MESH, 2) == 8
  assert sharding.shards(P(("data", "model")), MESH, 1) == 8


def test_schedule_cuts_sharded_leaves_along_the_given_axis():
  shapes = [(64, 32), (64, 32), (16,)]
  coupling = coupling_lib.Coupling(groups=((0,), (1,), (2,)), splittable=frozenset({0, 1, 2}))
  slices = schedule.build(coupling, shapes, [4096, 4096, 4096], 1024, cut_axes=[1, None, None])
  pieces = [p for s in slices for p in s]
  assert {(p.axis, p.flat) for p in pieces if p.leaf == 0} == {(1, False)}
  assert sum(p.stop - p.start for p in pieces if p.leaf == 0) == 32
  assert [p.start for p in pieces if p.leaf in (1, 2)] == [None, None]  # no cut axis: whole
  x = jnp.arange(64 * 32.0).reshape(64, 32)
  parts = [p.take(x) for p in pieces if p.leaf == 0]
  assert jnp.array_equal(schedule.join([p for p in pieces if p.leaf == 0], parts, x.shape), x)


def test_shard_axis_needs_params_on_a_mesh_with_it():
  params = {"w": jnp.ones((8, 4))}
  with pytest.raises(offlax.errors.InvalidTierError, match="shard_axis='data'.*params on no mesh"):
    offlax.offload(optax.adam(1e-3), offlax.HostTier(shard_axis="data")).init(params)
  with pytest.raises(offlax.errors.InvalidTierError, match="mesh axis name or None"):
    offlax.HostTier(shard_axis=0)
  one = jax.make_mesh((1,), ("data",))  # a mesh of one device changes nothing
  on_one = jax.device_put(params, jax.sharding.NamedSharding(one, P("data")))
  state = offlax.offload(optax.adam(1e-3)).init(on_one)
  assert state.spec.mesh is None
