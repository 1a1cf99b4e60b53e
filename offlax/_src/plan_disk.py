"""The RAM and disk of params, gradients and state on disk: the planner's ``params_nvme`` mode.

An `offlax.LayerStore` holds the stacked layers' params, gradients and
optimizer state on disk; `params_on_disk_bytes` counts what that leaves in
RAM (a leaf of a layer at a time in the update, the params outside the
layers whole) and on disk, from the model's own leaves (`layer_leaves`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def layer_leaves(params: Any, layers: int) -> tuple[int, int]:
  """The largest leaf of one layer and the params outside the layers, in params.

  The leaves whose first axis is `layers` are the stacked layers (what an
  `offlax.LayerStore` holds); the others (embedding, head, final norm) are
  outside them. ``(0, 0)`` where no leaf is stacked: `params_on_disk_bytes`
  then takes a leaf as a third of a layer and every param as a layer's.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from offlax._src import plan_disk
    >>> s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    >>> params = {"layers": {"w1": s(4, 64, 256), "wq": s(4, 64, 64)}, "embed": s(1000, 64)}
    >>> plan_disk.layer_leaves(params, 4)  # w1 of one layer; the embedding
    (16384, 64000)
  """
  stacked, rest = [], 0
  for x in jax.tree.leaves(params):
    size = int(np.prod(np.shape(x)))
    if _stacked(x, layers):
      stacked.append(size // layers)
    else:
      rest += size
  return (max(stacked), rest) if stacked else (0, 0)


def largest_rest_leaf(params: Any, layers: int) -> int:
  """The largest leaf outside the stacked layers (`layer_leaves`), in params; 0 if none.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from offlax._src import plan_disk
    >>> s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    >>> params = {"layers": {"w": s(4, 64, 64)}, "embed": s(1000, 64), "norm": s(64)}
    >>> plan_disk.largest_rest_leaf(params, 4)  # the embedding
    64000
  """
  sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params) if not _stacked(x, layers)]
  return max(sizes, default=0)


def _stacked(x: Any, layers: int) -> bool:
  """Whether leaf `x` is the stacked layers' (its first axis is `layers`)."""
  shape = np.shape(x)
  return len(shape) >= 2 and shape[0] == layers


def params_on_disk_bytes(
  param_bytes: int,
  state: int,
  n_params: int,
  layers: int,
  *,
  leaf_params: int = 0,
  rest_params: int = 0,
  update_bytes: int | None = None,
  host_bytes: int | None = None,
  nvme_ram: int = 0,
  rest_leaf_params: int = 0,
  read_params: bool = True,
) -> dict:
  """RAM, disk and bytes per step of an `offlax.LayerStore` (mode ``params_nvme``).

  With ``p`` bytes a param (``param_bytes / n_params``; gradients alike) and
  ``s`` bytes of state a param (``state / n_params``), RAM is::

    max(reads, update) + rest
    reads  = 2 x a layer's params (the forward's read, the backward's
             gradients written behind)
    update = 4 x leaf x (3p + 2s): `LayerStore.update` steps one leaf of one
             layer at a time (`layer_store/step.py`): 2 read ahead and 1
             computing, each its param, gradient and state in (p + p + s);
             1 computed and 2 queued for the writers, each its param and
             state out (p + s); 4 x (in + out) bounds those and the step's
             temporaries. ``leaf`` is the largest leaf of one layer
             (`leaf_params`, e.g. Llama 3.1 70B's MLP kernel, 8192 x 28672 =
             235M params); 0: a third of a layer.
    rest   = rest_params x (2p + s): the params outside the layers (the
             embedding and head: 2 x 128256 x 8192 = 2.1B params in Llama
             3.1 70B) stay in RAM with their gradients and state.

  With ``update_bytes`` (`LayerStore(update_bytes=)`: the largest leaves cut in row ranges,
  `layer_store/ranges.py`) the update holds at most that: ``update = min(update_bytes,
  4 x leaf x (3p + 2s))``. Then, where ``host_bytes`` is given and the rest's params,
  gradients and state do not fit in it beside the store's, the rest's state is counted on
  the NVMe tier (``rest_state="nvme"``: ``rest = (rest_params + rest_leaf) x p + nvme_ram``,
  the params, one gradient and the tier's buffers; its store, 3 copies, on the disk). One
  gradient: the tier runs each leaf's slices as one loop (`DiskIO.loop`) and the leaves one
  after another, and XLA moves a leaf's gradient (computed on the device) to host memory just
  before its loop, so the gradients there share one buffer, the largest's
  (``rest_leaf_params``; 0: all of them). Compiled (`benchmarks/capacity.py`, Llama 3.1 405B):
  the embedding's and the head's, 4.2 GB each, at one offset of the host's temporaries; where
  the leaf's slices were unrolled, XLA interleaved the embedding's last ones with the head's
  gradient's copy, and both were held.

  Disk: 2 generations (``keep=1``) of params and state, and the gradients.
  Per step: the params read twice (forward, and the rematerialised backward),
  the gradients written, then the update reads params (unless `read_params` is
  False), gradients and state and writes params and state.

  Args:
    param_bytes: all of the params' bytes.
    state: all of the optimizer state's bytes.
    n_params: all of the params.
    layers: the stacked layers.
    leaf_params: the largest leaf of one layer, in params (`layer_leaves`).
    rest_params: the params outside the layers (`layer_leaves`).
    update_bytes: the store's ``update_bytes``, or None (whole leaves in flight).
    host_bytes: host RAM: with ``update_bytes``, where the rest's state goes (above).
    nvme_ram: the NVMe tier's buffers in RAM, for the rest's state there.
    rest_leaf_params: the largest param outside the layers (`largest_rest_leaf`), whose
      gradient is the one in RAM with the rest's state on the NVMe tier; 0: all of theirs.
    read_params: whether the update reads the params; not a `master_weights`', which
      overwrites them with its rounded master (`master.rounds_to_master`).

  Returns:
    ``ram`` (with its parts ``reads``, ``update``, ``rest``, and ``leaf``,
    the leaf counted, ``update_bytes`` and ``rest_state``, "ram" or "nvme"), ``disk``
    and ``disk_per_step``, in bytes.

  Example:
    >>> from offlax._src import plan_disk
    >>> n = 10**9  # bf16 params (2 B), Adam's bf16 moments (4 B): a leaf of 0.1B, 0.2B outside
    >>> b = plan_disk.params_on_disk_bytes(2 * n, 4 * n, n, 8, leaf_params=n // 10,
    ...                                    rest_params=n // 5)
    >>> b["update"], b["rest"], b["ram"]  # 4 x 0.1B x 14 B; 0.2B x 8 B
    (5600000000, 1600000000, 7200000000)
  """
  p, s = param_bytes / n_params, state / n_params
  layer = (n_params - rest_params) / layers
  leaf = leaf_params or layer / 3
  reads = 2 * layer * p
  update = 4 * leaf * (3 * p + 2 * s)
  if update_bytes is not None:
    update = min(update, update_bytes)
  # the update's reads (the gradients, the state, the params unless `read_params` is False)
  # and writes (the params and the state)
  updated = (1 + read_params) * param_bytes + state + param_bytes + state
  rest, rest_state, rest_disk = rest_params * (2 * p + s), "ram", 0.0
  if update_bytes is not None and host_bytes is not None and max(reads, update) + rest > host_bytes:
    grads = rest_leaf_params or rest_params  # one at a time (above)
    rest = (rest_params + grads) * p + nvme_ram
    rest_state, rest_disk = "nvme", 3 * rest_params * s
  return {
    "reads": int(reads),
    "update": int(update),
    "rest": int(rest),
    "leaf": int(leaf),
    "update_bytes": update_bytes,
    "rest_state": rest_state,
    "ram": int(max(reads, update) + rest),
    "disk": 2 * (param_bytes + state) + param_bytes + int(rest_disk),
    "disk_per_step": 3 * param_bytes + updated,
  }
