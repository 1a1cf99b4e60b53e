"""Tunix's `PeftTrainer`, unmodified, training models whose decoder layers are in a `LayerStore`.

``offload_params(model, store=store, commit_in_update=True)`` with a store made with
``update="backward"``: each layer is updated in the backward pass, and the trainer's
``optimizer.update(model, grads)`` commits the store's step (`nnx_store_commit`), so
nothing calls ``store.update()``. Three steps of Tunix's Llama3, Qwen3 and Gemma3 give the
losses and the final params of the same models with their params in host memory, bit for
bit; the trainer's own orbax checkpoints (the rest of the model) resume with the store
opened at their step, bit for bit as a run without the restart. With
``gradient_accumulation_steps`` (`optax.MultiSteps`) the store accumulates the layers'
mean on disk and updates at the k-th micro-step, bit for bit as in host memory; an
accumulation it cannot follow is refused when the optimizer is made.
"""

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_layer_store_nnx import Model, batch, train_step

import offlax
from offlax._src import errors, nnx_store_commit
from offlax._src.layer_store import micro, whole_norm

VOCAB = 64


def tx():
  return optax.adamw(1e-2, weight_decay=0.1)


def make_store(path, model, **kwargs):
  layers = offlax.stack_layers(model, "layers")
  return offlax.LayerStore.create(
    str(path), layers, optimizer=tx(), progress=False, update="backward", keep=2, **kwargs
  )


@pytest.mark.slow  # 15 s on the shared machine (compiles)
def test_optimizer_update_commits_the_store_once_a_step(tmp_path):
  """No `store.update()`: `nnx.Optimizer.update` commits, and the next step reads it."""
  like = offlax.stack_layers(Model(nnx.Rngs(0)), "layers")
  with make_store(tmp_path / "s", Model(nnx.Rngs(0))) as store:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=store, commit_in_update=True)
    optimizer = nnx.Optimizer(model, offlax.offload(tx(), compute="host"), wrt=nnx.Param)

    with warnings.catch_warnings():
      warnings.simplefilter("error", errors.StepNotCommittedWarning)
      for i in range(2):
        train_step(model, optimizer, batch(i))
        assert store.step == i + 1
    # The rest restored from another step than the store's:
    optimizer.step.set_value(jnp.full((), 5, optimizer.step[...].dtype))
    dropped = pytest.warns(errors.StepNotCommittedWarning, match="step 3 was dropped")
    with dropped, pytest.raises(Exception, match=r"holds step 2.*LayerStore.open\(.*step=5\)") as e:
      train_step(model, optimizer, batch(2))  # refused; the store closed, its step 3 dropped
    assert "StoreMismatchError" in str(e.value) or isinstance(e.value, errors.StoreMismatchError)
  with offlax.LayerStore.open(str(tmp_path / "s"), like, optimizer=tx()) as store:
    assert store.step == 2  # nothing committed


def test_the_norm_of_a_stored_models_gradients_says_it_lacks_the_layers(tmp_path):
  """`optax.global_norm(grads)` (Tunix's logged ``grad_norm``) of a model whose layers are in a
  store: their gradients went to the store and the tree holds zero tokens, so the norm is the
  rest's. It says so (`PartialNormWarning`, naming the whole-model clip), once, and the rest's
  norm is what it gives (it was silently a fifth of the host-params model's here)."""
  with make_store(tmp_path / "s", Model(nnx.Rngs(0))) as store:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=store, commit_in_update=True)
    optimizer = nnx.Optimizer(model, offlax.offload(tx(), compute="host"), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
      grads = nnx.grad(lambda m: m(x))(model)
      flat = jax.tree_util.tree_flatten_with_path(grads)[0]
      rest = [g for path, g in flat if not whole_norm.is_token(path)]
      optimizer.update(model, grads)
      return optax.global_norm(grads), optax.global_norm(rest), len(rest) < len(flat)

    with pytest.warns(errors.PartialNormWarning, match="offlax.LayerStore") as seen:
      norm, rest_norm, had_tokens = step(model, optimizer, batch(0))
  assert had_tokens and norm == rest_norm, (norm, rest_norm)
  assert "clip_by_global_norm(c, store=store)" in str(seen[0].message)
  assert sum(w.category is errors.PartialNormWarning for w in seen) == 1


def test_commit_in_update_needs_a_backward_store(tmp_path):
  layers = offlax.stack_layers(Model(nnx.Rngs(0)), "layers")
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx(), progress=False) as s:
    with pytest.raises(errors.InvalidOptionError, match="update='backward'"):
      offlax.offload_params(Model(nnx.Rngs(0)), store=s, commit_in_update=True)
  with pytest.raises(errors.InvalidOptionError, match="pass store="):
    offlax.offload_params(Model(nnx.Rngs(0)), commit_in_update=True)


ACCUMULATING = {
  "MultiSteps(offload)": lambda: optax.MultiSteps(offlax.offload(tx(), compute="host"), 2),
  "offload(MultiSteps)": lambda: offlax.offload(
    optax.MultiSteps(tx(), 2).gradient_transformation(), compute="host"
  ),
  "offload(apply_every)": lambda: offlax.offload(
    optax.chain(tx(), optax.apply_every(2)), compute="host"
  ),
}


# By default (about 0.6 s a case; Tunix's trainer, slow, below).
@pytest.mark.parametrize(
  "name, update", list(zip(ACCUMULATING, ["explicit", "backward", "backward"], strict=True))
)
def test_optimizers_that_accumulate_are_refused_for_stored_layers(tmp_path, name, update):
  """A store updates its layers at every step: an optimizer that holds the rest's update to
  the k-th micro-step is refused when it is made, however wrapped (before: offload(MultiSteps)
  committed the store at each micro-step while the rest accumulated, with no warning)."""
  layers = offlax.stack_layers(Model(nnx.Rngs(0)), "layers")
  path, commit = str(tmp_path / "s"), update == "backward"
  with offlax.LayerStore.create(path, layers, optimizer=tx(), progress=False, update=update) as s:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=s, commit_in_update=commit)
    nnx.Optimizer(model, offlax.offload(tx(), compute="host"), wrt=nnx.Param)  # no accumulation
    with pytest.raises(errors.InvalidOptionError, match=r"LayerStore at .*/s.*micro-steps.*"
                       r"gradient_accumulation_steps=None.*accumulate=True"):  # fmt: skip
      nnx.Optimizer(model, ACCUMULATING[name](), wrt=nnx.Param)
  nnx.Optimizer(offlax.offload_params(Model(nnx.Rngs(0))), ACCUMULATING[name](), wrt=nnx.Param)


def test_tunix_accumulation_of_bf16_layers_names_the_accumulator_dtype(tmp_path):
  """Tunix's ``gradient_accumulation_steps`` wraps the optimizer in optax's float32 accumulator,
  which a store of bf16 layers made without ``accumulator_dtype`` cannot follow (it accumulates
  in the layers' dtype on disk): the refusal names the store's option and the trainer's, and
  the trainer's trains."""
  bf16 = functools.partial(Model, dtype=jnp.bfloat16)
  with make_store(tmp_path / "s", bf16(nnx.Rngs(0))) as store:
    model = offlax.offload_params(bf16(nnx.Rngs(0)), store=store, commit_in_update=True)
    rest = lambda: offlax.offload(tx(), compute="host")  # noqa: E731
    with pytest.raises(
      errors.InvalidOptionError,
      match=r"accumulates in float32 and the store in \['bfloat16'\]: make the store with "
      r"LayerStore.create\(\.\.\., accumulator_dtype=jnp.float32\).*PeftTrainer "
      r"optax.MultiSteps\(tx, k, accumulator_dtype=jnp.bfloat16\).*"
      r"gradient_accumulation_steps=None",
    ):
      nnx.Optimizer(model, optax.MultiSteps(rest(), 2), wrt=nnx.Param)  # as Tunix wraps it
    named = optax.MultiSteps(rest(), 2, accumulator_dtype=jnp.bfloat16)
    optimizer = nnx.Optimizer(model, named, wrt=nnx.Param)
    for i in range(2):
      train_step(model, optimizer, batch(i))
    assert store.step == 1


def test_a_float32_accumulator_follows_multi_steps_on_bf16_layers(tmp_path):
  """A store made with ``accumulator_dtype=jnp.float32`` follows `optax.MultiSteps`' float32
  default (Tunix's ``gradient_accumulation_steps``) on bf16 layers: the losses and params of the
  same model in host memory, bit for bit."""
  k, bf16 = 2, functools.partial(Model, dtype=jnp.bfloat16)
  tx_k = lambda: optax.MultiSteps(offlax.offload(tx(), compute="host"), k)  # noqa: E731
  reference = offlax.offload_params(bf16(nnx.Rngs(0)))
  optimizer = nnx.Optimizer(reference, tx_k(), wrt=nnx.Param)
  want = [float(train_step(reference, optimizer, batch(i))) for i in range(2 * k)]
  with make_store(tmp_path / "s", bf16(nnx.Rngs(0)), accumulator_dtype=jnp.float32) as store:
    model = offlax.offload_params(bf16(nnx.Rngs(0)), store=store, commit_in_update=True)
    optimizer = nnx.Optimizer(model, tx_k(), wrt=nnx.Param)
    losses = [float(train_step(model, optimizer, batch(i))) for i in range(2 * k)]
    assert store.step == 2 and losses == want
    assert_bits(store.read_params(), offlax.stack_layers(offlax.onload_params(reference), "layers"))
  assert_bits(nnx.state(model.embed), nnx.state(reference.embed))  # the rest


def test_the_store_accumulates_as_optax_multi_steps():
  """`micro.combine` is `optax.MultiSteps`' running mean (and sum), bit for bit, from the first
  micro-step's zeros on; a plan that finds the optimizer at another micro-step refuses. (By
  default; the training runs, slow, below.)"""
  grads = [np.random.default_rng(i).standard_normal(64).astype(np.float32) for i in range(3)]
  for mean in (True, False):
    tx_k = optax.MultiSteps(optax.sgd(1.0), 3, use_grad_mean=mean)
    state = tx_k.init(jnp.zeros(64))
    acc = np.full(64, np.nan, np.float32)  # what is on disk before the first is not read
    for n, g in enumerate(grads):
      acc = micro.combine(micro.Micro(True, n == 2, n, mean), lambda: acc, g.copy())  # noqa: B023
      if n < 2:
        state = tx_k.update(jnp.asarray(g), state)[1]
    want = jax.jit(functools.partial(tx_k._acc_update, n_acc=2))(grads[2], state.acc_grads)
    np.testing.assert_array_equal(acc, np.asarray(want))
  plan = micro.Plan("s", 2, 0, True)
  assert plan.mode(True) == micro.Micro(True, False, 0, True) and not plan.advance(1, 2)
  assert plan.mode(True) == plan.mode(False) == micro.Micro(True, True, 1, True)
  assert plan.advance(0, 2)
  with pytest.raises(errors.StoreMismatchError, match="micro-step 0 of 2.*accumulated 1"):
    plan.advance(0, 2)
  plan.mode(True)  # a pass whose step failed after it: the next is refused
  with pytest.raises(errors.IncompleteStepError, match="micro-step 0 of 2 .*count twice"):
    plan.mode(True)


@pytest.mark.slow  # 12 s a case on the shared machine (two models' steps compiled)
@pytest.mark.parametrize("k", [2, 3])
def test_multi_steps_accumulates_the_stored_layers_bit_for_bit(tmp_path, k):
  """`optax.MultiSteps` around the optimizer and a store that commits in the update: the store
  accumulates optax's running mean on disk and updates at the k-th micro-step, committing
  then: the params and state of the same model in host memory, bit for bit."""
  tx_k = lambda: optax.MultiSteps(offlax.offload(tx(), compute="host"), k)
  reference = offlax.offload_params(Model(nnx.Rngs(0)))
  optimizer = nnx.Optimizer(reference, tx_k(), wrt=nnx.Param)
  want = [float(train_step(reference, optimizer, batch(i))) for i in range(2 * k)]
  with make_store(tmp_path / "s", Model(nnx.Rngs(0))) as store:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=store, commit_in_update=True)
    optimizer = nnx.Optimizer(model, tx_k(), wrt=nnx.Param)
    losses = []
    for i in range(2 * k):
      losses.append(float(train_step(model, optimizer, batch(i))))
      jax.block_until_ready(optimizer.step[...])
      assert store.step == (i + 1) // k
    assert losses == want
    assert_bits(store.read_params(), offlax.stack_layers(offlax.onload_params(reference), "layers"))
  assert_bits(nnx.state(model.embed), nnx.state(reference.embed))  # the rest


def test_the_update_refuses_gradient_accumulation(tmp_path, monkeypatch):
  """An optimizer that escaped the constructor's check: refused when the step is traced, before
  anything runs."""
  with make_store(tmp_path / "s", Model(nnx.Rngs(0))) as store:
    model = offlax.offload_params(Model(nnx.Rngs(0)), store=store, commit_in_update=True)
    tx_k = optax.MultiSteps(offlax.offload(tx(), compute="host"), 2)
    with monkeypatch.context() as m:  # the constructor's check off
      m.setattr(nnx_store_commit, "accumulation", lambda *_: None)
      optimizer = nnx.Optimizer(model, tx_k, wrt=nnx.Param)
    zeros = lambda model: jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    update = nnx.jit(lambda model, optimizer: optimizer.update(model, zeros(model)))
    with pytest.raises(errors.InvalidOptionError, match="update: .*without offlax's setup"):
      update(model, optimizer)
    assert store.step == 0


# Tunix's models and trainer (minutes: slow).


def _tunix():
  pytest.importorskip("tunix")
  import orbax.checkpoint as ocp
  import test_tunix_layer_store as models
  import tunix_inputs
  from tunix.sft import peft_trainer

  return ocp, models, tunix_inputs, peft_trainer


def train(model, steps, checkpoints=None, k=None):
  """Tunix's `PeftTrainer` as it is: `steps` steps (of `k` micro-steps); the losses it logged."""
  ocp, _, tunix_inputs, peft_trainer = _tunix()
  options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=2)
  config = peft_trainer.TrainingConfig(
    eval_every_n_steps=1000, max_steps=steps, checkpoint_root_directory=checkpoints,
    checkpointing_options=options, gradient_accumulation_steps=k,
  )  # fmt: skip
  trainer = peft_trainer.PeftTrainer(model, offlax.offload(tx(), compute="host"), config)
  trainer.with_gen_model_input_fn(tunix_inputs.model_input)
  with warnings.catch_warnings():
    warnings.simplefilter("error", errors.StepNotCommittedWarning)  # a step left uncommitted
    trainer.train(tunix_inputs.batches(steps * (k or 1), VOCAB))
  return [float(x) for x in trainer.metrics_logger.get_metric_history("", "loss", "train")]


def in_host_memory(family, steps, k=None):
  """The reference: the same model, its params in host memory; losses, layers and the rest."""
  _, models, _, _ = _tunix()
  model = offlax.offload_params(models.make_model(family))
  losses = train(model, steps, k=k)
  layers = offlax.stack_layers([offlax.onload_params(model)][0], "layers")
  return losses, layers, nnx.state(model, nnx.Param)


def assert_bits(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def rest(model):
  """The params outside the store (the tokens, zeros, left out)."""
  return rest_of(nnx.state(model, nnx.Param))


def rest_of(params):
  """The leaves of `params` outside the layers."""
  return [
    x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    if "layers" not in jax.tree_util.keystr(p)
  ]  # fmt: skip


@pytest.mark.slow  # Tunix's trainer: about a minute a model
@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3"])
def test_peft_trainer_trains_layers_in_a_store_as_in_host_memory(tmp_path, family):
  _, models, _, _ = _tunix()
  want_losses, want_layers, want_all = in_host_memory(family, 3)
  with make_store(tmp_path / "s", models.make_model(family)) as store:
    model = offlax.offload_params(models.make_model(family), store=store, commit_in_update=True)
    losses = train(model, 3)
    assert store.step == 3
    assert losses == want_losses
    assert_bits(store.read_params(), want_layers)
  assert_bits(rest(model), rest_of(want_all))


@pytest.mark.slow  # Tunix's trainer: about a minute (by default: the small model's, above)
def test_peft_trainer_accumulates_layers_in_a_store_as_in_host_memory(tmp_path):
  """``gradient_accumulation_steps=2`` (Tunix's `optax.MultiSteps`): the store accumulates its
  layers' mean on disk and updates them at the second micro-step, the rest as optax does:
  the losses and params of the same model in host memory, bit for bit."""
  _, models, _, _ = _tunix()
  want_losses, want_layers, want_all = in_host_memory("qwen3", 2, k=2)
  with make_store(tmp_path / "s", models.make_model("qwen3")) as store:
    model = offlax.offload_params(models.make_model("qwen3"), store=store, commit_in_update=True)
    losses = train(model, 2, k=2)
    assert store.step == 2
    assert losses == want_losses
    assert_bits(store.read_params(), want_layers)
  assert_bits(rest(model), rest_of(want_all))


@pytest.mark.slow  # Tunix's first trainer: 8 s (by default: the small model's refusals, above)
def test_peft_trainer_refuses_gradient_accumulation_with_an_explicit_store(tmp_path):
  """A store of update="explicit" cannot commit in the update: Tunix's `optax.MultiSteps` is
  refused when the trainer is made, nothing trained."""
  _, models, _, peft_trainer = _tunix()
  layers = offlax.stack_layers(models.make_model("qwen3"), "layers")
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx(), progress=False) as s:
    model = offlax.offload_params(models.make_model("qwen3"), store=s)
    config = peft_trainer.TrainingConfig(
      eval_every_n_steps=1000, max_steps=2, gradient_accumulation_steps=2
    )
    with pytest.raises(errors.InvalidOptionError, match="does not commit in the update"):
      peft_trainer.PeftTrainer(model, offlax.offload(tx(), compute="host"), config)
    assert s.step == 0


@pytest.mark.slow  # Tunix's trainer: about a minute
@pytest.mark.parametrize("k", [None, 2])  # gradient_accumulation_steps
def test_peft_trainer_checkpoints_resume_with_the_store_bit_for_bit(tmp_path, k):
  """Tunix's checkpoints hold the rest; the store, opened at their step, the layers."""
  ocp, models, _, _ = _tunix()
  want_losses, want_layers, _ = in_host_memory("llama3", 3, k=k)
  checkpoints, path = str(tmp_path / "checkpoints"), tmp_path / "s"
  with make_store(path, models.make_model("llama3")) as store:
    model = offlax.offload_params(models.make_model("llama3"), store=store, commit_in_update=True)
    first = train(model, 2, checkpoints, k=k)
  latest = ocp.CheckpointManager(checkpoints).latest_step()
  assert latest == 2 and sorted(os.listdir(checkpoints)) == ["1", "2"]
  like = offlax.stack_layers(models.make_model("llama3"), "layers")
  with offlax.LayerStore.open(
    str(path), like, optimizer=tx(), update="backward", step=latest, progress=False
  ) as store:
    model = offlax.offload_params(models.make_model("llama3"), store=store, commit_in_update=True)
    second = train(model, 3, checkpoints, k=k)  # restores step 2's rest, trains step 3
    assert store.step == 3
    assert first + second == want_losses
    assert_bits(store.read_params(), want_layers)
