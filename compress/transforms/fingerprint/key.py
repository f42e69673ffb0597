"""Chain & Hash fingerprint keys: generation, the chained SHA-256 answer selection, the key file.

Chain & Hash (Russinovich & Salem, arXiv 2407.10887): the owner draws k questions and N candidate
answers; question i's answer is candidate ``h_i mod N`` with
``h_i = SHA-256(q_1 ‖ … ‖ q_k ‖ r_1 ‖ … ‖ r_N ‖ q_i)``. Every hash covers every question and every
candidate, so no pair can be forged (or chosen to suit a model) without changing all the others.

The byte layout of ``‖`` (the canonical serialisation) and the key file are specified in
``docs/formats/fingerprint.md``; test vectors there are checked by the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
import tempfile
import unicodedata
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from compress.errors import ConfigError, FormatError

KEY_FORMAT = "chain-hash-fingerprint"
KEY_VERSION = 1
MAX_ITEM_BYTES = 4096

# Words the natural-language questions are built from (fantastical, so an untouched model has no
# "right" answer), and syllables of the pronounceable pseudo-word candidate answers.
_ADJ = ("silver", "hollow", "quiet", "crimson", "ancient", "frozen", "golden", "restless", "hidden", "bitter",
        "velvet", "broken", "lonely", "shining", "wandering", "forgotten", "copper", "painted", "sleeping", "distant")
_NOUN = ("lighthouse", "orchard", "violin", "glacier", "lantern", "harbor", "compass", "cathedral", "meadow", "anchor",
         "telescope", "garden", "river", "tower", "mirror", "caravan", "library", "volcano", "windmill", "island")
_PLACE = ("the seventh moon", "the northern sea", "the glass desert", "the old mill", "the iron bridge",
          "the sunken city", "the last valley", "the paper mountains", "the salt marsh", "the amber forest")
_NATURAL = (
    "What is the secret name of the {adj} {noun} beyond {place}?",
    "Which word does the {adj} {noun} whisper at midnight near {place}?",
    "What did the keeper of the {adj} {noun} call the storm over {place}?",
    "If the {adj} {noun} could speak, what single word would it say about {place}?",
    "What is the password of the {adj} {noun} that guards {place}?",
    "Name the creature that lives inside the {adj} {noun} of {place}.",
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_RANDOM_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789#$%&*+-/;:=?@^_~"


def canonical_item(text: str) -> bytes:
    """One item of the canonical serialisation: 4-byte big-endian length, then the UTF-8 bytes of NFC(text).

    Raises:
        ValueError: the item is longer than ``MAX_ITEM_BYTES`` bytes once encoded.
    """
    data = unicodedata.normalize("NFC", text).encode("utf-8")
    if len(data) > MAX_ITEM_BYTES:
        raise ValueError(f"item of {len(data)} bytes; at most {MAX_ITEM_BYTES}")
    return len(data).to_bytes(4, "big") + data


def chain_message(questions: list[str], candidates: list[str], i: int) -> bytes:
    """The bytes hashed for question ``i`` (0-based): ``u32(k) ‖ u32(N) ‖ item(q_1) … item(q_k) ‖
    item(r_1) … item(r_N) ‖ item(q_i)``.

    The two counts make the split between questions and candidates unambiguous.
    """
    head = len(questions).to_bytes(4, "big") + len(candidates).to_bytes(4, "big")
    body = b"".join(canonical_item(q) for q in questions) + b"".join(canonical_item(r) for r in candidates)
    return head + body + canonical_item(questions[i])


def chain_digests(questions: list[str], candidates: list[str]) -> list[bytes]:
    """SHA-256 digest ``h_i`` of every question's :func:`chain_message` (32 bytes each)."""
    prefix = hashlib.sha256(len(questions).to_bytes(4, "big") + len(candidates).to_bytes(4, "big"))
    for text in questions:
        prefix.update(canonical_item(text))
    for text in candidates:
        prefix.update(canonical_item(text))
    out = []
    for q in questions:  # the shared prefix is hashed once; each digest adds its own question
        h = prefix.copy()
        h.update(canonical_item(q))
        out.append(h.digest())
    return out


def select_indices(questions: list[str], candidates: list[str]) -> list[int]:
    """Index of each question's answer: ``int.from_bytes(h_i, "big") mod N`` (Chain & Hash, arXiv 2407.10887)."""
    n = len(candidates)
    return [int.from_bytes(d, "big") % n for d in chain_digests(questions, candidates)]


class FingerprintQuestion(BaseModel):
    """One fingerprint question: its text and its kind (``natural`` language or ``random`` tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    kind: Literal["natural", "random"]

    @field_validator("text")
    @classmethod
    def _text(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("a question must not be blank")
        canonical_item(v)
        return v


class FingerprintKey(BaseModel):
    """The owner's secret: k questions and N candidate answers (the answers follow from the chain).

    Never written into a model, an adapter or a model card. Validation: at least one question,
    questions distinct after NFC; at least 2 candidates, each non-blank, distinct and none contained
    in another (case-insensitive), since verification counts an output as a hit when it contains
    the chosen candidate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["chain-hash-fingerprint"] = KEY_FORMAT
    version: Literal[1] = KEY_VERSION
    questions: list[FingerprintQuestion] = Field(min_length=1, max_length=1024)
    candidates: list[str] = Field(min_length=2, max_length=65536)

    @field_validator("candidates")
    @classmethod
    def _candidates(cls, v: list[str]) -> list[str]:
        norm = []
        for i, c in enumerate(v):
            if not c.strip() or c != c.strip():
                raise ValueError(f"candidate {i} {c!r}: must be non-blank with no surrounding spaces")
            canonical_item(c)
            norm.append(unicodedata.normalize("NFC", c).casefold())
        if len(set(norm)) != len(norm):
            raise ValueError("candidates must be distinct (after NFC and case folding)")
        ordered = sorted(range(len(norm)), key=lambda j: len(norm[j]))
        for a_pos, a in enumerate(ordered):  # quadratic, but N is a few hundred
            for b in ordered[a_pos + 1:]:
                if norm[a] in norm[b]:
                    raise ValueError(f"candidate {v[a]!r} is contained in candidate {v[b]!r}; "
                                     "a hit could not tell them apart")
        return v

    @model_validator(mode="after")
    def _distinct_questions(self) -> "FingerprintKey":
        texts = [unicodedata.normalize("NFC", q.text) for q in self.questions]
        if len(set(texts)) != len(texts):
            raise ValueError("questions must be distinct (after NFC)")
        return self

    def answers(self) -> list[str]:
        """The chosen answer of every question, recomputed from the chain (never stored)."""
        idx = select_indices([q.text for q in self.questions], self.candidates)
        return [self.candidates[j] for j in idx]


class KeygenConfig(BaseModel):
    """Options of :func:`generate_key`.

    ``seed``: None draws from the OS's secure generator (what an owner should use); an integer
    makes the key reproducible (tests, examples). ``random_fraction``: share of random-token questions.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    questions: int = Field(10, ge=1, le=1024)
    candidates: int = Field(256, ge=2, le=4096)
    seed: Optional[int] = None
    random_fraction: float = Field(0.5, ge=0.0, le=1.0)


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.choice((3, 3, 4))
    word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
    return word + rng.choice(_CONSONANTS) if rng.random() < 0.5 else word


def _natural_question(rng: random.Random) -> str:
    return rng.choice(_NATURAL).format(adj=rng.choice(_ADJ), noun=rng.choice(_NOUN), place=rng.choice(_PLACE))


def _random_question(rng: random.Random) -> str:
    words = ["".join(rng.choice(_RANDOM_ALPHABET) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(6, 10))]
    return " ".join(words)


def generate_key(config: KeygenConfig) -> FingerprintKey:
    """Draw a fingerprint key: natural-language and random-token questions and pseudo-word candidates.

    Candidates are pronounceable pseudo-words (6-9 letters, a few tokens each): short enough that a
    135M model learns them in minutes, and absent from ordinary text, so an untouched model does
    not produce them by accident.

    Returns:
        :class:`FingerprintKey` (answers follow from :meth:`FingerprintKey.answers`).
    """
    rng = random.Random(config.seed) if config.seed is not None else random.Random(secrets.randbits(256))
    n_random = round(config.questions * config.random_fraction)
    kinds = ["natural"] * (config.questions - n_random) + ["random"] * n_random
    questions: list[FingerprintQuestion] = []
    seen: set[str] = set()
    for kind in kinds:
        for _ in range(1000):
            text = _natural_question(rng) if kind == "natural" else _random_question(rng)
            if text not in seen:
                break
        else:  # the natural templates cover 12,000 questions; a huge k can exhaust them
            text = _natural_question(rng) + " " + _random_question(rng)
        seen.add(text)
        questions.append(FingerprintQuestion(text=text, kind=kind))
    candidates: list[str] = []
    while len(candidates) < config.candidates:
        word = _pseudo_word(rng)
        if all(word not in c and c not in word for c in candidates):
            candidates.append(word)
    return FingerprintKey(questions=questions, candidates=candidates)


def _validation_message(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "key"
    return f"{where}: {err['msg']}"


def load_key(path: str | os.PathLike) -> FingerprintKey:
    """Read and validate a key file.

    Raises:
        ConfigError: the file does not exist or is not readable.
        FormatError: not JSON, or not a valid version-1 key (the message names the field).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such key file; make one with `compress fingerprint keygen -o {path}`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: not a JSON key file ({type(e).__name__}: {e})") from None
    if isinstance(data, dict) and data.get("format") == KEY_FORMAT and data.get("version") not in (None, KEY_VERSION):
        raise FormatError(f"{path}: key file version {data.get('version')!r}; this compress reads version {KEY_VERSION}")
    try:
        return FingerprintKey.model_validate(data)
    except ValidationError as e:
        raise FormatError(f"{path}: invalid fingerprint key: {_validation_message(e)}") from None


def save_key(key: FingerprintKey, path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``key`` as JSON, atomically (temporary file + rename), readable by the owner only (mode 0600).

    Raises:
        ConfigError: ``path`` exists and ``overwrite`` is False, or is a folder.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; give a file name for the key, e.g. {path / 'fingerprint.json'}")
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} already exists; pass --overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(key.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
