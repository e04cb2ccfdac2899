"""The engine's written interface (app/engine/interface.py): both engines, both cores and both
models satisfy it, by name and by signature; typed stats keep their JSON form."""

import inspect

import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.engine_stats import EngineReport, EngineStats
from app.engine.factory import build_engine
from app.engine.interface import Core, Engine, Model
from app.engine.process_engine import ProcessEngine
from app.engine.tp.model import TensorParallelModel
from app.model.llama import LlamaModel
from benchmarks.simulated_engine import SimulatedCore, StepTime


def _members(protocol) -> tuple[list[str], list[str]]:
    """(methods and properties, data attributes) the protocol declares."""
    methods = [
        n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    ]
    return methods, [n for n in protocol.__annotations__ if not n.startswith("_")]


def _assert_implements(cls, protocol) -> None:
    """Each of the protocol's methods exists on cls with the same parameters (cls may add optional ones)."""
    methods, _ = _members(protocol)
    for name in methods:
        declared, given = getattr(protocol, name), getattr(cls, name, None)
        assert given is not None, f"{cls.__name__} lacks {name}"
        if isinstance(declared, property):
            assert isinstance(given, property), f"{cls.__name__}.{name} is not a property"
            continue
        want = list(inspect.signature(declared).parameters.values())
        have = list(inspect.signature(given).parameters.values())
        assert [(p.name, p.kind) for p in have[: len(want)]] == [(p.name, p.kind) for p in want], (cls, name)
        assert all(p.default is not p.empty or p.kind is p.VAR_POSITIONAL for p in have[len(want) :]), (cls, name)


@pytest.mark.parametrize("cls", [AsyncEngine, ProcessEngine])
def test_both_engines_have_the_engine_interface(cls):
    _assert_implements(cls, Engine)


@pytest.mark.parametrize("cls", [EngineCore, SimulatedCore])
def test_both_cores_have_the_core_interface(cls):
    _assert_implements(cls, Core)


@pytest.mark.parametrize("cls", [LlamaModel, TensorParallelModel])
def test_both_models_have_the_model_interface(cls):
    _assert_implements(cls, Model)


def test_instances_satisfy_the_protocols(tiny_model_dir):
    config = EngineConfig(num_kv_blocks=16, block_size=4)
    cores = [SimulatedCore(config, StepTime(0.0)), build_engine(tiny_model_dir, config, tokenizer=None)]
    for core in cores:
        assert isinstance(core, Core)
        if isinstance(core, EngineCore):  # the simulated core has no model
            assert isinstance(core.model, Model) and core.model.broken is None
        engine = AsyncEngine(core)
        try:
            assert isinstance(engine, Engine)
            report = engine.stats().result(timeout=30)
            assert isinstance(report, EngineReport) and report.stats.total_kv_blocks == 16
            stats, _ = engine.metrics_sample()
            assert isinstance(stats, EngineStats) and engine.failure() is None
        finally:
            engine.shutdown()


def test_stats_keep_their_json_form():
    stats = EngineStats(1, 2, 8, 10, 16, resident_adapters=("a",), prefix_heads=("h",))
    d = EngineReport(stats, ("a", "b")).to_dict()
    assert d["running"] == 1 and d["free_kv_blocks"] == 10 and d["resident_adapters"] == ["a"]
    assert d["adapters"] == ["a", "b"] and "adapter_store" not in d and "kv_cache" not in d
    assert EngineReport(stats, (), {"tiers": {}}).to_dict()["adapter_store"] == {"tiers": {}}
