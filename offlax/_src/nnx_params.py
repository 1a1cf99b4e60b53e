"""`offload_params`: a Flax NNX model's params in host memory, fetched where each module uses them.

No edit of the model's code. `offload_params` moves the chosen params to
``pinned_host`` and gives every module that uses them (each element of a list
of layers, and each module that owns params directly) a subclass whose methods
run on a device copy of its params, fetched inside a rematerialised region
(`remat_call`). So a step holds one unit's params on the device at a time, in
the forward pass and again in the backward pass, and autodiff returns each
param's gradient in host memory.

Why a `jax.custom_vjp` and not `jax.checkpoint`: a rematerialised region's
recomputation depends only on its saved inputs, so XLA's scheduler may hoist
every layer's fetch to the start of the backward pass and hold the whole model
on the device. Here each fetch waits, through an optimisation barrier, for the
value that precedes it in the program's own order: the unit's inputs in the
forward pass, its output's cotangent in the backward pass.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from offlax._src import donation, errors, host_params, memory, nnx_hooks, nnx_tied
from offlax._src import nnx_paths as paths

# The attributes of an offloaded unit's class (and of its instances' graphdefs): which
# Variables it fetches, and whether its saved inputs go to host memory.
_WRT = "_offlax_wrt"
_OFFLOAD_ACTIVATIONS = "_offlax_offload_activations"
_BASE = "_offlax_base"
# A stored layer's class also has `nnx_layer_store.SOURCE`: the `LayerSource` its layers read.


def offload_params(
  model: Any,
  *,
  wrt: Any = None,
  memory_kind: str = "pinned_host",
  offload_activations: bool = False,
  store: Any = None,
  layers: str | None = None,
  commit_in_update: bool = False,
) -> Any:
  """`model` with its params in host memory, each fetched to the device where it is used.

  Every module that uses offloaded params runs its methods (``__call__``,
  ``encode``, ``decode``, ...) on a device copy of them, made inside a
  rematerialised region: the layers of a list (``list``, `nnx.List`,
  Tunix's ``ModuleList``) each as one unit, and any other module that owns
  params directly (an embedding, a final norm, a head). Stacked layers run by
  `nnx.scan` are fetched a layer at a time the same way (`offlax.scan_layers`
  compiles far faster for them). Under `nnx.grad` the gradients of
  offloaded params come back in host memory; train with
  ``nnx.Optimizer(model, offlax.offload(tx, compute="host"), wrt=...)``,
  whose ``update`` then runs offlax's fused host update. A param read by
  several methods in one call of the model (a tied embedding: ``__call__``
  embeds, ``attend`` is the head) has its uses' gradients added on the
  device, then copied to host memory once (`nnx_tied`): the first use's
  gradient waits on the device for the last, the param's size in the
  backward pass.

  With ``store``, an `offlax.LayerStore`, the model's list of layers keeps
  its params on disk instead (ZeRO-Infinity's params on NVMe): each layer's
  params become `StoredParam` placeholders, read from the store a layer ahead
  where the layer runs (and again in the backward pass); under `nnx.grad`
  each layer's gradient goes to the store, and ``store.update()`` applies
  the store's optimizer. The layer gains a `LayerToken`, an `nnx.Param`
  whose gradient is a zero. The other params go to host memory as above.

  Args:
    model: a Flax NNX module, with arrays or (under `nnx.eval_shape`)
      `jax.ShapeDtypeStruct`s; changed in place.
    wrt: an NNX filter of the Variables to offload (default: every
      `nnx.Param`). For LoRA, ``nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))``
      keeps the adapters on the device.
    memory_kind: ``"pinned_host"`` or ``"unpinned_host"``.
    offload_activations: keep each unit's saved inputs (for the backward
      pass) in host memory too, so device memory stays nearly flat in depth.
    store: an `offlax.LayerStore` holding the layers of one list of the
      model: the list it records (made with ``stack_layers(model, path)``),
      else the one whose layers match it, leaf for leaf; or its
      ``source(accumulate=True)`` to add the gradients into the store's.
    layers: with ``store``, the path of its list (``"decoder"`` for
      ``model.decoder``), where the store does not record it.
    commit_in_update: with ``store`` (made with ``update="backward"``),
      `nnx.Optimizer.update` of the model commits the store's step, checked
      against the optimizer's count (`nnx_store_commit`): a trainer that calls
      only ``optimizer.update(model, grads)`` (Tunix's `PeftTrainer`) drives the
      store, no ``store.update()`` to call; with ``optax.MultiSteps`` around the
      optimizer (``gradient_accumulation_steps``) the store accumulates alike.

  Returns:
    `model` itself.

  Raises:
    InvalidOptionError: `model` is already offloaded, or is not an NNX module;
      or ``store`` matches several lists and records none (pass ``layers=``).
    StoreMismatchError: no list of layers in `model` matches ``store``, or
      not the one it records or ``layers`` names.

  Example:
    >>> import jax, jax.numpy as jnp, offlax
    >>> from flax import nnx
    >>> model = offlax.offload_params(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> model.kernel[...].sharding.memory_kind
    'pinned_host'
    >>> grads = nnx.jit(nnx.grad(lambda m: m(jnp.ones((1, 2))).sum()))(model)
    >>> grads.kernel[...].sharding.memory_kind
    'pinned_host'
  """
  from flax import nnx

  from offlax._src import nnx_layer_store as stored_lib

  if not isinstance(model, nnx.Module):
    raise errors.InvalidOptionError(
      f"offload_params: expected a Flax NNX module, got {type(model).__name__}."
    )
  if memory_kind not in ("pinned_host", "unpinned_host"):
    raise errors.InvalidOptionError(
      f"offload_params: memory_kind must be 'pinned_host' or 'unpinned_host', got {memory_kind!r}."
    )
  # A list filter (NNX accepts one) as a tuple: the offloaded class is cached by its filter.
  wrt = nnx.Param if wrt is None else tuple(wrt) if isinstance(wrt, list) else wrt
  nodes = list(nnx.graph.iter_graph(model))
  offloaded = [p for p, n in nodes if isinstance(n, nnx.Module) and hasattr(type(n), _BASE)]
  if offloaded:
    raise errors.InvalidOptionError(
      f"offload_params: the model is already offloaded (its module at "
      f"{paths.name(offloaded[0])} fetches its params); call offlax.onload_params(model) first."
    )
  if (layers is not None or commit_in_update) and store is None:
    raise errors.InvalidOptionError(
      "offload_params: layers= and commit_in_update= are about the list of layers that "
      "store= holds; pass store= too."
    )
  if store is not None:
    _store_layers(model, store, wrt, offload_activations, layers, commit_in_update)
    wrt = nnx.All(wrt, nnx.Not(stored_lib.LayerToken))
    nodes = list(nnx.graph.iter_graph(model))
  units = _units(nodes, nnx.filterlib.to_predicate(wrt))
  for path in units:
    module = paths.at(model, path)
    cls: Any = type(module)
    object.__setattr__(module, "__class__", _offloaded_class(cls, wrt, offload_activations))
  if () not in units:  # the root names, in an error, the modules that fetch
    object.__setattr__(model, "__class__", _guarded_class(type(model)))
  state = nnx.state(model, wrt)
  nnx.update(model, jax.tree.map(functools.partial(_host_copy, kind=memory_kind), state))
  nnx_hooks.install()
  donation.install()  # a step that donates the params in host memory (Tunix's)
  return model


def onload_params(model: Any) -> Any:
  """The inverse of `offload_params`: `model`'s params on the device, its modules as they were.

  For inference and export, or to train on the device again.

  Args:
    model: a model given to `offload_params`; changed in place.

  Returns:
    `model` itself.

  Example:
    >>> import offlax
    >>> from flax import nnx
    >>> model = offlax.offload_params(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> type(offlax.onload_params(model)).__name__, model.kernel[...].sharding.memory_kind
    ('Linear', 'device')
  """
  from flax import nnx

  from offlax._src import nnx_layer_store as stored_lib

  wrt, stored = None, False
  for _, node in nnx.graph.iter_graph(model):
    source = stored_lib.layers_source(node)
    if source is not None:
      stored_lib.detach(node, source)
      stored = True
  for _, node in nnx.graph.iter_graph(model):
    base = getattr(type(node), _BASE, None)
    if isinstance(node, nnx.Module) and base is not None:
      wrt = getattr(type(node), _WRT) or wrt
      object.__setattr__(node, "__class__", base)
  if wrt is None and not stored:
    raise errors.InvalidOptionError("onload_params: the model was not given to offload_params.")
  if wrt is not None:
    nnx.update(model, jax.tree.map(_device_copy, nnx.state(model, wrt)))
  return model


def _store_layers(model: Any, store: Any, wrt: Any, offload_activations: bool, layers: Any,
                  commit: bool = False):  # fmt: skip
  """Puts the store's list of layers in `model` (at `layers`) on the store; returns its path."""
  from flax import nnx

  from offlax._src import nnx_layer_store as stored_lib
  from offlax._src import nnx_store_commit

  source = stored_lib.source_of(store)
  nnx_store_commit.check(source.store, commit)
  is_stored = nnx.filterlib.to_predicate(wrt)
  path = stored_lib.find_layers(model, source, is_stored, layers)
  layers = paths.at(model, path)
  stored_lib.attach(layers, is_stored)
  cls = type(layers[0])
  attributes = {
    _BASE: cls, _WRT: None, stored_lib.SOURCE: source, _OFFLOAD_ACTIVATIONS: offload_activations,
    nnx_store_commit.COMMIT: commit,
  }  # fmt: skip
  stored_class = _subclass(cls, _reading, attributes)
  for layer in layers:
    object.__setattr__(layer, "__class__", stored_class)
  return path


def _units(nodes: list[tuple[tuple[Any, ...], Any]], is_offloaded: Callable[..., bool]) -> list:
  """Paths of the modules that fetch: list elements holding params, and params' direct owners."""
  from flax import nnx

  modules = {p: n for p, n in nodes if isinstance(n, nnx.Module)}
  listed = {p: n for p, n in nodes if isinstance(n, (list, tuple, nnx.List, nnx.Sequential))}
  units: dict[tuple[Any, ...], None] = {}
  for path, node in nodes:
    if not (isinstance(node, nnx.Variable) and is_offloaded(path, node)):
      continue
    owner = max((p for p in modules if path[: len(p)] == p), key=len)
    units[owner] = None
    for p in modules:  # the layer of a list that holds it
      if p and p[:-1] in listed and path[: len(p)] == p:
        units[p] = None
  return sorted(units, key=len)


# The generated subclasses of each user's class, by what else defines them (the filter and
# options of a fetching class; none of a guarded root's). Never evicted: NNX registers every
# Module subclass with JAX's pytree registry for the life of the process, so a class made
# again for the same key would be a second registered class, not a freed one.
_CLASSES: weakref.WeakKeyDictionary[type, dict[Any, type]] = weakref.WeakKeyDictionary()


def _generated(cls: type, key: Any, make: Callable[[], type]) -> type:
  """The subclass of `cls` for `key`, made by `make` the first time."""
  made = _CLASSES.setdefault(cls, {})
  if key not in made:
    made[key] = make()
  return made[key]


def _offloaded_class(cls: Any, wrt: Any, offload_activations: bool) -> type:
  """`cls` with each method fetching the module's offloaded params (one class per options)."""
  attributes = {_BASE: cls, _WRT: wrt, _OFFLOAD_ACTIVATIONS: offload_activations}
  return _generated(
    cls, ("fetching", wrt, offload_activations), lambda: _subclass(cls, _fetching, attributes)
  )


def _subclass(cls: type, wrap: Callable[..., Any], attributes: dict[str, Any]) -> type:
  """`cls` with its methods (``__call__`` and its public ones, not NNX's) wrapped by `wrap`."""
  from flax import nnx

  namespace = {**attributes, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
  framework = set(dir(nnx.Module)) - {"__call__"}
  for name in dir(cls):
    if (name.startswith("_") and name != "__call__") or name in framework:
      continue
    attribute = _class_attribute(cls, name)
    if callable(attribute) and not isinstance(attribute, (staticmethod, classmethod, type)):
      namespace[name] = wrap(attribute)
  return type(cls.__name__, (cls,), namespace)


def _guarded_class(cls: Any) -> type:
  """`cls` whose methods turn JAX's error on a param used outside its unit into offlax's."""

  def guarded(method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
      try:
        with nnx_tied.sharing():  # a tied param's uses in the call share a carrier
          return method(self, *args, **kwargs)
      except ValueError as e:
        # The condition itself: an operation given operands in two memory spaces.
        if not memory.mixed_operands(e) or isinstance(e, errors.OffloadError):
          raise
        raise errors.MemoryKindError(
          f"offload_params: a param in host memory was used outside the methods of the module "
          f"that owns it. The modules that fetch their params are {', '.join(_units_of(self))}; "
          f"a param read by another module's code (e.g. `self.child.kernel[...]`) is not "
          f"fetched. Call the owning module's method instead, or keep that param on the device "
          f"with `wrt=`. ({str(e).splitlines()[0]})"
        ) from e

    return wrapped

  return _generated(cls, "guarded", lambda: _subclass(cls, guarded, {_BASE: cls, _WRT: None}))


def _units_of(model: Any) -> list[str]:
  """The names of the modules of `model` that fetch their params, and of its stored lists."""
  from flax import nnx

  from offlax._src import nnx_layer_store as stored_lib

  nodes = sorted(nnx.graph.iter_graph(model), key=lambda pn: len(pn[0]))
  fetching = [p for p, n in nodes if getattr(type(n), _WRT, None) is not None]
  stored = [p for p, n in nodes if stored_lib.layers_source(n) is not None]
  return [paths.name(p) for p in fetching] + [f"{paths.name(p)}[...]" for p in stored]


def _class_attribute(cls: type, name: str) -> Any:
  for klass in cls.__mro__:
    if name in vars(klass):
      return vars(klass)[name]
  return None


def _fetching(method: Callable[..., Any]) -> Callable[..., Any]:
  """`method` run by `remat_call` when its module holds params in host memory."""

  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    from flax import nnx

    cls = type(self)
    graphdef, params, rest = nnx.split(self, getattr(cls, _WRT), ...)
    if not memory.any_on_host(params):  # inside a unit that fetched them already
      return method(self, *args, **kwargs)
    with nnx_tied.sharing():  # a param's uses in this call: its gradient summed on the device
      out, rest = remat_call(
        method, graphdef, params, rest, args, kwargs,
        carry=nnx_tied.carrier if nnx_tied.wanted(params) else None,
        offload_activations=getattr(cls, _OFFLOAD_ACTIVATIONS), params_filter=getattr(cls, _WRT),
      )  # fmt: skip
    nnx.update(self, rest)
    return out

  return wrapped


def _reading(method: Callable[..., Any]) -> Callable[..., Any]:
  """`method` run by `remat_call` on its layer's params read from its `LayerStore`."""

  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    from flax import nnx

    from offlax._src import nnx_layer_store as stored_lib

    cls = type(self)
    graphdef, token, stored, rest = nnx.split(
      self, stored_lib.LayerToken, stored_lib.StoredParam, ...
    )
    source = getattr(cls, stored_lib.SOURCE)
    if not stored_lib.is_placeholder(stored, source.store.records):  # inside its own run: read
      return method(self, *args, **kwargs)
    i, treedef = getattr(self, stored_lib.INDEX), jax.tree.structure(stored)
    out, rest = remat_call(
      method, graphdef, token, rest, args, kwargs,
      offload_activations=getattr(cls, _OFFLOAD_ACTIVATIONS),
      params_filter=nnx.Any(stored_lib.LayerToken, stored_lib.StoredParam),
      states=lambda token: (token, stored_lib.read(source, i, token, treedef)), order_grads=True,
    )  # fmt: skip
    nnx.update(self, rest)
    return out

  return wrapped


def remat_call(
  method: Callable[..., Any],
  graphdef: Any,
  params: Any,
  rest: Any,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  *,
  offload_activations: bool,
  params_filter: Any,
  states: Callable[[Any], tuple[Any, ...]] = lambda params: (params,),
  order_grads: bool = False,
  carry: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any]:
  """``method(nnx.merge(graphdef, fetch(params), rest), *args, **kwargs)``, rematerialised.

  Returns its output and the module's state outside ``params_filter`` after
  the call (RNG counts, caches). The float arrays among params, state and
  arguments are the differentiable inputs; everything else (integer arrays,
  keys, Python values) is closed over. ``states`` makes, from the fetched
  params, the states merged before ``rest`` (a stored layer's: its token and
  its params read from the store). With ``order_grads`` the cotangents of
  the unit's inputs wait for those of its params: a stored layer's gradients
  leave for the store before the layer below starts its backward pass.
  With ``carry`` (`nnx_tied.carrier`), a fetched param's gradient goes, on the
  device, to the cotangent of its carrier, ``carry(param)``, not to the param's.
  """
  from flax import nnx

  leaves, treedef = jax.tree.flatten((params, rest, args, kwargs))
  n_params = len(jax.tree.leaves(params))
  diff = [_is_float(x) for x in leaves]
  inputs = [x for x, d in zip(leaves, diff, strict=True) if d]
  fixed = [x for x, d in zip(leaves, diff, strict=True) if not d]
  fetched = [i < n_params and memory.on_host(x) for i, x in enumerate(leaves)]
  fetched = [f for f, d in zip(fetched, diff, strict=True) if d]

  def run(inputs):
    it, fixed_it = iter(inputs), iter(fixed)
    tree = jax.tree.unflatten(treedef, [next(it) if d else next(fixed_it) for d in diff])
    params, rest, args, kwargs = tree
    module = nnx.merge(graphdef, *states(params), rest)
    out = method(module, *args, **kwargs)
    return out, nnx.state(module, nnx.Not(params_filter))

  # Traced once, here, where the caller's context holds (a framework's interception of
  # the module's ops, as qwix's LoRA does while the model's __call__ runs): the backward
  # pass replays this program, not the Python method, after that context has ended.
  devices = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
  traced, consts = jax.closure_convert(run, devices)

  def fetch(inputs):
    return [host_params.fetch(x) if f else x for x, f in zip(inputs, fetched, strict=True)]

  carried = None if carry is None else [carry(x) for x, f in zip(inputs, fetched, strict=True) if f]

  @jax.custom_vjp
  def call(inputs, carried, consts):
    return traced(fetch(inputs), *consts)

  def call_fwd(inputs, carried, consts):
    # The fetch waits for the unit's inputs: the previous layer's output.
    out = traced(fetch(jax.lax.optimization_barrier(inputs)), *consts)
    saved = [
      jax.device_put(x, jax.memory.Space.Host) if offload_activations and not f else x
      for x, f in zip(inputs, fetched, strict=True)
    ]
    return out, (saved, consts)

  def call_bwd(residuals, cotangent):
    # The fetch waits for this unit's output cotangent: the next layer's backward pass.
    (saved, consts), cotangent = jax.lax.optimization_barrier((residuals, cotangent))
    inputs = [
      jax.device_put(x, jax.memory.Space.Device) if offload_activations and not f else x
      for x, f in zip(saved, fetched, strict=True)
    ]
    if carried is None:
      _, vjp = jax.vjp(lambda i, c: traced(fetch(i), *c), inputs, consts)
    else:  # by the fetched copies: their gradients on the device
      _, vjp = jax.vjp(lambda i, c: traced(i, *c), fetch(inputs), consts)
    grads, const_grads = vjp(cotangent)
    if order_grads:  # the input's cotangent waits for the params' (a stored layer's hand-off)
      grads = jax.lax.optimization_barrier(grads)
    if carried is not None:  # the params' to their carriers (the copy to host is theirs)
      return (
        [None if f else g for g, f in zip(grads, fetched, strict=True)],
        [g for g, f in zip(grads, fetched, strict=True) if f],
        const_grads,
      )
    grads = [jax.device_put(g, jax.memory.Space.Host) if f else g
             for g, f in zip(grads, fetched, strict=True)]  # fmt: skip
    return grads, None, const_grads

  call.defvjp(call_fwd, call_bwd)
  return call(inputs, carried, consts)


def _is_float(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(x.dtype, jnp.inexact)


def _host_copy(x: Any, *, kind: str) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_host_sharding(x.sharding, kind))
  return host_params.placed_on_host(x, kind)


def _host_sharding(sharding: Any, kind: str) -> jax.sharding.Sharding:
  from offlax._src import sharding as sharding_lib

  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding.with_memory_kind(kind)
  device = next(iter(sharding.device_set)) if sharding is not None else jax.devices()[0]
  mesh = sharding_lib.one_device_mesh(device)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)


def _device_copy(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding.with_memory_kind("device") if x.sharding is not None else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if not memory.on_host(x):
    return x
  return jax.device_put(x, x.sharding.with_memory_kind("device"))
