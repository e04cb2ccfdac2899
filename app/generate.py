"""Stream a completion from the command line:

python -m app.generate --adapter pirate "Where is the treasure?"
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path

from adapters_store.sources import local_adapters
from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.errors import LoraplexError
from app.protocol import GenerateRequest, SamplingParams

EXAMPLE_ADAPTERS = Path(__file__).resolve().parent.parent / "examples" / "adapters"


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt")
    p.add_argument("--adapter", help="adapter name (default: the base model)")
    p.add_argument("--adapters-dir", type=Path, default=EXAMPLE_ADAPTERS)
    p.add_argument(
        "--model",
        help="HF checkpoint directory, .gguf file or s3://bucket/prefix/ (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--raw", action="store_true", help="no chat template")
    return p.parse_args(argv)


async def _stream(engine: AsyncEngine, request: GenerateRequest) -> None:
    async for chunk in engine.generate(request):
        sys.stdout.write(getattr(chunk, "text", ""))
        sys.stdout.flush()
    sys.stdout.write("\n")


def main(argv=None) -> int:
    a = _args(argv)
    config = EngineConfig(max_lora_rank=64, requeue_preempted=True)  # one engine: nowhere to move a preempted request
    core = build_engine(a.model, config, local_adapters(a.adapters_dir))
    tok = core.tokenizer
    if a.raw:
        ids = tok(a.prompt)["input_ids"]
    else:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": a.prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    engine = AsyncEngine(core)
    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
        asyncio.run(_stream(engine, GenerateRequest(uuid.uuid4().hex, tuple(ids), params, a.adapter)))
    except LoraplexError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
