"""Perplexity of a GGUF file in acb (``quantization="gguf"``, and the same file dequantized to float32)
against ``llama-perplexity`` on the same file, the same text and the same context, as llama.cpp scores it.

    python benchmarks/gguf_perplexity.py --llama-bin /path/to/llama.cpp/build/bin            # SmolLM2 Q4_1
    python benchmarks/gguf_perplexity.py --model gemma3 --llama-bin ... --ctx 512

The text: the Debian license texts quality.py holds out (written to a file for llama.cpp). llama.cpp's
way, repeated here: the text tokenized whole (by llama.cpp's ``llama-tokenize`` where ``--llama-bin`` is
given, so both score the same tokens; else by transformers' tokenizer of the file), cut into chunks of
``--ctx`` tokens, each chunk's first token replaced by BOS where the model adds one, and only each
chunk's second half scored (every token after position ctx/2, predicted from the logits before it).
Also reported: top-1 agreement of acb's ``gguf`` with the file in float32 over the scored positions.
Writes JSON (default bench-results/gguf-perplexity-<model>.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gguf_speed import cpu_class, model_file  # noqa: E402
from quality import held_out_text, window_logits  # noqa: E402


def acb_scores(model, ids: list[int], ctx: int, bos: int | None, chunks: int) -> tuple[list[float], list[int]]:
    """(negative log-likelihoods, argmaxes) of the scored positions, chunk by chunk as llama-perplexity."""
    from acb import EngineConfig
    from acb.worker.runner import ModelRunner

    pages = list(range(-(-ctx // 16) + 1))
    runner = ModelRunner(model, len(pages) + 1, 16)
    runner.configure_fast_paths(EngineConfig(), 1)
    nll, top = [], []
    try:
        for start in range(0, min(len(ids) - ctx + 1, chunks * ctx), ctx):
            chunk = list(ids[start: start + ctx])
            if bos is not None:
                chunk[0] = bos
            logits = window_logits(runner, chunk, pages)
            logp = torch.log_softmax(logits.double(), -1)
            first = ctx // 2
            target = torch.tensor(ids[start + first + 1: start + ctx])
            nll += (-logp[first: ctx - 1].gather(1, target[:, None])[:, 0]).tolist()
            top += logits[first: ctx - 1].argmax(-1).tolist()
    finally:
        runner.release()
    return nll, top


def llama_perplexity(bin_dir: str, path: str, text_file: str, ctx: int, chunks: int) -> dict:
    cmd = [str(Path(bin_dir) / "llama-perplexity"), "-m", path, "-f", text_file, "-c", str(ctx), "-b", str(ctx),
           "-t", str(os.cpu_count()), "--chunks", str(chunks)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    tokens = re.search(r"tokenizing the input .*?\n.*?(\d+) tokens|tokenization took.*?\n", text)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", text)
    return {"command": " ".join(cmd), "ppl": float(ppl.group(1)) if ppl else None,
            "chunks": int(chunks.group(1)) if chunks else None, "tokens_line": tokens.group(0) if tokens else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=20, help="chunks scored (llama-perplexity's --chunks)")
    ap.add_argument("--llama-bin", default=os.environ.get("ACB_LLAMA_BIN"))
    ap.add_argument("--out")
    args = ap.parse_args()
    from acb.model.loading import load

    folder, name = model_file(args.model)
    text = held_out_text()
    text_file = Path(tempfile.gettempdir()) / "acb-held-out-licenses.txt"  # quality.py's text, for llama.cpp
    text_file.write_text(text)
    rows = {}
    quantized, tok = load(folder, name, dtype="float32", quantization="gguf")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    own = len(ids)
    if args.llama_bin:  # llama.cpp's own tokens (its tokenizer and transformers' split some whitespace apart)
        out = subprocess.run([str(Path(args.llama_bin) / "llama-tokenize"), "-m", os.path.join(folder, name), "-f",
                              str(text_file), "--ids", "--log-disable", "--no-bos"], capture_output=True, text=True,
                             check=True)
        ids = json.loads(out.stdout.strip().splitlines()[-1])
    bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) or args.model == "gemma3" else None
    nll_q, top_q = acb_scores(quantized, ids, args.ctx, bos, args.chunks)
    del quantized
    dense, _ = load(folder, name, dtype="float32")
    nll_f, top_f = acb_scores(dense, ids, args.ctx, bos, args.chunks)
    rows["acb_gguf"] = {"ppl": math.exp(sum(nll_q) / len(nll_q)), "scored": len(nll_q)}
    rows["acb_fp32"] = {"ppl": math.exp(sum(nll_f) / len(nll_f)), "scored": len(nll_f)}
    agreement = sum(a == b for a, b in zip(top_q, top_f, strict=True)) / len(top_f)
    if args.llama_bin:
        rows["llama_cpp"] = llama_perplexity(args.llama_bin, os.path.join(folder, name), str(text_file), args.ctx,
                                             args.chunks)
    print(f"{cpu_class()}; {name}, ctx {args.ctx}, {len(ids)} tokens scored from (transformers' tokenizer: {own})")
    for system, r in rows.items():
        print(f"{system:<10} PPL {r['ppl']:.4f}" + (f"  ({r['scored']} tokens scored)" if "scored" in r else
                                                     f"  ({r.get('chunks')} chunks)"))
    if "llama_cpp" in rows and rows["llama_cpp"]["ppl"]:
        print(f"acb gguf / llama.cpp: {rows['acb_gguf']['ppl'] / rows['llama_cpp']['ppl']:.4f}")
    print(f"top-1 agreement, acb gguf with the file in float32: {agreement:.2%}")
    out = Path(args.out or f"bench-results/gguf-perplexity-{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": "python " + " ".join(sys.argv), "cpu": cpu_class(),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "model": name,
                               "ctx": args.ctx, "tokens": len(ids), "transformers_tokens": own, "rows": rows,
                               "top1_agreement": agreement}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
