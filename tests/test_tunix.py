"""offlax in an unmodified Tunix `PeftTrainer` (issue 21), run in subprocesses (`tunix_run.py`).

Full fine-tuning and LoRA, streamed and host compute, and a checkpoint resumed
into a fresh trainer: the same losses and params as plain optax bit for bit,
the state in `pinned_host` after the constructor (which restores) and after
training; on a 2-device ("fsdp", "tp") mesh no moment of a sharded param is
replicated.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tunix")

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ("full-device", "full-host", "full-resume", "lora-device", "lora-host", "lora-resume")


def _run(devices: int) -> dict:
  env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
  out = subprocess.run(
    [sys.executable, os.path.join(HERE, "tunix_run.py"), str(devices)],
    capture_output=True, text=True, timeout=900, env=env,
  )  # fmt: skip
  lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  cases = [line for line in out.stdout.splitlines() if line.startswith("CASE ")]
  assert out.returncode == 0 and lines, (
    f"exit {out.returncode} in {cases[-1:] or 'set-up'}: {out.stderr[-4000:]}"
  )
  return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def one_device():
  return _run(1)


@pytest.fixture(scope="module")
def mesh():
  return _run(2)


def _check(r, case):
  assert r["losses"] == r["want_losses"]
  assert r["params_exact"], "params differ from plain optax's"
  assert r["kinds_after"] == ["pinned_host"], "the optimizer state left host memory"
  if case.endswith("resume"):
    # Tunix restores inside the constructor: into host memory, before any step.
    assert r["kinds_after_init"] == ["pinned_host"]


@pytest.mark.slow  # Tunix's PeftTrainer: minutes
@pytest.mark.parametrize("case", CASES)
def test_peft_trainer_one_device(one_device, case):
  _check(one_device[case], case)


@pytest.mark.slow  # the same subprocess
def test_peft_trainer_with_the_nvme_tier(one_device):
  r = one_device["full-nvme"]
  assert r["losses"] == r["want_losses"]
  assert r["params_exact"], "params differ from plain optax's"


@pytest.mark.slow  # Tunix's PeftTrainer: minutes
def test_peft_trainer_checkpoints_of_nvme_state_are_refused(one_device):
  """Tunix's checkpoint would hold the small leaves without the store's moments: refused."""
  r = one_device["full-nvme-checkpoint"]
  assert r["error"].startswith("UnsavableStateError"), r["error"]
  assert "offlax.checkpoint.NVMeStoreSave(tier)" in r["error"]
  assert "PeftTrainer" in r["error"]  # the way out in Tunix is named
  assert not [name for name in r["saved"] if name.isdigit()], r["saved"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_peft_trainer_on_a_mesh(mesh, case):
  r = mesh[case]
  _check(r, case)
  # Tunix shards the state by its NNX partition specs: offlax gives them, so the
  # moment of each sharded param stays sharded (without them Tunix replicates all).
  assert r["replicated_of_sharded"] == []
  assert r["sharded"] > 0


@pytest.mark.slow
def test_example_resumes_where_it_stopped():
  env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
  code = (
    "import json, runpy\n"
    "m = runpy.run_path('examples/tunix_lora.py')\n"
    "print('RESULT', json.dumps(m['main'](['--steps', '6'])))\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env,
    cwd=os.path.dirname(HERE),
  )  # fmt: skip
  lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  assert out.returncode == 0 and lines, out.stderr[-4000:]
  r = json.loads(lines[-1][len("RESULT ") :])
  assert r["restored_step"] == 3
  assert len(r["first"]) == 3 and len(r["second"]) == 3  # steps 4-6 only, after the resume
  assert r["restored_kinds"] == r["kinds"] == ["pinned_host"]
