"""Adapter names → loaded LoRA weights (local PEFT directories for now)."""
from __future__ import annotations

from pathlib import Path

from adapters_store.peft_weights import LoraWeights, ModelShape, load_local
from app.errors import AdapterNotFoundError, InvalidRequestError


class LocalAdapters:
    """Registered PEFT directories, loaded (and validated) once at registration."""

    def __init__(self, shape: ModelShape, max_rank: int):
        self.shape = shape
        self.max_rank = max_rank
        self._weights: dict[str, LoraWeights] = {}

    def register(self, name: str, path: str | Path) -> LoraWeights:
        if not name or "/" in name or name.startswith("."):
            raise InvalidRequestError(f"invalid adapter name {name!r}")
        weights = load_local(name, Path(path), self.max_rank, self.shape)
        self._weights[name] = weights
        return weights

    def unregister(self, name: str) -> None:
        if self._weights.pop(name, None) is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")

    def get(self, name: str) -> LoraWeights:
        try:
            return self._weights[name]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist") from None

    def names(self) -> list[str]:
        return sorted(self._weights)
