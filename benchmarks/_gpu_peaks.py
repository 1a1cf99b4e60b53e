"""gpu_check.py's sections on device memory: compiled, measured on a GPU, predicted without one.

Private to `benchmarks/`; gpu_check.py's docstring says what each section measures. A section
returns a JSON-able dict and records what fails inside it as an `error`; gpu_check.py's `main`
records a section that raises.
"""

from __future__ import annotations

import statistics

import numpy as np

from benchmarks import _gpu


def memory_analysis(offlax, optax, jax, n_params):
  shapes = _gpu.transformer_shapes(n_params)
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
      jax.jit(_gpu.optimizer_step(tx), donate_argnums=(0, 1))
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
  # and state; the compiled step adds its temporaries). 1 PB: the most the planner takes.
  plan = offlax.plan(shapes, optax.adamw(1e-3), device_bytes=10**15, host_bytes=10**15)
  a = plan.assumptions
  out["planner"] = {
    "param_grad_state_bytes": a["param_bytes"] + a["grad_bytes"] + a["state_bytes"],
    "state_bytes": a["state_bytes"],
    "host_tier_host_argument_bytes": out["host_tier"]["host_argument_size_in_bytes"],
  }
  return out


def measured_vs_compiled(offlax, optax, jax, n_params, modes=("host", "streamed"), child=True):
  """A real step's device peak on this GPU beside `offlax.compile_for_gpu`'s prediction.

  Runs one donated AdamW step per mode on real arrays and reads the device's
  `peak_bytes_in_use` (which only grows: each mode runs in a fresh process on a
  GPU, `_gpu.in_child`); the prediction compiles the same step from shapes for an H200
  target (XLA's GPU compiler, as on a machine without a GPU). Errors are
  recorded, not raised.
  """
  if child:
    return {
      m: _gpu.in_child("measured_vs_compiled", n_params=n_params, modes=[m])[m] for m in modes
    }
  from offlax._src import gpu_compile

  (mode,) = modes
  device = jax.devices()[0]
  out = {}
  try:
    params = _gpu.materialise(_gpu.transformer_shapes(n_params), 0)  # each leaf ready as it is made
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
    predicted, why = _gpu.predicted_peak(offlax, step, params, state, x, n_params=n)
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
    out[mode] = {"error": _gpu.error_text(e)}
  return out


def params_on_host(offlax, optax, jax, scale, steps, child=True):
  """The params-on-host train step on this GPU beside the plain one; errors are recorded.

  In a fresh process (`_gpu.in_child`), offlax's steps first: the device's peak counter
  then holds its peak, not the plain model's.
  """
  if child:
    return _gpu.in_child("params_on_host", scale=scale, steps=steps)
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
    p = _gpu.materialise(llama.param_specs(m, None), 0, place=offlax.to_host)
    tx = offlax.offload(inner, compute="host")
    s = tx.init(p)
    step = jax.jit(llama.train_step(m, tx), donate_argnums=(0, 1))
    out["predicted_peak_bytes"], out["prediction_error"] = _gpu.predicted_peak(
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
    q = _gpu.materialise(llama.param_specs(m, None), 0)
    r = inner.init(q)
    for _ in range(3):
      q, r, _ = plain(q, r, tokens)
    times = _gpu.time_calls(lambda p, s: step(p, s, tokens)[:2], (p, s), steps, 1, jax, last=True)
    (p, s), out["offlax_median_s"] = times[-1], statistics.median(times[:-1])
    times = _gpu.time_calls(lambda q, r: plain(q, r, tokens)[:2], (q, r), steps, 1, jax, last=True)
    (q, r), out["plain_median_s"] = times[-1], statistics.median(times[:-1])
    out["ratio"] = out["offlax_median_s"] / out["plain_median_s"]
    # Compared last: a NumPy view of a host array would forbid donating it to the next step.
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.float32(a) - np.float32(b)))), p, q)
    out["steps_compared"] = 3 + 1 + steps
    out["max_abs_diff"] = max(jax.tree.leaves(diff))
  except Exception as e:  # recorded: the table shows it
    out["error"] = _gpu.error_text(e)
  return out
