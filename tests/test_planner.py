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
  # Not enough RAM for params and gradients: all on disk (an offlax.LayerStore) ...
  r = offlax.plan(shapes, tx, host_bytes=40 * 10**9, layers=40, **sizes)
  assert (r.mode, r.fits) == ("params_nvme", True)
  assert 0 <= r.bytes["nvme"] - (2 * 14 + 2) * n <= 64  # and the step counts
  # ... unless the disk cannot hold two generations of params and state: nothing fits.
  small_disk = {**sizes, "nvme_bytes": 25 * n}
  assert not offlax.plan(shapes, tx, host_bytes=40 * 10**9, layers=40, **small_disk).fits


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
  # The 13B case: its needs, from its sizes (26 GB of bf16 params, 156 GB of state).
  cli(["plan", *cases[0]])
  out = capsys.readouterr().out
  assert f"{(2 * 26 + 156) * gb / 1e9:.1f} GB (RAM short by 80.0 GB)" in out
  assert f"disk {3 * 156:.1f} GB (disk short by {3 * 156:.1f} GB)" in out  # keep + 1 copies
  # With that disk, the plan takes the way it named.
  assert cli(["plan", *cases[0], "--nvme", "468GB"]) == 0
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
  # The --layers line is the plan that --layers gives.
  layers = int(out.split("with --layers ")[1].split()[0])
  line = next(x for x in out.splitlines() if x.startswith("- with --layers"))
  cli(["plan", "--params", "7B", "--device-mem", "80GB", "--host-mem", "256GB", "--master",
       "--layers", str(layers)])  # fmt: skip
  again = capsys.readouterr().out
  assert line.split("mode ")[1].split(",")[0] in again  # "host (fits)"


def test_params_in_host_memory_proposed_for_a_usual_decoder_or_a_named_model(capsys, tmp_path):
  """The seed's 13B on 24 GB: params in host memory, the state on NVMe, not DOES NOT FIT."""
  args = ["--device-mem", "24GB", "--host-mem", "128GB", "--nvme", "2TB", "--master"]
  assert cli(["plan", "--params", "13e9", *args]) == 0
  out = capsys.readouterr().out
  assert "assuming a usual decoder of this size (Llama(layers=39" in out
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
@pytest.mark.parametrize("master, per_param", [(True, 36), (False, 20)])  # bf16 moments: 20
def test_params_on_disk_when_they_do_not_fit_in_ram(capsys, tmp_path, master, per_param):
  """70B on one 80 GB GPU with 64 GB of RAM: params, gradients and state in a LayerStore."""
  args = ["plan", "--params", "70e9", "--device-mem", "80GB", "--host-mem", "64GB",
          "--nvme", "4TB", *(["--master"] if master else []), "--disk-gbps", "2"]  # fmt: skip
  assert cli(args) == 0
  out = capsys.readouterr().out
  assert "mode: params_nvme (fits)" in out and "offlax.LayerStore.create(" in out
  assert f"moves {per_param} B/param on disk" in out
  assert "the params outside the layers (0.58B: embedding, head, final norm)" in out
  if master:  # 16 B/param of them: the embedding's RAM beside the store's
    assert cli([*args[:6], "50GB", *args[7:]]) == 1
    assert "RAM short by 3.9 GB once those are counted" in capsys.readouterr().out
  n = 70e9
  shapes = {"w": jax.ShapeDtypeStruct((70, int(n) // 70), jnp.bfloat16)}
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
