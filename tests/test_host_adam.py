"""`offlax.adam`/`adamw`: optax's results, bit for bit, with the native moments kernel."""

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal, committed, committed_state, grads_like, model_params

import offlax
from offlax._src import coupling, ffi, host_adam


def _float_params():
  params = model_params()
  del params["steps_seen"]
  return params


def _f32_params():
  return jax.tree.map(lambda x: x.astype(jnp.float32), _float_params())


def _train(tx, params, steps=4):
  params = committed(params)  # the step compiles once
  state = committed_state(tx.init(params))
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  for i in range(steps):
    updates, state = step(params, state, grads_like(params, i))
    params = optax.apply_updates(params, updates)
  return params, state


schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
CASES = {
  "adam": lambda m: m.adam(1e-3),
  "adam_schedule": lambda m: m.adam(schedule),
  "adam_hyper": lambda m: m.adam(3e-3, b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-9),
  "adamw": lambda m: m.adamw(1e-3, weight_decay=0.1),
  "adamw_no_decay": lambda m: m.adamw(1e-3, weight_decay=0.0),
  "adamw_mask": lambda m: m.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
  "adamw_schedule": lambda m: m.adamw(schedule, weight_decay=0.05),
  "inject": lambda m: optax.inject_hyperparams(m.adam)(learning_rate=1e-3, b1=0.85),
}


@pytest.mark.slow_except("native-adam", "plain-adamw", "native-inject")
@pytest.mark.parametrize("case", CASES)
def test_bit_identical_to_optax(case, native):
  params = _f32_params()
  want = _train(CASES[case](optax), params)
  got = _train(CASES[case](offlax), params)
  assert_trees_equal(got, want)


def test_the_kernel_runs_on_cpu_and_not_for_cuda():
  assert host_adam.native_available()
  tx = offlax.adam(1e-3)
  params = _f32_params()
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  args = (params, tx.init(params), params)
  assert "offlax_adam_moments_f32" in step.lower(*args).as_text()
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  exported = jax.export.export(step, platforms=["cuda"])(*specs)
  assert "offlax_adam" not in exported.mlir_module()


@pytest.mark.parametrize(
  "make",
  [
    lambda m: m.adam(1e-3, mu_dtype=jnp.bfloat16),
    lambda m: m.adam(1e-3, nesterov=True),
    lambda m: m.adamw(1e-3, weight_decay=lambda c: 1e-4 * c),
    lambda m: m.adamw(1e-3, mask={"w": True}),  # a prefix mask: optax.masked's rules
  ],
  ids=["mu_dtype", "nesterov", "decay_schedule", "prefix_mask"],
)
def test_what_the_kernel_does_not_cover_runs_optax(make):
  params = {"w": {"a": jnp.linspace(-1, 1, 12).reshape(3, 4), "b": jnp.ones(4)}}
  assert_trees_equal(_train(make(offlax), params), _train(make(optax), params))


def test_bf16_leaves_run_optax():
  params = _float_params()  # a bf16 embedding among fp32 leaves
  assert_trees_equal(_train(offlax.adam(1e-3), params), _train(optax.adam(1e-3), params))


@pytest.mark.slow_except("native-device", "plain-host")
@pytest.mark.parametrize("mode", ["device", "host"])
def test_under_offload(mode, native):
  params = _f32_params()
  want = _train(optax.adamw(1e-3), params)
  tier = offlax.HostTier(compute=mode, chunk_bytes=1024)
  got_params, got_state = _train(offlax.offload(offlax.adamw(1e-3), tier), params)
  assert_trees_equal(got_params, want[0])
  assert_trees_equal(got_state.inner_state, want[1])


def test_under_the_nvme_tier(tmp_path):
  params = _f32_params()
  want, _ = _train(optax.adam(1e-3), params)
  tier = offlax.NVMeTier(str(tmp_path), chunk_bytes=3000, cache_bytes=0, progress=False)
  got, _ = _train(offlax.offload(offlax.adam(1e-3), tier), params)
  tier.close()
  assert_trees_equal(got, want)


def test_adamw_needs_params():
  tx = offlax.adamw(1e-3)
  params = _f32_params()
  with pytest.raises(ValueError, match="params"):
    tx.update(params, tx.init(params))


def test_fused_update_matches_optax_to_rounding():
  """The whole step in one pass (update written out): optax's maths, rounded its own way.

  It divides once, m / (bc1 * denominator), where this test's XLA divides twice;
  the moments are bit-identical. Tolerance: 2e-6 relative, 1e-10 absolute (the
  updates are about 1e-3; the absolute term covers updates where the weight
  decay cancels the Adam step).
  """
  assert host_adam.native_available()
  k = jax.random.split(jax.random.key(1), 2)
  p = {"a": jax.random.normal(k[0], (1000,)), "b": jax.random.normal(k[1], (37,))}
  ref = optax.adamw(1e-3, weight_decay=0.1)
  state = ref.init(p)
  for i in range(3):
    g = jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), p)
    hyper = host_adam.Hyper(
      0.9,
      0.999,
      1 - 0.9 ** jnp.float32(i + 1),
      1 - 0.999 ** jnp.float32(i + 1),
      1e-8,
      0.0,
      -1e-3,
      False,
      0.1,
    )
    vector = hyper.vector(moments_only=False)
    got = {
      k: jax.jit(host_adam.fused_update, static_argnames="decay")(
        g[k], state[0].mu[k], state[0].nu[k], p[k], vector, decay=True
      )
      for k in p
    }
    want, state = jax.jit(ref.update)(g, state, p)
    for k in p:
      np.testing.assert_allclose(got[k][0], want[k], rtol=2e-6, atol=1e-10)
      assert_trees_equal((got[k][1], got[k][2]), (state[0].mu[k], state[0].nu[k]))


NATIVE_UPDATE = {
  "adam": lambda: offlax.adam(1e-3, native_update=True),
  "adam_schedule": lambda: offlax.adam(schedule, native_update=True),
  "adamw": lambda: offlax.adamw(1e-3, weight_decay=0.1, native_update=True),
  "adamw_mask": lambda: offlax.adamw(
    1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), native_update=True
  ),
}
REFERENCE = {
  "adam": lambda: optax.adam(1e-3),
  "adam_schedule": lambda: optax.adam(schedule),
  "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
  "adamw_mask": lambda: optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
}


@pytest.mark.slow_except(
  "native-adamw-device", "native-adamw_mask-host", "plain-adam_schedule-host"
)
@pytest.mark.parametrize("mode", ["device", "host"])
@pytest.mark.parametrize("case", NATIVE_UPDATE)
def test_native_update_matches_optax_to_rounding(case, mode, native):
  """`native_update=True`: the kernel writes the update too.

  Without the kernel (plain JAX) the results are optax's bit for bit. With it,
  the update is rounded the kernel's way (one division, see
  `test_fused_update_matches_optax_to_rounding`). The gradients here do not
  depend on the params, so the moments stay bit-identical; after 4 steps the
  params agree to 1e-6 relative, 1e-7 absolute (an ulp or two: steps of up to
  1e-2, each within 2e-6 relative).
  """
  params = committed(_f32_params())  # each step compiles once

  def train(tx):
    state, p = committed_state(tx.init(params)), params
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    for i in range(4):
      updates, state = step(p, state, grads_like(params, i))
      p = optax.apply_updates(p, updates)
    return p, state, step

  tx = offlax.offload(NATIVE_UPDATE[case](), offlax.HostTier(compute=mode, chunk_bytes=1024))
  got_params, got_state, step = train(tx)
  want_params, want_state, _ = train(REFERENCE[case]())
  assert_trees_equal(got_state.inner_state, want_state)
  if not native:
    assert_trees_equal(got_params, want_params)
    return
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  jax.tree.map(close, got_params, want_params)
  # The program the steps ran (jit's cache: no second compile).
  state = committed_state(tx.init(params))
  assert "offlax_adam_f32" in step.lower(params, state, params).compile().as_text()


@pytest.mark.parametrize("native_update", [False, True])
@pytest.mark.parametrize("mode", ["device", "host"])
def test_cuda_lowering_calls_the_kernel_only_on_the_host(mode, native_update):
  """For a GPU: the kernel is in the host computation (JAX lowers it for "cpu"), nowhere else.

  Whether XLA:GPU runs an FFI call inside a host computation is what
  benchmarks/gpu_check.py checks on a GPU (OFFLAX_NATIVE=0 turns the kernel off).
  """
  assert host_adam.native_available()
  tx = offlax.offload(offlax.adam(1e-3, native_update=native_update), offlax.HostTier(compute=mode))
  params = _f32_params()
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  specs = (params, offlax.abstract_state(tx, params), params)  # the offload tx: its tier
  target = "offlax_adam_f32" if native_update else "offlax_adam_moments_f32"
  checks = [jax.export.DisabledSafetyCheck.custom_call(target)]
  text = jax.export.export(step, platforms=["cuda"], disabled_checks=checks)(*specs).mlir_module()
  calls = [line for line in text.splitlines() if f"@{target}(" in line]
  if mode == "device":
    assert not calls
  else:
    assert len(calls) == sum(x.size > 0 for x in jax.tree.leaves(params))  # not the empty one
    assert all('_xla_compute_type = "host"' in line for line in calls)


def test_a_failed_build_falls_back_to_jax(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(ffi, "_registered", None)
  monkeypatch.setenv("OFFLAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  with caplog.at_level(logging.WARNING, logger="offlax"):
    assert not host_adam.native_available()
  assert "native library unavailable" in caplog.text
  params = _f32_params()
  assert_trees_equal(_train(offlax.adam(1e-3), params), _train(optax.adam(1e-3), params))


def test_an_edited_header_rebuilds_the_library(tmp_path, monkeypatch):
  """The library's cache key covers native/*.h (common.h), not the sources alone."""
  import shutil

  native = tmp_path / "native"
  shutil.copytree(ffi._NATIVE, native)
  compiler = tmp_path / "cxx"  # touches its output: the key, not the compile, is tested
  loop = 'while [ "$#" -gt 1 ]; do [ "$1" = -o ] && touch "$2"; shift; done'
  compiler.write_text(f"#!/bin/sh\n{loop}\n")
  compiler.chmod(0o755)
  monkeypatch.setattr(ffi, "_NATIVE", native)
  monkeypatch.setenv("OFFLAX_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("CXX", str(compiler))
  first = ffi._build()
  assert ffi._build() == first
  header = native / "common.h"
  header.write_text(header.read_text() + "// edited\n")
  assert ffi._build() != first


@pytest.mark.parametrize("compute", ["host", "device"])
def test_on_the_cpu_backend_the_native_step_updates_each_leaf_whole(compute):
  """On the CPU backend no slice of the state is taken: each leaf is updated in place.

  Cutting a leaf copies its slices out and back: the mixed-precision host step
  ran 6-11x slower so, with a page fault per 4 KiB of state. GPU programs do cut
  the kernel's leaves (`coupling.split_native`; `compile_for_gpu` traces so).
  """
  assert ffi.available()
  params = {f"w{i}": jnp.full((1 << 16,), 0.5, jnp.bfloat16) for i in range(4)}
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.005), params)
  # Slices of 64 KiB: every leaf (768 KiB of state) is larger than one.
  tier = offlax.HostTier(compute=compute, chunk_bytes=1 << 16)
  tx = offlax.offload(offlax.master_weights(offlax.adamw(1e-3)), tier)
  state = tx.init(params)
  step = lambda p, s, g: offlax.update_and_apply(tx, g, s, p)  # noqa: E731
  sliced = re.compile(r"\b(dynamic_)?slice\[")
  jaxpr = str(jax.make_jaxpr(step)(params, state, grads))
  assert jaxpr.count("ffi_call") == 4 and not sliced.search(jaxpr)
  with coupling.splitting_native(True):  # as in a GPU program
    jaxpr = str(jax.make_jaxpr(step)(params, state, grads))
  assert sliced.search(jaxpr)


def test_a_plugin_that_refuses_the_handlers_turns_the_kernel_off(monkeypatch, caplog):
  """A GPU plugin whose host computations could not find the kernels: plain JAX everywhere.

  (A GPU program naming a target its host computation lacks aborts the process.)
  """
  import ctypes

  from jax._src import xla_bridge

  fake_api = (ctypes.c_size_t * 2)(16, 0)  # PJRT_Api {struct_size, extension_start = NULL}
  make = ctypes.pythonapi.PyCapsule_New
  make.restype = ctypes.py_object
  make.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
  capsule = make(ctypes.addressof(fake_api), b"pjrt_c_api", None)
  monkeypatch.setattr(xla_bridge, "register_plugin_callbacks", lambda cb: cb(c_api=capsule))
  monkeypatch.setattr(ffi, "_registered", None)
  with caplog.at_level(logging.WARNING, logger="offlax"):
    assert not host_adam.native_available()
  assert "the PJRT plugin has no FFI extension" in caplog.text
  tx = offlax.adam(1e-3)
  params = _f32_params()
  text = jax.jit(lambda p, s: tx.update(p, s, p)).lower(params, tx.init(params)).as_text()
  assert "offlax_adam" not in text


DEFAULT_FLAGS = textwrap.dedent(
  """
    import json, jax, jax.numpy as jnp, numpy as np, optax, offlax
    from offlax._src import host_adam
    k = jax.random.split(jax.random.key(0), 3)
    trees = {"one leaf": {"w": jax.random.normal(k[0], (4096,))},
             "three leaves": {"w": jax.random.normal(k[0], (64, 32)), "b": jnp.zeros(32),
                              "e": jax.random.normal(k[1], (50, 16))}}

    def run(tx, params, steps=5):
      state, p = tx.init(params), params
      step = jax.jit(lambda p, s, g: tx.update(g, s, p))
      for i in range(steps):
        g = jax.tree.map(lambda x: jnp.sin(x * (i + 1)) * 10.0 ** (i - 3), p)
        u, state = step(p, state, g)
        p = optax.apply_updates(p, u)
      return p, state

    def same(a, b):
      return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                 for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    out = {"native": host_adam.native_available()}
    for name, params in trees.items():
      for opt in ("adam", "adamw"):
        out[f"{opt}, {name}"] = same(run(getattr(offlax, opt)(1e-3), params),
                                     run(getattr(optax, opt)(1e-3), params))
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # a subprocess, as test_default_flags.py
def test_bit_identical_under_default_xla_flags(tmp_path):
  """With XLA's rewrites and FMA on, as users run it (conftest turns them off)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["OFFLAX_CACHE_DIR"] = str(tmp_path)
  result = subprocess.run(
    [sys.executable, "-c", DEFAULT_FLAGS], env=env, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.strip().splitlines()[-1])
  assert out.pop("native") is True
  assert all(out.values()), out


# -- the whole step in one pass (moments, master or params, new params) ------------

WHOLE = {
  "adam": lambda m: m.adam(1e-3),
  "adamw": lambda m: m.adamw(1e-3, weight_decay=0.1),
  "adamw_mask_schedule": lambda m: m.adamw(
    schedule, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  ),
}


def _mixed_params():
  """bf16 weights and an fp32 bias: what `master_weights` is for."""
  k = jax.random.split(jax.random.key(3), 3)
  return {
    "w": jax.random.normal(k[0], (300, 7)).astype(jnp.bfloat16),
    "b": jax.random.normal(k[1], (7,)),
    "e": jax.random.normal(k[2], (70, 3)).astype(jnp.bfloat16),
  }


def _steps(tx, params, fused, steps=4):
  """`steps` jitted steps: `offlax.update_and_apply`, or `tx.update` then optax's apply."""
  params = committed(params)  # the step compiles once
  state = committed_state(tx.init(params))

  def step(p, s, g):
    if fused:
      return offlax.update_and_apply(tx, g, s, p)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(step)
  for i in range(steps):
    params, state = step(params, state, grads_like(params, i))
  return (params, state), step.lower(params, state, params).compile().as_text()


@pytest.mark.slow_except(
  "native-adamw-update",
  "native-adamw_mask_schedule-update_and_apply",
  "plain-adam-update_and_apply",
)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
@pytest.mark.parametrize("case", WHOLE)
def test_master_weights_whole_step_bit_identical(case, fused, native):
  """`master_weights(offlax.adamw(...))` in one native pass: optax's results, bit for bit.

  The pass reads the bf16 gradient, both moments and the fp32 master, and
  writes them and the new bf16 param (`update_and_apply`) or its fp32 update
  (`update`). Its update is optax's expression as written, so under this
  test's XLA flags (evaluate as written) it is bit-identical.
  """
  params = _mixed_params()
  want, _ = _steps(offlax.master_weights(WHOLE[case](optax)), params, fused=False)
  got, text = _steps(offlax.master_weights(WHOLE[case](offlax)), params, fused)
  assert_trees_equal(got, want)
  assert ("offlax_adam_step" in text) == native


@pytest.mark.slow_except("native-adamw")
@pytest.mark.parametrize("case", WHOLE)
def test_update_and_apply_is_one_pass(case, native):
  """`offlax.update_and_apply(offlax.adam(...), ...)`: the CPU-only full step, in place."""
  params = _f32_params()
  want, _ = _steps(WHOLE[case](optax), params, fused=False)
  got, text = _steps(WHOLE[case](offlax), params, fused=True)
  assert_trees_equal(got, want)
  assert ("offlax_adam_step" in text) == native
  if native:  # params and state updated in place: no temporaries but scalars
    tx = WHOLE[case](offlax)
    step = jax.jit(lambda p, s, g: offlax.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
    stats = step.lower(params, tx.init(params), params).compile().memory_analysis()
    assert stats.temp_size_in_bytes < 4096


@pytest.mark.parametrize("mode", [pytest.param("device", marks=pytest.mark.slow), "host"])
def test_master_weights_whole_step_under_offload(mode):
  params = _mixed_params()
  inner = lambda m: offlax.master_weights(m.adamw(1e-3, weight_decay=0.1))
  want, _ = _steps(inner(optax), params, fused=False)
  tier = offlax.HostTier(compute=mode, chunk_bytes=1024)
  (got_params, got_state), text = _steps(offlax.offload(inner(offlax), tier), params, True)
  assert_trees_equal(got_params, want[0])
  assert_trees_equal(got_state.inner_state, want[1])
  assert "offlax_adam_step" in text


def test_whole_step_kernel_only_in_the_host_computation_for_cuda():
  tx = offlax.offload(
    offlax.master_weights(offlax.adamw(1e-3)), offlax.HostTier(compute="host", chunk_bytes=1024)
  )
  params = _mixed_params()
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  specs = (params, offlax.abstract_state(tx, params), params)
  checks = [jax.export.DisabledSafetyCheck.custom_call("offlax_adam_step")]
  text = jax.export.export(step, platforms=["cuda"], disabled_checks=checks)(*specs).mlir_module()
  calls = [line for line in text.splitlines() if "@offlax_adam_step(" in line]
  assert calls and all('_xla_compute_type = "host"' in line for line in calls)


WHOLE_STEP_RUN = textwrap.dedent(
  """
    import hashlib, json, jax, jax.numpy as jnp, numpy as np, optax, offlax
    k = jax.random.split(jax.random.key(0), 2)
    params = {"w": jax.random.normal(k[0], (3, 1 << 18)).astype(jnp.bfloat16),
              "b": jax.random.normal(k[1], (4096,))}

    def run(tx, fused, steps=5):
      state, p = tx.init(params), params
      def step(p, s, g):
        if fused:
          return offlax.update_and_apply(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
      step = jax.jit(step)
      for i in range(steps):
        g = jax.tree.map(lambda x: (jnp.sin(x * (i + 1)) * 10.0 ** (i - 3)).astype(x.dtype),
                         params)
        p, state = step(p, state, g)
      return p, state

    got = run(offlax.master_weights(offlax.adamw(1e-3, weight_decay=0.1)), True)
    want = run(offlax.master_weights(optax.adamw(1e-3, weight_decay=0.1)), False)
    # Normwise relative difference, and the largest elementwise one (for bf16 leaves).
    diff = lambda a, b: np.abs(np.float32(a) - np.float32(b))
    rel = lambda a, b: [float(np.max(diff(a, b)) / np.max(np.abs(np.float32(b)))),
                        float(np.max(diff(a, b) / np.maximum(np.abs(np.float32(b)), 1e-30)))]
    parts = lambda r: {"params": r[0], "master": r[1].master, "mu": r[1].inner_state[0].mu,
                       "nu": r[1].inner_state[0].nu}
    print(json.dumps({"rel": jax.tree.map(rel, parts(got), parts(want)),
                      "digest": [hashlib.sha256(np.asarray(x).tobytes()).hexdigest()
                                 for x in jax.tree.leaves(got)]}))
    """
)


def _whole_step_run(tmp_path, **env_vars):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(OFFLAX_CACHE_DIR=str(tmp_path), **env_vars)
  run = subprocess.run(
    [sys.executable, "-c", WHOLE_STEP_RUN], env=env, capture_output=True, text=True, timeout=600
  )
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess, as the above
def test_whole_step_under_default_xla_flags(tmp_path):
  """Under XLA's defaults (rewrites, FMA) optax's program rounds its own way.

  The moments of the fp32 leaf stay bit-identical (the gradients do not
  depend on the params); those of the bf16 leaf, whose gradient XLA widens
  inside the moments' fusion and contracts its own way, agree to 1e-6
  normwise relative, as do the master and the fp32 params after 5 steps (an
  ulp or two of float32 per step); a bf16 param differs from optax's only
  where its master lies that close to a rounding boundary of bf16, and then by
  one bf16 ulp (2**-7 relative at most).
  """
  rel = _whole_step_run(tmp_path)["rel"]
  assert rel["mu"]["b"][0] == rel["nu"]["b"][0] == 0.0
  assert all(r[0] < 1e-6 for r in [*rel["mu"].values(), *rel["nu"].values()])
  assert all(r[0] < 1e-6 for r in rel["master"].values())
  assert rel["params"]["b"][0] < 1e-6 and rel["params"]["w"][1] <= 2**-7


_POOL_RUN = """
import hashlib, jax, jax.numpy as jnp, numpy as np, offlax
tx = offlax.adamw(1e-3); p = {"w": jnp.linspace(-1, 1, 1 << 21)}; s = tx.init(p)
for _ in range(2):
  u, s = jax.jit(tx.update)(p, s, p)
print(hashlib.sha256(np.asarray(u["w"]).tobytes() + np.asarray(s[0].nu["w"]).tobytes()).hexdigest())
"""


def _pool_run(**env_vars):
  env = {k: v for k, v in os.environ.items() if k != "OFFLAX_NATIVE_THREADS"}
  env.update(OFFLAX_NATIVE_DEBUG="1", **env_vars)
  run = subprocess.run(
    [sys.executable, "-c", _POOL_RUN], env=env, capture_output=True, text=True, timeout=600
  )
  assert run.returncode == 0, run.stderr[-3000:]
  said = re.findall(r"offlax native: XLA's intra-op pool has (\d+) threads; .* ran on (\d+) "
                    r"threads \((.*)\)", run.stderr)  # fmt: skip
  assert len(said) == 1, run.stderr[-3000:]  # said once
  (pool, threads, which) = said[0]
  return run.stdout.split()[-1], int(pool), int(threads), which


@pytest.mark.slow  # the native kernels' bit-exact tests run by default
def test_native_pool_xla_or_own_gives_the_same_bytes():
  """XLA's pool (the CPU backend's), or offlax's own (what a call with no XLA pool gets)."""
  digest, pool, threads, which = _pool_run()
  assert which == "XLA's pool" and pool >= 1 and 1 <= threads <= pool
  own = _pool_run(OFFLAX_NATIVE_POOL="own")
  # One thread per core this process may use (the caller's and the workers'); 32 chunks.
  assert own[3] == "offlax's own pool" and own[2] == min(len(os.sched_getaffinity(0)), 32)
  assert own[0] == digest


@pytest.mark.slow
def test_whole_step_threads_do_not_change_results(tmp_path):
  """One thread (OFFLAX_NATIVE_THREADS=1) or XLA's whole pool: the same bytes."""
  one = _whole_step_run(tmp_path, OFFLAX_NATIVE_THREADS="1")
  assert one["digest"] == _whole_step_run(tmp_path)["digest"]
