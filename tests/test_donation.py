"""Jitted steps that donate offloaded state, in any pattern: exact, in place, never an abort.

JAX 0.10 pairs donated buffers with outputs by shape and dtype alone when a
jit has no `out_shardings`, and hands a `pinned_host` state buffer to a device
output: the process aborts (one device) or the step fails (a mesh). offlax
makes the pairing memory-kind aware (`offlax._src.donation`, a process-wide
patch listed in docs/patches.md); the patterns run
in a subprocess (`donation_run.py`), where a regression is a failed test, not
a crashed session.
"""

import json
import os
import subprocess
import sys

import pytest

from offlax._src import donation

HERE = os.path.dirname(os.path.abspath(__file__))
PATTERNS = (
  "state_alone",
  "state_first",
  "state_and_updates",
  "update_alone",
  "params_alone",
  "params_and_state",
)


def _run(code: str, **env_vars: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), **env_vars}
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
  )


_RESULTS: dict[str, dict] = {}


def _results(where: str) -> dict:
  """The patterns' results on one device or the mesh, run once per module in a subprocess."""
  if where not in _RESULTS:
    out = _run(f"import donation_run; donation_run.main({where!r})")
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    started = [line for line in out.stdout.splitlines() if line.startswith("PATTERN ")]
    assert out.returncode == 0 and lines, (
      f"exit {out.returncode} in {started[-1:] or 'set-up'}: {out.stderr[-3000:]}"
    )
    _RESULTS[where] = json.loads(lines[-1][len("RESULT ") :])
  return _RESULTS[where]


def test_installed_on_first_use_not_at_import():
  """`import offlax` leaves JAX's pairing alone; the first `offload(...).init` wraps it."""
  out = _run(
    "import jax.numpy as jnp, optax\n"
    "from jax._src.interpreters import mlir\n"
    "original = mlir._set_up_aliases\n"
    "import offlax\n"
    "print('IMPORT', mlir._set_up_aliases is original)\n"
    "offlax.offload(optax.adam(1e-3)).init({'w': jnp.ones(2)})\n"
    "f = mlir._set_up_aliases\n"
    "print('INIT', f.__wrapped__ is original, f.__offlax_patch__)\n"
  )
  assert out.returncode == 0, out.stderr[-3000:]
  lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
  assert lines["IMPORT"] == "True", "import offlax replaced JAX's _set_up_aliases"
  assert lines["INIT"] == f"True {donation.PATCH.name}", lines["INIT"]


def test_installed_for_this_jax():
  from jax._src.interpreters import mlir

  from offlax._src import patches

  assert donation.install()  # this JAX has the function wrapped
  assert donation.install()  # idempotent: wraps once
  assert patches.installed(donation.PATCH)
  assert mlir._set_up_aliases.__offlax_patch__ == donation.PATCH.name
  assert not hasattr(mlir._set_up_aliases.__wrapped__, "__offlax_patch__")


@pytest.mark.slow  # subprocesses; test_composition.py donates by default
@pytest.mark.parametrize("where", ["one_device", "mesh"])
@pytest.mark.parametrize("mode", ["device", "host"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_donated_step_is_exact_and_in_place(pattern, mode, where):
  r = _results(where)[f"{pattern}-{mode}-{where}"]
  assert r["exact"], "donated steps differ from undonated ones"
  assert r["kinds"] == ["pinned_host"], "the state left host memory"
  assert r["reused"], "a donated state buffer was not reused in place"


def test_only_pairings_across_memory_kinds_change():
  """The wrapper hands JAX's own answer through unless JAX paired across memory kinds."""
  import jax
  import jax.numpy as jnp
  from jax._src import core
  from jax._src.interpreters import mlir

  patched, jaxs = mlir._set_up_aliases, mlir._set_up_aliases.__wrapped__
  a = core.ShapedArray((4, 3), jnp.float32)
  b = core.ShapedArray((3,), jnp.float32)
  host = core.ShapedArray((4, 3), jnp.float32, memory_space=jax.memory.Space.Host)
  tail = (None, None, None, None, None)
  # One memory kind.
  args = ([None, None], [a, b], [b, a], [True, True], *tail)
  assert patched(*args) == jaxs(*args) == ([1, 0], [False, False], None)
  # Host memory, paired within its kind by JAX already: JAX's answer, warning flags and all.
  args = ([None, None], [host, a], [host, a], [True, True], *tail)
  assert patched(*args) == jaxs(*args) == ([0, 1], [False, False], None)
  # A host buffer and a device output of its shape: JAX pairs them, the wrapper does not.
  args = ([None], [host], [a], [True], *tail)
  assert jaxs(*args)[0] == [0]
  assert patched(*args)[0] == [None]
  # Kinds JAX knows (out_shardings given): JAX's answer.
  args = ([None], [host], [a], [True], ["pinned_host"], ["device"], None, None, None)
  assert patched(*args) == jaxs(*args)


@pytest.mark.slow  # a subprocess, as the above
def test_jax_still_needs_the_fix():
  """Canary: with OFFLAX_NO_PATCHES=1 the Tunix pattern aborts. Red: JAX fixed it, drop the fix.

  When this fails, remove `offlax._src.donation` and its entry in docs/patches.md.
  """
  out = _run(
    "import donation_run as d\n"
    "from jax._src.interpreters import mlir\n"
    "assert not hasattr(mlir._set_up_aliases, '__offlax_patch__')\n"
    "d.run_pattern('state_alone', 'device', None)\n",
    OFFLAX_NO_PATCHES="1",
  )
  assert out.returncode != 0, "the donation pattern ran without offlax's fix: JAX fixed it"
  assert "memory kind does not match" in out.stderr, out.stderr[-3000:]
