"""Crash safety of `offlax.load_safetensors` into a `LayerStore`: SIGKILL mid-load.

The store holds checkpoint A (loaded, committed). A child process opens it and
loads checkpoint B, and kills itself at a set point of the load: after the
first layer is written, after the last one (before the manifest), while the
manifest is written (before its rename), or right after the rename. The store
must then open at its step with A's layers (or, killed after the rename, B's),
whole, every slot's crc32c valid (`offlax.checkpoint.inspect_store(verify=True)`). The
kill points are hooks the child sets on offlax's own functions, so each kill
lands where it is named, every run.
"""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

import offlax

safetensors_numpy = pytest.importorskip(
  "safetensors.numpy", reason="needs safetensors: writes the test checkpoints"
)

D, L = 16, 4
MAPPING = {
  r"layers\.([0-9]+)\.weight": (r"layers.\1.lin.kernel", ((1, 0), None)),
  r"layers\.([0-9]+)\.bias": (r"layers.\1.lin.bias", None),
  r"head\.weight": ("head.kernel", ((1, 0), None)),
  r"head\.bias": ("head.bias", None),
}
MODEL = textwrap.dedent(
  """
  import jax.numpy as jnp, optax, offlax
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear({d}, {d}, rngs=rngs)

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([Block(rngs) for _ in range({n})])
      self.head = nnx.Linear({d}, 2, rngs=rngs)

  def stored(path, create):
    model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
    tx = offlax.master_weights(optax.adam(1e-3))
    layers = offlax.stack_layers(model.layers)
    if create:
      store = offlax.LayerStore.create(path, layers, optimizer=tx, progress=False)
    else:
      store = offlax.LayerStore.open(path, layers, optimizer=tx, progress=False)
    return offlax.offload_params(model, store=store), store
  """
).format(d=D, n=L)
namespace: dict = {}
exec(MODEL, namespace)  # the parent's model is the child's

# Each hook kills the child at its point of the load (functions the load calls by module).
HOOKS = {
  "first_layer": (  # its params written, then its fresh optimizer state
    "Rewrite",
    "init_state",
    "original(*a, **k); os.kill(os.getpid(), signal.SIGKILL)",
  ),
  "before_manifest": ("layer_files", "write_manifest", "os.kill(os.getpid(), signal.SIGKILL)"),
  "before_rename": ("os", "replace", "os.kill(os.getpid(), signal.SIGKILL)"),
  "after_rename": ("os", "replace", "original(*a, **k); os.kill(os.getpid(), signal.SIGKILL)"),
}
CHILD = textwrap.dedent(
  """
  import os, signal, sys
  import offlax
  from offlax._src.layer_store import files as layer_files  # the store's, as its commit calls it
  from offlax._src.layer_store.rewrite import Rewrite
  {model}
  model, store = stored(sys.argv[1], create=False)
  module, name, then = {hook!r}
  module = {{"Rewrite": Rewrite, "layer_files": layer_files, "os": os}}[module]
  original = getattr(module, name)
  def hook(*a, **k):
    exec(then)
  setattr(module, name, hook)
  offlax.load_safetensors(model, sys.argv[2], mapping={mapping!r}, store=store,
                          check_config=False, progress=False)
  print("loaded, not killed", flush=True)
  """
)


def checkpoint(folder, seed):
  rng = np.random.default_rng(seed)
  tensors = {"head.weight": rng.standard_normal((2, D), np.float32),
             "head.bias": rng.standard_normal(2, np.float32)}  # fmt: skip
  for i in range(L):
    tensors[f"layers.{i}.weight"] = rng.standard_normal((D, D), np.float32)
    tensors[f"layers.{i}.bias"] = rng.standard_normal(D, np.float32)
  os.makedirs(folder)
  safetensors_numpy.save_file(tensors, os.path.join(folder, "model.safetensors"))
  return str(folder), tensors


def assert_store_holds(store, tensors):
  params = store.read_params()
  for i in range(L):
    np.testing.assert_array_equal(params["lin"]["kernel"][i], tensors[f"layers.{i}.weight"].T)
    np.testing.assert_array_equal(params["lin"]["bias"][i], tensors[f"layers.{i}.bias"])
  master = jax.tree.leaves(store.read_state())  # the fp32 master of the same layers, zero moments
  assert any(np.array_equal(x, params["lin"]["kernel"]) for x in master)


@pytest.mark.parametrize(
  "point",
  ["first_layer", pytest.param("before_manifest", marks=pytest.mark.slow),
   pytest.param("before_rename", marks=pytest.mark.slow),
   pytest.param("after_rename", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_load_killed_at_any_point_leaves_the_store_whole(tmp_path, point):
  path = str(tmp_path / "store")
  a, tensors_a = checkpoint(tmp_path / "a", 0)
  b, tensors_b = checkpoint(tmp_path / "b", 1)
  model, store = namespace["stored"](path, create=True)
  with store:
    offlax.load_safetensors(model, a, mapping=MAPPING, store=store, check_config=False,
                            progress=False)  # fmt: skip
  child = CHILD.format(model=MODEL, hook=HOOKS[point], mapping=MAPPING)
  run = subprocess.run([sys.executable, "-c", child, path, b], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip
  assert run.returncode == -9, run.stdout + run.stderr  # killed where the hook is
  [report] = offlax.checkpoint.inspect_store(path, verify=True, progress=False)
  assert report.ok, report  # every slot of every kept step matches its crc32c
  model, store = namespace["stored"](path, create=False)
  with store:
    assert store.step == 0
    assert_store_holds(store, tensors_b if point == "after_rename" else tensors_a)
    # The store loads again after the crash.
    offlax.load_safetensors(model, b, mapping=MAPPING, store=store, check_config=False,
                            progress=False)  # fmt: skip
    assert_store_holds(store, tensors_b)
  [report] = offlax.checkpoint.inspect_store(path, verify=True, progress=False)
  assert report.ok, report


def test_a_load_drops_the_layers_read_ahead(tmp_path):
  a, tensors_a = checkpoint(tmp_path / "a", 0)
  b, tensors_b = checkpoint(tmp_path / "b", 1)
  model, store = namespace["stored"](str(tmp_path / "store"), create=True)
  with store:
    offlax.load_safetensors(model, a, mapping=MAPPING, store=store, check_config=False,
                            progress=False)  # fmt: skip
    store.fetch(0)  # as the scan's forward pass does: layer 1 is read ahead, of A
    offlax.load_safetensors(model, b, mapping=MAPPING, store=store, check_config=False,
                            progress=False)  # fmt: skip
    leaves = {r["path"]: x for r, x in zip(store.records, store.fetch(1), strict=True)}
    [kernel] = [x for path, x in leaves.items() if "kernel" in path]
    np.testing.assert_array_equal(kernel, tensors_b["layers.1.weight"].T)  # not A's layer 1


def test_a_load_refuses_a_store_open_without_its_optimizer(tmp_path):
  a, _ = checkpoint(tmp_path / "a", 0)
  path = str(tmp_path / "store")
  _, store = namespace["stored"](path, create=True)
  store.close()
  model = nnx.eval_shape(lambda: namespace["Net"](nnx.Rngs(0)))
  layers = offlax.stack_layers(model.layers)
  with offlax.LayerStore.open(path, layers, progress=False) as store:
    offlax.offload_params(model, store=store)
    with pytest.raises(offlax.errors.InvalidOptionError, match="optimizer="):
      offlax.load_safetensors(model, a, mapping=MAPPING, store=store, check_config=False,
                              progress=False)  # fmt: skip
    assert store.read_params()["lin"]["kernel"].any() == 0  # nothing written: still zeros
