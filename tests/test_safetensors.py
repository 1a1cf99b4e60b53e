"""`offlax.load_safetensors` / `save_safetensors` with Tunix's Llama3, Qwen3 and Gemma3.

Each test writes a tiny checkpoint in Hugging Face's own layout (the tensor
names and shapes of `transformers`' Llama, Qwen3 and Gemma3 models, written by
the `safetensors` package), loads it with offlax into a model whose params are
on the device, in ``pinned_host`` or in a `LayerStore`, and compares the logits
with those of the same model loaded by Tunix's own loader
(``create_model_from_safe_tensors``), bit for bit. Saving a loaded model gives
back every tensor of the source byte for byte; each bad input is refused by
name with the model, the store and the output folder untouched.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import offlax

pytest.importorskip(
  "tunix", reason="needs google-tunix: the Llama3/Qwen3/Gemma3 models and loaders are Tunix's"
)
safetensors_numpy = pytest.importorskip(
  "safetensors.numpy", reason="needs safetensors: writes the test checkpoints"
)

from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix.models.gemma3 import params_safetensors as gemma3_params  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.llama3 import params as llama3_params  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.models.qwen3 import params as qwen3_params  # noqa: E402

SMALL = dict(embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2)
VOCAB, LAYERS = 64, 2


def config_of(family, **changes):
  if family == "llama3":
    config = llama3.ModelConfig(num_layers=LAYERS, vocab_size=VOCAB, rope_theta=500_000,
                                norm_eps=1e-5, **SMALL)  # fmt: skip
  elif family == "qwen3":
    config = qwen3.ModelConfig(num_layers=LAYERS, vocab_size=VOCAB, rope_theta=1_000_000,
                               norm_eps=1e-6, **SMALL)  # fmt: skip
  else:
    config = dataclasses.replace(
      gemma3.ModelConfig.gemma3_270m(), num_layers=LAYERS, num_embed=VOCAB,
      sliding_window_size=4, param_dtype=jnp.float32, **SMALL,
    )  # fmt: skip
  return dataclasses.replace(config, **changes)


MODELS = {"llama3": llama3.Llama3, "qwen3": qwen3.Qwen3, "gemma3": gemma3.Gemma3}
TUNIX_LOADERS = {
  "llama3": llama3_params.create_model_from_safe_tensors,
  "qwen3": qwen3_params.create_model_from_safe_tensors,
  "gemma3": gemma3_params.create_model_from_safe_tensors,
}


def abstract_model(family, config):
  return nnx.eval_shape(lambda: MODELS[family](config, rngs=nnx.Rngs(0)))


def hf_tensors(family, config, dtype=np.float32, seed=0):
  """Random tensors with the names and shapes of Hugging Face's checkpoint of `family`."""
  d, n, k, h, f = (config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.hidden_dim)  # fmt: skip
  shapes = {"model.embed_tokens.weight": (VOCAB, d)}
  for i in range(config.num_layers):
    p = f"model.layers.{i}."
    shapes |= {
      p + "self_attn.q_proj.weight": (n * h, d), p + "self_attn.k_proj.weight": (k * h, d),
      p + "self_attn.v_proj.weight": (k * h, d), p + "self_attn.o_proj.weight": (d, n * h),
      p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
      p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
      p + "post_attention_layernorm.weight": (d,),
    }  # fmt: skip
    if family in ("qwen3", "gemma3"):
      shapes |= {p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,)}
    if family == "gemma3":
      shapes |= {p + "pre_feedforward_layernorm.weight": (d,),
                 p + "post_feedforward_layernorm.weight": (d,)}  # fmt: skip
  shapes["model.norm.weight"] = (d,)
  if family != "gemma3":  # Gemma ties its head to the embedding
    shapes["lm_head.weight"] = (VOCAB, d)
  rng = np.random.default_rng(seed)
  return {name: (rng.standard_normal(s) * 0.3).astype(dtype) for name, s in shapes.items()}


def write_checkpoint(folder, family, config, tensors, shards=1):
  """`tensors` as a Hugging Face folder: shards with their index, config.json, a tokenizer file."""
  os.makedirs(folder, exist_ok=True)
  names = list(tensors)
  parts = [names[i::shards] for i in range(shards)]
  files = ["model.safetensors"] if shards == 1 else [
    f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)
  ]  # fmt: skip
  for file, part in zip(files, parts, strict=True):
    safetensors_numpy.save_file({n: tensors[n] for n in part}, os.path.join(folder, file),
                                metadata={"format": "pt"})  # fmt: skip
  if shards > 1:
    weight_map = {n: file for file, part in zip(files, parts, strict=True) for n in part}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
  hf_config = {
    "architectures": [{"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "gemma3": "Gemma3ForCausalLM"}[family]],
    "num_hidden_layers": config.num_layers, "hidden_size": config.embed_dim,
    "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim, "intermediate_size": config.hidden_dim, "vocab_size": VOCAB,
  }  # fmt: skip
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf_config, f)
  with open(os.path.join(folder, "tokenizer.json"), "w") as f:
    f.write('{"model": "a tokenizer"}')
  return str(folder)


TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 1, VOCAB)


def logits(model, tokens):
  b, n = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(n), (b, n))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
  return model(tokens, positions, None, mask)[0]


logits_of = nnx.jit(logits)


def tunix_loaded(family, config, folder, dtype=None):
  return TUNIX_LOADERS[family](str(folder), config, dtype=dtype)


def params_of(model):
  return {
    jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
    for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  }


def assert_same_tensors(a, b):
  """Two checkpoint folders hold the same tensors: names, dtypes, shapes and bytes."""
  load = lambda folder: {
    name: x
    for file in sorted(os.listdir(folder)) if file.endswith(".safetensors")
    for name, x in safetensors_numpy.load_file(os.path.join(folder, file)).items()
  }  # fmt: skip
  x, y = load(a), load(b)
  assert sorted(x) == sorted(y)
  for name in x:
    assert (x[name].dtype, x[name].shape) == (y[name].dtype, y[name].shape), name
    assert x[name].tobytes() == y[name].tobytes(), name


# -- loading -----------------------------------------------------------------------------------


def _families(fast):
  """`fast` in the default run; the other two with -m slow (each family compiles its model)."""
  return [f if f == fast else pytest.param(f, marks=pytest.mark.slow)
          for f in ("llama3", "qwen3", "gemma3")]  # fmt: skip


@pytest.mark.parametrize("family", _families("gemma3"))
def test_load_on_the_device_equals_tunix_loader(tmp_path, family):
  config = config_of(family)
  folder = write_checkpoint(tmp_path / "ckpt", family, config, hf_tensors(family, config), 2)
  model = offlax.load_safetensors(abstract_model(family, config), folder, progress=False)
  want = tunix_loaded(family, config, folder)
  got_params, want_params = params_of(model), params_of(want)
  assert sorted(got_params) == sorted(want_params)
  for key in want_params:
    np.testing.assert_array_equal(got_params[key], want_params[key], err_msg=key)
  np.testing.assert_array_equal(logits_of(model, TOKENS), logits_of(want, TOKENS))


@pytest.mark.parametrize("family", _families("qwen3"))
def test_load_into_pinned_host_equals_tunix_loader(tmp_path, family):
  config = config_of(family)
  folder = write_checkpoint(tmp_path / "ckpt", family, config, hf_tensors(family, config))
  model = offlax.offload_params(abstract_model(family, config))
  offlax.load_safetensors(model, folder, progress=False)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
  assert kinds == {"pinned_host"}
  want = offlax.offload_params(tunix_loaded(family, config, folder))
  np.testing.assert_array_equal(logits_of(model, TOKENS), logits_of(want, TOKENS))


def test_a_bf16_checkpoint_into_float32_params_as_tunix_casts(tmp_path):
  config = config_of("llama3")
  tensors = hf_tensors("llama3", config, ml_dtypes.bfloat16)
  folder = write_checkpoint(tmp_path / "ckpt", "llama3", config, tensors)
  model = offlax.load_safetensors(abstract_model("llama3", config), folder, progress=False)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype("float32")}
  want = tunix_loaded("llama3", config, folder, dtype=jnp.float32)
  np.testing.assert_array_equal(logits_of(model, TOKENS), logits_of(want, TOKENS))
  out = offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  assert_same_tensors(out, folder)  # bf16 -> float32 -> bf16: exact


def stored_model(tmp_path, family, config, optimizer=None):
  """An abstract model with its layers in a new (sparse, zero) store, the rest in pinned_host."""
  model = abstract_model(family, config)
  store = offlax.LayerStore.create(str(tmp_path / "store"), offlax.stack_layers(model.layers),
                                   optimizer=optimizer, progress=False)  # fmt: skip
  return offlax.offload_params(model, store=store), store


@pytest.mark.parametrize("family", _families("llama3"))
def test_load_into_a_layer_store_equals_tunix_loader(tmp_path, family):
  config = config_of(family)
  folder = write_checkpoint(tmp_path / "ckpt", family, config, hf_tensors(family, config))
  tx = offlax.master_weights(optax.adam(1e-3))
  model, store = stored_model(tmp_path, family, config, tx)
  with store:
    offlax.load_safetensors(model, folder, store=store, progress=False)
    want = tunix_loaded(family, config, folder)
    stacked = offlax.stack_layers(want.layers)
    for a, b in zip(jax.tree.leaves(store.read_params()), jax.tree.leaves(stacked), strict=True):
      np.testing.assert_array_equal(a, b)  # on disk, in the committed step
    # The optimizer's state is init of the loaded layers: its fp32 master, zero moments.
    fresh = jax.vmap(tx.init)(jax.tree.map(np.asarray, stacked))
    for a, b in zip(jax.tree.leaves(store.read_state()), jax.tree.leaves(fresh), strict=True):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
      logits_of(model, TOKENS), logits_of(offlax.offload_params(want), TOKENS)
    )
  [report] = offlax.checkpoint.inspect_store(store.path, verify=True, progress=False)
  assert report.ok, report  # the checksums of the slots written


# -- saving ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["device", "pinned_host", "store"])
def test_load_then_save_gives_every_tensor_back(tmp_path, where):
  config = config_of("gemma3")
  tensors = hf_tensors("gemma3", config)
  tensors["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
  tensors["lm_head.weight"] = np.ones((VOCAB, 32), np.float32)  # Tunix's Gemma3: unused (tied)
  source = write_checkpoint(tmp_path / "ckpt", "gemma3", config, tensors, shards=3)
  skip = [r"vision_tower\..*"]
  store = None
  if where == "store":
    model, store = stored_model(tmp_path, "gemma3", config)
  else:
    model = abstract_model("gemma3", config)
    model = offlax.offload_params(model) if where == "pinned_host" else model
  offlax.load_safetensors(model, source, skip=skip, store=store, progress=False)
  out = offlax.save_safetensors(model, str(tmp_path / "out"), store=store,
                                max_shard_bytes=40_000, progress=False)  # fmt: skip
  assert_same_tensors(out, source)  # the skipped vision tensor copied as it was
  files = sorted(os.listdir(out))
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) > 1 and "model.safetensors.index.json" in files
  assert {"config.json", "tokenizer.json"} <= set(files)
  assert all(os.path.getsize(os.path.join(out, f)) <= 40_000 + 4096 for f in shards)
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    weight_map = json.load(f)["weight_map"]
  assert sorted(weight_map) == sorted(tensors)
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".out")]  # no temporary left
  if store is not None:
    store.close()


@pytest.mark.slow  # compiles a training step (10 s); the store's twin below is slow too
def test_save_after_training_loads_in_tunix_as_trained(tmp_path):
  config = config_of("qwen3")
  source = write_checkpoint(tmp_path / "ckpt", "qwen3", config, hf_tensors("qwen3", config))
  model = offlax.load_safetensors(abstract_model("qwen3", config), source, progress=False)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss = lambda m: jnp.mean(logits(m, TOKENS) ** 2)
    optimizer.update(model, nnx.grad(loss)(model))

  step(model, optimizer)
  out = offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  np.testing.assert_array_equal(
    logits_of(tunix_loaded("qwen3", config, out), TOKENS), logits_of(model, TOKENS)
  )


def test_save_refuses_a_folder_with_files_unless_overwrite(tmp_path):
  config = config_of("llama3")
  source = write_checkpoint(tmp_path / "ckpt", "llama3", config, hf_tensors("llama3", config))
  model = offlax.load_safetensors(abstract_model("llama3", config), source, progress=False)
  out = tmp_path / "out"
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  with pytest.raises(offlax.errors.CheckpointExistsError, match="overwrite=True"):
    offlax.save_safetensors(model, str(out), progress=False)
  assert os.listdir(out) == ["notes.txt"]
  offlax.save_safetensors(model, str(out), overwrite=True, progress=False)
  assert "notes.txt" not in os.listdir(out)
  assert_same_tensors(str(out), source)


def test_a_save_that_fails_midway_leaves_no_checkpoint(tmp_path, monkeypatch):
  from offlax._src.hf import files

  config = config_of("llama3")
  source = write_checkpoint(tmp_path / "ckpt", "llama3", config, hf_tensors("llama3", config))
  model = offlax.load_safetensors(abstract_model("llama3", config), source, progress=False)
  write, written = files.Writer.write, []

  def failing(self, name, x):
    if len(written) == 5:
      raise OSError(28, "No space left on device")
    written.append(name)
    write(self, name, x)

  monkeypatch.setattr(files.Writer, "write", failing)
  with pytest.raises(OSError, match="No space"):
    offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # neither the folder nor its temporary


def test_save_of_a_model_never_loaded_needs_a_source(tmp_path):
  model = abstract_model("llama3", config_of("llama3"))
  with pytest.raises(offlax.errors.InvalidOptionError, match="source="):
    offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  assert not os.path.exists(tmp_path / "out")


# -- bad input ---------------------------------------------------------------------------------


def _bad(tmp_path, change, *, shards=2):
  """A Llama3 checkpoint with `change(tensors, folder)` applied."""
  config = config_of("llama3")
  tensors = hf_tensors("llama3", config)
  folder = str(tmp_path / "ckpt")
  change(tensors, None)
  write_checkpoint(folder, "llama3", config, tensors, shards)
  change(None, folder)
  return folder


def _drop(tensors, folder):
  if tensors is not None:
    del tensors["model.layers.1.mlp.up_proj.weight"]


def _extra(tensors, folder):
  if tensors is not None:
    tensors["vision_tower.patch_embedding.weight"] = np.zeros((4, 4), np.float32)


def _shape(tensors, folder):
  if tensors is not None:
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 32), np.float32)


def _dtype(tensors, folder):
  if tensors is not None:
    tensors["model.norm.weight"] = np.ones(32, np.int32)


def _truncate(tensors, folder):
  if folder is not None:
    name = os.path.join(folder, "model-00002-of-00002.safetensors")
    os.truncate(name, os.path.getsize(name) - 100)


def _lose_shard(tensors, folder):
  if folder is not None:
    os.remove(os.path.join(folder, "model-00001-of-00002.safetensors"))


def _config(tensors, folder):
  if folder is not None:
    name = os.path.join(folder, "config.json")
    with open(name) as f:
      hf = json.load(f)
    with open(name, "w") as f:
      json.dump(hf | {"num_hidden_layers": 3, "hidden_size": 48}, f)


BAD = {
  "missing tensor": (_drop, offlax.errors.CheckpointMismatchError,
                     r"no tensor for the model's params layers\.1\.mlp\.up_proj\.kernel"),
  "unexpected tensor": (_extra, offlax.errors.CheckpointMismatchError,
                        r"does not: vision_tower\.patch_embedding\.weight.*skip="),
  "wrong shape": (_shape, offlax.errors.CheckpointMismatchError,
                  r"model\.layers\.0\.self_attn\.k_proj\.weight is \[24, 32\]"),
  "wrong dtype": (_dtype, offlax.errors.CheckpointMismatchError, r"model\.norm\.weight is I32"),
  "truncated file": (_truncate, offlax.errors.CheckpointCorruptedError,
                     r"model-00002-of-00002\.safetensors is cut short"),
  "missing shard": (_lose_shard, offlax.errors.CheckpointNotFoundError,
                    r"model-00001-of-00002\.safetensors is missing"),
  "config.json": (_config, offlax.errors.CheckpointMismatchError,
                  r"num_hidden_layers=3 \(the model's num_layers=2\), hidden_size=48"),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_checkpoint_is_refused_by_name_before_any_write(tmp_path, bad):
  change, error, message = BAD[bad]
  folder = _bad(tmp_path, change)
  config = config_of("llama3")
  model = offlax.offload_params(abstract_model("llama3", config))  # its layers in host memory
  before = jax.tree.map(lambda x: x, nnx.state(model, nnx.Param))
  with pytest.raises(error, match=message):
    offlax.load_safetensors(model, folder, progress=False)
  after = nnx.state(model, nnx.Param)  # still abstract: nothing was put
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(after))
  assert jax.tree.structure(after) == jax.tree.structure(before)


def test_cast_false_refuses_another_dtype(tmp_path):
  config = config_of("llama3")
  tensors = hf_tensors("llama3", config, ml_dtypes.bfloat16)
  folder = write_checkpoint(tmp_path / "ckpt", "llama3", config, tensors)
  model = abstract_model("llama3", config)
  with pytest.raises(
    offlax.errors.CheckpointMismatchError, match=r"is BF16, the param .* float32 \(cast"
  ):
    offlax.load_safetensors(model, folder, cast=False, progress=False)


def test_a_bad_checkpoint_leaves_a_store_untouched(tmp_path):
  config = config_of("llama3")
  good = write_checkpoint(tmp_path / "good", "llama3", config, hf_tensors("llama3", config))
  bad = _bad(tmp_path, _shape)
  model, store = stored_model(tmp_path, "llama3", config, optax.adam(1e-3))
  with store:
    offlax.load_safetensors(model, good, store=store, progress=False)
    files = {}
    for root, _, names in os.walk(store.path):
      for name in names:
        with open(os.path.join(root, name), "rb") as f:
          files[os.path.join(root, name)] = f.read()
    with pytest.raises(offlax.errors.CheckpointMismatchError, match="k_proj"):
      offlax.load_safetensors(model, bad, store=store, progress=False)
    for name, data in files.items():
      with open(name, "rb") as f:
        assert f.read() == data, name


def test_skip_loads_a_checkpoint_with_a_vision_tower(tmp_path):
  folder = _bad(tmp_path, _extra)
  model = abstract_model("llama3", config_of("llama3"))
  offlax.load_safetensors(model, folder, skip=[r"vision_tower\..*"], progress=False)
  assert not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))


def test_a_stored_model_loads_into_its_own_store_and_refuses_another(tmp_path):
  config = config_of("llama3")
  tensors = hf_tensors("llama3", config)
  folder = write_checkpoint(tmp_path / "ckpt", "llama3", config, tensors)
  model, store = stored_model(tmp_path, "llama3", config)
  # Another store with the same leaves: accepted before, and written while the model read its own.
  other = offlax.LayerStore.create(
    str(tmp_path / "other"),
    offlax.stack_layers(abstract_model("llama3", config).layers),
    progress=False,
  )
  with store, other:
    before = [np.array(x) for x in jax.tree.leaves(other.read_params())]
    snapshot = {os.path.join(r, n): open(os.path.join(r, n), "rb").read()
                for r, _, names in os.walk(other.path) for n in names}  # fmt: skip
    with pytest.raises(offlax.errors.InvalidOptionError, match="read the store at"):
      offlax.load_safetensors(model, folder, store=other, progress=False)
    for name, data in snapshot.items():
      assert open(name, "rb").read() == data, name
    for a, b in zip(before, jax.tree.leaves(other.read_params()), strict=True):
      np.testing.assert_array_equal(a, b)
    with pytest.raises(offlax.errors.InvalidOptionError, match="read the store at"):
      offlax.save_safetensors(model, str(tmp_path / "out"), source=folder, store=other,
                              progress=False)  # fmt: skip
    assert not os.path.exists(tmp_path / "out")
    offlax.load_safetensors(model, folder, progress=False)  # store=None: the model's own
    out = offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  assert_same_tensors(out, folder)


def test_a_model_of_another_library_needs_a_mapping(tmp_path):
  class Net(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

  folder = str(tmp_path / "ckpt")
  os.makedirs(folder)
  weights = {"dense.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
             "dense.bias": np.ones(3, np.float32)}  # fmt: skip
  safetensors_numpy.save_file(weights, os.path.join(folder, "model.safetensors"))
  with pytest.raises(offlax.errors.InvalidOptionError, match="mapping="):
    offlax.load_safetensors(Net(), folder, progress=False)
  mapping = {
    r"dense\.weight": ("dense.kernel", ((1, 0), None)),
    r"dense\.bias": ("dense.bias", None),
  }
  net = offlax.load_safetensors(Net(), folder, mapping=mapping, progress=False)
  np.testing.assert_array_equal(net.dense.kernel[...], weights["dense.weight"].T)
  out = offlax.save_safetensors(net, str(tmp_path / "out"), progress=False)
  assert_same_tensors(out, folder)


@pytest.mark.slow  # writes, loads and saves two checkpoints of 0.4 and 1.0 GB: about a minute
def test_ram_stays_flat_as_the_checkpoint_grows(tmp_path):
  """The benchmark's two depths of a Qwen3 (126 MB a layer) into a store and back out."""
  import importlib.util

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
    "safetensors_io", os.path.join(root, "benchmarks", "safetensors_io.py")
  )
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = bench.main(["--layers", "1", "5", "--dir", str(tmp_path), "--raw-gib", "0.25"])
  small, large = out["sizes"]
  assert large["checkpoint_bytes"] > 2 * small["checkpoint_bytes"]
  # The peak over the process's RSS before the load: the host params (embedding, head: 262 MB)
  # and what is in flight, whatever the depth: the head's 131 MB read and transposed, or a
  # layer's tensors read ahead, converted into their slots, queued for the writer, and one
  # buffer of each size kept for the next layer (together under a layer and 4 of the largest).
  assert out["load_rss_ratio"] < 1.15 and out["save_rss_ratio"] < 1.15, out
  largest = bench.VOCAB * bench.D * 2
  assert large["load_peak_rss_bytes"] < 2 * largest + large["layer_bytes"] + 4 * largest, large
  assert not os.listdir(tmp_path)  # the benchmark's folders removed


@pytest.mark.slow  # compiles a training step with the layers on disk
def test_save_from_a_trained_store_loads_in_tunix_as_trained(tmp_path):
  config = config_of("llama3")
  source = write_checkpoint(tmp_path / "ckpt", "llama3", config, hf_tensors("llama3", config))
  model, store = stored_model(tmp_path, "llama3", config, optax.sgd(0.1))
  with store:
    offlax.load_safetensors(model, source, store=store, progress=False)
    optimizer = nnx.Optimizer(model, offlax.offload(optax.sgd(0.1), compute="host"), wrt=nnx.Param)
    loss = lambda m: jnp.mean(logits(m, TOKENS) ** 2)
    grads = nnx.jit(nnx.grad(loss))(model)
    nnx.jit(lambda m, o, g: o.update(m, g))(model, optimizer, grads)
    store.update()
    out = offlax.save_safetensors(model, str(tmp_path / "out"), store=store, progress=False)
    trained = logits_of(model, TOKENS)
  loaded = offlax.offload_params(tunix_loaded("llama3", config, out))
  np.testing.assert_array_equal(logits_of(loaded, TOKENS), trained)
  with pytest.raises(AssertionError):  # trained: not the source's
    np.testing.assert_array_equal(
      logits_of(offlax.offload_params(tunix_loaded("llama3", config, source)), TOKENS), trained
    )


@pytest.mark.slow  # Tunix's PeftTrainer and a store's loop, each compiled: about a minute each
@pytest.mark.parametrize("store", [False, True])
def test_the_example_fine_tunes_a_checkpoint_it_makes(tmp_path, store):
  import importlib.util

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
    "finetune_pretrained", os.path.join(root, "examples", "finetune_pretrained.py")
  )
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  argv = ["--out", str(tmp_path / "out")] + (["--store", str(tmp_path / "store")] if store else [])
  result = example.main(argv)
  assert result["losses"][-1] < result["losses"][0] - 1.0  # it learns the counting
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
  source = safetensors_numpy.load_file(os.path.join(result["checkpoint"], "model.safetensors"))
  tuned = safetensors_numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
  assert {k: (v.dtype, v.shape) for k, v in tuned.items()} == {
    k: (v.dtype, v.shape) for k, v in source.items()
  }


@pytest.mark.slow  # compiles a third Gemma3
def test_gemma3_with_as_many_kv_heads_as_heads_stacks_q_k_v_as_tunix(tmp_path):
  """Tunix's Gemma3 fuses q, k and v into one `qkv_einsum` when the heads are all kv heads."""
  config = config_of("gemma3", num_kv_heads=4)
  folder = write_checkpoint(tmp_path / "ckpt", "gemma3", config, hf_tensors("gemma3", config))
  model = offlax.load_safetensors(abstract_model("gemma3", config), folder, progress=False)
  assert model.layers[0].attn.qkv_einsum.w.shape == (3, 4, 32, 8)
  want = tunix_loaded("gemma3", config, folder)
  np.testing.assert_array_equal(logits_of(model, TOKENS), logits_of(want, TOKENS))
  out = offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  assert_same_tensors(out, folder)


@pytest.mark.slow  # qwix traces the model to place its adapters
def test_lora_adapters_are_named_as_such(tmp_path):
  from tunix_inputs import with_lora

  config = config_of("llama3")
  source = write_checkpoint(tmp_path / "ckpt", "llama3", config, hf_tensors("llama3", config))
  model = with_lora(offlax.load_safetensors(abstract_model("llama3", config), source,
                                            progress=False))  # fmt: skip
  with pytest.raises(offlax.errors.CheckpointMismatchError, match="are LoRA adapters.*merge them"):
    # (qwix returns a new model: the source named, as for any model load_safetensors did not fill)
    offlax.save_safetensors(model, str(tmp_path / "out"), source=source, progress=False)
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow  # compiles a mixture-of-experts Qwen3
def test_qwen3_moe_experts_stack_into_their_params_as_tunix(tmp_path):
  config = config_of("qwen3", num_experts=4, num_experts_per_tok=2)
  tensors = hf_tensors("qwen3", config)
  rng = np.random.default_rng(1)
  for i in range(LAYERS):
    p = f"model.layers.{i}.mlp."
    for kind in ("gate", "up", "down"):
      del tensors[p + f"{kind}_proj.weight"]
    tensors[p + "gate.weight"] = rng.standard_normal((4, 32)).astype(np.float32)
    for e in range(4):
      for kind, shape in (("gate", (64, 32)), ("up", (64, 32)), ("down", (32, 64))):
        tensors[p + f"experts.{e}.{kind}_proj.weight"] = (rng.standard_normal(shape) * 0.3).astype(
          np.float32
        )
  folder = write_checkpoint(tmp_path / "ckpt", "qwen3", config, tensors, shards=2)
  model = offlax.load_safetensors(abstract_model("qwen3", config), folder, progress=False)
  assert model.layers[0].mlp.gate_proj.shape == (4, 32, 64)
  want = tunix_loaded("qwen3", config, folder)
  np.testing.assert_array_equal(logits_of(model, TOKENS), logits_of(want, TOKENS))
  out = offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  assert_same_tensors(out, folder)


def _linear_checkpoint(tmp_path):
  """A `nnx.Linear` model loaded from a one-tensor-each checkpoint with a config and tokenizer."""

  class Net(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

  folder = str(tmp_path / "ckpt")
  os.makedirs(folder)
  weights = {"dense.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
             "dense.bias": np.ones(3, np.float32)}  # fmt: skip
  safetensors_numpy.save_file(weights, os.path.join(folder, "model.safetensors"))
  for name in ("config.json", "tokenizer.json"):
    with open(os.path.join(folder, name), "w") as f:
      f.write("{}")
  mapping = {
    r"dense\.weight": ("dense.kernel", ((1, 0), None)),
    r"dense\.bias": ("dense.bias", None),
  }
  return offlax.load_safetensors(Net(), folder, mapping=mapping, progress=False), folder


def test_save_fsyncs_every_file_and_the_folder_before_the_rename(tmp_path, monkeypatch):
  net, folder = _linear_checkpoint(tmp_path)
  out = str(tmp_path / "out")
  events: list[tuple[str, str]] = []
  real_fsync, real_rename = os.fsync, os.rename
  monkeypatch.setattr(
    os,
    "fsync",
    lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1],
  )
  monkeypatch.setattr(os, "rename", lambda a, b: (
    events.append(("rename", f"{a} {b}")), real_rename(a, b))[1])  # fmt: skip
  offlax.save_safetensors(net, out, max_shard_bytes=20, progress=False)  # two shards
  ((i, (_, names)),) = [(i, e) for i, e in enumerate(events) if e[0] == "rename"]
  tmp = names.split()[0]
  before = {name for kind, name in events[:i] if kind == "fsync"}
  want = {os.path.join(tmp, n) for n in os.listdir(out)} | {tmp}
  assert len(want) == 6  # two shards, the index, config.json, tokenizer.json and the folder
  assert want <= before, sorted(want - before)
  assert ("fsync", str(tmp_path)) in events[i + 1 :]  # the parent, after the rename
  assert_same_tensors(out, folder)


def test_save_cleans_up_after_a_killed_save(tmp_path):
  net, folder = _linear_checkpoint(tmp_path)
  out = str(tmp_path / "out")
  offlax.save_safetensors(net, out, progress=False)
  want = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
  # Killed between its renames: the old checkpoint aside, nothing at `out`, a finished temp folder.
  os.rename(out, str(tmp_path / ".out.abcd1234.old"))
  os.makedirs(tmp_path / ".out.zz_9zz99.tmp")
  os.makedirs(tmp_path / ".other.abcd1234.tmp")  # not this save's: left alone
  os.makedirs(tmp_path / ".out.notours.tmp")
  with pytest.raises(offlax.errors.CheckpointExistsError):  # the old checkpoint is back at `out`
    offlax.save_safetensors(net, out, progress=False)
  assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == want
  assert sorted(os.listdir(tmp_path)) == [".other.abcd1234.tmp", ".out.notours.tmp", "ckpt", "out"]
  offlax.save_safetensors(net, out, overwrite=True, progress=False)
  assert_same_tensors(out, folder)
  assert sorted(os.listdir(tmp_path)) == [".other.abcd1234.tmp", ".out.notours.tmp", "ckpt", "out"]


class _Mixed(nnx.Module):
  """A float32 and an int8 param."""

  def __init__(self):
    self.w = nnx.Param(jnp.zeros((2, 3), jnp.float32))
    self.n = nnx.Param(jnp.zeros((4,), jnp.int8))


def test_a_float8_tensor_is_cast_and_an_integer_one_never_narrowed(tmp_path):
  folder = str(tmp_path / "ckpt")
  os.makedirs(folder)
  w = np.array([[0.5, -1.0, 2.0], [3.5, 0.25, -448.0]], ml_dtypes.float8_e4m3fn)
  n = np.array([1, 2, 300, -7], np.int32)  # 300 wraps to 44 in int8
  safetensors_numpy.save_file({"w": w, "n": n}, os.path.join(folder, "model.safetensors"))
  mapping = {r"w": ("w", None), r"n": ("n", None)}
  with pytest.raises(
    offlax.errors.CheckpointMismatchError, match=r"tensor n is I32, the param n is int8"
  ):
    offlax.load_safetensors(_Mixed(), folder, mapping=mapping, progress=False)
  n8 = np.array([1, 2, 44, -7], np.int8)  # the same dtype: loaded as it is
  safetensors_numpy.save_file({"w": w, "n": n8}, os.path.join(folder, "model.safetensors"))
  model = offlax.load_safetensors(_Mixed(), folder, mapping=mapping, progress=False)
  np.testing.assert_array_equal(model.w[...], w.astype(np.float32))
  np.testing.assert_array_equal(model.n[...], n8)


@pytest.mark.parametrize(
  "header, named",
  [
    ({"w": {"dtype": "F32", "data_offsets": [0, 24]}}, "tensor w of"),  # no shape
    ({"w": {"dtype": "F32", "shape": [2, 3]}}, "tensor w of"),  # no data_offsets
    ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": ["0", 24]}}, "tensor w of"),
    ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0.0, 24.0]}}, "tensor w of"),
    ({"w": {"dtype": "F32", "shape": 6, "data_offsets": [0, 24]}}, "tensor w of"),
    ({"w": [2, 3]}, "tensor w of"),
    ([["w", {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}]],
     r"model\.safetensors's header is a JSON list"),
  ],
)  # fmt: skip
def test_a_damaged_header_entry_is_refused_as_corrupted_naming_the_tensor(tmp_path, header, named):
  folder = tmp_path / "ckpt"
  folder.mkdir()
  raw = json.dumps(header).encode()
  name = folder / "model.safetensors"
  name.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(24))
  want = named if "header" in named else rf"{named} .*model\.safetensors has a damaged header"
  with pytest.raises(offlax.errors.CheckpointCorruptedError, match=want):
    offlax.load_safetensors(_Mixed(), str(folder), mapping={r"w": ("w", None)}, progress=False)


def test_a_load_interrupted_at_the_store_commit_leaves_the_model_as_it_was(tmp_path, monkeypatch):
  from offlax._src.layer_store import rewrite as rewrite_lib

  config = config_of("llama3")
  folder = write_checkpoint(tmp_path / "ckpt", "llama3", config, hf_tensors("llama3", config))
  model, store = stored_model(tmp_path, "llama3", config)

  def interrupted(*args):
    raise KeyboardInterrupt

  monkeypatch.setattr(rewrite_lib.Rewrite, "commit", interrupted)
  with store:
    with pytest.raises(KeyboardInterrupt):
      offlax.load_safetensors(model, folder, progress=False)
    # The params outside the store were read before the commit; none was set.
    concrete = [
      jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))
      if not isinstance(x, jax.ShapeDtypeStruct)
    ]  # fmt: skip
    assert concrete == [f"['layers'][{i}]['_offlax_token'].value" for i in range(LAYERS)]


def test_a_load_failing_at_its_last_tensor_leaves_the_values_as_they_were(tmp_path, monkeypatch):
  from offlax._src.hf import files as files_lib

  config = config_of("llama3")
  a = write_checkpoint(tmp_path / "a", "llama3", config, hf_tensors("llama3", config))
  b = write_checkpoint(tmp_path / "b", "llama3", config, hf_tensors("llama3", config, seed=1))
  model = offlax.load_safetensors(abstract_model("llama3", config), a, progress=False)
  before = [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
  read, count = files_lib.read, [0]
  total = sum(1 for _ in jax.tree.leaves(nnx.state(model, nnx.Param)))

  def failing(t, *args):
    count[0] += 1
    if count[0] == total:
      raise OSError("the disk went away")
    return read(t, *args)

  monkeypatch.setattr(files_lib, "read", failing)
  with pytest.raises(OSError, match="went away"):
    offlax.load_safetensors(model, b, progress=False)
  for x, y in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
  "native",
  # The native case builds offlax's library when it is the session's first user (15 s).
  [pytest.param(True, marks=pytest.mark.slow), False],
  ids=["native", "numpy"],
)
def test_the_transpose_is_numpys_bit_for_bit(native, monkeypatch):
  """Every item size, ragged tile edges, and matrices large enough for the native kernel and for
  threads (bands of rows)."""
  from offlax._src import ffi
  from offlax._src.hf import mapping as mapping_lib

  if native:
    assert ffi.library() is not None, "offlax's native library did not build (see the log)"
  else:
    monkeypatch.setattr(ffi, "library", lambda: None)
  rng = np.random.default_rng(0)
  shapes = [(0, 3), (1, 1), (1, 300), (300, 1), (7, 9), (129, 33), (257, 1000), (700, 997)]
  shapes += [(1500, 1300)]  # 3.9 MB of bf16 on one thread, 7.8 of fp32 on bands of rows
  for dtype in (np.uint8, ml_dtypes.bfloat16, np.float16, np.float32, np.int64):
    for shape in shapes:
      x = rng.integers(0, 255, shape).astype(dtype)
      got = mapping_lib.transpose(x, (1, 0))
      assert got.dtype == x.dtype and got.flags.c_contiguous
      np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(x.T).view(np.uint8))
  x = rng.integers(0, 255, (2, 3, 4)).astype(np.float32)  # other ranks: numpy's own
  np.testing.assert_array_equal(mapping_lib.transpose(x, (2, 0, 1)), x.transpose(2, 0, 1))


def test_the_writer_puts_large_tensors_by_direct_io_at_any_offset(tmp_path):
  """Tensors of 1 MiB and more at offsets in every phase of the block: their whole blocks by direct
  I/O (from `empty`'s arrays as they are, from others copied), their ends by the page cache."""
  from offlax._src.hf import files as files_lib
  from offlax._src.nvme import direct_io

  rng = np.random.default_rng(0)
  tensors = {  # sizes not whole blocks, so the offsets after them fall mid-block
    "a": rng.standard_normal(3, np.float32),
    "b": rng.integers(0, 255, (1029, 1031)).astype(np.uint8),
    "c": rng.standard_normal((513, 515)).astype(ml_dtypes.bfloat16),
    "d": rng.standard_normal((300, 1000)).astype(np.float32),
    "e": rng.standard_normal(5, np.float32),
  }
  layout = [(n, x.dtype, x.shape) for n, x in tensors.items()]
  writer = files_lib.Writer(str(tmp_path), layout, 2**30, {"format": "pt"})
  assert len({writer.places[n][2] % 4096 for n in tensors}) == len(tensors)  # every phase differs
  assert (writer.direct[0] is not None) == direct_io.supports_direct(str(tmp_path))
  for name, x in tensors.items():
    if name == "c":  # made in the writer's own array
      into = writer.empty(name)
      into[...] = x
      x = into
    writer.write(name, x)
  writer.finish()
  got = safetensors_numpy.load_file(str(tmp_path / "model.safetensors"))
  assert sorted(got) == sorted(tensors)
  for name, x in tensors.items():
    assert got[name].dtype == x.dtype and got[name].tobytes() == x.tobytes(), name


@pytest.mark.parametrize("optimizer", [False, True], ids=["params", "adam"])
def test_megabyte_tensors_load_into_a_store_and_save_back_exactly(tmp_path, monkeypatch, optimizer):
  """Tensors of 1 MiB and more take the fast paths: direct reads into buffers used again, leaves
  converted into slots that later layers use again (after the optimizer's init reads them),
  direct writes. numpy's transposes (the native one: test_the_transpose_is_numpys_bit_for_bit)."""
  from offlax._src import ffi

  monkeypatch.setattr(ffi, "library", lambda: None)
  d, n = 512, 3  # 1 MiB a kernel of fp32

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(d, d, rngs=rngs)

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([Block(rngs) for _ in range(n)])
      self.head = nnx.Linear(d, d + 3, rngs=rngs)  # 1 MiB and a bit: its ends mid-block

  rng = np.random.default_rng(0)
  tensors = {"head.weight": rng.standard_normal((d + 3, d), np.float32),
             "head.bias": rng.standard_normal(d + 3, np.float32)}  # fmt: skip
  for i in range(n):
    tensors[f"layers.{i}.weight"] = rng.standard_normal((d, d), np.float32)
    tensors[f"layers.{i}.bias"] = rng.standard_normal(d, np.float32)
  folder = str(tmp_path / "ckpt")
  os.makedirs(folder)
  safetensors_numpy.save_file(tensors, os.path.join(folder, "model.safetensors"))
  mapping = {
    r"layers\.([0-9]+)\.weight": (r"layers.\1.lin.kernel", ((1, 0), None)),
    r"layers\.([0-9]+)\.bias": (r"layers.\1.lin.bias", None),
    r"head\.weight": ("head.kernel", ((1, 0), None)),
    r"head\.bias": ("head.bias", None),
  }
  model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
  tx = offlax.master_weights(optax.adam(1e-3)) if optimizer else None
  with offlax.LayerStore.create(str(tmp_path / "store"), offlax.stack_layers(model.layers),
                                optimizer=tx, progress=False) as store:  # fmt: skip
    offlax.offload_params(model, store=store)
    offlax.load_safetensors(model, folder, mapping=mapping, check_config=False, progress=False)
    params = store.read_params()
    for i in range(n):
      np.testing.assert_array_equal(params["lin"]["kernel"][i], tensors[f"layers.{i}.weight"].T)
      np.testing.assert_array_equal(params["lin"]["bias"][i], tensors[f"layers.{i}.bias"])
    if optimizer:  # the fp32 master of each layer: its own values, not a later layer's
      assert any(np.array_equal(x, params["lin"]["kernel"]) for x in jax.tree.leaves(
        store.read_state()))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(model.head.kernel[...]), tensors["head.weight"].T)
    out = offlax.save_safetensors(model, str(tmp_path / "out"), progress=False)
  assert_same_tensors(out, folder)
