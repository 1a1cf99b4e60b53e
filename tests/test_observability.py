"""Telemetry, configuration warnings, the store inspector and rollback."""

import json
import logging
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_trees_equal, committed, grads_like, model_params

import offlax
from offlax._src import telemetry
from offlax._src.nvme.store import Store

SMALL = dict(chunk_bytes=3000, cache_bytes=600, progress=False, fsync=False)
PARAMS = {"w": jnp.ones((256, 256)), "b": jnp.zeros(256)}
N = 256 * 256 + 256  # params
F32 = 4


def _float_params():
  params = model_params()
  del params["steps_seen"]
  return params


def _train(tx, params, steps, state=None, first=0):
  params = committed(params)  # the step compiles once
  state = tx.init(params) if state is None else state
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  for i in range(first, first + steps):
    updates, state = step(params, state, grads_like(params, i))
    params = optax.apply_updates(params, updates)
  return params, state


def _cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "offlax", *args], capture_output=True, text=True, timeout=300
  )


# -- telemetry -----------------------------------------------------------------


def test_host_tier_stats_match_the_state_sizes():
  tier = offlax.HostTier()
  state = offlax.offload(optax.adam(1e-3), tier).init(PARAMS)
  s = offlax.stats(state, tier)
  # mu and nu (fp32) in pinned host memory, the int32 count on the device.
  assert (s.host_bytes, s.device_bytes, s.nvme_bytes) == (2 * N * F32, 4, 0)
  assert s.h2d_bytes == s.d2h_bytes == 2 * N * F32
  assert s.step is None and s.disk_read_bytes is None and s.step_s is None
  assert s.summary().startswith("offlax: state device 4 B, host 526.3 kB, nvme 0 B; per step h2d")

  partial = offlax.HostTier(select=r"\.mu")
  s = offlax.stats(offlax.offload(optax.adam(1e-3), partial).init(PARAMS), partial)
  assert (s.host_bytes, s.device_bytes) == (N * F32, N * F32 + 4)

  host = offlax.HostTier(compute="host")
  s = offlax.stats(offlax.offload(optax.adam(1e-3), host).init(PARAMS), host)
  assert s.host_bytes == 2 * N * F32
  assert s.h2d_bytes == s.d2h_bytes == N * F32  # gradients out, updates back

  abstract = jax.eval_shape(offlax.offload(optax.adam(1e-3), tier).init, PARAMS)
  assert offlax.stats(abstract, tier).device_bytes + offlax.stats(abstract, tier).host_bytes == (
    2 * N * F32 + 4
  )


def test_stats_refuses_what_is_not_an_offload_state():
  with pytest.raises(offlax.errors.TreeMismatchError, match="OffloadState"):
    offlax.stats(optax.adam(1e-3).init(PARAMS), offlax.HostTier())
  state = offlax.offload(optax.adam(1e-3)).init(PARAMS)
  with pytest.raises(offlax.errors.InvalidTierError, match="HostTier or NVMeTier"):
    offlax.stats(state, "host")


def test_nvme_stats_count_the_step_io(tmp_path, caplog):
  params = _float_params()
  tier = offlax.NVMeTier(str(tmp_path), **{**SMALL, "log_every": 2})
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(params)
  s = offlax.stats(state, tier)
  store = tier.store
  all_bytes = sum(r.nbytes for r in store.records)
  hot = sum(r.nbytes for r in store.records if r.hot)
  assert (s.step, s.nvme_bytes, s.disk_read_bytes) == (0, all_bytes, None)
  assert 0 < s.host_bytes <= 600 and s.host_bytes + s.device_bytes == hot  # scalars: device

  def file_bytes(records):  # chunk files: data padded to whole chunks, plus a crc32c
    return sum(-(-r.size // r.chunk_size) * (r.chunk_nbytes + 4) for r in records)

  with caplog.at_level(logging.INFO, logger="offlax"):
    _, state = _train(tx, params, 4, state)
    s = offlax.stats(state, tier, sync=True)
  assert s.step == 4
  assert s.disk_read_bytes == file_bytes([r for r in store.records if not r.hot])
  assert s.disk_write_bytes == file_bytes(store.records)  # cached arrays too
  assert (s.cache_hit_bytes, s.cache_miss_bytes) == (hot, all_bytes - hot)
  assert 0 < s.io_wait_s <= s.step_s < 60
  logged = [r.getMessage() for r in caplog.records if r.name == "offlax"]
  assert [m.split(":")[0] for m in logged] == ["NVMe step 2", "NVMe step 4"]
  assert "committed step 4" in s.summary() and "waited on I/O" in s.summary()
  tier.close()


# -- warnings ------------------------------------------------------------------


@pytest.mark.slow  # the other warnings run by default
def test_stall_warning_after_io_bound_steps(tmp_path, monkeypatch):
  monkeypatch.setattr(telemetry, "STALL_MIN_S", 0.0)
  monkeypatch.setattr(telemetry, "STALL_SHARE", 0.0)  # any wait is a stall
  tier = offlax.NVMeTier(str(tmp_path), **SMALL)
  tx = offlax.offload(optax.adam(1e-3), tier)
  params = _float_params()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, state = _train(tx, params, 2)
    jax.effects_barrier()
    assert not [w for w in caught if issubclass(w.category, offlax.errors.PerformanceWarning)]
    _train(tx, params, 3, state, first=2)
    jax.effects_barrier()
  stalls = [
    str(w.message) for w in caught if issubclass(w.category, offlax.errors.PerformanceWarning)
  ]
  assert len(stalls) == 1 and "waited on the disk" in stalls[0] and "cache_bytes" in stalls[0]
  tier.close()


def test_cache_warning_names_the_size_that_would_help(tmp_path):
  params = {"a": jnp.ones(2**19), "b": jnp.ones(2**19)}  # Adam: 4 arrays of 2 MiB
  with pytest.warns(
    offlax.errors.PerformanceWarning, match=r"cache_bytes=1572864\) holds only 4 B"
  ):
    tier = offlax.NVMeTier(str(tmp_path), cache_bytes=3 * 2**19, progress=False, fsync=False)
    offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()


def test_pinned_pool_warning(monkeypatch):
  monkeypatch.setenv(telemetry.PINNED_LIMIT_ENV, "1")
  with pytest.warns(offlax.errors.PerformanceWarning, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=2"):
    telemetry.check_pinned(int(0.95 * 2**30), "gpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    telemetry.check_pinned(int(0.5 * 2**30), "gpu")
    telemetry.check_pinned(2**40, "cpu")  # the CPU backend's host memory is uncapped


def test_uncommitted_params_warning_on_a_gpu():
  loose = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  assert not loose["w"].committed
  with pytest.warns(
    offlax.errors.PerformanceWarning, match=r"params \['b'\], \['w'\] are not committed"
  ):
    telemetry.check_committed(loose, "gpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    telemetry.check_committed(jax.device_put(loose, jax.devices()[0]), "gpu")
    telemetry.check_committed(loose, "cpu")  # a compile is cheap there


@pytest.mark.parametrize("mode", ["always [madvise] never", "[always] madvise never"])
def test_hugepage_hint(mode, tmp_path, monkeypatch):
  thp = tmp_path / "enabled"
  thp.write_text(mode + "\n")
  monkeypatch.setattr(telemetry, "_THP", str(thp))
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  if "[madvise]" in mode:
    with pytest.warns(
      offlax.errors.PerformanceWarning, match="glibc.malloc.hugetlb=1 in GLIBC_TUNABLES"
    ):
      telemetry.check_hugepages(2**31, "cpu", native=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    telemetry.check_hugepages(2**31, "cpu", native=True)  # the native copies touch no fresh memory
    telemetry.check_hugepages(2**29, "cpu", native=False)  # small states are not worth it
    telemetry.check_hugepages(2**31, "cuda", native=False)  # XLA's buffers are device memory there
    if "[always]" in mode:
      telemetry.check_hugepages(2**31, "cpu", native=False)  # every process gets them already
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    telemetry.check_hugepages(2**31, "cpu", native=False)


def test_slice_size_warnings():
  params = {"w": jnp.ones((512, 512))}  # Adam state 2 MiB
  with pytest.warns(offlax.errors.PerformanceWarning, match="512 slices"):
    offlax.offload(optax.adam(1e-3), chunk_bytes=4096).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the defaults never warn
    offlax.offload(optax.adam(1e-3)).init(params)
    offlax.offload(optax.adam(1e-3), chunk_bytes=2**18).init(params)
  with pytest.warns(offlax.errors.PerformanceWarning, match="device memory"):
    telemetry.check_chunk(2**31, 2**26, 2**36)


# -- inspect -------------------------------------------------------------------


def _store(path, steps=3, **kw):
  params = _float_params()
  tier = offlax.NVMeTier(str(path), **{**SMALL, **kw})
  _train(offlax.offload(optax.adam(1e-3), tier), params, steps)
  tier.close()
  return params


def _chunk(path, leaf_path, step=None):
  meta = json.loads((path / "offlax.json").read_text())
  gens = dict(meta["kept"])
  record = next(r for r in meta["leaves"] if r["path"] == leaf_path)
  gen = meta["generation"] if step is None else gens[step]
  return path / f"gen{gen}" / f"leaf_{record['index']:05d}" / "c" / "0"


@pytest.mark.slow  # test_usage.py's directory case runs inspect by default
def test_inspect_healthy_and_corrupted_store(tmp_path):
  _store(tmp_path)
  [report] = offlax.checkpoint.inspect_store(tmp_path, verify=True, progress=False)
  assert report.ok and report.step == 3 and report.kept == [3, 2] and report.generations == 3
  assert all(leaf.status == "verified" for leaf in report.leaves)
  assert "namedtuple[ScaleByAdamState]" in report.structure
  out = _cli("inspect", str(tmp_path), "--verify", "--no-progress")
  assert out.returncode == 0, out.stderr
  for line in ("committed step 3; kept steps [3, 2]", "[0].mu['layers'][0]['mlp']['kernel']"):
    assert line in out.stdout
  assert "float32[16, 64]" in out.stdout and "OK" in out.stdout

  leaf = "[0].nu['layers'][0]['mlp']['kernel']"
  chunk = _chunk(tmp_path, leaf, step=2)  # an older kept step: the current one is healthy
  data = bytearray(chunk.read_bytes())
  data[5] ^= 0x40
  chunk.write_bytes(bytes(data))
  assert _cli("inspect", str(tmp_path)).returncode == 0  # same size: only --verify sees it
  out = _cli("inspect", str(tmp_path), "--verify", "--no-progress")
  assert out.returncode == 1
  assert f"step 2: corrupted chunk in {chunk.parent.parent}" in out.stdout
  assert leaf in out.stdout and "checksum mismatch" in out.stdout and "bad in step 2" in out.stdout

  _chunk(tmp_path, leaf).write_bytes(b"short")  # the current step, truncated
  out = _cli("inspect", str(tmp_path))
  assert out.returncode == 1 and "step 3:" in out.stdout and "5 bytes, expected" in out.stdout

  (tmp_path / "offlax.json").write_text("{not json")
  out = _cli("inspect", str(tmp_path))
  assert out.returncode == 1 and "cannot read" in out.stdout
  out = _cli("inspect", str(tmp_path / "nowhere"))
  assert out.returncode == 2 and "not a directory" in out.stderr


@pytest.mark.slow  # test_usage.py's directory case runs inspect by default
def test_inspect_an_orbax_checkpoint(tmp_path):
  params = _float_params()
  del params["head"]  # orbax refuses zero-size arrays
  tier = offlax.NVMeTier(str(tmp_path / "store"), **SMALL)
  _train(offlax.offload(optax.adam(1e-3), tier), params, 2)
  host_state = offlax.offload(optax.adam(1e-3)).init(params)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(
      2,
      args=ocp.args.Composite(
        host=ocp.args.StandardSave(host_state), opt=offlax.checkpoint.NVMeStoreSave(tier)
      ),
    )
  tier.close()
  reports = offlax.checkpoint.inspect_store(tmp_path / "ckpt", verify=True, progress=False)
  assert [(r.kind, os.path.basename(r.path)) for r in reports] == [
    ("orbax", "host"),
    ("nvme", "opt"),
  ]
  host, nvme = reports
  assert host.ok and nvme.ok and nvme.step == 2 and nvme.kept == [2]
  assert {leaf.path for leaf in host.leaves} >= {"['inner_state'][0]['mu']['temperature']"}
  assert all(leaf.status == "verified" for leaf in host.leaves)
  out = _cli("inspect", str(tmp_path / "ckpt" / "2"))
  assert out.returncode == 0 and "orbax store" in out.stdout and "nvme store" in out.stdout
  with pytest.raises(offlax.errors.StoreError, match="no offlax store"):
    offlax.checkpoint.inspect_store(tmp_path / "store" / "gen0")


# -- rollback ------------------------------------------------------------------


@pytest.mark.slow
def test_rollback_then_resume_equals_the_reference(tmp_path):
  params = _float_params()
  inner = optax.adamw(1e-3)
  # The reference: 3 steps, then steps 3 and 4 again from there.
  want_mid, want_state = _train(inner, params, 3)
  want_params, _ = _train(inner, want_mid, 2, want_state, first=3)

  tier = offlax.NVMeTier(str(tmp_path), **SMALL, keep=3)
  tx = offlax.offload(inner, tier)
  mid, state = _train(tx, params, 3)
  assert_trees_equal(mid, want_mid)
  _train(tx, mid, 2, state, first=3)  # steps 4 and 5: to be thrown away
  with pytest.raises(offlax.errors.StoreLockedError):
    offlax.checkpoint.rollback(tmp_path, 3)  # the trainer holds it
  tier.close()

  with pytest.raises(offlax.errors.StepNotKeptError, match=r"keeps steps \[3, 4, 5\]"):
    offlax.checkpoint.rollback(tmp_path, 2)
  out = _cli("rollback", str(tmp_path), "--to", "2")
  assert out.returncode == 1 and "does not keep step 2" in out.stderr
  out = _cli("rollback", str(tmp_path), "--to", "3")
  assert out.returncode == 0, out.stderr
  assert json.loads((tmp_path / "offlax.json").read_text())["kept"][0][0] == 3

  tier = offlax.NVMeTier(str(tmp_path), **SMALL, resume=True)
  tx = offlax.offload(inner, tier)
  state = tx.init(params)
  assert int(state.step) == 3
  got_params, _ = _train(tx, mid, 2, state, first=3)
  assert_trees_equal(got_params, want_params)
  assert tier.store.kept[0] == (5, tier.store.generation)
  tier.close()


def test_rollback_refuses_a_damaged_step_and_keeps_the_store(tmp_path):
  _store(tmp_path)
  chunk = _chunk(tmp_path, "[0].mu['layers'][0]['mlp']['kernel']", step=2)
  chunk.unlink()
  before = (tmp_path / "offlax.json").read_text()
  with pytest.raises(offlax.errors.StoreCorruptedError, match="step 2 is damaged"):
    offlax.checkpoint.rollback(tmp_path, 2)
  assert (tmp_path / "offlax.json").read_text() == before
  with pytest.raises(offlax.errors.StoreError, match="no offlax store"):
    offlax.checkpoint.rollback(tmp_path / "nowhere", 1)


@pytest.mark.slow
def test_keep_is_fixed_and_old_stores_open(tmp_path):
  _store(tmp_path / "one", keep=1)
  store = Store(str(tmp_path / "one"), fsync=False)
  store.read_metadata()
  assert store.kept == [(3, store.generation)] and store.generations == 2
  with pytest.raises(offlax.errors.StoreMismatchError, match="keep=1"):
    offlax.offload(
      optax.adam(1e-3), offlax.NVMeTier(str(tmp_path / "one"), resume=True, keep=2, progress=False)
    ).init(_float_params())
  with pytest.raises(offlax.errors.InvalidTierError, match="keep must be an int >= 1"):
    offlax.NVMeTier(str(tmp_path), keep=0)

  # A store of format version 2 (two generations, no list of kept steps) resumes.
  meta_file = tmp_path / "one" / "offlax.json"
  meta = json.loads(meta_file.read_text())
  meta["format_version"] = 2
  del meta["generations"], meta["kept"]
  meta_file.write_text(json.dumps(meta))
  params = _float_params()
  tier = offlax.NVMeTier(str(tmp_path / "one"), **SMALL, resume=True)
  _, state = _train(offlax.offload(optax.adam(1e-3), tier), params, 1, first=3)
  jax.effects_barrier()
  assert tier.store.step == 4 and tier.store.generations == 2
  assert np.asarray(state.step) == 4
  tier.close()
