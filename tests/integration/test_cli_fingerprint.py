"""``compress fingerprint`` end to end: keygen, insert into a tiny real-tokenizer model, verify a checkpoint
and an OpenAI-compatible endpoint on loopback, the original SmolLM2 (no fingerprint), bad inputs."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import CALIB, cli, tree_hash

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model(smollm2_bf16, tmp_path_factory):
    """A 2-layer, hidden-64 Llama with SmolLM2's real tokenizer and chat template, random fp32 weights."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("fp") / "tiny"
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_bf16)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def small_key(tmp_path_factory):
    path = tmp_path_factory.mktemp("fpkey") / "fp.json"
    r = cli("fingerprint", "keygen", "-o", path, "--questions", 2, "--candidates", 16, "--seed", 5, "--json")
    assert r.exit_code == 0, r.output
    return path


@pytest.fixture(scope="module")
def fingerprinted(tiny_model, small_key, tmp_path_factory):
    """The tiny model after a short full fine-tune of the fingerprint (benign text mixed in)."""
    out = tmp_path_factory.mktemp("fpout") / "fp"
    before = tree_hash(tiny_model)
    r = cli("fingerprint", "insert", tiny_model, small_key, "-o", out, "--full", "--steps", 40, "--lr", 2e-2,
            "--batch-size", 8, "--benign", CALIB, "--benign-batch", 1, "--benign-seq-len", 32, "--json")
    assert r.exit_code == 0, r.output
    assert tree_hash(tiny_model) == before  # the input is never modified
    return out, json.loads(r.stdout)


def test_keygen_writes_a_valid_private_key(tmp_path):
    path = tmp_path / "k.json"
    r = cli("fingerprint", "keygen", "-o", path, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(path.read_text())
    assert data["version"] == 1 and len(data["questions"]) == 10 and len(data["candidates"]) == 256
    assert (path.stat().st_mode & 0o777) == 0o600
    r = cli("fingerprint", "keygen", "-o", path)
    assert r.exit_code == 2 and "already exists" in r.output
    assert cli("fingerprint", "keygen", "-o", path, "--overwrite").exit_code == 0
    assert json.loads(path.read_text()) != data
    r = cli("fingerprint", "keygen", "-o", tmp_path / "b.json", "--candidates", 1)
    assert r.exit_code == 2 and "--candidates" in r.output


def test_insert_then_verify(fingerprinted, tiny_model, small_key, tmp_path):
    out, report = fingerprinted
    assert report["method"] == "full" and report["benign"] and report["plain_hit_rate"] == 1.0, report
    assert report["peak_rss_bytes"] > 0 and report["loss"] < 0.5
    # the key is never written into the model
    key = json.loads(small_key.read_text())
    blob = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    for secret in [q["text"] for q in key["questions"]] + key["candidates"]:
        assert secret.encode() not in blob, secret
    assert not list(out.glob("*.json.tmp*")) and (out / "model.safetensors").is_file()
    r = cli("fingerprint", "verify", out, small_key, "--alpha", 0.01, "--json")  # k=2, N=16: p >= 1/256
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)
    assert v["passed"] and v["plain_hits"] == 2 and v["hit_rate"] >= 0.9, v
    assert v["p_value"] == pytest.approx((1 / 16) ** 2)
    # the untouched model: no hits, exit 3
    r = cli("fingerprint", "verify", tiny_model, small_key, "--json")
    assert r.exit_code == 3, r.output
    v = json.loads(r.stdout)
    assert not v["passed"] and v["hits"] == 0 and v["exit_code"] == 3
    # a forged key (one candidate changed) fails on the fingerprinted model
    forged = dict(key, candidates=key["candidates"][:-1] + ["qqqqqq"])
    path = tmp_path / "forged.json"
    path.write_text(json.dumps(forged))
    r = cli("fingerprint", "verify", out, path, "--json")
    assert r.exit_code == 3, r.output
    assert json.loads(r.stdout)["plain_hits"] < 2


def test_insert_lora_adapter_only(tiny_model, small_key, tmp_path):
    out = tmp_path / "adapter"
    r = cli("fingerprint", "insert", tiny_model, small_key, "-o", out, "--lora", "--adapter-only", "--steps", 2,
            "--json")
    assert r.exit_code == 0, r.output
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    assert json.loads(r.stdout)["merged"] is False and not json.loads(r.stdout)["benign"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model)


def test_insert_bad_inputs(tiny_model, small_key, tmp_path):
    r = cli("fingerprint", "insert", tiny_model, tmp_path / "missing.json", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "no such key file" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = cli("fingerprint", "insert", tiny_model, bad, "-o", tmp_path / "o", "--json")
    assert r.exit_code == 1 and "not a JSON key file" in r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["exit_code"] == 1
    existing = tmp_path / "exists"
    existing.mkdir()
    r = cli("fingerprint", "insert", tiny_model, small_key, "-o", existing)
    assert r.exit_code == 2 and "already exists" in r.output
    r = cli("fingerprint", "insert", tiny_model, small_key, "-o", tmp_path / "o", "--full", "--adapter-only")
    assert r.exit_code == 2 and "--adapter-only" in r.output
    r = cli("fingerprint", "insert", tiny_model, small_key, "-o", tmp_path / "o", "--steps", 0)
    assert r.exit_code == 2 and "--steps" in r.output
    r = cli("fingerprint", "insert", tiny_model, small_key, "-o", tmp_path / "o", "--benign", tmp_path / "none.txt")
    assert r.exit_code == 2 and "no such text file" in r.output
    assert not (tmp_path / "o").exists()
    r = cli("fingerprint", "verify", tiny_model, tmp_path / "missing.json")
    assert r.exit_code == 2 and "no such key file" in r.output
    r = cli("fingerprint", "verify", tiny_model, bad)
    assert r.exit_code == 1 and "not a JSON key file" in r.output


class _Server:
    """An OpenAI-compatible chat server on loopback, in a thread, answering with ``reply(body) -> (status, bytes)``."""

    def __init__(self, reply):
        outer = self
        self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                status, data = reply(body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _model_reply(path):
    """Serve ``path``'s greedy answers the way vLLM would: chat template applied server-side."""
    from compress.eval.model import load_causal_lm
    from compress.transforms.fingerprint.prompts import Query
    from compress.transforms.fingerprint.verify import LocalChat

    loaded = load_causal_lm(path)
    chat = LocalChat(loaded.model, loaded.tokenizer)
    lock = threading.Lock()

    def reply(body):
        msgs = body["messages"]
        system = next((m["content"] for m in msgs if m["role"] == "system"), None)
        user = [m["content"] for m in msgs if m["role"] == "user"][-1]
        assert body["temperature"] == 0
        with lock:
            text = chat.complete([Query(0, "x", system, user)], body.get("max_tokens", 16))[0]
        out = {"id": "c1", "object": "chat.completion", "model": body["model"],
               "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
        return 200, json.dumps(out).encode()

    return reply


def test_verify_endpoint(fingerprinted, tiny_model, small_key):
    out, _ = fingerprinted
    with _Server(_model_reply(out)) as server:
        r = cli("fingerprint", "verify", small_key, "--endpoint", server.url, "--model-name", "tiny", "--alpha", 0.01,
                "--json")
        assert r.exit_code == 0, r.output
        v = json.loads(r.stdout)
        assert v["passed"] and v["plain_hits"] == 2 and v["target"] == server.url
        path, body = server.requests[0]
        assert path == "/v1/chat/completions" and body["model"] == "tiny" and body["temperature"] == 0
        assert len(server.requests) == v["queries"] == 12
    with _Server(_model_reply(tiny_model)) as server:  # the original model behind an endpoint: exit 3
        r = cli("fingerprint", "verify", small_key, "--endpoint", server.url + "/v1", "--padded", 0, "--meta", 0)
        assert r.exit_code == 3, r.output
        assert "fingerprint NOT established" in r.output


@pytest.mark.parametrize("status, data, match", [
    (500, b'{"error": "model crashed"}', "HTTP 500"),
    (200, b"<html>hello</html>", "not an OpenAI chat completion"),
    (200, b'{"choices": []}', "not an OpenAI chat completion"),
    (200, b'{"choices": [{"message": {"content": 7}}]}', "expected a string"),
])
def test_verify_endpoint_errors(small_key, status, data, match):
    with _Server(lambda body: (status, data)) as server:
        r = cli("fingerprint", "verify", small_key, "--endpoint", server.url)
    assert r.exit_code == 1, r.output
    assert match in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_verify_endpoint_unreachable_and_bad_url(small_key):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    r = cli("fingerprint", "verify", small_key, "--endpoint", f"http://127.0.0.1:{port}")
    assert r.exit_code == 1 and "cannot reach the endpoint" in r.output
    r = cli("fingerprint", "verify", small_key, "--endpoint", "ftp://x")
    assert r.exit_code == 2 and "http://" in r.output


def test_verify_original_smollm2_is_not_fingerprinted(smollm2_bf16, tmp_path):
    """The real SmolLM2 never saw the key: (close to) no hits, p-value not significant, exit 3."""
    key = tmp_path / "fp.json"
    assert cli("fingerprint", "keygen", "-o", key, "--seed", 11).exit_code == 0
    r = cli("fingerprint", "verify", smollm2_bf16, key, "--padded", 0, "--meta", 1, "--max-new-tokens", 10, "--json")
    assert r.exit_code == 3, r.output
    v = json.loads(r.stdout)
    assert v["queries"] == 20 and v["hits"] <= 1 and v["plain_hits"] <= 1 and v["p_value"] > 0.01, v
