"""Checkpoints at disk speed: `checkpoint.checkpoint_handler`, the NVMe stores' direct-I/O copy."""

import hashlib
import json
import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_trees_equal, grads_like, model_params, refuse_direct_io

import offlax
from offlax._src.nvme import copies, direct_copy, direct_io


def _state():
  params = model_params()
  del params["steps_seen"]
  params["head"] = params["head"][:1]  # orbax cannot save zero-size arrays
  inner = optax.adamw(1e-3)
  tx = offlax.offload(inner, offlax.HostTier(chunk_bytes=1024))
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  state = tx.init(params)
  for i in range(2):  # moments that hold data
    _, state = step(params, state, grads_like(params, i))
  return inner, params, state


def _kinds(tree):
  return jax.tree.map(lambda x: x.sharding.memory_kind, tree)


def _array_metadata(directory):
  """Each saved array's zarr metadata (zarr v2 `.zarray` files), by file path."""
  found = {}
  for root, _, files in os.walk(directory):
    if ".zarray" in files:
      with open(os.path.join(root, ".zarray")) as f:
        found[root] = json.load(f)
  return found


def test_handler_round_trip_is_bit_exact_and_uncompressed(tmp_path):
  inner, params, state = _state()
  with ocp.CheckpointManager(
    tmp_path / "fast", item_handlers=offlax.checkpoint.checkpoint_handler()
  ) as m:
    m.save(2, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
    restored = m.restore(2, args=ocp.args.StandardRestore(offlax.abstract_state(inner, params)))
  assert_trees_equal(restored.inner_state, state.inner_state)
  assert _kinds(restored) == _kinds(state)
  # The options reached the disk: one zarr array per leaf, uncompressed, no OCDBT.
  arrays = _array_metadata(tmp_path / "fast")
  assert len(arrays) == len(jax.tree.leaves(state))
  assert all(meta["compressor"] is None for meta in arrays.values())
  assert not list((tmp_path / "fast").rglob("manifest.ocdbt"))
  # orbax's default handler restores it too (it reads the format from the checkpoint).
  with ocp.CheckpointManager(tmp_path / "fast") as m:
    again = m.restore(2, args=ocp.args.StandardRestore(offlax.abstract_state(inner, params)))
  assert_trees_equal(again.inner_state, state.inner_state)


def test_handler_options_reach_the_disk(tmp_path):
  """The same check sees orbax's defaults when they are asked for: it can fail."""
  _, _, state = _state()
  handler = offlax.checkpoint.checkpoint_handler(compression=True, ocdbt=True)
  with ocp.CheckpointManager(tmp_path, item_handlers=handler) as m:
    m.save(0, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  assert list(tmp_path.rglob("manifest.ocdbt"))
  assert not _array_metadata(tmp_path)  # inside OCDBT, not as files
  handler = offlax.checkpoint.checkpoint_handler(compression=True)
  with ocp.CheckpointManager(tmp_path / "zstd", item_handlers=handler) as m:
    m.save(0, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  arrays = _array_metadata(tmp_path / "zstd")
  assert arrays and all(meta["compressor"]["id"] == "zstd" for meta in arrays.values())


@pytest.mark.parametrize(
  "options",
  [{"compression": 1}, {"ocdbt": "no"}, {"save_concurrent_gb": 0}, {"restore_concurrent_gb": 1.5}],
)
def test_handler_refuses_bad_options(options):
  with pytest.raises(offlax.errors.InvalidOptionError, match=next(iter(options))):
    offlax.checkpoint.checkpoint_handler(**options)


def _digest(path):
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      h.update(block)
  return h.hexdigest()


@pytest.mark.parametrize(
  "size",
  [0, 5, 4096, (1 << 20) + 3, direct_copy.BLOCK_BYTES, 2 * direct_copy.BLOCK_BYTES + 4097],
)  # fmt: skip
def test_copy_file_is_exact_and_owner_only(tmp_path, monkeypatch, size):
  monkeypatch.setattr(direct_copy, "SMALL_BYTES", 1)  # every file by blocks, tiny ones included
  by_blocks, real = [], direct_copy._blocks
  monkeypatch.setattr(direct_copy, "_blocks", lambda *a: by_blocks.append(a[3]) or real(*a))
  src, dst = tmp_path / "src", tmp_path / "dst"
  src.write_bytes(np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes())
  old = os.umask(0o022)
  try:
    direct_copy.copy_file(str(src), str(dst))
  finally:
    os.umask(old)
  if direct_io.supports_direct(str(tmp_path)):  # written by direct I/O, not by `sendfile`
    assert by_blocks == ([size] if size else [])  # an empty file: sendfile, nothing to send
  assert dst.stat().st_size == size
  assert _digest(dst) == _digest(src)
  assert dst.stat().st_mode & 0o777 == 0o600
  with pytest.raises(FileExistsError):  # never over an existing file (or a planted link)
    direct_copy.copy_file(str(src), str(dst))


@pytest.mark.parametrize("refuse", ["platform", "filesystem"])
def test_copy_file_without_direct_io(tmp_path, monkeypatch, refuse):
  """Without direct I/O (none on the platform, or refused by the filesystem): `sendfile`, exact."""
  if refuse == "platform":
    monkeypatch.setattr(direct_io, "O_DIRECT", 0)
  else:
    refuse_direct_io(monkeypatch)
  src, dst = tmp_path / "src", tmp_path / "dst"
  src.write_bytes(np.random.default_rng(0).integers(0, 256, (3 << 20) + 5, np.uint8).tobytes())
  blocks = []
  monkeypatch.setattr(direct_copy, "_blocks", lambda *a: blocks.append(a))
  direct_copy.copy_file(str(src), str(dst))
  assert not blocks  # it took the `sendfile` path
  assert _digest(dst) == _digest(src)


def _status_bytes(field):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def test_copy_files_memory_is_bounded(tmp_path):
  """Copying 192 MiB of files raises the peak RSS by the buffers only, not by the bytes."""
  pairs = []  # 32 MiB files: two blocks each
  for i in range(6):
    src = tmp_path / f"src{i}"
    with open(src, "wb") as f:
      for _ in range(4):  # 32 MiB, written in pieces so the test itself stays small
        f.write(np.random.default_rng(i).integers(0, 256, 8 << 20, np.uint8).tobytes())
    pairs.append((str(src), str(tmp_path / f"dst{i}")))
  before = _status_bytes("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
  direct_copy.copy_files(pairs)
  rise = _status_bytes("VmHWM") - before
  bound = direct_copy.THREADS * direct_copy.BLOCK_BYTES
  assert rise <= bound + (16 << 20), f"peak RSS rose {rise >> 20} MiB"
  for src, dst in pairs:
    assert _digest(dst) == _digest(src)


@pytest.mark.slow  # test_checkpoint.py copies stores by default
def test_copy_store_shows_a_progress_bar_in_bytes(tmp_path, capsys, bars_at_once):
  tier = offlax.NVMeTier(str(tmp_path / "store"), cache_bytes=0, chunk_bytes=4096, progress=False)
  tx = offlax.offload(optax.adam(1e-3), tier)
  params = {"w": jax.numpy.ones((64, 64))}
  state = tx.init(params)
  _, state = jax.jit(lambda p, s, g: tx.update(g, s, p))(params, state, grads_like(params, 0))
  want = tier.read_state(state)
  capsys.readouterr()
  copies.copy_store(str(tmp_path / "store"), str(tmp_path / "copy"), progress=True)
  err = capsys.readouterr().err
  assert "offlax: copying" in err and "B/s" in err
  tier.close()
  copy = offlax.NVMeTier(str(tmp_path / "copy"), resume=True, cache_bytes=0, progress=False)
  restored = offlax.offload(optax.adam(1e-3), copy).init(params)
  assert_trees_equal(copy.read_state(restored), want)
  copy.close()
