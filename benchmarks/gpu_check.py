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
   the step time of both;
10. a whole Llama train step with the state on the device, streamed and in host compute
   (what the transfers can hide behind), and host compute's step in parts, with each of the
   native kernel's thread pools;
11. the native host step on the CPU backend, all cores and one;
12. `offlax.HostStateSave` / `HostStateRestore` of the host tier's state (its `pinned_host`
   arrays copied out as their files are written): exact, memory kinds kept, GB/s against
   the raw disk measured just before.

Each section's result (or error) is written to `<out>/gpu_check.json` as it ends, with a plot
(`gpu_check.png`) and a short table last. `--only` picks sections, `--budget-s` skips those
not started in time (a lent GPU's minutes). On a CPU it runs too (at `--size-scale 0.001` in
the test suite) but its figures mean nothing there.

    python benchmarks/gpu_check.py                   # on the GPU machine, about 8 minutes
    python benchmarks/gpu_check.py --only time train_step_overlap --budget-s 300
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


def _materialise(shapes, seed, place=lambda x: x):
  """Random arrays of `shapes`, each `place`d as it is made (one leaf at a time on the device)."""
  import jax

  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))

  def make(s):
    return jax.block_until_ready(place(jax.random.normal(next(keys), s.shape, s.dtype) * 0.1))

  return jax.tree.map(make, shapes)


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
      results[name] = {"error": _error(e)}
      continue
    diff = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for a, b in zip(jax.tree.leaves(out["plain"]), jax.tree.leaves(out["offlax"]), strict=True)
    )
    results[name] = {"max_abs_diff": diff, "bit_exact": diff == 0.0}
  return results


def native_in_host_compute(jax, np, sizes=(1 << 20, 1 << 26)):
  """Whether offlax's native Adam kernel runs inside a GPU program's host computation.

  JAX lowers a `compute_on("device_host")` region for the CPU platform, so
  `offlax.adam` in `HostTier(compute="host")` puts its kernel (an FFI call) in
  the GPU program's host computation, which the CUDA plugin compiles with its
  own XLA:CPU; offlax registers the kernels there (`offlax/_src/plugin_ffi.py`;
  compiling without a GPU proves only that they are found). Tried here on the
  bare kernel, with errors recorded and both times (`check_correctness` runs
  it through offlax); the kernel runs on one thread if the plugin gives its
  host computations no intra-op pool, which the times at 64M params show
  (`params_per_s` against `host_step_params_per_s`, all cores and one).
  """
  import jax.numpy as jnp

  from offlax._src import host_adam
  from offlax._src.compat import compute_on  # compute_on2 in JAX 0.10, compute_on after 0.11

  out = {"kernel_built": host_adam.native_available(), "cpu_count": os.cpu_count()}
  if not out["kernel_built"]:
    return out
  hyper = host_adam._Hyper(0.9, 0.999, 0.1, 0.001, 1e-8, 0.0, -1e-3, False, 0.0)
  vector = hyper.vector(moments_only=False)

  def on_host(fn):
    def relabelled(*args):  # typed as device values inside the region, as offlax does
      return fn(*(jax.device_put(x, jax.memory.Space.Device) for x in args))

    def step(g, m, v, vector):
      region = compute_on(
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
    for n in sizes:
      g, m, v = (jnp.full((n,), x, jnp.float32) for x in (0.005, 0.001, 1e-6))
      got = [np.asarray(x) for x in native(g, m, v, vector)]
      want = [np.asarray(x) for x in plain(g, m, v, vector)]
      native_s = statistics.median(_time(native, (g, m, v, vector), 5, 1, jax, keep=True))
      plain_s = statistics.median(_time(plain, (g, m, v, vector), 5, 1, jax, keep=True))
      out[f"{n / 2**20:.3g}M"] = {
        "max_rel_diff": max(
          float(np.max(np.abs(a - b) / (np.abs(b) + 1e-30))) for a, b in zip(got, want, strict=True)
        ),
        "native_s": native_s,
        "plain_s": plain_s,
        "native_params_per_s": n / native_s,
        "plain_params_per_s": n / plain_s,
      }
      del g, m, v, got, want
    out["runs"] = True
  except Exception as e:  # the experiment's answer, not a failure of the check
    out["runs"] = False
    out["error"] = _error(e)
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
    cmd += ["--threads", str(cores), "1", "--steps", "5", "--repeats", "1", "--out", out]
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
      out[key] = {"error": _error(e)}
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
    # The same with offlax's AdamW: its native kernel in the host computation.
    ("host_compute_native", offlax.offload(offlax.adamw(1e-3), compute="host")),
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


def _predicted_peak(offlax, step, params, state, *args, n_params=None):
  """`compile_for_gpu`'s device peak of `step` for an H200, and its error (one is None).

  The prediction's own error must not cost the measurement beside it.
  """
  from offlax._src import gpu_compile

  if not offlax.gpu_compile_available():
    return None, None
  specs = gpu_compile.state_specs
  try:
    m = offlax.compile_for_gpu(
      step, specs(params), specs(state), *args, target="h200", n_params=n_params
    )
  except Exception as e:
    return None, _error(e)
  return m.device_peak, None


def measured_vs_compiled(offlax, optax, jax, n_params, modes=("host", "streamed"), child=True):
  """A real step's device peak on this GPU beside `offlax.compile_for_gpu`'s prediction.

  Runs one donated AdamW step per mode on real arrays and reads the device's
  `peak_bytes_in_use` (which only grows: each mode runs in a fresh process on a
  GPU, `_child`); the prediction compiles the same step from shapes for an H200
  target (XLA's GPU compiler, as on a machine without a GPU). Errors are
  recorded, not raised.
  """
  if child:
    return {m: _child("measured_vs_compiled", n_params=n_params, modes=[m])[m] for m in modes}
  from offlax._src import gpu_compile

  (mode,) = modes
  device = jax.devices()[0]
  out = {}
  try:
    params = _materialise(_params(n_params), 0)  # each leaf ready as it is made
    made = device.memory_stats() or {}
    tx = offlax.offload(optax.adamw(1e-3), compute="host" if mode == "host" else "device")
    state = jax.block_until_ready(tx.init(params))
    # The state is made in host memory: the device holds the params alone (Adam's state made
    # there first would add 8 B/param, as it did before `host_params.init(via_host=...)`).
    init = {
      "params_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
      "peak_after_params_bytes": made.get("peak_bytes_in_use", 0),
      "peak_after_init_bytes": (device.memory_stats() or {}).get("peak_bytes_in_use", 0),
    }
    step = jax.jit(gpu_compile.update_step(tx), donate_argnums=(0, 1))
    x = jax.numpy.float32(1e-3)
    n = sum(p.size for p in jax.tree.leaves(params))
    predicted, why = _predicted_peak(offlax, step, params, state, x, n_params=n)
    before = device.memory_stats() or {}
    params, state = jax.block_until_ready(step(params, state, x))
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
    out[mode] = {
      **init,
      "base_bytes": before.get("bytes_in_use", 0),
      "peak_before_bytes": before.get("peak_bytes_in_use", 0),
      "peak_bytes": peak,
      "predicted_peak_bytes": predicted,
      "prediction_error": why,
      "ratio": peak / predicted if predicted else None,
      # The counter only grows: the step's peak shows only if it tops the set-up's.
      "step_peak_seen": peak > before.get("peak_bytes_in_use", 0),
    }
  except Exception as e:  # recorded: the table shows which mode failed and why
    out[mode] = {"error": _error(e)}
  return out


def params_on_host(offlax, optax, jax, scale, steps, child=True):
  """The params-on-host train step on this GPU beside the plain one; errors are recorded.

  In a fresh process (`_child`), offlax's steps first: the device's peak counter
  then holds its peak, not the plain model's.
  """
  if child:
    return _child("params_on_host", scale=scale, steps=steps)
  from offlax._src import llama

  layers = max(2, int(16 * min(1.0, scale * 4)))
  m = llama.Llama(layers=layers, d=2048, ffn=5632, vocab=32000, heads=16, tokens=2048)
  if scale < 0.01:  # the CPU smoke run
    m = llama.Llama(layers=2, d=128, ffn=256, vocab=256, heads=2, tokens=64)
  out: dict = {"n_params": m.n_params, "layers": m.layers}
  try:
    device = jax.devices()[0]
    tokens = jax.random.randint(jax.random.key(1), (m.tokens,), 0, m.vocab)
    inner = offlax.master_weights(optax.adamw(1e-4))
    # Leaf by leaf: the bf16 model made whole on the device would set the peak counter.
    p = _materialise(llama.param_specs(m, None), 0, place=offlax.to_host)
    tx = offlax.offload(inner, compute="host")
    s = tx.init(p)
    step = jax.jit(llama.train_step(m, tx), donate_argnums=(0, 1))
    out["predicted_peak_bytes"], out["prediction_error"] = _predicted_peak(
      offlax, step, p, s, tokens
    )
    jax.block_until_ready((p, s))
    out["base_bytes"] = (device.memory_stats() or {}).get("bytes_in_use", 0)
    for _ in range(3):
      p, s, _ = step(p, s, tokens)
    jax.block_until_ready(p)
    out["peak_bytes"] = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
    out["param_kinds"] = sorted({x.sharding.memory_kind for x in jax.tree.leaves(p)})
    plain = jax.jit(llama.train_step(m, inner, offloaded=False), donate_argnums=(0, 1))
    q = _materialise(llama.param_specs(m, None), 0)
    r = inner.init(q)
    for _ in range(3):
      q, r, _ = plain(q, r, tokens)
    times = _time(lambda p, s: step(p, s, tokens)[:2], (p, s), steps, 1, jax, last=True)
    (p, s), out["offlax_median_s"] = times[-1], statistics.median(times[:-1])
    times = _time(lambda q, r: plain(q, r, tokens)[:2], (q, r), steps, 1, jax, last=True)
    (q, r), out["plain_median_s"] = times[-1], statistics.median(times[:-1])
    out["ratio"] = out["offlax_median_s"] / out["plain_median_s"]
    # Compared last: a NumPy view of a host array would forbid donating it to the next step.
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.float32(a) - np.float32(b)))), p, q)
    out["steps_compared"] = 3 + 1 + steps
    out["max_abs_diff"] = max(jax.tree.leaves(diff))
  except Exception as e:  # recorded: the table shows it
    out["error"] = _error(e)
  return out


def _error(e: BaseException) -> str:
  """`e` and the innermost offlax and benchmark frames it passed: what to fix without a GPU."""
  import traceback

  frames = [f for f in traceback.extract_tb(e.__traceback__) if "offlax" in f.filename
            or "benchmarks" in f.filename or "examples" in f.filename][-4:]  # fmt: skip
  where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames))
  return f"{type(e).__name__}: {str(e)[:400]} [at {where}]"


def _child(section: str, env: dict | None = None, **kwargs) -> dict:
  """Runs `section(**kwargs)` in a fresh process and returns its result (errors as results).

  The device's `peak_bytes_in_use` only grows within a process: a peak read after
  earlier sections would be theirs; and the native kernel reads its environment
  (`env`, added to this one's) once per process. What the kernel says of its
  threads (``OFFLAX_NATIVE_DEBUG``) is returned as ``native_said``.
  """
  import subprocess

  cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([section, kwargs])]
  env = {**os.environ, **(env or {})}
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
  lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
  if run.returncode != 0 or not lines:
    return {"error": f"child exited {run.returncode}: {run.stderr.strip()[-500:]}"}
  result = json.loads(lines[-1][len("RESULT ") :])
  said = [x for x in run.stderr.splitlines() if x.startswith("offlax native:")]
  return {**result, "native_said": said[0]} if said else result


def _run_child(spec: str) -> None:
  import jax
  import optax

  import offlax

  section, kwargs = json.loads(spec)
  run = {
    "measured_vs_compiled": measured_vs_compiled,
    "host_compute_parts": host_compute_parts,
    "params_on_host": params_on_host,
  }[section]
  print("RESULT " + json.dumps(run(offlax, optax, jax, child=False, **kwargs)), flush=True)


def _time(fn, args, steps, warmup, jax, keep=False, last=False):
  """Times `fn`, feeding each call the last one's results unless `keep`.

  With `last`, the final results follow the times (the arguments were donated).
  """
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
  return [*times, args] if last else times


def step_times(offlax, optax, jax, n_params, steps, warmup):
  shapes = _params(n_params)
  grads = _materialise(shapes, 1)
  out = {}
  for name, tx in (
    ("on_device", optax.adamw(1e-3)),
    ("stream", offlax.offload(optax.adamw(1e-3))),
    ("one_slice", offlax.offload(optax.adamw(1e-3), chunk_bytes=2**40)),
    ("host_compute", offlax.offload(optax.adamw(1e-3), compute="host")),
    # The same with offlax's AdamW: its native kernel in the host computation.
    ("host_compute_native", offlax.offload(offlax.adamw(1e-3), compute="host")),
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
  for name in ("stream", "one_slice", "host_compute", "host_compute_native"):
    out[name]["ratio"] = out[name]["median_s"] / base
  return out


def train_step_overlap(offlax, optax, jax, scale, steps):
  """A whole Llama train step, state on the device vs streamed vs host compute (issue 16/20).

  The bare AdamW step of `step_times` is the transfer itself on a PCIe-class bus;
  in a train step the forward and backward passes are what the state's transfers
  (or host compute's gradients and updates) can hide behind. bf16 params with an
  fp32 master (`master_weights`), 953M params at 8192 tokens; errors are recorded.
  """
  from offlax._src import llama

  m = llama.Llama(layers=16, d=2048, ffn=5632, vocab=32000, heads=16, tokens=8192)
  if scale < 0.01:  # the CPU smoke run
    m = llama.Llama(layers=2, d=128, ffn=256, vocab=256, heads=2, tokens=64)
  inner = offlax.master_weights(optax.adamw(1e-4))
  tokens = jax.random.randint(jax.random.key(1), (m.tokens,), 0, m.vocab)
  out: dict = {"n_params": m.n_params, "tokens": m.tokens}
  for name, tx in (
    ("on_device", inner),
    ("stream", offlax.offload(inner)),
    ("host_compute", offlax.offload(inner, compute="host")),
  ):
    try:
      params = _materialise(llama.param_specs(m, None), 0)
      state = tx.init(params)
      step = jax.jit(llama.train_step(m, tx, offloaded=False), donate_argnums=(0, 1))
      times = _time(lambda p, s, step=step: step(p, s, tokens)[:2], (params, state), steps, 2, jax)
      out[name] = _common.stats_of(times, "_s")
      del params, state, step
    except Exception as e:  # recorded: the table shows which mode failed and why
      out[name] = {"error": _error(e)}
  base = out["on_device"].get("median_s")
  for name in ("stream", "host_compute"):
    if base and "median_s" in out[name]:
      out[name]["ratio"] = out[name]["median_s"] / base
  return out


def host_compute_parts(offlax, optax, jax, n_params, steps, child=True):
  """Where `HostTier(compute="host")`'s step spends its time on a GPU (issue 20).

  The whole step (gradients to the host, the update there, updates back), the
  same in one slice, and the host computation alone: the inner update of host
  arrays in a `compute_on("device_host")` region, as offlax runs it per slice,
  for optax's AdamW (XLA:CPU code) and offlax's (its native kernel). Twice, each
  in a fresh process: the native kernel's threads from XLA's pool
  (``OFFLAX_NATIVE_POOL=xla``; one core's speed was measured so on an H200's host)
  and by default (offlax's own pool where XLA gives fewer than two threads).
  """
  if child:
    pools = {"xla_pool": "xla", "default_pool": ""}
    return {
      name: _child(
        "host_compute_parts",
        env={"OFFLAX_NATIVE_POOL": pool, "OFFLAX_NATIVE_DEBUG": "1"},
        n_params=n_params,
        steps=steps,
      )
      for name, pool in pools.items()
    }
  from offlax._src import host_params
  from offlax._src.compat import compute_on

  shapes = _params(n_params)
  n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
  out: dict = {"n_params": n}
  grads = _materialise(shapes, 1)
  for name, tx in (
    ("step", offlax.offload(offlax.adamw(1e-3), compute="host")),
    ("step_one_slice", offlax.offload(offlax.adamw(1e-3), compute="host", chunk_bytes=2**40)),
  ):
    params = _materialise(shapes, 0)
    state = tx.init(params)
    step = jax.jit(_step(tx), donate_argnums=(0, 1))
    run = lambda p, s, step=step, g=grads: (*step(p, s, g),)
    times = _time(run, (params, state), steps, 1, jax)
    out[f"{name}_s"] = statistics.median(times)
    del params, state, step
  host_grads = offlax.to_host(grads)
  del grads
  for name, inner in (("optax", optax.adamw(1e-3)), ("offlax", offlax.adamw(1e-3))):
    params = _materialise(shapes, 0, place=offlax.to_host)
    state = host_params.init(inner.init, params)

    def update(g, s, p, inner=inner):
      args = jax.tree.map(host_params.as_device_value, (g, s, p))
      return inner.update(*args)

    region = compute_on(update, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    run = jax.jit(lambda s, g, p, region=region: region(g, s, p)[1], donate_argnums=(0,))
    times = _time(lambda s, run=run, p=params: (run(s, host_grads, p),), (state,), steps, 1, jax)
    out[f"host_update_{name}_s"] = statistics.median(times)
    out[f"host_update_{name}_params_per_s"] = n / out[f"host_update_{name}_s"]
    del params, state, run
  return out


def host_state_checkpoint(offlax, optax, jax, n_params):
  """`HostStateSave` / `HostStateRestore` of host-tier state made on this GPU, against the raw disk.

  On a GPU the state's `pinned_host` arrays are copied out to NumPy as their files are
  written, and restored leaves are copied into pinned memory: exactness, memory kinds and
  GB/s are what the CPU cannot show. The raw disk (direct I/O, 4 streams) is measured in
  the same directory just before.
  """
  import pathlib
  import shutil

  import jax.numpy as jnp
  import orbax.checkpoint as ocp

  from benchmarks import nvme_throughput as nvme

  rows = max(1, int(n_params) // 4096)
  params = {f"w{i}": jnp.full((rows, 1024), 0.5, jnp.float32) for i in range(4)}
  inner = optax.adam(1e-3)
  tx = offlax.offload(inner)
  _, state = jax.jit(lambda p, s: tx.update(jax.tree.map(jnp.sin, p), s, p))(
    params, tx.init(params)
  )
  jax.block_until_ready(state)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  work = pathlib.Path(tempfile.mkdtemp(prefix="offlax-gpu-ckpt-"))
  try:
    raw = nvme.raw_python(work / "raw.bin", max(nbytes, 4 * nvme.RAW_BLOCK_BYTES), streams=4)
    (work / "raw.bin").unlink(missing_ok=True)
    with ocp.CheckpointManager(work / "ckpt") as mngr:
      start = time.perf_counter()
      mngr.save(0, args=ocp.args.Composite(opt=offlax.HostStateSave(state, progress=False)))
      mngr.wait_until_finished()
      os.sync()
      save_s = time.perf_counter() - start
      nvme.drop_page_cache(work / "ckpt")
      target = offlax.abstract_state(inner, params)
      start = time.perf_counter()
      item = offlax.HostStateRestore(target, progress=False)
      restored = jax.block_until_ready(mngr.restore(0, args=ocp.args.Composite(opt=item)).opt)
      restore_s = time.perf_counter() - start
    pairs = zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True)
    exact = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(restored) if x.ndim})
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return {
    "state_bytes": nbytes,
    "exact": exact,
    "restored_kinds": kinds,
    "save_gb_per_s": nbytes / save_s / 1e9,
    "restore_gb_per_s": nbytes / restore_s / 1e9,
    "raw_write_gb_per_s": raw["write_bytes_per_s"] / 1e9,
    "raw_read_gb_per_s": raw["read_bytes_per_s"] / 1e9,
    "save_vs_raw": nbytes / save_s / raw["write_bytes_per_s"],
    "restore_vs_raw": nbytes / restore_s / raw["read_bytes_per_s"],
  }


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


SECTIONS = (
  "correctness",
  "native_in_host_compute",
  "memory",
  "measured_vs_compiled",
  "time",
  "train_step_overlap",
  "bandwidth_bytes_per_s",
  "host_compute_parts",
  "params_on_host",
  "examples",
  "host_step_params_per_s",
  "host_state_checkpoint",
)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size-scale", type=float, default=1.0)
  _common.add_steps_arguments(parser, steps=20, warmup_help="untimed steps after compiling (2)")
  parser.add_argument(
    "--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="the sections to run (all)"
  )
  parser.add_argument(
    "--budget-s",
    type=float,
    default=None,
    help="seconds for the whole run: sections not started by then are skipped (none)",
  )
  _common.add_out_argument(parser, "gpu_check")
  args = parser.parse_args(argv)

  import jax
  import optax

  import offlax

  start = time.perf_counter()
  scale = args.size_scale
  result = {"benchmark": "gpu_check", **_common.environment(devices=True), "size_scale": scale}
  result["memories"] = [m.kind for m in jax.devices()[0].addressable_memories()]
  result["section_s"] = {}
  sections = {
    "correctness": lambda: check_correctness(offlax, optax, jax, np),
    "native_in_host_compute": lambda: native_in_host_compute(
      jax, np, sizes=(1 << 20, max(1 << 16, int((1 << 26) * scale)))
    ),
    "memory": lambda: memory_analysis(offlax, optax, jax, 1e9 * scale),
    "measured_vs_compiled": lambda: measured_vs_compiled(offlax, optax, jax, 1e9 * scale),
    "time": lambda: step_times(offlax, optax, jax, 2.5e8 * scale, args.steps, args.warmup),
    "bandwidth_bytes_per_s": lambda: bandwidth(jax, int(2**30 * scale) // 4 * 4 or 4096),
    "train_step_overlap": lambda: train_step_overlap(offlax, optax, jax, scale, min(args.steps, 5)),
    "host_compute_parts": lambda: host_compute_parts(
      offlax, optax, jax, 2.5e8 * scale, min(args.steps, 5)
    ),
    "params_on_host": lambda: params_on_host(offlax, optax, jax, scale, min(args.steps, 5)),
    "examples": lambda: examples(max(3, int(20 * min(1.0, scale * 100)))),
    "host_step_params_per_s": lambda: host_step_threads(scale),
    "host_state_checkpoint": lambda: host_state_checkpoint(offlax, optax, jax, 2.5e8 * scale),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  # One section at a time, the JSON rewritten after each: a run stopped at a time limit (a lent
  # GPU's minutes) keeps what it measured, and one section's error is recorded, not fatal.
  for name in (s for s in SECTIONS if s in args.only):
    elapsed = time.perf_counter() - start
    if args.budget_s is not None and elapsed > args.budget_s:
      result[name] = {"error": f"skipped: {elapsed:.0f} s of the {args.budget_s:g} s budget spent"}
      continue
    print(f"[gpu_check {elapsed:6.1f} s] {name}", flush=True)
    began = time.perf_counter()
    try:
      result[name] = sections[name]()
    except Exception as e:  # recorded: the table shows which section failed and why
      result[name] = {"error": _error(e)}
    result["section_s"][name] = time.perf_counter() - began
    _common.write_json(result, args.out / "gpu_check.json")

  result["overlap"] = overlap(result, scale)
  result["wall_s"] = time.perf_counter() - start
  _common.write_json(result, args.out / "gpu_check.json")
  plot(result, args.out / "gpu_check.png")
  print(table(result))
  return result


def overlap(result: dict, scale: float) -> dict | None:
  """The share of the streamed step's state traffic hidden behind compute, from two sections."""
  t, bw = result.get("time", {}), result.get("bandwidth_bytes_per_s", {})
  if "stream" not in t or "on_device" not in t or not bw or "error" in bw:
    return None
  import jax

  # State bytes moved per streamed step: mu and nu in and out (4 x 4 bytes per parameter).
  n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(_params(2.5e8 * scale)))
  transfer_s = 16 * n / min(bw.values())
  extra_s = t["stream"]["median_s"] - t["on_device"]["median_s"]
  return {
    "state_bytes_moved": 16 * n,
    "transfer_s_at_bandwidth": transfer_s,
    "extra_step_s": extra_s,
    "hidden_fraction": max(0.0, min(1.0, 1 - extra_s / transfer_s)) if transfer_s else None,
  }


def plot(r: dict, path) -> bool:
  """Step times (log scale) and real device peaks against `compile_for_gpu`'s, when measured.

  Returns whether there was anything to draw (a run of other sections writes no PNG).
  """
  t, peaks = r.get("time", {}), []
  for mode, x in (r.get("measured_vs_compiled") or {}).items():
    if isinstance(x, dict) and x.get("predicted_peak_bytes") and x.get("step_peak_seen"):
      what = {"host": "host compute", "streamed": "streamed host tier"}.get(mode, mode)
      n = x["params_bytes"] / 4  # fp32
      peaks.append((f"{what}\n{n / 1e9:.2g}B AdamW", x["peak_bytes"], x["predicted_peak_bytes"]))
  x = r.get("params_on_host") or {}
  if x.get("predicted_peak_bytes") and x.get("peak_bytes"):
    what = f"params on the host\n{x['n_params'] / 1e6:.0f}M Llama, bf16"
    peaks.append((what, x["peak_bytes"], x["predicted_peak_bytes"]))
  if "on_device" not in t and not peaks:
    return False
  plt = _common.pyplot()
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
  names = [n for n in ("on_device", "stream", "one_slice", "host_compute", "host_compute_native")
           if n in t]  # fmt: skip
  med = [t[n]["median_s"] * 1e3 for n in names]
  bars = left.bar(range(len(names)), med, color="tab:blue")
  for bar, n, m in zip(bars, names, med, strict=True):
    text = f"{m:.1f} ms" + (f"\n{t[n]['ratio']:.1f}x" if "ratio" in t[n] else "")
    _common.label_above(left, text, (bar.get_x() + bar.get_width() / 2, m), dy=3)
  moved = (r.get("overlap") or {}).get("transfer_s_at_bandwidth")
  if moved:
    left.axhline(moved * 1e3, color="tab:red", linestyle="--", linewidth=1,
                 label="the state in and out at the measured bandwidth")  # fmt: skip
    left.legend(loc="upper left", fontsize=8)
  left.set_yscale("log")
  left.set_ylim(min(med) / 2, max(med) * 8)
  left.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=8)
  left.set_ylabel("AdamW step, 250M fp32 params (ms, median)")
  left.set_title("step time", fontsize=10)
  if peaks:
    x = np.arange(len(peaks))
    real = [p[1] / 1e9 for p in peaks]
    predicted = [p[2] / 1e9 for p in peaks]
    right.bar(x - 0.2, predicted, 0.4, label="compile_for_gpu (no GPU)", color="tab:gray")
    bars = right.bar(x + 0.2, real, 0.4, label="peak_bytes_in_use on the GPU", color="tab:green")
    for bar, a, b in zip(bars, real, predicted, strict=True):
      _common.label_above(right, f"{a / b:.4f}x", (bar.get_x() + bar.get_width() / 2, a), dy=3)
    right.set_xticks(x, [p[0] for p in peaks], fontsize=8)
    right.set_ylabel("device peak (GB)")
    right.set_ylim(0, max(real + predicted) * 1.2)
    right.legend(loc="upper right", fontsize=8)
  right.set_title("device peak: measured vs predicted", fontsize=10)
  title = f"gpu_check on {', '.join(r['devices'])} (jax {r['jax_version']}, {r['date'][:10]})"
  _common.save_png(fig, path, suptitle=title)
  return True


def table(r: dict) -> str:
  """The run in a few lines; a section that failed or did not run says so."""

  def line(name, fmt):
    x = r.get(name)
    if x is None:
      return f"{name}: not run"
    if isinstance(x, dict) and set(x) == {"error"}:
      return f"{name}: FAILED ({x['error'][:200]})"
    try:
      return fmt(x)
    except (KeyError, TypeError) as e:  # a part of the section failed: show it raw
      return f"{name}: {x} ({type(e).__name__}: {e})"

  def correctness(c):
    return "correctness (max|diff| vs optax): " + ", ".join(
      f"{k} {v['max_abs_diff']:.3g}" if "error" not in v else f"{k} FAILED ({v['error'][:80]})"
      for k, v in c.items()
    )

  def memory(m):
    return (
      f"device bytes/param ({m['params']:,} params): on device "
      f"{m['on_device']['device_bytes_per_param']:.2f}, host tier "
      f"{m['host_tier']['device_bytes_per_param']:.2f} (host args "
      f"{m['host_tier']['host_argument_size_in_bytes'] / 2**30:.2f} GiB), host compute "
      f"{m['host_compute']['device_bytes_per_param']:.2f}"
    )

  def times(t):
    return (
      f"step: on device {t['on_device']['median_s'] * 1e3:.1f} ms, stream "
      f"{t['stream']['median_s'] * 1e3:.1f} ms ({t['stream']['ratio']:.3f}x, goal <= 1.15x), "
      f"one slice {t['one_slice']['median_s'] * 1e3:.1f} ms ({t['one_slice']['ratio']:.3f}x), "
      f"host compute {t['host_compute']['median_s'] * 1e3:.1f} ms "
      f"({t['host_compute']['ratio']:.3f}x; with offlax.adamw's native kernel "
      f"{t['host_compute_native']['median_s'] * 1e3:.1f} ms)"
    )

  lines = [
    f"gpu_check on {r['devices']} (jax {r['jax_version']}), memories {r['memories']}, "
    f"{r.get('wall_s', 0):.0f} s",
    line("correctness", correctness),
    line("memory", memory),
    line("time", times),
    line(
      "bandwidth_bytes_per_s",
      lambda b: "bandwidth: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in b.items()),
    ),  # fmt: skip
    f"overlap: {r.get('overlap')}",
    line("native_in_host_compute", lambda x: f"native Adam kernel in a GPU host computation: {x}"),
    line("measured_vs_compiled", lambda x: f"device peak, real run vs compile_for_gpu: {x}"),
    line(
      "train_step_overlap", lambda x: f"Llama train step, state on device / streamed / host: {x}"
    ),
    line("host_compute_parts", lambda x: f"host compute's step in parts (s): {x}"),
    line("params_on_host", lambda x: f"params, gradients and state on the host: {x}"),
    line("examples", lambda x: f"examples: {x}"),
    line("host_step_params_per_s", lambda x: f"native host step (params/s, all cores, one): {x}"),
    line(
      "host_state_checkpoint",
      lambda x: (
        f"HostStateSave / Restore of {x['state_bytes'] / 1e9:.2f} GB: exact {x['exact']}, "
        f"{x['save_gb_per_s']:.2f} / {x['restore_gb_per_s']:.2f} GB/s = "
        f"{x['save_vs_raw']:.2f}x / {x['restore_vs_raw']:.2f}x the raw disk"
      ),
    ),
  ]
  return "\n".join(lines)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    _run_child(sys.argv[2])
  else:
    main()
