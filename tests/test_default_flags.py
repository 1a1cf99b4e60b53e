"""Under XLA's default flags: one slice is bit-exact, streaming within a few ulp.

The other tests run with two XLA:CPU rewrites disabled (see conftest.py). Here a
subprocess uses the defaults, as users do.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
  """
    import json, jax, jax.numpy as jnp, numpy as np, optax, offlax
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (64, 32)), "b": jnp.zeros(32),
              "e": jax.random.normal(k[1], (50, 16)).astype(jnp.bfloat16)}

    def run(tx, steps=5):
      state, p = tx.init(params), params
      step = jax.jit(lambda p, s, g: tx.update(g, s, p))
      for i in range(steps):
        g = jax.tree.map(lambda x: jnp.sin(x.astype(jnp.float32) * (i + 1)).astype(x.dtype), p)
        u, state = step(p, state, g)
        p = optax.apply_updates(p, u)
      return p

    def ulps(a, b):
      a, b = np.asarray(a), np.asarray(b)
      bits = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
      return int(np.max(np.abs(a.view(bits).astype(np.int64) - b.view(bits).astype(np.int64))))

    def rel(a, b):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      return float(np.max(np.abs(a - b) / (np.abs(b) + 1e-30)))

    out = {}
    for name, inner in [("adamw", optax.adamw(1e-3)), ("lamb", optax.lamb(1e-3))]:
      want = run(inner)
      one = run(offlax.offload(inner))
      streamed = run(offlax.offload(inner, chunk_bytes=1024))
      out[name] = {
          "one_slice": max(jax.tree.leaves(jax.tree.map(ulps, one, want))),
          "streamed": max(jax.tree.leaves(jax.tree.map(ulps, streamed, want))),
          "rel": max(jax.tree.leaves(jax.tree.map(rel, streamed, want))),
      }
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # a subprocess under the default XLA flags
def test_default_xla_flags():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]
  ulps = json.loads(result.stdout.strip().splitlines()[-1])
  for name, d in ulps.items():
    assert d["one_slice"] == 0, (name, d)
    # Measured: up to ~32 ulp after five steps (about 2e-6 relative), from
    # division and FMA rewrites that depend on the surrounding program.
    assert d["streamed"] <= 256 and d["rel"] <= 1e-4, (name, d)
