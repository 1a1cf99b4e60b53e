"""A layer store's commits (`Commits`): the manifest in memory, the committed step, its rename.

The manifest (`files.MANIFEST`) names the committed step, the generation its
params and state are in, the kept steps and every slot's checksum. A step is
written into a free generation (`free_generation`), then `commit` makes it
the current one by replacing the manifest atomically (`files.write_manifest`);
`replace` does the same for new values of the committed step itself (a
checkpoint loaded into the store, `rewrite.Rewrite`), its number kept.
"""

from __future__ import annotations

from typing import Any

from offlax._src.layer_store import files


class Commits:
  """The manifest of an open layer store and its committed step.

  Attributes:
    path: the store's directory.
    manifest: the manifest as in memory (the slots' checksums as written).
    fsync: flush the manifest as it is replaced.
    generations: the copies of params and state (``keep + 1``).
    step: the committed step.
    generation: the generation the committed step is in.
    kept: the committed steps on disk and their generations, newest first.
    layers_path: the model's list the layers are (`guards.layers_path`), or None: unknown.
  """

  def __init__(self, path: str, manifest: dict, fsync: bool):
    self.path, self.manifest, self.fsync = path, manifest, fsync
    self.generations: int = manifest["generations"]
    self.step: int = manifest["step"]
    self.generation: int = manifest["generation"]
    self.kept: list[tuple[int, int]] = [tuple(k) for k in manifest["kept"]]  # type: ignore[misc]
    self.layers_path: str | None = manifest.get("layers_path")

  def step_of(self, gen: int) -> int | None:
    """The kept step in generation `gen`, or None (a free one)."""
    return next((s for s, g in self.kept if g == gen), None)

  def is_free(self, gen: int) -> bool:
    """Whether generation `gen` holds neither the committed step nor a kept one."""
    return gen != self.generation and all(g != gen for _, g in self.kept)

  def crcs(self, gen: int) -> dict[str, list[int | None]]:
    """Generation `gen`'s slot checksums by kind (the manifest's own lists: written in place)."""
    return self.manifest["crc"][str(gen)]

  def free_generation(self) -> int:
    """A generation no kept step is in, its checksums reset: where the next step is written."""
    target = next(g for g in range(self.generations) if g not in {g for _, g in self.kept})
    self.manifest["crc"][str(target)] = files.no_crcs(self.manifest)
    return target

  def rest_records(self) -> Any:
    """The records of what `update(rest=...)` committed with the current step, or None."""
    return self.manifest.get("rest", {}).get(str(self.generation))

  def commit(self, target: int, rest_records: Any) -> int:
    """Makes `target` (written whole, flushed) the next step's generation; returns that step.

    The manifest on disk first, then in memory: a failed write (a full disk) leaves both at
    the step before, so the next step is not written into the generation the disk names.
    """
    keep = self.generations - 1
    kept = [(self.step + 1, target)] + self.kept[: keep - 1]
    self._write(self.step + 1, target, kept, rest_records)
    return self.step

  def add_rest(self, rest_records: Any) -> None:
    """Names the rest written late into the committed step's generation (`backward`)."""
    self._write(self.step, self.generation, self.kept, rest_records)

  def replace(self, target: int, rest_records: Any) -> None:
    """Makes `target` (written whole, flushed) the committed step's generation, its number kept.

    The generation the step was in is free again; the older kept steps stay.
    """
    self._write(self.step, target, [(self.step, target)] + self.kept[1:], rest_records)

  def go_to_step(self, step: int) -> None:
    """Makes kept `step` current again, dropping the steps after it (`LayerStore.open(step=)`)."""
    kept = files.to_kept_step(self.path, self.step, self.kept, step)
    self._write(kept[0][0], kept[0][1], kept, self.manifest.get("rest", {}).get(str(kept[0][1])))

  def _write(self, step: int, gen: int, kept: list[tuple[int, int]], rest_records: Any) -> None:
    """The manifest naming `step` in `gen` (its rest's records) written, then made the one in
    memory: nothing in memory changes where the write fails."""
    rest = {**self.manifest.get("rest", {}), str(gen): rest_records}
    new = {**self.manifest, "step": step, "generation": gen, "kept": kept, "rest": rest}
    files.write_manifest(self.path, new, fsync=self.fsync)
    self.manifest.update(new)
    self.step, self.generation, self.kept = step, gen, kept
