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

  Raises:
    InvalidOptionError: a model the planner's dense Llama shape would count
      wrongly: experts (``num_experts``, ``num_local_experts``,
      ``n_routed_experts``, ``moe_intermediate_size``), a head tied to the
      embedding (``tie_word_embeddings``), or ``num_attention_heads x
      head_dim`` other than ``hidden_size``.
  """
  config = read(path)
  _check_plannable(path, config)
  shapes = {k: config[key] for k, key in SHAPE_KEYS.items() if config.get(key) is not None}
  if "kv_heads" not in shapes and "heads" in shapes:
    shapes["kv_heads"] = shapes["heads"]
  return shapes


# Keys of a mixture of experts' config.json (Mixtral, Qwen3-MoE, DeepSeek): the planner's shape
# has one MLP a layer, so Qwen3-30B-A3B would be counted as a dense 3B model.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _check_plannable(path: str, config: dict[str, Any]) -> None:
  """Refuses a config the planner's shape (untied head, heads x head_dim = width) miscounts."""
  why = None
  moe = [k for k in MOE_KEYS if config.get(k)]
  heads, d, head_dim = (config.get(k) for k in ("num_attention_heads", "hidden_size", "head_dim"))
  if moe:
    why = (
      f"{moe[0]} = {config[moe[0]]}: a mixture of experts; the planner's shape has one dense MLP "
      "a layer and would count a fraction of its params"
    )
  elif config.get("tie_word_embeddings"):
    why = (
      "tie_word_embeddings = true: the head is the embedding; the planner's shape counts an "
      "untied head of its own"
    )
  elif head_dim is not None and heads is not None and d is not None and heads * head_dim != d:
    why = (
      f"num_attention_heads x head_dim = {heads} x {head_dim} = {heads * head_dim}, not "
      f"hidden_size {d}; the planner's shape has heads x head_dim = width"
    )
  if why is not None:
    raise errors.InvalidOptionError(
      f"{path}: {why}; plan it with --params N (its parameter count) instead"
    )
