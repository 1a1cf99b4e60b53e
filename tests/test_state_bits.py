"""`offlax.adam/adamw(state_bits=8)`: the 8-bit blockwise scheme, its update and every tier.

The reference here is written independently of `offlax/_src/quantized.py`: the
code maps as bitsandbytes' `create_dynamic_map` builds them, and a per-block
NumPy quantizer with the documented rule (the index is the number of float32
midpoints <= x * (1 / absmax)).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_trees_equal, committed, committed_state

import offlax
from offlax._src import adam8, quantized
from offlax._src.layout import ParamSpec, StateLayout
from offlax._src.nvme.store import Store
from offlax.checkpoint import NVMeStoreRestore
from offlax.errors import InvalidOptionError, TreeMismatchError

B = 256


def _bnb_map(signed: bool) -> np.ndarray:
  """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), transcribed."""
  data = []
  max_exponent_bits, total_bits = 7, 8
  non_sign_bits = total_bits - 1
  additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
  for i in range(max_exponent_bits):
    exponent = i + non_sign_bits - max_exponent_bits
    fraction_items = int(2**exponent + 1 if signed else 2 ** (exponent + 1) + 1)
    boundaries = np.linspace(0.1, 1, fraction_items)
    means = (boundaries[:-1] + boundaries[1:]) / 2.0
    data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if signed:
      data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
  assert additional_items == 0
  data += [0, 1.0]
  assert len(data) == 2**total_bits
  return np.sort(np.array(data, np.float64)).astype(np.float32)


def _ref_quantize(x, signed):
  """Per-block NumPy quantizer: (codes in x's shape, float32 absmax per block)."""
  table = _bnb_map(signed).astype(np.float64)
  mids = ((table[:-1] + table[1:]) / 2).astype(np.float32)
  flat = np.asarray(x, np.float32).ravel()
  codes = np.empty(flat.size, np.int64)
  scales = []
  for start in range(0, flat.size, B):
    block = flat[start : start + B]
    s = np.float32(np.max(np.abs(block)))
    y = block * (np.float32(1) / (s if s > 0 else np.float32(1)))
    codes[start : start + B] = np.searchsorted(mids, y, side="right")
    scales.append(s)
  codes = (codes - 128).astype(np.int8) if signed else codes.astype(np.uint8)
  return codes.reshape(np.shape(x)), np.asarray(scales, np.float32)


def _ref_dequantize(codes, scales, signed):
  table = _bnb_map(signed)
  index = codes.astype(np.int64).ravel() + (128 if signed else 0)
  per_element = np.repeat(scales, B)[: index.size]
  return (table[index] * per_element).reshape(codes.shape)


def _x(n=5000, seed=0):
  """Values over many orders of magnitude, a block of zeros and a partial last block."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 2, n)
  x[B : 2 * B] = 0.0
  return x.astype(np.float32)


def test_code_maps_are_bitsandbytes():
  for signed in (True, False):
    np.testing.assert_array_equal(quantized.code_map(signed), _bnb_map(signed))
  signed, unsigned = quantized.code_map(True), quantized.code_map(False)
  assert signed[127] == 0 and signed[-1] == 1 and signed[0] == np.float32(-0.99296875)
  assert unsigned[0] == 0 and unsigned[-1] == 1 and unsigned[1] == np.float32(3.25e-7)


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_matches_reference_bit_for_bit(signed):
  x = _x()
  x = x if signed else np.abs(x)
  codes, scales = jax.jit(quantized.quantize, static_argnums=1)(x, signed)
  want_codes, want_scales = _ref_quantize(x, signed)
  assert codes.dtype == (np.int8 if signed else np.uint8) and scales.shape == (20,)
  assert_trees_equal((codes, scales), (want_codes, want_scales))
  got = jax.jit(quantized.dequantize, static_argnums=2)(codes, scales, signed)
  assert_trees_equal(got, _ref_dequantize(want_codes, want_scales, signed))
  assert not np.any(np.asarray(got)[B : 2 * B])  # the block of zeros: scale 0, values 0


@pytest.mark.parametrize("signed", [True, False])
def test_ties_go_to_the_larger_entry_and_codes_are_nearest(signed):
  table = _bnb_map(signed).astype(np.float64)
  mids = ((table[:-1] + table[1:]) / 2).astype(np.float32)
  # Two blocks, each led by 1.0 so that x * (1 / absmax) is x itself: the midpoints, the entries.
  x = np.concatenate([[1.0], mids, [1.0], table[1:-1], [0.0]]).astype(np.float32)
  codes, scales = quantized.quantize(x, signed)
  index = np.asarray(codes).astype(np.int64) + (128 if signed else 0)
  np.testing.assert_array_equal(scales, [1.0, 1.0])
  np.testing.assert_array_equal(index[1:256], np.arange(1, 256))  # each midpoint: the upper one
  np.testing.assert_array_equal(index[257:511], np.arange(1, 255))  # each entry: itself
  # Everywhere: the nearest entry (up to the float32 rounding of the midpoints).
  y = np.asarray(x, np.float64)
  nearest = np.abs(table[None, :] - y[:, None]).min(axis=1)
  assert np.all(np.abs(table[index] - y) <= nearest + 1e-7)


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_is_bounded(signed):
  x = _x(n=64 * B, seed=1)
  x = x if signed else np.abs(x)
  codes, scales = quantized.quantize(x, signed)
  err = np.abs(np.asarray(quantized.dequantize(codes, scales, signed)) - x).reshape(-1, B)
  bound = np.asarray(quantized.max_error(scales, signed))
  # Half the widest gap of the map (its top decade) times the block's absmax.
  assert bound[0] / float(scales[0]) == pytest.approx((0.9 / (64 if signed else 128)) / 2, 1e-4)
  assert np.all(err <= bound[:, None])
  # ... and the bound is nearly reached: it is the scheme's, not a loose one.
  uniform = np.linspace(-1 if signed else 0, 1, 4096, dtype=np.float32)
  c, s = quantized.quantize(uniform, signed)
  worst = np.abs(np.asarray(quantized.dequantize(c, s, signed)) - uniform).max()
  assert worst >= 0.9 * float(np.asarray(quantized.max_error(s, signed)).max())


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "w": jax.random.normal(k[0], (70, 100)),  # 7000: 28 blocks, the last one partial
    "emb": {"table": jax.random.normal(k[1], (64, 80)) * 0.1},  # 5120 elements, 20 blocks
    "b": jnp.zeros(100),  # < 4096: float32 moments
    "norm": (jnp.ones(16), jax.random.normal(k[2], (4096,))),
  }


def _grads(params, step):
  keys = jax.random.split(jax.random.key(100 + step), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  scale = 10.0 ** jnp.linspace(-6, 0, 7000)  # gradients over six decades
  return treedef.unflatten(
    [
      jax.random.normal(k, x.shape, x.dtype) * scale[: x.size].reshape(x.shape).astype(x.dtype)
      for k, x in zip(keys, leaves, strict=True)
    ]
  )


def _train(tx, params, steps, state=None):
  params = committed(params)  # the step compiles once
  state = committed_state(tx.init(params)) if state is None else state
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  updates = None
  for i in range(steps):
    updates, state = step(params, state, _grads(params, i))
    params = optax.apply_updates(params, updates)
  return params, state, updates


def _mask(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
CASES = {
  "adam": (lambda m, **k: m.adam(1e-3, **k), lambda: optax.adam(1e-3)),
  "adam_nesterov": (
    lambda m, **k: m.adam(3e-3, b1=0.8, eps_root=1e-9, nesterov=True, **k),
    lambda: optax.adam(3e-3, b1=0.8, eps_root=1e-9, nesterov=True),
  ),
  "adamw_mask_schedule": (
    lambda m, **k: m.adamw(schedule, weight_decay=0.1, mask=_mask, **k),
    lambda: optax.adamw(schedule, weight_decay=0.1, mask=_mask),
  ),
}


@pytest.mark.parametrize("case", CASES)
def test_update_is_dequantize_optax_quantize_bit_for_bit(case):
  """Each step: the NumPy dequantize, optax's own adam/adamw, the NumPy quantize."""
  build, reference = CASES[case]
  params = _params()
  tx, ref = build(offlax, state_bits=8), reference()
  state = tx.init(params)
  ref_state = ref.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  ref_step = jax.jit(lambda p, s, g: ref.update(g, s, p))
  quantized_leaf = lambda x: x.size >= 4096  # noqa: E731
  ref_mu, ref_mu_scale = _ref_tree(ref_state[0].mu, True, quantized_leaf)
  ref_nu, ref_nu_scale = _ref_tree(ref_state[0].nu, False, quantized_leaf)
  for i in range(3):
    s8 = state[0]
    got = (s8.count, s8.mu, s8.nu, _scales(s8.mu_scale), _scales(s8.nu_scale))
    want = (ref_state[0].count, ref_mu, ref_nu, _scales(ref_mu_scale), _scales(ref_nu_scale))
    assert_trees_equal(got, want)
    g = _grads(params, i)
    updates, state = step(params, state, g)
    # optax's update from the moments the 8-bit state holds, dequantized by the reference.
    mu = _ref_dequantize_tree(ref_mu, ref_mu_scale, True)
    nu = _ref_dequantize_tree(ref_nu, ref_nu_scale, False)
    adam_state = optax.ScaleByAdamState(ref_state[0].count, mu, nu)
    want_updates, ref_state = ref_step(params, (adam_state, *ref_state[1:]), g)
    assert_trees_equal(updates, want_updates)
    assert_trees_equal(state[1:], ref_state[1:])
    ref_mu, ref_mu_scale = _ref_tree(ref_state[0].mu, True, quantized_leaf)
    ref_nu, ref_nu_scale = _ref_tree(ref_state[0].nu, False, quantized_leaf)
    params = optax.apply_updates(params, updates)


def _ref_dequantize_tree(codes, scales, signed):
  return jax.tree.map(
    lambda c, s: c if s is None else _ref_dequantize(np.asarray(c), s, signed),
    codes,
    scales,
    is_leaf=lambda x: x is None,
  )


def _ref_tree(tree, signed, quantized_leaf):
  pairs = jax.tree.map(
    lambda x: _ref_quantize(np.asarray(x), signed) if quantized_leaf(x) else (x, None), tree
  )
  is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and not isinstance(x[0], tuple)  # noqa: E731
  return (
    jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
    jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair),
  )


def _scales(tree):
  """The scales of a tree, float leaves kept as None (MaskedNode or the reference's None)."""
  return jax.tree.map(
    lambda s: None if s is None or isinstance(s, optax.MaskedNode) else np.asarray(s),
    tree,
    is_leaf=lambda s: s is None or isinstance(s, optax.MaskedNode),
  )


def test_state_layout():
  state = offlax.adamw(1e-3, state_bits=8).init(_params())[0]
  assert isinstance(state, adam8.ScaleByAdam8bitState)
  assert state.mu["w"].dtype == jnp.int8 and state.mu["w"].shape == (70, 100)
  assert state.nu["w"].dtype == jnp.uint8 and state.nu_scale["w"].shape == (28,)
  assert state.mu_scale["emb"]["table"].shape == (20,)
  assert state.mu["b"].dtype == jnp.float32 and isinstance(state.mu_scale["b"], optax.MaskedNode)
  assert state.mu["norm"][1].dtype == jnp.int8  # 4096 elements: quantized
  # Both trees of each moment are per-parameter state to the tiers.
  layout = StateLayout(state, ParamSpec.of(_params()))
  assert -1 not in [o for o, x in zip(layout.owners, layout.split(state), strict=True) if x.ndim]
  fp32 = sum(x.nbytes for x in jax.tree.leaves(offlax.adam(1e-3).init(_params())))
  eight = sum(x.nbytes for x in jax.tree.leaves(state))
  assert eight < 0.27 * fp32


def _same_through(tier, tmp_path=None, steps=2, mode="update"):
  params = _params()
  inner = offlax.adamw(1e-3, weight_decay=0.1, state_bits=8)
  want_params, want_state, _ = _train(inner, params, steps)
  tx = offlax.offload(inner, tier)
  if mode == "update":
    got_params, got_state, _ = _train(tx, params, steps)
  else:
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: offlax.update_and_apply(tx, g, s, p))
    got_params = params
    for i in range(steps):
      got_params, state = step(got_params, state, _grads(params, i))
    got_state = state
  assert_trees_equal(got_params, want_params)
  return got_state, want_state


@pytest.mark.parametrize(
  "compute, mode",
  [
    ("host", "update"),
    ("device", "update_and_apply"),
    pytest.param("device", "update", marks=pytest.mark.slow),
    pytest.param("host", "update_and_apply", marks=pytest.mark.slow),
  ],
)
def test_host_tier_state_equals_on_device_state(compute, mode):
  # Small chunks: the leaves go in several slices, each its own inner update.
  tier = offlax.HostTier(compute=compute, chunk_bytes=4096)
  got, want = _same_through(tier, mode=mode)
  assert_trees_equal(jax.device_get(got.inner_state), jax.device_get(want))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(got.inner_state) if x.ndim}
  assert kinds == {"pinned_host"}


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_host_compute_runs_the_native_kernel_on_slices(chunk_bytes):
  """Slices of one leaf, and of several (the others masked in every tree of the state)."""
  from offlax._src import ffi

  params = _params()
  inner = offlax.adamw(1e-3, weight_decay=0.1, state_bits=8)
  tx = offlax.offload(inner, offlax.HostTier(compute="host", chunk_bytes=chunk_bytes))
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: offlax.update_and_apply(tx, g, s, p))
  text = step.lower(params, state, params).as_text()
  assert text.count("offlax_adam8_step") == (3 if ffi.available() else 0)


@pytest.mark.slow
def test_nvme_tier_state_equals_on_device_state(tmp_path):
  tier = offlax.NVMeTier(
    str(tmp_path), chunk_bytes=4096, cache_bytes=600, progress=False, fsync=False
  )
  got, want = _same_through(tier, tmp_path)
  store = Store(str(tmp_path), fsync=False)
  store.read_metadata()
  values = [store.result(store.read(r.index, 0, r.size)).reshape(r.shape) for r in store.records]
  assert {np.dtype(r.dtype) for r in store.records} >= {np.dtype("int8"), np.dtype("uint8")}
  stored = StateLayout(want, ParamSpec.of(_params())).merge(values)
  assert_trees_equal(stored, want)
  tier.close()


@pytest.mark.slow
def test_master_weights_with_8bit_state_through_host_compute():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
  inner = offlax.master_weights(offlax.adamw(1e-3, state_bits=8))
  want_params, want_state, _ = _train(inner, params, 3)
  assert want_state.inner_state[0].mu["w"].dtype == jnp.int8
  tx = offlax.offload(inner, offlax.HostTier(compute="host", chunk_bytes=4096))
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: offlax.update_and_apply(tx, g, s, p))
  got = params
  for i in range(3):
    got, state = step(got, state, _grads(params, i))
  assert_trees_equal(got, want_params)
  assert_trees_equal(jax.device_get(state.inner_state), jax.device_get(want_state))


@pytest.mark.skipif(
  not offlax.extend.gpu_compile_available(), reason="needs offlax[gpu-compile] (jax-cuda12-plugin)"
)
@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16-master"])
def test_host_compute_of_a_models_gradients_compiles_for_gpu(master):
  """An NNX model's step with 8-bit state updated on the host, compiled by XLA:GPU.

  A matmul's gradient comes in the layout XLA's dot chose ({0,1}), and XLA:GPU failed its
  own check of the host computation's parameters ("The async-start expects the async shape
  ... to match") where the 8-bit kernel's operand wanted row-major; the CPU backend never
  saw it. The gradient pieces now enter the host computation flat.
  """
  from flax import nnx

  from offlax._src import gpu_compile

  dtype = jnp.bfloat16 if master else jnp.float32

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(64, 128, param_dtype=dtype, rngs=rngs)
      self.b = nnx.Linear(128, 64, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
      return self.b(jax.nn.relu(self.a(x.astype(dtype))))

  inner = offlax.adamw(1e-3, state_bits=8)
  tx = offlax.offload(offlax.master_weights(inner) if master else inner, compute="host")
  graphdef, state = nnx.split((model := MLP(nnx.Rngs(0)), nnx.Optimizer(model, tx, wrt=nnx.Param)))

  def step(state, x):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  specs = gpu_compile.state_specs(state)
  c = offlax.compile_for_gpu(jax.jit(step, donate_argnums=0), specs, jnp.ones((8, 64)))
  assert c.host_compute == (), c.table()
  # The 8-bit state (codes, scales, with a master its fp32 copy) stays in host memory.
  params_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert c.host["argument"] >= (2 + 4 * master) * params_bytes / dtype(0).itemsize, c.table()


def test_host_state_save_round_trip_is_exact_and_other_bits_refused(tmp_path):
  params = _params()
  inner = offlax.adamw(1e-3, state_bits=8)
  tx = offlax.offload(inner, offlax.HostTier(chunk_bytes=4096))
  _, state, _ = _train(tx, params, 2)
  with ocp.CheckpointManager(tmp_path) as m:
    m.save(2, args=ocp.args.Composite(opt=offlax.checkpoint.HostStateSave(state, progress=False)))
    m.wait_until_finished()
  with ocp.CheckpointManager(tmp_path) as m:
    target = offlax.abstract_state(inner, params)
    restored = m.restore(2, args=ocp.args.Composite(opt=offlax.checkpoint.HostStateRestore(target)))
    assert_trees_equal(jax.device_get(restored.opt), jax.device_get(state))
    fp32 = offlax.abstract_state(offlax.adamw(1e-3), params)
    with pytest.raises(TreeMismatchError, match="8-bit Adam state.*state_bits=8"):
      m.restore(2, args=ocp.args.Composite(opt=offlax.checkpoint.HostStateRestore(fp32)))


def test_state_of_the_other_bit_width_is_refused():
  params = _params()
  eight, fp32 = offlax.adam(1e-3, state_bits=8), offlax.adam(1e-3)
  g = _grads(params, 0)
  with pytest.raises(TreeMismatchError, match=r"state_bits=32\) got an 8-bit Adam state"):
    fp32.update(g, eight.init(params), params)
  with pytest.raises(TreeMismatchError, match=r"state_bits=8\) got a ScaleByAdamState"):
    eight.update(g, fp32.init(params), params)
  master = offlax.master_weights(fp32)
  state = offlax.master_weights(eight).init(params)
  with pytest.raises(TreeMismatchError, match="state_bits=8"):
    offlax.update_and_apply(master, g, state, params)


@pytest.mark.parametrize("bits", [4, 16, 0, True, "8", 8.5])
def test_bad_state_bits_are_refused_by_name(bits):
  for make in (offlax.adam, offlax.adamw):
    with pytest.raises(InvalidOptionError, match=rf"state_bits must be 8 .*{bits!r}"):
      make(1e-3, state_bits=bits)
  with pytest.raises(InvalidOptionError, match="mu_dtype.*state_bits=8"):
    offlax.adam(1e-3, mu_dtype=jnp.bfloat16, state_bits=8)


def test_state_bits_under_inject_hyperparams():
  params = _params()
  # Not injected by default (None is not a number); traced, it is refused with the way out.
  injected = optax.inject_hyperparams(offlax.adam)(learning_rate=1e-3, state_bits=8)
  with pytest.raises(InvalidOptionError, match="static_args=\\('state_bits',\\)"):
    injected.init(params)
  tx = optax.inject_hyperparams(offlax.adam, static_args=("state_bits",))(1e-3, state_bits=8)
  state = tx.init(params)
  assert state.inner_state[0].mu["w"].dtype == jnp.int8
  _, state = jax.jit(tx.update)(_grads(params, 0), state, params)
  assert state.inner_state[0].nu["w"].dtype == jnp.uint8


def _regression(tx, steps):
  """Least squares, 64 x 128 weights (quantized), features scaled over one decade."""
  k = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(k[0], (256, 64)) * jnp.logspace(-0.5, 0.5, 64)
  w_true = jax.random.normal(k[1], (64, 128))
  y = x @ w_true + 0.01 * jax.random.normal(k[2], (256, 128))
  params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)}
  loss = lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)  # noqa: E731

  @jax.jit
  def run(params):
    def body(carry, _):
      params, state = carry
      value, grads = jax.value_and_grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), value

    (params, _), curve = jax.lax.scan(body, (params, tx.init(params)), None, steps)
    return loss(params), curve

  return run(params)


@pytest.mark.slow
def test_converges_like_fp32_adam():
  """Both reach the noise floor (7.5e-5, from 139); 8-bit's final loss within 2% of fp32's."""
  lr = optax.exponential_decay(1e-1, 100, 0.5)
  fp32, curve32 = _regression(offlax.adamw(lr, weight_decay=0.0), 500)
  eight, curve8 = _regression(offlax.adamw(lr, weight_decay=0.0, state_bits=8), 500)
  assert float(curve8[0]) == float(curve32[0]) > 100
  assert float(fp32) < 1e-4
  assert abs(float(eight) - float(fp32)) <= 0.02 * float(fp32), (float(eight), float(fp32))


NATIVE_CASES = {
  "adam_update": (lambda m: m.adam(1e-3), "update"),
  "adamw_update": (lambda m: m.adamw(1e-3, weight_decay=0.1, mask=_mask), "update"),
  "adamw_schedule_apply": (lambda m: m.adamw(schedule, weight_decay=0.1), "apply"),
  "master_update": (lambda m: offlax.master_weights(m.adamw(1e-3, weight_decay=0.1)), "update"),
  "master_apply": (lambda m: offlax.master_weights(m.adamw(1e-3, weight_decay=0.1)), "apply"),
}


class _Chain:
  """`offlax.adam`/`adamw` with state_bits=8 as optax's plain chain (no native step)."""

  @staticmethod
  def adam(lr, **kw):
    return adam8.adam_8bit(lr, (0.9, 0.999, 1e-8, 0.0), **kw)

  @staticmethod
  def adamw(lr, weight_decay, mask=None):
    return adam8.adam_8bit(lr, (0.9, 0.999, 1e-8, 0.0), weight_decay, mask)


class _Offlax8:
  @staticmethod
  def adam(lr, **kw):
    return offlax.adam(lr, state_bits=8, **kw)

  @staticmethod
  def adamw(lr, **kw):
    return offlax.adamw(lr, state_bits=8, **kw)


def _run(tx, params, mode, steps=2):
  state = tx.init(params)
  if mode == "update":
    step = jax.jit(
      lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
    )
  else:
    step = jax.jit(lambda p, s, g: offlax.update_and_apply(tx, g, s, p))
  text = step.lower(params, state, params).as_text()
  for i in range(steps):
    params, state = step(params, state, _grads(params, i))
  return params, state, text.count("offlax_adam8_step")


_DEFAULT_RUN = {("adamw_update", "native"), ("adamw_schedule_apply", "leafwise_jax")}


@pytest.mark.parametrize(
  "case, kernel",
  [
    pytest.param(c, k, marks=() if (c, k) in _DEFAULT_RUN else pytest.mark.slow)
    for c in NATIVE_CASES
    for k in ("native", "leafwise_jax")
  ],
)
def test_native_step_equals_the_jax_chain_bit_for_bit(case, kernel, monkeypatch):
  """The C++ kernel (native/adam8.cc), and the per-leaf JAX it falls back to in a GPU program."""
  from offlax._src import ffi

  build, mode = NATIVE_CASES[case]
  params = _params()
  if case.startswith("master"):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  if kernel == "leafwise_jax":  # what a GPU program runs: platform_dependent's default
    monkeypatch.setattr(ffi, "on_cpu", lambda native, default, *args: default(*args))
  want_params, want_state, _ = _run(build(_Chain), params, mode)
  got_params, got_state, calls = _run(build(_Offlax8), params, mode)
  assert calls == (3 if kernel == "native" and ffi.available() else 0)  # the quantized leaves
  assert_trees_equal(got_params, want_params)
  assert_trees_equal(got_state, want_state)


def test_planner_counts_8bit_state(capsys):
  from offlax.__main__ import main as cli

  params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
  for bits, per_param in ((32, 8.0), (8, 2 + 8 / 256)):
    p = offlax.plan(
      params, offlax.adamw(1e-3, state_bits=bits), device_bytes=2**30, host_bytes=2**34
    )
    assert p.assumptions["state_bytes"] == int(per_param * 4096 * 4096) + 4  # + the count
  args = ["plan", "--params", "7e9", "--device-mem", "80GB", "--host-mem", "256GB", "--master"]
  args += ["--activations", "2GB"]  # (no working set to guess)
  assert cli(args) == 0
  assert "optimizer state 84.0 GB" in capsys.readouterr().out  # master + 2 fp32 moments
  assert cli([*args, "--state-bits", "8"]) == 0
  out = capsys.readouterr().out
  assert "optimizer state 42.2 GB" in out  # master + ~1 byte a moment
  assert "offlax.master_weights(offlax.adamw(1e-3, state_bits=8))" in out or "mode: device" in out
  assert "host Adam 1.00 G params/s" in out  # the 8-bit host step's measured figure
  with pytest.raises(SystemExit):
    cli([*args, "--state-bits", "4"])
  assert "invalid choice: 4" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli([*args, "--state-bits", "8", "--optimizer", "sgd"])
  assert "--state-bits 8 is for Adam's moments" in capsys.readouterr().err


@pytest.mark.slow
def test_standard_save_and_nvme_store_save_resume_bit_exactly(tmp_path):
  """StandardSave of a host-tier state (MaskedNode scales and all), NVMeStoreSave of a store."""
  params = _params()
  inner = offlax.adamw(1e-3, weight_decay=0.1, state_bits=8)
  want, _, _ = _train(inner, params, 4)

  def steps(tx, params, state, start, stop):
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    for i in range(start, stop):
      updates, state = step(params, state, _grads(params, i))
      params = optax.apply_updates(params, updates)
    return params, state

  tier = offlax.HostTier(chunk_bytes=4096)
  tx = offlax.offload(inner, tier)
  p2, s2 = steps(tx, params, tx.init(params), 0, 2)
  with ocp.CheckpointManager(tmp_path / "std") as m:
    m.save(2, args=ocp.args.StandardSave(s2))
    m.wait_until_finished()
    restored = m.restore(
      2, args=ocp.args.StandardRestore(offlax.abstract_state(inner, params, tier))
    )
  assert_trees_equal(jax.device_get(restored), jax.device_get(s2))
  assert_trees_equal(steps(tx, p2, restored, 2, 4)[0], want)

  options = dict(chunk_bytes=4096, cache_bytes=600, progress=False, fsync=False)
  tier = offlax.NVMeTier(str(tmp_path / "store"), **options)
  tx = offlax.offload(inner, tier)
  p2, s2 = steps(tx, params, tx.init(params), 0, 2)
  with ocp.CheckpointManager(tmp_path / "ckpt") as m:
    m.save(2, args=ocp.args.Composite(opt=offlax.checkpoint.NVMeStoreSave(tier)))
    m.wait_until_finished()
    tier.close()
    got = m.restore(
      2,
      args=ocp.args.Composite(opt=NVMeStoreRestore(str(tmp_path / "back"), progress=False)),
    )
  assert got.opt == 2
  tier = offlax.NVMeTier(str(tmp_path / "back"), resume=True, **options)
  tx = offlax.offload(inner, tier)
  assert_trees_equal(steps(tx, p2, tx.init(params), 2, 4)[0], want)
  tier.close()


@pytest.mark.parametrize(
  "problem, p0, lr, steps, tol",
  [
    ("parabola", [-1.0, 10.0, 1.0], 1e-1, 1000, 1e-5),
    ("rosenbrock", [-1.2, 1.0], 1e-2, 10000, 2e-4),
  ],
)
def test_optax_alias_problems_converge_with_8bit_state(problem, p0, lr, steps, tol):
  """optax's alias-test problems, every leaf quantized (min_size=0: one short block)."""
  target = jnp.array([1.0, -1.0, 2.0] if problem == "parabola" else [1.0, 1.0])
  loss = {
    "parabola": lambda p: jnp.sum((p - target) ** 2),
    "rosenbrock": lambda p: (1 - p[0]) ** 2 + 100 * (p[1] - p[0] ** 2) ** 2,
  }[problem]
  tx = optax.chain(adam8.scale_by_adam_8bit(min_size=0), optax.scale_by_learning_rate(lr))

  def body(carry, _):
    p, s = carry
    updates, s = tx.update(jax.grad(loss)(p), s, p)
    return (optax.apply_updates(p, updates), s), None

  p0 = jnp.array(p0)
  assert tx.init(p0)[0].mu.dtype == jnp.int8
  run = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), None, steps)[0][0])
  np.testing.assert_allclose(run(p0), target, atol=tol)


@pytest.mark.slow
def test_retier_moves_8bit_state_between_tiers_exactly(tmp_path):
  params = _params()
  inner = offlax.adamw(1e-3, weight_decay=0.1, state_bits=8)
  want, _, _ = _train(inner, params, 3)
  _, plain, _ = _train(inner, params, 1)
  on_host = offlax.checkpoint.retier(inner, params, plain, offlax.HostTier(chunk_bytes=4096))
  assert_trees_equal(jax.device_get(on_host.inner_state), jax.device_get(plain))
  tx = offlax.offload(inner, offlax.HostTier(chunk_bytes=4096))
  p1 = optax.apply_updates(params, _train(inner, params, 1)[2])
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  state = on_host
  for i in (1, 2):
    updates, state = step(p1, state, _grads(p1, i))
    p1 = optax.apply_updates(p1, updates)
  assert_trees_equal(p1, want)
  with pytest.raises(TreeMismatchError, match="holds an 8-bit Adam state.*state_bits=8"):
    offlax.checkpoint.retier(offlax.adamw(1e-3), params, plain, offlax.HostTier())


@pytest.mark.parametrize(
  "stride",
  [pytest.param(997, id="every_997th"), pytest.param(1, id="every", marks=pytest.mark.slow)],
)
def test_native_fast_codes_equal_the_bucket_table_on_every_float(stride):
  """adam8.cc's arithmetic codes (Segments) equal the bucket table's (the JAX path's) on every
  float in [-1, 1] for both maps (every 997th bit pattern in the default run, all in the slow one).
  """
  import ctypes

  from offlax._src import ffi, host_adam8

  library = ffi.library()
  if library is None:
    pytest.skip("no native library")
  check = library.OfflaxAdam8CheckCodes
  check.restype = ctypes.c_int64
  _, above, keys = host_adam8._tables()
  slow = ctypes.c_int64()
  for signed, half in ((True, 0), (False, 1)):
    a = np.ascontiguousarray(above[256 * half : 256 * (half + 1)])
    k = np.ascontiguousarray(keys[2**17 * half : 2**17 * (half + 1)])
    wrong = check(
      a.ctypes.data_as(ctypes.c_void_p), k.ctypes.data_as(ctypes.c_void_p), ctypes.c_int32(signed),
      ctypes.c_int64(stride), ctypes.byref(slow),
    )  # fmt: skip
    if wrong == -1:
      pytest.skip("no AVX-512: the kernel uses the bucket table only")
    assert wrong == 0
    assert slow.value < 1e-3 * 2**30 / stride  # the table is the exception


def test_native_codes_at_every_midpoint_and_entry(monkeypatch):
  """The kernel's in-register code search (adam8.cc) gives the JAX path's codes at every midpoint
  and entry of the signed map and one float either side of each.

  With b1 = b2 = 0 the new first moment is the gradient itself, and each block of 256 holds a
  1.0, so its scale is 1 and the values quantized are exactly the gradient's.
  """
  from offlax._src import ffi

  signed = [quantized.midpoints(True), quantized.code_map(True)]
  points = np.concatenate(signed).astype(np.float32)
  points = np.concatenate(
    [points, np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(-np.inf))]
  )
  points = points[np.abs(points) <= 1]
  rows = max(-(-points.size // 255), quantized.MIN_SIZE // 256)  # a leaf big enough to quantize
  values = np.zeros((rows, 256), np.float32)
  values[:, 0] = 1.0
  values[:, 1:].flat[: points.size] = points
  params = {"w": jnp.zeros(values.size, jnp.float32)}
  grads = {"w": jnp.asarray(values.reshape(-1))}
  tx = offlax.adam(1.0, b1=0.0, b2=0.0, state_bits=8)

  def step():
    run = jax.jit(lambda p, s, g: offlax.update_and_apply(tx, g, s, p))
    state = tx.init(params)
    return run(params, state, grads), run.lower(params, state, grads).as_text()

  got, text = step()
  assert text.count("offlax_adam8_step") == (1 if ffi.available() else 0)
  monkeypatch.setattr(ffi, "on_cpu", lambda native, default, *args: default(*args))
  want, text = step()
  assert "offlax_adam8_step" not in text
  assert_trees_equal(got, want)
  assert any(x.dtype == jnp.int8 for x in jax.tree.leaves(got[1]))  # the moment is quantized
