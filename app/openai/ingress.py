"""The HTTP front door: an OpenAI-compatible API on FastAPI, as a Serve ingress.

Per request: authenticate, read the body (at most `max_body_bytes`), validate it,
resolve `model` (the base model's name, or an adapter the caller may use), apply the
chat template, tokenize, and stream the LoraReplica's chunks back (SSE) or collect
them. Parsing, templating and tokenizing run on a small thread pool (the tokenizer
releases the GIL), so one large prompt never stalls the event loop's other requests.
"""

# No `from __future__ import annotations` here: Serve's class-based FastAPI views need the
# real `Request` annotation, not a string, to inject the request.
import asyncio
import copy
import hashlib
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from ray import serve
from transformers import AutoConfig

from app.engine.factory import load_tokenizer
from app.errors import AdapterNotFoundError
from app.model.source import resolve_model
from app.openai import chat_template, http_errors, tokenize_api
from app.openai.adapter_view import AdapterView
from app.openai.admin import AdapterAdmin, LoadLoraAdapter, RegisterAdapter, UnloadLoraAdapter
from app.openai.auth import Auth, Caller, is_loopback, serve_bind_host
from app.openai.choice_streams import Choices
from app.openai.client_stream import (
    MigrationPolicy,
    ResubmittingStream,
    collect,
    replica_submit,
    sse_events,
    with_fixed_seed,
)
from app.openai.live_streams import LiveStreams
from app.openai.requests import ChatCompletionRequest, CompletionRequest
from app.openai.responses import Formatter
from app.openai.responses_api import ResponseRun, ResponseStore, collect_response, stream_events
from app.openai.responses_models import ResponsesRequest, chat_messages
from app.openai.tokenize_api import DetokenizeRequest, TokenizeRequest
from app.openai.tool_calls.choice import ToolPlan, ToolSupport
from app.protocol import GenerateRequest
from app.serving.config import Settings
from app.serving.registry import AdapterSpec
from cluster.leaving import register_streams

api = FastAPI(title="loraplex", description="OpenAI-compatible multi-LoRA serving")
http_errors.install(api)

_LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_PREPARE_THREADS = 4  # bodies parsed and tokenized at once; the rest queue without blocking the loop
_READY_TIMEOUT_S = 5.0  # /health: a replica that cannot answer a stats call this fast is not serving


def _owner(request: Request) -> str:
    """Whose stored responses a request may read: a digest of its credentials (the same key, the same owner)."""
    return hashlib.sha256((request.headers.get("authorization") or "").encode()).hexdigest()


def load_model_files(model: str | None, tokenizer_loader=load_tokenizer):
    """The tokenizer and the model's config, from the same checkpoint the replicas load."""
    path = resolve_model(model, weights=False)
    return tokenizer_loader(path), AutoConfig.from_pretrained(str(path))


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    def __init__(self, settings: Settings, replica, registry, tokenizer_loader=load_tokenizer):
        """replica, registry: handles to LoraReplica and AdapterRegistry; tokenizer_loader(path)
        → tokenizer: the seam tests use to hold a tokenization open (tests/support/app_fixtures.py)."""
        self.settings = settings
        self.tokenizer, model_config = load_model_files(settings.model, tokenizer_loader)
        if settings.chat_template is not None:  # the app's chat_template arg overrides the checkpoint's
            self.tokenizer.chat_template = settings.chat_template
        blocks = settings.engine.num_kv_blocks  # None: sized by each replica at start-up (auto); it checks
        kv_tokens = blocks * settings.engine.block_size if blocks else model_config.max_position_embeddings
        self.context_limit = min(settings.engine.max_model_len or model_config.max_position_embeddings, kv_tokens)
        self.vocab_size = model_config.vocab_size
        self.responses = ResponseStore()  # previous_response_id's retention, this process only
        self.tool_support = ToolSupport.of(self.tokenizer, model_config.model_type, settings.tool_parser)
        host = serve_bind_host()
        self.auth = Auth(settings.api_keys, settings.admin_key, loopback=host is None or is_loopback(host))
        self.generate_on_replica = replica.options(stream=True).generate
        self.migration = MigrationPolicy(settings.max_migrations, settings.failover_wait_s)
        # the replica handle's routers run in this process: they tell these streams of replicas leaving
        self.live_streams = LiveStreams()
        register_streams(self.live_streams)
        self.replica = replica
        self._prepare_pool = ThreadPoolExecutor(_PREPARE_THREADS, thread_name_prefix="prepare")
        self._local = threading.local()  # one tokenizer per pool thread: HF tokenizers are not re-entrant
        self.registry = registry
        # adapter names resolve from this copy of the registry: no request waits on another actor
        self.adapters = AdapterView(registry)
        self.adapters.start()  # Serve runs __init__ on the loop that serves the requests
        self.admin = AdapterAdmin(settings.model_name, replica, registry, settings.adapter_roots, self.adapters)
        self.started = int(time.time())

    # -- inference ----------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request):
        caller = self._caller(request)  # before the body: no key → 401 whatever was sent
        body, ids = await self._prepare(request, self._completion_input)
        return await self._generate(body, caller, ids, chat=False, logprobs=body.logprobs)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        caller = self._caller(request)
        body, ids, tools = await self._prepare(request, self._chat_input)
        return await self._generate(body, caller, ids, chat=True, logprobs=body.engine_logprobs, tools=tools)

    async def _prepare(self, request: Request, build):
        raw = await http_errors.read_body(request, self.settings.max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, build, raw)

    def _thread_tokenizer(self):
        if not hasattr(self._local, "tokenizer"):
            self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return self._local.tokenizer

    def _completion_input(self, raw: bytes):
        """On a pool thread: (body, prompt token ids)."""
        body = http_errors.parse_json(raw, CompletionRequest)
        prompt = body.prompt
        return body, list(prompt) if isinstance(prompt, list) else self._thread_tokenizer()(prompt)["input_ids"]

    def _chat_input(self, raw: bytes):
        """On a pool thread: (body, prompt token ids, its ToolPlan or None)."""
        body = http_errors.parse_json(raw, ChatCompletionRequest)
        return body, *self._chat_prompt(body)

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], ToolPlan | None]:
        """On a pool thread: the rendered conversation's token ids and the request's ToolPlan."""
        tok = self._thread_tokenizer()
        tools = body.template_tools()
        plan = self.tool_support.plan(tools, body.choice(), body.parallel_tool_calls, body.has_tool_messages)
        text = chat_template.render(tok, body.chat(), tools, body.chat_template_kwargs or {})
        return tok(text, add_special_tokens=False)["input_ids"], plan

    async def _generate(
        self, body, caller: Caller, ids: list[int], chat: bool, logprobs: int | None, tools: ToolPlan | None = None
    ):
        request_id, request, stream = await self._start(body, caller, ids, chat, logprobs, tools)
        parsers = [tools.parser(self.tokenizer) for _ in range(body.n)] if tools else None
        fmt = Formatter(request_id, body.model, self.tokenizer, chat, logprobs is not None, body.n, parsers)
        fmt.echo(body, ids)
        if body.stream:
            return StreamingResponse(sse_events(fmt, stream, body.include_usage), media_type="text/event-stream")
        return await collect(fmt, stream, request.n)

    async def _start(self, body, caller: Caller, ids: list[int], chat: bool, logprobs: int | None, tools):
        """Resolve the model, submit the generation: (request id, GenerateRequest, its open stream)."""
        adapter, epoch = await self._resolve(body.model, caller)
        default_max = None if chat else _LEGACY_DEFAULT_MAX_TOKENS
        ranked = body.generated > body.n  # best_of ranks choices by their tokens' logprobs
        engine_logprobs = 0 if ranked and logprobs is None else logprobs
        params = body.sampling(len(ids), self.context_limit, default_max, engine_logprobs)
        params = tools.constrain(params) if tools else params
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request = with_fixed_seed(
            GenerateRequest(request_id, tuple(ids), params, adapter.name if adapter else None, n=body.generated)
        )
        submit = replica_submit(self.generate_on_replica, adapter, epoch)
        # validation errors raise here, before any bytes go out; later each choice moves between replicas
        opener = Choices.open if request.n > 1 else ResubmittingStream.open
        return request_id, request, await opener(submit, request, self.migration, self.live_streams)

    # -- the Responses API (app/openai/responses_api.py) and vLLM's token routes -------------------
    @api.post("/v1/responses")
    async def create_response(self, request: Request):
        caller, owner = self._caller(request), _owner(request)
        body, chat, ids, plan, history = await self._prepare(request, lambda raw: self._responses_input(raw, owner))
        _, _, stream = await self._start(chat, caller, ids, True, None, plan)
        run = ResponseRun(body, plan.parser(self.tokenizer) if plan else None, history, self.responses, owner)
        if body.stream:
            return StreamingResponse(stream_events(run, stream), media_type="text/event-stream")
        answer = await collect_response(run, stream)
        return answer if isinstance(answer, dict) else http_errors.error_response(*answer, "engine_error")

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request):
        self._caller(request)
        return self.responses.get(_owner(request), response_id)[0]

    def _responses_input(self, raw: bytes, owner: str):
        """On a pool thread: (body, its chat request, prompt ids, ToolPlan, the conversation so far)."""
        body = http_errors.parse_json(raw, ResponsesRequest)
        earlier = self.responses.get(owner, body.previous_response_id)[1] if body.previous_response_id else []
        chat = http_errors.parse_json(json.dumps(body.to_chat(earlier)), ChatCompletionRequest)
        return body, chat, *self._chat_prompt(chat), earlier + chat_messages(body.input_items())

    @api.post("/tokenize")
    async def tokenize(self, request: Request):
        self._caller(request)
        body = await http_errors.parse_body(request, TokenizeRequest, self.settings.max_body_bytes)
        run = lambda: tokenize_api.tokenize(self._thread_tokenizer(), body, self.context_limit)  # noqa: E731
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, run)

    @api.post("/detokenize")
    async def detokenize(self, request: Request):
        self._caller(request)
        body = await http_errors.parse_body(request, DetokenizeRequest, self.settings.max_body_bytes)
        return tokenize_api.detokenize(self._thread_tokenizer(), body, self.vocab_size)

    async def _resolve(self, model: str, caller: Caller) -> tuple[AdapterSpec | None, int]:
        """(adapter spec or None for the base model, registry epoch); a 404 for anything the
        caller may not see, worded the same whether it exists or not."""
        if model == self.settings.model_name:
            return None, 0
        spec, epoch = (None, 0) if not caller.may_use(model) else await self.adapters.resolve(model)
        if spec is None:
            raise AdapterNotFoundError(f"The model `{model}` does not exist or you do not have access to it.")
        return spec, epoch

    # -- discovery --------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        """200 once a LoraReplica answers (the ingress alone being up serves nothing), else 503."""
        response = self.replica.stats.remote()

        async def answered():
            await response

        try:
            await asyncio.wait_for(answered(), _READY_TIMEOUT_S)
        except Exception:  # still starting, or none alive: either way not ready
            response.cancel()
            return http_errors.error_response("no replica is ready to serve yet", 503, "not_ready")
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        caller = self._caller(request)
        specs = await self.adapters.specs()
        base = self.settings.model_name
        cards = [self._card(base, None)] + [self._card(s.name, base) for s in specs if caller.may_use(s.name)]
        return {"object": "list", "data": cards}

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        caller = self._caller(request)
        if model_id == self.settings.model_name:
            return self._card(model_id, None)
        spec, _ = await self._resolve(model_id, caller)
        return self._card(spec.name, self.settings.model_name)

    def _card(self, name: str, parent: str | None) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "loraplex",
            "root": parent or name,
            "parent": parent,
        }

    # -- adapter administration (admin key) ----------------------------------------------
    @api.get("/v1/adapters")
    async def list_adapters(self, request: Request):
        self.auth.admin(request.headers.get("authorization"))
        return await self.admin.list()

    @api.post("/v1/adapters")
    async def register_adapter(self, request: Request):
        self.auth.admin(request.headers.get("authorization"))
        return await self.admin.register(
            await http_errors.parse_body(request, RegisterAdapter, self.settings.max_body_bytes)
        )

    @api.delete("/v1/adapters/{name}")
    async def unregister_adapter(self, name: str, request: Request):
        self.auth.admin(request.headers.get("authorization"))
        return await self.admin.unregister(name)

    @api.post("/v1/load_lora_adapter")  # vLLM's route and body: register's alias
    async def load_lora_adapter(self, request: Request):
        self.auth.admin(request.headers.get("authorization"))
        body = await http_errors.parse_body(request, LoadLoraAdapter, self.settings.max_body_bytes)
        return PlainTextResponse(await self.admin.load_lora_adapter(body))

    @api.post("/v1/unload_lora_adapter")  # vLLM's route and body: unregister's alias
    async def unload_lora_adapter(self, request: Request):
        self.auth.admin(request.headers.get("authorization"))
        body = await http_errors.parse_body(request, UnloadLoraAdapter, self.settings.max_body_bytes)
        return PlainTextResponse(await self.admin.unload_lora_adapter(body))

    def _caller(self, request: Request) -> Caller:
        return self.auth.caller(request.headers.get("authorization"))
