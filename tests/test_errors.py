"""Bad input raises an offlax error that names the leaf and what was expected."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offlax


@pytest.fixture
def tx():
  return offlax.offload(optax.adam(1e-3))


def test_error_hierarchy():
  assert issubclass(offlax.errors.InvalidTierError, offlax.errors.OffloadError)
  assert issubclass(offlax.errors.InvalidTierError, ValueError)
  assert issubclass(offlax.errors.InvalidOptionError, offlax.errors.OffloadError)
  assert issubclass(offlax.errors.InvalidOptionError, ValueError)
  assert issubclass(offlax.errors.MemoryKindError, ValueError)
  assert issubclass(offlax.errors.TreeMismatchError, ValueError)
  assert issubclass(offlax.errors.LeafTypeError, TypeError)


@pytest.mark.parametrize("chunk", [0, -1])
def test_chunk_bytes_must_be_positive(chunk):
  with pytest.raises(
    offlax.errors.InvalidTierError, match=f"chunk_bytes must be > 0 bytes, got {chunk}"
  ):
    offlax.HostTier(chunk_bytes=chunk)


@pytest.mark.parametrize("chunk", [1.5, "64MB", True, None])
def test_chunk_bytes_must_be_an_int(chunk):
  with pytest.raises(offlax.errors.InvalidTierError, match="chunk_bytes must be an int"):
    offlax.HostTier(chunk_bytes=chunk)


def test_min_offload_bytes_must_be_non_negative():
  with pytest.raises(offlax.errors.InvalidTierError, match="min_offload_bytes must be >= 0"):
    offlax.HostTier(min_offload_bytes=-5)


@pytest.mark.parametrize("kind", ["hbm", "device", "unpinned_host", ""])
def test_unknown_memory_kind(kind):
  with pytest.raises(offlax.errors.MemoryKindError, match=repr(kind)):
    offlax.HostTier(memory_kind=kind)


def test_tier_and_options_together():
  with pytest.raises(offlax.errors.InvalidTierError, match="chunk_bytes"):
    offlax.offload(optax.adam(1e-3), offlax.HostTier(), chunk_bytes=10)


def test_tier_of_wrong_type():
  with pytest.raises(offlax.errors.InvalidTierError, match="str"):
    offlax.offload(optax.adam(1e-3), "host")


def test_unknown_tier_option():
  with pytest.raises(TypeError, match="chunk_size"):
    offlax.offload(optax.adam(1e-3), chunk_size=10)


class _DeviceWithoutHostMemory:
  """Stands in for an accelerator whose runtime offers no pinned host memory."""

  class _Memory:
    kind = "device"

  def addressable_memories(self):
    return [self._Memory()]

  def __str__(self):
    return "FakeTPU_0"


def test_device_without_pinned_host():
  with pytest.raises(offlax.errors.MemoryKindError, match=r"FakeTPU_0 has no 'pinned_host' memory"):
    offlax.HostTier().check_devices([_DeviceWithoutHostMemory()])
  offlax.HostTier().check_devices(jax.devices())  # the CPU offers it


@pytest.mark.parametrize(
  "leaf, kind", [("a string", "str"), (object(), "object"), (lambda x: x, "function")]
)
def test_non_array_param_leaf(tx, leaf, kind):
  params = {"dense": {"w": jnp.ones(3), "act": leaf}}
  with pytest.raises(
    offlax.errors.LeafTypeError, match=rf"params leaf \['dense'\]\['act'\] is a {kind}"
  ):
    tx.init(params)


def test_non_array_update_leaf(tx):
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(offlax.errors.LeafTypeError, match=r"updates leaf \['w'\] is a str"):
    tx.update({"w": "oops"}, state)


def test_updates_with_other_keys(tx):
  state = tx.init({"w": jnp.ones(3), "b": jnp.ones(2)})
  with pytest.raises(
    offlax.errors.TreeMismatchError, match=r"missing leaves \['w'\]; unexpected leaves \['v'\]"
  ):
    tx.update({"v": jnp.ones(3), "b": jnp.ones(2)}, state)


def test_updates_with_other_container(tx):
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(
    offlax.errors.TreeMismatchError, match=r"missing leaves \['w'\]; unexpected leaves \[0\]"
  ):
    tx.update([jnp.ones(3)], state)


def test_updates_with_same_paths_other_nodes(tx):
  state = tx.init({"w": (jnp.ones(3),)})
  with pytest.raises(offlax.errors.TreeMismatchError, match="expected structure"):
    tx.update({"w": [jnp.ones(3)]}, state)


def test_updates_with_other_shape(tx):
  state = tx.init({"w": jnp.ones((3, 4))})
  with pytest.raises(
    offlax.errors.TreeMismatchError, match=r"updates leaf \['w'\] has shape \(4, 3\); .* \(3, 4\)"
  ):
    jax.jit(tx.update)({"w": jnp.ones((4, 3))}, state)


def test_params_with_other_structure(tx):
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(offlax.errors.TreeMismatchError, match="params do not have the structure"):
    tx.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3), "extra": jnp.ones(1)})


def test_state_of_another_transformation(tx):
  with pytest.raises(
    offlax.errors.TreeMismatchError, match="expects the OffloadState returned by init"
  ):
    tx.update({"w": jnp.ones(3)}, optax.adam(1e-3).init({"w": jnp.ones(3)}))


def test_nan_gradients_propagate_like_optax():
  """offload adds no NaN handling of its own: NaN in, NaN out, as in optax.

  Skipping non-finite steps is the inner chain's job (optax.apply_if_finite).
  """
  params = {"w": jnp.ones(4)}
  grads = {"w": jnp.array([1.0, jnp.nan, jnp.inf, 0.0])}
  for inner in (optax.adam(1e-3), optax.apply_if_finite(optax.adam(1e-3), 3)):
    want, _ = inner.update(grads, inner.init(params), params)
    tx = offlax.offload(inner)
    got, state = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
  assert int(optax.tree_utils.tree_get(state, "notfinite_count")) == 1


def test_an_unknown_offload_option_names_offload_it_and_the_options():
  with pytest.raises(
    offlax.errors.InvalidOptionError, match=r"offload.*\['chunk_size'\].*chunk_bytes"
  ):
    offlax.offload(optax.adamw(1e-3), chunk_size=1024)
  with pytest.raises(TypeError):  # what Python raises for an unknown keyword
    offlax.offload(optax.adamw(1e-3), chunk_size=1024)
  offlax.offload(optax.adamw(1e-3), chunk_bytes=1024)  # a HostTier option: accepted


def test_an_nvme_tier_in_a_folder_of_other_files_is_refused_and_writes_nothing(tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  params = {"w": jnp.ones(4)}
  tx = offlax.offload(optax.adam(1e-3), offlax.NVMeTier(str(tmp_path), progress=False))
  with pytest.raises(offlax.errors.NotAStoreError, match=r"1 other file.*notes\.txt.*offlax-state"):
    tx.init(params)
  assert issubclass(offlax.errors.NotAStoreError, offlax.errors.StoreError)
  assert issubclass(offlax.errors.NotAStoreError, FileExistsError)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
  # An empty folder, and one holding a store, are a store's.
  empty = tmp_path / "state"
  empty.mkdir()
  tier = offlax.NVMeTier(str(empty), progress=False, fsync=False)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  again = offlax.NVMeTier(str(empty), resume=True, progress=False, fsync=False)
  offlax.offload(optax.adam(1e-3), again).init(params)
  again.close()


def test_nvme_progress_bars_show_only_for_work_long_enough_to_watch(tmp_path, capfd, monkeypatch):
  from offlax._src.nvme import array_files

  params = {"w": jnp.ones(1024)}  # a store of a few KB: done long before a bar would show

  def run(path):
    tier = offlax.NVMeTier(str(path), progress=True, fsync=False)
    offlax.offload(optax.adam(1e-3), tier).init(params)
    tier.close()
    again = offlax.NVMeTier(str(path), resume=True, progress=True, fsync=False)
    offlax.offload(optax.adam(1e-3), again).init(params)
    again.close()
    return capfd.readouterr().err

  capfd.readouterr()
  assert "offlax: " not in run(tmp_path / "quick")
  monkeypatch.setattr(array_files, "BAR_DELAY_S", 0.0)  # as if it had run long enough
  err = run(tmp_path / "slow")
  assert "offlax: writing" in err and "offlax: resuming" in err
