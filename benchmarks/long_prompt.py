"""One long prompt through chunked prefill, bf16 pages against int8 pages (SmolLM2, bf16):

    python benchmarks/long_prompt.py                 # 6,000 tokens in chunks of max_batch_tokens (2,048)
    python benchmarks/long_prompt.py --tokens 4000 --rounds 3

Each round starts a fresh engine per page dtype (after a short warm-up request) and times a
request of --tokens prompt tokens (GPL-3's text) and one new token: every chunk after the first
attends to its context read back from the pages. Prints seconds per round and page dtype.
"""

import argparse
import asyncio
import time

import acb
from acb.loading import load, smollm2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model, tok = load(*smollm2(), dtype="bfloat16")
    with open("/usr/share/common-licenses/GPL-3") as f:
        ids = tok(f.read())["input_ids"][: args.tokens]

    async def timed(kv: str | None) -> float:
        engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(dtype="bfloat16", kv_cache_dtype=kv))
        async with engine:
            await engine.generate_batch([ids[:300]], max_new_tokens=2)
            t0 = time.perf_counter()
            await engine.generate_batch([ids], max_new_tokens=1, ignore_eos=True)
            return time.perf_counter() - t0

    for r in range(args.rounds):
        for kv in (None, "int8"):
            print(f"round {r + 1}: {len(ids)}-token prompt, {kv or 'bf16'} pages: {asyncio.run(timed(kv)):.2f} s",
                  flush=True)


if __name__ == "__main__":
    main()
