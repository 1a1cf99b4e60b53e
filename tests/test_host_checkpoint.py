"""`offlax.checkpoint.HostStateSave` and `HostStateRestore`: host-tier state as raw files."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_trees_equal, grads_like, model_params, refuse_direct_io

import offlax
from offlax._src.nvme import array_files, direct_io


def _setup():
  params = model_params()
  del params["steps_seen"]  # optax's moments of int params turn float: init's dtype no longer holds
  params["empty"] = jnp.zeros((0, 3), jnp.bfloat16)  # orbax's handlers refuse zero-size arrays
  inner = optax.adamw(1e-3)
  tx = offlax.offload(inner, offlax.HostTier(chunk_bytes=1024))
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  return inner, params, tx, step


def _train(params, state, step, steps):
  for i in steps:
    updates, state = step(params, state, grads_like(params, i))
    params = optax.apply_updates(params, updates)
  return params, state


def _save(directory, step, **items):
  with ocp.CheckpointManager(directory) as m:
    m.save(step, args=ocp.args.Composite(**items))
    m.wait_until_finished()


def _restore(directory, step, **items):
  with ocp.CheckpointManager(directory) as m:
    return m.restore(step, args=ocp.args.Composite(**items))


def test_round_trip_resumes_training_bit_exactly(tmp_path):
  inner, params, tx, step = _setup()
  params, state = _train(params, tx.init(params), step, range(2))
  # Any pytree of arrays: the params (in device memory) too, restored into live arrays.
  _save(
    tmp_path,
    2,
    model=offlax.checkpoint.HostStateSave(params),
    opt=offlax.checkpoint.HostStateSave(state),
  )
  target = offlax.abstract_state(inner, params)
  restored = _restore(
    tmp_path,
    2,
    model=offlax.checkpoint.HostStateRestore(params),
    opt=offlax.checkpoint.HostStateRestore(target),
  )
  assert_trees_equal(restored.model, params)
  assert_trees_equal(restored.opt, state)
  kinds = lambda t: [  # noqa: E731
    (x.sharding.memory_kind, jax.typeof(x).memory_space) for x in jax.tree.leaves(t)
  ]
  assert kinds(restored.opt) == kinds(state)
  assert ("pinned_host", jax.memory.Space.Host) in kinds(state)
  # Training goes on from the restored state exactly as without the checkpoint.
  want = _train(params, state, step, range(2, 4))
  got = _train(restored.model, restored.opt, step, range(2, 4))
  assert_trees_equal(got, want)
  # One file per leaf (one shard each here), the layout, and this process's checksums.
  files = set(os.listdir(tmp_path / "2" / "opt"))
  leaves = jax.tree.leaves(state)
  assert {f"{i}.0" for i in range(len(leaves))} <= files
  assert {"host_state.json", "crc32c.0.json"} <= files
  with open(tmp_path / "2" / "opt" / "host_state.json") as f:
    layout = json.load(f)["leaves"]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
  assert [leaf["path"] for leaf in layout] == paths


def test_corrupted_files_are_refused_naming_the_file(tmp_path):
  inner, params, tx, step = _setup()
  _, state = _train(params, tx.init(params), step, range(1))
  _save(tmp_path, 1, opt=offlax.checkpoint.HostStateSave(state, progress=False))
  target = offlax.abstract_state(inner, params)
  biggest = max((tmp_path / "1" / "opt").glob("*.0"), key=lambda p: p.stat().st_size)
  data = bytearray(biggest.read_bytes())
  data[len(data) // 2] ^= 1
  biggest.write_bytes(bytes(data))
  with pytest.raises(offlax.errors.StoreCorruptedError, match=f"{biggest.name}.*checksum"):
    _restore(tmp_path, 1, opt=offlax.checkpoint.HostStateRestore(target))
  biggest.write_bytes(bytes(data[:-5]))
  with pytest.raises(
    offlax.errors.StoreCorruptedError, match=f"{biggest.name} holds {len(data) - 5}"
  ):
    _restore(tmp_path, 1, opt=offlax.checkpoint.HostStateRestore(target))


def test_bad_targets_and_states_are_refused(tmp_path):
  inner, params, tx, _ = _setup()
  state = tx.init(params)
  _save(tmp_path, 0, opt=offlax.checkpoint.HostStateSave(state, progress=False))
  other = dict(params, embed=jnp.zeros((3, 3)))
  with pytest.raises(offlax.errors.TreeMismatchError, match=r"\['embed'\].*float32\[3, 3\].*holds"):
    _restore(
      tmp_path, 0, opt=offlax.checkpoint.HostStateRestore(offlax.abstract_state(inner, other))
    )
  with pytest.raises(
    offlax.errors.TreeMismatchError, match=r"leaf 0 of the target is .count int32"
  ):
    _restore(tmp_path, 0, opt=offlax.checkpoint.HostStateRestore(state.inner_state[0]))
  with pytest.raises(offlax.errors.InvalidTargetError, match="abstract_state"):
    offlax.checkpoint.HostStateRestore(None)
  with pytest.raises(offlax.errors.LeafTypeError, match=r"\['lr'\] is a str"):
    _save(tmp_path / "bad", 0, opt=offlax.checkpoint.HostStateSave({"lr": "high"}))
  with pytest.raises(offlax.errors.LeafTypeError, match=r"\['rng'\] is a PRNG key"):
    _save(tmp_path / "bad", 1, opt=offlax.checkpoint.HostStateSave({"rng": jax.random.key(0)}))


def test_restores_into_another_sharding(tmp_path):
  """Saved sharded on 4 devices; restored sharded otherwise, replicated, and on one device."""
  script = textwrap.dedent(f"""
    import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp, offlax
    from jax.sharding import NamedSharding, PartitionSpec as P
    devices = np.array(jax.devices())
    mesh4 = jax.sharding.Mesh(devices, ("x",))
    mesh22 = jax.sharding.Mesh(devices.reshape(2, 2), ("a", "b"))
    host = lambda mesh, spec: NamedSharding(mesh, spec, memory_kind="pinned_host")
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    state = {{"m": jax.device_put(value, host(mesh4, P("x"))),
              "v": jax.device_put(value.astype(jnp.bfloat16), host(mesh22, P("a", "b"))),
              "r": jax.device_put(value, host(mesh4, P()))}}
    with ocp.CheckpointManager({str(tmp_path)!r}) as m:
      m.save(0, args=ocp.args.Composite(opt=offlax.checkpoint.HostStateSave(state, progress=False)))
      m.wait_until_finished()
      for m_sharding, v_sharding in [
          (host(mesh22, P("b", "a")), host(mesh4, P(None, "x"))),
          (host(mesh4, P()), host(mesh22, P(None, "a"))),
          (jax.sharding.SingleDeviceSharding(devices[3], memory_kind="pinned_host"), None)]:
        target = {{"m": jax.ShapeDtypeStruct((8, 12), jnp.float32, sharding=m_sharding),
                   "v": jax.ShapeDtypeStruct((8, 12), jnp.bfloat16, sharding=v_sharding),
                   "r": jax.ShapeDtypeStruct((8, 12), jnp.float32, sharding=host(mesh22, P()))}}
        item = offlax.checkpoint.HostStateRestore(target)
        got = m.restore(0, args=ocp.args.Composite(opt=item))["opt"]
        assert np.array_equal(np.asarray(got["m"]), value)
        assert np.array_equal(np.asarray(got["r"]), value)
        assert np.array_equal(np.asarray(got["v"]), value.astype(jnp.bfloat16))
        assert got["m"].sharding.memory_kind == "pinned_host", got["m"].sharding
        assert jax.typeof(got["m"]).memory_space == jax.memory.Space.Host
        for x in jax.tree.leaves(got):  # replicas in buffers of their own, never aliased
          shards = x.addressable_shards
          assert len({{s.data.unsafe_buffer_pointer() for s in shards}}) == len(shards)
        if v_sharding is not None:
          assert got["v"].sharding == v_sharding
    print("ok")
  """)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("direct", ["direct", "none", "refused"])
@pytest.mark.parametrize("size", [0, 5, 4096, 3 * 65536 + 7])
def test_array_files_round_trip(tmp_path, monkeypatch, direct, size):
  """Files of every size class, by direct I/O and through the page cache, in small ranges.

  "none": the platform has no O_DIRECT; "refused": the filesystem refuses it.
  """
  monkeypatch.setattr(array_files, "RANGE_BYTES", 65536)
  monkeypatch.setattr(array_files, "BLOCK_BYTES", 8192)
  if direct == "none":
    monkeypatch.setattr(direct_io, "O_DIRECT", 0)
  elif direct == "refused":
    refuse_direct_io(monkeypatch)
  a = np.random.default_rng(size).integers(0, 256, size, np.uint8)
  b = np.random.default_rng(1).standard_normal((size // 4 + 1, 3)).astype(jnp.bfloat16)
  items = [(str(tmp_path / "a"), lambda: a, a.nbytes), (str(tmp_path / "b"), lambda: b, b.nbytes)]
  crcs = array_files.write_files(items)
  assert os.path.getsize(tmp_path / "a") == size
  assert len(crcs[str(tmp_path / "a")]) == -(-size // 65536)
  reads = [
    (str(tmp_path / "a"), a.shape, a.dtype, crcs[str(tmp_path / "a")]),
    (str(tmp_path / "b"), b.shape, b.dtype, crcs[str(tmp_path / "b")]),
  ]
  got = dict(array_files.read_files(reads))
  assert got[0].dtype == a.dtype and np.array_equal(got[0], a)
  assert got[1].dtype == b.dtype and np.array_equal(got[1].view(np.uint16), b.view(np.uint16))
  with pytest.raises(offlax.errors.StoreError, match="File exists"):  # never over an existing file
    array_files.write_files(items[:1])


def test_progress_bars_in_bytes(tmp_path, capsys, bars_at_once):
  inner, params, tx, _ = _setup()
  state = tx.init(params)
  _save(tmp_path, 0, opt=offlax.checkpoint.HostStateSave(state))
  assert "offlax: saving host state" in capsys.readouterr().err
  _restore(
    tmp_path, 0, opt=offlax.checkpoint.HostStateRestore(offlax.abstract_state(inner, params))
  )
  err = capsys.readouterr().err
  assert "offlax: restoring host state" in err and "B/s" in err


def test_inspect_checks_the_files_and_their_checksums(tmp_path):
  inner, params, tx, step = _setup()
  _, state = _train(params, tx.init(params), step, range(1))
  _save(tmp_path, 1, opt=offlax.checkpoint.HostStateSave(state, progress=False))
  [report] = offlax.checkpoint.inspect_store(tmp_path, verify=True, progress=False)
  assert report.ok and report.kind == "host_state", report.format()
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
  assert [leaf.path for leaf in report.leaves] == paths
  assert {leaf.status for leaf in report.leaves} == {"verified"}
  assert sum(leaf.nbytes for leaf in report.leaves) == sum(x.nbytes for x in jax.tree.leaves(state))
  item = tmp_path / "1" / "opt"
  biggest = max(item.glob("*.0"), key=lambda p: p.stat().st_size)
  data = bytearray(biggest.read_bytes())
  data[7] ^= 1
  biggest.write_bytes(bytes(data))
  [report] = offlax.checkpoint.inspect_store(item, verify=False, progress=False)
  assert report.ok  # sizes only: the flipped byte needs --verify
  [report] = offlax.checkpoint.inspect_store(item, verify=True, progress=False)
  bad = [leaf for leaf in report.leaves if leaf.status == "BAD"]
  assert len(bad) == 1 and "checksum" in report.problems[0] and bad[0].path in report.problems[0]
  (item / "0.0").unlink()
  [report] = offlax.checkpoint.inspect_store(item, progress=False)
  assert report.leaves[0].status == "MISSING" and "0.0" in report.format()
