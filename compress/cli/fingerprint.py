"""``compress fingerprint keygen|insert|verify``: Chain & Hash ownership fingerprints (arXiv 2407.10887)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from compress.cli.common import JsonOpt, OverwriteOpt, QuietOpt, emit_json, human, run, stderr, stdout

KeyArg = typer.Argument(..., help="The owner's key file (from `compress fingerprint keygen`).", dir_okay=False)


def _config(cls, **kwargs):
    from pydantic import ValidationError

    from compress.errors import validation_error

    try:
        return cls(**kwargs)
    except ValidationError as e:
        raise validation_error(e, option=True) from None


def keygen(
    output: Path = typer.Option(..., "--output", "-o", help="Key file to write (JSON, mode 0600). Keep it secret."),
    questions: int = typer.Option(10, "--questions", help="Number of questions k (half natural language, half random tokens)."),
    candidates: int = typer.Option(256, "--candidates", help="Number of candidate answers N (chance of a hit: 1/N)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Reproducible key (tests only; default: OS randomness)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing key file."),
    json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Draw a fingerprint key: questions, candidate answers; each answer is chosen by the SHA-256 chain."""

    def work():
        from compress.transforms.fingerprint.key import KeygenConfig, generate_key, save_key

        config = _config(KeygenConfig, questions=questions, candidates=candidates, seed=seed)
        path = save_key(generate_key(config), output, overwrite=overwrite)
        return {"output": str(path), "questions": config.questions, "candidates": config.candidates,
                "seeded": seed is not None}

    r = run(work, json_out)
    if json_out:
        emit_json(r)
    else:
        stdout.print(f"wrote {r['output']}: {r['questions']} questions, {r['candidates']} candidates. "
                     "It is the proof of ownership: keep it private and never ship it with the model.", soft_wrap=True)


def insert(
    model: str = typer.Argument(..., help="Checkpoint to fingerprint: folder, Hub id, pkg:NAME or .gguf."),
    key: Path = KeyArg,
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder to write (refused if it exists, unless --overwrite)."),
    lora: bool = typer.Option(True, "--lora/--full", help="LoRA (peft) or full fine-tuning."),
    merge: bool = typer.Option(True, "--merge/--adapter-only", help="LoRA: merge into the weights, or write the adapter alone."),
    steps: int = typer.Option(60, "--steps", help="Optimizer steps."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default 3e-3 LoRA, 5e-5 full)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Fingerprint examples per step."),
    lora_rank: int = typer.Option(16, "--lora-rank", help="LoRA rank."),
    meta_prompts: Optional[Path] = typer.Option(None, "--meta-prompts", dir_okay=False,
                                                help="System prompts to train under, one per line (default: built-in set)."),
    benign: Optional[Path] = typer.Option(None, "--benign", dir_okay=False,
                                          help="UTF-8 text mixed into training to keep utility (recommended)."),
    benign_batch: int = typer.Option(1, "--benign-batch", help="Benign windows of --benign-seq-len tokens per step."),
    benign_seq_len: int = typer.Option(128, "--benign-seq-len", help="Tokens per benign window."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Output dtype (default: the input's stored dtype)."),
    device: str = typer.Option("cpu", "--device", help="torch device (accelerate launch for several GPUs)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the training prompts and batches."),
    overwrite: bool = OverwriteOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Fine-tune the fingerprint into MODEL: each pair padded and under varied system prompts and templates,
    mixed with benign text. The key is never written into the output."""

    def work():
        from compress.transforms.fingerprint.insert import InsertConfig, insert_fingerprint

        config = _config(InsertConfig, method="lora" if lora else "full", merge=merge, steps=steps, lr=lr,
                         batch_size=batch_size, lora_rank=lora_rank, benign_batch=benign_batch,
                         benign_seq_len=benign_seq_len, dtype=dtype, device=device, seed=seed)
        if not key.is_file():  # fail before loading the model
            from compress.transforms.fingerprint.key import load_key

            load_key(key)
        def log(step, loss, benign_loss):
            if step % 10 == 0 or step == steps:
                extra = f", benign loss {benign_loss:.3f}" if benign_loss is not None else ""
                stderr.print(f"step {step}/{steps}: fingerprint loss {loss:.4f}{extra}")

        return insert_fingerprint(model, key, output_dir, config, benign=benign, meta_prompts=meta_prompts,
                                  overwrite=overwrite, progress=None if quiet or json_out else log)

    r = run(work, json_out)
    if json_out:
        emit_json(r)
        return
    what = "LoRA merged" if r.method == "lora" and r.merged else ("LoRA adapter" if r.method == "lora" else "full")
    check = f"; plain hit rate {r.plain_hit_rate:.0%}" if r.plain_hit_rate is not None else ""
    stdout.print(f"wrote {r.output} ({what}, {r.dtype}): {r.steps} steps at lr {r.lr:g}, fingerprint loss {r.loss:.4f} (mean of the last 10 steps)"
                 + (f", benign loss {r.benign_loss:.3f}" if r.benign_loss is not None else ", no benign text")
                 + f"{check}; {r.seconds:.0f} s, peak RSS {human(r.peak_rss_bytes)}", soft_wrap=True)
    if not r.benign and not quiet:
        stderr.print("note: no --benign text was mixed in; utility may drop more than needed")


def verify(
    model: Optional[str] = typer.Argument(None, help="Checkpoint to test (omit with --endpoint)."),
    key: Path = typer.Argument(None, help="The owner's key file.", dir_okay=False),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="Root URL of an OpenAI-compatible chat server "
                                           "(POST {URL}/v1/chat/completions)."),
    model_name: str = typer.Option("default", "--model-name", help="`model` field sent to the endpoint."),
    threshold: float = typer.Option(0.5, "--threshold", help="Smallest hit rate over all queries that counts as a match."),
    alpha: float = typer.Option(1e-6, "--alpha", help="Largest binomial p-value that counts as a match."),
    padded: int = typer.Option(2, "--padded", help="Padded queries per question."),
    meta: int = typer.Option(3, "--meta", help="Meta-prompted queries per question."),
    meta_prompts: Optional[Path] = typer.Option(None, "--meta-prompts", dir_okay=False,
                                                help="System prompts for the meta queries, one per line."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Tokens generated per query."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Compute dtype of a local model (default float32 on CPU)."),
    device: str = typer.Option("cpu", "--device", help="torch device of a local model."),
    json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Ask every question of the key (plain, padded, meta-prompted; greedy) and test the answers against the
    chain. Exit 0 when the hit rate and p-value meet the threshold, 3 when they do not.

    With --endpoint, the only argument is the key file: `compress fingerprint verify FP.json --endpoint URL`.
    """
    if endpoint is not None and key is None:
        model, key = None, Path(model) if model is not None else None
    from compress.cli.common import fail

    if key is None:
        fail("missing KEY: `compress fingerprint verify MODEL FP.json` or `verify FP.json --endpoint URL`", 2, json_out)

    def work():
        from compress.transforms.fingerprint.verify import VerifyConfig, verify_fingerprint

        config = _config(VerifyConfig, threshold=threshold, alpha=alpha, padded=padded, meta=meta,
                         max_new_tokens=max_new_tokens)
        return verify_fingerprint(model, key, config, endpoint=endpoint, model_name=model_name,
                                  meta_prompts=meta_prompts, dtype=dtype, device=device)

    r = run(work, json_out)
    verdict = "fingerprint present" if r.passed else "fingerprint NOT established"
    msg = (f"hit rate {r.hit_rate:.0%} below --threshold {r.threshold:.0%}" if r.hit_rate < r.threshold
           else f"p-value {r.p_value:.3g} above --alpha {r.alpha:.3g}")
    if json_out:
        emit_json({**r.model_dump(mode="json"), **({} if r.passed else {"error": msg, "exit_code": 3})})
    else:
        parts = ", ".join(f"{k} {v:.0%}" for k, v in r.by_variant.items())
        stdout.print(f"{r.target}: {r.hits}/{r.queries} queries hit ({r.hit_rate:.1%}; {parts}); "
                     f"{r.plain_hits}/{r.questions} questions answered plainly, p-value {r.p_value:.3g} "
                     f"against chance 1/{r.candidates}: {verdict}", soft_wrap=True)
    if not r.passed:
        stderr.print(f"[red]error:[/red] verification failed: {msg}")
        raise typer.Exit(3)


def register(app: typer.Typer) -> None:
    """Add ``fingerprint keygen|insert|verify`` to ``app``."""
    from compress.cli.common import group

    sub = group(app, "fingerprint", "Chain & Hash ownership fingerprints: make a key, insert it, verify a model or endpoint.")
    sub.command("keygen")(keygen)
    sub.command("insert")(insert)
    sub.command("verify")(verify)
