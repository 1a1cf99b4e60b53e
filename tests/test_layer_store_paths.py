"""Which list of a model a `LayerStore` holds, and the mistakes a store refuses or warns about.

A model with two lists of the same shapes (an encoder and a decoder): a store
records the list it was made from (`stack_layers(model, path)`, or
``LayerStore.create(layers_path=)``) and `offload_params(model, store=)`
attaches it there; one that records nothing and matches both is refused. The
reference trains the same model with its params in host memory, as
`tests/test_layer_store_nnx.py` does (each layer rematerialised alike).
"""

import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_layer_store_nnx import train_step

import offlax
from offlax._src import errors

D, L = 4, 2


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(x))


class EncoderDecoder(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(3, D, rngs=rngs)
    self.encoder = nnx.List([Block(rngs) for _ in range(L)])
    self.decoder = nnx.List([Block(rngs) for _ in range(L)])

  def __call__(self, x):
    x = self.embed(x)
    for layer in [*self.encoder, *self.decoder]:
      x = layer(x)
    return jnp.mean(x**2)


class OneList(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List([Block(rngs) for _ in range(L)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return jnp.sum(x)


def batch(step):
  return jax.random.normal(jax.random.key(step), (2, 3))


def tx():
  return optax.adam(1e-2)


grad = nnx.jit(nnx.value_and_grad(lambda model, x: model(x)))


def reference(steps, name):
  """Losses and the stacked layers of `name` after `steps` steps, the params in host memory."""
  losses, model = _reference_run(steps)
  return losses, offlax.stack_layers(model, name)


@functools.cache  # the same training for either list: run (and compiled) once per process
def _reference_run(steps):
  model = offlax.offload_params(EncoderDecoder(nnx.Rngs(0)))
  params = jax.device_get(nnx.state(model, nnx.Param))
  opt, state = tx(), tx().init(params)
  update = jax.jit(
    lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*opt.update(g, s, p))
  )
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  losses = []
  for step in range(steps):
    loss, grads = grad(model, batch(step))
    params, state = update(jax.device_get(grads), state, params)
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, host), params))
    losses.append(float(loss))
  return losses, offlax.onload_params(model)


def is_stored(layers):
  return all(isinstance(layer.lin.kernel, offlax.extend.StoredParam) for layer in layers)


@pytest.mark.parametrize("name", ["encoder", "decoder"])
def test_store_attaches_to_the_list_it_was_made_from(tmp_path, name):
  want_losses, want = reference(2, name)
  model = EncoderDecoder(nnx.Rngs(0))
  layers = offlax.stack_layers(model, name)
  with offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=tx(), progress=False) as s:
    assert s.layers_path == name
    with open(tmp_path / "s" / "layers.json") as f:
      assert json.load(f)["layers_path"] == name
    offlax.offload_params(model, store=s)
    other = "decoder" if name == "encoder" else "encoder"
    assert is_stored(getattr(model, name)) and not is_stored(getattr(model, other))
    optimizer = nnx.Optimizer(model, offlax.offload(tx(), compute="host"), wrt=nnx.Param)

    losses = []
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      for i in range(2):
        losses.append(float(train_step(model, optimizer, batch(i))))
        s.update()
    assert losses == want_losses
    assert not [w for w in seen if w.category is offlax.errors.GradientsOverwrittenWarning]
    for a, b in zip(jax.tree.leaves(s.read_params()), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, np.asarray(b))


def test_a_store_that_does_not_say_is_refused_where_two_lists_match(tmp_path):
  model = EncoderDecoder(nnx.Rngs(0))
  with offlax.LayerStore.create(
    str(tmp_path / "s"), offlax.stack_layers(model.decoder), progress=False
  ) as s:
    assert s.layers_path is None  # a bare list: unknown
    with pytest.raises(
      errors.InvalidOptionError,
      match=r"matches 2 lists of layers of the model, model.decoder, model.encoder, and does "
      r"not record which it was made from. Pick one with layers= \('decoder' or 'encoder'\), "
      r"e.g. .* layers='decoder'\).*stack_layers\(model, 'decoder'\), which records it",
    ):
      offlax.offload_params(model, store=s)
    assert type(model.encoder[0]) is Block and type(model.decoder[0]) is Block  # nothing changed
    offlax.offload_params(model, store=s, layers="decoder")  # the argument picks one
    assert is_stored(model.decoder) and not is_stored(model.encoder)
  # One list that matches needs no path.
  one = OneList(nnx.Rngs(0))
  with offlax.LayerStore.create(
    str(tmp_path / "t"), offlax.stack_layers(one.layers), progress=False
  ) as s:
    offlax.offload_params(one, store=s)
    assert is_stored(one.layers)


def test_a_recorded_path_that_is_missing_or_does_not_match_is_refused(tmp_path):
  model = EncoderDecoder(nnx.Rngs(0))
  path = str(tmp_path / "s")
  offlax.LayerStore.create(path, offlax.stack_layers(model, "encoder"), progress=False).close()
  like = offlax.stack_layers(model.encoder)
  with offlax.LayerStore.open(path, like) as s:
    assert s.layers_path == "encoder"
    one = OneList(nnx.Rngs(0))  # its layers match, but it has no encoder
    with pytest.raises(
      errors.StoreMismatchError,
      match=r"the store \(.*layers.json\) names model.encoder, which is not a list of layers of "
      r"the model; its lists of layers: 'layers'. Pass layers=",
    ):
      offlax.offload_params(one, store=s)
    offlax.offload_params(one, store=s, layers="layers")  # the argument overrides it
    assert is_stored(one.layers)
  # A recorded list whose layers differ from the store's.
  wide = EncoderDecoder(nnx.Rngs(0))
  wide.decoder.append(Block(nnx.Rngs(1)))
  with offlax.LayerStore.open(path, like) as s:
    with pytest.raises(
      errors.StoreMismatchError, match=r"layers= names model.decoder, whose layers do not match "
      r"the store at .*: model.decoder has 3 layers, the store 2",
    ):  # fmt: skip
      offlax.offload_params(wide, store=s, layers="decoder")
    assert type(wide.decoder[0]) is Block
  # `open` checks the list `like` was stacked from; a manifest without the field adopts it.
  with pytest.raises(errors.StoreMismatchError, match="holds the layers of model.encoder, and"):
    offlax.LayerStore.open(path, offlax.stack_layers(model, "decoder"))
  with open(os.path.join(path, "layers.json")) as f:
    manifest = json.load(f)
  del manifest["layers_path"]  # as an older offlax wrote it
  with open(os.path.join(path, "layers.json"), "w") as f:
    json.dump(manifest, f)
  with offlax.LayerStore.open(path, like) as s:
    assert s.layers_path is None
  with offlax.LayerStore.open(path, offlax.stack_layers(model, "decoder")) as s:
    assert s.layers_path == "decoder"


def test_bad_paths(tmp_path):
  model = EncoderDecoder(nnx.Rngs(0))
  with pytest.raises(
    errors.InvalidOptionError,
    match=r"model.middle is not a list of layers of the EncoderDecoder; its lists of layers: "
    r"'decoder', 'encoder'",
  ):
    offlax.stack_layers(model, "middle")
  with pytest.raises(errors.InvalidOptionError, match=r"'encoder\.\.x' is not the path"):
    offlax.stack_layers(model, "encoder..x")
  with pytest.raises(errors.InvalidOptionError, match=r"stack_layers\(model, 'layers'\)"):
    offlax.stack_layers(model)  # the model, not a list
  with pytest.raises(errors.InvalidOptionError, match="layers_path='decoder', but the layers"):
    offlax.LayerStore.create(
      str(tmp_path / "s"), offlax.stack_layers(model, "encoder"), layers_path="decoder"
    )
  with pytest.raises(errors.InvalidOptionError, match="pass store="):
    offlax.offload_params(model, layers="encoder")
  assert not os.path.exists(tmp_path / "s")
  with offlax.LayerStore.create(
    str(tmp_path / "s"), offlax.stack_layers(model.encoder), layers_path="decoder", progress=False
  ) as s:
    assert s.layers_path == "decoder"
    offlax.offload_params(model, store=s)
    assert is_stored(model.decoder)


# -- the errors that name the fix (issue 41, point 5) ------------------------------------------


def test_an_offloaded_optimizer_is_refused_with_the_unwrapped_one_named(tmp_path):
  layers = offlax.stack_layers(OneList(nnx.Rngs(0)).layers)
  for optimizer in [
    offlax.offload(optax.adam(1e-2)),
    offlax.offload(optax.adamw(1e-2), compute="host"),
    optax.chain(optax.scale(1.0), offlax.offload(optax.adam(1e-2))),
  ]:
    with pytest.raises(
      errors.TransformationTypeError,
      match=r"optimizer= is \(or holds\) an offlax.offload\(...\) transformation.*unwrapped, "
      r"e.g. optimizer=optax.adamw\(1e-3\)",
    ):
      offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=optimizer)
    assert not os.path.exists(tmp_path / "s")  # nothing written
  offlax.LayerStore.create(str(tmp_path / "s"), layers, optimizer=optax.adam(1e-2)).close()
  with pytest.raises(errors.TransformationTypeError, match="LayerStore.open: optimizer="):
    offlax.LayerStore.open(str(tmp_path / "s"), layers, optimizer=offlax.offload(optax.adam(1e-2)))


def test_stack_layers_after_offload_params_names_the_order(tmp_path):
  model = OneList(nnx.Rngs(0))
  offlax.offload_params(model)
  with pytest.raises(
    errors.InvalidOptionError,
    match=r"layer 0's params are in host memory \(offload_params moved them\): stack the layers "
    r"before offload_params.*or call offlax.onload_params\(model\) first",
  ):
    offlax.stack_layers(model.layers)
  offlax.onload_params(model)
  with offlax.LayerStore.create(
    str(tmp_path / "s"), offlax.stack_layers(model, "layers"), progress=False
  ) as s:
    offlax.offload_params(model, store=s)
    with pytest.raises(
      errors.InvalidOptionError, match=r"layer 0 was given to offload_params\(model, store=\).*"
      r"store.read_params\(\) gives them stacked",
    ):  # fmt: skip
      offlax.stack_layers(model, "layers")
    assert jax.tree.leaves(offlax.stack_layers(offlax.onload_params(model), "layers"))


def test_create_on_an_existing_store_points_to_open(tmp_path):
  layers, path = offlax.stack_layers(OneList(nnx.Rngs(0)).layers), str(tmp_path / "s")
  with offlax.LayerStore.create(path, layers, optimizer=optax.sgd(0.1), progress=False) as s:
    s.update()
  with pytest.raises(
    errors.StoreExistsError, match=r"already holds a layer store .*LayerStore.open\('.*', like"
  ) as e:
    offlax.LayerStore.create(path, layers, optimizer=optax.sgd(0.1))
  assert isinstance(e.value, FileExistsError)
  with offlax.LayerStore.open(path, layers, optimizer=optax.sgd(0.1)) as s:
    assert s.step == 1  # the store is as it was
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("x")
  with pytest.raises(errors.NotAStoreError, match="not empty"):
    offlax.LayerStore.create(str(tmp_path / "other"), layers)


@jax.jit
@jax.grad
def _scan_loss_grad(source, x):
  body = lambda h, p: (jnp.tanh(h @ p["w"]), None)
  return jnp.sum(offlax.scan_layers(body, x, source)[0])


def _scan_grads(store, x, accumulate=False):
  _scan_loss_grad(store.source(accumulate=accumulate), x)
  store.flush_grads()


def test_a_forgotten_update_warns(tmp_path):
  layers = {"w": jnp.full((L, 3, 3), 0.1)}
  x = jnp.ones((2, 3))
  with offlax.LayerStore.create(
    str(tmp_path / "s"), layers, optimizer=optax.sgd(0.1), progress=False
  ) as store:
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      for _ in range(2):  # each step used by an update: no warning
        _scan_grads(store, x)
        store.update()
      store.zero_grads()
      for _ in range(2):  # accumulating microbatches: no warning
        _scan_grads(store, x, accumulate=True)
      store.update()
    assert not [w for w in seen if w.category is offlax.errors.GradientsOverwrittenWarning]
    with pytest.warns(
      offlax.errors.GradientsOverwrittenWarning,
      match=r"overwrote layer 1's gradients before update\(\) used them; the store is still at "
      r"step 3. Call store.update\(\) after each step's backward pass",
    ) as seen:
      for _ in range(3):  # three steps, no update
        _scan_grads(store, x)
    assert store.step == 3
    assert len([w for w in seen if w.category is offlax.errors.GradientsOverwrittenWarning]) == 2
  # A store without an optimizer has no update to forget.
  with offlax.LayerStore.create(str(tmp_path / "p"), layers, progress=False) as store:
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      for _ in range(2):
        _scan_grads(store, x)
    assert not [w for w in seen if w.category is offlax.errors.GradientsOverwrittenWarning]


def test_a_forgotten_update_warns_for_an_nnx_model(tmp_path):
  model = OneList(nnx.Rngs(0))
  with offlax.LayerStore.create(
    str(tmp_path / "s"), offlax.stack_layers(model, "layers"), optimizer=optax.sgd(0.1),
    progress=False,
  ) as store:  # fmt: skip
    offlax.offload_params(model, store=store)
    step = nnx.jit(nnx.grad(lambda m, x: m(x)))
    with pytest.warns(offlax.errors.GradientsOverwrittenWarning, match="still at step 0"):
      for i in range(2):
        step(model, jnp.ones((2, D)) * i)
      store.flush_grads()
