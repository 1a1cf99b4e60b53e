"""What a store's `offlax.json` says (`Manifest`): its leaves, chunking, generations, kept steps."""

from __future__ import annotations

import dataclasses
import os

from offlax._src import errors
from offlax._src.nvme.format import (
  DEFAULT_KEEP,
  FORMAT_VERSION,
  METADATA,
  LeafRecord,
  metadata_problem,
  read_json,
)


@dataclasses.dataclass
class Manifest:
  """A store's committed state, as `offlax.json` records it (`format.py` has the layout).

  Example:
    >>> from offlax._src.nvme.manifest import Manifest
    >>> m = Manifest(generation=2, generations=3, kept=[(0, 2)])
    >>> m.next_generation, m.committed(1)
    (0, (0, [(1, 0), (0, 2)]))
  """

  records: list[LeafRecord] = dataclasses.field(default_factory=list)
  structure: str = ""  # the inner state's treedef, for people reading offlax.json
  chunk_bytes: int = 0  # the slice budget the chunks were cut for
  step: int = 0
  generation: int = 0
  generations: int = DEFAULT_KEEP + 1
  kept: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (step, gen), newest first

  @classmethod
  def read(cls, path: str) -> tuple[Manifest, dict]:
    """The manifest of the store at `path`, and `offlax.json` as read.

    Raises:
      StoreCorruptedError: a format this offlax does not read, or a malformed file.
    """
    name = os.path.join(path, METADATA)
    meta = read_json(name)
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
      raise errors.StoreCorruptedError(
        f"{name} has format_version {version!r}; this offlax reads versions <= {FORMAT_VERSION}."
      )
    try:
      records = [
        LeafRecord(
          r["index"], r["path"], tuple(r["shape"]), r["dtype"], r["chunk"], r["hot"], r.get("key")
        )
        for r in meta["leaves"]
      ]
      step, generation, chunk_bytes = meta["step"], meta["generation"], meta["chunk_bytes"]
      if version < 3:  # two generations, the committed one the only step kept
        generations, kept = 2, [[step, generation]]
      else:
        generations, kept = meta["generations"], meta["kept"]
      problem = metadata_problem(records, step, generation, chunk_bytes, generations, kept)
    except (KeyError, TypeError, ValueError) as e:
      problem = repr(e)
    if problem:
      raise errors.StoreCorruptedError(f"{name} is malformed: {problem}.")
    structure = str(meta.get("state_structure", ""))
    kept_pairs = [(s, g) for s, g in kept]
    return cls(records, structure, chunk_bytes, step, generation, generations, kept_pairs), meta

  @property
  def next_generation(self) -> int:
    """The generation the next step writes."""
    return (self.generation + 1) % self.generations

  def committed(self, step: int) -> tuple[int, list[tuple[int, int]]]:
    """The generation and kept steps once `step`, written to `next_generation`, is committed.

    The generation the step after it writes is no longer a kept step.
    """
    gen = self.next_generation
    after = (gen + 1) % self.generations
    return gen, [(step, gen), *((s, g) for s, g in self.kept if g not in (gen, after))]

  def to_json(self, step: int, gen: int, kept: list[tuple[int, int]]) -> dict:
    """The contents of `offlax.json` for this store with `step` current in generation `gen`."""
    return {
      "format_version": FORMAT_VERSION,
      "step": step,
      "generation": gen,
      "generations": self.generations,
      "kept": [list(e) for e in kept],
      "chunk_bytes": self.chunk_bytes,
      "state_structure": self.structure,
      "leaves": [dataclasses.asdict(r) for r in self.records],
    }
