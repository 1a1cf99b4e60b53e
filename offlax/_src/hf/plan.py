"""A checkpoint matched to a model's params, every problem found before a byte is written.

`match` pairs each tensor of a checkpoint folder with the param it fills
(`mapping.resolve`), and checks the pairs: no tensor without a param (unless
skipped), no param without its tensors, shapes that the mapping's steps turn
into the param's, dtypes that convert (floating point to floating point).
`check_config` compares the folder's ``config.json`` with the model's config.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax.numpy as jnp

from offlax._src import errors
from offlax._src.hf import files
from offlax._src.hf import mapping as mapping_lib

# config.json's keys and the names Tunix's (and most JAX models') configs give them.
CONFIG_KEYS = {
  "num_hidden_layers": ("num_layers", "num_hidden_layers", "n_layers"),
  "hidden_size": ("embed_dim", "hidden_size", "d_model", "emb_dim"),
  "num_attention_heads": ("num_heads", "num_attention_heads", "n_heads"),
  "num_key_value_heads": ("num_kv_heads", "num_key_value_heads", "n_kv_heads"),
  "head_dim": ("head_dim",),
  "intermediate_size": ("hidden_dim", "intermediate_size", "mlp_dim"),
  "vocab_size": ("vocab_size", "num_embed"),
}


class Match(NamedTuple):
  """The checkpoint's tensors by the param they fill; those that fill none (copied by a save)."""

  by_path: dict[str, list[tuple[mapping_lib.Entry, files.Tensor]]]
  others: list[str]  # skipped, or mapped to an ``unused.`` target


def match(folder: files.Folder, mapping: dict[str, Any], params: dict[str, Any],
          skip: Iterable[str], cast: bool, where: str) -> Match:  # fmt: skip
  """Pairs `folder`'s tensors with `params`, all checked.

  Raises:
    CheckpointMismatchError: naming every unexpected tensor, missing param,
      wrong shape or dtype.
  """
  skips = [re.compile(s) for s in skip]
  by_path: dict[str, list[tuple[mapping_lib.Entry, files.Tensor]]] = {}
  others, unexpected, unknown = [], [], []
  for name, t in folder.tensors.items():
    if any(s.fullmatch(name) for s in skips):
      others.append(name)
      continue
    entry = mapping_lib.resolve(mapping, name)
    if entry is not None and entry.path.startswith(mapping_lib.UNUSED):
      others.append(name)
    elif entry is None:
      unexpected.append(name)
    elif entry.path not in params:
      unknown.append(f"{name} (mapped to {entry.path})")
    else:
      by_path.setdefault(entry.path, []).append((entry, t))
  if unexpected or unknown:
    raise errors.CheckpointMismatchError(
      f"{where}: the checkpoint {folder.path} has tensors the model does not: "
      + files.short(unexpected + unknown)
      + ". A checkpoint of another model? Else skip them with skip=[name or regex, ...] "
      "(e.g. a vision tower: skip=[r'vision_tower\\..*']), or pass a mapping= that places them."
    )
  missing = [p for p in params if p not in by_path]
  lora = [
    p for p in missing if "lora" in type(getattr(params[p], "variable", None)).__name__.lower()
  ]
  if lora:
    raise errors.CheckpointMismatchError(
      f"{where}: the model's params {files.short(lora)} are LoRA adapters, which a Hugging Face "
      f"checkpoint of the base model ({folder.path}) does not hold: load before adding them, and "
      "merge them into the base weights before saving (or save the adapters on their own)."
    )
  if missing:
    raise errors.CheckpointMismatchError(
      f"{where}: the checkpoint {folder.path} has no tensor for the model's params "
      f"{files.short(missing)} ({len(folder.tensors)} tensors, {len(others)} skipped). "
      "A checkpoint of another model, or a mapping= that misses them?"
    )
  problems = []
  for path, pairs in by_path.items():
    problems += _check(path, pairs, params[path], cast)
  if problems:
    raise errors.CheckpointMismatchError(
      f"{where}: the checkpoint {folder.path} does not fit the model: {files.short(problems, 6)}."
    )
  return Match(by_path, others)


def _check(path: str, pairs: list, param: Any, cast: bool) -> list[str]:
  indices = [e.at for e, _ in pairs]
  if indices == [None]:
    want = [param.shape]
  elif None in indices or sorted(indices) != list(range(len(param.shape) and param.shape[0])):
    names = ", ".join(f"{t.name}->{e.at}" for e, t in pairs)
    return [f"param {path} {list(param.shape)} gets tensors {names}, not each index of its first "
            "axis once"]  # fmt: skip
  else:
    want = [param.shape[1:]] * len(pairs)
  out = []
  for (entry, t), shape in zip(pairs, want, strict=True):
    try:
      got = mapping_lib.shapes(t.shape, entry.steps, t.name)[-1]
    except errors.CheckpointMismatchError as e:
      out.append(str(e))
      continue
    if got != tuple(shape):
      out.append(f"tensor {t.name} is {list(t.shape)} (mapped: {list(got)}), the param "
                 f"{path} wants {list(shape)}")  # fmt: skip
    # jnp.issubdtype knows ml_dtypes' bfloat16 and float8s (np.issubdtype does not). A cast is
    # float to float only: an integer one would silently wrap values.
    floats = [jnp.issubdtype(d, jnp.floating) for d in (t.dtype, param.dtype)]
    if t.dtype != param.dtype and (not cast or not (floats[0] and floats[1])):
      why = " (cast=False)" if not cast else " (cast converts floating point dtypes only)"
      out.append(f"tensor {t.name} is {files.NAMES[t.dtype]}, the param {path} is "
                 f"{param.dtype.name}{why}")  # fmt: skip
  return out


def check_config(folder: str, config: Any, where: str) -> None:
  """Refuses a ``config.json`` in `folder` whose sizes differ from `config`'s.

  Compares the keys of `CONFIG_KEYS` that both name (a Gemma3 config's
  ``text_config`` for a multimodal checkpoint). No config.json, or no
  config: nothing to compare (the tensors' shapes are checked anyway).

  Raises:
    CheckpointMismatchError: naming each size that differs.
  """
  name = os.path.join(folder, "config.json")
  if config is None or not os.path.isfile(name):
    return
  try:
    with open(name) as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.CheckpointCorruptedError(f"{where}: cannot read {name}: {e}") from e
  hf = {**hf, **hf.get("text_config", {})}
  differ = []
  for key, attrs in CONFIG_KEYS.items():
    ours = next((getattr(config, a) for a in attrs if hasattr(config, a)), None)
    if key in hf and ours is not None and hf[key] is not None and int(hf[key]) != int(ours):
      attr = next(a for a in attrs if hasattr(config, a))
      differ.append(f"{key}={hf[key]} (the model's {attr}={ours})")
  if differ:
    raise errors.CheckpointMismatchError(
      f"{where}: {name} disagrees with the model's config: {', '.join(differ)}. Make the model "
      "from the checkpoint's config (or pass check_config=False to compare only the tensors)."
    )
