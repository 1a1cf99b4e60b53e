"""Security review checks (docs/reliability.md): names, deserialisation, permissions, links."""

import ast
import json
import os
import pathlib
import pickle
import re
import stat

import jax
import jax.numpy as jnp
import optax
import pytest

import offlax

SMALL = dict(chunk_bytes=256, cache_bytes=0, progress=False, fsync=False)

# Keys a pytree may carry that would escape or break a directory if used as a name.
HOSTILE_KEYS = [
  "../../escaped",
  "/etc/passwd",
  "a/b",
  "..",
  ".",
  "..\\..\\windows",
  "nul\x00byte",
  "new\nline",
  "x" * 300,  # longer than NAME_MAX
  "ünïcödé",
  "offlax.json",
  ".lock",
]
OURS = re.compile(r"^(\.lock|offlax\.json|gen\d|leaf_\d{5}|zarr\.json|c|\d+)$")


def _hostile_params():
  return {k: jnp.full((4, 3), float(i)) for i, k in enumerate(HOSTILE_KEYS)}


def test_key_paths_never_name_files(tmp_path):
  store = tmp_path / "store"
  params = _hostile_params()
  tier = offlax.NVMeTier(str(store), **SMALL)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  # Nothing outside the store; inside, only names offlax makes from indices.
  assert sorted(os.listdir(tmp_path)) == ["store"]
  for root, dirs, files in os.walk(store):
    for name in dirs + files:
      assert OURS.match(name), os.path.join(root, name)
  # The key paths are data in offlax.json, and round-trip: the store resumes.
  meta = json.loads((store / "offlax.json").read_text())
  assert {r["path"] for r in meta["leaves"]} >= {f"[0].mu[{k!r}]" for k in HOSTILE_KEYS}
  tier = offlax.NVMeTier(str(store), resume=True, **SMALL)
  state = offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  assert int(state.step) == 0


def _source_files():
  return sorted(pathlib.Path(offlax.__file__).parent.rglob("*.py"))


UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "yaml"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}


def test_no_pickle_or_eval_in_offlax():
  """No module that can run code from bytes is imported, no string is evaluated."""
  found = []
  for path in _source_files():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found += [(path, a.name) for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
      elif isinstance(node, ast.ImportFrom) and node.module:
        if node.module.split(".")[0] in UNSAFE_MODULES:
          found.append((path, node.module))
      elif isinstance(node, ast.Call):
        fn = node.func
        name = (
          fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        )
        if isinstance(fn, ast.Name) and name in UNSAFE_CALLS:  # the builtins, not re.compile
          found.append((path, name))
        # numpy's loaders unpickle object arrays when asked to.
        if name in ("load", "loads") and any(k.arg == "allow_pickle" for k in node.keywords):
          found.append((path, "allow_pickle"))
  assert not found, found
  assert len(_source_files()) > 10  # the walk saw the package


class _Payload:
  def __reduce__(self):
    return (os.system, (f"touch {_MARKER}",))


_MARKER = "/tmp/offlax-security-marker"


def test_pickled_payloads_in_the_store_are_never_run(tmp_path):
  """A pickle where offlax.json or a chunk should be is refused as data, never loaded."""
  if os.path.exists(_MARKER):
    os.unlink(_MARKER)
  store = tmp_path / "store"
  params = {"w": jnp.ones((16, 16))}
  tier = offlax.NVMeTier(str(store), **SMALL)
  offlax.offload(optax.adam(1e-3), tier).init(params)
  tier.close()
  payload = pickle.dumps(_Payload())
  for chunk in store.glob("gen0/leaf_*/c/*"):
    chunk.write_bytes(payload)
  (store / "offlax.json").write_bytes(payload)
  with pytest.raises(offlax.errors.StoreCorruptedError, match="offlax.json"):
    offlax.offload(optax.adam(1e-3), offlax.NVMeTier(str(store), resume=True, **SMALL)).init(params)
  assert not os.path.exists(_MARKER)


def _modes(root):
  """(relative name, permission bits) of everything under `root`, root included."""
  out = [(".", stat.S_IMODE(os.lstat(root).st_mode))]
  for base, dirs, files in os.walk(root):
    for name in dirs + files:
      full = os.path.join(base, name)
      out.append((os.path.relpath(full, root), stat.S_IMODE(os.lstat(full).st_mode)))
  return out


def test_files_are_owner_only(tmp_path):
  """Under the usual umask 022 too: the store, and a snapshot copied out of it."""
  old = os.umask(0o022)
  try:
    tier = offlax.NVMeTier(str(tmp_path / "new" / "store"), **SMALL)
    tx = offlax.offload(optax.adam(1e-3), tier)
    tx.init({"w": jnp.ones((16, 16)), "b": jnp.ones(16)})
    existing = tmp_path / "orbax-made"  # a directory someone else created, as orbax does
    existing.mkdir(mode=0o755)
    tier.snapshot(str(existing / "opt"))
    tier.close()
  finally:
    os.umask(old)
  for root in (tmp_path / "new" / "store", existing / "opt"):
    modes = _modes(root)
    assert len(modes) > 10
    loose = [(name, oct(mode)) for name, mode in modes if mode & 0o077]
    assert not loose, f"{root}: {loose}"


def test_commit_does_not_follow_a_planted_link(tmp_path):
  """The commit's temporary file (like .lock, see test_nvme.py) is opened with O_NOFOLLOW."""
  victim = tmp_path / "victim"
  victim.write_text("keep me")
  store = tmp_path / "store"
  tier = offlax.NVMeTier(str(store), **SMALL)
  offlax.offload(optax.adam(1e-3), tier).init({"w": jnp.ones(8)})
  # Named per process (processes of one job may share a directory).
  os.symlink(victim, store / f"offlax.json.{jax.process_index()}.{os.getpid()}.tmp")
  with pytest.raises(offlax.errors.StoreError, match="cannot commit step 1"):
    tier.store.commit(1)
  tier.close()
  assert victim.read_text() == "keep me"
  assert json.loads((store / "offlax.json").read_text())["step"] == 0
