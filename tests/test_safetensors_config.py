"""A Hugging Face config.json as the planner's model: `python -m offlax plan --hf-config FOLDER`.

No Tunix needed: the shapes come from the keys `transformers` writes.
"""

import json

import pytest

from offlax.__main__ import main
from offlax._src import errors, plan_models
from offlax._src.hf import config as hf_config

QWEN3_14B = {
  "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120, "intermediate_size": 17408,
  "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 8,
  "vocab_size": 151936, "head_dim": 128, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_plan_reads_a_checkpoint_folder_as_its_named_config(tmp_path, capsys):
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
  for model in (str(tmp_path), str(tmp_path / "config.json")):
    shape = plan_models.load(model, tokens=2048).model
    assert (shape.layers, shape.d, shape.ffn, shape.vocab, shape.heads, shape.kv_heads) == (
      40, 5120, 17408, 151936, 40, 8
    )  # fmt: skip
  assert (
    main(["plan", "--model", str(tmp_path), "--device-mem", "24GB", "--host-mem", "256GB"]) == 0
  )
  out = capsys.readouterr().out
  assert "40 layers, d 5120, ffn 17408, 40 heads (8 kv), vocab 151936: 14.77B params" in out


def test_a_multimodal_config_gives_its_language_model(tmp_path):
  config = {"architectures": ["Gemma3ForConditionalGeneration"],
            "vision_config": {"hidden_size": 1152},
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                            "num_attention_heads": 8, "num_hidden_layers": 34,
                            "num_key_value_heads": 4, "vocab_size": 262208}}  # fmt: skip
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert hf_config.planner_shapes(str(tmp_path)) == {
    "layers": 34, "d": 2560, "ffn": 10240, "vocab": 262208, "heads": 8, "kv_heads": 4
  }  # fmt: skip


def test_a_config_without_a_size_is_refused_naming_it(tmp_path):
  config = dict(QWEN3_14B)
  del config["intermediate_size"]
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(errors.InvalidOptionError, match=r"lack \['ffn'\]"):
    plan_models.load(str(tmp_path), tokens=2048)


def test_plan_hf_config_plans_the_checkpoint_as_its_named_tunix_config(tmp_path, capsys):
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
  mem = ["--device-mem", "24GB", "--host-mem", "128GB", "--nvme", "2TB", "--master"]
  for path in (str(tmp_path), str(tmp_path / "config.json")):
    assert main(["plan", "--hf-config", path, *mem]) == 0
    first, *plan = capsys.readouterr().out.splitlines()
    assert first == (
      f"shape: --hf-config {path}: 40 layers, d 5120, ffn 17408, 40 heads (8 kv), vocab 151936: "
      "14.77B params"
    )
    # The same plan as the shapes of Tunix's qwen3_14b, given as numbers.
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"layers": 40, "d": 5120, "ffn": 17408, "vocab": 151936,
                                  "heads": 40, "kv_heads": 8}))  # fmt: skip
    assert main(["plan", "--model", str(shapes), *mem]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == plan


@pytest.mark.parametrize(
  "extra, message",
  [(["--params", "7B"], "--hf-config and --params: give one"),
   (["--layers", "8"], "--hf-config and --layers: give one"),
   (["--model", "qwen3_14b"], "--hf-config and --model: give one")],
)  # fmt: skip
def test_plan_hf_config_refuses_another_shape_flag(tmp_path, capsys, extra, message):
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
  with pytest.raises(SystemExit) as e:
    main(["plan", "--hf-config", str(tmp_path), *extra, "--device-mem", "24GB",
          "--host-mem", "128GB"])  # fmt: skip
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_plan_hf_config_refuses_a_folder_without_config_json(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    main(["plan", "--hf-config", str(tmp_path), "--device-mem", "24GB", "--host-mem", "128GB"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"--hf-config {tmp_path}: not a Hugging Face checkpoint folder with a config.json" in err


QWEN3_30B_A3B = {
  "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
  "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
  "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "vocab_size": 151936, "head_dim": 128, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.parametrize(
  "change, key",
  [
    ({}, "num_experts"),  # Qwen3-30B-A3B, planned as a dense ~3B model before
    ({"num_experts": None, "num_local_experts": 8}, "num_local_experts"),  # Mixtral
    ({"num_experts": None, "moe_intermediate_size": None, "tie_word_embeddings": True},
     "tie_word_embeddings"),
    ({"num_experts": None, "moe_intermediate_size": None}, "num_attention_heads x head_dim"),
  ],
)  # fmt: skip
def test_a_config_the_planner_would_miscount_is_refused_naming_the_key(tmp_path, change, key):
  (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, **change}))
  with pytest.raises(errors.InvalidOptionError, match=key):
    plan_models.load(str(tmp_path), tokens=2048)
  with pytest.raises(errors.InvalidOptionError, match=key):
    hf_config.planner_shapes(str(tmp_path / "config.json"))
