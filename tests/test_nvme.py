"""The NVMe tier: equivalence, placement, resume, crash safety and faults."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal, committed, grads_like, model_params

import offlax
from offlax._src import ffi
from offlax._src.layout import ParamSpec, StateLayout
from offlax._src.nvme.store import Store

SMALL = dict(chunk_bytes=3000, cache_bytes=600, progress=False, fsync=False)


def _tier(path, **kw):
  return offlax.NVMeTier(str(path), **{**SMALL, **kw})


def _float_params():
  params = model_params()
  del params["steps_seen"]
  return params


def _train(tx, params, steps, state=None):
  params = committed(params)  # the step compiles once
  state = tx.init(params) if state is None else state
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  for i in range(steps):
    updates, state = step(params, state, grads_like(params, i))
    params = optax.apply_updates(params, updates)
  return params, state


def _stored_state(path, like, params):
  """The committed state read back from the store at `path`, shaped like `like`."""
  store = Store(str(path), fsync=False)
  store.read_metadata()
  values = [store.result(store.read(r.index, 0, r.size)).reshape(r.shape) for r in store.records]
  return StateLayout(like, ParamSpec.of(params)).merge(values), store.step


OPTIMIZERS = {
  "adamw": lambda: optax.adamw(1e-3),
  "lamb": lambda: optax.lamb(1e-3),
  "clip_chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


@pytest.mark.slow_except("plain-clip_chain")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bit_identical_to_inner(tmp_path, name, native):
  params = _float_params()
  inner = OPTIMIZERS[name]()
  want_params, want_state = _train(inner, params, 3)
  tier = _tier(tmp_path / name)
  tx = offlax.offload(inner, tier)
  state = tx.init(params)
  lowered = jax.jit(lambda p, s, g: tx.update(g, s, p)).lower(params, state, params).as_text()
  # The data crosses by the native copies or by the callbacks, never both.
  copies = lowered.count("offlax_from_slice"), lowered.count("offlax_to_slice")
  assert copies[0] == copies[1] and (copies[0] > 0) == native
  got_params, got_state = _train(tx, params, 3, state)
  assert_trees_equal(got_params, want_params)
  assert int(got_state.step) == 3 and tier.store.step == 3
  stored, step = _stored_state(tmp_path / name, want_state, params)
  assert step == 3
  assert_trees_equal(stored, want_state)
  tier.close()


def test_a_leafs_slices_loop_whatever_their_count(tmp_path):
  """A leaf cut into many slices is one loop: the step's custom calls (its callbacks, the
  native copies) do not grow with the slices, and it trains bit for bit like optax.

  Unrolled, each slice had its own read and write: XLA's compile time grew with them (a 405B
  model's embedding in 64 MiB slices did not compile for a GPU in 15 minutes).
  """
  params = {"a": jnp.linspace(-1, 1, 3), "w": jnp.linspace(-2, 2, 40 * 8).reshape(40, 8)}
  inner = optax.adam(1e-3)
  calls = {}
  for rows in (10, 2):  # pieces of w: 4 or 20 (Adam's mu and nu, 64 B a row); `a` beside the first
    tier = _tier(tmp_path / str(rows), chunk_bytes=64 * rows + 24, cache_bytes=0)
    tx = offlax.offload(inner, tier)
    state = tx.init(params)
    step = jax.jit(lambda p, s, g, tx=tx: tx.update(g, s, p))
    text = step.lower(params, state, params).as_text()
    calls[rows] = (text.count("custom_call"), "stablehlo.while" in text)
    if rows == 2:
      got_params, got_state = _train(tx, params, 2, state)
    tier.close()
  assert calls[2] == calls[10] and calls[2][1], calls
  want_params, want_state = _train(inner, params, 2)
  assert_trees_equal(got_params, want_params)
  stored, step = _stored_state(tmp_path / "2", want_state, params)
  assert step == 2
  assert_trees_equal(stored, want_state)


def test_state_placement(tmp_path):
  params = _float_params()
  tier = _tier(tmp_path, cache_bytes=300)
  state = offlax.offload(optax.adam(1e-3), tier).init(params)
  mu = optax.tree_utils.tree_get(state, "mu")
  big = mu["layers"][0]["mlp"]["kernel"]
  assert isinstance(big, offlax.extend.OnDisk) and big.shape == (16, 64)
  assert optax.tree_utils.tree_get(state, "count").sharding.memory_kind == "device"
  cached = [x for x in jax.tree.leaves(state.inner_state) if x.ndim]
  assert cached and sum(x.nbytes for x in cached) <= 300
  assert all(x.sharding.memory_kind == "pinned_host" for x in cached)
  meta = json.loads((tmp_path / "offlax.json").read_text())
  assert meta["step"] == 0 and meta["format_version"] == 3 and meta["chunk_bytes"] == 3000
  assert meta["generations"] == 3 and meta["kept"] == [[0, 0]]
  assert "namedtuple[ScaleByAdamState], [*, *, *]" in meta["state_structure"]
  paths = {r["path"] for r in meta["leaves"]}
  assert "[0].mu['layers'][0]['mlp']['kernel']" in paths
  assert sorted(os.listdir(tmp_path)) == [".lock", "gen0", "gen1", "gen2", "offlax.json"]
  assert oct(os.stat(tmp_path / "offlax.json").st_mode & 0o777) == "0o600"
  tier.close()


@pytest.mark.slow  # the NVMe example resumes by default
def test_resume_continues_bit_exactly(tmp_path, caplog):
  params = _float_params()
  inner = optax.adamw(1e-3)
  want_params, _ = _train(inner, params, 5)

  tier = _tier(tmp_path)
  tx = offlax.offload(inner, tier)
  mid_params, _ = _train(tx, params, 3)
  tier.close()

  with pytest.raises(offlax.errors.StoreExistsError, match="resume=True"):
    offlax.offload(inner, _tier(tmp_path)).init(params)

  tier = _tier(tmp_path, resume=True)
  tx = offlax.offload(inner, tier)
  with caplog.at_level("WARNING", logger="offlax"):
    state = tx.init(params)
  # Without step=, the user is told which step the optimizer resumes at, and how to check it.
  assert (
    "resumed at its committed step 3" in caplog.text and "step=<your params' step>" in caplog.text
  )
  assert int(state.step) == 3
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  for i in (3, 4):
    updates, state = step(mid_params, state, grads_like(mid_params, i))
    mid_params = optax.apply_updates(mid_params, updates)
  assert_trees_equal(mid_params, want_params)
  tier.close()


def test_resume_refuses_other_optimizer_or_tree(tmp_path):
  params = _float_params()
  tier = _tier(tmp_path)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  with pytest.raises(offlax.errors.StoreMismatchError, match="state arrays"):
    offlax.offload(optax.sgd(1e-3, momentum=0.9), _tier(tmp_path, resume=True)).init(params)
  other = {**params, "temperature": jnp.zeros(3)}
  with pytest.raises(offlax.errors.StoreMismatchError, match=r"\['temperature'\]"):
    offlax.offload(optax.adam(1e-3), _tier(tmp_path, resume=True)).init(other)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  with pytest.raises(offlax.errors.StoreMismatchError, match="bfloat16"):
    offlax.offload(optax.adam(1e-3), _tier(tmp_path, resume=True)).init(bf16)


def test_resume_without_store(tmp_path):
  with pytest.raises(offlax.errors.StoreError, match="no offlax store"):
    offlax.offload(optax.adam(1e-3), _tier(tmp_path, resume=True)).init(_float_params())


def test_stale_state_is_refused(tmp_path):
  params = _float_params()
  tier = _tier(tmp_path)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state0 = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  step(params, state0, grads_like(params, 0))
  with pytest.raises(Exception, match="StaleStateError|state is from step 0"):
    jax.block_until_ready(step(params, state0, grads_like(params, 0)))
  assert tier.store.step == 1
  tier.close()


def test_abstract_init_is_the_concrete_ones_structure_and_writes_nothing(tmp_path):
  """`init` of `jax.ShapeDtypeStruct`s (or under `jax.eval_shape`): the state a new store
  would give, leaf for leaf (shapes, dtypes, memory kinds, the same items on disk), for a
  compile; nothing is written, and the step lowers against it."""
  params = {"w": jnp.ones((64, 32), jnp.float32), "b": jnp.ones((32,), jnp.float32)}
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  inner = offlax.master_weights(optax.adam(1e-3))
  concrete = offlax.offload(inner, _tier(tmp_path / "c")).init(params)
  tx = offlax.offload(inner, _tier(tmp_path / "a"))
  abstract = tx.init(specs)
  traced = jax.eval_shape(tx.init, params)
  assert not (tmp_path / "a").exists()
  is_disk = lambda x: isinstance(x, offlax.extend.OnDisk)
  form = lambda x: x if is_disk(x) else (x.shape, x.dtype, x.sharding.memory_kind)
  assert jax.tree.map(form, abstract, is_leaf=is_disk) == jax.tree.map(
    form, concrete, is_leaf=is_disk
  )
  assert any(is_disk(x) for x in jax.tree.leaves(abstract, is_leaf=is_disk))
  shape = lambda x: x if is_disk(x) else (x.shape, x.dtype)
  assert jax.tree.map(shape, traced, is_leaf=is_disk) == jax.tree.map(
    shape, concrete, is_leaf=is_disk
  )
  assert offlax.abstract_state(tx, specs).inner_state == abstract.inner_state
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  step.lower(specs, abstract, specs)  # the tier's records, kept in memory, plan the reads
  assert not (tmp_path / "a").exists()


def test_path_is_a_file(tmp_path):
  (tmp_path / "f").write_text("x")
  with pytest.raises(offlax.errors.StoreError, match="not a directory"):
    offlax.offload(optax.adam(1e-3), _tier(tmp_path / "f")).init(_float_params())


@pytest.mark.parametrize("bad", [dict(cache_bytes=-1), dict(readahead=0), dict(chunk_bytes=0)])
def test_bad_options(tmp_path, bad):
  with pytest.raises(offlax.errors.InvalidTierError):
    _tier(tmp_path, **bad)


def test_io_threads_make_one_pool_whatever_the_callers(monkeypatch):
  """First submits from many threads at once (JAX's callback threads) share one pool."""
  import concurrent.futures
  import threading

  from offlax._src.nvme.store import IOThreads

  made, real = [], concurrent.futures.ThreadPoolExecutor

  def pool(*args, **kwargs):
    made.append(1)
    time.sleep(0.05)  # widen the window in which a second caller could make another
    return real(*args, **kwargs)

  monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", pool)
  threads, barrier, futures = IOThreads("s", 2), threading.Barrier(8), []
  callers = [threading.Thread(target=lambda: (barrier.wait(), futures.append(
    threads.submit(lambda: 1))))  for _ in range(8)]  # fmt: skip
  for c in callers:
    c.start()
  for c in callers:
    c.join()
  threads.close()
  assert len(made) == 1 and [f.result() for f in futures] == [1] * 8
  with pytest.raises(offlax.errors.StoreError, match="closed"):
    threads.submit(lambda: 1)


def test_numpy_ints_are_taken_as_ints(tmp_path):
  """A numpy int option (from a config or an argument parser) reaches offlax.json as an int."""
  tier = offlax.NVMeTier(str(tmp_path), keep=np.int64(3), chunk_bytes=np.int32(1 << 16))
  offlax.offload(optax.adam(1e-3), tier).init(_float_params())
  tier.close()
  with open(tmp_path / "offlax.json") as f:
    assert json.load(f)["chunk_bytes"] == 1 << 16
  assert type(tier.keep) is int and type(tier.options.chunk_bytes) is int


def test_second_writer_is_locked_out(tmp_path):
  params = _float_params()
  tier = _tier(tmp_path)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  script = textwrap.dedent(
    f"""
    import offlax, optax, jax.numpy as jnp
    tier = offlax.NVMeTier({str(tmp_path)!r}, resume=True, progress=False)
    try:
      offlax.offload(optax.adam(1e-3), tier).init({{"w": jnp.ones(3)}})
    except offlax.errors.StoreLockedError as e:
      print("LOCKED", e)
    """
  )
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert "LOCKED" in out.stdout and str(tmp_path) in out.stdout, out.stderr[-2000:]
  tier.close()


def test_lock_is_not_a_symlink_trap(tmp_path):
  target = tmp_path / "victim"
  target.write_text("keep me")
  store = tmp_path / "store"
  store.mkdir()
  os.symlink(target, store / ".lock")
  with pytest.raises(offlax.errors.StoreError, match="cannot open"):
    offlax.offload(optax.adam(1e-3), _tier(store)).init(_float_params())
  assert target.read_text() == "keep me"


def _cold_chunk(path):
  meta = json.loads((path / "offlax.json").read_text())
  record = next(r for r in meta["leaves"] if not r["hot"])
  chunk_dir = path / f"gen{meta['generation']}" / f"leaf_{record['index']:05d}" / "c"
  return record, chunk_dir / sorted(os.listdir(chunk_dir))[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_chunk_is_detected(tmp_path, damage):
  params = _float_params()
  tier = _tier(tmp_path)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(params)
  meta_before = (tmp_path / "offlax.json").read_bytes()
  record, chunk = _cold_chunk(tmp_path)
  data = bytearray(chunk.read_bytes())
  if damage == "flip":
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
  elif damage == "truncate":
    chunk.write_bytes(bytes(data[:7]))
  else:
    chunk.unlink()
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  with pytest.raises(Exception, match=r"corrupted chunk in .*leaf_\d+/c/\d+ \(state leaf .*\)"):
    jax.block_until_ready(step(params, state, grads_like(params, 0)))
  assert (tmp_path / "offlax.json").read_bytes() == meta_before  # nothing committed
  tier.close()
  # Reading the damaged array later fails the same way, naming path and leaf.
  store = Store(str(tmp_path), fsync=False)
  store.read_metadata()
  size = int(np.prod(record["shape"]))
  with pytest.raises(offlax.errors.StoreCorruptedError, match=re.escape(record["path"])):
    store.result(store.read(record["index"], 0, size))


def test_corrupted_metadata(tmp_path):
  params = _float_params()
  tier = _tier(tmp_path)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  meta = tmp_path / "offlax.json"
  text = meta.read_text()
  meta.write_text(text[: len(text) // 2])
  with pytest.raises(offlax.errors.StoreCorruptedError, match="offlax.json"):
    offlax.offload(optax.adam(1e-3), _tier(tmp_path, resume=True)).init(params)
  meta.write_text(json.dumps({**json.loads(text), "format_version": 99}))
  with pytest.raises(offlax.errors.StoreCorruptedError, match="format_version 99"):
    offlax.offload(optax.adam(1e-3), _tier(tmp_path, resume=True)).init(params)


def test_progress_bar(tmp_path, capsys, bars_at_once):
  params = _float_params()
  tier = _tier(tmp_path / "a", progress=True)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  assert "offlax: writing" in capsys.readouterr().err
  tier = _tier(tmp_path / "b", progress=False)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  assert capsys.readouterr().err == ""


def _mount_tmpfs(path, options):
  path.mkdir(parents=True, exist_ok=True)
  if os.geteuid() != 0 or shutil.which("mount") is None:
    pytest.skip("needs root to mount a tmpfs")
  result = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
  )
  if result.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


def _umount(path):
  subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_disk_full_keeps_last_commit(tmp_path):
  mnt = tmp_path / "small"
  _mount_tmpfs(mnt, "size=200k")
  try:
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}  # Adam state: 2 x 2 x 16 KiB generations
    tier = offlax.NVMeTier(str(mnt), cache_bytes=0, chunk_bytes=8192, progress=False, fsync=False)
    tx = offlax.offload(optax.adam(1e-3), tier)
    state = tx.init(params)
    filler = mnt / "filler"
    free = shutil.disk_usage(mnt).free
    with open(filler, "wb") as f:
      f.write(b"\0" * max(0, free - 4096))
    meta_before = (mnt / "offlax.json").read_bytes()
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    with pytest.raises(
      Exception, match=r"I/O error on .*leaf_\d+/c/\d+ \(state leaf|cannot commit"
    ):
      jax.block_until_ready(step(params, state, jax.tree.map(jnp.ones_like, params)))
    assert (mnt / "offlax.json").read_bytes() == meta_before
    filler.unlink()
    tier.store.close()  # the failed step's writes are moot
    tier = offlax.NVMeTier(str(mnt), cache_bytes=0, chunk_bytes=8192, progress=False, resume=True)
    state = offlax.offload(optax.adam(1e-3), tier).init(params)
    assert int(state.step) == 0
    tier.close()
  finally:
    _umount(mnt)


def test_read_only_directory(tmp_path):
  mnt = tmp_path / "ro"
  _mount_tmpfs(mnt, "size=1m,ro")
  try:
    with pytest.raises(offlax.errors.StoreError, match="cannot open NVMe store"):
      offlax.offload(optax.adam(1e-3), offlax.NVMeTier(str(mnt / "run"), progress=False)).init(
        {"w": jnp.ones(4)}
      )
  finally:
    _umount(mnt)


def test_failed_step_then_a_different_step(tmp_path, monkeypatch):
  """Writes left in flight by a failed step never land on the next step's data."""
  params = _float_params()
  tier = _tier(tmp_path, cache_bytes=0)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  write, calls = Store.write, []

  def flaky(self, index, start, value):
    calls.append(index)
    if len(calls) == 3:
      raise offlax.errors.StoreError("injected write failure")
    return write(self, index, start, value)

  monkeypatch.setattr(Store, "write", flaky)
  with pytest.raises(Exception, match="injected write failure"):
    jax.block_until_ready(step(params, state, grads_like(params, 0)))
  monkeypatch.undo()
  # The same state, other gradients: exactly one plain Adam step with those.
  grads = grads_like(params, 7)
  _, new_state = step(params, state, grads)
  jax.block_until_ready(new_state)
  tier.close()
  want = optax.adam(1e-3).update(grads, optax.adam(1e-3).init(params), params)[1]
  stored, committed = _stored_state(tmp_path, want, params)
  assert committed == 1
  assert_trees_equal(stored, want)


def test_direct_io(tmp_path, monkeypatch):
  """Whole, block-aligned chunks bypass the page cache; the rest do not; both exact."""
  from offlax._src.nvme import chunks

  direct = []
  clear_direct = chunks.clear_direct
  monkeypatch.setattr(chunks, "clear_direct", lambda fd: direct.append(fd) or clear_direct(fd))
  # Chunks of 8 KiB: "a" two whole ones; "b" a whole one and a short one of one
  # block (read directly, written directly with its block of padding); "c" a
  # short one of 1 KiB (page cache both ways).
  params = {"a": jnp.linspace(-1, 1, 4096), "b": jnp.linspace(0, 2, 3072), "c": jnp.ones(256)}
  want_params, want_state = _train(optax.adam(1e-3), params, 3)
  tier = _tier(tmp_path, chunk_bytes=8192, cache_bytes=0)
  got_params, _ = _train(offlax.offload(optax.adam(1e-3), tier), params, 3)
  assert_trees_equal(got_params, want_params)
  tier.close()
  assert direct, "no chunk moved with direct I/O"
  assert_trees_equal(_stored_state(tmp_path, want_state, params)[0], want_state)
  # A flipped byte in a chunk read with direct I/O is caught by its checksum.
  meta = json.loads((tmp_path / "offlax.json").read_text())
  record = next(r for r in meta["leaves"] if r["path"].endswith("['a']"))
  chunk = tmp_path / f"gen{meta['generation']}" / f"leaf_{record['index']:05d}" / "c" / "1"
  data = bytearray(chunk.read_bytes())
  data[100] ^= 1
  chunk.write_bytes(bytes(data))
  store = Store(str(tmp_path), fsync=False)
  store.read_metadata()
  with pytest.raises(offlax.errors.StoreCorruptedError, match=r"checksum mismatch"):
    store.result(store.read(record["index"], 0, 4096))


def test_no_io_after_close(tmp_path):
  params = _float_params()
  tier = _tier(tmp_path)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  _, state = step(params, state, grads_like(params, 0))  # not waited for: close() waits
  tier.close()
  assert int(state.step) == 1 and tier.store.step == 1
  with pytest.raises(Exception, match="the tier was closed"):
    jax.block_until_ready(step(params, state, grads_like(params, 1)))


def test_native_copy_checks_the_slice_buffer():
  """The native copies refuse arrays that would not fit in the buffer they are told of."""
  assert ffi.available(), "offlax's native library did not build (see the log)"
  buffer = np.zeros(4096, np.uint8)

  def where(nbytes):
    words = [buffer.ctypes.data, nbytes]
    return np.array([w >> s & 0xFFFFFFFF for w in words for s in (0, 32)], np.uint32)

  x = jnp.arange(512, dtype=jnp.float32)  # 2 KiB
  to = jax.ffi.ffi_call(
    "offlax_to_slice", jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True
  )
  back = jax.ffi.ffi_call(
    "offlax_from_slice",
    (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), jnp.int32)),
  )
  offsets = np.array([2048], np.int64)
  jax.block_until_ready(to(where(4096), jnp.int32(0), x, offsets=offsets))
  np.testing.assert_array_equal(buffer[2048:].view(np.float32), x)
  np.testing.assert_array_equal(back(where(4096), offsets=offsets)[0], x)
  for bad in (where(4095), where(0)):
    with pytest.raises(Exception, match="does not fit in the slice buffer"):
      jax.block_until_ready(to(bad, jnp.int32(0), x, offsets=offsets))
    with pytest.raises(Exception, match="does not fit in the slice buffer"):
      jax.block_until_ready(back(bad, offsets=offsets))
  np.testing.assert_array_equal(buffer[:2048], 0)  # nothing written out of place


def test_state_copies_share_the_tier_and_pickles_keep_its_type(tmp_path):
  """A state's tier is a live store: `copy.deepcopy` shares it; `pickle` keeps its type."""
  import copy
  import pickle

  params = _float_params()
  tier = _tier(tmp_path)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(params)
  copied = copy.deepcopy(state)
  assert copied.tier is tier
  assert jax.tree.structure(copied) == jax.tree.structure(state)
  loaded = pickle.loads(pickle.dumps(state))
  assert loaded.tier is None  # the live tier (files, locks, threads) is not pickled
  assert jax.tree.structure(loaded) == jax.tree.structure(state)
  tier.close()


@pytest.mark.slow  # test_bit_identical_to_inner runs a chain by default
def test_fused_inside_a_chain_is_exact_and_commits_each_step(tmp_path):
  """``chain(clip, offload(adam, nvme))`` by `update_and_apply`: the offload's fused step, once."""
  params = _float_params()
  tier = _tier(tmp_path)
  clip = optax.clip_by_global_norm(1.0)
  tx = optax.chain(clip, offlax.offload(optax.adam(1e-3), tier))
  want, want_state = params, optax.chain(clip, optax.adam(1e-3)).init(params)
  got, state = params, tx.init(params)
  step = jax.jit(offlax.update_and_apply, static_argnums=0)
  for i in range(3):
    grads = grads_like(params, i)
    updates, want_state = optax.chain(clip, optax.adam(1e-3)).update(grads, want_state, want)
    want = optax.apply_updates(want, updates)
    got, state = step(tx, grads, state, got)
  assert_trees_equal(got, want)
  assert int(state[1].step) == 3  # one commit a step: the probe trace wrote nothing
  tier.close()
