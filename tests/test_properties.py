"""Property tests: `offload(inner, tier)` equals plain optax, bit for bit, on random input.

Hypothesis draws a pytree (nesting of dicts, lists and tuples; float32,
bfloat16, float16 and int32 leaves; scalars, 0-size and small arrays), an optax
pipeline (clipping, weight decay, schedules, masks, injected hyperparameters,
one of several optimizers) and chunk sizes, then runs two jitted steps of
plain optax and of the offloaded pipeline in each tier and compute mode: the
params after both steps, the last updates and the state must be the same bits. The tree size
is bounded by the profile (`conftest.py`): 8 leaves by default, up to
200 in the long profile.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
  assert_trees_equal,
  float_labels,
  long_profile,
  run_steps,
  scale_by_highest_dtype,
)
from hypothesis import assume, event, given
from hypothesis import strategies as st

import offlax

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "i32": jnp.int32}


@st.composite
def pytrees(draw):
  """A tree of 1 to 8 leaves (200 in the long profile), nested up to 4 deep.

  Hypothesis draws the leaf count and a seed, numpy the rest: drawing 200
  leaves' shapes, dtypes, keys and nesting from hypothesis overruns its buffer,
  and it drops such examples (the long run then only saw small trees).
  Shrinking still reduces the count and the seed.
  """
  n = draw(st.integers(1, 200 if long_profile() else 8))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  return _nest(rng, [_leaf(rng) for _ in range(n)], 0)


# Dimension bounds [low, high) by rank: scalars, and 0-size arrays in every rank.
SHAPES = [[], [(0, 25)], [(0, 7), (1, 10)], [(1, 4), (0, 5), (1, 6)]]


def _leaf(rng):
  bounds = SHAPES[rng.choice(4, p=[0.25, 0.3, 0.3, 0.15])]
  shape = tuple(int(rng.integers(low, high)) for low, high in bounds)
  dtype = list(DTYPES.values())[rng.integers(len(DTYPES))]
  if dtype == jnp.int32:
    return jnp.asarray(rng.integers(-5, 5, shape), dtype)
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _nest(rng, xs, depth):
  if len(xs) == 1 and (depth >= 4 or rng.random() < 0.5):
    return xs[0]  # the whole tree may be a bare leaf
  # Cut the leaves into groups, one child each; at the bottom, one leaf each.
  if depth >= 4:
    cuts = list(range(1, len(xs)))
  else:
    k = rng.integers(1, min(4, len(xs)) + 1)
    cuts = sorted(rng.choice(np.arange(1, len(xs)), k - 1, replace=False).tolist())
  children = [
    _nest(rng, xs[a:b], depth + 1) for a, b in zip([0, *cuts], [*cuts, len(xs)], strict=True)
  ]
  kind = rng.integers(3)
  if kind:
    return children if kind == 1 else tuple(children)
  # Keys sort in another order than the leaves were drawn, as real names do.
  tree = {f"{'xbac'[rng.integers(4)]}{i}": child for i, child in enumerate(children)}
  if rng.random() < 0.3:
    tree["no_params"] = {}  # a module without params
  return tree


def learning_rates():
  return st.sampled_from(
    [
      ("1e-3", lambda: 1e-3),
      ("warmup_cosine", lambda: optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
      ("exponential", lambda: optax.exponential_decay(1e-2, 1, 0.5)),
      ("piecewise", lambda: optax.piecewise_constant_schedule(1e-2, {1: 0.1})),
    ]
  )


# name -> (offloaded inner, plain reference): offlax.adam must be optax.adam, bit for bit.
OPTIMIZERS = {
  "adam": lambda lr: (optax.adam(lr), optax.adam(lr)),
  "nadam": lambda lr: (optax.adam(lr, nesterov=True), optax.adam(lr, nesterov=True)),
  "adamw": lambda lr: (optax.adamw(lr, weight_decay=0.1), optax.adamw(lr, weight_decay=0.1)),
  "offlax.adam": lambda lr: (offlax.adam(lr), optax.adam(lr)),
  "offlax.adamw": lambda lr: (offlax.adamw(lr), optax.adamw(lr)),
  "sgd": lambda lr: (optax.sgd(lr), optax.sgd(lr)),
  "sgd_nesterov": lambda lr: (
    optax.sgd(lr, momentum=0.9, nesterov=True),
    optax.sgd(lr, momentum=0.9, nesterov=True),
  ),
  "lion": lambda lr: (optax.lion(lr), optax.lion(lr)),
  "rmsprop": lambda lr: (optax.rmsprop(lr, momentum=0.5), optax.rmsprop(lr, momentum=0.5)),
  "adagrad": lambda lr: (optax.adagrad(lr), optax.adagrad(lr)),
  "adafactor": lambda lr: (optax.adafactor(lr), optax.adafactor(lr)),
  "lamb": lambda lr: (optax.lamb(lr), optax.lamb(lr)),
  "adabelief": lambda lr: (optax.adabelief(lr), optax.adabelief(lr)),
}


@st.composite
def pipelines(draw, params):
  """(description, offloaded inner, plain reference) for `params`."""
  lr_name, lr = draw(learning_rates())
  name = draw(st.sampled_from(sorted(OPTIMIZERS)))
  inject = draw(st.booleans()) and name in ("adam", "sgd", "lion")
  if inject:  # hyperparameters in the state: scalar state leaves the tier keeps on device
    make = {"adam": optax.adam, "sgd": optax.sgd, "lion": optax.lion}[name]
    pair = [optax.inject_hyperparams(make)(learning_rate=lr()) for _ in range(2)]
  else:
    pair = list(OPTIMIZERS[name](lr()))
  floats = jax.tree.map(lambda x: bool(jnp.issubdtype(x.dtype, jnp.floating)), params)
  mask = jax.tree.map(lambda f: f and draw(st.booleans()), floats)
  before = draw(
    st.lists(
      st.sampled_from(["clip_global", "clip_value", "decay_masked", "masked_scale"]), max_size=2
    )  # fmt: skip
  )
  finite = draw(st.booleans())
  parts = [name + ("(injected)" if inject else ""), f"lr={lr_name}", *before]

  def build(opt):
    chain = []
    for b in before:
      chain.append(
        {
          "clip_global": lambda: optax.clip_by_global_norm(0.5),
          "clip_value": lambda: optax.clip(0.3),
          "decay_masked": lambda: optax.add_decayed_weights(0.05, mask=mask),
          "masked_scale": lambda: optax.masked(optax.scale(0.5), mask),
        }[b]()
      )
    tx = optax.chain(*chain, opt)
    if finite:  # a global counter coupled to every leaf: the whole state is one slice
      tx = optax.apply_if_finite(tx, 2)
    # Int leaves (step counters, token ids in real models) get no update.
    return optax.multi_transform({"float": tx, "int": optax.set_to_zero()}, float_labels)

  if finite:
    parts.append("apply_if_finite")
  return " + ".join(parts), build(pair[0]), build(pair[1])


CHUNKS = st.one_of(st.sampled_from([2**40, 64, 1024]), st.integers(16, 3000))


@pytest.mark.slow  # each tier runs bit-exact by default elsewhere
@given(data=st.data())
def test_offload_equals_optax_in_every_tier(data):
  params = data.draw(pytrees(), "params")
  what, inner, reference = data.draw(pipelines(params), "pipeline")
  try:
    want = run_steps(reference, params, steps=2)
  except Exception as e:  # optax itself refuses some pipelines for some trees
    event(f"optax refused: {type(e).__name__}")
    assume(False)
  chunk = data.draw(CHUNKS, "chunk_bytes")
  n = len(jax.tree.leaves(params))
  event(f"leaves: {'1' if n == 1 else '2-9' if n < 10 else '10-49' if n < 50 else '50-200'}")
  event(f"optimizer: {what.split(' + ')[0]}")
  for x in jax.tree.leaves(params):
    event(f"leaf: {x.dtype}" + (", scalar" if x.ndim == 0 else ", 0-size" if x.size == 0 else ""))
  tiers = {
    "host/device": offlax.HostTier(chunk_bytes=chunk),
    "host/host": offlax.HostTier(compute="host"),
  }
  for mode, tier in tiers.items():
    got = run_steps(offlax.offload(inner, tier), params, steps=2)
    _same(got, want, got[1].inner_state, f"{mode}, {what}, chunk {chunk}")

  # Some pipelines change a state leaf's dtype in the update (inject_hyperparams
  # promotes bf16 moments to f32); a store keeps its dtypes and must refuse them.
  dtypes = lambda state: jax.tree.map(lambda x: x.dtype, state)  # noqa: E731
  changes_dtype = dtypes(want[1]) != dtypes(jax.eval_shape(reference.init, params))
  event(f"nvme: {'refuses a dtype change' if changes_dtype else 'compared'}")
  cache = data.draw(st.sampled_from([0, 64, 2**20]), "cache_bytes")
  with tempfile.TemporaryDirectory() as path:
    tier = offlax.NVMeTier(path, chunk_bytes=chunk, cache_bytes=cache, progress=False, fsync=False)
    try:
      if changes_dtype:
        with pytest.raises(
          offlax.errors.StoreMismatchError, match="cannot change a state array's dtype"
        ):
          run_steps(offlax.offload(inner, tier), params, steps=2)
        return
      got = run_steps(offlax.offload(inner, tier), params, steps=2)
      stored = tier.read_state(got[1])
    finally:
      tier.close()  # also when a comparison fails: no I/O may outlive the directory
  _same(got, want, stored, f"nvme, {what}, chunk {chunk}, cache {cache}")


def _same(got, want, got_state, where):
  """Params after both steps, the last updates and the inner state: the same bits."""
  for name, a, b in [("params", got[0], want[0]), ("updates", got[2], want[2]),
                     ("state", got_state, want[1])]:  # fmt: skip
    try:
      assert_trees_equal(a, b)
    except AssertionError as e:
      raise AssertionError(f"{where}: {name}: {e}") from None


@pytest.mark.parametrize("compute", ["device", "host"])
@pytest.mark.parametrize("low", [("float16", "bfloat16"), ("bfloat16",)], ids=["f16_bf16", "bf16"])
@pytest.mark.parametrize("name", ["inject_hyperparams", "highest_dtype"])
def test_updates_that_read_the_tree_dtypes(name, low, compute):
  """Found by the long run. inject_hyperparams asks for the highest float dtype
  of the params it is given: a slice holding float16 and bfloat16 leaves but no
  float32 one has none, and optax raised. An update that casts a constant to
  that dtype would run in bfloat16 on a slice of bfloat16 leaves, in float32 on
  the whole tree: silently different. The coupling analysis follows values, not
  dtypes; the leaves of each subset of the dtypes are now traced alone too, and
  a failure or a difference keeps one slice.
  """
  n = 64 if name == "inject_hyperparams" else 256  # sizes at which each failed (600 B slices)
  params = {"a": jnp.linspace(0, 1, n)}
  params |= {f"b{i}": jnp.linspace(0, 1, n).astype(d) for i, d in enumerate(low)}
  inner = {
    "inject_hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "highest_dtype": optax.chain(scale_by_highest_dtype(0.3), optax.sgd(0.1, momentum=0.9)),
  }[name]
  tier = offlax.HostTier(chunk_bytes=600, compute=compute)
  got = run_steps(offlax.offload(inner, tier), params, steps=2)
  want = run_steps(inner, params, steps=2)
  assert_trees_equal(got[0], want[0])
  assert_trees_equal(got[1].inner_state, want[1])
  assert_trees_equal(got[2], want[2])
