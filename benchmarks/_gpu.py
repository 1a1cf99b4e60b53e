"""What gpu_check.py's sections share: a model's shapes, the step, timing, errors, child processes.

Private to `benchmarks/`. Each section takes the modules it uses (`offlax`, `optax`, `jax`) as
arguments, imported once by gpu_check.py's `main`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

# The script `in_child` starts (with `--child`) to run one section in a fresh process.
GPU_CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check.py")


def transformer_shapes(n_params: float, layers: int = 16):
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


def optimizer_step(tx):
  import optax

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def materialise(shapes, seed, place=lambda x: x):
  """Random arrays of `shapes`, each `place`d as it is made (one leaf at a time on the device)."""
  import jax

  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))

  def make(s):
    return jax.block_until_ready(place(jax.random.normal(next(keys), s.shape, s.dtype) * 0.1))

  return jax.tree.map(make, shapes)


def time_calls(fn, args, steps, warmup, jax, keep=False, last=False):
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


def error_text(e: BaseException) -> str:
  """`e` and the innermost offlax and benchmark frames it passed: what to fix without a GPU."""
  frames = [f for f in traceback.extract_tb(e.__traceback__) if "offlax" in f.filename
            or "benchmarks" in f.filename or "examples" in f.filename][-4:]  # fmt: skip
  where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames))
  return f"{type(e).__name__}: {str(e)[:400]} [at {where}]"


def in_child(section: str, env: dict | None = None, **kwargs) -> dict:
  """Runs `section(**kwargs)` in a fresh process (`gpu_check.py --child`) and returns its result.

  Errors are results too.

  The device's `peak_bytes_in_use` only grows within a process: a peak read after
  earlier sections would be theirs; and the native kernel reads its environment
  (`env`, added to this one's) once per process. What the kernel says of its
  threads (``OFFLAX_NATIVE_DEBUG``) is returned as ``native_said``.
  """
  cmd = [sys.executable, GPU_CHECK, "--child", json.dumps([section, kwargs])]
  env = {**os.environ, **(env or {})}
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
  lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
  if run.returncode != 0 or not lines:
    return {"error": f"child exited {run.returncode}: {run.stderr.strip()[-500:]}"}
  result = json.loads(lines[-1][len("RESULT ") :])
  said = [x for x in run.stderr.splitlines() if x.startswith("offlax native:")]
  return {**result, "native_said": said[0]} if said else result


def predicted_peak(offlax, step, params, state, *args, n_params=None):
  """`compile_for_gpu`'s device peak of `step` for an H200, and its error (one is None).

  The prediction's own error must not cost the measurement beside it.
  """
  from offlax._src import gpu_compile

  if not offlax.extend.gpu_compile_available():
    return None, None
  specs = gpu_compile.state_specs
  try:
    m = offlax.compile_for_gpu(
      step, specs(params), specs(state), *args, target="h200", n_params=n_params
    )
  except Exception as e:
    return None, error_text(e)
  return m.device_peak, None
