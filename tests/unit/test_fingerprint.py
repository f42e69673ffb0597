"""Chain & Hash keys: the canonical serialisation, the spec's test vectors, forgery, p-values, key files."""

import hashlib
import json
import re
import stat
from pathlib import Path

import pytest

from compress.errors import ConfigError, FormatError
from compress.transforms.fingerprint import (FingerprintKey, KeygenConfig, binomial_sf, canonical_item, chain_digests,
                                             chain_message, contains_answer, generate_key, load_key, save_key,
                                             select_indices, verify_with)
from compress.transforms.fingerprint.prompts import VERIFY_META_PROMPTS, TRAIN_META_PROMPTS, pad, verification_queries

SPEC = Path(__file__).resolve().parents[2] / "docs" / "formats" / "fingerprint.md"
Q = ["What is the secret name of the silver lighthouse?", "Qx 7f ~zu"]
R = ["alpha", "bravo", "charlie", "delta"]


def _spec_hex(label: str) -> list[str]:
    """The 64-hex digests that follow ``label`` lines in the spec (in order)."""
    text = SPEC.read_text()
    return re.findall(rf"{label} = ([0-9a-f]{{64}})", text)


def test_canonical_item_layout_and_nfc():
    assert canonical_item("alpha") == b"\x00\x00\x00\x05alpha"
    assert canonical_item("Café") == canonical_item("Cafe\u0301") == bytes.fromhex("00000005436166c3a9")
    assert canonical_item("") == b"\x00\x00\x00\x00"
    with pytest.raises(ValueError):
        canonical_item("x" * 4097)


def test_message_matches_spec_hex():
    text = SPEC.read_text()
    block = text.split("M_0 (hex) = ", 1)[1].split("h_0 =", 1)[0]
    spec_bytes = bytes.fromhex("".join(block.split()))
    assert chain_message(Q, R, 0) == spec_bytes
    assert hashlib.sha256(spec_bytes).hexdigest() == _spec_hex("h_0")[0]


def test_chain_test_vectors():
    h0, h0_forged = _spec_hex("h_0")
    h1, h1_forged = _spec_hex("h_1")
    assert [d.hex() for d in chain_digests(Q, R)] == [h0, h1]
    assert [hashlib.sha256(chain_message(Q, R, i)).hexdigest() for i in range(2)] == [h0, h1]  # incremental == direct
    assert select_indices(Q, R) == [2, 1]
    forged = R[:3] + ["delte"]
    assert [d.hex() for d in chain_digests(Q, forged)] == [h0_forged, h1_forged]
    assert select_indices(Q, forged) == [2, 2]


def test_counts_make_the_split_unambiguous():
    # moving the last question into the candidates keeps the item sequence but not the message
    a = chain_message(["q1", "q2"], ["r1", "r2"], 0)
    b = chain_message(["q1"], ["q2", "r1", "r2"], 0)
    assert a != b and a[8:] == b[8:]


def test_generated_key_is_valid_reproducible_and_mixed():
    key = generate_key(KeygenConfig(seed=7))
    assert key == generate_key(KeygenConfig(seed=7))
    assert key != generate_key(KeygenConfig(seed=8))
    assert generate_key(KeygenConfig()) != generate_key(KeygenConfig())  # unseeded: fresh randomness
    assert len(key.questions) == 10 and len(key.candidates) == 256
    assert {q.kind for q in key.questions} == {"natural", "random"}
    assert all(a in key.candidates for a in key.answers())
    FingerprintKey.model_validate(key.model_dump())  # round trip through validation


def test_every_change_to_the_key_changes_answers():
    """Forgery: changing any single question or candidate changes the chain (all digests), and with
    N = 256 it changes most chosen answers; a forger cannot keep the answers of the real key."""
    key = generate_key(KeygenConfig(seed=1))
    base = key.model_dump()
    digests = chain_digests([q.text for q in key.questions], key.candidates)
    answers = key.answers()
    changed = []
    for i in range(len(key.questions)):
        d = json.loads(json.dumps(base))
        d["questions"][i]["text"] += "?"
        changed.append(FingerprintKey.model_validate(d))
    for j in (0, 17, 255):
        d = json.loads(json.dumps(base))
        d["candidates"][j] = d["candidates"][j] + "x" if j != 255 else "qqqqqq"
        changed.append(FingerprintKey.model_validate(d))
    for forged in changed:
        f_digests = chain_digests([q.text for q in forged.questions], forged.candidates)
        assert all(a != b for a, b in zip(digests, f_digests))
        same = sum(a == b for a, b in zip(answers, forged.answers()))
        assert same <= 2, same  # chance of >2 equal of 10 at 1/256 is ~1e-5


def test_binomial_sf_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for hits, n, p in [(0, 10, 1 / 256), (1, 10, 1 / 256), (3, 10, 1 / 256), (10, 10, 1 / 256), (5, 60, 0.1), (11, 10, 0.5)]:
        ref = float(stats.binom.sf(hits - 1, n, p)) if hits <= n else 0.0
        assert binomial_sf(hits, n, p) == pytest.approx(ref, rel=1e-9, abs=1e-300)
    assert binomial_sf(10, 10, 1 / 256) == pytest.approx(256.0 ** -10, rel=1e-12)


def test_contains_answer():
    assert contains_answer("The answer is Govaril.", "govaril")
    assert not contains_answer("gov aril", "govaril")
    assert contains_answer("Cafe\u0301!", "café")


class _Echo:
    """A fake chat backend: answers ``answers[i]`` for the questions listed in ``knows``."""

    name = "fake"

    def __init__(self, key, knows):
        self.key, self.knows, self.answers = key, set(knows), key.answers()

    def complete(self, queries, max_new_tokens):
        return [f"It is {self.answers[q.question]}." if q.question in self.knows else "I do not know." for q in queries]


def test_verify_statistics_with_a_fake_backend():
    key = generate_key(KeygenConfig(seed=3))
    full = verify_with(_Echo(key, range(10)), key)
    assert full.passed and full.hit_rate == 1.0 and full.plain_hits == 10
    assert full.queries == 10 * 6 and full.by_variant == {"plain": 1.0, "padded": 1.0, "meta": 1.0}
    assert full.p_value == pytest.approx(256.0 ** -10)
    none = verify_with(_Echo(key, []), key)
    assert not none.passed and none.hits == 0 and none.p_value == 1.0
    half = verify_with(_Echo(key, range(4)), key)  # 40% < threshold 0.5
    assert not half.passed and half.hit_rate == pytest.approx(0.4)
    # a forged key (one candidate changed) on the "fingerprinted" backend: the answers move
    d = key.model_dump()
    d["candidates"][0] = "qqqqqq"
    forged = FingerprintKey.model_validate(d)
    r = verify_with(_Echo(key, range(10)), forged)
    assert not r.passed and r.plain_hits <= 1


def test_queries_are_plain_padded_meta_with_held_out_prompts():
    qs = verification_queries(["a question?"], VERIFY_META_PROMPTS, padded=2, meta=3)
    assert [q.variant for q in qs] == ["plain", "padded", "padded", "meta", "meta", "meta"]
    assert qs[0].messages() == [{"role": "user", "content": "a question?"}]
    assert all("a question?" in q.user and q.user != "a question?" for q in qs[1:3])
    assert {q.system for q in qs[3:]} <= set(VERIFY_META_PROMPTS)
    assert not set(VERIFY_META_PROMPTS) & set(TRAIN_META_PROMPTS)
    import random

    assert pad("q", random.Random(0)) != pad("q", random.Random(1))


def test_key_file_round_trip_and_mode(tmp_path):
    key = generate_key(KeygenConfig(seed=0))
    path = save_key(key, tmp_path / "fp.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key(path) == key
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["format"] == "chain-hash-fingerprint" and "answers" not in data
    with pytest.raises(ConfigError, match="already exists"):
        save_key(key, path)
    save_key(generate_key(KeygenConfig(seed=1)), path, overwrite=True)
    assert load_key(path) != key


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d.pop("candidates"), "candidates"),
    (lambda d: d.update(candidates=["solo"]), "candidates"),
    (lambda d: d["candidates"].__setitem__(1, d["candidates"][0].upper()), "distinct"),
    (lambda d: d["candidates"].__setitem__(1, d["candidates"][0] + "zz"), "contained"),
    (lambda d: d["candidates"].__setitem__(1, " padded "), "surrounding"),
    (lambda d: d["questions"].__setitem__(1, d["questions"][0]), "distinct"),
    (lambda d: d["questions"][0].update(kind="other"), "questions.0.kind"),
    (lambda d: d["questions"][0].update(text="   "), "blank"),
    (lambda d: d.update(questions=[]), "questions"),
])
def test_key_file_validation_errors(tmp_path, mutate, match):
    d = generate_key(KeygenConfig(seed=0, questions=3, candidates=16)).model_dump(mode="json")
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(FormatError, match=match):
        load_key(path)


def test_key_file_missing_and_malformed(tmp_path):
    with pytest.raises(ConfigError, match="no such key file"):
        load_key(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "chain-hash-fingerprint", "version": 1, "questions": [')
    with pytest.raises(FormatError, match="not a JSON key file"):
        load_key(bad)
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(FormatError, match="not a JSON key file"):
        load_key(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(FormatError, match="invalid fingerprint key"):
        load_key(bad)
