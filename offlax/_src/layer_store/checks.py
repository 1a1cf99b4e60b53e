"""A `LayerStore`'s slot checksums, checked on every read, and what a mismatch says.

The store records the crc32c of each params and state slot it writes in the
manifest (per generation, layer i of leaf k at ``i * leaves + k``: `slot_at`),
and of each gradient slot in memory. Every read of a slot (the model's forward
read and its backward read again, `update`'s reads, `read_params`,
`read_layer`, `read_state`) checks it before its bytes are used, in the
thread that read it (the read-ahead pool's, `update`'s readers): a mismatch
raises `StoreCorruptedError` naming the file, the leaf, the layer and the
step, and the way back to a kept step. `update` then commits nothing: the
committed step stays as it was, its files and the manifest untouched.

The gradients' checksums live in memory only: a backward pass rewrites every
gradient slot before the `update` that reads it, and the manifest is written
at commits, not after each backward pass. A store opened anew holds
gradients of no known step, unchecked, as the backward pass overwrites them.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np

from offlax._src import errors

UNKNOWN = None  # a slot never written since create (a sparse store's zeros): not checked


def slot_at(records: Sequence[dict], k: int, i: int) -> int:
  """Where layer `i` of leaf `k` (`records`' order) is in its generation's checksum list."""
  return i * len(records) + records[k].get("index", k)


def crc(buffer: np.ndarray) -> int:
  """A slot's crc32c (the `crc32c` package: hardware, without the GIL for large slots)."""
  return crc32c.crc32c(buffer.data)


def way_back(path: str, step: int | None, kept: Sequence[tuple[int, int]]) -> str:
  """How to go back from a damaged `step`: the older kept steps, or that there are none."""
  older = sorted((s for s, _ in kept if step is None or s < step), reverse=True)
  verify = f"`python -m offlax inspect {path} --verify` lists every damaged slot."
  if not older:
    return (
      f"The store keeps no step before step {step} (LayerStore.create(keep=...) sets how many "
      "it keeps): restore the store from a copy or create it anew. " + verify
    )
  return (
    f"Go back to an older kept step ({', '.join(map(str, older))}): "
    f"LayerStore.open({path!r}, like, optimizer=..., step={older[0]}), or "
    f"`python -m offlax rollback {path} --to {older[0]}`, with the rest of the model from the "
    f"same step. " + verify
  )


def corrupted(
  path: str,
  name: str,
  kind: str,
  leaf: str,
  layer: int,
  step: int | None,
  kept: Sequence[tuple[int, int]],
  got: int,
  want: int,
) -> errors.StoreCorruptedError:
  """The error for a params or state slot of a kept `step` that fails its checksum."""
  return errors.StoreCorruptedError(
    f"LayerStore: {name}: layer {layer} of {kind} leaf {leaf} in step {step} does not match "
    f"its checksum (crc32c {got:08x}, recorded {want:08x}): the file changed after offlax "
    f"wrote it. Nothing was written over it: step {step} stays committed as it is. "
    + way_back(path, step, kept)
  )


def grads_corrupted(
  name: str, leaf: str, layer: int, step: int, got: int, want: int
) -> errors.StoreCorruptedError:
  """The error for a gradient slot that fails the checksum taken when it was written."""
  return errors.StoreCorruptedError(
    f"LayerStore: {name}: layer {layer} of the gradient of leaf {leaf} does not match the "
    f"checksum taken when it was written (crc32c {got:08x}, expected {want:08x}): the disk "
    f"changed it. Nothing was committed: the store still holds step {step}. Run the step's "
    "forward and backward pass again (they rewrite the gradients), then update()."
  )
