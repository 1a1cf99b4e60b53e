"""NVMe-tier state through Flax NNX and orbax: refused whole, or saved with its store (issue 34).

`nnx.state(optimizer)` of an NVMe-tier optimizer keeps an `OnDiskVariable` for
each array in the store, so every orbax pytree save of it (`StandardSave`,
`PyTreeSave`, either inside a `Composite`, of `nnx.split`'s state) raises
`UnsavableStateError` naming `offlax.checkpoint.NVMeStoreSave`, rather than save the
state without its moments. A state restored beside a store that lacks its step
says so.
"""

import copy
import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import offlax

X = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)


def _tier(path, **kw):
  return offlax.NVMeTier(str(path), chunk_bytes=256, cache_bytes=0, progress=False, **kw)


def _optimizer(path, **kw):
  model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
  tier = _tier(path, **kw)
  return model, nnx.Optimizer(model, offlax.offload(optax.adam(1e-2), tier), wrt=nnx.Param), tier


@nnx.jit
def _step(model, optimizer):
  grads = nnx.grad(lambda m: jnp.mean(m(X) ** 2))(model)
  optimizer.update(model, grads)


def _on_disk(state):
  return [
    (path, v)
    for path, v in nnx.to_flat_state(state)
    if isinstance(nnx.as_pure(v), offlax.extend.OnDisk)
  ]


def test_nnx_state_keeps_each_array_on_disk_and_training_is_unchanged(tmp_path):
  model, optimizer, tier = _optimizer(tmp_path / "store")
  state = nnx.state(optimizer)
  # One variable per moment of each param (mu, nu of bias and kernel), where NNX
  # used to drop them (the issue's `tree_get(nnx.state(optimizer), "mu")` KeyError).
  on_disk = _on_disk(state)
  assert len(on_disk) == 4
  kernel = optax.tree_utils.tree_get(state, "mu")["kernel"]["on_disk"]
  assert nnx.as_pure(kernel) == optimizer.opt_state.inner_state[0].mu["kernel"]
  # JAX sees no leaf in them: jit and nnx.jit take the state as before.
  assert all(jax.tree.leaves(v) == [] for _, v in on_disk)
  # (tests/test_flax.py::test_nnx_optimizer[nvme] trains bit for bit with plain optax.)
  kernel_before = np.asarray(model.kernel[...])
  for _ in range(3):
    _step(model, optimizer)
  assert tier.store.step == 3 and int(optimizer.opt_state.step) == 3
  assert not np.array_equal(model.kernel[...], kernel_before)
  # split and merge give back the placeholders the update reads.
  graphdef, split_state = nnx.split(optimizer)
  merged = nnx.merge(graphdef, split_state)
  assert merged.opt_state.inner_state[0].nu["bias"] == optimizer.opt_state.inner_state[0].nu["bias"]
  tier.close()


def test_a_cached_partial_step_with_every_moment_on_disk_trains_as_plain_optax(tmp_path):
  """Tunix's train step is an `nnx.cached_partial` of (model, optimizer): NNX then asks
  that each step give back the graph it was given, variable for variable."""
  model, optimizer, tier = _optimizer(tmp_path / "store")
  plain_model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
  plain = nnx.Optimizer(plain_model, optax.adam(1e-2), wrt=nnx.Param)
  step = nnx.cached_partial(_step, model, optimizer)
  for _ in range(3):
    step()  # raised "The graph structure ... was mutated" at the second call
    _step(plain_model, plain)
  np.testing.assert_array_equal(model.kernel[...], plain_model.kernel[...])
  np.testing.assert_array_equal(model.bias[...], plain_model.bias[...])
  assert tier.store.step == 3 and len(_on_disk(nnx.state(optimizer))) == 4
  # A placeholder NNX has bound to its variable pickles and copies as its fields.
  placeholder = optimizer.opt_state.inner_state[0].mu["kernel"]
  assert copy.deepcopy(placeholder) == placeholder
  assert pickle.loads(pickle.dumps(placeholder)).__dict__ == dataclasses.asdict(placeholder)
  tier.close()


# The refused saves below create their directories synchronously. Orbax's default creates them in
# the background and its commit threads wait for that to finish; a save refused in between leaves
# those threads waiting out orbax's 300 s coordination timeout, which holds the test process at
# its exit (a script's interpreter, shutting its executors down, ends them at once).
_SYNC_DIRS = ocp.AsyncOptions(create_directories_asynchronously=False)
_MANAGER_OPTIONS = ocp.CheckpointManagerOptions(async_options=_SYNC_DIRS)


def _save_standard(path, model, optimizer):
  ckptr = ocp.StandardCheckpointer(async_options=_SYNC_DIRS)
  try:
    ckptr.save(path / "ckpt", nnx.state(optimizer))
    ckptr.wait_until_finished()
  finally:
    ckptr.close()


def _save_split(path, model, optimizer):
  ckptr = ocp.StandardCheckpointer(async_options=_SYNC_DIRS)
  try:
    ckptr.save(path / "ckpt", nnx.split(optimizer)[1])
    ckptr.wait_until_finished()
  finally:
    ckptr.close()


def _save_model_and_optimizer(path, model, optimizer):
  ckptr = ocp.StandardCheckpointer(async_options=_SYNC_DIRS)
  try:
    ckptr.save(path / "ckpt", nnx.state((model, optimizer)))
    ckptr.wait_until_finished()
  finally:
    ckptr.close()


def _save_pure(path, model, optimizer):
  ckptr = ocp.StandardCheckpointer(async_options=_SYNC_DIRS)
  try:
    ckptr.save(path / "ckpt", nnx.as_pure(nnx.state(optimizer)))
    ckptr.wait_until_finished()
  finally:
    ckptr.close()


def _save_pytree(path, model, optimizer):
  ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  try:
    ckptr.save(path / "ckpt", args=ocp.args.PyTreeSave(nnx.state(optimizer)))
  finally:
    ckptr.close()


def _save_composite(path, model, optimizer):
  # The call, verbatim but for the step.
  with ocp.CheckpointManager(path / "mngr", options=_MANAGER_OPTIONS) as mngr:
    try:
      mngr.save(
        30,
        args=ocp.args.Composite(
          model=ocp.args.StandardSave(nnx.state(model)),
          opt=ocp.args.StandardSave(nnx.state(optimizer)),
        ),
      )
      mngr.wait_until_finished()
    finally:
      assert mngr.all_steps() == []  # no step of the partial state left to restore


def _save_composite_pytree(path, model, optimizer):
  with ocp.CheckpointManager(path / "mngr", options=_MANAGER_OPTIONS) as mngr:
    state = nnx.state(optimizer)
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(), state)
    mngr.save(1, args=ocp.args.Composite(opt=ocp.args.PyTreeSave(state, save_args=save_args)))
    mngr.wait_until_finished()


def _save_tunix_style(path, model, optimizer):
  # What Tunix's CheckpointManager.save does: the state filtered to OptState, by PyTreeSave.
  with ocp.CheckpointManager(path / "mngr", options=_MANAGER_OPTIONS) as mngr:
    state = nnx.state(optimizer, nnx.optimizer.OptState)
    model_state = nnx.state(model)
    mngr.save(
      1,
      args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave(model_state),
        optimizer_state=ocp.args.PyTreeSave(state),
      ),
    )
    mngr.wait_until_finished()


SAVES = {
  "nnx.state+StandardSave": _save_standard,
  "nnx.split+StandardSave": _save_split,
  "nnx.state(model, optimizer)": _save_model_and_optimizer,
  "nnx.as_pure": _save_pure,
  "PyTreeSave": _save_pytree,
  "Composite+StandardSave": _save_composite,
  "Composite+PyTreeSave": _save_composite_pytree,
  "OptState filter (Tunix)": _save_tunix_style,
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """An NNX model and its NVMe-tier optimizer after a step (the saves below leave them as is)."""
  model, optimizer, tier = _optimizer(tmp_path_factory.mktemp("trained") / "store")
  _step(model, optimizer)
  yield model, optimizer
  tier.close()


@pytest.mark.parametrize("save", list(SAVES))
def test_every_orbax_save_of_nnx_nvme_state_is_refused_naming_nvme_store_save(
  tmp_path, trained, save
):
  with pytest.raises(
    offlax.errors.UnsavableStateError, match=r"offlax\.checkpoint\.NVMeStoreSave\(tier\)"
  ):
    SAVES[save](tmp_path, *trained)


def test_nnx_model_and_store_saved_with_nvme_store_save_resume_exactly(tmp_path):
  """The way the refusal names: the model and step by orbax, the optimizer as its store."""
  model, optimizer, tier = _optimizer(tmp_path / "store")
  for _ in range(2):
    _step(model, optimizer)
  with ocp.CheckpointManager(tmp_path / "mngr") as mngr:
    items = {"model": nnx.state(model), "step": optimizer.step[...]}
    mngr.save(
      2,
      args=ocp.args.Composite(
        model=ocp.args.StandardSave(items), opt=offlax.checkpoint.NVMeStoreSave(tier)
      ),
    )
    mngr.wait_until_finished()
    for _ in range(2):  # the run goes on past its checkpoint
      _step(model, optimizer)
    tier.close()
    fresh = nnx.Linear(4, 16, rngs=nnx.Rngs(1))
    target = {"model": nnx.state(fresh), "step": jnp.zeros((), jnp.uint32)}
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = mngr.restore(
      2,
      args=ocp.args.Composite(
        model=ocp.args.StandardRestore(target),
        opt=offlax.checkpoint.NVMeStoreRestore(str(tmp_path / "restored"), progress=False),
      ),
    )
  nnx.update(fresh, restored.model["model"])
  again_tier = _tier(tmp_path / "restored", resume=True)
  again = nnx.Optimizer(fresh, offlax.offload(optax.adam(1e-2), again_tier), wrt=nnx.Param)
  again.step[...] = restored.model["step"]
  assert int(again.opt_state.step) == 2
  for _ in range(2):
    _step(fresh, again)
  np.testing.assert_array_equal(fresh.kernel[...], model.kernel[...])
  again_tier.close()


def test_a_state_restored_beside_a_store_without_its_step_says_the_store_is_missing(tmp_path):
  """A checkpoint of the small leaves alone, restored beside a new store."""
  model, optimizer, tier = _optimizer(tmp_path / "store")
  for _ in range(3):
    _step(model, optimizer)
  # A filter that leaves the placeholders out on purpose: this save succeeds, and
  # the store at the tier's path holds the rest.
  small_leaves = nnx.All(nnx.optimizer.OptState, nnx.Not(nnx.PathContains("on_disk")))
  small = nnx.state(optimizer, small_leaves)
  assert _on_disk(small) == [] and _on_disk(nnx.state(optimizer, nnx.optimizer.OptState))
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "ckpt", small)
  ckptr.wait_until_finished()
  tier.close()
  # Restored into an optimizer on a new store: the store has no step 3.
  model, optimizer, tier = _optimizer(tmp_path / "new-store")
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(optimizer, small_leaves))
  nnx.update(optimizer, ckptr.restore(tmp_path / "ckpt", target))
  ckptr.close()
  with pytest.raises(Exception, match=r"StaleStateError") as raised:
    _step(model, optimizer)
  message = str(raised.value)
  assert "this state is from step 3" in message
  assert "(a new store) has committed only step 0" in message
  assert "the arrays of step 3 are not in this store" in message
  assert "offlax.checkpoint.NVMeStoreSave(tier)" in message
  assert "resume=True, step=" not in message  # the rollback advice does not apply
  tier.close()
