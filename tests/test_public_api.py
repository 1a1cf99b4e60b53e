"""The public API's shape: a top level of at most 30 names, three lazy namespaces, the old paths
deprecated (not broken), one argument order for the state helpers."""

from __future__ import annotations

import inspect
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

import offlax

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMESPACES = ("checkpoint", "errors", "extend")


def test_top_level_is_at_most_30_names_and_dir_shows_only_them():
  assert len(offlax.__all__) <= 30, sorted(offlax.__all__)
  assert len(set(offlax.__all__)) == len(offlax.__all__)
  # No `Any`, `TYPE_CHECKING`, `importlib`, `_lazy`, nor a moved name, even once loaded.
  offlax.offload, offlax.errors, offlax.checkpoint.retier  # noqa: B018 (loads them)
  with pytest.warns(DeprecationWarning):
    offlax.OffloadError  # noqa: B018
  public = [n for n in dir(offlax) if not n.startswith("__")]
  assert public == sorted(offlax.__all__)
  for name in NAMESPACES:
    module = getattr(offlax, name)
    # Not identifiers: pytest's assertion rewriting adds `@py_builtins` to a module named on
    # its command line (`pytest offlax/errors.py` runs its doctest).
    names = [n for n in dir(module) if not n.startswith("__") and n.isidentifier()]
    assert names == sorted(module.__all__)


def test_every_name_resolves_at_one_path():
  seen: dict[int, str] = {}
  for where in ("offlax", *(f"offlax.{n}" for n in NAMESPACES)):
    module = sys.modules[where] if where in sys.modules else __import__(where, fromlist=["_"])
    for name in module.__all__:
      value = getattr(module, name)
      assert value is not None, f"{where}.{name}"
      if inspect.ismodule(value):
        continue
      assert id(value) not in seen, f"{where}.{name} is also {seen.get(id(value))}"
      seen[id(value)] = f"{where}.{name}"


def test_errors_namespace_holds_every_exception_and_warning_class():
  from offlax._src import errors as src_errors

  for name in offlax.errors.__all__:
    value = getattr(offlax.errors, name)
    assert isinstance(value, type) and issubclass(value, (Exception, Warning)), name
  defined = {
    n for n, v in vars(src_errors).items()
    if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == src_errors.__name__
  }  # fmt: skip
  assert defined == set(offlax.errors.__all__)
  from offlax.errors import StoreCorruptedError  # the from-import works too

  assert issubclass(StoreCorruptedError, (offlax.errors.OffloadError, ValueError))


def test_namespaces_load_no_jax_until_a_name_is_used():
  code = (
    "import sys\n"
    "import offlax, offlax.errors, offlax.checkpoint, offlax.extend\n"
    "from offlax.errors import StoreCorruptedError, OffloadError\n"
    "heavy = lambda: sorted({m.split('.')[0] for m in sys.modules}"
    " & {'jax', 'optax', 'flax', 'orbax', 'tensorstore'})\n"
    "print('AFTER_IMPORT', heavy())\n"
    "from offlax.checkpoint import HostStateSave\n"
    "print('AFTER_CHECKPOINT', heavy())\n"
  )
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
  )
  assert out.returncode == 0, out.stderr[-3000:]
  lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
  assert lines["AFTER_IMPORT"] == "[]"
  assert lines["AFTER_CHECKPOINT"] == "['jax', 'optax', 'orbax', 'tensorstore']"


def test_moved_names_still_work_with_a_deprecation_warning_naming_the_new_path():
  from offlax import _MOVED

  # Every namespaced name had a top-level path in 0.1 but those added since, never top-level.
  added_since = {"IncompleteStepError", "PartialNormWarning", "StepNotCommittedWarning"}
  namespaced = {name for n in NAMESPACES for name in getattr(offlax, n).__all__}
  assert set(_MOVED) == namespaced - added_since
  for name in added_since:
    with pytest.raises(AttributeError):
      getattr(offlax, name)
  for name, namespace in _MOVED.items():
    with pytest.warns(DeprecationWarning, match=rf"offlax\.{name} moved to {namespace}\.{name}"):
      old = getattr(offlax, name)
    assert old is getattr(sys.modules[namespace], name)
    assert name not in offlax.__all__ and name not in dir(offlax)
  with warnings.catch_warnings(record=True) as caught:  # the warning points at the caller
    warnings.simplefilter("always")
    offlax.StoreError  # noqa: B018
  assert caught[0].filename == __file__
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    offlax.not_a_name  # noqa: B018
  with pytest.raises(AttributeError, match="'offlax.checkpoint' has no attribute 'offload'"):
    offlax.checkpoint.offload  # noqa: B018


def test_state_helpers_take_inner_and_params_first():
  for fn in (offlax.abstract_state, offlax.checkpoint.retier, offlax.checkpoint.reshard):
    assert list(inspect.signature(fn).parameters)[:2] == ["inner", "params"], fn.__name__


def test_old_argument_order_is_refused_naming_the_new_one(tmp_path):
  import jax.numpy as jnp
  import optax

  params = {"w": jnp.ones(3)}
  state = optax.adam(1e-3).init(params)
  with pytest.raises(offlax.errors.TransformationTypeError) as e:
    offlax.checkpoint.retier(state, optax.adam(1e-3), params, offlax.HostTier())
  assert "retier(inner, params, inner_state, tier)" in str(e.value)
  assert isinstance(e.value, TypeError)
  with pytest.raises(
    offlax.errors.TransformationTypeError, match=r"reshard\(inner, params, src, dest"
  ):
    offlax.checkpoint.reshard(tmp_path / "a", tmp_path / "b", optax.adam(1e-3), params)
  assert not (tmp_path / "b").exists()
  # The new order works: the state lands in the tier.
  moved = offlax.checkpoint.retier(optax.adam(1e-3), params, state, offlax.HostTier())
  assert moved.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
