"""The optimizer step over a `LayerStore`'s layers: a layer at a time, on the host CPU.

As ZeRO-Infinity's CPU Adam: the params, their gradients and the optimizer
state never sit whole in RAM. For each layer, read-ahead threads bring its
params, gradients and state from disk, the optimizer's update runs on the CPU
(jitted once for one layer: offlax's `adam`/`adamw` use their native kernel
there), and one writer thread writes the new params and state into the free
generation while the next layer computes.

A layer at a time is the optimizer applied to the stacked tree only where
every leaf's update is elementwise (Adam: yes; a global-norm clip, LAMB's
per-leaf trust ratio: no). `layer_update` checks that on the update's jaxpr
(`coupling.analyze`) rather than trusting a list of optimizers. The state is
`jax.vmap` of ``init``: each layer holds its own copy of global leaves (the
step count), all equal, since a global leaf never depends on the params.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from offlax._src import coupling as coupling_lib
from offlax._src import errors
from offlax._src import layout as layout_lib

IO_THREADS = 4  # per direction: what a disk needs to reach its bandwidth with 8-64 MiB transfers


class Stats(NamedTuple):
  """What one `LayerStore.update` moved and how long it took.

  Attributes:
    step: the step it committed.
    seconds: its wall time, reads, compute, writes and flushes together.
    bytes_read: params, gradients and state read.
    bytes_written: params and state written.
    read_seconds: time the read threads spent reading (summed over threads).
    write_seconds: time the writer spent writing.
    compute_seconds: time the optimizer's update ran.
  """

  step: int
  seconds: float
  bytes_read: int
  bytes_written: int
  read_seconds: float
  write_seconds: float
  compute_seconds: float


def _one_layer(layers: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype), layers)


def one_layer_state(optimizer: Any, layers: Any) -> Any:
  """The optimizer's state of one layer, as shapes and dtypes."""
  if not isinstance(optimizer, optax.GradientTransformation):
    raise errors.TransformationTypeError(
      f"LayerStore: optimizer must be an optax GradientTransformation, got "
      f"{type(optimizer).__name__}."
    )
  return jax.eval_shape(optimizer.init, _one_layer(layers))


def check_elementwise(optimizer: Any, stacked: Any) -> None:
  """Raises `InvalidOptionError` unless the update of each leaf is elementwise."""
  spec = layout_lib.ParamSpec.of(stacked)
  state = jax.eval_shape(optimizer.init, stacked)
  layout = layout_lib.StateLayout(state, spec)
  items = layout.split(state)

  def flat(u, s, p):
    new_u, new_s = optimizer.update(
      spec.treedef.unflatten(u), layout.merge(s), spec.treedef.unflatten(p)
    )
    return jax.tree.leaves(new_u), layout.split(new_s)

  leaves = jax.tree.leaves(stacked)
  n = len(leaves)
  in_owners = [*range(n), *layout.owners, *range(n)]
  out_owners = [*range(n), *layout.owners]
  # As traced for a GPU program, where offlax's native kernels are elementwise by contract.
  with coupling_lib.splitting_native(True):
    jaxpr = jax.make_jaxpr(flat)(leaves, items, leaves)
    shapes = [tuple(x.shape) for x in leaves]
    coupling = coupling_lib.analyze(jaxpr, in_owners, out_owners, shapes)
  coupled = [p for i, p in enumerate(spec.paths) if i not in coupling.splittable]
  if coupled:
    why = coupling.reason or "it reads more than each element's own values"
    raise errors.InvalidOptionError(
      f"LayerStore: the optimizer's update of leaf {coupled[0]} is not elementwise ({why}), "
      "so applying it a layer at a time would change it. Use an elementwise optimizer (Adam, "
      "AdamW, SGD, Lion, offlax.master_weights of them); clip gradients per layer if needed."
    )


def layer_update(optimizer: Any, store: Any):
  """The optimizer's update of one layer, jitted: (params, grads, state) leaves -> new ones.

  The caller has checked it with `check_elementwise`.
  """

  def update(p, g, s):
    p = jax.tree.unflatten(store.treedef, p)
    updates, s = optimizer.update(
      jax.tree.unflatten(store.treedef, g), jax.tree.unflatten(store.state_treedef, s), p
    )
    return jax.tree.leaves(optax.apply_updates(p, updates)), jax.tree.leaves(s)

  return jax.jit(update)


def run(store: Any, update: Any, target: int) -> Stats:
  """Updates every layer of `store` from its committed generation into `target`.

  Each layer's slots (a leaf's layer each, of params, gradients and state) are
  read and written by `IO_THREADS` threads each way, as one reader thread
  reaches only part of an NVMe's bandwidth; ``pool_layers - 1`` layers are read
  ahead, and at most two layers' writes are queued while the next computes.
  """
  from offlax._src.nvme.store import progress_bar

  cpu = jax.devices("cpu")[0]  # the host's compute, whatever the default device
  gen, n = store.generation, store.n_layers
  ahead = max(1, store.pool_layers - 1)
  lock = threading.Lock()
  tally: collections.defaultdict[str, float] = collections.defaultdict(float)
  kinds = [("params", gen), ("grads", 0), ("state", gen)]
  counts = {
    "params": len(store.records),
    "grads": len(store.records),
    "state": len(store.state_records),
  }

  def timed(what, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    with lock:
      tally[what + "_seconds"] += time.perf_counter() - start
    return out

  def read(pool, i):
    return [
      [pool.submit(timed, "read", store.read_slot, kind, g, k, i) for k in range(counts[kind])]
      for kind, g in kinds
    ]

  def write(pool, i, params, state):
    return [
      pool.submit(timed, "write", store.write_slot, kind, target, k, i, x)
      for kind, leaves in (("params", params), ("state", state))
      for k, x in enumerate(leaves)
    ]

  start = time.perf_counter()
  with (
    concurrent.futures.ThreadPoolExecutor(IO_THREADS, "offlax-update-read") as readers,
    concurrent.futures.ThreadPoolExecutor(IO_THREADS, "offlax-update-write") as writers,
  ):
    reads = {i: read(readers, i) for i in range(min(ahead, n))}
    writes: collections.deque[list[concurrent.futures.Future]] = collections.deque()
    try:
      for i in progress_bar(range(n), store.progress, f"offlax: updating {store.path}"):
        p, g, s = [[f.result() for f in futures] for futures in reads.pop(i)]
        tally["read_bytes"] += sum(x.nbytes for x in [*p, *g, *s])
        if i + ahead < n:
          reads[i + ahead] = read(readers, i + ahead)
        t = time.perf_counter()
        with jax.default_device(cpu):
          new_p, new_s = update(p, g, s)
          new_p, new_s = [np.asarray(x) for x in new_p], [np.asarray(x) for x in new_s]
        tally["compute_seconds"] += time.perf_counter() - t
        while len(writes) >= 2:  # one layer written, one queued, while the next computes
          [f.result() for f in writes.popleft()]
        writes.append(write(writers, i, new_p, new_s))
        tally["write_bytes"] += sum(x.nbytes for x in [*new_p, *new_s])
      while writes:
        [f.result() for f in writes.popleft()]
    except BaseException:
      for f in [f for layer in reads.values() for fs in layer for f in fs]:
        f.cancel()
      for f in [f for fs in writes for f in fs]:
        f.cancel()
      raise
  return Stats(
    step=store.step + 1,
    seconds=time.perf_counter() - start,
    bytes_read=int(tally["read_bytes"]),
    bytes_written=int(tally["write_bytes"]),
    read_seconds=tally["read_seconds"],
    write_seconds=tally["write_seconds"],
    compute_seconds=tally["compute_seconds"],
  )
