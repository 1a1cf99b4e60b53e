"""offlax used the way people use optax, orbax and notebooks (issue 18).

AOT lowering from specs of live state, optax's tree utilities, compile counts,
every optax alias with every tier, orbax saves of NVMe state, interrupts, and
reopening a store in the same process.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import offlax


def _params():
  return {"w": jnp.arange(12.0).reshape(4, 3) / 10, "b": jnp.zeros(3)}


def _grads(params, i=0):
  return jax.tree.map(lambda x: jnp.sin(x + i + 1.0), params)


HOST_TIERS = {
  "device": lambda: offlax.HostTier(chunk_bytes=32),
  "host": lambda: offlax.HostTier(compute="host"),
}


def _nvme(path, **kw):
  return offlax.NVMeTier(path, cache_bytes=0, chunk_bytes=32, progress=False, fsync=False, **kw)


def _specs(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _train(tx):
  def train(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return train


# -- 1. AOT lowering from specs of live state ----------------------------------


@pytest.mark.parametrize("mode", HOST_TIERS)
def test_specs_of_live_state_lower_and_export_on_one_device(mode):
  params = _params()
  tx = offlax.offload(optax.adam(1e-3), HOST_TIERS[mode]())
  state = tx.init(params)
  train = jax.jit(_train(tx))
  for _ in range(2):  # the state init returns, then the state a step returns
    specs = _specs((params, state, _grads(params)))
    train.lower(*specs).compile()
    jax.export.export(train, platforms=["cuda"])(*specs)
    params, state = train(params, state, _grads(params))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.inner_state[0].mu)}
  assert kinds == {"pinned_host"}


def test_specs_of_state_committed_like_single_device_params_lower_after_placed():
  """Params committed with a SingleDeviceSharding: the step returns state sharded so too."""
  params = jax.device_put(_params(), jax.devices()[0])
  tx = offlax.offload(optax.adam(1e-3))
  train = jax.jit(_train(tx))
  params, state = train(params, tx.init(params), _grads(params))
  specs = _specs((params, state, _grads(params)))
  with pytest.raises(offlax.errors.MemoryKindError, match=r"offlax\.placed"):
    train.lower(*specs)
  train.lower(*offlax.placed(specs)).compile()


def test_eval_shape_of_init_and_abstract_state_as_lowering_specs():
  params = _params()
  tx = offlax.offload(optax.adam(1e-3))
  shapes = jax.eval_shape(tx.init, params)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(
    lambda x: (x.shape, x.dtype), tx.init(params)
  )
  # eval_shape keeps no memory kinds (JAX); abstract_state does, and lowers.
  target = offlax.abstract_state(tx, params)
  jax.jit(_train(tx)).lower(params, target, params).compile()


# -- 2. abstract_state of a chain ---------------------------------------------------


def test_abstract_state_of_a_chain_holding_offload_restores_with_orbax(tmp_path):
  params = _params()
  tx = optax.chain(optax.clip_by_global_norm(1.0), offlax.offload(optax.adam(1e-3)))
  state = tx.init(params)
  _, state = jax.jit(tx.update)(_grads(params), state, params)
  target = offlax.abstract_state(tx, params)
  assert isinstance(target, tuple) and isinstance(target[1], offlax.OffloadState)
  # Asked again: `jax.eval_shape` had reused its trace of the chain's init, which
  # then recorded no offload, and the whole chain's state came back as one OffloadState.
  assert jax.tree.structure(offlax.abstract_state(tx, params)) == jax.tree.structure(target)
  assert jax.tree.structure(target) == jax.tree.structure(state)
  assert [x.sharding.memory_kind for x in jax.tree.leaves(target)] == [
    x.sharding.memory_kind for x in jax.tree.leaves(state)
  ]
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=ocp.args.StandardRestore(target))
  want, _ = jax.jit(tx.update)(_grads(params, 1), state, params)
  got, _ = jax.jit(tx.update)(_grads(params, 1), restored, params)
  np.testing.assert_array_equal(got["w"], want["w"])


def test_abstract_state_of_a_chain_refuses_another_tier():
  tx = optax.chain(optax.clip(1.0), offlax.offload(optax.sgd(0.1, 0.9)))
  with pytest.raises(offlax.errors.InvalidTierError, match="omit tier"):
    offlax.abstract_state(tx, _params(), offlax.HostTier(compute="host"))


# -- 3. optax's tree utilities -----------------------------------------------------


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_optax_tree_utilities_work_on_offloaded_state(tier, tmp_path):
  params = _params()
  made = _nvme(str(tmp_path)) if tier == "nvme" else HOST_TIERS[tier]()
  tx = offlax.offload(optax.adam(1e-3), made)
  plain = optax.adam(1e-3)
  state = tx.init(params)
  # map_params re-inits on a placeholder and maps it together with the state.
  mapped = optax.tree.map_params(tx, lambda x: x, state)
  assert jax.tree.structure(mapped) == jax.tree.structure(state)
  shardings = optax.tree.map_params(
    tx, lambda x: x.sharding, state, transform_non_params=lambda x: None
  )
  if tier != "nvme":
    assert shardings.inner_state[0].mu["w"].memory_kind == "pinned_host"
  assert optax.tree.get(mapped, "count") == 0
  set_ = optax.tree.set(state, count=jnp.int32(5))
  assert int(optax.tree.get(set_, "count")) == 5
  # The mapped state (its spec the placeholder's) still updates like plain optax.
  want, _ = plain.update(_grads(params), plain.init(params), params)
  got, _ = jax.jit(tx.update)(_grads(params), mapped, params)
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)
  if tier != "nvme":  # the arithmetic utilities, as docs/host_tier.md states them
    ref, inner = plain.init(params), state.inner_state
    for name in ("sum", "max"):
      f = getattr(optax.tree, name)
      assert float(f(inner)) == float(f(ref)) == float(jax.jit(f)(inner)), name
    doubled = optax.tree.scale(2.0, optax.tree.add(inner, inner))
    assert jax.tree.structure(doubled) == jax.tree.structure(ref)
    zeros = jax.jit(optax.tree.zeros_like)(state)  # eagerly, JAX 0.10 refuses host leaves
    assert jax.tree.structure(zeros) == jax.tree.structure(state)
    norm = jax.jit(lambda s: optax.tree.norm(offlax.fetch(s)))(inner)  # its leaves fetched
    assert float(norm) == float(optax.tree.norm(ref))
  if tier == "nvme":
    made.close()


# -- 4. one compilation ------------------------------------------------------------


def _compiles(tx, params, calls=3):
  counted = []

  def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      counted.append(event)

  state = tx.init(params)
  train = jax.jit(_train(tx))
  grads = [_grads(params, i) for i in range(calls)]  # (eager ops compile too)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for g in grads:
      params, state = train(params, state, g)
    jax.block_until_ready(params)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return len(counted)


def _committed(kind):
  device = jax.devices()[0]
  if kind == "single_device":
    return jax.device_put(_params(), device)
  mesh = jax.sharding.Mesh(np.array([device]), ("batch",))
  return jax.device_put(_params(), NamedSharding(mesh, P()))


@pytest.mark.parametrize("placement", ["single_device", "one_device_mesh"])
@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_jitted_step_compiles_once(tier, placement, tmp_path):
  made = _nvme(str(tmp_path)) if tier == "nvme" else HOST_TIERS[tier]()
  tx = offlax.offload(optax.adam(1e-3), made)
  assert _compiles(tx, _committed(placement)) == 1
  if tier == "nvme":
    made.close()


def test_uncommitted_params_cost_one_more_compile_only():
  """JAX commits what a program that moves memory returns: the params too (docs/host_tier.md)."""
  assert _compiles(offlax.offload(optax.adam(1e-3)), _params(), calls=4) == 2


# -- 5. every optax alias with every tier -----------------------------------------


def _loss(params):
  return sum(jnp.sum(x**2) for x in jax.tree.leaves(params))


def _alias(name):
  make = getattr(optax, name)
  if name == "polyak_sgd":
    return make()
  if name == "lbfgs":
    return make()
  if name == "noisy_sgd":
    return make(1e-2, key=jax.random.key(0))
  return make(1e-2)


def _extra(name, params):
  if name == "polyak_sgd":
    return {"value": _loss(params)}
  if name == "lbfgs":
    return {"value": _loss(params), "grad": jax.grad(_loss)(params), "value_fn": _loss}
  return {}


ALIASES = (
  "adabelief adadelta adafactor adagrad adam adamax adamaxw adamw adan amsgrad fromage lamb lars "
  "lbfgs lion noisy_sgd novograd optimistic_adam optimistic_adam_v2 optimistic_gradient_descent "
  "polyak_sgd radam rmsprop rprop sgd sign_sgd signum sm3 yogi"
).split()
# States of unusual shape: no arrays, a PRNG key, per-dimension lists, factored
# moments, a line search's extra arguments. The rest run with the slow tests.
UNUSUAL = ("sign_sgd", "fromage", "polyak_sgd", "noisy_sgd", "sm3", "adafactor", "lbfgs")


def test_the_alias_list_is_optaxs():
  from optax._src import alias

  public = {
    n
    for n in dir(alias)
    if not n.startswith("_") and getattr(getattr(alias, n), "__module__", "") == alias.__name__
  }
  assert public - {"Optimizer"} >= set(ALIASES) and set(ALIASES) >= {
    n for n in public if callable(getattr(optax, n, None)) and n != "Optimizer"
  }


@pytest.mark.slow_except(
  "nvme-sign_sgd", "nvme-polyak_sgd", "nvme-noisy_sgd", "nvme-sm3", "device-sm3", "host-noisy_sgd"
)
@pytest.mark.parametrize(
  "name", [n if n in UNUSUAL else pytest.param(n, marks=pytest.mark.slow) for n in ALIASES]
)
@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_every_optax_alias_works_with_every_tier(name, tier, tmp_path):
  params = _params()
  made = _nvme(str(tmp_path)) if tier == "nvme" else HOST_TIERS[tier]()
  plain, tx = _alias(name), offlax.offload(_alias(name), made)
  plain_state, state = plain.init(params), tx.init(params)
  static = {"value_fn": _loss} if name == "lbfgs" else {}  # _extra's, not traced
  step = jax.jit(lambda g, s, p, e: tx.update(g, s, p, **e, **static))  # one jit: compiled once
  for i in range(2):
    grads = jax.grad(_loss)(params)
    extra = _extra(name, params)
    want, plain_state = plain.update(grads, plain_state, params, **extra)
    extra.pop("value_fn", None)
    got, state = step(grads, state, params, extra)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=f"{name} step {i}")
    params = optax.apply_updates(params, want)
  if tier == "nvme":
    made.close()
    # The store reopens into the same state (a PRNG key is stored as its key data).
    again = _nvme(str(tmp_path), resume=True)
    resumed = offlax.offload(_alias(name), again).init(params)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(state), strict=True):
      if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
      np.testing.assert_array_equal(a, b)
    again.close()


# -- 13. messages --------------------------------------------------------------------


def test_nvme_tier_chunk_bytes_error_names_nvme_tier(tmp_path):
  with pytest.raises(offlax.errors.InvalidTierError, match=r"^NVMeTier\.chunk_bytes .* got 0"):
    offlax.NVMeTier(str(tmp_path), chunk_bytes=0)


def test_nested_offload_is_refused_clearly(tmp_path):
  with pytest.raises(offlax.errors.TransformationTypeError, match=r"offload\(offload"):
    offlax.offload(offlax.offload(optax.adam(1e-3)))
  nested = offlax.offload(optax.chain(optax.clip(1.0), offlax.offload(optax.adam(1e-3))))
  with pytest.raises(offlax.errors.TransformationTypeError, match="Offload once"):
    nested.init(_params())


def test_stats_finds_the_offload_state_inside_a_chain():
  tier = offlax.HostTier()
  tx = optax.chain(optax.clip(1.0), offlax.offload(optax.adam(1e-3), tier))
  state = tx.init(_params())
  assert offlax.stats(state, tier) == offlax.stats(state[1], tier)
  assert offlax.stats(state, tier).host_bytes == 2 * 15 * 4
  with pytest.raises(offlax.errors.TreeMismatchError, match="holding none"):
    offlax.stats(optax.adam(1e-3).init(_params()), tier)


# -- 6. orbax saves of NVMe-tier state --------------------------------------------


def test_standard_save_of_nvme_state_is_refused_naming_nvme_store_save(tmp_path):
  tier = _nvme(str(tmp_path / "store"))
  state = offlax.offload(optax.adam(1e-3), tier).init(_params())
  # Directories made synchronously: see test_nnx_checkpoint._SYNC_DIRS.
  checkpointer = ocp.StandardCheckpointer(
    async_options=ocp.AsyncOptions(create_directories_asynchronously=False)
  )
  with pytest.raises(
    offlax.errors.UnsavableStateError, match=r"offlax\.checkpoint\.NVMeStoreSave\(tier\)"
  ):
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
  checkpointer.close()
  tier.close()


# -- 7. interrupts and resuming at the params' step ------------------------------


def _nvme_run(path, steps, **kw):
  """An NVMe-tier Adam run of `steps` steps; returns (tier, tx, jitted step, params, state)."""
  tier = _nvme(path, **kw)
  tx = offlax.offload(optax.adam(1e-2), tier)
  params = _params()
  state = tx.init(params)
  train = jax.jit(_train(tx))
  for i in range(steps):
    params, state = train(params, state, _grads(params, i))
  return tier, tx, train, params, state


def test_ctrl_c_in_a_callback_surfaces_as_keyboard_interrupt_after_the_commit(
  tmp_path, monkeypatch, request
):
  import signal
  import threading

  from offlax._src.nvme import store as nvme_store

  tier, tx, train, params, state = _nvme_run(str(tmp_path), 1)
  read, calls, threads = nvme_store.Store.read, [], set()

  def interrupted_read(self, *args, **kwargs):
    calls.append(1)
    threads.add(threading.current_thread())
    if len(calls) == 1:  # Ctrl-C while the step reads its first slice
      calls.append(signal.getsignal(signal.SIGINT))  # which handler holds it, if it fails
      signal.raise_signal(signal.SIGINT)
    return read(self, *args, **kwargs)

  monkeypatch.setattr(nvme_store.Store, "read", interrupted_read)
  # Python's own Ctrl-C handler, as in a terminal: a process started in the background
  # by a shell (`cmd &`) inherits SIGINT ignored, and Python then leaves it ignored.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
  returned, after, interrupted = None, [], []
  try:
    returned = train(params, state, _grads(params, 1))
    # Held back until the call returned: raised at the next line, no time later.
    after.append(1)
    jax.block_until_ready(returned)
    jax.effects_barrier()
  except KeyboardInterrupt:
    interrupted.append(1)
  assert interrupted and after == [], (calls, threads)  # raised at once, before the next line
  assert threads == {threading.main_thread()}, threads  # the case this test is about
  # The step finished and returned its result: the store and it agree.
  assert returned is not None and int(returned[1].step) == 2
  assert tier.store.step == 2
  # A Ctrl-C in a callback of a step called in a loop: raised before the next step.
  calls.clear()
  params, state = returned
  done = 0
  try:
    for i in range(3):
      params, state = train(params, state, _grads(params, i))
      done += 1
  except KeyboardInterrupt:
    interrupted.append(2)
  assert interrupted == [1, 2] and done == 0, (calls, threads)
  assert int(state.step) == 3 and tier.store.step == 3
  # Beside a tracer (a debugger, coverage: sys.settrace is theirs), raised once the
  # call has returned.
  import sys
  import time

  calls.clear()
  returned = None
  sys.settrace(lambda frame, event, arg: None)
  try:
    returned = train(params, state, _grads(params, 3))
    deadline = time.monotonic() + 60  # a bound for a hang, not a wait for the interrupt
    while time.monotonic() < deadline:
      time.sleep(0.01)
  except KeyboardInterrupt:
    interrupted.append(3)
  finally:
    sys.settrace(None)
  assert interrupted == [1, 2, 3], (calls, threads)
  assert returned is not None and int(returned[1].step) == 4 and tier.store.step == 4
  tier.close()


def test_stale_state_error_says_how_to_recover_and_resume_goes_back_to_the_params_step(
  tmp_path,
):
  path = str(tmp_path)
  tier, tx, train, params, state = _nvme_run(path, 2)
  lost_params, lost_state = params, state
  params, state = train(params, state, _grads(params, 2))  # committed: step 3 ...
  # (raised in a callback of the step: JAX reports it as a JaxRuntimeError naming it)
  with pytest.raises(Exception, match=r"StaleStateError.*resume=True, step=.*keeps steps \[2, 3\]"):
    jax.block_until_ready(train(lost_params, lost_state, _grads(params, 2)))  # ... but lost
  tier.close()
  # Resuming at the params' step (2) rolls the store back to it, and continues exactly.
  tier = _nvme(path, resume=True, step=2)
  tx = offlax.offload(optax.adam(1e-2), tier)
  again = tx.init(lost_params)
  assert int(again.step) == 2
  redo, _ = jax.jit(_train(tx))(lost_params, again, _grads(lost_params, 2))
  np.testing.assert_array_equal(redo["w"], params["w"])
  tier.close()
  # A step the store no longer keeps is refused, naming the way out.
  with pytest.raises(
    offlax.errors.StoreMismatchError, match=r"params are at step 0.*NVMeStoreRestore"
  ):
    offlax.offload(optax.adam(1e-2), _nvme(path, resume=True, step=0)).init(lost_params)


# -- 9. reopening a store in the same process ------------------------------------


def test_reopening_an_open_store_in_this_process_names_it_and_its_holder(tmp_path):
  import gc
  import os

  path = str(tmp_path)
  tier, tx, train, params, state = _nvme_run(path, 1)
  del tier, tx, state
  gc.collect()  # a jitted step still holds the tier (a notebook cell run again)
  with pytest.raises(
    offlax.errors.StoreLockedError, match=rf"in this process \(PID {os.getpid()}\)"
  ) as e:
    offlax.offload(optax.adam(1e-2), _nvme(path, resume=True)).init(params)
  assert e.value.pid == os.getpid() and isinstance(e.value.holder, offlax.NVMeTier)
  e.value.holder.close()
  tier = _nvme(path, resume=True)
  assert int(offlax.offload(optax.adam(1e-2), tier).init(params).step) == 1
  tier.close()
  del train


def test_a_tier_deleted_without_close_releases_its_store(tmp_path):
  import gc

  path = str(tmp_path)
  tier = _nvme(path)
  state = offlax.offload(optax.adam(1e-2), tier).init(_params())
  del tier, state
  gc.collect()
  tier = _nvme(path, resume=True)
  assert int(offlax.offload(optax.adam(1e-2), tier).init(_params()).step) == 0
  tier.close()


def test_store_locked_by_another_process_names_its_pid(tmp_path):
  import subprocess
  import sys

  path = str(tmp_path)
  holder = subprocess.Popen(
    [sys.executable, "-c", f"import offlax, sys, time\n"
     f"from offlax._src.nvme.store import Store\n"
     f"s = Store({path!r}, fsync=False); s.lock(); print('locked', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True,
  )  # fmt: skip
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(
      offlax.errors.StoreLockedError, match=rf"another process \(PID {holder.pid}\)"
    ):
      offlax.offload(optax.adam(1e-2), _nvme(path)).init(_params())
  finally:
    holder.kill()
    holder.wait()


# -- 10. a resumed store honours cache_bytes -------------------------------------


def test_resume_honours_a_new_cache_bytes(tmp_path):
  path = str(tmp_path)
  tier, tx, train, params, state = _nvme_run(path, 1)
  tier.close()
  on_disk = lambda s: [
    x for x in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, offlax.extend.OnDisk))
    if isinstance(x, offlax.extend.OnDisk)
  ]  # fmt: skip
  assert len(on_disk(state)) == 4  # cache_bytes=0: the moments on disk
  tier = offlax.NVMeTier(path, resume=True, cache_bytes=10**6, progress=False, fsync=False)
  tx = offlax.offload(optax.adam(1e-2), tier)
  resumed = tx.init(params)
  assert on_disk(resumed) == []  # all of it in RAM now
  assert [r.hot for r in tier.store.records] == [True] * len(tier.store.records)
  params2, _ = jax.jit(_train(tx))(params, resumed, _grads(params, 1))
  plain = optax.adam(1e-2)
  want, plain_state = _params(), plain.init(_params())
  for i in range(2):
    want, plain_state = jax.jit(_train(plain))(want, plain_state, _grads(want, i))
  np.testing.assert_allclose(params2["w"], want["w"], rtol=1e-6)
  tier.close()


# -- 12. inspect on a directory above stores --------------------------------------


def test_inspect_a_directory_above_stores_skips_venvs_and_hidden_directories(tmp_path):
  import os
  import shutil
  import subprocess
  import sys

  tier = _nvme(str(tmp_path / "run" / "store"))
  offlax.offload(optax.adam(1e-3), tier).init(_params())
  tier.close()
  with ocp.CheckpointManager(tmp_path / "run" / "ckpt") as mngr:
    mngr.save(1, args=ocp.args.StandardSave({"p": jnp.ones(3)}))
    mngr.wait_until_finished()
  # Checkpoint-like fixtures of installed packages, in a hidden venv and a visible one.
  for venv in (".venv", "env"):
    site = tmp_path / venv / "lib" / "site-packages"
    site.mkdir(parents=True)
    (tmp_path / venv / "pyvenv.cfg").write_text("home = /usr\n")
    shutil.copytree(tmp_path / "run" / "ckpt" / "1", site / "orbax_fixture")
  out = subprocess.run(
    [sys.executable, "-m", "offlax", "inspect", str(tmp_path), "--no-progress"],
    capture_output=True, text=True, timeout=300,
    env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))},
  )  # fmt: skip
  assert out.returncode == 0, out.stdout + out.stderr
  reported = [line for line in out.stdout.splitlines() if " store /" in line]
  assert len(reported) == 2 and not any("site-packages" in line for line in reported)
  assert "Event loop is closed" not in out.stderr
