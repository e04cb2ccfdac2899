"""PEFT ``adapter_config.json`` → a validated, frozen manifest.

Only what we serve exactly is accepted; everything else is a clear
InvalidAdapterError (never a silent approximation).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from adapters_store.errors import InvalidAdapterError

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoint fuses q|k|v and gate|up, so its adapters name the fused modules; the weights
# check (peft_weights) narrows these to the base model's own names.
FUSED_TARGET_MODULES = ("qkv_proj", "gate_up_proj")


@dataclass(frozen=True)
class AdapterManifest:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None  # None: a regex in the config, resolved by the weights

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _reject_unsupported(cfg: dict) -> None:
    unsupported = [
        (cfg.get("peft_type", "LORA") != "LORA", f"peft_type {cfg.get('peft_type')!r} (only LORA)"),
        (cfg.get("use_dora"), "DoRA (use_dora=true)"),
        (cfg.get("bias", "none") != "none", f"bias={cfg.get('bias')!r} (only 'none')"),
        (cfg.get("modules_to_save"), "modules_to_save"),
        (cfg.get("rank_pattern"), "rank_pattern (per-module ranks)"),
        (cfg.get("alpha_pattern"), "alpha_pattern (per-module alphas)"),
        (cfg.get("fan_in_fan_out"), "fan_in_fan_out=true"),
        (cfg.get("layers_to_transform") is not None, "layers_to_transform"),
    ]
    for bad, what in unsupported:
        if bad:
            raise InvalidAdapterError(f"unsupported adapter feature: {what}")


def parse_manifest(raw: bytes | str, max_rank: int) -> AdapterManifest:
    try:
        cfg = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidAdapterError(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise InvalidAdapterError("adapter_config.json must hold a JSON object")
    _reject_unsupported(cfg)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidAdapterError(f"adapter rank r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise InvalidAdapterError(f"adapter rank {rank} exceeds the configured max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise InvalidAdapterError(f"lora_alpha={alpha!r} must be a number")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES + FUSED_TARGET_MODULES))
        if unknown:
            raise InvalidAdapterError(
                f"unknown target modules {unknown}; supported: {list(TARGET_MODULES + FUSED_TARGET_MODULES)}"
            )
        targets = tuple(targets)
    elif not isinstance(targets, str):
        raise InvalidAdapterError("target_modules must be a list of module names or a regex string")
    else:
        targets = None
    return AdapterManifest(rank, float(alpha), bool(cfg.get("use_rslora", False)), targets)
