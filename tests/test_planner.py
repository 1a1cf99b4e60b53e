"""The planner: modes, byte accounting against real states and compiled steps, the CLI."""

import dataclasses
import json

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
  assert none.code == "" and all(p.code for p in (host, compute, nvme))
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
  with pytest.raises(offlax.errors.InvalidOptionError, match="device_bytes"):
    _plan(0, MiB)
  assert parse_bytes("24GB") == 24 * 10**9 and parse_bytes("64MiB") == 64 * MiB
  assert parse_bytes("1.5e9") == 1_500_000_000
  with pytest.raises(ValueError, match="not a size"):
    parse_bytes("lots")


def test_cli(capsys):
  assert cli(["plan", "--params", "13e9", "--device-mem", "24GB", "--host-mem", "128GB",
              "--master"]) == 1  # fmt: skip
  out = capsys.readouterr().out
  assert "13,015,864,320 params" in out and "DOES NOT FIT" in out and "shard them" in out
  assert out.startswith("assuming the shape of Llama 2 13B")  # params and grads leave the device
  assert cli(["plan", "--params", "2e8", "--device-mem", "1.2GB", "--host-mem", "16GB",
              "--optimizer", "adam"]) == 0  # fmt: skip
  assert "mode: host (fits)" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli(["plan", "--params", "1e9", "--device-mem", "lots", "--host-mem", "1GB"])
  assert "not a size" in capsys.readouterr().err


@pytest.mark.slow  # measures the machine; test_cli runs the command line
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
  cache = int(p.code.split("cache_bytes=")[1].split(")")[0])
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
  assert cli(["plan", "--params", "7B", "--device-mem", "24GB", "--host-mem", "16GB"]) == 1
  out = capsys.readouterr().out
  assert "Mistral 7B" in out and "7,241,732,096 params" in out and "DOES NOT FIT" in out
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


@pytest.mark.slow  # a usual decoder's case runs by default
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
  # Not enough RAM for params and gradients: all on disk (an offlax.LayerStore) ...
  r = offlax.plan(shapes, tx, host_bytes=40 * 10**9, layers=40, **sizes)
  assert (r.mode, r.fits) == ("params_nvme", True)
  assert 0 <= r.bytes["nvme"] - (2 * 14 + 2) * n <= 64  # and the step counts
  # ... unless the disk cannot hold two generations of params and state: nothing fits.
  small_disk = {**sizes, "nvme_bytes": 25 * n}
  assert not offlax.plan(shapes, tx, host_bytes=40 * 10**9, layers=40, **small_disk).fits


@pytest.mark.slow  # test_cli's no-fit runs by default
def test_every_no_fit_lists_offlaxs_own_ways_out_first(capsys):
  """Params in host memory, the NVMe tier and chunk_bytes/fraction, each with its needs."""
  gb = 10**9
  cases = [
    ["--params", "13e9", "--device-mem", "24GB", "--host-mem", "128GB", "--master", "--layers",
     "40"],
    ["--params", "13B", "--device-mem", "24GB", "--host-mem", "128GB", "--master"],
    ["--params", "3e9", "--device-mem", "24GB", "--host-mem", "128GB", "--master"],
    ["--params", "3e9", "--device-mem", "24GB", "--host-mem", "20GB", "--master", "--fused"],
    ["--params", "1e9", "--device-mem", "4.3GB", "--host-mem", "1GB", "--nvme", "1TB"],
  ]  # fmt: skip
  for args in cases:
    assert cli(["plan", *args]) == 1
    out = capsys.readouterr().out
    advice = [line[2:] for line in out.splitlines() if line.startswith("- ")]
    assert "DOES NOT FIT" in out, out
    assert advice[0].startswith("params in host memory"), advice
    assert advice[1].startswith("the NVMe tier"), advice
    assert "chunk_bytes" in advice[2] or "fraction" in advice[2], advice
    beyond = [i for i, a in enumerate(advice) if "shard them" in a or "LoRA" in a]
    assert all(i >= 3 for i in beyond), advice
  # The 13B case (Llama 2 13B's shape, 40 layers): its needs, from its sizes (bf16 params,
  # 12 B/param of state).
  cli(["plan", *cases[0]])
  out = capsys.readouterr().out
  n = int(out.split(" params (")[0].split()[-1].replace(",", ""))
  assert n == 13_015_864_320
  need = (2 * 2 + 12) * n  # params and gradients, state (and the step count, 4 B)
  assert f"{need / 1e9:.1f} GB (RAM short by {(need - 128 * gb) / 1e9:.1f} GB)" in out
  assert f"disk {3 * 12 * n / 1e9:.1f} GB (disk short by {3 * 12 * n / 1e9:.1f} GB)" in out
  # With that disk, the plan takes the way it named.
  assert cli(["plan", *cases[0], "--nvme", f"{3 * 12 * n}B"]) == 0
  assert "mode: params_host_nvme (fits)" in capsys.readouterr().out


def test_a_smaller_chunk_the_advice_names_fits():
  # 64 MiB of fp32 params in 1 leaf, its 128 MiB of state on the NVMe tier (16 MiB of RAM):
  # two 4 MiB slices in flight do not fit beside params and gradients, where 2 MiB ones do.
  shapes = {"w": jax.ShapeDtypeStruct((2**24,), jnp.float32)}
  kw = {"device_bytes": int((2 * 64 + 6) * MiB / 0.95), "host_bytes": 16 * MiB}
  kw["nvme_bytes"] = 1 << 30
  p = offlax.plan(shapes, optax.adam(1e-3), chunk_bytes=4 * MiB, **kw)
  assert not p.fits
  (line,) = [a for a in p.advice if a.startswith("a smaller chunk_bytes")]
  chunk = int(line.split("chunk_bytes=")[1].split()[0])
  assert chunk < 4 * MiB and offlax.plan(shapes, optax.adam(1e-3), chunk_bytes=chunk, **kw).fits


def test_every_mode_has_code_that_builds_its_optimizer(tmp_path):
  params = {k: jnp.ones(s.shape) for k, s in _shapes().items()}
  plans = {
    "device": _plan(64 * MiB, 64 * MiB),
    "host": _plan(24 * MiB, 64 * MiB),
    "host_compute": _plan(17 * MiB, 64 * MiB),
    "nvme": _plan(24 * MiB, 8 * MiB, nvme=1 << 30),
  }
  for mode, p in plans.items():
    assert p.mode == mode
    scope = {"offlax": offlax, "optax": optax, "inner": optax.adam(1e-3), "path": str(tmp_path)}
    exec(p.code.splitlines()[0], scope)  # the line that builds tx
    tx = scope["tx"]
    state = tx.init(params)
    where = {x.sharding.memory_kind for x in jax.tree.leaves(state) if x.size > 1}
    assert ("pinned_host" in where) == (mode in ("host", "host_compute")), (mode, where)
    if mode == "nvme":
      tx.tier.close()  # the tier holds its store open
  assert 'compute="host"' in plans["host_compute"].code
  assert f"fraction={plans['host'].fraction:.3f}" in plans["host"].code


def test_master_weights_in_the_code_and_what_activations_would_change(capsys):
  assert cli(["plan", "--params", "7B", "--device-mem", "80GB", "--host-mem", "256GB",
              "--master"]) == 0  # fmt: skip
  out = capsys.readouterr().out
  assert "tx = offlax.offload(offlax.master_weights(optax.adamw(1e-3)), fraction=" in out
  assert "activations are counted as 0" in out
  used, has = (float(x) for x in out.split("device")[1].split()[:3:2])  # "76.0 GB 80.0 GB"
  leaves = float(out.split("this plan leaves ")[1].split()[0])
  unit = out.split("this plan leaves ")[1].split()[1]
  assert abs(leaves * {"MB": 1e-3, "GB": 1}[unit] - (0.95 * has - used)) < 0.06
  # The last line is the plan of the nearest known model, its working set counted.
  from offlax._src import plan_models

  line = next(x for x in out.splitlines() if x.startswith("- with the working set of"))
  assert line.startswith("- with the working set of Mistral 7B, the nearest known model to 7B")
  m = plan_models.KNOWN["Mistral 7B"]
  tx = offlax.master_weights(optax.adamw(1e-3))
  sizes = {"device_bytes": 80 * 10**9, "host_bytes": 256 * 10**9}
  sizes["activation_bytes"] = m.device_bytes()
  p = offlax.plan(plan_models.params(m, jnp.bfloat16), tx, layers=m.layers, **sizes)
  assert line.endswith(f"mode {p.mode} (fits), fraction {p.fraction:.2f}, device "
                       f"{p.bytes['device'] / 1e9:.1f} GB")  # fmt: skip


def test_params_in_host_memory_proposed_for_a_usual_decoder_or_a_named_model(capsys, tmp_path):
  """The seed's 13B on 24 GB: params in host memory, the state on NVMe, not DOES NOT FIT."""
  args = ["--device-mem", "24GB", "--host-mem", "128GB", "--nvme", "2TB", "--master"]
  assert cli(["plan", "--params", "13e9", *args]) == 0
  out = capsys.readouterr().out
  assert (
    "assuming the shape of Llama 2 13B, the nearest known model to 13B params: 40 layers" in out
  )
  assert "mode: params_host_nvme (fits)" in out and "offlax.offload_params(model)" in out
  shapes = tmp_path / "qwen3_14b.json"
  shapes.write_text('{"layers": 40, "d": 5120, "ffn": 17408, "vocab": 151936, "heads": 40, '
                    '"kv_heads": 8}')  # fmt: skip
  assert cli(["plan", "--model", str(shapes), *args]) == 0
  out = capsys.readouterr().out
  assert "14,768,296,960 params" in out and "mode: params_host_nvme (fits)" in out
  assert "assuming" not in out
  shapes.write_text('{"layers": 40}')
  with pytest.raises(SystemExit):
    cli(["plan", "--model", str(shapes), *args])
  assert "the shapes lack ['d', 'ffn', 'heads', 'vocab']" in capsys.readouterr().err


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_mode_bytes_is_what_the_plan_of_that_mode_counts(master, fused):
  """`planner.mode_bytes` agrees with `plan` on a device just big enough for the mode."""
  from offlax._src import planner

  params = _shapes(dtype=jnp.bfloat16 if master else jnp.float32)
  tx = offlax.master_weights(optax.adam(1e-3)) if master else optax.adam(1e-3)
  kw = dict(chunk_bytes=MiB, fused=fused)
  host = {"device": 2**40, "host": 2**40, "host_compute": 2**40, "nvme": MiB}
  for mode in ("device", "host", "host_compute", "nvme"):
    need = planner.mode_bytes(params, tx, mode, **kw)
    device = int(need / (1 - planner.DEVICE_RESERVE)) + 64
    sizes = dict(host_bytes=host[mode], nvme_bytes=2**40, **kw)
    p = offlax.plan(params, tx, device_bytes=device, **sizes)
    assert (p.mode, p.bytes["device"]) == (mode, need), (mode, p.bytes, p.placement)
    # A device a slice smaller does not hold the mode.
    assert offlax.plan(params, tx, device_bytes=device - 2 * MiB, **sizes).mode != mode
  with pytest.raises(ValueError, match="params_host"):
    planner.mode_bytes(params, tx, "params_host", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("master, per_param", [(True, 34), (False, 20)])  # bf16 moments: 20
def test_params_on_disk_when_they_do_not_fit_in_ram(capsys, tmp_path, master, per_param):
  """70B on one 80 GB GPU with 64 GB of RAM: params, gradients and state in a LayerStore."""
  args = ["plan", "--params", "70e9", "--device-mem", "80GB", "--host-mem", "64GB",
          "--nvme", "4TB", *(["--master"] if master else []), "--disk-gbps", "2"]  # fmt: skip
  assert cli(args) == 0
  out = capsys.readouterr().out
  assert "mode: params_nvme (fits)" in out and "offlax.LayerStore.create(" in out
  assert f"moves {per_param} B/param on disk" in out
  # Llama 3.1 70B's shape: the MLP kernel (8192 x 28672) in flight, embedding and head in RAM.
  assert "Llama 3.1 70B, the nearest known model to 70B params" in out
  assert "a layer's largest leaf, 235M params" in out
  if master:  # 16 B/param of embedding and head (2.1B params): 33.6 GB beside the update's
    assert "(33.6 GB)" in out
    # 50 GB: whole leaves in flight would be 11.8 GB short; the update by row ranges fits.
    assert cli([*args[:6], "50GB", *args[7:]]) == 0
    out = capsys.readouterr().out
    assert "mode: params_nvme (fits)" in out and "update_bytes=4 << 30" in out
    assert cli([*args[:6], "8GB", *args[7:]]) == 1
    out = capsys.readouterr().out
    assert "mode: none (DOES NOT FIT)" in out and "mode: params_nvme" not in out
    assert "all on disk in an offlax.LayerStore" in out and "RAM short by" in out
  n = 70e9
  # Three leaves a layer, stacked: a third of a layer in flight.
  shapes = {k: jax.ShapeDtypeStruct((70, int(n) // 210), jnp.bfloat16) for k in ("a", "b", "c")}
  inner = optax.adamw(1e-3)
  tx = offlax.master_weights(inner) if master else inner
  p = offlax.plan(shapes, tx, device_bytes=80 * 10**9, host_bytes=64 * 10**9,
                  nvme_bytes=4 * 10**12, layers=70, disk_bytes_per_s=2e9)  # fmt: skip
  assert p.mode == "params_nvme" and p.fits
  assert p.bytes["host"] <= 64e9 and p.bytes["nvme"] <= 4e12
  state = 12 if master else 4  # fp32 master and moments, or optax's bf16 moments
  assert p.bytes["nvme"] == pytest.approx((2 * (2 + state) + 2) * n, rel=1e-6)  # keep=1, grads
  assert p.disk_bytes_per_step == pytest.approx(per_param * n, rel=1e-6)
  assert p.overhead_s == pytest.approx(per_param * n / 2e9, rel=1e-6)  # the disk's time
  # The disk too small for two generations: refused, saying what it would need.
  assert cli([*args[:-2], "--nvme", "500GB"]) == 1
  assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.slow
def test_measure_disk(capsys, tmp_path):
  args = ["plan", "--params", "70e9", "--device-mem", "80GB", "--host-mem", "64GB",
          "--nvme", "4TB", "--master"]  # fmt: skip
  assert cli(args) == 0
  assert "3 GB/s is assumed" in capsys.readouterr().out
  assert cli([*args, "--measure-disk", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  measured = float(out.split("measured: disk ")[1].split()[0])
  assert measured > 0 and "is assumed" not in out
  with pytest.raises(SystemExit):
    cli([*args, "--measure-disk", str(tmp_path / "missing")])


# Nonsense in, one line out: (the arguments after the machine's, the flag the line names).
_MACHINE = ["--device-mem", "24GB", "--host-mem", "64GB"]
_NONSENSE = [
  (["--params", "1e30"], "--params"),  # was killed for memory after 86 s
  (["--params", "1e400"], "--params"),
  (["--params", "0"], "--params"),
  (["--params", "-7B"], "--params"),
  (["--params", "nan"], "--params"),
  (["--params", "lots"], "--params"),
  (["--params", "7B", "--device-mem", "0GB"], "--device-mem"),  # was a traceback
  (["--params", "7B", "--device-mem", "2PB"], "--device-mem"),
  (["--params", "7B", "--host-mem", "0.5KB"], "--host-mem"),
  (["--params", "7B", "--host-mem", "1e400GB"], "--host-mem"),
  (["--params", "7B", "--nvme", "-1TB"], "--nvme"),
  (["--params", "7B", "--nvme", "2ZB"], "--nvme"),
  (["--params", "7B", "--activations", "-1GB"], "--activations"),
  (["--params", "7B", "--chunk", "0B"], "--chunk"),
  (["--params", "7B", "--chunk", "1TB"], "--chunk"),
  (["--params", "7B", "--layers", "-3"], "--layers"),  # was a traceback
  (["--params", "7B", "--layers", "0"], "--layers"),  # was accepted
  (["--params", "7B", "--layers", "1e9"], "--layers"),
  (["--params", "7B", "--layers", "many"], "--layers"),
  (["--params", "7B", "--layers", "100000"], "--layers"),
  (["--params", "30M", "--layers", "900"], "--layers"),  # more params than asked for
  (["--params", "7B", "--tokens", "0"], "--tokens"),  # was accepted
  (["--params", "7B", "--tokens", "-5"], "--tokens"),
  (["--params", "7B", "--tokens", "1e12"], "--tokens"),
  (["--params", "70e9", "--tokens", "10000000"], "--tokens"),  # a working set of 86 PB
  (["--params", "7B", "--bus-gbps", "0"], "--bus-gbps"),
  (["--params", "7B", "--disk-gbps", "-2"], "--disk-gbps"),
  (["--params", "7B", "--disk-gbps", "nan"], "--disk-gbps"),
  (["--params", "7B", "--host-adam-gps", "inf"], "--host-adam-gps"),
  (["--params", "7B", "--param-dtype", "int8"], "--param-dtype"),
  (["--params", "7B", "--optimizer", "lion"], "--optimizer"),
  (["--params", "7B", "--compile", "tpu9"], "--compile"),
  (["--params", "7B", "--measure-disk", "/no/such/dir"], "--measure-disk"),
  (["--params", "7B", "--model", "llama3_70b"], "--model"),
  (["--model", "/no/such/model.json"], "--model"),
  (["--params", "7B", "--chunk"], "--chunk"),  # argparse's "expected one argument"
  ([], "--params"),
]


@pytest.mark.parametrize(("args", "flag"), _NONSENSE, ids=[" ".join(a) for a, _ in _NONSENSE])
def test_nonsense_is_one_line_naming_the_flag_and_its_range(capsys, args, flag):
  """Every bad option: exit 2, one line on stderr with the flag (and its range), within 1 s.

  The time is the command's own, its modules imported (as `python -m offlax` imports them).
  """
  import time

  from offlax._src import plan_cli, plan_models  # noqa: F401

  start = time.perf_counter()
  with pytest.raises(SystemExit) as exit_:
    cli(["plan", *_MACHINE[: 0 if "--device-mem" in args else 2], *_MACHINE[2:], *args])
  elapsed = time.perf_counter() - start
  err = capsys.readouterr()
  assert exit_.value.code == 2 and err.out == ""
  assert len(err.err.splitlines()) == 1, err.err
  assert err.err.startswith("python -m offlax plan: error: ") and flag in err.err, err.err
  from offlax._src import plan_options

  ranges = {lim.flag: lim.text for lim in plan_options.LIMITS.values()}
  if flag in ranges:
    assert f"must be {ranges[flag]}" in err.err, err.err
  assert elapsed < 1.0, elapsed


def test_a_missing_option_is_one_line_with_its_range(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli(["plan", "--params", "7B", "--device-mem", "24GB"])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and err == (
    "python -m offlax plan: error: the following arguments are required: --host-mem; host RAM "
    "must be 1MiB to 1PB (--help lists the options)\n"
  )


def test_nonsense_from_the_api_is_the_same_error_as_from_the_cli(capsys):
  """`offlax.plan` raises InvalidOptionError (a ValueError) with the command line's message."""
  cases = [
    ({"device_bytes": 0}, ["--device-mem", "0GB"]),
    ({"host_bytes": 2**70}, ["--host-mem", f"{2**70}B"]),
    ({"nvme_bytes": -1}, None),
    ({"activation_bytes": float("nan")}, None),
    ({"chunk_bytes": 1}, ["--chunk", "1B"]),
    ({"layers": 0}, ["--layers", "0"]),
    ({"layers": True}, None),
    ({"layers": 2.5}, None),
    ({"bus_bytes_per_s": -1e9}, ["--bus-gbps", "-1"]),
    ({"disk_bytes_per_s": float("inf")}, ["--disk-gbps", "inf"]),
    ({"host_adam_params_per_s": 0}, ["--host-adam-gps", "0"]),
  ]
  for kw, flags in cases:
    sizes = {"device_bytes": 24 * 10**9, "host_bytes": 64 * 10**9, **kw}
    with pytest.raises(offlax.errors.InvalidOptionError) as api:
      offlax.plan(_shapes(), optax.adam(1e-3), **sizes)
    assert isinstance(api.value, ValueError)
    message = str(api.value)
    assert message.startswith("plan: --") and f"({next(iter(kw))}=)" in message, message
    if flags is None:
      continue
    given = dict(zip(_MACHINE[::2], _MACHINE[1::2], strict=True)) | dict([flags])
    with pytest.raises(SystemExit):
      cli(["plan", "--params", "7B", *(x for kv in given.items() for x in kv)])
    err = capsys.readouterr().err
    assert message.removeprefix("plan: ") in err, (message, err)
  # A tree of 1e15 params: refused at once, not counted leaf by leaf.
  with pytest.raises(offlax.errors.InvalidOptionError, match="--params: got 1e\\+15"):
    huge = {"w": jax.ShapeDtypeStruct((10**15,), jnp.bfloat16)}
    offlax.plan(huge, optax.adam(1e-3), device_bytes=10**9, host_bytes=10**9)


def test_the_cli_is_one_line_in_a_fresh_process():
  """`python -m offlax plan --params 1e30` (was killed for memory after 86 s): exit 2, one line."""
  import os
  import subprocess
  import sys

  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
  args = [sys.executable, "-m", "offlax", "plan", "--params", "1e30", *_MACHINE]
  out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
  assert (
    out.returncode == 2
    and out.stdout == ""
    and out.stderr
    == (
      "python -m offlax plan: error: --params: got 1e+30; parameters must be 1 to 1e14 (100T) "
      "(--help lists the options)\n"
    )
  ), out
  # Refused before JAX is imported (its import alone takes 1-2 s): what makes it instant.
  code = (
    "import sys\nfrom offlax.__main__ import main\ntry:\n  main(sys.argv[1:])\n"
    "except SystemExit as e:\n  print(e.code, 'jax' in sys.modules)\n"
  )
  out = subprocess.run([sys.executable, "-c", code, *args[3:]], capture_output=True, text=True,
                       timeout=120, env=env)  # fmt: skip
  assert out.stdout == "2 False\n", out


def test_the_largest_count_plans_at_once(capsys):
  """1e14 params (the limit) plan in O(1): at most 64 leaves, whatever the count."""
  import time

  from offlax._src import plan_models

  assert len(plan_models.flat(10**14, jnp.bfloat16)) == 64
  assert len(plan_models.flat(3 * 10**9, jnp.bfloat16)) == 45  # 64M-param leaves below 4.3B
  start = time.perf_counter()
  assert cli(["plan", "--params", "1e14", *_MACHINE, "--nvme", "1PB"]) == 1
  assert time.perf_counter() - start < 10
  assert "DOES NOT FIT" in capsys.readouterr().out


def _llama31_70b(tmp_path):
  shapes = tmp_path / "llama3_70b.json"  # Tunix's llama3_70b, without Tunix
  shapes.write_text('{"layers": 80, "d": 8192, "ffn": 28672, "vocab": 128256, "heads": 64, '
                    '"kv_heads": 8}')  # fmt: skip
  return str(shapes)


@pytest.mark.parametrize("master", [False, True])
def test_one_verdict_from_the_cli_and_the_api_with_the_real_largest_leaf(capsys, tmp_path, master):
  """Llama 3.1 70B on disk: RAM is the update's leaves in flight (its MLP kernel, 4 x in and
  out) and the embedding and head with their gradients and state; the verdict counts it."""
  from offlax._src import plan_models

  model = plan_models.load(_llama31_70b(tmp_path), 2048).model
  params = plan_models.params(model, jnp.bfloat16)
  inner = optax.adamw(1e-3)
  tx = offlax.master_weights(inner) if master else inner
  n = model.n_params
  state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(tx.init, params)))
  p, s = 2, state / n
  leaf, rest = 8192 * 28672, 2 * 128256 * 8192 + 8192  # the MLP kernel; embedding, head, norm
  ram = 4 * leaf * (3 * p + 2 * s) + rest * (2 * p + s)
  assert ram == pytest.approx((61.8 if master else 30.0) * 1e9, abs=0.05e9)
  # Just enough for whole leaves; 1 GB short of it (a budget: the update by row ranges, as
  # much as 2 layers' reads, 4 GiB); too little even for the store's reads and the rest's.
  for host in (ram + 1e9, ram - 1e9, 10e9):
    kw = {"device_bytes": 80 * 10**9, "host_bytes": int(host), "nvme_bytes": 4 * 10**12}
    kw["activation_bytes"] = model.device_bytes()
    api = offlax.plan(params, tx, layers=80, fused=True, **kw)
    assert api.fits == (host > 10e9)
    if host > ram:
      assert api.mode == "params_nvme" and api.bytes["host"] == pytest.approx(ram, rel=1e-6)
      assert "update_bytes" not in api.code
    elif api.fits:
      assert api.mode == "params_nvme" and api.bytes["host"] < host
      assert "update_bytes=4 << 30" in api.code
    else:  # what the LayerStore needs, and what is short
      assert api.mode == "none"
      assert any("all on disk in an offlax.LayerStore" in a and "RAM short by" in a
                 for a in api.advice), api.advice  # fmt: skip
    args = ["plan", "--model", _llama31_70b(tmp_path), "--device-mem", "80GB",
            "--host-mem", f"{int(host)}B", "--nvme", "4TB", "--fused"]  # fmt: skip
    assert cli(args + (["--master"] if master else [])) == (0 if api.fits else 1)
    out = capsys.readouterr().out
    modes = [line for line in out.splitlines() if line.startswith("mode: ")]
    assert len(modes) == 1 and modes[0].startswith(f"mode: {api.mode} "), out
    assert ("DOES NOT FIT" in out) == (not api.fits) and "short" not in out.split("mode: ")[0]
    assert api.table(inner=("offlax.master_weights(optax.adamw(1e-3))" if master
                            else "optax.adamw(1e-3)")) in out  # fmt: skip


def test_the_shape_guessed_from_params_is_a_real_models(capsys):
  """--params 70e9: Llama 3.1 70B's shape (was heads=71, kv_heads=0 and a 32000 vocabulary)."""
  from offlax._src import plan_models

  args = ["--device-mem", "80GB", "--host-mem", "64GB", "--nvme", "4TB", "--master"]
  assert cli(["plan", "--params", "70e9", *args]) == 0
  out = capsys.readouterr().out
  assert out.startswith(
    "assuming the shape of Llama 3.1 70B, the nearest known model to 70B params: 80 layers, "
    "d 8192, ffn 28672, 64 heads (8 kv), vocab 128256: 70.55B params"
  )
  assert "70,553,706,496 params" in out and "kv_heads=0" not in out
  for n, name in [(1.1e9, "TinyLlama 1.1B"), (8e9, "Llama 3.1 8B"), (13e9, "Llama 2 13B"),
                  (15e9, "Qwen3 14B"), (400e9, "Llama 3.1 405B")]:  # fmt: skip
    guess = plan_models.guess(int(n), 2048)
    assert guess.source.startswith(f"{name}, the nearest"), (n, guess.source)
    assert guess.model == plan_models.KNOWN[name]
  # Every known shape is the published model's count (Llama 3.1 8B: 8.03B, 405B: 405.9B).
  counts = {k: round(m.n_params / 1e9, 2) for k, m in plan_models.KNOWN.items()}
  assert counts["Llama 3.1 8B"] == 8.03 and counts["Llama 3.1 405B"] == 405.85
  assert counts["Llama 2 7B"] == 6.74 and counts["Qwen3 14B"] == 14.77
  # Far from any known model: a Llama-shaped one, said so.
  assert "no known model within 1.5x" in plan_models.guess(3 * 10**9, 2048).source
  # --layers L: the user's depth, a Llama-shaped model of it, said so.
  assert plan_models.with_layers(7 * 10**9, 30, 2048).source == (
    "a Llama-shaped model of 7B params in 30 layers"
  )


def test_the_device_breakdown_adds_up(capsys):
  """8B with fp32 master updates: params and gradients 32 GB, the updates another 32 GB."""
  assert cli(["plan", "--params", "8e9", *_MACHINE, "--master", "--activations", "0"]) == 1
  out = capsys.readouterr().out  # (no shape guessed: activations given)
  line = next(x for x in out.splitlines() if x.startswith("- the NVMe tier"))
  held = line.split("the device holds ")[1].split("; RAM")[0]
  assert held.startswith("params and gradients (32.0 GB), 2 slices (134.2 MB) and the updates "
                         "written whole in their own dtype (32.0 GB")  # fmt: skip
  parts = [parse_bytes(x.split(")")[0].split(";")[0].replace(" ", "")) for x in held.split("(")[1:]]
  total = parse_bytes(held.rsplit(": ", 1)[1].replace(" ", ""))
  assert abs(sum(parts) - total) <= 0.1e9, (parts, total)


def test_update_bytes_counts_the_store_budget_and_the_rest_state_on_nvme(capsys, tmp_path):
  """Llama 3.1 405B on one H200 with 64 GB of RAM (issue 44.5): whole leaves in flight and
  the rest's state in RAM do not fit; a budget (the plan's own, or `--update-bytes 16GB`)
  counts the store's update at it, and the rest's state on the NVMe tier (its params and
  the largest one's gradient, 4.2B x 2 B + 2.1B x 2 B, and 8 slices in RAM: the compile holds
  one of the rest's gradients in host memory at a time, `plan_disk.params_on_disk_bytes`)."""
  shapes = tmp_path / "llama3p1_405b.json"  # Tunix's llama3p1_405b, without Tunix
  shapes.write_text('{"layers": 126, "d": 16384, "ffn": 53248, "vocab": 128256, "heads": 128, '
                    '"kv_heads": 8}')  # fmt: skip
  args = ["plan", "--model", str(shapes), "--device-mem", "141GB", "--host-mem", "64GB",
          "--nvme", "16TB", "--master"]  # fmt: skip
  # Without --update-bytes, whole leaves in flight would not fit: the plan picks a budget,
  # the model's reads (2 layers of 3.2B bf16 params, 12 GiB), and says it in the code.
  assert cli(args) == 0
  out = capsys.readouterr().out
  rest, grad = 2 * 128256 * 16384 + 16384, 128256 * 16384  # params; the embedding's gradient
  ram = 12 * 2**30 + 2 * (rest + grad) + 8 * 64 * 2**20
  assert "mode: params_nvme (fits)" in out and f"RAM {ram / 1e9:.1f} GB" in out
  assert "update_bytes=12 << 30)" in out
  assert cli([*args, "--update-bytes", "16GB"]) == 0
  out = capsys.readouterr().out
  ram = 16e9 + 2 * (rest + grad) + 8 * 64 * 2**20  # the budget (above 2 layers' reads), the rest
  assert "mode: params_nvme (fits)" in out and f"RAM {ram / 1e9:.1f} GB" in out
  assert "update_bytes=16000000000)" in out and "their state on the NVMe tier" in out
  with pytest.raises(SystemExit):
    cli([*args, "--update-bytes", "1KB"])
  assert "--update-bytes (update_bytes=): got 1.0 kB" in capsys.readouterr().err


def test_a_tunix_model_counts_its_unrolled_working_set(tmp_path):
  """``--model NAME`` of a Tunix config counts its step as Tunix runs it: layers unrolled,
  each one's input saved (`Llama.unrolled_device_bytes`, 21.3 GB for 405B: the compiled step's
  21.9 GB with the rest's state in host memory, 19.7 GB with it on the NVMe tier,
  benchmarks/capacity.py); the same shapes from a JSON file, offlax's scanned step.
  tests/test_gpu_compile.py checks the figure against a compiled Tunix step (slow)."""
  pytest.importorskip("tunix")  # (the run has imported it: test_safetensors.py does)
  from offlax._src import plan_models

  shape = plan_models.load("llama3p1_405b", 2048)
  assert shape.unrolled and shape.device_bytes() == shape.model.unrolled_device_bytes()
  assert shape.device_bytes() == pytest.approx(21.3e9, rel=0.01)
  # (The CLI's output for it: docs/planner.md, run by tests/test_docs.py.)
  shapes = tmp_path / "405b.json"
  shapes.write_text(json.dumps(dataclasses.asdict(shape.model)))
  json_shape = plan_models.load(str(shapes), 2048)
  assert not json_shape.unrolled and json_shape.device_bytes() == shape.model.device_bytes()


def test_the_cli_plans_without_starting_a_gpu_backend(tmp_path):
  """With the gpu-compile extra on a machine without a GPU and JAX_PLATFORMS unset, a plan
  that builds an optimizer (`--state-bits 8`) printed the CUDA plugin's failed start, a
  traceback; and it built offlax's native library (seconds on a fresh machine). The planner
  needs shapes only: neither happens."""
  import os
  import subprocess
  import sys

  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["OFFLAX_CACHE_DIR"] = str(tmp_path)  # where a build would put the library
  args = [sys.executable, "-m", "offlax", "plan", "--params", "1e9", "--device-mem", "80GB",
          "--host-mem", "48GB", "--master", "--state-bits", "8"]  # fmt: skip
  out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
  assert out.returncode == 0 and "fits" in out.stdout, out
  assert "Traceback" not in out.stderr and "ERROR" not in out.stderr, out.stderr[-2000:]
  assert not list(tmp_path.iterdir()), "the plan built the native library"
