"""A Llama-shaped decoder, as shapes: whole training steps to compile, plan and benchmark.

`compile_step` builds the train step of a model too big for the device the way
offlax trains it (params, gradients and optimizer state in host memory, layers
streamed by `scan_layers`, the update fused with its apply on the host) or the
plain way, and compiles it with XLA's GPU compiler (`compile_for_gpu`): the
CLI's ``offlax compile --llama``, the planner's check, `benchmarks/params_offload.py`
and the tests use it. Nothing is allocated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from offlax._src import gpu_compile
from offlax._src.apply import update_and_apply
from offlax._src.checkpoint import abstract_state
from offlax._src.host_params import fetch
from offlax._src.layers import scan_layers
from offlax._src.master import master_weights
from offlax._src.transform import offload


@dataclasses.dataclass(frozen=True)
class Llama:
  """A Llama-shaped decoder: `layers` blocks of attention and a SwiGLU MLP."""

  layers: int
  d: int
  ffn: int
  vocab: int
  heads: int
  kv_heads: int = 0  # grouped-query attention: fewer key/value heads (0: as many as heads)
  tokens: int = 2048  # batch 1 x sequence

  @property
  def kv(self) -> int:
    """The width of the key and value projections."""
    return self.d // self.heads * (self.kv_heads or self.heads)

  @property
  def layer_params(self) -> int:
    return 2 * self.d * (self.d + self.kv) + 3 * self.d * self.ffn + 2 * self.d

  @property
  def n_params(self) -> int:
    return self.layers * self.layer_params + 2 * self.vocab * self.d + self.d

  def device_bytes(self) -> int:
    """The device peak of `compile_step` (offloaded), estimated from the shapes.

    The larger of two phases of XLA:GPU's program:
    - a layer's backward pass: XLA's attention (no flash kernel) holds the
      scores and their gradients, f32 and bf16, and a mask, 13.5 B per head
      and token pair; besides, about 4 hidden states and a third of a
      layer's weights;
    - the update: 1.4 layers of bf16 weights, an eighth of the embedding and
      the host step's slices.
    The coefficients are fitted to the compiled step at 16 shapes (1B-70B,
    512-4096 tokens, `llama.shaped` and `MODELS`): within 7% of each (2026-12-04).
    """
    layer = 2 * self.layer_params  # bf16
    backward = 13.5 * self.heads * self.tokens**2 + 4 * 2 * self.tokens * self.d
    backward += 0.3 * layer + 50e6
    update = 1.4 * layer + 0.13 * 2 * self.vocab * self.d + 185e6
    return int(max(backward, update))

  def unrolled_device_bytes(self) -> int:
    """The device peak of a Flax NNX model's step with its layers off the device, estimated.

    Tunix's models (``offlax.offload_params``, layers in host memory or an
    `offlax.LayerStore`) run their layers unrolled, without remat: the backward
    pass keeps every layer's input (a bf16 hidden state each), so the peak grows
    with the depth, unlike `device_bytes`' scanned step. The larger of two phases
    of XLA:GPU's program (read off its buffer assignment at 2 layers):
    - a layer's backward pass: the attention's scores, f32, and probabilities,
      bf16 (6 B per head and token pair); the layer's bf16 weights read for it
      and the gradients of some (1.2 layers: how many are live at once is the
      scheduler's choice; 405B's compiles hold 1.0 with the rest's state on the
      NVMe tier, and with it in host memory also the embedding's gradient, made
      before the layers' backward); the MLP's activations (4 x tokens x ffn,
      bf16); the logits' gradient (tokens x vocab, bf16) or the embedding's, bf16;
    - the head's backward pass: its gradient (vocab x d) and the logits'.
    Both hold the saved hidden states: one per layer and about 8 more.
    Against the compiled step (tests/test_gpu_compile.py, benchmarks/capacity.py):
    Llama 3.1 405B -2.8% at 126 layers (+7.8% with the rest's state on the NVMe tier,
    from 2 and 4 layers), Llama3-70B -5.8% at 80. With 1.3 layers, as before the NVMe
    tier's slices of a leaf ran in one loop: 405B +0.1% at 126 (+5.6% with the NVMe tier;
    +11.0% with its loop), 70B -5% at 2 and -4% at 80, a 0.2B Llama at 1024 tokens +8%,
    Llama 3.1 8B at 2 layers +39% (its schedule holds less at once: over, not under)
    (2026-12-07).
    """
    hidden = 2 * self.tokens * self.d  # bf16
    logits = 2 * self.tokens * self.vocab  # the logits' gradient, bf16
    saved = (8 + self.layers) * hidden
    backward = 6 * self.heads * self.tokens**2 + 1.2 * 2 * self.layer_params
    backward += 4 * 2 * self.tokens * self.ffn + logits
    head = 2 * self.vocab * self.d + logits
    return int(max(backward, head) + saved)


MODELS = {
  "13b": Llama(layers=40, d=5120, ffn=13824, vocab=32000, heads=40),
  "70b": Llama(layers=80, d=8192, ffn=28672, vocab=32000, heads=64, kv_heads=8),
}


def shaped(n_params: float, layers: int, *, tokens: int = 2048, vocab: int = 32000) -> Llama:
  """A Llama of about `n_params` parameters in `layers` layers (ffn 2.7 d, heads of 128)."""
  # n = layers * (4 d^2 + 3 * 2.7 d^2) + 2 vocab d: solved for d, rounded to heads of 128.
  a, b = layers * (4 + 3 * 2.7), 2 * vocab
  d = (-b + (b * b + 4 * a * n_params) ** 0.5) / (2 * a)
  d = max(128, int(round(d / 128)) * 128)
  ffn = int(round(2.7 * d / 256)) * 256
  return Llama(layers=layers, d=d, ffn=ffn, vocab=vocab, heads=d // 128, tokens=tokens)


def param_specs(m: Llama, memory_kind: str | None, dtype=jnp.bfloat16):
  """`ShapeDtypeStruct`s of the params, layers stacked along a first axis."""
  return param_shapes(m, dtype, sharding=gpu_compile.one_device(memory_kind))


def param_shapes(m: Llama, dtype: Any, *, sharding: Any = None) -> dict:
  """The params of `m` as `jax.ShapeDtypeStruct`s, layers stacked (``layers`` first axis).

  Without a sharding the shapes start no backend: the planner's case.
  """
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  L, d, f = m.layers, m.d, m.ffn
  layers = {
    "wq": s(L, d, d), "wk": s(L, d, m.kv), "wv": s(L, d, m.kv), "wo": s(L, d, d),
    "w1": s(L, d, f), "w3": s(L, d, f), "w2": s(L, f, d), "n1": s(L, d), "n2": s(L, d),
  }  # fmt: skip
  return {"layers": layers, "embed": s(m.vocab, d), "head": s(d, m.vocab), "norm": s(d)}


def _rms(x, g):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
  return y.astype(x.dtype) * g


def block(m: Llama, h, w):
  """One decoder layer on hidden states `h` (tokens, d)."""
  t, hd = h.shape[0], m.d // m.heads
  x = _rms(h, w["n1"])
  q = (x @ w["wq"]).reshape(1, t, m.heads, hd)
  k, v = ((x @ w[n]).reshape(1, t, m.kv // hd, hd) for n in ("wk", "wv"))
  a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(t, m.d)
  h = h + a @ w["wo"]
  x = _rms(h, w["n2"])
  return h + (jax.nn.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"]


def loss_fn(m: Llama, offload_activations: bool = True):
  """Next-token cross-entropy of `m`; params in host memory are fetched where used.

  For params on the device `fetch` does nothing and `scan_layers` is a
  rematerialised `jax.lax.scan`: the plain step's loss.
  """

  def loss(params, tokens):
    h = fetch(params["embed"])[tokens]
    layer = lambda h, w: (block(m, h, w), None)
    h, _ = scan_layers(layer, h, params["layers"], offload_activations=offload_activations)
    logits = (_rms(h, fetch(params["norm"])) @ fetch(params["head"])).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], -1))

  return loss


def train_step(m: Llama, tx, *, offloaded: bool = True):
  """``(params, state, tokens) -> (params, state, loss)``; jit with params and state donated."""
  loss = loss_fn(m, offload_activations=offloaded)

  def step(params, state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    if offloaded:
      params, state = update_and_apply(tx, grads, state, params)
    else:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state, value

  return step


def compile_step(
  m: Llama,
  target: str | gpu_compile.GpuTarget,
  *,
  offloaded: bool = True,
  chunk_bytes: int = 256 * 2**20,
  layer_store: str | None = None,
  **compile_options,
):
  """The compiled train step's memory (an `offlax.extend.CompiledMemory`).

  Options go to `compile_for_gpu`.
  """
  if layer_store is not None:
    return _compile_layers_on_disk(m, target, layer_store, chunk_bytes, compile_options)
  inner = master_weights(optax.adamw(1e-5))
  params = param_specs(m, "pinned_host" if offloaded else None)
  if offloaded:
    tx = offload(inner, compute="host", chunk_bytes=chunk_bytes)
    state = gpu_compile.state_specs(abstract_state(tx, params))
  else:
    tx = inner
    state = gpu_compile.state_specs(jax.eval_shape(tx.init, params))
  step = jax.jit(train_step(m, tx, offloaded=offloaded), donate_argnums=(0, 1))
  tokens = jax.ShapeDtypeStruct((m.tokens,), jnp.int32, sharding=gpu_compile.one_device(None))
  return gpu_compile.compile_for_gpu(
    step, params, state, tokens, target=target, n_params=m.n_params, **compile_options
  )


def _compile_layers_on_disk(m: Llama, target, path: str, chunk_bytes: int, options: dict):
  """The step with the layers in an `offlax.LayerStore` at `path` (sparse: nothing written).

  The layers' gradients go to the store and its `update` runs outside the
  program; the embedding, head and final norm stay in host memory with
  AdamW and an fp32 master in host compute, as in the params-in-host-memory step.
  """
  from offlax._src.layer_store.store import LayerStore

  rest = param_specs(m, "pinned_host")
  layers = rest.pop("layers")
  tx = offload(master_weights(optax.adamw(1e-5)), compute="host", chunk_bytes=chunk_bytes)
  state = gpu_compile.state_specs(abstract_state(tx, rest))
  loss = loss_fn(m)

  def step(source, rest, state, tokens):
    merged = lambda source, rest: loss({**rest, "layers": source}, tokens)
    value, (_, grads) = jax.value_and_grad(merged, argnums=(0, 1))(source, rest)
    rest, state = update_and_apply(tx, grads, state, rest)
    return rest, state, value

  tokens = jax.ShapeDtypeStruct((m.tokens,), jnp.int32, sharding=gpu_compile.one_device(None))
  with LayerStore.create(path, layers, progress=False) as store:
    return gpu_compile.compile_for_gpu(
      jax.jit(step, donate_argnums=(1, 2)), store.source(), rest, state, tokens, target=target,
      n_params=m.n_params, **options,
    )  # fmt: skip


def from_config(name: str, *, tokens: int = 2048) -> Llama:
  """The `Llama` shape of a Tunix model config (``qwen3_14b``) or of a JSON file of shapes.

  A JSON file holds ``{"layers", "d", "ffn", "vocab", "heads"}`` and optionally
  ``"kv_heads"``. A name is a classmethod of the ``ModelConfig`` of
  ``tunix.models.llama3``, ``qwen3`` or ``gemma3`` (Tunix installed).

  Raises:
    InvalidOptionError: the name is neither a file nor a Tunix config.
  """
  import json
  import os

  from offlax._src import errors

  if name.endswith(".json") or os.path.isfile(name):
    with open(name) as f:
      shape = json.load(f)
    missing = {"layers", "d", "ffn", "vocab", "heads"} - set(shape)
    if missing:
      raise errors.InvalidOptionError(
        f"--model {name}: the shapes lack {sorted(missing)} (expected layers, d, ffn, vocab, "
        "heads and optionally kv_heads)."
      )
    return Llama(tokens=tokens, **{k: int(v) for k, v in shape.items()})
  import importlib

  known = []
  for family in ("llama3", "qwen3", "gemma3"):
    try:
      config_cls = importlib.import_module(f"tunix.models.{family}.model").ModelConfig
    except ImportError:
      continue
    known += [n for n in dir(config_cls) if not n.startswith("_") and "b" in n]
    make = getattr(config_cls, name, None)
    if callable(make):
      c = make()
      d = c.embed_dim
      return Llama(
        layers=c.num_layers, d=d, ffn=c.hidden_dim, vocab=c.vocab_size,
        heads=d // c.head_dim, kv_heads=max(1, c.num_kv_heads * d // (c.head_dim * c.num_heads)),
        tokens=tokens,
      )  # fmt: skip
  raise errors.InvalidOptionError(
    f"--model {name!r}: not a JSON file of shapes nor a Tunix model config"
    + (
      f" (known: {', '.join(sorted(set(known))[:12])}, ...)" if known else " (Tunix not installed)"
    )
  )
