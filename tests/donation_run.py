"""Run by `test_donation.py` in a subprocess: jitted steps that donate offloaded state.

Without offlax's donation fix (`offlax._src.donation`) JAX 0.10 aborts the
process on most of these patterns, so they run here, where an abort is a failed
test and not a crashed test session. For each pattern, compute mode and
placement (one device; a 2-device ("fsdp", "tp") mesh) it runs three donated
steps and three undonated ones, and prints ``PATTERN <name>`` before each
(to name the one that aborts) and one JSON line ``RESULT {...}`` at the end:
whether the two runs agree bit for bit, the memory kinds of the state's array
leaves afterwards, and whether each donated offloaded buffer was reused.
"""

import functools
import json
import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import offlax  # noqa: E402


def loss(params, x):
  h = jnp.tanh(x @ params["a"]) @ params["b"].T
  return jnp.mean((h + params["c"]) ** 2)


def grads_of(params, x):
  return jax.grad(loss)(params, x)


# Each pattern makes, from `tx` and `jit` (`jax.jit` with or without the
# pattern's donation), a step `(params, state, x) -> (params, state)`. Params
# `a` and `b` have one shape, so JAX has two device outputs to pair each state
# buffer with.
def step_alone(tx, jit):  # Tunix: `nnx.jit(train_step, donate_argnames=("optimizer",))`
  @jit
  def step(params, state, x):
    updates, state = tx.update(grads_of(params, x), state, params)
    return optax.apply_updates(params, updates), state

  return step


def state_first(tx, jit):  # the state before the params in the outputs
  @jit
  def step(params, state, x):
    updates, state = tx.update(grads_of(params, x), state, params)
    return state, optax.apply_updates(params, updates)

  return lambda params, state, x: step(params, state, x)[::-1]


def with_updates(tx, jit):  # device outputs shaped like the state besides the new state
  @jit
  def step(params, state, x):
    updates, state = tx.update(grads_of(params, x), state, params)
    return optax.apply_updates(params, updates), state, updates

  return lambda params, state, x: step(params, state, x)[:2]


def update_alone(tx, jit):  # `jax.jit(tx.update, donate_argnums=1)`: updates shaped like the state
  update, grads = jit(tx.update), jax.jit(grads_of)

  def step(params, state, x):
    updates, state = update(grads(params, x), state, params)
    return optax.apply_updates(params, updates), state

  return step


PATTERNS = {
  "state_alone": (step_alone, (1,)),
  "state_first": (state_first, (1,)),
  "state_and_updates": (with_updates, (1,)),
  "update_alone": (update_alone, (1,)),
  "params_alone": (step_alone, (0,)),
  "params_and_state": (step_alone, (0, 1)),
}
MODES = ("device", "host")


def make_params(mesh):
  k = jax.random.split(jax.random.key(0), 3)
  params = {
    "a": jax.random.normal(k[0], (16, 32)) * 0.3,
    "b": jax.random.normal(k[1], (16, 32)) * 0.3,
    "c": jax.random.normal(k[2], (16,)),
  }
  if mesh is None:
    return params
  specs = {"a": P("fsdp", "tp"), "b": P("fsdp", None), "c": P()}
  return {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in params.items()}


def run_pattern(name, mode, mesh):
  make, donate = PATTERNS[name]
  tx = offlax.offload(optax.adamw(1e-2), compute=mode)
  x = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
  donated = make(tx, functools.partial(jax.jit, donate_argnums=donate))
  plain = make(tx, jax.jit)
  p = jax.tree.map(jnp.copy, make_params(mesh))
  s = tx.init(p)
  want_p, want_s = make_params(mesh), tx.init(make_params(mesh))
  reused = True
  for _ in range(3):
    old = [y for y in jax.tree.leaves(s) if y.sharding.memory_kind == "pinned_host"]
    p, s = donated(p, s, x)
    if 1 in donate:
      reused &= all(y.is_deleted() for y in old)
    want_p, want_s = plain(want_p, want_s, x)
  same = lambda a, b: all(
    np.asarray(u).tobytes() == np.asarray(v).tobytes()
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )
  kinds = sorted({y.sharding.memory_kind for y in jax.tree.leaves(s) if y.ndim})
  return {"exact": same(p, want_p) and same(s, want_s), "kinds": kinds, "reused": reused}


def main(only=None):
  """Runs every pattern, one device and a mesh (or `only` one of the two)."""
  mesh = jax.make_mesh((1, 2), ("fsdp", "tp"))
  out = {}
  for where, m in (("one_device", None), ("mesh", mesh)):
    if only not in (None, where):
      continue
    for name in PATTERNS:
      for mode in MODES:
        key = f"{name}-{mode}-{where}"
        print("PATTERN", key, flush=True)
        out[key] = run_pattern(name, mode, m)
  print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
  sys.exit(main())
