"""A third tier, written against `offlax.extend.Tier` alone: the protocol is all `offload` needs.

`NumpyTier` keeps every array of the optimizer state in numpy buffers owned by
Python, outside JAX; the state holds `offlax.extend.OnDisk` placeholders for them.
Each step reads a slice's pieces through an ordered `io_callback` and writes
the new ones back in place, and counts its steps. docs/adding_a_tier.md walks
through it. The conformance tests below hold for every tier: the host tier in
both compute modes, the NVMe tier and this one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal, committed, committed_state, grads_like, model_params
from conftest import run_steps as run
from jax.experimental import io_callback

import offlax


# --8<-- [start:tier]
class NumpyTier(offlax.extend.Tier):
  """Keeps each array of the state in a numpy buffer of this process; scalars stay in JAX."""

  def __init__(self, chunk_bytes: int = 4096):
    self._chunk_bytes = chunk_bytes
    self.buffers: dict[int, np.ndarray] = {}

  @property
  def chunk_bytes(self) -> int:
    return self._chunk_bytes

  def init(self, inner, params, spec):
    def place(x):
      if np.ndim(x) == 0:
        return x  # every slice needs it: kept in JAX, on the device
      index = len(self.buffers)
      self.buffers[index] = np.array(x)
      return offlax.extend.OnDisk(index, tuple(x.shape), np.dtype(x.dtype).name)

    return jax.tree.map(place, inner.init(params)), jnp.int32(0)  # the tier's step count

  def open_io(self, items, offloaded, step, *, mesh_plan=None, shard=None):
    return NumpyIO(self, items, offloaded, step)

  def stats(self, state, *, sync=False):
    held = sum(b.nbytes for b in self.buffers.values())
    on_device = sum(x.nbytes for x in jax.tree.leaves(state.inner_state))
    return offlax.extend.OffloadStats(None, on_device, held, 0, held, held)

  def view(self, index: int, piece) -> np.ndarray:
    """The part of buffer `index` that `piece` names (a view: writes go into the buffer)."""
    x = self.buffers[index]
    if piece.start is None:
      return x
    x = x.reshape(-1) if piece.flat else x
    return x[(slice(None),) * piece.axis + (slice(piece.start, piece.stop),)]


class NumpyIO:
  """One step's moves: each piece read and written by an ordered callback."""

  prefetch_depth = 1  # ordered callbacks: no read runs ahead
  writes_in_place = False  # the items are placeholders: only this tier can read them

  def __init__(self, tier, items, offloaded, step):
    self.tier, self.items, self.offloaded, self.step = tier, items, offloaded, step

  def plan(self, keys):
    self.keys = keys

  def to_host(self, x):
    return x

  def to_device(self, j, x):
    return x  # only items kept in JAX (scalars) come here: already on the device

  def to_tier(self, j, x):
    return x

  def load(self, k, after):
    out = []
    for j, piece in self.keys[k]:
      item = self.items[j]
      if not isinstance(item, offlax.extend.OnDisk):
        out.append(piece.take(item))
        continue
      shape = jax.eval_shape(piece.take, jax.ShapeDtypeStruct(item.shape, item.dtype))
      read = lambda i=item.index, p=piece: self.tier.view(i, p).copy()
      out.append(io_callback(read, shape, ordered=True))
    return out

  def store(self, k, values):
    out = []
    for (j, piece), value in zip(self.keys[k], values, strict=True):
      item = self.items[j]
      if not isinstance(item, offlax.extend.OnDisk):
        out.append(value)
        continue
      write = lambda v, i=item.index, p=piece: np.copyto(self.tier.view(i, p), v)
      io_callback(write, None, value, ordered=True)
      out.append(None)  # the tier holds it
    return out

  def finish(self, items):
    return [self.items[j] if x is None else x for j, x in enumerate(items)]

  def next_step(self):
    return self.step + 1


# --8<-- [end:tier]


@pytest.mark.slow_except("clip_adam-256", "adamw-1048576")
@pytest.mark.parametrize("chunk_bytes", [256, 2**20])
@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.adamw(1e-2, weight_decay=1e-3),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),  # one coupled slice
  ],
  ids=["adamw", "clip_adam"],
)
def test_a_third_tier_trains_bit_exact_with_optax(make, chunk_bytes):
  params = {k: v for k, v in model_params().items() if k != "steps_seen"}  # floats only
  want_params, want_state, want_u = run(make(), params, 4)
  tier = NumpyTier(chunk_bytes)
  got_params, got_state, got_u = run(offlax.offload(make(), tier), params, 4)
  assert_trees_equal(got_params, want_params)
  assert_trees_equal(got_u, want_u)
  # The state lives in the tier's buffers, not in JAX, and holds optax's values.
  mu = optax.tree_utils.tree_get(got_state, "mu")
  kernel = mu["layers"][0]["mlp"]["kernel"]
  assert isinstance(kernel, offlax.extend.OnDisk)
  want_mu = optax.tree_utils.tree_get(want_state, "mu")["layers"][0]["mlp"]["kernel"]
  np.testing.assert_array_equal(tier.buffers[kernel.index], np.asarray(want_mu))
  assert offlax.stats(got_state, tier).host_bytes == sum(b.nbytes for b in tier.buffers.values())


def test_the_third_tier_is_short():
  """The tier above, protocol and I/O, is under 100 lines: the protocol asks little."""
  text = open(__file__).read()
  tier = text.split("# --8<-- [start:tier]")[1].split("# --8<-- [end:tier]")[0]
  assert len(tier.strip().splitlines()) < 100


def test_an_object_without_the_protocol_is_refused():
  with pytest.raises(offlax.errors.InvalidTierError, match="lacks .*open_io"):
    offlax.offload(optax.adam(1e-3), tier=object())


# -- conformance: what every tier does behind the protocol ------------------------


def _host(compute):
  return lambda tmp_path, chunk: offlax.HostTier(chunk_bytes=chunk, compute=compute)


def _nvme(tmp_path, chunk):
  return offlax.NVMeTier(str(tmp_path / "store"), chunk_bytes=chunk, cache_bytes=0, progress=False)


TIERS = {
  "host": _host("device"),
  "host_compute": _host("host"),
  "nvme": _nvme,
  "numpy": lambda tmp_path, chunk: NumpyTier(chunk),
}


@pytest.fixture(params=list(TIERS))
def make_tier(request, tmp_path):
  made = []

  def make(chunk=1024):
    made.append(TIERS[request.param](tmp_path, chunk))
    return made[-1]

  yield make
  for tier in made:
    tier.close()


def _floats():
  return {k: v for k, v in model_params().items() if k != "steps_seen"}


def test_conformance_protocol_and_io(make_tier):
  """The tier is an `offlax.extend.Tier`, and its I/O states the capabilities the stream reads."""
  tier = make_tier()
  assert isinstance(tier, offlax.extend.Tier)
  tx = offlax.offload(optax.adam(1e-3), tier)
  params = _floats()
  state = tx.init(params)
  assert state.tier is tier  # reachable from the state: static, not a leaf
  items = jax.tree.leaves(state.inner_state, is_leaf=lambda x: isinstance(x, offlax.extend.OnDisk))
  io = tier.open_io(items, [True] * len(items), state.step)
  assert isinstance(io, offlax.extend.TierIO)
  assert isinstance(io.prefetch_depth, int) and io.prefetch_depth >= 1
  assert isinstance(io.writes_in_place, bool)
  assert tier.compute == "device" or io.writes_in_place


# numpy-update: test_a_third_tier_trains_bit_exact_with_optax[clip_adam-256] runs the NumpyTier
# in smaller slices with a coupled clip by default (and checks its buffers).
@pytest.mark.slow_except("host-update")
@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_conformance_bit_exact_in_many_slices_with_its_step(make_tier, fused):
  """Leaves cut into pieces and a coupled update: optax's results, bit for bit; the step counts."""
  params = committed(_floats())  # the steps compile once
  make = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  tier = make_tier(chunk=512)

  def train(tx):
    @jax.jit
    def step(params, state, grads):
      if fused:
        return offlax.update_and_apply(tx, grads, state, params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    state = committed_state(tx.init(params))
    first, p = state.step if isinstance(state, offlax.OffloadState) else None, params
    for i in range(3):
      p, state = step(p, state, grads_like(params, i))
    return p, state, first

  want_params, want_state, _ = train(make())
  got, state, first = train(offlax.offload(make(), tier))
  assert_trees_equal(got, want_params)
  if first is None:  # a tier that counts no steps
    assert state.step is None
  else:
    assert int(state.step) == int(first) + 3
  assert state.tier is tier
  s = offlax.stats(state, tier)
  assert isinstance(s, offlax.extend.OffloadStats) and s.host_bytes + s.nvme_bytes > 0
  # The state holds optax's values: in JAX arrays, or in the tier's own storage.
  if tier.compute == "device" and isinstance(tier, offlax.HostTier):
    want_mu = optax.tree_utils.tree_get(want_state, "mu")
    assert_trees_equal(optax.tree_utils.tree_get(state, "mu"), want_mu)
