"""`compress upload`: what is sent to the Hub (the Hub API replaced by a recorder), refusals, offline."""

import json

import pytest

from conftest import cli

pytestmark = pytest.mark.integration


@pytest.fixture()
def encoded(minilm_bf16, tmp_path):
    import shutil

    src, out = tmp_path / "src", tmp_path / "enc"
    shutil.copytree(minilm_bf16, src)
    (src / "README.md").unlink()  # so a model card is generated
    assert cli("encode", "ecf8", src, "-o", out, "--quiet").exit_code == 0
    return out


def test_upload_sends_every_file_and_a_card(encoded, monkeypatch):
    import huggingface_hub

    calls = {}

    def create_commit(self, repo_id, operations, commit_message=None, revision=None):
        calls["commit"] = (repo_id, {op.path_in_repo: op for op in operations}, revision)
        return huggingface_hub.CommitInfo(commit_url="https://hf.co/o/m/commit/1", commit_message="", commit_description="",
                                          oid="1" * 40, pr_url=None)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("repo", kw))
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    (encoded.parent / ".enc.tmp-x").mkdir()  # a stray temporary folder beside it is never sent
    r = cli("upload", encoded, "org/model", "--private", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    repo_id, ops, revision = calls["commit"]
    assert repo_id == "org/model" and revision is None and calls["repo"]["private"] is True
    on_disk = sorted(str(p.relative_to(encoded)) for p in encoded.rglob("*") if p.is_file())
    assert ".gitattributes" in on_disk
    assert sorted(ops) == sorted(on_disk + ["README.md"]) == sorted(rep["files"])
    card = ops["README.md"].path_or_fileobj.decode()
    assert "ecf8" in card and "import compress" in card
    assert rep["manifest_checked"] and rep["generated_card"] and rep["url"].endswith("/commit/1")
    assert rep["bytes"] == sum((encoded / f).stat().st_size for f in on_disk) + len(card)


def test_upload_refuses_damaged_and_bad_input(encoded, tmp_path):
    r = cli("upload", encoded, "org/model", "--dry-run", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["dry_run"] is True
    config = encoded / "config.json"
    config.write_text(config.read_text() + " ")
    r = cli("upload", encoded, "org/model", "--dry-run")
    assert r.exit_code == 3 and "config.json" in r.output and "not uploaded" in r.output
    assert cli("upload", tmp_path / "missing", "org/model").exit_code == 2
    assert cli("upload", encoded, "not a repo id").exit_code == 2
    (tmp_path / "empty").mkdir()
    r = cli("upload", tmp_path / "empty", "org/model")
    assert r.exit_code == 2 and "no .safetensors" in r.output


def test_plain_folder_skips_hidden_folders(minilm_fp32, tmp_path):
    import shutil

    src = tmp_path / "plain"
    shutil.copytree(minilm_fp32, src)
    (src / ".cache").mkdir()
    (src / ".cache" / "lock").write_text("x")
    r = cli("upload", src, "org/model", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert ".gitattributes" in rep["files"] and "model.safetensors" in rep["files"]
    assert not any(f.startswith(".cache") for f in rep["files"])
    assert not rep["manifest_checked"] and not rep["generated_card"]  # MiniLM has its own README.md


def test_upload_offline_is_one_line(minilm_fp32):
    r = cli("upload", minilm_fp32, "org/model")  # HF_HUB_OFFLINE=1 in the tests: the Hub refuses
    assert r.exit_code == 2 and "upload to org/model failed" in r.output and "Traceback" not in r.output
