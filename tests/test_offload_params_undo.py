"""What `offload_params` changes in the user's model, and `onload_params` puts back.

`offload_params` swaps the class of each module that fetches params for a generated
subclass of the same name, and a stored list's layers gain offlax attributes
(docs/patches.md, "On the user's objects"); `onload_params` undoes both. The generated
classes are cached by what defines them, with a bound, and JAX's error on a param used
outside its module is recognised by its operands' memory spaces, not its text.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from test_offload_params import MLP, D, ListModel

import offlax
from offlax._src import nnx_params


def _modules(model):
  return [
    (path, node) for path, node in nnx.graph.iter_graph(model) if isinstance(node, nnx.Module)
  ]


def _attributes(module):
  """`vars(module)` without param values: each Variable by its type and metadata."""

  def plain(v):
    if isinstance(v, nnx.Variable):
      return (type(v), tuple(sorted((k, repr(m)) for k, m in v.get_metadata().items())))
    if isinstance(v, nnx.Module | nnx.List):
      return type(v)
    return repr(v)

  return {k: plain(v) for k, v in vars(module).items()}


def _snapshot(model):
  return [(path, type(m), _attributes(m)) for path, m in _modules(model)]


@pytest.mark.parametrize("make", [ListModel, MLP], ids=["list", "mlp"])
def test_onload_params_puts_back_every_class_and_attribute(make):
  model = make(nnx.Rngs(0))
  before = _snapshot(model)
  offlax.offload_params(model)
  swapped = [
    path
    for (path, cls, _), (_, m) in zip(before, _modules(model), strict=True)
    if type(m) is not cls
  ]
  assert swapped, "offload_params swapped no class: the test checks nothing"
  assert all(
    type(m).__name__ == cls.__name__
    for (_, cls, _), (_, m) in zip(before, _modules(model), strict=True)
  )
  offlax.onload_params(model)
  assert _snapshot(model) == before


def test_onload_params_puts_back_a_stored_list(tmp_path):
  model = ListModel(nnx.Rngs(0))
  before = _snapshot(model)
  store = offlax.LayerStore.create(tmp_path / "s", offlax.stack_layers(model, "layers"))
  offlax.offload_params(model, store=store)
  layer = model.layers[0]
  added = set(vars(layer)) - set(dict(before)[("layers", 0)] if False else {})
  assert any(k.startswith("_offlax") for k in vars(layer)), sorted(vars(layer))
  offlax.onload_params(model)
  assert _snapshot(model) == before
  del added


def test_generated_classes_are_one_per_class_and_options():
  """The cache's key is what defines a class: a model's own shape makes no new class."""
  classes = set()
  for n in (1, 2, 3):  # root classes alike, lists of other lengths: the same classes
    model = offlax.offload_params(ListModel(nnx.Rngs(0), layers=n))
    classes |= {type(m) for _, m in _modules(model)}
  generated = {c for c in classes if c.__name__ == c.__mro__[1].__name__}
  # One each: the root, a block, its norm and linears, the embedding (the list is not swapped).
  assert sorted(c.__name__ for c in generated) == sorted(
    ["ListModel", "Block", "LayerNorm", "Linear", "Embed"]
  ), generated
  again = offlax.offload_params(MLP(nnx.Rngs(0)), offload_activations=True)
  plain = offlax.offload_params(MLP(nnx.Rngs(0)))
  assert type(again.a) is not type(plain.a) and type(again.a).__name__ == "Linear"
  assert type(again.a).__mro__[1] is nnx.Linear  # `Linear` twice in the MRO: docs/patches.md
  assert len(nnx_params._CLASSES[nnx.Linear]) >= 2


class Outside(nnx.Module):
  """Reads its child's param from its own method, which offlax does not wrap."""

  def __init__(self, rngs):
    self.a = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return x @ self.a.kernel[...]


class Raises(nnx.Module):
  """Raises an error of its own whose text names a memory space."""

  def __init__(self, rngs):
    self.a = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    raise ValueError("memory_space of all inputs: the model's own check failed")


@pytest.mark.parametrize("filtering", ["auto", "off"])
def test_a_param_used_outside_its_module_is_recognised_by_its_operands(filtering):
  previous = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", filtering)
  try:
    model = offlax.offload_params(Outside(nnx.Rngs(0)))
    with pytest.raises(offlax.errors.MemoryKindError, match=r"model\.a"):
      nnx.jit(lambda m: m(jnp.ones((1, D))))(model)
    model = offlax.offload_params(Raises(nnx.Rngs(0)))
    with pytest.raises(ValueError, match="the model's own check failed") as info:
      nnx.jit(lambda m: m(jnp.ones((1, D))))(model)
    assert not isinstance(info.value, offlax.errors.OffloadError)  # the model's error, as it was
  finally:
    jax.config.update("jax_traceback_filtering", previous)
