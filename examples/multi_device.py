"""Data- and model-parallel training on a Mesh, with the Adam state in each device's host memory.

Run from the repository root (on a CPU-only machine the script asks XLA for 8
virtual CPU devices; on a GPU host it uses the GPUs):

    python examples/multi_device.py --steps 200

The params of a two-layer MLP are sharded on a ("data", "model") mesh, the
batch over "data". `offlax.HostTier(shard_axis="data")` keeps each moment in
pinned host memory, sharded like its param and, ZeRO-1 style, also over "data"
where the param is replicated there: each device's host RAM holds only its
shard. The script prints the loss and, last, the state bytes each device holds
with and without `shard_axis`.

With `--nvme DIR` the state goes to `offlax.NVMeTier(DIR)` instead: one store
per device under DIR (`DIR/shard_00000`, ...), each holding only its device's
shard; the script then prints each store's bytes.

For several hosts, start one process per host with the same script after
`jax.distributed.initialize(coordinator_address, num_processes, process_id)`
(see docs/multi_device.md); nothing else changes.
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Only the CPU backend reads it: virtual devices to shard over on a laptop.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import offlax  # noqa: E402


def init_params(mesh, width: int) -> dict:
  k1, k2 = jax.random.split(jax.random.key(0))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  return {
    # Megatron style: the hidden layer's columns and the output's rows over "model".
    "hidden": {
      "kernel": put(jax.random.normal(k1, (1, width)), P(None, "model")),
      "bias": put(jnp.zeros(width), P("model")),
    },
    "out": {
      "kernel": put(jax.random.normal(k2, (width, 1)) / jnp.sqrt(width), P("model", None)),
      "bias": put(jnp.zeros(1), P()),
    },
  }


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
  h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  pred = h @ params["out"]["kernel"] + params["out"]["bias"]
  return jnp.mean((pred - y) ** 2)


def state_bytes_per_device(state) -> int:
  """Host-tier bytes on the most loaded device: what one device's host RAM holds."""
  per_device: dict = {}
  for x in jax.tree.leaves(state.inner_state):
    if x.sharding.memory_kind == "pinned_host":
      for shard in x.addressable_shards:
        per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values())


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--model", type=int, default=2, help="devices on the model axis")
  parser.add_argument("--nvme", metavar="DIR", help="keep the state in NVMe stores under DIR")
  args = parser.parse_args(argv)

  n = len(jax.devices())
  # Auto axes: XLA propagates the shardings through the model (offlax works with
  # Explicit axes too).
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = jax.make_mesh((n // args.model, args.model), ("data", "model"), axis_types=auto)
  params = init_params(mesh, args.width)
  x = jax.device_put(jnp.linspace(-3, 3, 1024)[:, None], NamedSharding(mesh, P("data")))
  y = jnp.sin(x) + 0.05 * jax.random.normal(jax.random.key(1), x.shape)

  tier: offlax.HostTier | offlax.NVMeTier = offlax.HostTier(shard_axis="data")
  if args.nvme:
    tier = offlax.NVMeTier(args.nvme, progress=False)
  tx = offlax.offload(optax.adamw(3e-3, weight_decay=1e-4), tier)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for step in range(args.steps):
    params, opt_state, loss = train_step(params, opt_state, x, y)
    if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
      print(f"step {step:4d}  loss {float(loss):.4f}")

  if isinstance(tier, offlax.NVMeTier):
    tier.close()
    sizes = {i: sum(r.nbytes for r in shard.store.records) for i, shard in tier.shards.items()}
    print(f"NVMe tier: {len(sizes)} stores under {args.nvme}, state bytes each: {sizes}")
    return {"loss": float(loss), "devices": n, "store_bytes": sizes}
  unsharded = offlax.offload(optax.adamw(3e-3), offlax.HostTier()).init(params)
  result = {
    "loss": float(loss),
    "devices": n,
    "zero1_bytes_per_device": state_bytes_per_device(opt_state),
    "bytes_per_device": state_bytes_per_device(unsharded),
  }
  print(
    f"{n} devices, mesh {dict(mesh.shape)}: Adam state per device's host memory "
    f"{result['zero1_bytes_per_device']:,} B with shard_axis='data', "
    f"{result['bytes_per_device']:,} B sharded like the params only"
  )
  kernel = opt_state.inner_state[0].mu["hidden"]["kernel"]
  print(f"mu['hidden']['kernel']: {kernel.sharding.spec}, {kernel.sharding.memory_kind}")
  return result


if __name__ == "__main__":
  main()
