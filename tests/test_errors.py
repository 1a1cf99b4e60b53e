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
  assert issubclass(offlax.InvalidTierError, offlax.OffloadError)
  assert issubclass(offlax.InvalidTierError, ValueError)
  assert issubclass(offlax.InvalidOptionError, offlax.OffloadError)
  assert issubclass(offlax.InvalidOptionError, ValueError)
  assert issubclass(offlax.MemoryKindError, ValueError)
  assert issubclass(offlax.TreeMismatchError, ValueError)
  assert issubclass(offlax.LeafTypeError, TypeError)


@pytest.mark.parametrize("chunk", [0, -1])
def test_chunk_bytes_must_be_positive(chunk):
  with pytest.raises(offlax.InvalidTierError, match=f"chunk_bytes must be > 0 bytes, got {chunk}"):
    offlax.HostTier(chunk_bytes=chunk)


@pytest.mark.parametrize("chunk", [1.5, "64MB", True, None])
def test_chunk_bytes_must_be_an_int(chunk):
  with pytest.raises(offlax.InvalidTierError, match="chunk_bytes must be an int"):
    offlax.HostTier(chunk_bytes=chunk)


def test_min_offload_bytes_must_be_non_negative():
  with pytest.raises(offlax.InvalidTierError, match="min_offload_bytes must be >= 0"):
    offlax.HostTier(min_offload_bytes=-5)


@pytest.mark.parametrize("kind", ["hbm", "device", "unpinned_host", ""])
def test_unknown_memory_kind(kind):
  with pytest.raises(offlax.MemoryKindError, match=repr(kind)):
    offlax.HostTier(memory_kind=kind)


def test_tier_and_options_together():
  with pytest.raises(offlax.InvalidTierError, match="chunk_bytes"):
    offlax.offload(optax.adam(1e-3), offlax.HostTier(), chunk_bytes=10)


def test_tier_of_wrong_type():
  with pytest.raises(offlax.InvalidTierError, match="str"):
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
  with pytest.raises(offlax.MemoryKindError, match=r"FakeTPU_0 has no 'pinned_host' memory"):
    offlax.HostTier().check_devices([_DeviceWithoutHostMemory()])
  offlax.HostTier().check_devices(jax.devices())  # the CPU offers it


@pytest.mark.parametrize(
  "leaf, kind", [("a string", "str"), (object(), "object"), (lambda x: x, "function")]
)
def test_non_array_param_leaf(tx, leaf, kind):
  params = {"dense": {"w": jnp.ones(3), "act": leaf}}
  with pytest.raises(offlax.LeafTypeError, match=rf"params leaf \['dense'\]\['act'\] is a {kind}"):
    tx.init(params)


def test_non_array_update_leaf(tx):
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(offlax.LeafTypeError, match=r"updates leaf \['w'\] is a str"):
    tx.update({"w": "oops"}, state)


def test_updates_with_other_keys(tx):
  state = tx.init({"w": jnp.ones(3), "b": jnp.ones(2)})
  with pytest.raises(
    offlax.TreeMismatchError, match=r"missing leaves \['w'\]; unexpected leaves \['v'\]"
  ):
    tx.update({"v": jnp.ones(3), "b": jnp.ones(2)}, state)


def test_updates_with_other_container(tx):
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(
    offlax.TreeMismatchError, match=r"missing leaves \['w'\]; unexpected leaves \[0\]"
  ):
    tx.update([jnp.ones(3)], state)


def test_updates_with_same_paths_other_nodes(tx):
  state = tx.init({"w": (jnp.ones(3),)})
  with pytest.raises(offlax.TreeMismatchError, match="expected structure"):
    tx.update({"w": [jnp.ones(3)]}, state)


def test_updates_with_other_shape(tx):
  state = tx.init({"w": jnp.ones((3, 4))})
  with pytest.raises(
    offlax.TreeMismatchError, match=r"updates leaf \['w'\] has shape \(4, 3\); .* \(3, 4\)"
  ):
    jax.jit(tx.update)({"w": jnp.ones((4, 3))}, state)


def test_params_with_other_structure(tx):
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(offlax.TreeMismatchError, match="params do not have the structure"):
    tx.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3), "extra": jnp.ones(1)})


def test_state_of_another_transformation(tx):
  with pytest.raises(offlax.TreeMismatchError, match="expects the OffloadState returned by init"):
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
