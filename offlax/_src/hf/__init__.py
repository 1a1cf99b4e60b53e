"""Hugging Face safetensors checkpoints: `load_safetensors`, `save_safetensors` (issue 42)."""
