"""The model shapes `offlax plan` counts: a named model's, or the nearest real one to ``--params``.

A plan whose params leave the device needs the model's layers, and more: the
step's working set grows with the width, heads and tokens; the RAM of an
`offlax.LayerStore` with its largest leaf and with the params outside the
layers (embedding and head). `--params N` alone says none of that, so the
planner takes the shape of a real model: the one of `KNOWN` nearest to `N`
(within 1.5x), or, where none is that near, a Llama-shaped model of a usual
layer count (`llama.shaped`), and says which.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, NamedTuple

import jax

from offlax._src import errors, llama, plan_options

# Published configs whose every weight `llama.Llama` counts exactly (untied head,
# heads x head_dim == d); models with a tied head or wider attention are left out.
KNOWN = {
  "TinyLlama 1.1B": llama.Llama(layers=22, d=2048, ffn=5632, vocab=32000, heads=32, kv_heads=4),
  "Llama 2 7B": llama.Llama(layers=32, d=4096, ffn=11008, vocab=32000, heads=32),
  "Mistral 7B": llama.Llama(layers=32, d=4096, ffn=14336, vocab=32000, heads=32, kv_heads=8),
  "Llama 3.1 8B": llama.Llama(
    layers=32, d=4096, ffn=14336, vocab=128256, heads=32, kv_heads=8
  ),  # fmt: skip
  "Qwen3 8B": llama.Llama(layers=36, d=4096, ffn=12288, vocab=151936, heads=32, kv_heads=8),
  "Llama 2 13B": llama.Llama(layers=40, d=5120, ffn=13824, vocab=32000, heads=40),
  "Qwen3 14B": llama.Llama(layers=40, d=5120, ffn=17408, vocab=151936, heads=40, kv_heads=8),
  "Qwen2.5 32B": llama.Llama(layers=64, d=5120, ffn=27648, vocab=152064, heads=40, kv_heads=8),
  "Llama 2 70B": llama.Llama(layers=80, d=8192, ffn=28672, vocab=32000, heads=64, kv_heads=8),
  "Llama 3.1 70B": llama.Llama(
    layers=80, d=8192, ffn=28672, vocab=128256, heads=64, kv_heads=8
  ),  # fmt: skip
  "Qwen2.5 72B": llama.Llama(layers=80, d=8192, ffn=29568, vocab=152064, heads=64, kv_heads=8),
  "Llama 3.1 405B": llama.Llama(
    layers=126, d=16384, ffn=53248, vocab=128256, heads=128, kv_heads=8
  ),  # fmt: skip
}
NEAR = 1.5  # a known model within this factor of --params gives the shape


class Shape(NamedTuple):
  """A model shape the plan counts, and the words that say where it came from."""

  model: llama.Llama
  source: str  # e.g. "Llama 3.1 70B, the nearest known model to 70B params"
  # A Tunix config's model: a Flax NNX model whose layers run unrolled, without remat
  # (`llama.Llama.unrolled_device_bytes`); else offlax's scanned step (`device_bytes`).
  unrolled: bool = False

  def device_bytes(self) -> int:
    """The step's working set on the device, as this model is trained (see `unrolled`)."""
    return self.model.unrolled_device_bytes() if self.unrolled else self.model.device_bytes()


def describe(m: llama.Llama) -> str:
  """``80 layers, d 8192, ffn 28672, 64 heads (8 kv), vocab 128256: 70.55B params``."""
  kv = f" ({m.kv_heads} kv)" if m.kv_heads and m.kv_heads != m.heads else ""
  return (
    f"{m.layers} layers, d {m.d}, ffn {m.ffn}, {m.heads} heads{kv}, vocab {m.vocab}: "
    f"{m.n_params / 1e9:.2f}B params"
  )


def count(n: float) -> str:
  """A parameter count in words: ``70B``, ``350M``, ``1.5T``, ``4096``."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.4g}{unit}"
  return str(int(n))


def usual_layers(n: int) -> int:
  """A usual decoder's layer count for `n` params: 17 at 1B, 32 at 7B, 39 at 13B, 69 at 70B."""
  return max(1, round(n ** (1 / 3) / 60))


def guess(n: int, tokens: int) -> Shape:
  """The shape of the known model nearest to `n` params (within `NEAR`), or a Llama-shaped one.

  Example:
    >>> from offlax._src import plan_models
    >>> plan_models.guess(70 * 10**9, 2048).source
    'Llama 3.1 70B, the nearest known model to 70B params'
  """
  name, m = min(KNOWN.items(), key=lambda kv: abs(math.log(kv[1].n_params / n)))
  if abs(math.log(m.n_params / n)) <= math.log(NEAR):
    return Shape(
      dataclasses.replace(m, tokens=tokens), f"{name}, the nearest known model to {count(n)} params"
    )
  layers = min(usual_layers(n), plan_options.LIMITS["layers"].high)
  return Shape(
    llama.shaped(n, int(layers), tokens=tokens),
    f"a Llama-shaped model of {count(n)} params in {layers} layers (no known model within {NEAR}x)",
  )


def with_layers(n: int, layers: int, tokens: int) -> Shape:
  """A Llama-shaped model of about `n` params in `layers` layers (``--params N --layers L``).

  `llama.shaped`: the depth is the user's, so no known model's shape; its
  working set is the one `tests/test_gpu_compile.py` checks against the
  compiled step (1B-30B, 1024-4096 tokens).
  """
  m = llama.shaped(n, layers, tokens=tokens)
  if m.n_params > 2 * n:  # the narrowest layers (d 128) and the vocabulary are already more
    raise plan_options.error(
      "layers",
      f"{layers} layers of the narrowest width (d 128) and a 32000 vocabulary are "
      f"{count(m.n_params)} params, over twice --params {count(n)}: give fewer layers",
    )
  return Shape(m, f"a Llama-shaped model of {count(n)} params in {layers} layers")


def load(name: str, tokens: int, flag: str = "--model") -> Shape:
  """The shape of ``--model NAME`` (or `flag` NAME): a Tunix config, a shapes JSON, a config.json.

  Raises:
    InvalidOptionError: not a file nor a Tunix config, unreadable, or shapes
      out of range (each of layers, d, ffn, vocab, heads from 1, kv_heads from
      0 to heads, heads at most d).
  """
  from offlax._src.hf import config as hf_config

  tunix = False  # a Tunix config's name (below): its model's step is unrolled
  if hf_config.is_hf_config(name):  # a Hugging Face checkpoint folder or its config.json
    shape = hf_config.planner_shapes(name)
  elif name.endswith(".json") or os.path.isfile(name):
    try:
      with open(name) as f:
        shape = json.load(f)
    except (OSError, ValueError) as e:
      raise errors.InvalidOptionError(f"plan: {flag} {name}: {e}") from None
    if not isinstance(shape, dict):
      raise errors.InvalidOptionError(
        f"plan: {flag} {name}: expected a JSON object of layers, d, ffn, vocab, heads and "
        f"optionally kv_heads, got {type(shape).__name__}"
      )
  else:
    shape = dataclasses.asdict(llama.from_config(name, tokens=tokens))
    tunix = True
  allowed = {"layers", "d", "ffn", "vocab", "heads", "kv_heads"}
  missing, extra = {"layers", "d", "ffn", "vocab", "heads"} - set(shape), set(shape) - allowed
  extra.discard("tokens")
  if missing or extra:
    raise errors.InvalidOptionError(
      f"plan: {flag} {name}: the shapes lack {sorted(missing)} and have unknown "
      f"{sorted(extra)} (expected layers, d, ffn, vocab, heads and optionally kv_heads)"
      if extra
      else f"plan: {flag} {name}: the shapes lack {sorted(missing)} (expected layers, d, ffn, "
      "vocab, heads and optionally kv_heads)"
    )
  values = {k: shape[k] for k in allowed if k in shape}
  for key, value in values.items():
    low, high = (0, values["heads"]) if key == "kv_heads" else (1, 10**7)
    if key == "layers":
      high = plan_options.LIMITS["layers"].high
    if key == "heads":
      high = values["d"] if isinstance(values["d"], int) else 10**7
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
      raise errors.InvalidOptionError(
        f"plan: {flag} {name}: {key} is {value!r}; it must be a whole number from {low} to {high}"
      )
  return Shape(llama.Llama(tokens=tokens, **values), f"{flag} {name}", unrolled=tunix)


def params(m: llama.Llama, dtype: Any) -> dict:
  """The params of `m` as `jax.ShapeDtypeStruct`s, layers stacked: planning starts no backend."""
  return llama.param_shapes(m, dtype)


def flat(n: int, dtype: Any) -> dict:
  """`n` params of no known shape: at most 64 leaves of 64M params or more, O(1) to plan.

  Leaves of 64M params, like a large model's matrices, up to 4.3B params;
  beyond, 64 equal leaves (the host tier's `fraction` then moves by 1/64).
  """
  leaf = max(1 << 26, -(-n // 64))
  sizes = [leaf] * (n // leaf) + ([n % leaf] if n % leaf else [])
  return {f"w{i:02d}": jax.ShapeDtypeStruct((s,), dtype) for i, s in enumerate(sizes)}
