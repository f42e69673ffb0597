"""Black-box verification of a Chain & Hash fingerprint (arXiv 2407.10887, §3.3).

The answers are recomputed from the key file (a forged key selects other answers), every question
is asked plainly, with random padding and under held-out meta-prompts, with greedy decoding, and an
output is a hit when it contains the chosen answer (case-insensitive, after NFC).

Statistic: question i counts as recognised when its plain query hits. For a model that never saw
the key, the chosen answer is a uniformly random candidate (the hash acts as a random oracle) that
the model's fixed output contains with probability 1/N, so the number of recognised questions is
Binomial(k, 1/N); the p-value is its upper tail. The owner's decision: the hit rate over all
queries is at least ``threshold`` and the p-value at most ``alpha``.
"""

from __future__ import annotations

import json
import math
import os
import time
import unicodedata
import urllib.error
import urllib.request
from typing import Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field

from compress.errors import CompressError, ConfigError
from compress.transforms.fingerprint.key import FingerprintKey, load_key
from compress.transforms.fingerprint.prompts import VERIFY_META_PROMPTS, Query, read_meta_prompts, render_chat, \
    verification_queries


class EndpointError(CompressError):
    """A served endpoint failed or answered something that is not an OpenAI chat completion. Exit code 1."""


def binomial_sf(hits: int, n: int, p: float) -> float:
    """P(X >= hits) for X ~ Binomial(n, p), summed exactly term by term (float64).

    Args:
        hits: observed successes (0..n).
        n: trials.
        p: success probability of one trial, in [0, 1].
    """
    if hits <= 0:
        return 1.0
    if hits > n:
        return 0.0
    return min(1.0, sum(math.comb(n, j) * p ** j * (1.0 - p) ** (n - j) for j in range(hits, n + 1)))


def contains_answer(output: str, answer: str) -> bool:
    """Whether ``output`` contains ``answer`` (NFC, case-folded)."""
    norm = lambda s: unicodedata.normalize("NFC", s).casefold()  # noqa: E731
    return norm(answer) in norm(output)


class ChatBackend(Protocol):
    """Something that answers chat queries with greedy decoding."""

    name: str

    def complete(self, queries: list[Query], max_new_tokens: int) -> list[str]:
        """The greedy completion of every query, in order."""
        ...


class LocalChat:
    """A transformers model queried through its tokenizer's chat template, greedy, batched with left padding."""

    def __init__(self, model, tokenizer, name: str = "model", batch_size: int = 16):
        self.model, self.tokenizer, self.name, self.batch_size = model, tokenizer, name, batch_size

    def complete(self, queries: list[Query], max_new_tokens: int) -> list[str]:
        import torch

        tok = self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        device = next(self.model.parameters()).device
        outs: list[str] = []
        for start in range(0, len(queries), self.batch_size):
            texts = [render_chat(tok, q) for q in queries[start: start + self.batch_size]]
            ids = [tok(t, add_special_tokens=not getattr(tok, "chat_template", None))["input_ids"] for t in texts]
            width = max(len(x) for x in ids)
            input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)   # [b, L], left-padded
            mask = torch.zeros((len(ids), width), dtype=torch.long)              # [b, L]
            for r, x in enumerate(ids):
                input_ids[r, width - len(x):] = torch.tensor(x)
                mask[r, width - len(x):] = 1
            with torch.inference_mode():
                gen = self.model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                          max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                          pad_token_id=pad_id)                    # [b, L + new]
            outs.extend(tok.decode(row[width:], skip_special_tokens=True) for row in gen)
        return outs


class EndpointChat:
    """An OpenAI-compatible chat server (vLLM, TGI, llama.cpp): POST ``{url}/v1/chat/completions``, temperature 0.

    Args:
        url: server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        model_name: the ``model`` field of the request.
        timeout: seconds per request.
        api_key: sent as ``Authorization: Bearer`` when given (default: ``$OPENAI_API_KEY`` if set).
    """

    def __init__(self, url: str, model_name: str = "default", timeout: float = 60.0, api_key: Optional[str] = None):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--endpoint {url}: expected an http:// or https:// URL")
        root = url.rstrip("/")
        root = root[:-3] if root.endswith("/v1") else root
        self.url = root + "/v1/chat/completions"
        self.name, self.model_name, self.timeout = url, model_name, timeout
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")

    def _one(self, query: Query, max_new_tokens: int) -> str:
        body = json.dumps({"model": self.model_name, "messages": query.messages(), "temperature": 0,
                           "max_tokens": max_new_tokens, "stream": False}).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read(16 * 1024 * 1024)
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip().replace("\n", " ")
            raise EndpointError(f"{self.url}: HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise EndpointError(f"{self.url}: cannot reach the endpoint ({reason})") from None
        try:
            data = json.loads(raw)
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            head = raw[:80].decode("utf-8", "replace").replace("\n", " ")
            raise EndpointError(f"{self.url}: not an OpenAI chat completion (expected JSON with "
                                f"choices[0].message.content, got {head!r})") from None
        if content is None:
            return ""
        if not isinstance(content, str):
            raise EndpointError(f"{self.url}: choices[0].message.content is {type(content).__name__}, expected a string")
        return content

    def complete(self, queries: list[Query], max_new_tokens: int) -> list[str]:
        return [self._one(q, max_new_tokens) for q in queries]


class VerifyConfig(BaseModel):
    """Options of :func:`verify_fingerprint`.

    ``threshold``: smallest hit rate over all queries that counts as a match. ``alpha``: largest
    p-value that counts as a match. ``padded``/``meta``: queries per question of each kind.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    threshold: float = Field(0.5, ge=0.0, le=1.0)
    alpha: float = Field(1e-6, gt=0.0, le=1.0)
    padded: int = Field(2, ge=0, le=32)
    meta: int = Field(3, ge=0, le=32)
    max_new_tokens: int = Field(16, ge=1, le=512)
    seed: int = 0


class QueryResult(BaseModel):
    """One query and its outcome (the answer itself is not reported: the key is secret)."""

    question: int
    variant: str
    hit: bool


class VerifyResult(BaseModel):
    """Outcome of a verification.

    ``hit_rate``: hits / queries over every query. ``plain_hits``: questions whose plain query hit;
    ``p_value``: P(Binomial(k, 1/N) >= plain_hits). ``by_variant``: hit rate of each query kind.
    ``passed``: ``hit_rate >= threshold`` and ``p_value <= alpha``.
    """

    target: str
    questions: int
    candidates: int
    queries: int
    hits: int
    hit_rate: float
    by_variant: dict[str, float]
    plain_hits: int
    chance: float
    p_value: float
    threshold: float
    alpha: float
    passed: bool
    seconds: float
    results: list[QueryResult]


def verify_with(backend: ChatBackend, key: FingerprintKey, config: VerifyConfig = VerifyConfig(),
                meta_prompts: tuple[str, ...] = VERIFY_META_PROMPTS) -> VerifyResult:
    """Query ``backend`` with every question of ``key`` and score the answers against the chain.

    Returns:
        :class:`VerifyResult` (``passed`` False is not an error here; callers raise).
    """
    start = time.perf_counter()
    answers = key.answers()  # recomputed: a forged key gives different answers
    queries = verification_queries([q.text for q in key.questions], meta_prompts, config.padded, config.meta, config.seed)
    outputs = backend.complete(queries, config.max_new_tokens)
    results = [QueryResult(question=q.question, variant=q.variant, hit=contains_answer(o, answers[q.question]))
               for q, o in zip(queries, outputs)]
    hits = sum(r.hit for r in results)
    by_variant: dict[str, float] = {}
    for variant in ("plain", "padded", "meta"):
        rs = [r for r in results if r.variant == variant]
        if rs:
            by_variant[variant] = sum(r.hit for r in rs) / len(rs)
    k, n = len(key.questions), len(key.candidates)
    plain_hits = sum(r.hit for r in results if r.variant == "plain")
    p = binomial_sf(plain_hits, k, 1.0 / n)
    rate = hits / len(results)
    return VerifyResult(target=backend.name, questions=k, candidates=n, queries=len(results), hits=hits, hit_rate=rate,
                        by_variant=by_variant, plain_hits=plain_hits, chance=1.0 / n, p_value=p,
                        threshold=config.threshold, alpha=config.alpha,
                        passed=rate >= config.threshold and p <= config.alpha,
                        seconds=time.perf_counter() - start, results=results)


def verify_fingerprint(model: Optional[str], key_path: str | os.PathLike, config: VerifyConfig = VerifyConfig(), *,
                       endpoint: Optional[str] = None, model_name: str = "default",
                       meta_prompts: str | os.PathLike | None = None, dtype: Optional[str] = None,
                       device: str = "cpu") -> VerifyResult:
    """Verify a local checkpoint (``model``) or a served model (``endpoint``) against a key file.

    Args:
        model: any checkpoint :func:`compress.eval.model.load_causal_lm` loads; ignored with ``endpoint``.
        key_path: the owner's key file.
        endpoint: root URL of an OpenAI-compatible server.
        model_name: ``model`` field sent to the endpoint.
        meta_prompts: file of system prompts (one per line) for the meta queries.

    Returns:
        :class:`VerifyResult`; the caller turns ``passed`` False into exit 3.

    Raises:
        ConfigError, FormatError: bad key file, options or model; EndpointError: the server failed.
    """
    key = load_key(key_path)
    metas = read_meta_prompts(meta_prompts, VERIFY_META_PROMPTS)
    if endpoint is not None:
        backend: ChatBackend = EndpointChat(endpoint, model_name)
    else:
        if model is None:
            raise ConfigError("give a MODEL or --endpoint URL")
        from compress.eval.model import load_causal_lm

        loaded = load_causal_lm(model, dtype=dtype, device=device)
        backend = LocalChat(loaded.model, loaded.tokenizer, name=str(model))
    return verify_with(backend, key, config, metas)
