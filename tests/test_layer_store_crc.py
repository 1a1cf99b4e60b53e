"""A `LayerStore` checks every slot it reads against its crc32c (issue 41.1), writes its files
owner-only (41.7c) and shows a progress bar only for long work (41.7b).

A flipped byte in a params or state slot of the committed step: the forward read inside a
jitted step, `read_params`, `read_state`, `onload_params` and `update` refuse it with
`StoreCorruptedError` naming the file, the leaf, the layer and the step; `update` commits
nothing (the manifest and the kept steps' files stay byte for byte), and an older kept step
opens (`LayerStore.open(step=)`, `python -m offlax rollback`).
"""

import os
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offlax
from offlax.__main__ import main as cli
from offlax._src.layer_store import step as layer_step

L, D = 4, 16
HERE = os.path.dirname(os.path.abspath(__file__))


def make_layers():
  k = jax.random.split(jax.random.key(0), 2)
  return {"b": jax.random.normal(k[1], (L, D)) * 0.1, "w": jax.random.normal(k[0], (L, D, D)) / 4}


def loss(source, x):
  h, _ = offlax.scan_layers(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]), None), x, source)
  return jnp.mean(h**2)


grad = jax.jit(jax.grad(loss))
forward = jax.jit(loss)
LIKE = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_layers())
TX = optax.adam(1e-2)


def x(step=0):
  return jax.random.normal(jax.random.key(100 + step), (3, D))


def two_steps(path, keep=2):
  """A store at step 2, keeping steps 2 and 1; closed."""
  with offlax.LayerStore.create(path, make_layers(), optimizer=TX, keep=keep, progress=False) as s:
    for step in range(2):
      grad(s.source(), x(step))
      s.update(rest={"e": jnp.arange(3.0) + step})


def flip(path, step, kind, leaf, layer):
  """Flips one bit of `layer` of `leaf` (0: b, 1: w) of `kind` in step `step`; its file."""
  import json

  manifest = json.load(open(os.path.join(path, "layers.json")))
  gen = dict(manifest["kept"])[step]
  records = manifest["leaves"] if kind == "params" else manifest["state"]
  name = os.path.join(path, f"gen{gen}", kind, f"{leaf}.bin")
  data = bytearray(open(name, "rb").read())
  data[layer * records[leaf]["slot"] + 5] ^= 0x10
  open(name, "wb").write(bytes(data))
  return name


def files_of(path, steps=(1, 2)):
  """The bytes of the manifest and of every file of the kept `steps` (rest included)."""
  import json

  manifest = json.load(open(os.path.join(path, "layers.json")))
  gens = {g for s, g in manifest["kept"] if s in steps}
  out = {"layers.json": open(os.path.join(path, "layers.json"), "rb").read()}
  for g in gens:
    for base, _, names in os.walk(os.path.join(path, f"gen{g}")):
      for n in names:
        out[os.path.relpath(os.path.join(base, n), path)] = open(os.path.join(base, n), "rb").read()
  return out


def assert_names(message, name, leaf, layer, step):
  for part in (name, f"layer {layer} of", f"leaf {leaf}", f"in step {step}", "does not match"):
    assert part in message, (part, message)


def test_a_flipped_params_slot_is_refused_by_every_read(tmp_path):
  path = str(tmp_path / "s")
  two_steps(path)
  name = flip(path, 2, "params", 1, 2)  # ['w'] of layer 2
  before = files_of(path)
  with offlax.LayerStore.open(path, LIKE, optimizer=TX, progress=False) as store:
    assert store.step == 2  # opening checks sizes: the damage shows on the read
    np.testing.assert_array_equal(store.read_layer(1)[1], store.read_layer(1)[1])  # others read
    with pytest.raises(offlax.errors.StoreCorruptedError) as e:
      store.read_params()
    assert_names(str(e.value), name, "['w']", 2, 2)
    assert f"LayerStore.open({path!r}, like, optimizer=..., step=1)" in str(e.value)
    assert f"python -m offlax rollback {path} --to 1" in str(e.value)
    with pytest.raises(offlax.errors.StoreCorruptedError, match="layer 2 of params leaf"):
      store.read_layer(2)
    # Inside a jitted step the read is a host callback: JAX raises its runtime error,
    # carrying the offlax error's type and message.
    for step_fn in (forward, grad):
      with pytest.raises(Exception, match="StoreCorruptedError") as e:
        jax.block_until_ready(step_fn(store.source(), x(2)))
      assert_names(str(e.value), name, "['w']", 2, 2)
    with pytest.raises(offlax.errors.StoreCorruptedError) as e:
      store.update(rest={"e": jnp.zeros(3)})
    assert_names(str(e.value), name, "['w']", 2, 2)
    assert store.step == 2 and [s for s, _ in store.kept] == [2, 1]
  assert files_of(path) == before  # nothing committed, nothing written over the kept steps
  with offlax.LayerStore.open(path, LIKE, optimizer=TX, step=1, progress=False) as store:
    assert store.step == 1 and store.read_params()["w"].shape == (L, D, D)
    grad(store.source(), x(1))
    assert store.update() == 2  # training on from the older step


def test_a_flipped_state_slot_is_refused_and_nothing_commits(tmp_path):
  path = str(tmp_path / "s")
  two_steps(path, keep=1)
  name = flip(path, 2, "state", 2, 0)  # the state's third leaf, of layer 0
  before = files_of(path, steps=(2,))
  with offlax.LayerStore.open(path, LIKE, optimizer=TX, progress=False) as store:
    leaf = store.state_records[2]["path"]
    store.read_params()  # the params are whole
    with pytest.raises(offlax.errors.StoreCorruptedError) as e:
      store.read_state()
    assert_names(str(e.value), name, leaf, 0, 2)
    assert "keeps no step before step 2" in str(e.value)  # keep=1: nothing to go back to
    grad(store.source(), x(2))
    with pytest.raises(offlax.errors.StoreCorruptedError) as e:
      store.update()
    assert_names(str(e.value), name, leaf, 0, 2)
    assert store.step == 2
  assert files_of(path, steps=(2,)) == before


@pytest.mark.filterwarnings("ignore:.*overwrote layer")  # the backward pass again, on purpose
def test_a_gradient_changed_on_disk_is_refused_by_update(tmp_path):
  path = str(tmp_path / "s")
  with offlax.LayerStore.create(path, make_layers(), optimizer=TX, progress=False) as store:
    grad(store.source(), x())
    store.flush_grads()
    name = tmp_path / "s" / "grads" / "1.bin"
    data = bytearray(name.read_bytes())
    data[3 * store.records[1]["slot"]] ^= 1
    name.write_bytes(bytes(data))
    before = files_of(path, steps=(0,))
    with pytest.raises(offlax.errors.StoreCorruptedError, match="layer 3 of the gradient of leaf"):
      store.update()
    assert store.step == 0 and files_of(path, steps=(0,)) == before
    grad(store.source(), x())  # the backward pass writes them again
    assert store.update() == 1


def test_onload_params_checks_the_layers_it_reads(tmp_path):
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(L)])

    def __call__(self, h):
      for layer in self.layers:
        h = jnp.tanh(layer(h))
      return jnp.mean(h**2)

  model, path = Model(nnx.Rngs(0)), str(tmp_path / "s")
  store = offlax.LayerStore.create(path, offlax.stack_layers(model.layers), progress=False)
  with store:
    offlax.offload_params(model, store=store)
    name = flip(path, 0, "params", 1, 3)  # ['kernel'] of layer 3 (leaves: bias, kernel)
    with pytest.raises(offlax.errors.StoreCorruptedError) as e:
      offlax.onload_params(model)
    assert_names(str(e.value), name, "['kernel']", 3, 0)


def test_inspect_verify_says_what_it_found(tmp_path, capsys):
  path = str(tmp_path / "s")
  two_steps(path)
  assert cli(["inspect", path, "--verify", "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "checksums verified" in out and out.rstrip().endswith("OK")
  flip(path, 1, "params", 0, 1)
  assert cli(["inspect", path, "--verify", "--no-progress"]) == 1
  out = capsys.readouterr().out
  assert "checksums verified" not in out, out
  assert "checksums: 1 mismatch (below)" in out and "PROBLEM: step 1:" in out, out
  os.truncate(os.path.join(path, "grads", "0.bin"), 10)
  assert cli(["inspect", path, "--verify", "--no-progress"]) == 1
  assert "checksums: 1 mismatch, 1 other problem (below)" in capsys.readouterr().out
  tier = offlax.NVMeTier(str(tmp_path / "tier"), progress=False, fsync=False)  # the tier's too
  offlax.offload(optax.adam(1e-3), tier).init({"w": jnp.ones((64, 64))})
  tier.close()
  [chunk] = sorted((tmp_path / "tier").glob("gen0/leaf_*/c/*"))[-1:]
  chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 1]) + chunk.read_bytes()[1:])
  assert cli(["inspect", str(tmp_path / "tier"), "--verify", "--no-progress"]) == 1
  out = capsys.readouterr().out
  assert "checksums: 1 mismatch (below)" in out and "checksums verified" not in out, out


def test_rollback_of_a_layer_store(tmp_path, capsys):
  path = str(tmp_path / "s")
  two_steps(path)
  with offlax.LayerStore.open(path, LIKE, optimizer=TX, progress=False):
    assert cli(["rollback", path, "--to", "1"]) == 1  # open for training: refused
  assert "already open" in capsys.readouterr().err
  assert cli(["rollback", path, "--to", "0"]) == 1
  assert "does not keep step 0; it keeps steps [1, 2]" in capsys.readouterr().err
  flip(path, 2, "params", 1, 0)
  assert cli(["rollback", path, "--to", "1"]) == 0
  assert "step 1 is now current; resume with LayerStore.open" in capsys.readouterr().out
  with offlax.LayerStore.open(path, LIKE, optimizer=TX, progress=False) as store:
    assert store.step == 1 and [s for s, _ in store.kept] == [1]
    store.read_params()
    assert store.read_rest({"e": jnp.zeros(3)})["e"].tolist() == [0.0, 1.0, 2.0]


def test_a_layer_store_and_a_tier_store_are_owner_only(tmp_path):
  """Under the usual umask 022: every folder 0700, every file 0600 (docs/reliability.md)."""
  old = os.umask(0o022)
  try:
    path = str(tmp_path / "new" / "layers")  # its parent made too
    with offlax.LayerStore.create(path, make_layers(), optimizer=TX, keep=2, progress=False) as s:
      stale = os.path.join(path, "layers.json.tmp")  # as an older offlax left it: 0644
      open(stale, "w").close()
      os.chmod(stale, 0o644)
      for step in range(2):
        grad(s.source(), x(step))
        s.update(rest={"e": jnp.arange(3.0)})
    tier_path = str(tmp_path / "tier")
    tier = offlax.NVMeTier(tier_path, progress=False, fsync=False)
    offlax.offload(optax.adam(1e-3), tier).init({"w": jnp.ones((16, 16))})
    tier.close()
  finally:
    os.umask(old)
  for root in (path, tier_path):
    modes = [(".", os.lstat(root).st_mode)]
    for base, dirs, names in os.walk(root):
      full = [os.path.join(base, n) for n in dirs + names]
      modes += [(os.path.relpath(f, root), os.lstat(f).st_mode) for f in full]
    assert len(modes) > 10
    loose = [(n, oct(stat.S_IMODE(m))) for n, m in modes
             if stat.S_IMODE(m) != (0o700 if stat.S_ISDIR(m) else 0o600)]  # fmt: skip
    assert not loose, f"{root}: {loose}"
    assert root != path or {"layers.json", "gen1/rest.bin", ".lock"} <= {n for n, _ in modes}


def test_a_progress_bar_only_for_long_work(tmp_path, capfd, bars_at_once, monkeypatch):
  """Even past the bar's delay (`bars_at_once`: a first update compiling, a busy machine),
  an update or a create of a small store shows no bar; one moving a GiB or more does."""
  capfd.readouterr()
  with offlax.LayerStore.create(str(tmp_path / "a"), make_layers(), optimizer=TX) as store:
    grad(store.source(), x())
    store.update()
  assert "offlax: " not in capfd.readouterr().err
  assert layer_step.moved_bytes(store) < layer_step.BAR_MIN_BYTES
  monkeypatch.setattr(layer_step, "BAR_MIN_BYTES", layer_step.moved_bytes(store))
  with offlax.LayerStore.create(str(tmp_path / "b"), make_layers(), optimizer=TX) as store:
    grad(store.source(), x())
    store.update()
  err = capfd.readouterr().err
  assert "offlax: updating" in err and "offlax: writing" not in err  # the create moves less


@pytest.mark.slow
def test_the_example_refuses_to_resume_from_a_flipped_byte(tmp_path):
  """Issue 41's scenario: examples/nvme_params_nnx.py, one byte of gen0/params/0.bin flipped."""
  example = [sys.executable, os.path.join(HERE, "..", "examples", "nvme_params_nnx.py")]
  args = ["--layers", "2", "--width", "16", "--dir", str(tmp_path)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run(example + args + ["--steps", "1"], check=True, capture_output=True, env=env,
                 timeout=600)  # fmt: skip
  name = flip(str(tmp_path / "layers"), 1, "params", 0, 0)  # gen1/params/0.bin, step 1's
  out = subprocess.run(example + args + ["--steps", "2", "--resume"], capture_output=True,
                       text=True, env=env, timeout=600)  # fmt: skip
  assert out.returncode != 0
  assert "StoreCorruptedError" in out.stderr and f"{name}: layer 0 of params leaf" in out.stderr
  assert "in step 1 does not match its checksum" in out.stderr, out.stderr[-3000:]
  [report] = offlax.checkpoint.inspect_store(str(tmp_path / "layers"), verify=True, progress=False)
  assert report.step == 1 and report.mismatches == 1  # nothing trained on it, nothing committed
