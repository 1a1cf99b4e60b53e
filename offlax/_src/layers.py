"""`scan_layers`: stacked layers run one at a time, their params fetched from host memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from offlax._src import errors, host_params
from offlax._src.layer_store.source import LayerSource

# The name `offload_activations` gives each layer's input carry, so that a
# checkpoint policy can move it (and nothing else) to host memory.
_LAYER_INPUT = "offlax_layer_input"


def scan_layers(
  f: Callable[[Any, Any], tuple[Any, Any]],
  init: Any,
  layers: Any,
  *,
  remat: bool | Callable[..., Any] = True,
  offload_activations: bool = False,
  reverse: bool = False,
  unroll: int = 1,
) -> tuple[Any, Any]:
  """`jax.lax.scan` over stacked layers whose params may live in host memory.

  ``layers`` is a pytree whose leaves stack the layers along their first axis
  (as `nnx.vmap`/`nnx.scan` or `flax.linen.scan` make them). Each step fetches
  one layer's leaves from host memory to the device (`offlax.fetch`), runs
  ``f(carry, layer)`` and drops them: the device holds one or two layers,
  never the model. Under `jax.grad` the gradients of host-memory leaves come
  back in host memory, a layer at a time.

  With ``remat`` (the default) each layer is rematerialised in the backward
  pass (`jax.checkpoint`): only its input carry is saved, and the layer's
  params are fetched again. Without it, the backward pass needs each layer's
  device copy of its params, which keeps the whole model on the device. With
  ``offload_activations`` the saved input carries go to host memory too, so
  device memory stays flat however many layers are added.

  Args:
    f: ``(carry, layer) -> (carry, y)``, as for `jax.lax.scan`; ``layer`` has
      the leaves of ``layers`` without their first axis, on the device.
    init: the initial carry (e.g. the hidden states after the embedding).
    layers: the stacked layer params (and any per-layer inputs), in host or
      device memory; or a `LayerSource` of layers on disk, read a layer at a
      time (and a layer ahead), their gradients written back to the store.
    remat: True (save nothing but the layer inputs), False (no
      rematerialisation), or a `jax.checkpoint_policies` policy.
    offload_activations: keep the saved layer inputs in ``pinned_host`` memory.
    reverse: run the layers last to first, as `jax.lax.scan` does.
    unroll: passed to `jax.lax.scan`; 2 lets XLA fetch the next layer while
      this one computes, for a second layer's params on the device.

  Returns:
    ``(carry, ys)`` as `jax.lax.scan` returns them.

  Example:
    >>> import jax, jax.numpy as jnp, offlax
    >>> host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    >>> w = jax.device_put(jnp.full((4, 3, 3), 0.5), host)  # 4 layers in host memory
    >>> def loss(w, x):
    ...   layer = lambda h, w: (jnp.tanh(h @ w), None)
    ...   return offlax.scan_layers(layer, x, w)[0].sum()
    >>> g = jax.jit(jax.grad(loss))(w, jnp.ones(3))
    >>> g.shape, g.sharding.memory_kind
    ((4, 3, 3), 'pinned_host')
  """
  if offload_activations and remat is False:
    raise errors.InvalidOptionError(
      "scan_layers(offload_activations=True) offloads what remat saves: it needs remat "
      "(True or a policy), not remat=False."
    )

  def body(carry, layer):
    if offload_activations:
      carry = jax.tree.map(lambda x: checkpoint_name(x, _LAYER_INPUT), carry)
    return f(carry, host_params.fetch(layer))

  xs = layers
  if isinstance(layers, LayerSource):
    source = layers
    # The scan runs over the layer index; the body reads its layer from disk.
    xs = (jnp.arange(source.n_layers, dtype=jnp.int32), source.token)
    body = _reading(f, source, offload_activations)
  if remat is not False:
    body = jax.checkpoint(body, policy=_policy(remat, offload_activations), prevent_cse=False)
  return jax.lax.scan(body, init, xs, reverse=reverse, unroll=unroll)


def _reading(f: Callable[[Any, Any], tuple[Any, Any]], source: LayerSource, offload: bool):
  """The scan body over a `LayerSource`: layer i read from disk, then `f`."""

  def body(carry, x):
    i, token = x
    if offload:
      carry = jax.tree.map(lambda c: checkpoint_name(c, _LAYER_INPUT), carry)
    return f(carry, source.read(i, token))

  return body


def _policy(remat: bool | Callable[..., Any], offload_activations: bool) -> Callable[..., Any]:
  """The checkpoint policy: the user's (or save nothing), the layer input offloaded."""
  base: Callable[..., Any] = (
    jax.checkpoint_policies.nothing_saveable if remat is True or remat is False else remat
  )
  if not offload_activations:
    return base
  offload = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=(),
    names_which_can_be_offloaded=(_LAYER_INPUT,),
    offload_src="device",
    offload_dst="pinned_host",
  )
  recompute = offload(None)  # what the offload policy answers for anything else

  def policy(prim, *args, **params):
    decision = offload(prim, *args, **params)
    return base(prim, *args, **params) if decision == recompute else decision

  return policy
