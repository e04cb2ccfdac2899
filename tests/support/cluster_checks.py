"""What the cluster tests compare against and drive streams with: each request alone on an
uninterrupted float64 engine (the reference), one client's view of a stream, replica submission."""

import ray
import torch

from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.openai.client_stream import MigrationPolicy, ResubmittingStream, with_fixed_seed
from app.openai.live_streams import LiveStreams
from app.protocol import GenerateRequest, SamplingParams, TokenChunk
from cluster.leaving import register_streams
from tests.support.app_fixtures import wait_for
from tests.support.cluster_fixtures import replica_ids, replica_report

ADAPTERS = ("a1", "a2")
POLICY = MigrationPolicy(max_migrations=32, failover_wait_s=60)
_LIVE = LiveStreams()


def live_streams() -> LiveStreams:
    """The client streams of this test process, registered with its routers (as the ingress
    registers its own): the tests' streams move when their replica leaves."""
    register_streams(_LIVE)
    return _LIVE


class Reference:
    """Each request alone on one engine with room to spare: the uninterrupted output."""

    def __init__(self, model, adapters, block_size):
        paths = {n: str(adapters / n) for n in ADAPTERS}
        self.core = build_engine(
            model,
            EngineConfig(
                max_num_seqs=4,
                num_kv_blocks=512,
                block_size=block_size,
                max_model_len=256,
                max_loras=4,
                max_lora_rank=8,
                dtype=torch.float64,
            ),
            paths,
        )

    def __call__(self, request: GenerateRequest) -> list[TokenChunk]:
        self.core.add(request)
        out = []
        while self.core.has_work():
            out += [c for c in self.core.step() if isinstance(c, TokenChunk)]
        return out


def summary(chunks):
    tokens = [t for c in chunks for t in c.token_ids]
    last = chunks[-1]
    return (
        tokens,
        "".join(c.text for c in chunks),
        last.finish_reason,
        last.completion_tokens,
        [lp for c in chunks for lp in (c.logprobs or ())],
    )


def close_logprobs(a: dict, b: dict) -> bool:
    """One token's logprobs: same token and alternatives, values equal up to fp32 noise (a
    resumed request computes them in a prefill, the uninterrupted one in a decode step)."""
    return (
        a["token_id"] == b["token_id"]
        and abs(a["logprob"] - b["logprob"]) < 1e-4
        and [i for i, _ in a["top"]] == [i for i, _ in b["top"]]
        and all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a["top"], b["top"]))
    )


def assert_same(got, want, request_id):
    g, w = summary(got), summary(want)
    assert g[:4] == w[:4], request_id
    assert len(g[4]) == len(w[4]) and all(map(close_logprobs, g[4], w[4])), request_id


def submit_to(app, specs):
    from ray import serve

    handle = serve.get_deployment_handle("LoraReplica", app).options(stream=True).generate
    return lambda request: handle.remote(request, specs.get(request.adapter), 0)


async def client_stream(submit, request, on_chunk=None, policy=POLICY, leave_at=None):
    """The chunks one client sees; it hangs up after ``leave_at`` tokens if given."""
    stream = await ResubmittingStream.open(submit, request, policy, live_streams())
    chunks = []
    relay = stream.chunks()
    async for chunk in relay:
        chunks.append(chunk)
        if on_chunk:
            await on_chunk(stream, chunk)
        if leave_at is not None and len(stream.token_ids) >= leave_at:
            break
    await relay.aclose()
    return stream, chunks


def make_requests(n, rng, prompt_len, max_tokens, prefix="r"):
    out = []
    for i in range(n):
        greedy = i % 2 == 0
        params = SamplingParams(
            max_tokens=rng.randint(*max_tokens),
            temperature=0.0 if greedy else 0.9,
            top_p=1.0 if greedy else 0.9,
            seed=None if greedy else rng.randrange(2**31),
            logprobs=2 if i % 3 == 0 else None,
            stop=(" the", "ing") if i % 4 == 1 else (),
        )
        prompt = tuple(rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_len)))
        out.append(
            with_fixed_seed(GenerateRequest(f"{prefix}{i}", prompt, params, ADAPTERS[i % 3] if i % 3 < 2 else None))
        )
    return out


def idle(app):
    """Every replica answers (replacements have started): nothing running or waiting, every
    KV block free."""

    def check():
        try:
            reports = [replica_report(app, r) for r in replica_ids(app)]
        except ray.exceptions.RayError:  # a replacement still starting, or one just stopped
            return False
        return all(s.batch == 0 and s.free_kv_blocks == s.total_kv_blocks for s in reports) and reports

    return wait_for(check, timeout=90)
