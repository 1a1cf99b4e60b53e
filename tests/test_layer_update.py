"""The optimizer over a `LayerStore`'s layers: exactness, commits, keep, faults, bad input.

The reference keeps the same stacked layers in memory: the gradients from one
jitted function, the optax update from another (two programs, as the store's
step is: one XLA program fusing both may round differently).
"""

import errno
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offlax
from offlax._src import errors
from offlax._src.layer_store import files as layer_files
from offlax._src.layer_store import slots as slots_lib

L, D = 5, 16
HERE = os.path.dirname(os.path.abspath(__file__))


def make_layers(dtype=jnp.bfloat16, n=L):
  k = jax.random.split(jax.random.key(0), 2)
  return {
    "w": (jax.random.normal(k[0], (n, D, D)) / D**0.5).astype(dtype),
    "b": (jax.random.normal(k[1], (n, D)) * 0.1).astype(dtype),
  }


def loss(layers, x):
  h, _ = offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), x, layers)
  return jnp.mean(h.astype(jnp.float32) ** 2)


def batch(step, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.key(100 + step), (3, D)).astype(dtype)


grad = jax.jit(jax.grad(loss))


def reference(tx, layers, steps, dtype=jnp.bfloat16):
  """Params and state after `steps` steps with the layers in memory."""
  update = jax.jit(
    lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  )
  params, state = layers, tx.init(layers)
  for step in range(steps):
    params, state = update(grad(params, batch(step, dtype)), state, params)
  return params, state


def assert_bits(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def per_layer(state):
  """The reference's state as the store holds it: global leaves (the count) once per layer."""
  return jax.tree.map(lambda x: np.broadcast_to(x, (L,)) if np.ndim(x) == 0 else x, state)


OPTIMIZERS = {
  "adam": (lambda: optax.adam(1e-2), jnp.float32),
  "master-adamw": (
    lambda: offlax.master_weights(optax.adamw(1e-2, weight_decay=0.1)),
    jnp.bfloat16,
  ),
  "native-adamw": (lambda: offlax.adamw(1e-2, weight_decay=0.1), jnp.float32),
}


@pytest.mark.slow_except("adam")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_bit_exact_with_layers_in_memory(tmp_path, name):
  make_tx, dtype = OPTIMIZERS[name]
  tx, layers = make_tx(), make_layers(dtype)
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, progress=False) as store:
    for step in range(3):
      grad(store.source(), batch(step, dtype))
      assert store.update() == step + 1
    want_params, want_state = reference(tx, layers, 3, dtype)
    assert_bits(store.read_params(), want_params)
    assert_bits(store.read_state(), per_layer(want_state))
    s = store.last_update
    # Read: the gradients, the state and the params; written: the params and the state. A
    # master's step overwrites the params whatever they held: it reads none.
    nbytes = L * sum(math.prod(r["shape"]) * np.dtype(r["dtype"]).itemsize for r in store.records)
    read_params = not name.startswith("master")
    assert s.step == 3 and s.bytes_written > nbytes
    assert s.bytes_read == s.bytes_written + read_params * nbytes
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with offlax.LayerStore.open(str(tmp_path / "s"), like, optimizer=make_tx()) as store:
    assert store.step == 3  # the commit is on disk
    assert_bits(store.read_params(), want_params)
    grad(store.source(), batch(3, dtype))
    store.update()
    assert_bits(store.read_params(), reference(tx, layers, 4, dtype)[0])


def test_accumulated_gradients(tmp_path):
  tx, layers = optax.adam(1e-2), make_layers()
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, progress=False) as store:
    for step in range(2):
      store.zero_grads()
      grad(store.source(accumulate=True), batch(2 * step))
      grad(store.source(accumulate=True), batch(2 * step + 1))
      store.update()
    params, state = layers, tx.init(layers)
    for step in range(2):
      g = jax.tree.map(jnp.add, grad(params, batch(2 * step)), grad(params, batch(2 * step + 1)))
      u, state = jax.jit(tx.update)(g, state, params)
      params = jax.jit(optax.apply_updates)(params, u)
    assert_bits(store.read_params(), params)


@pytest.mark.slow  # its rest test keeps by default
def test_keep_and_open_at_a_step(tmp_path):
  tx, layers, path = optax.adam(1e-2), make_layers(), str(tmp_path / "s")
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with offlax.LayerStore.create(path, layers, optimizer=tx, keep=2, progress=False) as store:
    for step in range(4):
      grad(store.source(), batch(step))
      store.update()
    assert [s for s, _ in store.kept] == [4, 3]
    assert len({g for _, g in store.kept}) == 2
  with pytest.raises(errors.StoreMismatchError, match=r"keeps steps \[3, 4\], but step=2"):
    offlax.LayerStore.open(path, like, optimizer=tx, step=2)
  with offlax.LayerStore.open(path, like, optimizer=tx, step=3) as store:  # rolled back
    assert store.step == 3 and [s for s, _ in store.kept] == [3]
    assert_bits(store.read_params(), reference(tx, layers, 3)[0])
    grad(store.source(), batch(3))
    store.update()  # step 4 again, into the generation the dropped step 4 held
    assert_bits(store.read_params(), reference(tx, layers, 4)[0])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["disk-full", "ctrl-c"])
def test_a_failed_update_keeps_the_committed_step(tmp_path, monkeypatch, fault):
  tx, layers, path = optax.adam(1e-2), make_layers(), str(tmp_path / "s")
  store = offlax.LayerStore.create(path, layers, optimizer=tx, progress=False)
  grad(store.source(), batch(0))
  store.update(rest=rest_of(1))
  grad(store.source(), batch(1))
  store.flush_grads()  # the gradients on disk before the faults start
  real, writes = slots_lib.pwrite_all, [0]

  def full_disk(fd, parts, offset):
    writes[0] += 1
    if writes[0] > 3:  # part of step 2's layers are written, then the disk is full
      if fault == "ctrl-c":
        raise KeyboardInterrupt
      raise OSError(errno.ENOSPC, "No space left on device")
    real(fd, parts, offset)

  monkeypatch.setattr(slots_lib, "pwrite_all", full_disk)
  if fault == "ctrl-c":
    with pytest.raises(KeyboardInterrupt):
      store.update(rest=rest_of(2))
  else:
    with pytest.raises(errors.StoreError, match=r"step 2 was not committed .*No space left.*still "
                       r"holds step 1, whole.*free space on the disk") as e:  # fmt: skip
      store.update(rest=rest_of(2))
    assert e.value.errno == errno.ENOSPC
  assert store.step == 1
  monkeypatch.setattr(slots_lib, "pwrite_all", real)
  assert_bits(store.read_params(), reference(tx, layers, 1)[0])
  store.close()
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with offlax.LayerStore.open(path, like, optimizer=tx) as store:  # as after a kill
    assert store.step == 1
    assert_bits(store.read_rest(rest_of(0)), rest_of(1))
    assert_bits(store.read_state(), per_layer(reference(tx, layers, 1)[1]))
    grad(store.source(), batch(1))
    store.update()
    assert_bits(store.read_params(), reference(tx, layers, 2)[0])


def test_the_rest_of_the_model_commits_with_the_layers(tmp_path):
  tx, layers, path = optax.adam(1e-2), make_layers(), str(tmp_path / "s")
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with offlax.LayerStore.create(path, layers, optimizer=tx, keep=2, progress=False) as store:
    with pytest.raises(errors.StoreMismatchError, match="step 0 .* committed without rest="):
      store.read_rest(rest_of(0))
    for step in range(3):
      grad(store.source(), batch(step))
      store.update(rest=rest_of(step + 1))
    assert_bits(store.read_rest(rest_of(0)), rest_of(3))
  with offlax.LayerStore.open(path, like, optimizer=tx, step=2) as store:  # rolled back
    assert_bits(store.read_rest(rest_of(0)), rest_of(2))
    with pytest.raises(errors.StoreMismatchError, match=r"leaf \['embed'\] is float32\[64, 33\] "
                       r"in step 2, `like` has float32\[64, 32\]"):  # fmt: skip
      store.read_rest({**rest_of(0), "embed": np.zeros((64, 32), np.float32)})
    with pytest.raises(errors.StoreMismatchError, match=r"the rest lacks \['other'\]"):
      store.read_rest({**rest_of(0), "other": np.zeros(2)})
    grad(store.source(), batch(2))
    store.update()  # without rest: step 3 has none
    with pytest.raises(errors.StoreMismatchError, match="step 3 .* committed without rest="):
      store.read_rest(rest_of(0))
    gen = dict(store.kept)[2]
  name = tmp_path / "s" / f"gen{gen}" / "rest.bin"
  data = bytearray(name.read_bytes())
  data[100] ^= 1
  name.write_bytes(bytes(data))
  [report] = offlax.checkpoint.inspect_store(path, verify=True, progress=False)
  assert report.problems == [f"step 2: {name}: rest leaf ['embed'] does not match its checksum"]
  with offlax.LayerStore.open(path, like, optimizer=tx, step=2) as store:
    with pytest.raises(errors.StoreCorruptedError, match=r"leaf \['embed'\] of step 2 does not"):
      store.read_rest(rest_of(0))


def test_one_writer_at_a_time(tmp_path):
  layers, path = make_layers(), str(tmp_path / "s")
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with offlax.LayerStore.create(path, layers, progress=False):
    with pytest.raises(errors.StoreLockedError, match=r"already open .*close it first"):
      offlax.LayerStore.open(path, like)
  offlax.LayerStore.open(path, like).close()  # closed: free again


def test_bad_input(tmp_path, monkeypatch):
  layers = make_layers()
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  clipped = optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1.0))  # not leading
  with pytest.raises(errors.InvalidOptionError, match=r"update of leaf \['b'\] is not elementwise"):
    offlax.LayerStore.create(str(tmp_path / "a"), layers, optimizer=clipped)
  assert not os.path.exists(tmp_path / "a")
  with pytest.raises(errors.TransformationTypeError, match="GradientTransformation"):
    offlax.LayerStore.create(str(tmp_path / "a"), layers, optimizer=optax.adam)
  with pytest.raises(errors.InvalidOptionError, match="keep must be an int >= 1, got 0"):
    offlax.LayerStore.create(str(tmp_path / "a"), layers, keep=0)

  with offlax.LayerStore.create(str(tmp_path / "p"), layers, progress=False) as store:
    with pytest.raises(errors.InvalidOptionError, match="open without an optimizer"):
      store.update()
  with pytest.raises(errors.StoreMismatchError, match="made without optimizer state"):
    offlax.LayerStore.open(str(tmp_path / "p"), like, optimizer=optax.adam(1e-2))
  offlax.LayerStore.create(str(tmp_path / "q"), layers, optimizer=optax.sgd(0.1)).close()
  with pytest.raises(errors.StoreMismatchError, match=r"no state leaf \[0\].count; it holds none"):
    offlax.LayerStore.open(str(tmp_path / "q"), like, optimizer=optax.adam(1e-2))

  # The NVMe tier's store (optimizer state, no params) and a layer store refuse each other.
  tier = offlax.NVMeTier(str(tmp_path / "t"), cache_bytes=0, progress=False)
  offlax.offload(optax.adam(1e-2), tier).init(layers)
  tier.close()
  with pytest.raises(errors.StoreMismatchError, match=r"NVMeTier store \(optimizer state, made "
                     r"without params\), not a LayerStore"):  # fmt: skip
    offlax.LayerStore.open(str(tmp_path / "t"), like, optimizer=optax.adam(1e-2))
  tier = offlax.NVMeTier(str(tmp_path / "p"), progress=False)
  with pytest.raises(errors.StoreMismatchError, match="holds an offlax.LayerStore"):
    offlax.offload(optax.adam(1e-2), tier).init(layers)
  tier.close()

  with pytest.raises(errors.StoreMismatchError, match=r"init_layer\(0\) leaf \['w'\] is float32"):
    offlax.LayerStore.create(str(tmp_path / "i"), like,
                             init_layer=lambda i: {"b": np.zeros(D, jnp.bfloat16),
                                                   "w": np.zeros((D, D), np.float32)})  # fmt: skip
  assert not os.path.exists(tmp_path / "i")  # a failed create leaves nothing
  monkeypatch.setattr(layer_files, "free_bytes", lambda path: 1000)
  with pytest.raises(errors.StoreError, match=r"needs 0.00 GiB .*has 0.00 GiB free") as e:
    offlax.LayerStore.create(str(tmp_path / "f"), layers, optimizer=optax.adam(1e-2))
  assert e.value.errno == errno.ENOSPC


def test_init_layer_writes_a_layer_at_a_time(tmp_path):
  layers, tx = make_layers(), optax.adam(1e-2)
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  made = []
  init = lambda i: (made.append(i), jax.tree.map(lambda a: a[i], layers))[1]
  with offlax.LayerStore.create(str(tmp_path / "s"), like, optimizer=tx, init_layer=init,
                                progress=False) as store:  # fmt: skip
    assert made == list(range(L))
    assert_bits(store.read_params(), layers)
    assert_bits(store.read_state(), per_layer(tx.init(layers)))


@pytest.mark.slow
@pytest.mark.parametrize("update", ["explicit", "backward"])
def test_killed_at_any_moment_resumes_params_and_state_of_one_step(tmp_path, update):
  """SIGKILL at random moments (mid-backward, mid-update, mid-commit): always one whole step.

  With ``update="backward"`` the kills land in the backward pass's updates too.
  """
  path, rng = str(tmp_path / "s"), np.random.default_rng(0)
  cmd = [sys.executable, os.path.join(HERE, "layer_store_run.py"), path, update]
  steps = []
  for _ in range(4):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready")  # jax imported, the store open
    # One commit first (its compile takes 2-3 s on a busy machine, longer than the window),
    # so each run's kill lands in a later step's backward pass, update or commit.
    assert proc.stdout.readline().startswith("committed")
    time.sleep(rng.uniform(0.05, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with offlax.LayerStore.open(path, make_layers_like(), optimizer=run_optimizer()) as store:
      steps.append(store.step)
      params, state = reference(run_optimizer(), make_layers(jnp.float32), store.step, jnp.float32)
      assert_bits(store.read_params(), params)
      assert_bits(store.read_state(), per_layer(state))
      if store.step:  # the rest of the model committed with the layers: of the same step
        assert_bits(store.read_rest(rest_of(0)), rest_of(store.step))
  assert steps == sorted(steps) and steps[-1] > 0, steps


def rest_of(step):
  """A stand-in for the rest of a model (embedding and its state) at `step`."""
  return {"embed": np.full((64, 33), step, np.float32), "count": np.array(step, np.int32),
          "mu": np.full((3,), step, jnp.bfloat16)}  # fmt: skip


def make_layers_like():
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_layers(jnp.float32))


def run_optimizer():
  return offlax.master_weights(optax.adamw(1e-2, weight_decay=0.1))


@pytest.mark.slow  # its rest test inspects by default
def test_inspect_verifies_a_layer_store(tmp_path):
  tx, layers, path = optax.adam(1e-2), make_layers(), str(tmp_path / "s")
  with offlax.LayerStore.create(path, layers, optimizer=tx, keep=2, progress=False) as store:
    for step in range(2):
      grad(store.source(), batch(step))
      store.update()
  [report] = offlax.checkpoint.inspect_store(path, verify=True, progress=False)
  assert report.ok and report.kind == "layers", report.format()
  assert report.step == 2 and report.kept == [2, 1] and report.generations == 3
  assert {leaf.path for leaf in report.leaves} >= {"params ['w']", "state [0].mu['w']"}
  assert all(leaf.status == "verified" for leaf in report.leaves)
  gen = dict(store.kept)[2]
  name = tmp_path / "s" / f"gen{gen}" / "params" / "1.bin"  # leaf ['w']
  data = bytearray(name.read_bytes())
  data[3 * store.records[1]["slot"] + 5] ^= 1  # one bit of layer 3
  name.write_bytes(bytes(data))
  [report] = offlax.checkpoint.inspect_store(path, verify=False, progress=False)
  assert report.ok  # sizes only
  [report] = offlax.checkpoint.inspect_store(path, verify=True, progress=False)
  assert report.problems == [f"step 2: {name}: layer 3 of ['w'] does not match its checksum"]
  os.truncate(tmp_path / "s" / "grads" / "0.bin", 10)
  out = subprocess.run([sys.executable, "-m", "offlax", "inspect", path], capture_output=True,
                       text=True)  # fmt: skip
  assert out.returncode == 1 and "0.bin holds 10 bytes" in out.stdout, out.stdout + out.stderr
