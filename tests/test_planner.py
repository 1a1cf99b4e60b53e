"""The planner: modes, byte accounting against real states and compiled steps, the CLI."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offlax
from offlax.__main__ import main as cli
from offlax._src.planner import parse_bytes, parse_count

MiB = 2**20


def _shapes(n_leaves=8, size=2**18, dtype=jnp.float32):
  return {f"w{i}": jax.ShapeDtypeStruct((size,), dtype) for i in range(n_leaves)}


def _plan(device, host, nvme=0, **kw):
  return offlax.plan(
    _shapes(), optax.adam(1e-3), device_bytes=device, host_bytes=host, nvme_bytes=nvme,
    chunk_bytes=MiB, **kw,
  )  # fmt: skip


def test_modes_in_order():
  # 2M fp32 params: 8 MiB params, 8 MiB grads, 16 MiB of Adam state.
  assert _plan(64 * MiB, 64 * MiB).mode == "device"
  host = _plan(24 * MiB, 64 * MiB)
  assert (host.mode, host.fits) == ("host", True) and 0 < host.fraction < 1
  # Two 1 MiB slices on the device: each leaf's 2 MiB of state is cut into pieces.
  assert host.bytes["host"] + (host.bytes["device"] - 16 * MiB - 2 * MiB) == 16 * MiB + 4
  assert host.bus_bytes_per_step == 2 * host.bytes["host"]
  compute = _plan(17 * MiB, 64 * MiB)  # no room for two 1 MiB slices
  assert (compute.mode, compute.bus_bytes_per_step) == ("host_compute", 16 * MiB)
  nvme = _plan(24 * MiB, 8 * MiB, nvme=1 << 30)
  assert nvme.mode == "nvme" and nvme.bytes["nvme"] > 0 and nvme.disk_bytes_per_step > 0
  # The store keeps keep + 1 = 3 generations of the 16 MiB state.
  assert nvme.bytes["nvme"] == 3 * 16 * MiB
  assert _plan(24 * MiB, 8 * MiB, nvme=3 * 16 * MiB).mode == "nvme"
  small_disk = _plan(24 * MiB, 8 * MiB, nvme=3 * 16 * MiB - 1)
  assert small_disk.mode == "none" and any("3 copies" in a for a in small_disk.advice)
  none = _plan(8 * MiB, 8 * MiB)
  assert (none.mode, none.fits) == ("none", False)
  assert any("shard them over 3+ devices" in a for a in none.advice)  # 5% kept free
  assert "DOES NOT FIT" in none.table()


def test_host_bytes_match_the_real_state():
  params = {k: jnp.ones(s.shape) for k, s in _shapes().items()}
  p = offlax.plan(params, optax.adam(1e-3), device_bytes=24 * MiB, host_bytes=1 << 30,
                  chunk_bytes=MiB)  # fmt: skip
  state = offlax.offload(optax.adam(1e-3), fraction=p.fraction).init(params)
  on_host = sum(x.nbytes for x in jax.tree.leaves(state) if x.sharding.memory_kind == "pinned_host")
  assert on_host == p.bytes["host"]
  assert sorted(k for k, v in p.placement.items() if v == "host") == sorted(
    jax.tree_util.keystr(path)
    for path, x in jax.tree_util.tree_flatten_with_path(state.inner_state)[0]
    if x.sharding.memory_kind == "pinned_host"
  )


def test_accounting_matches_memory_analysis():
  """On the CPU a compiled step's arguments are params, state and gradients, whatever the tier."""
  shapes = _shapes()
  p = offlax.plan(shapes, optax.adamw(1e-3), device_bytes=1 << 30, host_bytes=1 << 30)
  tx = offlax.offload(optax.adamw(1e-3))  # reads the params: none of the arguments is pruned
  params = {k: jnp.ones(s.shape) for k, s in shapes.items()}
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  grads = jax.tree.map(jnp.zeros_like, params)
  analysis = step.lower(params, state, grads).compile().memory_analysis()
  a = p.assumptions
  assert analysis.argument_size_in_bytes == a["param_bytes"] + a["grad_bytes"] + a["state_bytes"]


def test_bad_sizes():
  with pytest.raises(offlax.InvalidTierError, match="device_bytes"):
    _plan(0, MiB)
  assert parse_bytes("24GB") == 24 * 10**9 and parse_bytes("64MiB") == 64 * MiB
  assert parse_bytes("1.5e9") == 1_500_000_000
  with pytest.raises(ValueError, match="not a size"):
    parse_bytes("lots")


def test_cli(capsys):
  assert cli(["plan", "--params", "13e9", "--device-mem", "24GB", "--host-mem", "128GB",
              "--master"]) == 1  # fmt: skip
  out = capsys.readouterr().out
  assert "13,000,000,000 params" in out and "DOES NOT FIT" in out and "shard them" in out
  assert cli(["plan", "--params", "2e8", "--device-mem", "1.2GB", "--host-mem", "16GB",
              "--optimizer", "adam"]) == 0  # fmt: skip
  assert "mode: host (fits)" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli(["plan", "--params", "1e9", "--device-mem", "lots", "--host-mem", "1GB"])
  assert "not a size" in capsys.readouterr().err


def test_cli_measure(capsys, tmp_path):
  assert cli(["plan", "--params", "1e8", "--device-mem", "80GB", "--host-mem", "16GB",
              "--measure", "--nvme-path", str(tmp_path)]) == 0  # fmt: skip
  out = capsys.readouterr().out
  measured = dict(kv.rsplit(" ", 1) for kv in out.splitlines()[0][len("measured: ") :].split(", "))
  assert all(float(v) > 0 for v in measured.values()), measured
  assert np.isfinite(float(measured["host_adam_params_per_s"]))


def test_the_device_keeps_headroom():
  # 16 MiB of params and gradients plus 16 MiB + 4 B of state: exactly that is not enough.
  assert _plan(32 * MiB + 4, 64 * MiB).mode != "device"
  assert _plan(34 * MiB, 64 * MiB).mode == "device"


def test_disk_bytes_per_step_match_the_nvme_tier(tmp_path):
  """Reads and writes of the arrays on disk, and the commit's writes of the cached ones."""
  shapes = _shapes()
  p = offlax.plan(shapes, optax.adam(1e-3), device_bytes=21 * MiB, host_bytes=14 * MiB,
                  nvme_bytes=1 << 30, chunk_bytes=MiB)  # fmt: skip
  assert p.mode == "nvme" and list(p.placement.values()).count("host") == 2
  cache = int(p.advice[0].split("cache_bytes=")[1].rstrip(")"))
  tier = offlax.NVMeTier(str(tmp_path), cache_bytes=cache, chunk_bytes=MiB, progress=False,
                         fsync=False)  # fmt: skip
  tx = offlax.offload(optax.adam(1e-3), tier)
  params = {k: jnp.ones(s.shape) for k, s in shapes.items()}
  state, step = tx.init(params), jax.jit(lambda g, s: tx.update(g, s))
  for _ in range(2):
    _, state = step(params, state)
  s = offlax.stats(state, tier, sync=True)
  measured = s.disk_read_bytes + s.disk_write_bytes
  tier.close()
  assert abs(p.disk_bytes_per_step - measured) <= 1e-4 * measured  # (checksums aside)


def test_cli_sizes_need_units_params_take_suffixes_and_no_fit_prints_no_costs(capsys):
  with pytest.raises(SystemExit):
    cli(["plan", "--params", "1e9", "--device-mem", "24", "--host-mem", "1GB"])
  assert "'24' has no unit: write e.g. 24GB" in capsys.readouterr().err
  assert parse_bytes("24") == 24 and parse_bytes("0", unit_required=True) == 0
  assert cli(["plan", "--params", "7B", "--device-mem", "24GB", "--host-mem", "128GB"]) == 1
  out = capsys.readouterr().out
  assert "7,000,000,000 params" in out and "DOES NOT FIT" in out
  assert "per step" not in out and "inf" not in out and "uses" not in out
  assert parse_count("350M") == 350 * 10**6 and parse_count("13e9") == 13 * 10**9
  with pytest.raises(ValueError, match="not a number of parameters"):
    parse_count("lots")


def test_no_fit_always_says_what_is_missing(capsys):
  """Every DOES NOT FIT names what does not fit, and the fix where there is one."""
  args = ["plan", "--params", "3e9", "--device-mem", "24GB", "--host-mem", "128GB", "--master"]
  assert cli(args) == 1
  out = capsys.readouterr().out
  assert "DOES NOT FIT" in out and "12.0 GB of it for the updates" in out and "--fused" in out
  assert cli([*args, "--fused"]) == 0
  no_room = ["--device-mem", "4.3GB", "--host-mem", "1GB", "--nvme", "1TB"]
  assert cli(["plan", "--params", "1e9", *no_room]) == 1
  out = capsys.readouterr().out
  assert "DOES NOT FIT" in out and "\n- " in out


def test_params_in_host_memory_when_params_and_gradients_do_not_fit():
  # 13B bf16 params with an fp32 master on a 24 GB device: params and gradients alone are 52 GB.
  shapes = {f"w{i}": jax.ShapeDtypeStruct((2**26,), jnp.bfloat16) for i in range(194)}
  tx = offlax.master_weights(optax.adamw(1e-3))
  sizes = {"device_bytes": 24 * 10**9, "nvme_bytes": 2 * 10**12}
  assert not offlax.plan(shapes, tx, host_bytes=256 * 10**9, **sizes).fits  # no layers: no
  p = offlax.plan(shapes, tx, host_bytes=256 * 10**9, layers=40, **sizes)
  n = 194 * 2**26
  assert (p.mode, p.fits) == ("params_host", True)
  # Params, gradients, master and moments (and the step count).
  assert 0 <= p.bytes["host"] - (2 * 2 * n + 12 * n) <= 8
  assert p.bytes["device"] == int(2 * (2 * n / 40))  # a layer's params and gradients
  assert p.bus_bytes_per_step == 3 * 2 * n
  # Less RAM than the state: the state on disk, params and gradients in RAM.
  q = offlax.plan(shapes, tx, host_bytes=128 * 10**9, layers=40, **sizes)
  assert (q.mode, q.fits) == ("params_host_nvme", True)
  assert 4 * n < q.bytes["host"] <= 128 * 10**9 and q.bytes["nvme"] == 3 * 12 * n
  # Not enough RAM for params and gradients: nothing fits.
  assert not offlax.plan(shapes, tx, host_bytes=40 * 10**9, layers=40, **sizes).fits
