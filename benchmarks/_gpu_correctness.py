"""gpu_check.py's sections that check results: offlax against optax, the examples, checkpoints.

Private to `benchmarks/`; gpu_check.py's docstring says what each section measures. A section
returns a JSON-able dict and records what fails inside it as an `error`; gpu_check.py's `main`
records a section that raises.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks import _disk, _gpu


def check_correctness(offlax, optax, jax, np):
  with tempfile.TemporaryDirectory(prefix="offlax-gpu-check-") as tmp:
    nvme = offlax.NVMeTier(tmp, cache_bytes=4096, chunk_bytes=64 * 1024, progress=False)
    try:
      return _correctness(offlax, optax, jax, np, nvme)
    finally:
      nvme.close()


def _correctness(offlax, optax, jax, np, nvme):
  shapes = _gpu.transformer_shapes(2e5, layers=2)
  params = _gpu.materialise(shapes, 0)
  inner = optax.adamw(1e-3)
  host = offlax.HostTier(compute="host")
  eight = offlax.adamw(1e-3, state_bits=8)
  every = lambda tx: optax.MultiSteps(tx, 2)
  results = {}
  # Each variant against its reference on this GPU, 3 steps (4 micro-steps of 2 with
  # MultiSteps). The host-compute ones with offlax's adamw run its native kernel in the host
  # computation (JAX lowers that region for the CPU): the moments only, then the update too
  # (within 2e-6 relative of optax's, so not bit-exact by design); 8-bit state against the
  # same 8-bit optimizer on the device (its update in plain JAX there). The last two run
  # `offlax.update_and_apply`'s fused accumulation (a loop of 0 or 1 trips around the update).
  for name, reference, tx in (
    ("one_slice", inner, offlax.offload(inner, offlax.HostTier(chunk_bytes=2**40))),
    ("streamed", inner, offlax.offload(inner, offlax.HostTier(chunk_bytes=64 * 1024))),
    ("host_compute", inner, offlax.offload(inner, host)),
    ("host_compute_offlax_adamw", inner, offlax.offload(offlax.adamw(1e-3), host)),
    ("host_compute_native_update", inner,
     offlax.offload(offlax.adamw(1e-3, native_update=True), host)),
    ("host_compute_whole_step", inner,
     offlax.offload(offlax.master_weights(offlax.adamw(1e-3)), host)),
    ("nvme", inner, offlax.offload(inner, nvme)),
    ("streamed_8bit", eight, offlax.offload(eight, offlax.HostTier(chunk_bytes=64 * 1024))),
    ("host_compute_8bit", eight, offlax.offload(eight, host)),
    ("multi_steps_host_compute", every(inner), every(offlax.offload(offlax.adamw(1e-3), host))),
    ("multi_steps_host_compute_8bit", every(eight), every(offlax.offload(eight, host))),
  ):  # fmt: skip
    out = {}
    try:
      for label, t in (("plain", reference), ("offlax", tx)):
        p, s = params, t.init(params)
        fused = name.startswith("multi_steps") and label == "offlax"
        step = jax.jit(_fused_step(t) if fused else _gpu.optimizer_step(t))
        for i in range(4 if name.startswith("multi_steps") else 3):
          p, s = step(p, s, jax.tree.map(lambda x, i=i: jax.numpy.sin(x * (i + 1)), p))
        out[label] = jax.block_until_ready(p)
    except Exception as e:  # recorded: the table shows which variant failed and why
      results[name] = {"error": _gpu.error_text(e)}
      continue
    diff = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for a, b in zip(jax.tree.leaves(out["plain"]), jax.tree.leaves(out["offlax"]), strict=True)
    )
    results[name] = {"max_abs_diff": diff, "bit_exact": diff == 0.0}
  return results


def _fused_step(tx):
  import offlax

  return lambda params, state, grads: offlax.update_and_apply(tx, grads, state, params)


def examples(steps: int) -> dict:
  """The Flax examples, a few steps each: that they run here, and their last losses."""
  root = pathlib.Path(__file__).resolve().parent.parent / "examples"
  out = {}
  lm = [("lm_nnx.py", ["--tier", t, "--steps", str(steps), "--no-progress"])
        for t in ("host", "host_compute", "nvme")]  # fmt: skip
  runs = [*lm, ("linen_train_state.py", ["--steps", str(steps)]),
          ("nvme_params.py", ["--steps", str(steps)])]  # fmt: skip
  for name, args in runs:
    key = f"{name} {' '.join(args[:2])}"
    spec = importlib.util.spec_from_file_location(name[:-3], root / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name[:-3]] = module
    try:
      spec.loader.exec_module(module)
      with tempfile.TemporaryDirectory() as tmp:
        extra = {"lm_nnx.py": ["--dir", tmp, "--dim", "32", "--seq", "32"],
                 "nvme_params.py": ["--dir", tmp]}.get(name, [])  # fmt: skip
        out[key] = {"result": float(module.main([*args, *extra]))}
    except Exception as e:  # recorded: the point is to learn what fails on this machine
      out[key] = {"error": _gpu.error_text(e)}
  return out


def host_state_checkpoint(offlax, optax, jax, n_params):
  """`HostStateSave` / `HostStateRestore` of host-tier state made on this GPU, against the raw disk.

  On a GPU the state's `pinned_host` arrays are copied out to NumPy as their files are
  written, and restored leaves are copied into pinned memory: exactness, memory kinds and
  GB/s are what the CPU cannot show. The raw disk (direct I/O, 4 streams) is measured in
  the same directory just before.
  """
  import jax.numpy as jnp
  import orbax.checkpoint as ocp

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
    raw = _disk.raw_python(work / "raw.bin", max(nbytes, 4 * _disk.RAW_BLOCK_BYTES), streams=4)
    (work / "raw.bin").unlink(missing_ok=True)
    with ocp.CheckpointManager(work / "ckpt") as mngr:
      start = time.perf_counter()
      mngr.save(
        0, args=ocp.args.Composite(opt=offlax.checkpoint.HostStateSave(state, progress=False))
      )
      mngr.wait_until_finished()
      os.sync()
      save_s = time.perf_counter() - start
      _disk.drop_page_cache(work / "ckpt")
      target = offlax.abstract_state(inner, params)
      start = time.perf_counter()
      item = offlax.checkpoint.HostStateRestore(target, progress=False)
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


def layer_store(offlax, optax, jax, steps: int = 3) -> dict:
  """Layers on disk (`offlax.LayerStore`) on this GPU against the same layers in its memory.

  The forward and backward pass run on the GPU, reading each layer by a callback and writing
  its gradient back; `update` runs AdamW with an fp32 master on the CPU. The reference: the
  same stacked bf16 layers in device memory, the gradients from the same GPU program shape,
  the update jitted on the CPU. Reported: whether the gradients and the params after `steps`
  steps are the same bits, and the step times.
  """
  import jax.numpy as jnp

  n, d = 8, 512
  keys = jax.random.split(jax.random.key(0), n)
  layers = {
    "w": jnp.stack([jax.random.normal(k, (d, d)) / d**0.5 for k in keys]).astype(jnp.bfloat16)
  }
  x = jax.random.normal(jax.random.key(1), (16, d)).astype(jnp.bfloat16)

  def loss(ls, x):
    h, _ = offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"]), None), x, ls)
    return jnp.mean(h.astype(jnp.float32) ** 2)

  tx = offlax.master_weights(offlax.adamw(1e-3))
  grad = jax.jit(jax.grad(loss))
  cpu = jax.devices("cpu")[0]
  update = jax.jit(
    lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  )
  with jax.default_device(cpu):
    params, state = jax.device_put(layers, cpu), jax.jit(tx.init)(jax.device_put(layers, cpu))
  out: dict = {"grads_bit_exact": [], "step_s": []}
  with tempfile.TemporaryDirectory(prefix="offlax-gpu-layers-") as tmp:
    with offlax.LayerStore.create(
      os.path.join(tmp, "s"), layers, optimizer=tx, progress=False
    ) as store:
      for _ in range(steps):
        start = time.perf_counter()
        grad(store.source(), x)
        store.update()
        out["step_s"].append(time.perf_counter() - start)
        g = jax.device_put(grad(jax.device_put(params, jax.devices()[0]), x), cpu)
        got = store.read_grads()
        out["grads_bit_exact"].append(
          bool(np.array_equal(np.asarray(got["w"]), np.asarray(g["w"])))
        )
        with jax.default_device(cpu):
          params, state = update(g, state, params)
      diff = np.abs(
        np.asarray(store.read_params()["w"], np.float32) - np.asarray(params["w"], np.float32)
      )
      out["params_max_abs_diff"] = float(diff.max())
      out["params_bit_exact"] = out["params_max_abs_diff"] == 0.0
      out["last_update"] = store.last_update._asdict()
  return out


def layer_store_nnx(offlax, optax, jax, steps: int = 3) -> dict:
  """An NNX model's list of layers on disk (`offload_params(store=)`) on this GPU.

  The reference: the same model with its params in host memory (`offload_params`
  without a store: each layer rematerialised alike). Reported: whether the losses
  and the first step's layer gradients are the same bits, and the step times.
  """
  import jax.numpy as jnp
  from flax import nnx

  d, n = 512, 6

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(d, 2 * d, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
      self.down = nnx.Linear(2 * d, d, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
      return x + self.down(jax.nn.gelu(self.up(x)))

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Linear(d, d, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
      self.layers = nnx.List([Block(rngs) for _ in range(n)])

    def __call__(self, x):
      x = self.embed(x)
      for layer in self.layers:
        x = layer(x)
      return jnp.mean(x.astype(jnp.float32) ** 2)

  x = jax.random.normal(jax.random.key(1), (16, d)).astype(jnp.bfloat16)
  tx = lambda: offlax.master_weights(offlax.adamw(1e-3))

  def train(model, store=None):
    optimizer = nnx.Optimizer(model, offlax.offload(tx(), compute="host"), wrt=nnx.Param)
    grad = nnx.jit(nnx.value_and_grad(lambda m, x: m(x)))
    update = nnx.jit(lambda m, o, g: o.update(m, g))
    losses, times, first = [], [], None
    for step in range(steps):
      start = time.perf_counter()
      loss, grads = grad(model, x)
      update(model, optimizer, grads)
      if store is not None:
        if step == 0:
          first = store.read_grads()
        store.update()
      losses.append(float(loss))
      times.append(time.perf_counter() - start)
      if store is None and step == 0:
        layers = nnx.state(grads, nnx.Param)["layers"]
        first = jax.tree.map(lambda *g: np.stack([np.asarray(a) for a in g]),
                             *[layers[i] for i in range(n)])  # fmt: skip
    return losses, times, first

  out: dict = {}
  with tempfile.TemporaryDirectory(prefix="offlax-gpu-nnx-layers-") as tmp:
    model = Model(nnx.Rngs(0))
    stacked = offlax.stack_layers(model.layers)
    with offlax.LayerStore.create(os.path.join(tmp, "s"), stacked, optimizer=tx(),
                                  progress=False) as store:  # fmt: skip
      offlax.offload_params(model, store=store)
      losses, out["step_s"], first = train(model, store)
  want_losses, out["host_params_step_s"], want_first = train(
    offlax.offload_params(Model(nnx.Rngs(0)))
  )
  out["losses_bit_exact"] = losses == want_losses
  out["grads_bit_exact"] = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(want_first), strict=True)
  )
  return out


PRETRAINED_BOUND = 16 * 2**20  # the device peak's growth allowed while loading into pinned_host


def pretrained_checkpoint(offlax, optax, jax, scale: float = 1.0, child: bool = True) -> dict:
  """A Hugging Face Qwen3 checkpoint into `pinned_host` params and back out (issue 42).

  In a process of its own (the device's peak only grows): the device's
  `peak_bytes_in_use` before and after `offlax.load_safetensors` into an
  `nnx.eval_shape` Qwen3 offloaded to `pinned_host` (goal: it grows by at most
  `PRETRAINED_BOUND`, whatever the params' size: no tensor passes through device
  memory); `save_safetensors` of that model (goal: every tensor byte-identical
  to the source's, the same names, dtypes and shapes); then the same checkpoint
  loaded onto the device, whose peak grows by about the params (the measure sees
  allocations). On a CPU, JAX has no memory stats: the peaks are None.
  """
  if child:
    return _gpu.in_child("pretrained_checkpoint", scale=scale)
  from flax import nnx

  from benchmarks import safetensors_io
  from offlax._src.hf import files

  big = scale >= 0.1  # 4 layers of d = 1024 (256 MB of bf16) on the GPU; a tiny one on a CPU
  shape = dict(d=1024, f=4096, heads=8, kv=4, head_dim=128, vocab=32_000) if big else dict(
    d=64, f=128, heads=4, kv=2, head_dim=16, vocab=256
  )  # fmt: skip
  layers, device = 4, jax.devices()[0]

  def peak():
    return (device.memory_stats() or {}).get("peak_bytes_in_use")

  def model():
    config = safetensors_io.config(layers, **shape)
    from tunix.models.qwen3 import model as qwen3

    return nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0)))

  out: dict = {"bound_bytes": PRETRAINED_BOUND}
  with tempfile.TemporaryDirectory(prefix="offlax-gpu-hf-") as tmp:
    ckpt, saved = os.path.join(tmp, "ckpt"), os.path.join(tmp, "saved")
    out["checkpoint_bytes"] = safetensors_io.write_checkpoint(ckpt, layers, **shape)
    hosted = offlax.offload_params(model())
    before, start = peak(), time.perf_counter()
    offlax.load_safetensors(hosted, ckpt, progress=False)
    params = jax.tree.leaves(nnx.state(hosted, nnx.Param))
    jax.block_until_ready(params)
    out["load_s"], after = time.perf_counter() - start, peak()
    out["param_kinds"] = sorted({x.sharding.memory_kind for x in params})
    out["device_peak_before_bytes"], out["device_peak_after_bytes"] = before, after
    growth = None if before is None or after is None else after - before
    out["device_peak_growth_bytes"] = growth
    out["within_bound"] = None if growth is None else growth <= PRETRAINED_BOUND
    start = time.perf_counter()
    offlax.save_safetensors(hosted, saved, progress=False)
    out["save_s"] = time.perf_counter() - start
    source, copy = files.read_folder(ckpt).tensors, files.read_folder(saved).tensors
    differ = [
      n for n, t in source.items()
      if n not in copy or (copy[n].dtype, copy[n].shape) != (t.dtype, t.shape)
      or files.read(copy[n]).tobytes() != files.read(t).tobytes()
    ]  # fmt: skip
    out["tensors"], out["differing"] = len(source), differ[:8]
    out["save_identical"] = not differ and set(copy) == set(source)
    del hosted, params
    on_device = model()
    before = peak()
    offlax.load_safetensors(on_device, ckpt, progress=False)
    jax.block_until_ready(jax.tree.leaves(nnx.state(on_device, nnx.Param)))
    after = peak()
    out["on_device_growth_bytes"] = None if before is None or after is None else after - before
  return out
