"""Test-wide JAX set-up: the CPU backend with arithmetic evaluated as written.

XLA:CPU rounds the same expression differently depending on the program
around it, in two ways: the algebraic simplifier turns `m / broadcast(s)` into
`m * broadcast(1 / s)` only where the scalar `s` has a single user, and LLVM
contracts `a * b + c` into one FMA only where both ops land in the same fusion.
So the same Adam update of a leaf can differ by an ulp between a program
holding the whole tree and one holding a slice of it (plain optax jitted on a
sub-tree shows the same). With the simplifier off and no FMA in the ISA (AVX has
none, FMA comes with AVX2; SSE4.2 has none either, but XLA:CPU then fails to
link float16 conversions, `__truncsfhf2`), every operation is rounded as
written, which is what "the maths is the same" means for the bit-for-bit tests;
`test_default_flags.py` checks the default configuration in a subprocess, with
the tolerance stated there.
"""

import functools
import os
import tempfile

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_disable_hlo_passes=algsimp --xla_cpu_max_isa=AVX"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The native Adam kernel is built per test session (a few seconds), never taken
# from a user's cache built under other flags.
os.environ.setdefault("OFFLAX_CACHE_DIR", tempfile.mkdtemp(prefix="offlax-test-cache-"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Hypothesis profiles (`--hypothesis-profile=long`, hypothesis's own pytest option,
# loads the other). "default" is what CI runs: few examples of small trees, from a
# fixed seed so CI does not turn red on a new draw; every example jit-compiles a
# few programs, so its count is what the default run pays. "long" is the deeper
# run of docs/reliability.md: random seeds, many more examples, trees up to 200
# leaves, and the crash tests' 50+ trials (see `long_profile`).
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
  "default", max_examples=3, deadline=None, derandomize=True, suppress_health_check=_SLOW_OK
)
settings.register_profile(
  "long", max_examples=60, deadline=None, derandomize=False, suppress_health_check=_SLOW_OK
)
settings.load_profile("default")  # the plugin loads "long" after this when asked


def _gpu_compiles_with_xla_s_default_passes() -> None:
  """`compile_for_gpu` in the tests compiles as it does outside them.

  The XLA_FLAGS above are for the CPU's arithmetic, but XLA reads them for every
  backend: the GPU compiler would run without its algebraic simplifier too, and its
  buffers differ from a user's (Tunix's Llama3 at 0.2B, 2 layers: 344.7 MB of device
  peak under the flags, 342.5 MB without). Each compile gets the simplifier back by its
  own `compiler_options`, as `compile_for_gpu`'s docstring shows; options a test gives win.
  """
  from offlax._src import gpu_compile

  compile_for_gpu = gpu_compile.compile_for_gpu

  @functools.wraps(compile_for_gpu)
  def with_default_passes(*args, compiler_options=None, **kwargs):
    options = {"xla_disable_hlo_passes": "", **(compiler_options or {})}
    return compile_for_gpu(*args, compiler_options=options, **kwargs)

  gpu_compile.compile_for_gpu = with_default_passes


_gpu_compiles_with_xla_s_default_passes()  # before a test module takes offlax.compile_for_gpu


def long_profile() -> bool:
  """Whether this run asked for the long profile (read at test time, not import).

  A prefix: `--hypothesis-verbosity` loads a copy named "long-with-...-verbosity".
  """
  return settings.get_current_profile_name().startswith("long")


def model_params(seed: int = 0) -> dict:
  """A pytree shaped like a small model: what real optimizer states hold."""
  k = jax.random.split(jax.random.key(seed), 6)
  return {
    "embed": {"table": jax.random.normal(k[0], (96, 16), jnp.bfloat16)},
    "layers": [
      {
        "attn": {"kernel": jax.random.normal(k[1], (16, 48)), "bias": jnp.zeros(48)},
        "mlp": {"kernel": jax.random.normal(k[2], (16, 64)) * 0.1, "bias": jnp.ones(64)},
        "norm": {"scale": jnp.ones(16)},
      },
      {"mlp": {"kernel": jax.random.normal(k[3], (64, 16)), "bias": jnp.zeros(16)}},
    ],
    "temperature": jnp.float32(0.5),
    "head": (jax.random.normal(k[4], (16, 10)), jnp.zeros((0,))),
    "no_params": {},
    "steps_seen": jnp.array([3, 1], jnp.int32),
  }


def grads_like(params, step: int):
  """Deterministic, step-dependent gradients (int leaves get zero grads)."""

  def g(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.zeros_like(x)
    return jnp.sin(x.astype(jnp.float32) * (step + 1) + 0.3).astype(x.dtype)

  return jax.tree.map(g, params)


def float_labels(params):
  return jax.tree.map(lambda x: "float" if jnp.issubdtype(x.dtype, jnp.floating) else "int", params)


def assert_trees_equal(a, b):
  """Bit-for-bit equality of two pytrees, naming the first leaf that differs."""
  la, ta = jax.tree_util.tree_flatten_with_path(a)
  lb, tb = jax.tree_util.tree_flatten_with_path(b)
  assert ta == tb, f"structures differ: {ta} vs {tb}"
  for (path, x), (_, y) in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), (
      f"leaf {jax.tree_util.keystr(path)} differs: max |diff| "
      f"{np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))}"
    )


def committed(params):
  """`params` committed as an offloaded step returns them, where all are uncommitted.

  An offloaded step commits its outputs to a one-device mesh (see
  `offlax._src.sharding.on_one_device`): uncommitted params would make a jitted
  step's second call miss its cache and compile the whole step again.
  """
  from offlax._src.sharding import one_device_mesh

  arrays = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
  if not arrays or any(x.committed for x in arrays):
    return params
  mesh = one_device_mesh(next(iter(arrays[0].devices())))
  put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return jax.tree.map(lambda x: put(x) if isinstance(x, jax.Array) else x, params)


def committed_state(state):
  """`state` with each uncommitted array committed as a jitted step returns it.

  `tx.init`'s scalars (the step count) and a plain optimizer's whole state come out
  uncommitted; a jitted step returns them committed, and its second call would
  compile the whole step again. Committed leaves (an offloaded state's) are kept.
  """
  from offlax._src.sharding import one_device_mesh

  arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
  if not arrays:
    return state
  mesh = one_device_mesh(next(iter(arrays[0].devices())))
  where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  put = lambda x: x if not isinstance(x, jax.Array) or x.committed else jax.device_put(x, where)
  return jax.tree.map(put, state)


def interrupted(fn, after=0.05):
  """Calls `fn()` with Ctrl-C (a `KeyboardInterrupt` from a SIGALRM handler) `after` seconds in,
  in this (the main) thread, as a user's; asserts it raised."""
  import signal

  def ctrl_c(*_):
    raise KeyboardInterrupt

  old = signal.signal(signal.SIGALRM, ctrl_c)
  try:
    signal.setitimer(signal.ITIMER_REAL, after)
    with pytest.raises(KeyboardInterrupt):
      fn()
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def run_steps(tx, params, steps=3):
  """Runs `steps` jitted steps (compiled once); returns params, state and the last updates."""
  params = committed(params)
  state = committed_state(tx.init(params))

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  for i in range(steps):
    params, state, updates = step(params, state, grads_like(params, i))
  return params, state, updates


@pytest.fixture
def params():
  return model_params()


@pytest.fixture
def bars_at_once(monkeypatch):
  """Progress bars show from the start, as if the work had run past their delay."""
  from offlax._src.nvme import array_files

  monkeypatch.setattr(array_files, "BAR_DELAY_S", 0.0)


# Scripts the tests run in subprocesses (8 devices, 2 processes, donation patterns that
# aborted): not test modules, and importing one here would start its run. `tunix_inputs.py`,
# their helper, imports Tunix and qwix, which a fresh venv (the README's commands) lacks.
collect_ignore = [
  "tunix_inputs.py",
  "sharded_run.py",
  "multiprocess_worker.py",
  "donation_run.py",
  "tunix_run.py",
  "tunix_params_run.py",
]


def scale_by_highest_dtype(factor):
  """Scales by `factor` cast to the tree's highest float dtype: reads the whole tree's dtypes."""

  def update(updates, state, params=None):
    del params
    c = jnp.asarray(factor, optax.tree.dtype(updates, "highest"))
    return jax.tree.map(lambda g: (g * c).astype(g.dtype), updates), state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.fixture(params=["native", "plain"])
def native(request, monkeypatch):
  """Runs a test with offlax's native library (on XLA:CPU), and again without it.

  Without it the Adam kernel's arithmetic runs as plain JAX and the NVMe tier's
  slices cross its callbacks, as on a GPU. True for the native run.
  """
  from offlax._src import ffi

  if request.param == "plain":
    monkeypatch.setattr(ffi, "_registered", False)
  else:
    assert ffi.available(), "offlax's native library did not build (see the log)"
  return request.param == "native"


def refuse_direct_io(monkeypatch) -> None:
  """Makes turning on O_DIRECT fail with EINVAL, as on a filesystem without direct I/O."""
  import fcntl

  from offlax._src.nvme import direct_io

  real = fcntl.fcntl

  def fcntl_without_direct(fd, cmd, arg=0):
    if cmd == fcntl.F_SETFL and arg & direct_io.O_DIRECT:
      raise OSError(22, "Invalid argument")  # what tmpfs of older kernels answers
    return real(fd, cmd, arg)

  monkeypatch.setattr(fcntl, "fcntl", fcntl_without_direct)


def pytest_collection_modifyitems(config, items):
  from offlax._src import gpu_compile

  # The optional GPU compiler's doctests need it (CI installs it; see test_gpu_compile.py).
  if not gpu_compile.available():
    needs = pytest.mark.skip(reason="needs offlax[gpu-compile] (jax-cuda12-plugin)")
    for item in items:
      if item.nodeid.startswith("offlax/_src/gpu_compile.py::"):
        item.add_marker(needs)
  # Runs before `-m` deselects (a conftest's hook comes before pytest's own), so `-m slow`
  # sees the marks added here. Cases picked by id on the command line leave the test's
  # other cases uncollected: a kept id is then not missing, so nothing is checked.
  missing = mark_slow_except(items)
  if missing and not any("[" in arg for arg in config.args):
    raise pytest.UsageError("\n".join(missing))


def mark_slow_except(items) -> list[str]:
  """Marks slow the cases a test's `@pytest.mark.slow_except(*ids)` does not keep.

  The default run (`pytest -m "not slow"`, the README's command) keeps each feature
  covered by its cheapest cases. A test marks itself (`@pytest.mark.slow`) or one
  parameter's cases (`pytest.param(..., marks=pytest.mark.slow)`) where it can;
  `slow_except` names the kept cases where they are combinations of several
  parameters or a fixture's (`native`, `opts`), which pytest cannot mark one by one.

  Args:
    items: the collected test items.

  Returns:
    One line per test whose `slow_except` names an id none of its cases has (a
    renamed or removed parameter), naming the test, the ids and the cases it has.
  """
  cases: dict[str, tuple[set, set]] = {}
  for item in items:
    mark = item.get_closest_marker("slow_except")
    if mark is None:
      continue
    case = getattr(item, "callspec", None)
    test = item.nodeid.partition("[")[0]
    kept, seen = cases.setdefault(test, (set(mark.args), set()))
    if case is not None:
      seen.add(case.id)
    if case is None or case.id not in kept:
      item.add_marker(pytest.mark.slow)
  return [
    f"{test}: @pytest.mark.slow_except names {sorted(kept - seen)}, not among its cases "
    f"{sorted(seen)}; name the cases the default run keeps"
    for test, (kept, seen) in cases.items()
    if kept - seen
  ]
