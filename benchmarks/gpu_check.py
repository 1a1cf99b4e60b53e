"""GPU check of the host tier: correctness, device bytes, step time, bandwidth, overlap.

What the CPU cannot show, checked in one run of a few minutes on a GPU machine:

1. correctness: `offlax.offload(optax.adamw)` streamed in small slices (leaves cut into rows and
   rejoined on the host), in one slice, and with `HostTier(compute="host")` (the update under
   `compute_on("device_host")`), and with the NVMe tier (its callbacks move the slices
   between the GPU and the disk), against plain optax on the same GPU, over 3 steps;
2. device memory: `compiled.memory_analysis()` of a jitted AdamW step on ~1B parameters
   (compiled from shapes, nothing allocated), all state on the device vs the host tier vs
   host compute:
   device and host bytes, and device bytes per parameter;
3. step time at a size that fits both ways (median of `--steps` after warm-up, synchronised):
   state on the device vs streamed from `pinned_host` vs host compute, and the overhead ratio
   (goal <= 1.15x for the stream);
4. host<->device bandwidth of one large transfer each way;
5. overlap: the share of the state traffic hidden behind compute,
   1 - (t_stream - t_device) / (state bytes moved / bandwidth);
6. whether offlax's native Adam kernel (an XLA:CPU FFI call) can run inside a
   GPU program's host computation, and how fast (an experiment: its error is
   recorded, not raised);
7. the Flax examples (NNX LM with each tier, Linen) for a few steps;
8. the device's peak bytes in a real step of each offloaded mode beside what
   `offlax.compile_for_gpu` predicts for it without a GPU;
9. params, gradients and state in host memory (`offlax.scan_layers`, host compute,
   `offlax.update_and_apply`) on a Llama-shaped model: the params after 3 steps against the
   same model trained on the device, the device peak against the compiled prediction, and
   the step time of both.

Writes `<out>/gpu_check.json` and prints a short table last. On a CPU it runs too (at
`--size-scale 0.001` in the test suite) but its figures mean nothing there.

    python benchmarks/gpu_check.py                   # on the GPU machine
    python benchmarks/gpu_check.py --size-scale 0.1  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import _common  # noqa: E402


def _params(n_params: float, layers: int = 16):
  """A transformer-shaped fp32 tree of about `n_params` parameters."""
  import jax
  import jax.numpy as jnp

  d = max(8, int((n_params / (layers * 12)) ** 0.5) // 8 * 8)
  shapes = {}
  for i in range(layers):
    shapes[f"layer{i:02d}"] = {
      "qkv": (d, 3 * d),
      "out": (d, d),
      "up": (d, 4 * d),
      "down": (4 * d, d),
      "bias": (4 * d,),
      "scale": (d,),
    }
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


def _step(tx):
  import optax

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _materialise(shapes, seed):
  import jax

  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))
  return jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype) * 0.1, shapes)


def check_correctness(offlax, optax, jax, np):
  with tempfile.TemporaryDirectory(prefix="offlax-gpu-check-") as tmp:
    nvme = offlax.NVMeTier(tmp, cache_bytes=4096, chunk_bytes=64 * 1024, progress=False)
    try:
      return _correctness(offlax, optax, jax, np, nvme)
    finally:
      nvme.close()


def _correctness(offlax, optax, jax, np, nvme):
  shapes = _params(2e5, layers=2)
  params = _materialise(shapes, 0)
  inner = optax.adamw(1e-3)
  host = offlax.HostTier(compute="host")
  results = {}
  # The last two run offlax's native kernel in the host computation (JAX lowers
  # that region for the CPU): the moments only, then the update too (within
  # 2e-6 relative of optax's, so not bit-exact by design).
  for name, tier, offloaded in (
    ("one_slice", offlax.HostTier(chunk_bytes=2**40), inner),
    ("streamed", offlax.HostTier(chunk_bytes=64 * 1024), inner),
    ("host_compute", host, inner),
    ("host_compute_offlax_adamw", host, offlax.adamw(1e-3)),
    ("host_compute_native_update", host, offlax.adamw(1e-3, native_update=True)),
    ("host_compute_whole_step", host, offlax.master_weights(offlax.adamw(1e-3))),
    ("nvme", nvme, inner),
  ):
    txs = {"plain": inner, "offlax": offlax.offload(offloaded, tier)}
    out = {}
    try:
      for label, tx in txs.items():
        p, s = params, tx.init(params)
        step = jax.jit(_step(tx))
        for i in range(3):
          p, s = step(p, s, jax.tree.map(lambda x, i=i: jax.numpy.sin(x * (i + 1)), p))
        out[label] = jax.block_until_ready(p)
    except Exception as e:  # recorded: the table shows which variant failed and why
      results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
      continue
    diff = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for a, b in zip(jax.tree.leaves(out["plain"]), jax.tree.leaves(out["offlax"]), strict=True)
    )
    results[name] = {"max_abs_diff": diff, "bit_exact": diff == 0.0}
  return results


def native_in_host_compute(jax, np):
  """Whether offlax's native Adam kernel runs inside a GPU program's host computation.

  JAX lowers a `compute_on("device_host")` region for the CPU platform, so
  `offlax.adam` in `HostTier(compute="host")` puts its kernel (an FFI call) in
  the GPU program's host computation, which the CUDA plugin compiles with its
  own XLA:CPU; offlax registers the kernels there (`offlax/_src/plugin_ffi.py`;
  compiling without a GPU proves only that they are found). Tried here on the
  bare kernel, with errors recorded and both times (`check_correctness` runs
  it through offlax); the kernel runs on one thread if the plugin gives its
  host computations no intra-op pool, which the times show.
  """
  import jax.numpy as jnp
  from jax.experimental.compute_on import compute_on2

  from offlax._src import host_adam

  out = {"kernel_built": host_adam.native_available()}
  if not out["kernel_built"]:
    return out
  n = 1 << 20
  g, m, v = (jnp.full((n,), x, jnp.float32) for x in (0.005, 0.001, 1e-6))
  hyper = host_adam._Hyper(0.9, 0.999, 0.1, 0.001, 1e-8, 0.0, -1e-3, False, 0.0)
  vector = hyper.vector(moments_only=False)

  def on_host(fn):
    def relabelled(*args):  # typed as device values inside the region, as offlax does
      return fn(*(jax.device_put(x, jax.memory.Space.Device) for x in args))

    def step(g, m, v, vector):
      region = compute_on2(
        relabelled, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host
      )
      to_host = lambda x: jax.device_put(x, jax.memory.Space.Host)
      return region(to_host(g), to_host(m), to_host(v), to_host(vector))

    return jax.jit(step)

  native = on_host(lambda g, m, v, h: host_adam.fused_update(g, m, v, h, h, decay=False))

  def reference(g, m, v, h):  # the fused kernel's arithmetic, in JAX
    m = h[0] * g + h[1] * m
    v = h[2] * (g * g) + h[3] * v
    return h[8] * (m / (h[4] * (jnp.sqrt(v / h[5] + h[6]) + h[7]))), m, v

  plain = on_host(reference)
  try:
    got = [np.asarray(x) for x in native(g, m, v, vector)]
    want = [np.asarray(x) for x in plain(g, m, v, vector)]
    out["runs"] = True
    out["max_rel_diff"] = max(
      float(np.max(np.abs(a - b) / (np.abs(b) + 1e-30))) for a, b in zip(got, want, strict=True)
    )
    out["native_s"] = statistics.median(_time(native, (g, m, v, vector), 5, 1, jax, keep=True))
    out["plain_s"] = statistics.median(_time(plain, (g, m, v, vector), 5, 1, jax, keep=True))
  except Exception as e:  # the experiment's answer, not a failure of the check
    out["runs"] = False
    out["error"] = f"{type(e).__name__}: {str(e)[:500]}"
  return out


def host_step_threads(scale: float) -> dict:
  """The native host step on this machine's CPU, all its cores and one (issue 20).

  `benchmarks/host_adam.py` in a subprocess on the CPU backend (the host step
  is XLA:CPU code also in a GPU program's host computation), the headline
  variants only; DeepSpeed joins where `benchmarks/.venv-torch` exists.
  """
  import pathlib
  import subprocess

  script = pathlib.Path(__file__).resolve().parent / "host_adam.py"
  cores = os.cpu_count() or 1
  with tempfile.TemporaryDirectory() as out:
    cmd = [sys.executable, str(script), "--sizes-m", f"{max(1.0, 256 * scale):g}"]
    cmd += ["--threads", str(cores), "1", "--steps", "5", "--out", out]
    run = subprocess.run(
      cmd, capture_output=True, text=True, timeout=1200, env=dict(os.environ, JAX_PLATFORMS="cpu")
    )
    if run.returncode != 0:
      return {"error": run.stderr.strip()[-500:]}
    result = json.loads(pathlib.Path(out, "host_adam.json").read_text())
  return {
    size: {name: s["median"] for name, s in row["params_per_s"].items()}
    for size, row in result["sizes"].items()
  }


def examples(steps: int) -> dict:
  """The Flax examples, a few steps each: that they run here, and their last losses."""
  import importlib.util
  import pathlib
  import tempfile

  root = pathlib.Path(__file__).resolve().parent.parent / "examples"
  out = {}
  lm = [("lm_nnx.py", ["--tier", t, "--steps", str(steps), "--no-progress"])
        for t in ("host", "host_compute", "nvme")]  # fmt: skip
  runs = [*lm, ("linen_train_state.py", ["--steps", str(steps)])]
  for name, args in runs:
    key = f"{name} {' '.join(args[:2])}"
    spec = importlib.util.spec_from_file_location(name[:-3], root / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name[:-3]] = module
    try:
      spec.loader.exec_module(module)
      with tempfile.TemporaryDirectory() as tmp:
        extra = ["--dir", tmp, "--dim", "32", "--seq", "32"] if name == "lm_nnx.py" else []
        out[key] = {"result": float(module.main([*args, *extra]))}
    except Exception as e:  # recorded: the point is to learn what fails on this machine
      out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  return out


def memory_analysis(offlax, optax, jax, n_params):
  shapes = _params(n_params)
  device = jax.devices()[0]
  out = {"params": sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))}
  # NamedShardings: JAX types a SingleDeviceSharding's pinned_host as device memory.
  mesh = jax.sharding.Mesh(np.array([device]), ("d",))
  replicated = jax.sharding.PartitionSpec()
  host = jax.sharding.NamedSharding(mesh, replicated, memory_kind="pinned_host")
  on_dev = jax.sharding.NamedSharding(mesh, replicated)
  param_specs = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=on_dev), shapes
  )
  for name, tx in (
    ("on_device", optax.adamw(1e-3)),
    ("host_tier", offlax.offload(optax.adamw(1e-3))),
    ("host_compute", offlax.offload(optax.adamw(1e-3), compute="host")),
  ):
    offloaded = name != "on_device"
    state_specs = jax.tree.map(
      lambda s, offloaded=offloaded: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=host if offloaded and s.ndim else on_dev
      ),
      jax.eval_shape(tx.init, shapes),
    )
    compiled = (
      jax.jit(_step(tx), donate_argnums=(0, 1))
      .lower(param_specs, state_specs, param_specs)
      .compile()
    )
    m = compiled.memory_analysis()
    fields = (
      "argument_size_in_bytes",
      "output_size_in_bytes",
      "temp_size_in_bytes",
      "alias_size_in_bytes",
      "host_argument_size_in_bytes",
      "host_output_size_in_bytes",
      "host_temp_size_in_bytes",
    )
    row = {f: int(getattr(m, f, 0) or 0) for f in fields}
    row["device_peak_bytes"] = (
      row["argument_size_in_bytes"] + row["output_size_in_bytes"] - row["alias_size_in_bytes"]
    ) + row["temp_size_in_bytes"]
    row["device_bytes_per_param"] = row["device_peak_bytes"] / out["params"]
    out[name] = row
  # The planner's accounting beside the compiler's (it counts params, gradients
  # and state; the compiled step adds its temporaries).
  plan = offlax.plan(shapes, optax.adamw(1e-3), device_bytes=2**62, host_bytes=2**62)
  a = plan.assumptions
  out["planner"] = {
    "param_grad_state_bytes": a["param_bytes"] + a["grad_bytes"] + a["state_bytes"],
    "state_bytes": a["state_bytes"],
    "host_tier_host_argument_bytes": out["host_tier"]["host_argument_size_in_bytes"],
  }
  return out


def measured_vs_compiled(offlax, optax, jax, n_params):
  """A real step's device peak on this GPU beside `offlax.compile_for_gpu`'s prediction.

  Runs one donated AdamW step per mode on real arrays and reads the device's
  `peak_bytes_in_use` above what the arguments hold; the prediction compiles
  the same step from shapes for an H200 target (XLA's GPU compiler, as on a
  machine without a GPU). Errors are recorded, not raised.
  """
  from offlax._src import gpu_compile

  device = jax.devices()[0]
  out = {}
  for mode, compute in (("streamed", "device"), ("host", "host")):
    try:
      params = _materialise(_params(n_params), 0)
      tx = offlax.offload(optax.adamw(1e-3), compute=compute)
      state = tx.init(params)
      step = jax.jit(gpu_compile.update_step(tx), donate_argnums=(0, 1))
      x = jax.numpy.float32(1e-3)
      predicted = None
      if offlax.gpu_compile_available():
        specs = gpu_compile.state_specs
        n = sum(p.size for p in jax.tree.leaves(params))
        predicted = offlax.compile_for_gpu(
          step, specs(params), specs(state), x, target="h200", n_params=n
        ).device_peak
      jax.block_until_ready((params, state))
      before = device.memory_stats() or {}
      base = before.get("bytes_in_use", 0)
      params, state = jax.block_until_ready(step(params, state, x))
      after = device.memory_stats() or {}
      peak = after.get("peak_bytes_in_use", 0)
      out[mode] = {
        "base_bytes": base,
        "peak_bytes": peak,
        "predicted_peak_bytes": predicted,
        "ratio": peak / predicted if predicted else None,
      }
      del params, state
    except Exception as e:  # recorded: the table shows which mode failed and why
      out[mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  return out


def params_on_host(offlax, optax, jax, scale, steps):
  """The params-on-host train step on this GPU beside the plain one; errors are recorded."""
  from offlax._src import gpu_compile, llama

  layers = max(2, int(16 * min(1.0, scale * 4)))
  m = llama.Llama(layers=layers, d=2048, ffn=5632, vocab=32000, heads=16, tokens=2048)
  if scale < 0.01:  # the CPU smoke run
    m = llama.Llama(layers=2, d=128, ffn=256, vocab=256, heads=2, tokens=64)
  out: dict = {"n_params": m.n_params, "layers": m.layers}
  try:
    device = jax.devices()[0]
    tokens = jax.random.randint(jax.random.key(1), (m.tokens,), 0, m.vocab)
    inner = offlax.master_weights(optax.adamw(1e-4))
    plain = jax.jit(llama.train_step(m, inner, offloaded=False), donate_argnums=(0, 1))
    q = _materialise(llama.param_specs(m, None), 0)
    r = inner.init(q)
    p = offlax.to_host(_materialise(llama.param_specs(m, None), 0))
    tx = offlax.offload(inner, compute="host")
    s = tx.init(p)
    step = jax.jit(llama.train_step(m, tx), donate_argnums=(0, 1))
    if offlax.gpu_compile_available():
      specs = gpu_compile.state_specs
      out["predicted_peak_bytes"] = offlax.compile_for_gpu(
        step, specs(p), specs(s), tokens, target="h200"
      ).device_peak
    jax.block_until_ready((p, s))
    out["base_bytes"] = (device.memory_stats() or {}).get("bytes_in_use", 0)
    for _ in range(3):
      p, s, _ = step(p, s, tokens)
      q, r, _ = plain(q, r, tokens)
    jax.block_until_ready((p, q))
    out["peak_bytes"] = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
    out["param_kinds"] = sorted({x.sharding.memory_kind for x in jax.tree.leaves(p)})
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.float32(a) - np.float32(b)))), p, q)
    out["max_abs_diff_after_3_steps"] = max(jax.tree.leaves(diff))
    out["offlax_median_s"] = statistics.median(
      _time(lambda p, s: step(p, s, tokens)[:2], (p, s), steps, 1, jax)
    )
    out["plain_median_s"] = statistics.median(
      _time(lambda q, r: plain(q, r, tokens)[:2], (q, r), steps, 1, jax)
    )
    out["ratio"] = out["offlax_median_s"] / out["plain_median_s"]
  except Exception as e:  # recorded: the table shows it
    out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


def _time(fn, args, steps, warmup, jax, keep=False):
  """Times `fn`, feeding each call the last one's results unless `keep`."""
  for _ in range(warmup):
    out = fn(*args)
    args = args if keep else out
  jax.block_until_ready(out if warmup else args)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
    args = args if keep else out
  return times


def step_times(offlax, optax, jax, n_params, steps, warmup):
  shapes = _params(n_params)
  grads = _materialise(shapes, 1)
  out = {}
  for name, tx in (
    ("on_device", optax.adamw(1e-3)),
    ("stream", offlax.offload(optax.adamw(1e-3))),
    ("one_slice", offlax.offload(optax.adamw(1e-3), chunk_bytes=2**40)),
    ("host_compute", offlax.offload(optax.adamw(1e-3), compute="host")),
  ):
    params = _materialise(shapes, 0)
    state = tx.init(params)
    step = jax.jit(_step(tx), donate_argnums=(0, 1))
    times = _time(
      lambda p, s, step=step: (*step(p, s, grads),), (params, state), steps, warmup, jax
    )
    out[name] = _common.stats_of(times, "_s")
    del params, state
  base = out["on_device"]["median_s"]
  for name in ("stream", "one_slice", "host_compute"):
    out[name]["ratio"] = out[name]["median_s"] / base
  return out


def bandwidth(jax, n_bytes):
  import jax.numpy as jnp

  x = jnp.ones(n_bytes // 4, jnp.float32)
  jax.block_until_ready(x)
  out = {}
  for name, space in (("device_to_host", jax.memory.Space.Host),):
    h = jax.device_put(x, space)
    jax.block_until_ready(h)
    times = []
    for _ in range(5):
      start = time.perf_counter()
      jax.block_until_ready(jax.device_put(x, space))
      times.append(time.perf_counter() - start)
    out[name] = n_bytes / statistics.median(times)
    times = []
    for _ in range(5):
      start = time.perf_counter()
      jax.block_until_ready(jax.device_put(h, jax.memory.Space.Device))
      times.append(time.perf_counter() - start)
    out["host_to_device"] = n_bytes / statistics.median(times)
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size-scale", type=float, default=1.0)
  _common.add_steps_arguments(parser, steps=20, warmup_help="untimed steps after compiling (2)")
  _common.add_out_argument(parser, "gpu_check")
  args = parser.parse_args(argv)

  import jax
  import optax

  import offlax

  scale = args.size_scale
  result = {"benchmark": "gpu_check", **_common.environment(devices=True), "size_scale": scale}
  result["memories"] = [m.kind for m in jax.devices()[0].addressable_memories()]
  result["correctness"] = check_correctness(offlax, optax, jax, np)
  result["native_in_host_compute"] = native_in_host_compute(jax, np)
  result["examples"] = examples(max(3, int(20 * min(1.0, scale * 100))))
  result["memory"] = memory_analysis(offlax, optax, jax, 1e9 * scale)
  result["measured_vs_compiled"] = measured_vs_compiled(offlax, optax, jax, 1e9 * scale)
  result["params_on_host"] = params_on_host(offlax, optax, jax, scale, min(args.steps, 5))
  result["time"] = step_times(offlax, optax, jax, 2.5e8 * scale, args.steps, args.warmup)
  result["bandwidth_bytes_per_s"] = bandwidth(jax, int(2**30 * scale) // 4 * 4 or 4096)
  result["host_step_params_per_s"] = host_step_threads(scale)

  # State bytes moved per streamed step: mu and nu in and out (4 x 4 bytes per parameter).
  n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(_params(2.5e8 * scale)))
  bw = min(result["bandwidth_bytes_per_s"].values())
  transfer_s = 16 * n / bw
  extra_s = result["time"]["stream"]["median_s"] - result["time"]["on_device"]["median_s"]
  result["overlap"] = {
    "state_bytes_moved": 16 * n,
    "transfer_s_at_bandwidth": transfer_s,
    "extra_step_s": extra_s,
    "hidden_fraction": max(0.0, min(1.0, 1 - extra_s / transfer_s)) if transfer_s else None,
  }

  def table(r):
    mem = r["memory"]
    t = r["time"]
    lines = [
      f"gpu_check on {r['devices']} (jax {r['jax_version']}), memories {r['memories']}",
      "correctness (max|diff| vs optax): "
      + ", ".join(
        f"{k} {v['max_abs_diff']:.3g}" if "error" not in v else f"{k} FAILED ({v['error'][:80]})"
        for k, v in r["correctness"].items()
      ),
      f"device bytes/param ({mem['params']:,} params): on device "
      f"{mem['on_device']['device_bytes_per_param']:.2f}, host tier "
      f"{mem['host_tier']['device_bytes_per_param']:.2f} (host args "
      f"{mem['host_tier']['host_argument_size_in_bytes'] / 2**30:.2f} GiB), host compute "
      f"{mem['host_compute']['device_bytes_per_param']:.2f}",
      f"step: on device {t['on_device']['median_s'] * 1e3:.1f} ms, stream "
      f"{t['stream']['median_s'] * 1e3:.1f} ms ({t['stream']['ratio']:.3f}x, goal <= 1.15x), "
      f"one slice {t['one_slice']['median_s'] * 1e3:.1f} ms ({t['one_slice']['ratio']:.3f}x), "
      f"host compute {t['host_compute']['median_s'] * 1e3:.1f} ms "
      f"({t['host_compute']['ratio']:.3f}x)",
      "bandwidth: "
      + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in r["bandwidth_bytes_per_s"].items()),
      f"overlap: {r['overlap']['hidden_fraction']} of the state traffic hidden behind compute",
      f"native Adam kernel under a GPU host computation: {r['native_in_host_compute']}",
      f"device peak, real run vs compile_for_gpu: {r['measured_vs_compiled']}",
      f"params, gradients and state on the host: {r['params_on_host']}",
      f"examples: {r['examples']}",
      f"native host step (params/s, all cores and one): {r['host_step_params_per_s']}",
    ]
    print("\n".join(lines))

  args.out.mkdir(parents=True, exist_ok=True)
  _common.write_json(result, args.out / "gpu_check.json")
  table(result)
  return result


if __name__ == "__main__":
  main()
