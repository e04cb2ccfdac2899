"""A GGUF file as an HF checkpoint directory: transformers + gguf dequantize it once; the
result (config.json, model.safetensors, tokenizer files) is what the engine and the HF
reference both load."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file


def is_converted(entry: Path) -> bool:
    """Whether a cached conversion still holds its weights (it is published whole; this catches later damage)."""
    return (entry / "model.safetensors").is_file()


def write_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantize gguf into out (an existing, empty directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF loader marks the model as quantized (so save_pretrained refuses),
    # although the weights are already dequantized: write the files ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    skip = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in skip}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
