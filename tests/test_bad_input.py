"""The bad input catalogue of docs/reliability.md: what tests elsewhere do not cover.

Each case gets an offlax error (an `OffloadError` and the fitting builtin) that
names what is wrong, and the store keeps its last committed state.
"""

import errno
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal

import offlax
from offlax._src.nvme import chunks as nvme_chunks
from offlax._src.nvme import store as nvme_store
from offlax._src.nvme.store import Store

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 256).reshape(16, 16), "b": jnp.ones(16)}
SMALL = dict(chunk_bytes=256, cache_bytes=0, progress=False, fsync=False)


def _tier(path, **kw):
  return offlax.NVMeTier(str(path), **{**SMALL, **kw})


def _steps(tx, state, n, start=0):
  step = jax.jit(lambda s, g: tx.update(g, s, PARAMS))
  for i in range(start, start + n):
    grads = {k: jnp.sin(x * (i + 1)) for k, x in PARAMS.items()}
    updates, state = step(state, grads)
  return updates, state


# -- wrong types -------------------------------------------------------------

NOT_TRANSFORMATIONS = {"str": "adam", "None": None, "uncalled": optax.adam, "int": 3}
TAKES_A_TRANSFORMATION = {
  "offload": lambda tx: offlax.offload(tx),
  "master_weights": lambda tx: offlax.master_weights(tx),
  "plan": lambda tx: offlax.plan(PARAMS, tx, device_bytes=2**30, host_bytes=2**30),
  "retier": lambda tx: offlax.checkpoint.retier(tx, PARAMS, {}, offlax.HostTier()),
  "abstract_state": lambda tx: offlax.abstract_state(tx, PARAMS),
}


@pytest.mark.parametrize("bad", NOT_TRANSFORMATIONS)
@pytest.mark.parametrize("fn", TAKES_A_TRANSFORMATION)
def test_not_a_transformation(fn, bad):
  with pytest.raises(
    offlax.errors.TransformationTypeError, match=f"{fn}: .*optax GradientTransformation"
  ):
    TAKES_A_TRANSFORMATION[fn](NOT_TRANSFORMATIONS[bad])
  assert issubclass(offlax.errors.TransformationTypeError, TypeError)


def test_uncalled_factory_gets_a_hint():
  with pytest.raises(offlax.errors.TransformationTypeError, match=r"not optax.adam"):
    offlax.offload(optax.adam)


@pytest.mark.parametrize(
  "bad",
  [
    dict(path=None),
    dict(path=""),
    dict(path=3.5),
    dict(resume="yes"),
    dict(fsync="no"),  # truthy: would have flushed though the caller said no
    dict(progress=1),
    dict(cache_bytes=1.5),
    dict(readahead="2"),
    dict(chunk_bytes="16MB"),
  ],
)
def test_nvme_tier_options_of_wrong_type(tmp_path, bad):
  kw = {"path": str(tmp_path), **bad}
  with pytest.raises(offlax.errors.InvalidTierError, match=next(iter(bad))):
    offlax.NVMeTier(kw.pop("path"), **kw)


def test_checkpoint_arguments_of_wrong_type():
  with pytest.raises(
    offlax.errors.InvalidTierError, match="NVMeStoreSave takes an NVMeTier, got HostTier"
  ):
    offlax.checkpoint.NVMeStoreSave(offlax.HostTier())
  for path in (None, "", 3):
    with pytest.raises(offlax.errors.InvalidTierError, match="NVMeStoreRestore.path"):
      offlax.checkpoint.NVMeStoreRestore(path)


# -- NaN and inf gradients: documented to propagate as in the inner optimizer ----


@pytest.mark.parametrize("mode", ["host/host", pytest.param("nvme", marks=pytest.mark.slow)])
def test_nan_and_inf_gradients_propagate_like_optax(tmp_path, mode):
  """The documented rule (docs/errors.md) in the tiers test_errors.py skips: NaN in, NaN out."""
  params = {"w": jnp.ones(4)}
  grads = {"w": jnp.array([1.0, jnp.nan, jnp.inf, -jnp.inf])}
  for n, inner in enumerate([optax.adam(1e-3), optax.apply_if_finite(optax.adam(1e-3), 3)]):
    want, want_state = inner.update(grads, inner.init(params), params)
    if mode == "nvme":
      tier = offlax.NVMeTier(str(tmp_path / str(n)), **SMALL)
    else:
      tier = offlax.HostTier(compute="host")
    tx = offlax.offload(inner, tier)
    got, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert_trees_equal(got, want)
    if mode == "nvme":
      inner_state = tier.read_state(state)
      tier.close()
    else:
      inner_state = state.inner_state
    assert_trees_equal(inner_state, want_state)  # NaN moments, or the skipped step's count


@pytest.mark.slow  # a store refusing a dtype change (the property tests' find)
@pytest.mark.parametrize("cache", [0, 2**20])
def test_update_that_changes_a_state_dtype(tmp_path, cache):
  """Found by the property test: optax's state may change dtype; a store's cannot.

  Before, the float32 moments were written into bfloat16 chunks, torn, and committed.
  """
  # Mixed dtypes: inject_hyperparams keeps its hyperparameters float32, which
  # promote lion's bf16 moment.
  params = {"w": jnp.ones(8, jnp.bfloat16), "b": jnp.ones(4)}
  inner = optax.inject_hyperparams(optax.lion)(learning_rate=1e-3)
  _, plain = inner.update(params, inner.init(params), params)
  assert plain.inner_state[0].mu["w"].dtype == jnp.float32
  tier = _tier(tmp_path, cache_bytes=cache)
  tx = offlax.offload(inner, tier)
  state = tx.init(params)
  meta = (tmp_path / "offlax.json").read_bytes()
  with pytest.raises(
    offlax.errors.StoreMismatchError,
    match=r"state leaf .*mu\['w'\] as float32.*stores it as bfloat16",
  ):
    jax.jit(tx.update)(params, state, params)
  tier.close()
  assert (tmp_path / "offlax.json").read_bytes() == meta


# -- storage: non-existent, read-only, full -----------------------------------


@pytest.mark.slow  # its parent's bad-input cases run by default
def test_non_existent_store_path_is_created(tmp_path):
  path = tmp_path / "a" / "b" / "store"
  tier = _tier(path)
  offlax.offload(optax.adam(1e-3), tier).init(PARAMS)
  tier.close()
  assert (path / "offlax.json").is_file()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits (see the tmpfs test)")
def test_read_only_directory_without_root(tmp_path):
  """test_nvme.py mounts a read-only tmpfs, which needs root; this needs the opposite."""
  ro = tmp_path / "ro"
  ro.mkdir(mode=0o500)
  with pytest.raises(offlax.errors.StoreError, match=f"cannot open NVMe store {ro}"):
    offlax.offload(optax.adam(1e-3), _tier(ro / "run")).init(PARAMS)


def _enospc_after(monkeypatch, n):
  """Makes every chunk write after the first `n` fail as on a full disk."""
  write, calls = nvme_chunks.pwrite_all, []

  def full(fd, parts, offset):
    calls.append(fd)
    if len(calls) > n:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write(fd, parts, offset)

  monkeypatch.setattr(nvme_chunks, "pwrite_all", full)


@pytest.mark.slow  # test_nvme.py's failed step runs by default
@pytest.mark.parametrize("where", ["chunk", "commit"])
def test_full_disk_keeps_the_last_commit(tmp_path, monkeypatch, where):
  """ENOSPC injected where the tmpfs test (root only) fills a real disk."""
  tier = _tier(tmp_path)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(PARAMS)
  _, state = _steps(tx, state, 1)
  jax.block_until_ready(state)
  meta = (tmp_path / "offlax.json").read_bytes()
  if where == "chunk":
    _enospc_after(monkeypatch, 3)
    match = r"I/O error on .*leaf_\d+/c/\d+ \(state leaf .*\).*No space left"
  else:

    def full(directory, meta, *, fsync):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(nvme_store, "write_metadata", full)
    match = r"cannot commit step 2 to .*offlax.json.*No space left"
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(_steps(tx, state, 1, start=1))
  assert (tmp_path / "offlax.json").read_bytes() == meta  # step 1 stays committed
  monkeypatch.undo()
  tier.store.close()
  # Space again: resume at step 1 and finish step 2 exactly as plain Adam does.
  tier = _tier(tmp_path, resume=True)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(PARAMS)
  assert int(state.step) == 1
  got, state = _steps(tx, state, 1, start=1)
  want, _ = _steps(optax.adam(1e-3), optax.adam(1e-3).init(PARAMS), 2)
  assert_trees_equal(got, want)
  tier.close()


# -- corrupted metadata -------------------------------------------------------


@pytest.fixture(scope="module")
def store_template(tmp_path_factory):
  """A committed store (Adam on PARAMS), copied by each test that damages it."""
  path = tmp_path_factory.mktemp("template") / "store"
  tier = _tier(path)
  offlax.offload(optax.adam(1e-3), tier).init(PARAMS)
  tier.close()
  return path


def _copy(template, tmp_path):
  path = tmp_path / "store"
  shutil.copytree(template, path)
  return path


def _leaf(meta, n, **changes):
  leaves = [dict(r) for r in meta["leaves"]]
  leaves[n].update(changes)
  return {**meta, "leaves": leaves}


METADATA_DAMAGE = {
  "empty file": lambda m: b"",
  "binary garbage": lambda m: bytes(range(256)),
  "a JSON list": lambda m: [],
  "no leaves": lambda m: {k: v for k, v in m.items() if k != "leaves"},
  "no format version": lambda m: {k: v for k, v in m.items() if k != "format_version"},
  "format version as a string": lambda m: {**m, "format_version": "2"},
  "step as a string": lambda m: {**m, "step": "1"},
  "negative step": lambda m: {**m, "step": -1},
  "step true": lambda m: {**m, "step": True},
  "generation 3 of 3": lambda m: {**m, "generation": 3},
  "generation -1": lambda m: {**m, "generation": -1},
  "a generation that holds no kept step": lambda m: {**m, "generation": m["generation"] + 1},
  "generations 1": lambda m: {**m, "generations": 1},
  "kept as a string": lambda m: {**m, "kept": "0"},
  "kept step in a missing generation": lambda m: {**m, "kept": [*m["kept"], [99, 7]]},
  "two kept steps in one generation": lambda m: {**m, "kept": [*m["kept"], m["kept"][0]]},
  "chunk_bytes 0": lambda m: {**m, "chunk_bytes": 0},
  "index out of order": lambda m: _leaf(m, 1, index=0),
  "index naming a path": lambda m: _leaf(m, 1, index="../../x"),
  "dtype object": lambda m: _leaf(m, 1, dtype="object"),
  "dtype nonsense": lambda m: _leaf(m, 1, dtype="float33"),
  "negative dimension": lambda m: _leaf(m, 1, shape=[-16, -16]),
  "hot as a string": lambda m: _leaf(m, 1, hot="no"),
  "negative chunk": lambda m: _leaf(m, 1, chunk=-1),
  "key path not a string": lambda m: _leaf(m, 1, path=["mu"]),
}


@pytest.mark.parametrize("damage", METADATA_DAMAGE)
def test_corrupted_metadata_catalogue(store_template, tmp_path, damage):
  path = _copy(store_template, tmp_path)
  meta = json.loads((path / "offlax.json").read_text())
  bad = METADATA_DAMAGE[damage](meta)
  (path / "offlax.json").write_bytes(bad if isinstance(bad, bytes) else json.dumps(bad).encode())
  before = sorted(str(p) for p in path.rglob("*"))
  with pytest.raises(offlax.errors.StoreCorruptedError, match=rf"{path}/offlax.json"):
    offlax.offload(optax.adam(1e-3), _tier(path, resume=True)).init(PARAMS)
  assert sorted(str(p) for p in path.rglob("*")) == before  # nothing created or removed


def test_metadata_is_a_directory(store_template, tmp_path):
  path = _copy(store_template, tmp_path)
  (path / "offlax.json").unlink()
  (path / "offlax.json").mkdir()
  with pytest.raises(offlax.errors.StoreCorruptedError, match="cannot read"):
    offlax.offload(optax.adam(1e-3), _tier(path, resume=True)).init(PARAMS)


# -- corrupted chunks: the kinds test_nvme.py (flip, truncate, delete) does not try --


def _first_chunk(path):
  meta = json.loads((path / "offlax.json").read_text())
  record = next(r for r in meta["leaves"] if r["shape"])
  return record, path / f"gen{meta['generation']}" / f"leaf_{record['index']:05d}" / "c" / "0"


@pytest.mark.parametrize("damage", ["extend", "zero", "symlink", "directory"])
def test_corrupted_chunk_kinds(store_template, tmp_path, damage):
  path = _copy(store_template, tmp_path)
  record, chunk = _first_chunk(path)
  data = chunk.read_bytes()
  chunk.unlink()
  error = offlax.errors.StoreCorruptedError
  if damage == "extend":
    chunk.write_bytes(data + b"\0" * 4)
  elif damage == "zero":  # zeroed pages, checksum included
    chunk.write_bytes(bytes(len(data)))
  elif damage == "symlink":  # never followed (O_NOFOLLOW)
    (tmp_path / "elsewhere").write_bytes(data)
    chunk.symlink_to(tmp_path / "elsewhere")
    error = offlax.errors.StoreError
  else:  # opens, but has a directory's size
    chunk.mkdir()
  store = Store(str(path), fsync=False)
  store.read_metadata()
  with pytest.raises(error, match=rf"{chunk} \(state leaf {re.escape(record['path'])}"):
    store.result(store.read(record["index"], 0, int(np.prod(record["shape"]))))


# -- foreign files, a failed first init, concurrent writers ---------------------

FOREIGN = ["notes.txt", "gen0/README", "gen1/leaf_99999/zarr.json", "gen0/leaf_00001/c/999"]


def test_foreign_files_in_the_store_are_ignored_and_kept(tmp_path):
  path = tmp_path / "store"  # (a folder of the user's files and no store is refused:
  tier = _tier(path)  # test_errors.py::test_an_nvme_tier_in_a_folder_of_other_files_...)
  tx = offlax.offload(optax.adam(1e-3), tier)
  state = tx.init(PARAMS)
  for name in FOREIGN:
    (path / name).parent.mkdir(parents=True, exist_ok=True)
    (path / name).write_text("mine")
  _, state = _steps(tx, state, 2)
  tier.close()
  tier = _tier(path, resume=True)
  tx = offlax.offload(optax.adam(1e-3), tier)
  got, _ = _steps(tx, tx.init(PARAMS), 1, start=2)
  tier.close()
  want, _ = _steps(optax.adam(1e-3), optax.adam(1e-3).init(PARAMS), 3)
  assert_trees_equal(got, want)
  assert all((path / name).read_text() == "mine" for name in FOREIGN)


def test_init_after_a_crashed_init(store_template, tmp_path):
  """Arrays without offlax.json (killed during the first init) are no store: init starts over."""
  path = _copy(store_template, tmp_path)
  (path / "offlax.json").unlink()
  with pytest.raises(offlax.errors.StoreError, match="no offlax store"):
    offlax.offload(optax.adam(1e-3), _tier(path, resume=True)).init(PARAMS)
  tier = _tier(path)
  state = offlax.offload(optax.adam(1e-3), tier).init(PARAMS)
  tier.close()
  assert int(state.step) == 0


def test_second_writer_in_the_same_process(store_template, tmp_path):
  """flock is per open file: a second tier on the path is refused in-process as well."""
  path = _copy(store_template, tmp_path)
  first = _tier(path, resume=True)
  offlax.offload(optax.adam(1e-3), first).init(PARAMS)
  with pytest.raises(offlax.errors.StoreLockedError, match=str(path)):
    offlax.offload(optax.adam(1e-3), _tier(path, resume=True)).init(PARAMS)
  first.close()
  second = _tier(path, resume=True)  # released by close
  assert int(offlax.offload(optax.adam(1e-3), second).init(PARAMS).step) == 0
  second.close()
