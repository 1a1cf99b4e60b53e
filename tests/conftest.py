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


def run_steps(tx, params, steps=3):
  """Runs `steps` jitted steps; returns params, state and the last updates."""
  state = tx.init(params)

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


# The default run (`pytest -m "not slow"`, the README's command) keeps each feature
# covered by its cheapest cases and stays within a few minutes on 2 cores; the cases
# below also run with `-m slow` (`.ci/run` runs both). Full test names (file::name),
# with, for parametrized tests, the parameter ids kept in the default run.
_SLOW = {
  # The examples run by default (lm_nnx through its NVMe kill-and-resume test); the
  # benchmarks' smoke runs and the longer example runs are slow.
  "test_examples_and_benchmarks.py::test_host_overhead_benchmark_runs",
  "test_examples_and_benchmarks.py::test_nvme_throughput_benchmark_runs",
  "test_examples_and_benchmarks.py::test_gpu_check_code_path_runs_on_cpu",
  "test_examples_and_benchmarks.py::test_scaling_benchmark_runs",
  "test_examples_and_benchmarks.py::test_checkpoint_benchmark_runs",
  "test_examples_and_benchmarks.py::test_entry_point_quick",
  "test_examples_and_benchmarks.py::test_lm_example_trains_checkpoints_and_resumes",
  "test_examples_and_benchmarks.py::test_multi_device_example_with_the_nvme_tier",
  "test_host_adam.py::test_bit_identical_under_default_xla_flags",  # test_default_flags.py
  "test_host_adam.py::test_whole_step_under_default_xla_flags",  # a subprocess, as the above
  "test_checkpoint.py::test_async_round_trip_resumes_bit_exactly",
  "test_nvme_crash.py::test_sigkill_during_orbax_checkpoints",
  "test_nvme_crash.py::test_sigkill_on_a_mesh_keeps_every_shard_committed",
  "test_observability.py::test_rollback_then_resume_equals_the_reference",
  "test_planner.py::test_cli_measure",  # measures the machine; test_cli runs the command line
  # The longest default cases of features that others cover too (lm_nnx's kill and resume:
  # the NVMe example's; inspect: the orbax-checkpoint case; ...): 70 s of a 6 min run.
  "test_examples_and_benchmarks.py::test_lm_example_resumes_after_a_kill_with_the_nvme_tier",
  "test_observability.py::test_inspect_healthy_and_corrupted_store",
  "test_nvme_memory.py::test_ram_bounded_by_cache_and_slices",
  "test_default_flags.py::test_default_xla_flags",
  "test_checkpoint.py::test_plain_optax_checkpoint_restores_into_offload",
  # Params in host memory: the example's run (test_params_on_host_nnx.py trains the same
  # way), the planner's compiled agreement (test_planner.py checks its figures).
  "test_examples_and_benchmarks.py::test_lm_example_with_params_on_host",
  "test_gpu_compile.py::test_plan_params_host_agrees_with_the_compiled_host_bytes",
  # Tunix's PeftTrainer (2 minutes: installs in CI, runs with -m slow).
  "test_tunix.py::test_peft_trainer_one_device",
  "test_tunix.py::test_peft_trainer_with_the_nvme_tier",  # the same subprocess
  "test_tunix.py::test_peft_trainer_checkpoints_of_nvme_state_are_refused",
  # Donation patterns in a subprocess (test_composition.py donates params and state by
  # default); the CLI's compile (test_gpu_compile.py compiles the same steps by the API).
  "test_donation.py::test_donated_step_is_exact_and_in_place",
  "test_donation.py::test_jax_still_needs_the_fix",
  "test_gpu_compile.py::test_cli_compile_and_plan_params_host",
  # Params in host memory: the NVMe tier and LoRA (the host tier's and NNX's cases run).
  "test_params_on_host.py::test_nvme_tier_with_params_on_host",
  "test_params_on_host.py::test_coupled_update_inside_offload_equals_optax",
  "test_params_on_host_nnx.py::test_lora_with_frozen_base_layers_in_host_memory",
  "test_gpu_compile.py::test_params_off_device_step_is_flat_in_depth",  # see the next test
  # Second cases of features the default run covers otherwise: the Linen example
  # (test_flax.py trains Linen), a dtype change in a store with a cache (without one runs).
  "test_examples_and_benchmarks.py::test_linen_example",
  "test_checkpoint.py::test_host_tier_checkpoint_into_an_nvme_store_and_back",
  # A fresh CI venv (the native library built anew) took 40 s more than a warm one; these
  # keep it near 5 minutes: a store refusing a dtype change (the property tests' find),
  # L-BFGS's value/grad/value_fn through offload (test_composition.py passes an extra
  # argument by default), NNX with host layers (test_params_on_host.py runs the mode).
  "test_composition.py::test_extra_args_reach_the_inner_update",
  # Added with the Tier protocol, the docs and the whole host step (session 3): the
  # benchmark's smoke run (7 subprocesses; the host step's tests cover the kernel), a
  # store's new path (the bad-input cases of its parent run), the stall warning (the
  # other warnings run), the progress bar of a store copy (test_checkpoint.py copies
  # stores by default).
  "test_examples_and_benchmarks.py::test_host_adam_benchmark_runs",
  "test_bad_input.py::test_non_existent_store_path_is_created",
  "test_observability.py::test_stall_warning_after_io_bound_steps",
  "test_checkpoint_speed.py::test_copy_store_shows_a_progress_bar_in_bytes",
  # NVMeStoreSave/Restore in orbax: docs/checkpoints.md's blocks run them by default;
  # inspect: test_usage.py's directory case runs the command by default.
  "test_checkpoint.py::test_nvme_store_in_an_orbax_checkpoint",
  "test_observability.py::test_inspect_an_orbax_checkpoint",
  # Room for the GPU compile's native-kernel cases: the property test of every tier against
  # optax (test_equivalence.py, test_nvme.py and test_third_tier.py run each tier bit-exact
  # by default).
  "test_properties.py::test_offload_equals_optax_in_every_tier",
  # offload_params: Tunix's models in PeftTrainer (subprocesses, minutes); the second cases
  # of the in-process tests (a list of layers trains bit-exact by default).
  "test_tunix_params.py::test_peft_trainer_with_params_in_host_memory",
  "test_tunix_params.py::test_master_weights_with_bf16_params",
  "test_tunix_params.py::test_on_a_mesh_params_stay_sharded_in_host_memory",
  "test_offload_params.py::test_gradients_land_in_host_memory_and_equal_the_devices",
  "test_offload_params.py::test_lora_adapters_stay_on_the_device",
  "test_offload_params.py::test_master_weights_with_bf16_params",
  "test_examples_and_benchmarks.py::test_tunix_full_finetune_example",
  "test_examples_and_benchmarks.py::test_tunix_full_finetune_example_compiles_as_the_benchmark",
  # The README's test command with the extras hidden (a collection and two pages in a subprocess,
  # 20 s): .ci/run runs the command itself in a venv without them first.
  "test_docs.py::test_readme_test_command_without_the_extras",
  # The CI's fresh venv ran the default cases in 328 s (2026-12-05): the 8-device mesh in a
  # subprocess (30 s; test_multi_device_example trains on a mesh by default), the docs'
  # train steps (test_offloaded_step_bounds_device_memory compiles both modes), the third tier's
  # host-compute mode (test_host_adam.py runs it against optax by default); host compute's
  # temporaries flat in depth (test_offloaded_step_bounds_device_memory compiles the mode by
  # default), the sharding patches' canary (test_patches.py checks their scope by default).
  "test_gpu_compile.py::test_host_compute_host_temp_stays_flat_in_depth",
  "test_patches.py::test_flax_and_jax_still_need_the_sharding_patches",
  "test_sharding.py::test_bit_exact_with_optax_on_the_same_mesh",
  "test_sharding.py::test_state_is_sharded_in_each_devices_host_memory",
  "test_sharding.py::test_sharded_step_exports_for_cuda",
  "test_sharding.py::test_abstract_state_has_the_shardings_of_init",
  "test_sharding.py::test_nvme_tier_on_the_mesh_is_exact_with_optax",
  "test_sharding.py::test_nvme_tier_on_the_mesh_with_an_update_that_reads_the_tree_dtypes",
  "test_sharding.py::test_nvme_tier_keeps_one_store_per_device_with_only_its_shard",
  "test_sharding.py::test_nvme_store_resharded_for_another_mesh_continues_exactly",
  "test_sharding.py::test_nvme_shards_a_step_apart_resume_from_the_common_step",
  "test_sharding.py::test_nvme_tier_refuses_another_mesh_or_a_coupled_update",
  "test_sharding.py::test_nvme_rollback_of_a_sharded_root_rolls_back_every_shard",
  "test_sharding.py::test_jitted_step_compiles_once_on_the_mesh",
  # Params on NVMe for NNX models (session 5): room for them in a 325 s default run under
  # load. Kills of the NVMe tier's training (test_bad_input.py's full disk and Ctrl-C keep
  # the commit by default), two processes by jax.distributed (test_multi_device_example
  # trains on a mesh by default).
  "test_nvme_crash.py::test_sigkill_keeps_the_last_committed_state",
  "test_multiprocess.py::test_two_processes_train_and_checkpoint",
  # and the NVMe tier fused inside a chain (test_nvme.py's plain-clip_chain runs a chain
  # exactly by default), an offload inside an optax wrapper in NNX (test_composition.py and
  # test_offload_params.py's MultiSteps case wrap offloads by default).
  "test_nvme.py::test_fused_inside_a_chain_is_exact_and_commits_each_step",
  "test_offload_params.py::test_an_offload_inside_an_optax_wrapper_trains_in_nnx",
  # CI's fresh venv then ran the default cases in 323 s (2026-12-06): second cases of features
  # the default run covers otherwise. A full disk (test_nvme.py's failed step runs), the native
  # pool's choice (the native kernels' bit-exact tests run), the plan from a clone's folder
  # (test_cli runs the command), an old store reopened and a store resumed (the NVMe example
  # resumes), the docs' host-compute step bound (test_params_off_device_step_keeps_the_model_
  # off_the_device compiles), a LayerStore's inspect and keep (its rest test does both).
  "test_bad_input.py::test_full_disk_keeps_the_last_commit",
  "test_host_adam.py::test_native_pool_xla_or_own_gives_the_same_bytes",
  "test_install.py::test_plan_runs_from_the_folder_holding_a_clone_named_offlax",
  "test_observability.py::test_keep_is_fixed_and_old_stores_open",
  "test_nvme.py::test_resume_continues_bit_exactly",
  "test_gpu_compile.py::test_the_docs_train_steps_keep_the_bound",
  "test_layer_update.py::test_inspect_verifies_a_layer_store",
  "test_layer_update.py::test_keep_and_open_at_a_step",
  "test_planner.py::test_every_no_fit_lists_offlaxs_own_ways_out_first",  # test_cli's no-fit
  # CI's fresh venv at d53257e: 308 s (284 s at 7b41a64, the same tests): params in host memory
  # is proposed by test_params_in_host_memory_proposed_for_a_usual_decoder_or_a_named_model.
  "test_planner.py::test_params_in_host_memory_when_params_and_gradients_do_not_fit",
}
_KEEP = {
  "test_third_tier.py::test_conformance_bit_exact_in_many_slices_with_its_step": {
    "host-update",
    "numpy-update",
  },
  # A slice of one element is the schedule's slowest case; 7 elements (-m slow) and 64 cut
  # leaves as well.
  "test_coupling.py::test_schedule_bounds_slices_and_covers_every_element": {
    "64",
    "100",
    "1000",
    "1000000",
  },
  "test_bad_input.py::test_nan_and_inf_gradients_propagate_like_optax": {"host/host"},
  # (-m slow: every optimizer; test_host_adam.py and test_composition.py run the host tier
  # against optax by default)
  "test_equivalence.py::test_bit_identical_to_inner": set(),
  "test_layer_update.py::test_update_bit_exact_with_layers_in_memory": {"adam"},
  # Layers read from a LayerStore: fp32 plain, and bf16 under a remat policy; one pool size.
  "test_layer_store.py::test_loss_and_grads_bit_exact": {"float32-kw0", "bfloat16-kw3"},
  "test_layer_store.py::test_pool_bound": {"2"},
  "test_layer_store_nnx.py::test_layers_on_disk_train_bit_for_bit": {"adam"},
  "test_host_adam.py::test_bit_identical_to_optax": {"native-adam", "plain-adamw", "native-inject"},
  "test_host_adam.py::test_under_offload": {"native-device", "plain-host"},
  "test_host_adam.py::test_native_update_matches_optax_to_rounding": {
    "native-adamw-device",
    "native-adamw_mask-host",
    "plain-adam_schedule-host",
  },
  "test_host_adam.py::test_master_weights_whole_step_bit_identical": {
    "native-adamw-update",
    "native-adamw_mask_schedule-update_and_apply",
    "plain-adam-update_and_apply",
  },
  "test_host_adam.py::test_update_and_apply_is_one_pass": {"native-adamw"},
  "test_host_adam.py::test_master_weights_whole_step_under_offload": {"host"},
  "test_nvme.py::test_bit_identical_to_inner": {"plain-clip_chain"},
  # The third tier: cut pieces with a coupled chain, and whole leaves.
  "test_third_tier.py::test_a_third_tier_trains_bit_exact_with_optax": {
    "clip_adam-256",
    "adamw-1048576",
  },
  # Compositions in the streamed mode; host compute for two (test_export.py lowers all).
  "test_composition.py::*": {"device"},
  "test_composition.py::test_chain_clip_then_offload": {"device", "host"},
  "test_composition.py::test_wrappers_keep_the_fused_step_and_abstract_state": {
    "offload(chain)",
    "chain(offload)",
    "masked(offload)",
    "MultiSteps(offload)",
    "chain(offload, scale)",
    "GradientTransformation(offload)",
  },
  "test_composition.py::test_multi_steps_inside_offload": {"device", "host"},
  "test_composition.py::test_donating_params_and_state": {"device-float32", "host-bfloat16"},
  "test_master_and_partial.py::*": {"device"},
  "test_master_and_partial.py::test_partial_offload_by_selector": {"device", "host"},
  "test_master_and_partial.py::test_apply_if_finite_skips_nan_steps": {
    "inside-device",
    "outside-host",
  },
  "test_flax.py::test_linen_train_state": {"host"},
  "test_bad_input.py::test_update_that_changes_a_state_dtype": set(),
  # optax's update in each mode; offlax's native kernel in each with master weights.
  "test_gpu_compile.py::test_offloaded_step_bounds_device_memory": {
    "optax-device-fp32-optax-apply",
    "optax-host-fp32-update_and_apply",
    "offlax-device-bf16-master-update_and_apply",
    "offlax-host-bf16-master-update_and_apply",
  },
  "test_params_on_host.py::test_training_off_device_equals_plain": {"True-host"},
  "test_params_on_host.py::test_unfused_update_keeps_host_updates_on_host": {"host"},
  "test_params_on_host.py::test_layer_gradients_equal_plain_scan": {
    "True-True-True",  # remat, offloaded layer inputs, reversed
    "False-False-True",  # no remat, reversed
  },
  "test_params_on_host.py::test_step_exports_for_cuda": {"host"},
  "test_params_on_host_nnx.py::test_stacked_decoder_with_host_layers_equals_plain": set(),
  "test_offload_params.py::test_trains_as_on_the_device": {"list-of-layers"},
  "test_offload_params.py::test_the_wrapped_methods_and_eager_calls": {"True"},
  "test_sharding.py::*": {"auto"},  # any parametrized test: its Auto-axes mesh case
  "test_usage.py::test_every_optax_alias_works_with_every_tier": {
    *(f"nvme-{n}" for n in ("sign_sgd", "polyak_sgd", "noisy_sgd", "sm3")),
    "device-sm3",
    "host-noisy_sgd",
  },
}


def pytest_collection_modifyitems(config, items):
  from offlax._src import gpu_compile

  # The optional GPU compiler's doctests need it (CI installs it; see test_gpu_compile.py).
  if not gpu_compile.available():
    needs = pytest.mark.skip(reason="needs offlax[gpu-compile] (jax-cuda12-plugin)")
    for item in items:
      if item.nodeid.startswith("offlax/_src/gpu_compile.py::"):
        item.add_marker(needs)
  for item in items:
    name = item.nodeid.split("/")[-1]
    function, _, params = name.partition("[")
    kept = _KEEP.get(function, _KEEP.get(function.split("::")[0] + "::*"))
    slow = function in _SLOW or (
      params and kept is not None and not _kept(params.rstrip("]"), kept, function)
    )
    if slow:
      item.add_marker(pytest.mark.slow)


# For a file's wildcard entry: the parameter ids it chooses among (a test
# parametrized otherwise is kept).
_WILDCARD_IDS = {"device", "host", "explicit", "auto"}


def _kept(params: str, kept: set, function: str) -> bool:
  if function not in _KEEP:  # a wildcard entry: its ids among the test's
    ids = set(params.split("-"))
    return not ids & _WILDCARD_IDS or bool(ids & kept)
  return params in kept
