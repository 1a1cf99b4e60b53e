"""A `LayerStore`'s layers as `offlax.scan_layers` takes them: reads in, gradients out.

The scan runs over the layer index, and its body reads layer i by a
`jax.pure_callback` whose results (one layer's leaves) land in device memory.
The read is a `jax.custom_vjp`: its backward rule hands layer i's gradient to
the store by an unordered `io_callback` (the store writes it behind, or adds
it into what is there: a `micro.Micro` says which, see `backward`) and
returns, as the cotangent of the source's token (a zero per layer, the
source's only pytree leaf), the zero that callback returns: the hand-off is a
dependency of the gradient the caller gets, so no pass drops it, and the
gradients never form a model-sized buffer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from offlax._src import host_callbacks
from offlax._src.layer_store import micro


@jax.tree_util.register_pytree_node_class
class LayerSource:
  """A `LayerStore`'s layers, as `scan_layers` takes them (`LayerStore.source`).

  A pytree with one leaf, ``token`` (a zero per layer): differentiating with
  respect to it writes the layers' gradients into the store, and its own
  gradient is zeros that depend on those writes.
  """

  def __init__(self, token: Any, store: Any, mode: micro.Micro):
    self.token, self.store, self.mode = token, store, mode

  def tree_flatten(self):
    return (self.token,), (self.store, self.mode)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @property
  def n_layers(self) -> int:
    return self.store.n_layers

  def read(self, i: Any, token: Any) -> Any:
    """Layer `i` (traced) as a pytree on the device; its gradient goes to the store."""
    return _read(self.store, self.mode, i, token)


def _fetch_callback(store: Any, i, token):
  # The token is an operand so that the read waits for it: the caller orders each read by
  # passing the token through a barrier with the layer's inputs (`offload_params`'s unrolled
  # layers), and the forward read and the backward pass's read again are not one to XLA.
  return host_callbacks.call(
    lambda i, _: store.fetch(i), store.avals(), i, token, side_effect=False
  )


def _read(store: Any, mode: micro.Micro, i, token):
  @jax.custom_vjp
  def read(i, token):
    return _fetch_callback(store, i, token)

  def fwd(i, token):
    return _fetch_callback(store, i, token), i

  def bwd(i, grads):
    write = lambda i, *g: [store.put_grads(mode, i, *g)]
    [done] = host_callbacks.call(
      write, [jax.ShapeDtypeStruct((), jnp.float32)], i, *grads, side_effect=True
    )
    return None, done  # the token's cotangent: the hand-off's result, so it cannot be dropped

  read.defvjp(fwd, bwd)
  return jax.tree.unflatten(store.treedef, read(i, token))
