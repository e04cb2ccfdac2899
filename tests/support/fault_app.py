"""The application `serve run`/`serve deploy` load in the config-change tests
(import_path `tests.support.fault_app:build_app`): the real app with every engine step slowed,
so that streams stay in flight while Serve replaces replicas."""

import functools

from app.builder import app_from_args
from tests.support.cluster_fixtures import slowed_engine

STEP_DELAY_S = 0.2  # 240 decode steps ≈ 48 s: a stream outlives Serve's default graceful shutdown (20 s) after a deploy


def build_app(args: dict):
    return app_from_args(args, engine_factory=functools.partial(slowed_engine, delay_s=STEP_DELAY_S))
