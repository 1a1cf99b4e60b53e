"""`LayerStore.create(..., update="backward")`: each layer updated in the backward pass.

The same model, batches and optimizers as `test_layer_update`: the params and
state after the steps equal, to the bit, the explicit `update()` mode's and
plain optax's on the layers in memory; the gradients never go to disk (the
store's byte counters); the step commits at its end, and only then.
"""

import errno
import gc
import threading
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import interrupted
from test_layer_update import (
  OPTIMIZERS,
  L,
  assert_bits,
  batch,
  grad,
  make_layers,
  per_layer,
  reference,
  rest_of,
)

import offlax
from offlax._src import errors
from offlax._src.layer_store import files as layer_files
from offlax._src.layer_store import micro
from offlax._src.layer_store import rest as layer_rest
from offlax._src.layer_store import slots as slots_lib


def train(path, make_tx, dtype, update, steps=3, rest=False):
  """`steps` steps in mode `update`; the params, state and bytes moved per step."""
  store = offlax.LayerStore.create(path, make_layers(dtype), optimizer=make_tx(), update=update,
                                   progress=False)  # fmt: skip
  moved = []
  with store:
    for step in range(steps):
      before = store.bytes_read + store.bytes_written
      grad(store.source(), batch(step, dtype))
      assert store.update(rest=rest_of(step + 1) if rest else None) == step + 1
      moved.append(store.bytes_read + store.bytes_written - before)
    return store.read_params(), store.read_state(), moved, store.last_update


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_backward_mode_is_bit_exact_and_moves_no_gradients(tmp_path, name):
  make_tx, dtype = OPTIMIZERS[name]
  params, state, moved, last = train(str(tmp_path / "b"), make_tx, dtype, "backward", rest=True)
  want_params, want_state = reference(make_tx(), make_layers(dtype), 3, dtype)
  assert_bits(params, want_params)
  assert_bits(state, per_layer(want_state))
  e_params, e_state, e_moved, _ = train(str(tmp_path / "e"), make_tx, dtype, "explicit")
  assert_bits(params, e_params)
  assert_bits(state, e_state)
  # Per step, the explicit mode also writes each layer's gradient and reads it back, and its
  # update reads the params the backward pass read (the backward mode keeps them), but for a
  # master's, which overwrites them whatever they held.
  layer_slots = L * sum(r["slot"] for r in offlax.LayerStore.open(
    str(tmp_path / "e"), params, optimizer=make_tx()).records)  # fmt: skip
  extra = (2 if name.startswith("master") else 3) * layer_slots
  assert [e - b for e, b in zip(e_moved, moved, strict=True)] == [extra] * 3
  assert last.step == 3 and last.bytes_written > 0 and last.bytes_read > 0
  with offlax.LayerStore.open(str(tmp_path / "b"), params, optimizer=make_tx()) as store:
    assert store.step == 3  # committed on disk, with its rest; resumed in the explicit mode
    assert_bits(store.read_rest(rest_of(0)), rest_of(3))
    grad(store.source(), batch(3, dtype))
    store.update()
    assert_bits(store.read_params(), reference(make_tx(), make_layers(dtype), 4, dtype)[0])


def test_the_step_commits_at_its_end_and_a_forgotten_update_is_not_silent(tmp_path):
  tx, layers = optax.adam(1e-2), make_layers(jnp.float32)
  store = offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, update="backward",
                                   progress=False)  # fmt: skip
  with pytest.raises(errors.IncompleteStepError, match="no backward pass handed off the layers"):
    store.update()
  grad(store.source(), batch(0, jnp.float32))
  store.flush_grads()
  assert store.step == 0  # updated in the backward pass, not committed
  assert_bits(store.read_params(), layers)
  # The next step's forward pass reads the layers: the step is committed first, warning.
  with pytest.warns(errors.StepNotCommittedWarning, match="step 1's layers were updated"):
    grad(store.source(), batch(1, jnp.float32))
    store.flush_grads()
  assert store.step == 1
  assert store.update() == 2  # step 2, its forward pass reading step 1's layers
  assert_bits(store.read_params(), reference(tx, layers, 2, jnp.float32)[0])
  grad(store.source(), batch(2, jnp.float32))
  with pytest.warns(errors.StepNotCommittedWarning, match="step 3 was dropped, not committed"):
    store.close()  # without update(): dropped
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with offlax.LayerStore.open(str(tmp_path / "s"), like, optimizer=tx) as store:
    assert store.step == 2
    assert_bits(store.read_params(), reference(tx, layers, 2, jnp.float32)[0])


@pytest.mark.slow
def test_a_failed_write_commits_nothing(tmp_path, monkeypatch):
  tx, layers = optax.adam(1e-2), make_layers(jnp.float32)
  store = offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, update="backward",
                                   progress=False)  # fmt: skip
  with store:
    grad(store.source(), batch(0, jnp.float32))
    store.update()
    real, writes = slots_lib.pwrite_all, [0]

    def full_disk(fd, parts, offset):
      writes[0] += 1
      if writes[0] > 3:
        raise OSError(errno.ENOSPC, "No space left on device")
      real(fd, parts, offset)

    monkeypatch.setattr(slots_lib, "pwrite_all", full_disk)
    grad(store.source(), batch(1, jnp.float32))  # the backward pass goes on; its worker failed
    with pytest.raises(errors.StoreError, match=r"step 2 was not committed: the update in the "
                       r"backward pass failed at layer 4, leaf \['b'\] .*still holds step 1, "
                       r"whole: free space on the disk, then run the step again"):  # fmt: skip
      store.update()
    monkeypatch.setattr(slots_lib, "pwrite_all", real)
    assert store.step == 1
    assert_bits(store.read_params(), reference(tx, layers, 1, jnp.float32)[0])
    grad(store.source(), batch(1, jnp.float32))  # the step again
    store.update()
    assert_bits(store.read_params(), reference(tx, layers, 2, jnp.float32)[0])


def test_bad_options_are_refused(tmp_path):
  layers = make_layers()
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers)
  with pytest.raises(errors.InvalidOptionError, match=r"update='sideways'; choose "
                     r"update='explicit' .* or update='backward'"):  # fmt: skip
    offlax.LayerStore.create(str(tmp_path / "a"), layers, optimizer=optax.adam(1e-2),
                             update="sideways")  # fmt: skip
  with pytest.raises(errors.InvalidOptionError, match="update='backward' .* none was given"):
    offlax.LayerStore.create(str(tmp_path / "a"), layers, update="backward")
  clipped = optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1.0))  # not leading
  with pytest.raises(errors.InvalidOptionError, match=r"leaf \['b'\] is not elementwise"):
    offlax.LayerStore.create(str(tmp_path / "a"), layers, optimizer=clipped, update="backward")
  offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=optax.adam(1e-2)).close()
  with pytest.raises(errors.InvalidOptionError, match="update='backward' .* none was given"):
    offlax.LayerStore.open(str(tmp_path / "s"), like, update="backward")
  with offlax.LayerStore.open(str(tmp_path / "s"), like, optimizer=optax.adam(1e-2),
                              update="backward") as store:  # fmt: skip
    with pytest.raises(errors.InvalidOptionError, match=r"keeps none .* open the store with "
                       r"update='explicit' \(the default\)"):  # fmt: skip
      store.read_grads()
    with pytest.raises(errors.InvalidOptionError, match=r"source\(last=True\) ends a gradient "
                       r"accumulation: pass source\(accumulate=True, last=True\)"):  # fmt: skip
      store.source(last=True)


@pytest.mark.parametrize("update", [pytest.param("explicit", marks=pytest.mark.slow), "backward"])
def test_accumulated_micro_steps_then_the_last_updates(tmp_path, update):
  """Two steps of two micro-steps: the same loop in both modes, bit for bit with optax."""
  tx, layers = optax.adam(1e-2), make_layers()
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, update=update,
                                progress=False) as store:  # fmt: skip
    moved = []
    for step in range(2):
      store.zero_grads()
      before = store.bytes_read + store.bytes_written
      grad(store.source(accumulate=True), batch(2 * step))
      grad(store.source(accumulate=True, last=True), batch(2 * step + 1))
      assert store.update() == step + 1
      moved.append(store.bytes_read + store.bytes_written - before)
    params, state = layers, tx.init(layers)
    for step in range(2):
      g = jax.tree.map(jnp.add, grad(params, batch(2 * step)), grad(params, batch(2 * step + 1)))
      u, state = jax.jit(tx.update)(g, state, params)
      params = jax.jit(optax.apply_updates)(params, u)
    assert_bits(store.read_params(), params)
    assert_bits(store.read_state(), per_layer(state))
    layer_slots = L * sum(r["slot"] for r in store.records)
    # Each micro-step reads the params twice, and the sum on disk; the explicit mode's write
    # theirs, the update reads params and gradients, writes params (11 in all). The backward
    # mode's last micro-step writes no sum, its update reads neither (8).
    state_slots = L * sum(r["slot"] for r in store.state_records)
    want = 11 if update == "explicit" else 8
    assert moved == [want * layer_slots + 2 * state_slots] * 2
    if update == "backward":  # zero_grads() before update(): the step is committed first
      grad(store.source(accumulate=True, last=True), batch(4))
      with pytest.warns(errors.StepNotCommittedWarning, match="step 3's layers were updated"):
        store.zero_grads()
      assert store.step == 3


def test_zero_grads_waits_for_a_backward_pass_still_running(tmp_path):
  """A jitted backward pass may return before its callbacks run (CI's busy cores once made
  the test above flaky): `zero_grads()` waits for them, then commits the step whole."""
  # The batch comes out of a program still running, so the backward pass is queued behind it
  # and `grad` returns at once (JAX's CPU client runs a program inline when its inputs are ready).
  late = jax.jit(lambda b, x: (b, x @ x @ x))
  tx, layers, x = optax.sgd(0.1), make_layers(jnp.float32), jnp.ones((1500, 1500))
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, update="backward",
                                progress=False) as store:  # fmt: skip
    for step in range(2):
      grad(store.source(), late(batch(step, jnp.float32), x)[0])
      with pytest.warns(errors.StepNotCommittedWarning, match=f"step {step + 1}'s layers were"):
        store.zero_grads()
      assert store.step == step + 1
    assert_bits(store.read_params(), reference(tx, make_layers(jnp.float32), 2, jnp.float32)[0])


def test_no_warning_when_each_step_is_committed(tmp_path):
  tx, layers = optax.sgd(0.1), make_layers(jnp.float32)
  with (
    warnings.catch_warnings(),
    offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx, update="backward",
                             progress=False) as store,
  ):  # fmt: skip
    warnings.simplefilter("error")
    for step in range(2):
      grad(store.source(), batch(step, jnp.float32))
      store.update()
    assert store.step == 2
    assert_bits(store.read_params(), reference(tx, layers, 2, jnp.float32)[0])


# The store's callbacks driven directly, as a jitted step calls them (fetch, put_grads): the
# hand-off's edges, without compiling a model.
TINY = {"w": jnp.full((4, 8, 8), 0.1, jnp.float32), "b": jnp.zeros((4, 8), jnp.float32)}
GRADS = [np.full((8,), 0.5, np.float32), np.ones((8, 8), np.float32)]  # leaves: b, w


def tiny(path, update="backward"):
  return offlax.LayerStore.create(str(path), TINY, optimizer=optax.adam(1e-2), update=update,
                                  progress=False)  # fmt: skip


def backward_pass(store, grads=GRADS):
  """Layer L-1 down to 0: each read (the rematerialised forward), then its gradient handed off."""
  for i in range(3, -1, -1):
    store.fetch(i)
    store.put_grads(micro.STEP, i, *grads)


def explicit_step(path):
  """The params after one step of the explicit mode from the same gradients."""
  with tiny(path, "explicit") as store:
    backward_pass(store)
    store.update()
    return store.read_params()


def busy_worker(monkeypatch):
  """The worker's read of layer 1's state takes 0.3 s: it is busy when Ctrl-C comes."""
  real, slow = slots_lib.Slots.read_slot, threading.Event()

  def read_slot(self, kind, gen, k, i):
    if kind == "state" and i == 1 and not slow.is_set():
      slow.set()
      time.sleep(0.3)
    return real(self, kind, gen, k, i)

  monkeypatch.setattr(slots_lib.Slots, "read_slot", read_slot)


def test_ctrl_c_in_update_leaves_no_worker_behind(tmp_path, monkeypatch):
  store = tiny(tmp_path / "s")
  busy_worker(monkeypatch)
  backward_pass(store)
  interrupted(store.update)
  assert store.step == 0
  # The step again (a notebook's next cell): its gradients go to its own worker, not the old one.
  again = threading.Thread(target=backward_pass, args=(store,), daemon=True)
  again.start()
  again.join(10)
  assert not again.is_alive(), "the backward pass after Ctrl-C hung"
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert store.update() == 1
  assert_bits(store.read_params(), explicit_step(tmp_path / "e"))
  store.close()


@pytest.mark.slow
def test_close_after_ctrl_c_in_update_drops_the_step_quietly(tmp_path, monkeypatch):
  """The KeyboardInterrupt said the step was not committed: close() adds no "update() was not
  called" warning, and the store holds the step before."""
  store = tiny(tmp_path / "s")
  busy_worker(monkeypatch)
  backward_pass(store)
  interrupted(store.update)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    store.close()
  with offlax.LayerStore.open(str(tmp_path / "s"), TINY, progress=False) as store:
    assert store.step == 0


def test_a_second_backward_pass_before_update_is_refused(tmp_path):
  store = tiny(tmp_path / "s")
  backward_pass(store)
  with pytest.raises(errors.IncompleteStepError, match=r"step 1's, all handed off and updated, "
                     r"were not committed: call update\(\) between backward passes"):  # fmt: skip
    store.put_grads(micro.STEP, 3, *GRADS)  # no read between: two gradients in one program
  assert store.step == 0
  assert store.update() == 1  # the step kept, committed against the params it was taken at
  assert_bits(store.read_params(), explicit_step(tmp_path / "e"))
  store.close()


REST = {"embed": np.arange(3, dtype=np.float32)}


def test_a_bad_or_failed_rest_keeps_the_step_for_a_retry(tmp_path, monkeypatch):
  store = tiny(tmp_path / "s")
  backward_pass(store)
  with pytest.raises(errors.LeafTypeError, match=r"rest leaf \['embed'\] must be an array"):
    store.update(rest={"embed": "not an array"})
  real = layer_rest.write

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(layer_rest, "write", full_disk)
  want = r"step 1 was not committed .*holds step 0, whole, and step 1's layers, updated: free "
  with pytest.raises(errors.StoreError, match=want + r"space .*call update\(\) again"):
    store.update(rest=REST)
  monkeypatch.setattr(layer_rest, "write", real)
  assert store.step == 0
  assert store.update(rest=REST) == 1  # the step kept: committed now
  assert_bits(store.read_rest(REST), REST)
  assert_bits(store.read_params(), explicit_step(tmp_path / "e"))
  store.close()


def test_rest_after_a_read_committed_the_step_goes_into_it(tmp_path):
  store = tiny(tmp_path / "s")
  backward_pass(store)
  want = r"without rest= \(a store.update\(rest=...\) before the next backward pass still writes"
  with pytest.warns(errors.StepNotCommittedWarning, match=want):
    store.fetch(0)  # a validation forward pass between the backward pass and update()
  assert store.step == 1
  assert store.update(rest=REST) == 1  # the rest written into step 1, not a new step
  assert store.last_update.step == 1
  assert_bits(store.read_rest(REST), REST)
  store.close()
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), TINY)
  with offlax.LayerStore.open(str(tmp_path / "s"), like, optimizer=optax.adam(1e-2)) as store:
    assert store.step == 1
    assert_bits(store.read_rest(REST), REST)
    assert_bits(store.read_params(), explicit_step(tmp_path / "e"))


def test_a_failed_worker_is_named_at_the_next_read(tmp_path, monkeypatch):
  store = tiny(tmp_path / "s")
  real = slots_lib.Slots.read_slot

  def read_slot(self, kind, gen, k, i):
    if kind == "state" and i == 1:
      raise errors.StoreError(errno.EIO, "Input/output error")
    return real(self, kind, gen, k, i)

  monkeypatch.setattr(slots_lib.Slots, "read_slot", read_slot)
  backward_pass(store)  # the hand-offs go on: the worker's failure is not the device's
  monkeypatch.setattr(slots_lib.Slots, "read_slot", real)
  with pytest.raises(errors.StoreError, match=r"step 1 was not committed: the update in the "
                     r"backward pass failed at layer 1, leaf \['b'\] \(Input/output error\); "
                     r"nothing of it was committed.*run the step again") as e:  # fmt: skip
    store.fetch(3)  # the next step's forward pass
  assert e.value.errno == errno.EIO
  assert store.step == 0
  backward_pass(store)  # the step again
  assert store.update() == 1
  assert_bits(store.read_params(), explicit_step(tmp_path / "e"))
  store.close()


def test_close_warns_of_a_step_cut_short_and_forgets_the_layers_kept(tmp_path):
  store = tiny(tmp_path / "s")
  for i in (3, 2):  # a backward pass stopped (an error in the step) after two layers
    store.fetch(i)
    store.put_grads(micro.STEP, i, *GRADS)
  read = weakref.ref(store.fetch(1)[0])  # kept for the update: the params of a layer read
  with pytest.warns(errors.StepNotCommittedWarning, match=r"step 1 was dropped, not committed: "
                    r"its backward pass had handed off 2 of the 4 layers' gradients when "
                    r"close\(\) came\. The store holds step 0"):  # fmt: skip
    store.close()
  gc.collect()
  assert read() is None  # not held in RAM after close()
  with tiny(tmp_path / "t") as store:
    read = weakref.ref(store.fetch(3)[0])
    store.drop_read_ahead()  # (a commit or a rewrite of the layers) forgets the layers kept
    gc.collect()
    assert read() is None


@pytest.mark.parametrize("update", ["explicit", "backward"])
def test_a_full_disk_at_the_manifest_leaves_memory_at_the_step_before(
  tmp_path, monkeypatch, update
):
  store = tiny(tmp_path / "s", update)
  backward_pass(store)
  real = layer_files.write_manifest

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(layer_files, "write_manifest", full_disk)
  with pytest.raises(OSError, match="No space left on device"):
    store.update()
  monkeypatch.setattr(layer_files, "write_manifest", real)
  assert (store.step, store.generation, store.kept) == (0, 0, [(0, 0)])  # as on disk
  assert store.update() == 1  # the step again (the explicit mode's gradients, or kept)
  backward_pass(store)
  assert store.update() == 2  # into the generation free on disk too
  store.close()
  with tiny(tmp_path / "e", "explicit") as want:
    for _ in range(2):
      backward_pass(want)
      want.update()
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), TINY)
    with offlax.LayerStore.open(str(tmp_path / "s"), like, optimizer=optax.adam(1e-2)) as store:
      assert store.step == 2
      assert_bits(store.read_params(), want.read_params())


def test_the_explicit_mode_compiles_one_step_for_every_micro_step(tmp_path):
  with tiny(tmp_path / "s", "explicit") as store:  # the jit cache key: the source's treedef
    kinds = {jax.tree.structure(store.source(accumulate=True, last=last)) for last in (0, 1)}
    assert len(kinds) == 1
  with tiny(tmp_path / "b") as store:  # the backward mode's last micro-step updates: its own
    kinds = {jax.tree.structure(store.source(accumulate=True, last=last)) for last in (0, 1)}
    assert len(kinds) == 2


def test_a_step_cut_short_says_which_layers_came(tmp_path):
  with tiny(tmp_path / "s") as store:
    for i in (3, 2):
      store.fetch(i)
      store.put_grads(micro.STEP, i, *GRADS)
    want = r"since step 0 handed off the gradients of layers 3 down to 2 only \(2 of 4; layer 1's"
    with pytest.raises(errors.IncompleteStepError, match=want + " was due next"):
      store.update()
    with pytest.raises(errors.IncompleteStepError, match=r"layer 2's gradient reached the host "
                       r"outside a step .* Run the step's backward pass whole"):  # fmt: skip
      store.put_grads(micro.STEP, 2, *GRADS)
    backward_pass(store)
    assert store.update() == 1
    # What the update read from disk: the state only (the params kept, the gradients handed).
    state = sum(np.prod(r["shape"]) * np.dtype(r["dtype"]).itemsize for r in store.state_records)
    assert store.last_update.bytes_read == 4 * state


@pytest.mark.slow
def test_accumulation_with_a_scalar_leaf_per_layer(tmp_path):
  """A per-layer scalar (a gate, stacked as (L,)): ending an accumulation, the backward mode
  adds the sum on disk to its 0-d gradient as the explicit mode does, to the bit."""
  layers = {"a": jnp.full((3,), 0.5), "w": jnp.eye(8)[None].repeat(3, 0) * 0.3}

  def loss(layers, x):
    body = lambda h, p: (jnp.tanh(p["a"] * (h @ p["w"])), None)
    return jnp.mean(offlax.scan_layers(body, x, layers)[0] ** 2)

  grads, params = jax.jit(jax.grad(loss)), []
  for update in ("explicit", "backward"):
    with offlax.LayerStore.create(str(tmp_path / update), layers, optimizer=optax.adam(1e-2),
                                  update=update, progress=False) as store:  # fmt: skip
      store.zero_grads()
      for m in range(2):
        grads(store.source(accumulate=True, last=m == 1), jnp.ones((2, 8)) * (m + 1))
      assert store.update() == 1
      params.append(store.read_params())
  assert_bits(params[1], params[0])
