"""Measurements for the planner (`python -m offlax plan --measure`): bus, disk, host Adam."""

from __future__ import annotations

import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def all(disk_dir: str | None = None, nbytes: int = 256 * 2**20) -> dict[str, float]:
  """The planner's rates measured on this machine, by the planner's argument names."""
  return {
    "bus_bytes_per_s": bus(nbytes),
    "disk_bytes_per_s": disk(disk_dir, nbytes),
    "host_adam_params_per_s": host_adam(),
  }


def bus(nbytes: int) -> float:
  """Host <-> device copy rate (pinned_host), the slower direction, median of 5."""
  x = jax.block_until_ready(jnp.ones(nbytes // 4, jnp.float32))
  h = jax.block_until_ready(jax.device_put(x, jax.memory.Space.Host))
  rates = []
  for src, space in ((x, jax.memory.Space.Host), (h, jax.memory.Space.Device)):
    times = []
    for _ in range(5):
      start = time.perf_counter()
      jax.block_until_ready(jax.device_put(src, space))
      times.append(time.perf_counter() - start)
    rates.append(nbytes / float(np.median(times)))
  return min(rates)


def disk(directory: str | None, nbytes: int) -> float:
  """Sequential write then read of `nbytes` with direct I/O where the filesystem allows."""
  from offlax._src.nvme.direct_io import O_DIRECT, aligned_empty, pread_into, pwrite_all

  data = aligned_empty(nbytes)
  data[:] = 1
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    name = os.path.join(tmp, "probe")
    flags = os.O_CREAT | os.O_RDWR | O_DIRECT
    try:
      fd = os.open(name, flags, 0o600)
    except OSError:
      fd = os.open(name, flags & ~O_DIRECT, 0o600)
    try:
      start = time.perf_counter()
      pwrite_all(fd, [data], 0)
      os.fsync(fd)
      write_s = time.perf_counter() - start
      start = time.perf_counter()
      pread_into(fd, data, 0)
      read_s = time.perf_counter() - start
    finally:
      os.close(fd)
  return 2 * nbytes / (write_s + read_s)


def host_adam(n: int = 16 * 2**20) -> float:
  """`offlax.adam` step (update + apply_updates) on the CPU, params per second."""
  import optax

  import offlax

  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    tx = offlax.adam(1e-3)
    params = {"w": jnp.full((n,), 0.5, jnp.float32)}
    grads = {"w": jnp.full((n,), 1e-3, jnp.float32)}
    state = tx.init(params)

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(0, 1))
    times = []
    for _ in range(5):
      start = time.perf_counter()
      params, state = jax.block_until_ready(step(params, state, grads))
      times.append(time.perf_counter() - start)
  return n / float(np.median(times[1:]))
