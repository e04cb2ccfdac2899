"""``model: s3://bucket/prefix/`` against a real S3 protocol server (moto on 127.0.0.1, through the
fault proxy): the first start downloads (parallel ranged GETs, one per part of a multipart object)
and verifies, a restart sends no GET or HEAD for any object, a corrupted object is refused and
leaves nothing in the cache, and the engine's greedy tokens equal those of the same checkpoint
loaded from its local (sharded) directory. Also: pickles-only checkpoints are refused."""

import hashlib
import os
import random
import threading
from pathlib import Path

import pytest

from adapters_store.s3_source import S3Config
from app.engine.config import EngineConfig
from app.engine.factory import build_engine
from app.model.node_cache import ModelSourceError
from app.model.s3_checkpoint import S3ModelConfig, fetch_checkpoint
from app.model.source import resolve_model
from app.protocol import GenerateRequest, SamplingParams
from app.serving.config import ConfigError, parse_args
from tests.support.fault_proxy import Fault
from tests.support.helpers import run_to_completion

pytest_plugins = ["tests.support.s3_fixtures"]  # fixture: s3

PART = 64 << 10  # multipart part size of the big shard (moto's 5 MiB minimum is lowered for the test)
ENGINE = EngineConfig(num_kv_blocks=64, block_size=8, max_loras=2)


@pytest.fixture(scope="module")
def sharded(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny random Llama saved as sharded safetensors (an index and several shards)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(out, max_shard_size="200KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) >= 3
    return out


@pytest.fixture
def env(s3, tmp_path, monkeypatch):
    """The replicas' view: boto3 finds the endpoint in AWS_ENDPOINT_URL_S3, the cache is fresh."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.proxy.url)
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("moto.s3.models.S3_UPLOAD_PART_MIN_SIZE", 1024)
    s3.proxy.state.fault = None
    return s3


def upload(s3, bucket: str, prefix: str, local: Path, extra: dict[str, bytes] | None = None) -> str:
    """Upload local's files; the largest shard as a multipart upload of PART-byte parts."""
    s3.bucket(bucket)
    files = sorted(f for f in local.iterdir() if f.is_file())
    big = biggest_shard(local)
    for f in files:
        key = f"{prefix}/{f.name}"
        if f == big:
            _multipart(s3.client, bucket, key, f.read_bytes())
        else:
            s3.client.put_object(Bucket=bucket, Key=key, Body=f.read_bytes())
    for name, data in (extra or {}).items():
        s3.client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    return f"s3://{bucket}/{prefix}/"


def biggest_shard(local: Path) -> Path:
    return max(sorted(local.glob("*.safetensors")), key=lambda f: f.stat().st_size)


def _multipart(client, bucket: str, key: str, data: bytes) -> None:
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = [
        {
            "PartNumber": n,
            "ETag": client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=data[start : start + PART]
            )["ETag"],
        }
        for n, start in enumerate(range(0, len(data), PART), 1)
    ]
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})


def object_requests(s3, bucket: str, prefix: str, method: str, name: str = "") -> int:
    """Requests for objects under s3://bucket/prefix/ (ListObjects goes to /bucket: not counted)."""
    path = f"/{bucket}/{prefix}/{name}"
    with s3.proxy.state.lock:
        return sum(1 for m, p in s3.proxy.state.requests if m == method and p.split("?")[0].startswith(path))


def greedy(engine, prompts) -> dict[str, list[int]]:
    reqs = [
        GenerateRequest(f"p{i}", tuple(p), SamplingParams(max_tokens=24, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    tokens, reasons, _ = run_to_completion(engine, {0: reqs})
    assert set(reasons.values()) == {"length"}
    return tokens


def leftovers(cache: Path) -> list[str]:
    """Files in the cache other than the per-entry lock files."""
    return [str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_s3_model_downloads_once_verifies_and_generates_as_the_local_directory(env, sharded, tmp_path):
    junk = {"pytorch_model.bin": b"\x80\x02pickle", "README.md": b"# tiny", "original/consolidated.pth": b"x"}
    uri = upload(env, "models", "llama/tiny", sharded, junk)
    big = biggest_shard(sharded)

    engine = build_engine(uri, ENGINE, tokenizer=None)
    entry = resolve_model(uri)  # the cached copy the engine loaded (no download now: see below)
    assert entry.is_relative_to(tmp_path / "cache" / "models" / "s3" / "models" / "llama" / "tiny")
    assert sorted(p.name for p in entry.iterdir()) == sorted(f.name for f in sharded.iterdir() if f.is_file())
    for f in sharded.iterdir():
        assert (entry / f.name).read_bytes() == f.read_bytes(), f.name
    parts = -(-big.stat().st_size // PART)
    assert parts > 1 and object_requests(env, "models", "llama/tiny", "GET", big.name) == parts  # one GET per part
    assert object_requests(env, "models", "llama/tiny", "GET", "pytorch_model.bin") == 0  # never fetched
    assert object_requests(env, "models", "llama/tiny", "GET", "original/") == 0

    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    local = build_engine(sharded, ENGINE, tokenizer=None)
    from_s3, from_dir = greedy(engine, prompts), greedy(local, prompts)
    assert from_s3 == from_dir
    assert len({tuple(t) for t in from_dir.values()}) > 1, "the random model should not answer every prompt alike"

    # A restart (a new engine on the same node): the listing only, not one GET or HEAD of an object.
    with env.proxy.state.lock:
        env.proxy.state.requests.clear()
    restarted = build_engine(uri, ENGINE, tokenizer=None)
    assert object_requests(env, "models", "llama/tiny", "GET") == 0
    assert object_requests(env, "models", "llama/tiny", "HEAD") == 0
    assert any(m == "GET" and p.startswith("/models?") for m, p in env.proxy.state.requests)  # it did list
    assert greedy(restarted, prompts) == from_dir


def test_the_ingress_reads_config_and_tokenizer_only(env, sharded, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from app.openai.ingress import load_model_files

    words = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, 320)}}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    with_tokenizer = tmp_path / "with-tokenizer"
    with_tokenizer.mkdir()
    for f in sharded.iterdir():
        (with_tokenizer / f.name).write_bytes(f.read_bytes())
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(with_tokenizer)
    uri = upload(env, "ingress", "tiny", with_tokenizer)

    tokenizer, config = load_model_files(uri)
    assert tokenizer("w3 w14 w159")["input_ids"] == [3, 14, 159] and config.max_position_embeddings == 512
    assert object_requests(env, "ingress", "tiny", "GET", "tokenizer.json") == 1
    assert object_requests(env, "ingress", "tiny", "GET", "model-") == 0  # no weights


def test_single_part_objects_are_fetched_by_ranges_and_verified(env, sharded, tmp_path):
    uri = upload(env, "ranges", "tiny", sharded)
    cfg = S3ModelConfig(S3Config(endpoint_url=env.proxy.url), range_bytes=50_000, workers=4, root=tmp_path / "r")
    entry = fetch_checkpoint(uri, cfg=cfg)
    small = min(sharded.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    assert object_requests(env, "ranges", "tiny", "GET", small.name) == -(-small.stat().st_size // 50_000) > 1
    assert (entry / small.name).read_bytes() == small.read_bytes()


@pytest.mark.parametrize("which", ["multipart", "single-part", "ranged"])
def test_a_corrupted_download_is_refused_and_nothing_is_cached(env, sharded, tmp_path, which):
    uri = upload(env, f"corrupt-{which}", "tiny", sharded)
    small = min(sorted(sharded.glob("*.safetensors")), key=lambda f: f.stat().st_size)
    target, why = {
        "multipart": (biggest_shard(sharded), "multipart ETag mismatch"),
        "ranged": (small, "MD5 mismatch"),
        # one GET of the whole object: moto sends its CRC32, which boto3 checks first
        "single-part": (small, "(MD5 mismatch|Expected checksum .* did not match)"),
    }[which]
    cfg = S3ModelConfig(
        S3Config(endpoint_url=env.proxy.url, max_attempts=1),
        root=tmp_path / "c",
        range_bytes=50_000 if which == "ranged" else 64 << 20,
    )
    env.proxy.state.fault = Fault("corrupt", times=1, suffix=target.name)  # one byte flipped in transit
    with pytest.raises(ModelSourceError, match=f"{target.name} failed verification: {why}.*nothing was cached"):
        fetch_checkpoint(uri, cfg=cfg)
    assert leftovers(tmp_path / "c") == []
    entry = fetch_checkpoint(uri, cfg=cfg)  # the next start downloads it whole
    assert (entry / target.name).read_bytes() == target.read_bytes()


def test_an_object_corrupted_at_rest_is_refused_by_the_sha256_manifest(env, sharded):
    manifest = "".join(
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in sorted(sharded.iterdir()) if f.is_file()
    )
    uri = upload(env, "at-rest", "tiny", sharded, {"SHA256SUMS": manifest.encode()})
    shard = min(sharded.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    env.client.put_object(Bucket="at-rest", Key=f"tiny/{shard.name}", Body=bytes(data))  # its ETag is its own MD5
    with pytest.raises(ModelSourceError, match=f"{shard.name} failed verification: SHA256 mismatch"):
        build_engine(uri, ENGINE, tokenizer=None)
    assert leftovers(Path(os.environ["LORAPLEX_CACHE"])) == []


def test_replicas_of_one_node_download_once(env, sharded):
    uri = upload(env, "once", "tiny", sharded)
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(uri))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert object_requests(env, "once", "tiny", "GET", "config.json") == 1


def test_checkpoints_that_are_no_safetensors_checkpoint_are_refused(env, tmp_path, sharded):
    env.bucket("refused")
    env.client.put_object(Bucket="refused", Key="pickled/config.json", Body=(sharded / "config.json").read_bytes())
    env.client.put_object(Bucket="refused", Key="pickled/pytorch_model.bin", Body=b"\x80\x02")
    with pytest.raises(
        ModelSourceError,
        match="no \\*.safetensors weights at s3://refused/pickled/; "
        "pytorch_model.bin is a PyTorch pickle, which is never loaded",
    ):
        resolve_model("s3://refused/pickled/")
    with pytest.raises(ModelSourceError, match="no HF checkpoint at s3://refused/empty/: config.json not found"):
        resolve_model("s3://refused/empty/")
    with pytest.raises(ModelSourceError, match="s3://no-such-bucket/.* does not exist"):
        resolve_model("s3://no-such-bucket/x/")
    local = tmp_path / "pickled"
    local.mkdir()
    (local / "config.json").write_bytes((sharded / "config.json").read_bytes())
    (local / "pytorch_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(ModelSourceError, match="pytorch_model.bin is a PyTorch pickle, which is never loaded"):
        build_engine(local, ENGINE, tokenizer=None)
    with pytest.raises(ModelSourceError, match="no HF checkpoint at .*nowhere"):
        resolve_model(tmp_path / "nowhere")
    with pytest.raises(ModelSourceError, match="unsupported model location 'gs://b/m'"):
        resolve_model("gs://b/m")
    with pytest.raises(ConfigError, match="model: invalid S3 bucket name"):
        parse_args({"model": "s3://Bad_Bucket/m/"}, "x")


@pytest.mark.slow
def test_a_gguf_file_is_dequantized_once_into_the_cache(tmp_path, monkeypatch, default_model_dir):
    """The embedded model's GGUF given as `model:` equals the default checkpoint made from it."""
    from safetensors.torch import load_file

    from app.model.default import GGUF_FILE, gguf_dir

    gguf = Path(gguf_dir()) / GGUF_FILE
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path))
    entry = resolve_model(gguf)
    assert entry.parent == (tmp_path / "gguf").resolve() and entry.name.startswith(gguf.stem)
    assert sorted(p.name for p in entry.iterdir()) == sorted(p.name for p in default_model_dir.iterdir())
    got, want = load_file(entry / "model.safetensors"), load_file(default_model_dir / "model.safetensors")
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)

    def no_second_conversion(gguf, out):
        raise AssertionError("converted again")

    monkeypatch.setattr("app.model.gguf.write_checkpoint", no_second_conversion)
    assert resolve_model(gguf) == entry  # a restart reuses the cached conversion
