"""A Hugging Face config.json as the planner's model: `python -m offlax plan --model FOLDER`.

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
