"""``compress eval``: perplexity, paired comparison (a CI gate) and greedy generation."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from compress.cli.common import JsonOpt, QuietOpt, emit_json, fail, human, run, stdout

TextOpt = typer.Option(None, "--text", help="UTF-8 text file to evaluate on (default: WikiText-2 test via "
                       "`datasets`, online only).", dir_okay=False)
TokensOpt = typer.Option(8192, "--tokens", help="Tokens of the text to evaluate (0: all).", min=0)
SeqLenOpt = typer.Option(512, "--seq-len", help="Tokens per non-overlapping window.", min=2)
BatchOpt = typer.Option(4, "--batch-size", help="Windows per forward pass.", min=1)
BitsOpt = typer.Option(None, "--bits", help="Precision of a multi-precision (AnyBCQ) checkpoint.", min=1, max=16)
DtypeOpt = typer.Option(None, "--dtype", help="Compute dtype (default: float32 on CPU, stored dtype on GPU).")
DeviceOpt = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda:0.")


def _ppl_line(r) -> str:
    size = f", {human(r.size_bytes)}" if r.size_bytes else ""
    return (f"{r.model}: perplexity {r.perplexity:.3f} (95% CI {r.ci_low:.3f}-{r.ci_high:.3f}) on {r.tokens} tokens "
            f"in {r.windows} windows of {r.seq_len}, {r.tokens_per_s:.0f} tokens/s{size}")


def perplexity(
    model: str = typer.Argument(..., help="Checkpoint: folder, Hub id, pkg:NAME or .gguf; plain or compress format."),
    text: Optional[Path] = TextOpt, tokens: int = TokensOpt, seq_len: int = SeqLenOpt, batch_size: int = BatchOpt,
    bits: Optional[int] = BitsOpt, dtype: Optional[str] = DtypeOpt, device: str = DeviceOpt,
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision."),
    json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Perplexity on real text with a 95% confidence interval, tokens/s and the exact token count."""
    from compress.eval.perplexity import evaluate

    report, _ = run(lambda: evaluate(model, text=text, tokens=tokens or None, seq_len=seq_len, batch_size=batch_size,
                                     bits=bits, dtype=dtype, device=device, revision=revision), json_out)
    emit_json(report) if json_out else stdout.print(_ppl_line(report), soft_wrap=True)


def compare(
    base: str = typer.Argument(..., help="Reference checkpoint."),
    candidate: str = typer.Argument(..., help="Checkpoint to judge (same tokenizer)."),
    text: Optional[Path] = TextOpt, tokens: int = TokensOpt, seq_len: int = SeqLenOpt, batch_size: int = BatchOpt,
    bits: Optional[int] = BitsOpt,
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", min=0.0,
                                                     help="Relative threshold, e.g. 0.02 for +2%: exit 3 beyond it."),
    dtype: Optional[str] = DtypeOpt, device: str = DeviceOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Both perplexities on the same windows, the paired difference with its 95% CI, sizes and top-1
    agreement. Exit 3 when --max-ppl-increase is exceeded."""
    from compress.eval.perplexity import compare as compare_

    r = run(lambda: compare_(base, candidate, text=text, tokens=tokens or None, seq_len=seq_len, batch_size=batch_size,
                             bits=bits, max_ppl_increase=max_ppl_increase, dtype=dtype, device=device), json_out)
    if json_out:
        emit_json(r)
    else:
        stdout.print(_ppl_line(r.base), soft_wrap=True)
        stdout.print(_ppl_line(r.candidate), soft_wrap=True)
        lo, hi = r.ppl_increase_ci
        size = f"; size ratio {r.size_ratio:.4f}" if r.size_ratio is not None else ""
        stdout.print(f"perplexity change {r.ppl_increase:+.2%} (paired 95% CI {lo:+.2%} to {hi:+.2%}); "
                     f"top-1 agreement {r.top1_agreement:.2%}{size}", soft_wrap=True)
    if not r.passed:
        fail(f"perplexity rose {r.ppl_increase:+.2%}, more than --max-ppl-increase {r.max_ppl_increase:.2%}", 3)


def generate(
    model: str = typer.Argument(..., help="Checkpoint to generate with."),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt (repeatable)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt in the tokenizer's chat template."),
    bits: Optional[int] = BitsOpt, dtype: Optional[str] = DtypeOpt, device: str = DeviceOpt,
    json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Greedy generation for a quick look."""
    from compress.eval.model import load_causal_lm
    from compress.eval.perplexity import greedy_generate

    def work():
        loaded = load_causal_lm(model, dtype=dtype, device=device, bits=bits)
        return [{"prompt": p, "completion": greedy_generate(loaded.model, loaded.tokenizer, p, max_new_tokens, chat)}
                for p in prompt]

    outs = run(work, json_out)
    if json_out:
        emit_json({"model": model, "bits": bits, "generations": outs})
    else:
        for o in outs:
            stdout.print(f"[bold]{o['prompt']}[/bold]{o['completion']}", soft_wrap=True, highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``eval perplexity|compare|generate`` to ``app``."""
    from compress.cli.common import group

    sub = group(app, "eval", "Evaluate checkpoints: perplexity, paired comparison (CI gate), generation.")
    sub.command("perplexity")(perplexity)
    sub.command("compare")(compare)
    sub.command("generate")(generate)
