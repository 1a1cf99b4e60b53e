"""offlax's patches of other libraries: listed, narrow, off with OFFLAX_NO_PATCHES=1, and canaries.

Each process-wide patch has a canary here or in test_donation.py: it runs the
upstream failure with ``OFFLAX_NO_PATCHES=1`` and asserts that it still fails.
A red canary means upstream fixed it: drop the patch and its docs/patches.md entry.
"""

import inspect
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from offlax._src import patches

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Tunix's use of an offloaded nnx.Optimizer's state on a 2-device mesh: the
# restore target from `nnx.get_named_sharding` and `_shard_optimizer`'s eager
# constraint by partition specs (`with mesh:`, as Tunix's command line enters it);
# and the same two calls on trees that are not offlax's, which must be JAX's and Flax's.
_NNX_SCRIPT = """
import json, os, warnings
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
warnings.simplefilter("ignore", DeprecationWarning)
import jax, optax
from flax import nnx
from flax.nnx import spmd
from jax.sharding import NamedSharding, PartitionSpec as P
import offlax

mesh = jax.make_mesh((2,), ("d",))
model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
on_mesh = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
nnx.update(model, jax.tree.map(on_mesh, nnx.state(model)))
optimizer = nnx.Optimizer(model, offlax.offload(optax.adam(1e-3)), wrt=nnx.Param)
state = nnx.state(optimizer, nnx.optimizer.OptState)
def moments(tree, kind=lambda x: x.memory_kind):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  keys = [jax.tree_util.keystr(k) for k, _ in flat]
  assert sum("['mu']" in k or "['nu']" in k for k in keys) == 4, keys
  return sorted({kind(x) for k, (_, x) in zip(keys, flat) if "['mu']" in k or "['nu']" in k})
named = nnx.get_named_sharding(state, mesh)
with mesh:
  moved = jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state))
  host = jax.device_put(jax.numpy.ones(4), NamedSharding(mesh, P(), memory_kind="pinned_host"))
  plain = jax.lax.with_sharding_constraint(host, P())
params = nnx.state(model)
flax_own = getattr(spmd.get_named_sharding, "__wrapped__", spmd.get_named_sharding)
print("RESULT", json.dumps({
  "named": moments(named),
  "moved": moments(moved, lambda x: x.sharding.memory_kind),
  "plain": plain.sharding.memory_kind,
  "params_named_same": jax.tree.leaves(nnx.get_named_sharding(params, mesh))
    == jax.tree.leaves(flax_own(params, mesh)),
  "patched": [getattr(f, "__offlax_patch__", None)
              for f in (nnx.get_named_sharding, jax.lax.with_sharding_constraint)],
}))
"""


def _nnx_run(**env_vars: str) -> dict:
  pytest.importorskip("flax")
  env = {**os.environ, "PYTHONPATH": str(ROOT), **env_vars}
  out = subprocess.run(
    [sys.executable, "-c", _NNX_SCRIPT], capture_output=True, text=True, timeout=600, env=env
  )
  lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  assert out.returncode == 0 and lines, out.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT ") :])


def test_nnx_state_stays_in_host_memory_and_other_trees_are_untouched():
  r = _nnx_run()
  assert r["patched"] == ["nnx-named-sharding-memory-kind", "eager-sharding-constraint-memory-kind"]
  assert r["named"] == ["pinned_host"], "get_named_sharding put offlax's moments in device memory"
  assert r["moved"] == ["pinned_host"], "the eager constraint moved offlax's moments to the device"
  # Not offlax's: JAX's and Flax's answers, as they are.
  assert r["plain"] == "device"
  assert r["params_named_same"]


@pytest.mark.slow  # a canary; their scope is checked by default
def test_flax_and_jax_still_need_the_sharding_patches():
  """Canary: with OFFLAX_NO_PATCHES=1 Tunix's two calls put the moments in device memory.

  Red: upstream keeps the memory kind itself; drop the patch whose assertion failed
  (`flax_glue.NAMED_SHARDING` or `flax_glue.SHARDING_CONSTRAINT`) and its docs entry.
  """
  r = _nnx_run(OFFLAX_NO_PATCHES="1")
  assert r["patched"] == [None, None]
  assert r["named"] == ["device"], "nnx.get_named_sharding keeps memory kinds now: drop the patch"
  assert r["moved"] == ["device"], "eager with_sharding_constraint keeps memory kinds: drop it"


def test_orbax_still_needs_the_handler_patch():
  """Canary: StandardCheckpointHandler still has no `use_compression` (else: pass it instead)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  assert "use_compression" not in inspect.signature(ocp.StandardCheckpointHandler).parameters
  assert isinstance(ocp.StandardCheckpointHandler()._impl, ocp.PyTreeCheckpointHandler)


def test_every_patch_is_on_the_docs_page():
  page = (ROOT / "docs" / "patches.md").read_text()
  declared = patches.declared()
  assert {p.name for p in declared} >= {
    "donation-memory-kinds",
    "nnx-named-sharding-memory-kind",
    "eager-sharding-constraint-memory-kind",
    "orbax-handler-compression",
  }
  for p in declared:
    assert f"### `{p.name}`" in page, f"docs/patches.md does not list {p.name}"
    assert f"**Written against:** {p.versions}." in page, f"{p.name}: versions not on the page"
    assert f"`{p.target}`" in page, f"docs/patches.md does not name {p.name}'s target"


def _patch(name: str, scope: str = "process") -> patches.Patch:
  return patches.register(
    patches.Patch(name=name, target="t.f", scope=scope, upstream="u", versions="v", failure="f")  # type: ignore[arg-type]
  )


def test_replace_is_idempotent_reversible_and_replaces_only_the_same_function(monkeypatch):
  monkeypatch.delenv(patches.ENV, raising=False)
  f = lambda x: x
  other = lambda x: -x
  a, b, c = (types.SimpleNamespace(f=f), types.SimpleNamespace(f=f), types.SimpleNamespace(f=other))
  patch = _patch("test-replace")
  wrap = lambda original: lambda x: original(x) + 1
  assert patches.replace(patch, a, "f", wrap, also=[(b, "f"), (c, "f")])
  assert patches.replace(patch, a, "f", wrap)  # again: the same wrapper, not a second one
  assert (a.f(1), b.f(1), c.f(1)) == (2, 2, -1)  # c held another function: left alone
  assert patches.installed(patch)
  patches.uninstall(patch)
  assert (a.f, b.f, c.f) == (f, f, other) and not patches.installed(patch)
  assert not patches.replace(patch, a, "f", lambda original: None)  # wrap declined
  assert a.f is f


def test_no_patches_env_leaves_everything_as_it_is(monkeypatch):
  monkeypatch.setenv(patches.ENV, "1")
  target = types.SimpleNamespace(f=len)
  assert not patches.replace(_patch("test-env"), target, "f", lambda original: abs)
  assert target.f is len


def test_set_on_refuses_an_attribute_the_object_lacks():
  patch = _patch("test-object", scope="object")
  obj = types.SimpleNamespace(impl=1)
  patches.set_on(patch, obj, "impl", 2)
  assert obj.impl == 2
  with pytest.raises(AttributeError, match="test-object: SimpleNamespace has no attribute 'impl_'"):
    patches.set_on(patch, obj, "impl_", 3)
  with pytest.raises(ValueError, match="registered process patch"):
    patches.replace(patch, obj, "impl", lambda original: original)


def test_the_constraint_patch_hands_calls_inside_jit_to_jax():
  """Inside jit (on offlax's host arrays closed over: concrete) JAX's rules apply unchanged."""
  nnx = pytest.importorskip("flax.nnx")
  import jax
  import optax

  import offlax

  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, offlax.offload(optax.adam(1e-3)), wrt=nnx.Param)
  state = nnx.state(optimizer.opt_state)
  specs = nnx.get_partition_spec(state)
  with jax.set_mesh(jax.make_mesh((1,), ("d",))):
    constrain = lambda wsc: jax.jit(lambda: wsc(state, specs))()
    got = constrain(jax.lax.with_sharding_constraint)
    want = constrain(jax.lax.with_sharding_constraint.__wrapped__)
  kinds = lambda tree: [x.sharding.memory_kind for x in jax.tree.leaves(tree)]
  assert kinds(got) == kinds(want)


# What offlax changes or reads that is not a replaced function (docs/patches.md, "On the
# user's objects" and "Registrations and private names"): a canary each, red when upstream
# changed what offlax relies on.


def test_optax_multisteps_still_has_the_fields_offlax_reads():
  """Canary: `multi_steps.py` reads five private fields of `optax.MultiSteps`."""
  import optax

  tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  fields = ("_accumulator_dtype", "_acc_update", "_every_k_schedule", "_should_skip_update_fn")
  for field in (*fields, "_use_grad_mean"):
    assert hasattr(tx, field), (
      f"optax.MultiSteps has no {field} now: see offlax/_src/multi_steps.py"
    )
  assert tx._every_k_schedule(0) == 2
  assert tx._use_grad_mean is True  # (a store's accumulation takes the mean alike)


def test_optax_numerics_still_has_safe_increment():
  """Canary: `host_adam.py` counts steps as optax's adam does, with `optax._src.numerics`."""
  import jax.numpy as jnp
  import optax
  from optax._src import numerics

  count = jnp.asarray(jnp.iinfo(jnp.int32).max, jnp.int32)
  assert int(numerics.safe_increment(count)) == int(count)  # saturates, as adam's count does
  state = optax.scale_by_adam().init({"w": jnp.ones(2)})
  _, state = optax.scale_by_adam().update({"w": jnp.ones(2)}, state)
  assert int(state.count) == int(numerics.safe_increment(jnp.zeros((), jnp.int32)))


def test_orbax_still_looks_up_the_on_disk_handler_by_type():
  """Canary: `checkpoint.py` registers a refusal for `OnDisk` in orbax's global type registry.

  Importing offlax's checkpoint module registers it (orbax has no per-save registry for a
  `StandardSave`); `tests/test_usage.py` checks that a save of NVMe-tier state is refused.
  """
  ocp = pytest.importorskip("orbax.checkpoint")
  from offlax._src import checkpoint, layout

  handler = ocp.type_handlers.get_type_handler(layout.OnDisk)
  assert handler is checkpoint._refusal
  with pytest.raises(Exception, match="NVMeStoreSave"):
    handler.typestr()
