"""A Hugging Face ``config.json``: read from a file or a checkpoint folder, as the planner's shapes.

`offlax plan --hf-config PATH` takes a checkpoint folder or its ``config.json``
(`plan_models.load`; ``--model PATH`` too): the model's layers, width, MLP width, vocabulary and
heads, from the keys ``transformers`` writes (a multimodal model's
``text_config``: its language model, the one trained).
"""

from __future__ import annotations

import json
import os
from typing import Any

from offlax._src import errors

NAME = "config.json"
# The planner's shape (`llama.Llama`'s fields) and the config.json key of each.
SHAPE_KEYS = {
  "layers": "num_hidden_layers", "d": "hidden_size", "ffn": "intermediate_size",
  "vocab": "vocab_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
}  # fmt: skip


def is_hf_config(path: str) -> bool:
  """Whether `path` is a checkpoint folder with a config.json, or a config.json of one."""
  if os.path.isdir(path):
    return os.path.isfile(os.path.join(path, NAME))
  try:
    with open(path) as f:
      config = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(config, dict) and (
    "num_hidden_layers" in config or "num_hidden_layers" in config.get("text_config", {})
  )


def read(path: str) -> dict[str, Any]:
  """The config.json of a checkpoint folder (or the file itself), a ``text_config`` merged in.

  Raises:
    InvalidOptionError: no config.json, or it is not a JSON object.
  """
  name = os.path.join(path, NAME) if os.path.isdir(path) else path
  try:
    with open(name) as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.InvalidOptionError(f"cannot read the Hugging Face config {name}: {e}") from None
  if not isinstance(config, dict):
    raise errors.InvalidOptionError(f"{name} is not a Hugging Face config (a JSON object).")
  return {**config, **config.get("text_config", {})}


def planner_shapes(path: str) -> dict[str, Any]:
  """The planner's shapes (layers, d, ffn, vocab, heads, kv_heads) from a config.json's keys.

  A key the config lacks is left out (the planner names it); ``kv_heads``
  defaults to the heads, as ``transformers`` does.
  """
  config = read(path)
  shapes = {k: config[key] for k, key in SHAPE_KEYS.items() if config.get(key) is not None}
  if "kv_heads" not in shapes and "heads" in shapes:
    shapes["kv_heads"] = shapes["heads"]
  return shapes
