"""Two processes joined by `jax.distributed` train and checkpoint sharded offloaded state."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # test_multi_device_example trains on a mesh by default
def test_two_processes_train_and_checkpoint(tmp_path):
  env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
  port = str(_free_port())
  worker = os.path.join(HERE, "multiprocess_worker.py")
  procs = [
    subprocess.Popen(
      [sys.executable, worker, str(i), port, str(tmp_path)],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
    )  # fmt: skip
    for i in range(2)
  ]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300)[0])
  finally:  # never leave a process behind, whatever failed
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
  results = [json.loads(o.split("RESULT ")[1].splitlines()[0]) for o in outs]
  assert [r["process"] for r in results] == [0, 1]
  for r in results:
    for name in ("stream", "zero1", "host"):
      got = r[name]
      # Bit for bit with plain optax on the same 2-process mesh, before and after
      # an orbax save and restore written by both processes.
      assert got["exact"] and got["resumed_exact"], (name, got)
      # offlax.checkpoint.HostStateSave too: each process wrote its checksums, process 0 the layout.
      assert got["direct_resumed_exact"], (name, got)
      assert {"crc32c.0.json", "crc32c.1.json", "host_state.json"} <= set(got["direct_files"])
      assert got["kinds"] == got["restored_kinds"] == ["pinned_host"]
      assert got["specs"]["w"] in ("P('data',)", "P('data', None)")
    # Each process holds its 2 devices' shards: "b" (16 fp32) replicated is 2 x 64 B,
    # a quarter of that under ZeRO-1; "w" (32 x 16, sharded 4 ways) 2 x 512 B.
    assert r["stream"]["local_bytes"] == {"b": 128, "w": 1024}
    assert r["zero1"]["local_bytes"] == r["host"]["local_bytes"] == {"b": 32, "w": 1024}
    # The NVMe tier: 2 steps bit for bit, an orbax checkpoint of the store,
    # restored and reopened, 2 more. Each process opened its own 2 devices' stores.
    nvme = r["nvme"]
    assert nvme["exact"] and nvme["resumed_exact"], nvme
    assert (nvme["step"], nvme["resumed_step"]) == (2, 4)
    assert nvme["shards"] == [2 * r["process"], 2 * r["process"] + 1]
    # Each restored its own shards into one directory (listed after a collective).
    assert nvme["dirs"] == [f"shard_0000{i}" for i in range(4)]
    # offlax.checkpoint.reshard for other specs, run by both: the next step is plain optax's.
    assert nvme["reshard_step"] == 4 and nvme["resharded_exact"], nvme
    assert nvme["resharded_shards"] == nvme["shards"]
