"""gpu_check.py's sections on speed: step times, overlap, host compute, the bus, native kernels.

Private to `benchmarks/`; gpu_check.py's docstring says what each section measures. A section
returns a JSON-able dict and records what fails inside it as an `error`; gpu_check.py's `main`
records a section that raises.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import _common, _gpu


def step_times(offlax, optax, jax, n_params, steps, warmup):
  shapes = _gpu.transformer_shapes(n_params)
  grads = _gpu.materialise(shapes, 1)
  out = {}
  for name, tx in (
    ("on_device", optax.adamw(1e-3)),
    ("stream", offlax.offload(optax.adamw(1e-3))),
    ("one_slice", offlax.offload(optax.adamw(1e-3), chunk_bytes=2**40)),
    ("host_compute", offlax.offload(optax.adamw(1e-3), compute="host")),
    # The same with offlax's AdamW: its native kernel in the host computation.
    ("host_compute_native", offlax.offload(offlax.adamw(1e-3), compute="host")),
  ):
    params = _gpu.materialise(shapes, 0)
    state = tx.init(params)
    step = jax.jit(_gpu.optimizer_step(tx), donate_argnums=(0, 1))
    times = _gpu.time_calls(
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
      params = _gpu.materialise(llama.param_specs(m, None), 0)
      state = tx.init(params)
      step = jax.jit(llama.train_step(m, tx, offloaded=False), donate_argnums=(0, 1))
      times = _gpu.time_calls(
        lambda p, s, step=step: step(p, s, tokens)[:2], (params, state), steps, 2, jax
      )
      out[name] = _common.stats_of(times, "_s")
      del params, state, step
    except Exception as e:  # recorded: the table shows which mode failed and why
      out[name] = {"error": _gpu.error_text(e)}
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
      name: _gpu.in_child(
        "host_compute_parts",
        env={"OFFLAX_NATIVE_POOL": pool, "OFFLAX_NATIVE_DEBUG": "1"},
        n_params=n_params,
        steps=steps,
      )
      for name, pool in pools.items()
    }
  from offlax._src import host_params
  from offlax._src.compat import compute_on

  shapes = _gpu.transformer_shapes(n_params)
  n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
  out: dict = {"n_params": n}
  grads = _gpu.materialise(shapes, 1)
  for name, tx in (
    ("step", offlax.offload(offlax.adamw(1e-3), compute="host")),
    ("step_one_slice", offlax.offload(offlax.adamw(1e-3), compute="host", chunk_bytes=2**40)),
  ):
    params = _gpu.materialise(shapes, 0)
    state = tx.init(params)
    step = jax.jit(_gpu.optimizer_step(tx), donate_argnums=(0, 1))
    run = lambda p, s, step=step, g=grads: (*step(p, s, g),)
    times = _gpu.time_calls(run, (params, state), steps, 1, jax)
    out[f"{name}_s"] = statistics.median(times)
    del params, state, step
  host_grads = offlax.to_host(grads)
  del grads
  for name, inner in (("optax", optax.adamw(1e-3)), ("offlax", offlax.adamw(1e-3))):
    params = _gpu.materialise(shapes, 0, place=offlax.to_host)
    state = host_params.init(inner.init, params)

    def update(g, s, p, inner=inner):
      args = jax.tree.map(host_params.as_device_value, (g, s, p))
      return inner.update(*args)

    region = compute_on(update, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    run = jax.jit(lambda s, g, p, region=region: region(g, s, p)[1], donate_argnums=(0,))
    times = _gpu.time_calls(
      lambda s, run=run, p=params: (run(s, host_grads, p),), (state,), steps, 1, jax
    )
    out[f"host_update_{name}_s"] = statistics.median(times)
    out[f"host_update_{name}_params_per_s"] = n / out[f"host_update_{name}_s"]
    del params, state, run
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
  hyper = host_adam.Hyper(0.9, 0.999, 0.1, 0.001, 1e-8, 0.0, -1e-3, False, 0.0)
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
      native_s = statistics.median(_gpu.time_calls(native, (g, m, v, vector), 5, 1, jax, keep=True))
      plain_s = statistics.median(_gpu.time_calls(plain, (g, m, v, vector), 5, 1, jax, keep=True))
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
    out["error"] = _gpu.error_text(e)
  return out


def host_step_threads(scale: float) -> dict:
  """The native host step on this machine's CPU, all its cores and one (issue 20).

  `benchmarks/host_adam.py` in a subprocess on the CPU backend (the host step
  is XLA:CPU code also in a GPU program's host computation), the headline
  variants only; DeepSpeed joins where `benchmarks/.venv-torch` exists.
  """
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


def state_bits_host(scale: float, budget_s: float = 120.0) -> dict:
  """fp32 vs 8-bit Adam state, the native host step on this machine's CPU, all cores (issue 45).

  `benchmarks/state_bits.py` on the CPU backend at 64M and 256M params, one round of the
  native variants (not plain JAX), each size skipped once `budget_s` is spent: on a host
  with more cores per memory channel than the CI machine's two, the fp32 kernel (28 bytes
  a param) may be bound by memory where the 8-bit one (16 bytes) is not.
  """
  script = pathlib.Path(__file__).with_name("state_bits.py")
  variants = ["fp32 full step", "8-bit full step", "fp32 mixed", "8-bit mixed"]
  out: dict = {"cpu_count": os.cpu_count(), "budget_s": budget_s}
  deadline = time.monotonic() + budget_s
  for size in sorted({max(1, round(s * scale)) for s in (64, 256)}):
    left = deadline - time.monotonic()
    if left < 10:
      out[f"{size}M"] = {"error": f"skipped: the {budget_s:g} s budget spent"}
      continue
    with tempfile.TemporaryDirectory() as tmp:
      cmd = [sys.executable, str(script), "--sizes-m", str(size), "--steps", "3", "--warmup", "1",
             "--repeats", "1", "--out", tmp, "--variants", *variants]  # fmt: skip
      env = dict(os.environ, JAX_PLATFORMS="cpu")  # the host kernels, not the GPU
      try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
      except subprocess.TimeoutExpired:
        out[f"{size}M"] = {"error": f"timed out after {left:.0f} s"}
        continue
      if run.returncode != 0:
        out[f"{size}M"] = {"error": run.stderr.strip()[-500:]}
        continue
      row = json.loads(pathlib.Path(tmp, "state_bits.json").read_text())["sizes"][f"{size}M"]
    out[f"{size}M"] = {
      name: x if not isinstance(x, dict) else
      {k: x[k] for k in ("median_params_per_s", "median_params_per_cpu_s", "error") if k in x}
      for name, x in row.items()
    }  # fmt: skip
  return out


def layer_store_speed(scale: float, steps: int = 3) -> dict:
  """`nvme_params.py` with its passes on this GPU: a ~1B stack of Llama-like layers in a
  `LayerStore` in both update modes, beside the same pass with the layers in host memory
  and the disk's bound (issue 44's speed goals: backward <= 0.7x explicit, <= 1.15x the
  larger of the two bounds)."""
  script = pathlib.Path(__file__).with_name("nvme_params.py")
  with tempfile.TemporaryDirectory(prefix="offlax-gpu-layer-speed-") as out:
    cmd = [sys.executable, str(script), "--sizes", f"{max(0.005, scale):g}", "--steps", str(steps),
           "--compile", "none", "--raw-gib", f"{max(0.1, 2 * scale):g}", "--out", out]  # fmt: skip
    if scale < 0.1:  # the CPU smoke run: small layers
      cmd += ["--width", "256"]
    # nvme_params.py keeps JAX on the CPU unless JAX_PLATFORMS is set: "" is every backend.
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
      return {"error": done.stderr[-2000:], "command": " ".join(cmd)}
    result = json.loads(pathlib.Path(out, "nvme_params.json").read_text())
  size = result["sizes"][0]
  modes = {
    mode: {k: statistics.median(s[k] for s in run["steps"][1:] or run["steps"])
           for k in ("step_s", "forward_backward_s", "bytes_per_param")}
    for mode, run in size["modes"].items()
  }  # fmt: skip
  return {"n_params": size["n_params"], "command": " ".join(cmd), "modes": modes,
          "speed": size["speed"], "peak_rss_bytes": size["peak_rss_bytes"],
          "raw": {k: v for k, v in result["raw"].items() if k.endswith("_per_s")}}  # fmt: skip
