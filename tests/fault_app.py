"""The application `serve run`/`serve deploy` load in the config-change tests
(import_path `tests.fault_app:build_app`): the real app with every engine step slowed,
so that streams stay in flight while Serve replaces replicas."""
import time

from app.builder import app_from_args

STEP_DELAY_S = 0.12  # 200 decode steps ≈ 25 s: longer than Serve's default graceful shutdown (20 s)


def slowed_engine(settings):
    from app.replica import build_async_engine

    engine = build_async_engine(settings)
    step = engine.core.step

    def slow_step():
        time.sleep(STEP_DELAY_S)
        return step()

    engine.core.step = slow_step
    return engine


def build_app(args: dict):
    return app_from_args(args, engine_factory=slowed_engine)
