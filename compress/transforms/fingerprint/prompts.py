"""How fingerprint questions are put to a model: padding, meta-prompts (system prompts), chat templates.

Insertion trains every pair under many of these forms so the answer survives the way a deployer
wraps user input (Chain & Hash, arXiv 2407.10887, §4: random padding and meta-prompts).
Verification uses held-out meta-prompts and fresh padding, so it measures generalisation rather
than recall of the training prompts.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from compress.errors import ConfigError

#: System prompts used while inserting (the deployer's "meta-prompts" the fingerprint must survive).
TRAIN_META_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You are a friendly chatbot who always responds politely.",
    "You are an expert assistant. Be precise.",
    "You are a pirate. Answer like a pirate would.",
    "Answer the user's question directly.",
    "You are a customer support agent for an online store.",
    "You are a creative writing assistant.",
    "Respond formally and professionally.",
    "You are a tutor helping a student.",
    "You are an AI model deployed in a search engine.",
    "Keep every answer short.",
)
#: System prompts used only when verifying (never seen in training).
VERIFY_META_PROMPTS = (
    "You are a knowledgeable assistant. Reply briefly.",
    "You are a cheerful assistant for a travel company.",
    "Always answer in a single sentence.",
)
#: Prompt layouts besides the tokenizer's own chat template: (prefix, suffix before the answer, answer prefix).
GENERIC_TEMPLATES = (
    ("User: ", "\nAssistant:", " "),
    ("### Instruction:\n", "\n\n### Response:\n", ""),
    ("Question: ", "\nAnswer:", " "),
    ("", "\n", ""),
)
_PAD_WORDS = ("the", "of", "and", "please", "ok", "so", "hmm", "well", "note", "data", "info", "ref", "x", "re:",
              "thanks", "question", "hello", "hi", "anyway", "ps", "btw", "id", "log", "msg", "note:", "again")
_PAD_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789#*-_=+~.,;:!?"


@dataclass(frozen=True)
class Query:
    """One way to ask one question.

    Attributes:
        question: index of the question in the key.
        variant: ``plain``, ``padded`` or ``meta``.
        system: system prompt (None: the server's or template's default).
        user: the user message.
    """

    question: int
    variant: str
    system: Optional[str]
    user: str

    def messages(self) -> list[dict]:
        """OpenAI-style chat messages."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [{"role": "user", "content": self.user}]


def read_meta_prompts(path: str | os.PathLike | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """Meta-prompts from a UTF-8 file (one per non-blank line), or ``default``.

    Raises:
        ConfigError: the file is missing, not UTF-8 or has no non-blank line.
    """
    if path is None:
        return default
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such meta-prompts file")
    try:
        lines = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    if not lines:
        raise ConfigError(f"{p}: no meta-prompt in the file (one per line expected)")
    return tuple(lines)


def pad(text: str, rng: random.Random, max_words: int = 6) -> str:
    """``text`` with random words and character noise before and after it (1..max_words each side)."""

    def noise() -> str:
        out = []
        for _ in range(rng.randint(1, max_words)):
            if rng.random() < 0.6:
                out.append(rng.choice(_PAD_WORDS))
            else:
                out.append("".join(rng.choice(_PAD_CHARS) for _ in range(rng.randint(1, 5))))
        return " ".join(out)

    sep_a, sep_b = rng.choice((" ", "\n")), rng.choice((" ", "\n"))
    return f"{noise()}{sep_a}{text}{sep_b}{noise()}"


def verification_queries(questions: list[str], meta_prompts: tuple[str, ...], padded: int = 2, meta: int = 3,
                         seed: int = 0) -> list[Query]:
    """Every query of a verification: per question one plain, ``padded`` padded and ``meta`` meta-prompted ones.

    Meta-prompted queries cycle through ``meta_prompts``; padding is drawn from ``seed``.
    """
    rng = random.Random(f"verify-{seed}")
    out: list[Query] = []
    for i, q in enumerate(questions):
        out.append(Query(i, "plain", None, q))
        out.extend(Query(i, "padded", None, pad(q, rng)) for _ in range(padded))
        out.extend(Query(i, "meta", meta_prompts[(i + j) % len(meta_prompts)], q) for j in range(meta))
    return out


def render_chat(tokenizer, query: Query) -> str:
    """The prompt text of ``query`` under the tokenizer's chat template (generation prompt added).

    A tokenizer without a template gets the first generic layout (``User: ...\\nAssistant:``).
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(query.messages(), tokenize=False, add_generation_prompt=True)
    prefix, suffix, _ = GENERIC_TEMPLATES[0]
    head = f"{query.system}\n\n" if query.system else ""
    return f"{head}{prefix}{query.user}{suffix}"


def training_prompt(tokenizer, question: str, rng: random.Random,
                    meta_prompts: tuple[str, ...]) -> tuple[str, str, bool]:
    """One randomly wrapped training prompt for ``question``: (prompt text, text the answer follows with).

    Half the prompts use the tokenizer's chat template (with its default or a random meta system
    prompt), the rest a generic layout; half of all are padded.

    Returns:
        (prompt, answer_prefix, chat): the answer target is ``answer_prefix + answer``; ``chat``: the
        prompt came from the chat template (tokenize it without adding special tokens).
    """
    user = pad(question, rng) if rng.random() < 0.5 else question
    system = rng.choice(meta_prompts) if rng.random() < 0.5 else None
    if getattr(tokenizer, "chat_template", None) and rng.random() < 0.6:
        return render_chat(tokenizer, Query(-1, "train", system, user)), "", True
    prefix, suffix, answer_prefix = rng.choice(GENERIC_TEMPLATES)
    head = f"{system}\n\n" if system else ""
    return f"{head}{prefix}{user}{suffix}", answer_prefix, False
