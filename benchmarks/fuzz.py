"""Feature-mix fuzz (not a CI test): random engine settings against random request mixes, and
random (often malformed) bodies against the OpenAI endpoints. Exit status 1 on any finding.

    python benchmarks/fuzz.py engine --seed 1 --rounds 60     # ~1 min a seed on 2 cores
    python benchmarks/fuzz.py server --seed 1 --requests 400   # --junk 0.25: share of junk field values

``engine``: each round builds an engine over a fresh tiny model of a random architecture with
random settings (page size, a cache of 12-128 pages, token budget, request cap, the three
schedulers, prefix caching, CPU offload, async batching, n-gram or draft speculation, the native
kernels or fused forward off, bf16, int8 weights, int8 pages, two LoRA adapters loaded with one
of them unloaded mid-round) and sends it 4-16 concurrent requests sharing prefixes, each by a
random route: greedy, ``n=2``, cancelled after two chunks, a stream left with ``break``, sampled,
seeded twice, a regex, logprobs, a repetition penalty, a logit bias, prompt logprobs, a stop
token and a stop string, a deadline; with adapters, each names one of them or the base model.
It checks that greedy tokens (every choice, every stream's prefix) equal transformers'
``generate`` in float32 (PEFT's model with that adapter active for an adapter's rows; the same
penalty or bias through transformers' processors), that prompt logprobs are transformers'
log-softmax within 1e-4, that a stop token or string taken from the greedy output ends the
request right there, that a deadline ends one with "timeout" (its tokens generate's), that
seeded twins are equal, that a regex output matches, that nothing fails but by refusal
(``InvalidRequestError``, ``EngineOverloadedError``), that a round ends within
``--round-timeout`` (else: a hang, with the engine's stats), and that afterwards every page is
free and ``check_integrity()`` passes.

``server``: the aiohttp app of ``acb serve`` over a tiny engine; each request is a random body for
``/v1/completions`` or ``/v1/chat/completions`` (valid fields, wrong types, out-of-range values,
unknown fields, conflicting constraints, invalid JSON), 16 at a time. Every answer must be a 200
(a stream ending in ``[DONE]``) or a 4xx/429 whose JSON names what was wrong; never a 5xx; ``/health``
answers 200 and every page is free afterwards. The refusals are counted by message.

Findings so far are in docs/reliability.md ("The feature-mix fuzz").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import acb  # noqa: E402
from acb.testing import (  # noqa: E402
    ARCHITECTURES,
    random_prompts,
    reference_greedy,
    reference_log_softmax,
    tiny_lora_model,
    tiny_model,
    tiny_tokenizer,
)

ROUTES = {"greedy": 5, "n2": 1, "cancel": 1, "stream_break": 1, "sample": 1, "seeded2": 1, "regex": 1,
          "logprobs": 1, "penalty": 1, "bias": 1, "prompt_logprobs": 1, "stop": 1, "timeout": 1}
PROMPT_LOGPROB_TOL = 1e-4  # tests/test_prompt_logprobs.py's: acb and transformers sum in other orders
REGEX = "[ab]{1,5}c"


def peft_model(arch: str, seed: int, r: int):
    """PEFT's LoRA model over the tiny ``arch`` model, every projection targeted, A and B random
    (``acb.testing.tiny_lora_model``); None without ``peft``."""
    try:
        return tiny_lora_model(arch, seed, r, 2 * r)
    except ImportError:
        return None


def engine_settings(rnd: random.Random, arch: str) -> tuple[dict, bool]:
    """Random EngineConfig fields; whether greedy output must equal float32 ``generate``."""
    cfg: dict = dict(page_size=rnd.choice([4, 8, 16]), num_blocks=rnd.choice([12, 20, 40, 128]),
                     max_batch_tokens=rnd.choice([None, 7, 16, 33, 64]),
                     scheduler=rnd.choice(["fifo", "prefill_first", "priority"]),
                     allow_prefix_sharing=rnd.random() < 0.7, cpu_offload_space=rnd.choice([0.0, 0.0, 0.5]),
                     async_batching=rnd.random() < 0.8, debug_checks=True,
                     max_requests_per_batch=rnd.choice([None, 3, 8]))
    spec = rnd.random()
    if spec < 0.25:
        cfg.update(speculative_method="ngram", num_speculative_tokens=rnd.choice([1, 3, 5]))
    elif spec < 0.4:
        cfg.update(speculative_method="draft", draft_model=tiny_model(arch, seed=rnd.choice([0, 1])),
                   num_speculative_tokens=rnd.choice([1, 3, 5]))
    path = rnd.random()
    if path < 0.15:
        cfg["cpu_fused_forward"] = False
    elif path < 0.3:
        cfg["cpu_kernels"] = False
    exact = True
    dtype = rnd.random()
    if dtype < 0.3 and "cpu_kernels" not in cfg and "cpu_fused_forward" not in cfg:
        exact = False
        name, value = [("dtype", "bfloat16"), ("quantization", "int8"), ("kv_cache_dtype", "int8")][int(dtype * 10)]
        cfg[name] = value
    return cfg, exact


class EngineRound:
    def __init__(self, rnd: random.Random, index: int, refs: dict) -> None:
        self.rnd, self.index, self.refs = rnd, index, refs
        self.arch = rnd.choice(ARCHITECTURES)
        self.cfg, self.exact = engine_settings(rnd, self.arch)
        self.adapters: dict = {}  # name -> PEFT model, loaded into the engine when the round starts
        if rnd.random() < 0.3 and "quantization" not in self.cfg:
            ranks = rnd.sample([2, 4, 8], 2)
            self.cfg.update(max_adapters=2, max_adapter_rank=max(ranks))
            self.adapters = {name: peft_model(self.arch, rnd.randrange(10**6), r)
                             for name, r in zip(("a", "b"), ranks, strict=True)}
            if any(m is None for m in self.adapters.values()):
                self.adapters = {}
        self.unloaded = asyncio.Event()
        self.findings: list[tuple] = []
        self.checked = 0
        self.release_s = 0.0  # from the last request's end to every page free

    def model(self, adapter: str | None):
        return self.adapters[adapter] if adapter else tiny_model(self.arch)

    def ref(self, prompt: list[int], n: int, adapter: str | None = None, **generate_kwargs) -> list[int]:
        key = (self.arch, tuple(prompt), n, adapter, id(self.adapters.get(adapter)), repr(generate_kwargs))
        if key not in self.refs:
            self.refs[key] = reference_greedy(self.model(adapter), prompt, n, **generate_kwargs)
        return self.refs[key]

    def jobs(self) -> list[tuple]:
        rnd = self.rnd
        base = random_prompts(4, 5, 20, seed=rnd.randrange(10**6))
        out = []
        for _ in range(rnd.randint(4, 16)):
            prompt = list(rnd.choice(base))
            if rnd.random() < 0.5:
                prompt += random_prompts(1, 1, 12, seed=rnd.randrange(10**6))[0]
            route = rnd.choices(list(ROUTES), list(ROUTES.values()))[0]
            adapter = rnd.choice([None, *self.adapters]) if self.adapters else None
            out.append((prompt, rnd.randint(1, 24), route, rnd.randint(0, 3), rnd.randrange(1000), rnd.random(),
                        adapter))
        return out

    async def unload_later(self, engine: acb.Engine, delay: float) -> None:
        """Unload adapter "b" while requests run: those naming it before are served, those after
        refused by name."""
        await asyncio.sleep(delay * 0.05)
        self.unloaded.set()
        await engine.unload_adapter("b")
        if "b" in engine.adapters():
            self.findings.append(("unload_adapter returned with the adapter still loaded", engine.adapters()))

    async def request(self, engine: acb.Engine, job: tuple) -> None:
        prompt, n, route, priority, seed, delay, adapter = job
        kw: dict = dict(max_new_tokens=n, ignore_eos=True)
        if self.cfg["scheduler"] == "priority":
            kw["priority"] = priority
        if adapter is not None:
            kw["adapter"] = adapter
        await asyncio.sleep(delay * 0.05)
        want = self.ref(prompt, n, adapter) if self.exact else None
        try:
            if route in ("greedy", "logprobs", "n2"):
                extra = dict(n=2) if route == "n2" else dict(logprobs=True, top_logprobs=3) if route == "logprobs" \
                    else {}
                done = await engine.generate(prompt, **kw, **extra)
                for c in done.choices or [done]:
                    if want is not None and c.token_ids != want:
                        self.findings.append(("greedy tokens differ from generate", route, prompt, n, c.token_ids,
                                              want))
                self.checked += 1
            elif route == "cancel":
                handle = engine.submit(prompt, **kw)
                chunks = 0
                async for _ in handle:
                    chunks += 1
                    if chunks >= 2:
                        handle.cancel()
                        break
            elif route == "stream_break":
                got: list[int] = []
                async for chunk in engine.stream(prompt, **kw):
                    got += chunk.token_ids
                    if len(got) >= n // 2:
                        break
                if want is not None and got != want[: len(got)]:
                    self.findings.append(("stream prefix differs from generate", prompt, n, got))
            elif route == "sample":
                await engine.generate(prompt, temperature=1.0, top_p=0.9, **kw)
            elif route == "seeded2":
                # both awaited to the end even when one is refused (overload): then not compared
                a, b = await asyncio.gather(*(engine.generate(prompt, temperature=0.8, seed=seed, **kw)
                                              for _ in range(2)), return_exceptions=True)
                for twin in (a, b):
                    if isinstance(twin, BaseException):
                        raise twin
                # a prompt's logits do not depend on how it was chunked, in every dtype and page kind
                if a.token_ids != b.token_ids:
                    self.findings.append(("seeded twins differ", prompt, n, a.token_ids, b.token_ids))
            elif route in ("penalty", "bias"):
                # transformers' processors: RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor
                token = prompt[seed % len(prompt)]
                mine, theirs = (dict(repetition_penalty=1.3), dict(repetition_penalty=1.3)) if route == "penalty" \
                    else (dict(logit_bias={token: 4.0}), dict(sequence_bias={(token,): 4.0}))
                done = await engine.generate(prompt, **kw, **mine)
                if self.exact:
                    want = self.ref(prompt, n, adapter, **theirs)
                    if done.token_ids != want:
                        self.findings.append((f"{route}: greedy tokens differ from generate", prompt, n, mine,
                                              done.token_ids, want))
                self.checked += 1
            elif route == "prompt_logprobs":
                done = await engine.generate(prompt, **kw, prompt_logprobs=1)
                scores = done.prompt_logprobs
                if scores is None or scores.token_ids != prompt or scores.logprobs[0] is not None:
                    self.findings.append(("prompt_logprobs missing or malformed", prompt, repr(scores)[:200]))
                elif self.exact:
                    ref = reference_log_softmax(self.model(adapter), prompt)
                    worst = max((abs(scores.logprobs[p] - ref[p - 1, prompt[p]].item())
                                 for p in range(1, len(prompt))), default=0.0)
                    if worst > PROMPT_LOGPROB_TOL:
                        self.findings.append(("prompt logprobs differ from transformers' forward", prompt, worst))
            elif route == "stop":
                # a stop token id (kept in the output) and a stop string (cut from the text) taken
                # from the request's own greedy output: both must end it right there
                free = await engine.generate(prompt, **kw)
                if want is not None and free.token_ids != want:
                    self.findings.append(("greedy tokens differ from generate", route, prompt, n, free.token_ids,
                                          want))
                stop_id = free.token_ids[seed % len(free.token_ids)]
                first = free.token_ids.index(stop_id)
                by_id = await engine.generate(prompt, **kw, stop_token_ids=[stop_id])
                if by_id.token_ids != free.token_ids[: first + 1] or by_id.finish_reason != "stop":
                    self.findings.append(("stop_token_ids did not end the request at the token", prompt, stop_id,
                                          by_id.token_ids, by_id.finish_reason, free.token_ids))
                at = seed % max(1, len(free.text) - 1)
                needle = free.text[at: at + 2]
                if needle and "\ufffd" not in needle:
                    by_str = await engine.generate(prompt, **kw, stop=[needle])
                    if by_str.text != free.text[: free.text.index(needle)] or by_str.finish_reason != "stop":
                        self.findings.append(("a stop string did not cut the text there", prompt, needle,
                                              by_str.text, by_str.finish_reason, free.text))
                self.checked += 1
            elif route == "timeout":
                done = await engine.generate(prompt, **kw, timeout_s=0.005 + 0.05 * (seed % 4))
                if done.finish_reason not in ("timeout", "length"):
                    self.findings.append(("a deadline ended a request otherwise", done.finish_reason))
                if want is not None and done.token_ids != want[: len(done.token_ids)]:
                    self.findings.append(("a timed-out request's tokens are not generate's", prompt,
                                          done.token_ids, want))
            elif route == "regex":
                kw.pop("ignore_eos")
                done = await engine.generate(prompt, regex=REGEX, speculative=False
                                             if self.cfg.get("speculative_method") else None, **kw)
                if done.finish_reason != "length" and not re.fullmatch(REGEX, done.text):
                    self.findings.append(("regex output does not match", done.text, done.finish_reason))
        except acb.InvalidRequestError as e:
            if adapter == "b" and not self.unloaded.is_set() and "adapter" in str(e):
                self.findings.append(("a loaded adapter was refused", route, str(e)[:300]))
            # else refused by name (a prompt that can never fit, an unloaded adapter)
        except acb.EngineOverloadedError:
            pass  # a full queue
        except Exception as e:  # noqa: BLE001 - every other failure is a finding
            self.findings.append(("request failed", route, repr(e)[:300]))

    async def run(self, timeout: float) -> None:
        engine = acb.Engine(tiny_model(self.arch), tokenizer=tiny_tokenizer(), config=acb.EngineConfig(**self.cfg))
        async with engine:
            for name, model in self.adapters.items():
                await engine.load_adapter(model, name)
            jobs = [self.request(engine, job) for job in self.jobs()]
            if self.adapters and self.rnd.random() < 0.5:
                jobs.append(self.unload_later(engine, self.rnd.random()))
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.gather(*jobs)
            except TimeoutError:
                self.findings.append(("hang: the round did not end", str(engine.stats())))
                return
            # a cancelled request's pages come back at the loop's next step boundary: allow a second
            t0 = time.monotonic()
            while True:
                st = engine.stats()
                idle = st.free_blocks == st.total_blocks and not st.running and not st.waiting
                if idle or time.monotonic() - t0 > 1.0:
                    break
                await asyncio.sleep(0.01)
            self.release_s = time.monotonic() - t0
            engine.check_integrity()
            if not idle:
                self.findings.append(("pages or requests left after 1 s", str(st)))

    def describe(self) -> str:
        shown = {k: v for k, v in self.cfg.items() if k != "draft_model"}
        if self.adapters:
            shown["adapters"] = {name: m.peft_config["default"].r for name, m in self.adapters.items()}
        return f"round {self.index}: {self.arch} {shown}"


async def fuzz_engine(args: argparse.Namespace) -> int:
    rnd = random.Random(args.seed)
    refs: dict = {}
    t0, checked, findings, release = time.monotonic(), 0, 0, 0.0
    for i in range(args.rounds):
        r = EngineRound(rnd, i, refs)
        await r.run(args.round_timeout)
        checked += r.checked
        release = max(release, r.release_s)
        if r.findings:
            findings += len(r.findings)
            print(r.describe())
            for f in r.findings[:5]:
                print("   ", f)
    print(f"engine fuzz, seed {args.seed}: {args.rounds} rounds, {checked} greedy requests compared, "
          f"{findings} findings, {time.monotonic() - t0:.0f} s; pages all free at most {release * 1000:.0f} ms "
          f"after a round's last request")
    return 1 if findings else 0


JUNK = [None, True, False, 0, 1, -1, 2**31, 2**63, -2**63, 1e308, 0.5, -0.5, "", "x", "a" * 50, [], [1], ["a"],
        [[1]], {}, {"a": 1}, {"type": "x"}, [None], "\u0000", "\U0001f642", [-1], [300, 2**40]]
FIELDS = {
    "model": ["acb", "nope"], "max_tokens": [1, 4, 16, 0, -3, 100000], "max_completion_tokens": [2, 5],
    "temperature": [0, 0.7, 1.5, -1], "top_p": [0.5, 1, 0, 1.5], "top_k": [0, 5, -1, 10**6], "min_p": [0.1, 2],
    "n": [1, 2, 3, 0, 100], "best_of": [1, 2], "seed": [1, -5, 2**70], "stream": [True, False],
    "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, {}], "stop": ["\n", ["a", "b"], []],
    "logprobs": [True, False, 3, 50], "top_logprobs": [0, 3, 25, -1], "echo": [True, False],
    "presence_penalty": [0.5, -3], "frequency_penalty": [0.2, 9], "repetition_penalty": [1.1, 0, -1],
    "logit_bias": [{"5": 10}, {"99999": 1}, {"x": 1}, {"5": 100}], "user": ["u"],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "regex"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"type": "integer"}}}}}],
    "tools": [[{"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}], [{"type": "x"}], []],
    "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "get"}},
                    {"type": "function", "function": {"name": "zzz"}}],
    "guided_regex": ["[ab]+", "("], "guided_choice": [["yes", "no"], []], "guided_json": [{"type": "object"}],
    "priority": [0, 5, -1], "ignore_eos": [True], "min_tokens": [0, 3, 100000], "prompt_logprobs": [0, 2],
    "suffix": ["x"], "include_metrics": [True],
}
PROMPTS = ["hi there", [5, 6, 7], ["a", "b"], [[5, 6], [7]], "", []]
MESSAGES = [[{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
            [{"role": "user"}], [{"content": "x"}], [{"role": "tool", "content": "x"}],
            [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]]
NOT_JSON = ["{", "[]", "null", '{"prompt": 1e999}', "\xff"]


def body(rnd: random.Random, chat: bool, junk: float) -> str:
    if rnd.random() < 0.03:
        return rnd.choice(NOT_JSON)
    b: dict = {"messages": rnd.choice(MESSAGES)} if chat else {"prompt": rnd.choice(PROMPTS)}
    for k in rnd.sample(sorted(FIELDS), rnd.randint(0, 6)):
        b[k] = rnd.choice(JUNK) if rnd.random() < junk else rnd.choice(FIELDS[k])
    if rnd.random() < 0.1:
        b["messages" if chat else "prompt"] = rnd.choice(JUNK)
    b.setdefault("max_tokens", rnd.choice([1, 4, 8]))
    return json.dumps(b)


async def fuzz_server(args: argparse.Namespace) -> int:
    from aiohttp.test_utils import TestClient, TestServer

    from acb.serving.server import ServerConfig, create_app

    rnd = random.Random(args.seed)
    statuses: collections.Counter = collections.Counter()
    messages: collections.Counter = collections.Counter()
    findings: list[tuple] = []
    engine = acb.Engine(tiny_model("llama"), tokenizer=tiny_tokenizer(),
                        config=acb.EngineConfig(num_blocks=128, page_size=8))
    async with engine:
        async with TestClient(TestServer(create_app(engine, ServerConfig(max_tokens_limit=64)))) as client:
            async def one() -> None:
                chat = rnd.random() < 0.5
                raw = body(rnd, chat, args.junk)
                path = "/v1/chat/completions" if chat else "/v1/completions"
                async with client.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
                    text = await r.text()
                statuses[r.status] += 1
                if r.status >= 500 or r.status not in (200, 400, 404, 413, 422, 429):
                    findings.append((r.status, path, raw[:300], text[:300]))
                elif r.status != 200:
                    message = json.loads(text).get("error", {}).get("message")
                    if not message:
                        findings.append(("an error without a message", r.status, raw[:200], text[:200]))
                    messages[re.sub(r"\d+", "N", message or "")[:100]] += 1
                elif '"stream": true' in raw and "data: [DONE]" not in text:
                    findings.append(("a stream without [DONE]", raw[:200], text[-200:]))

            for k in range(0, args.requests, 16):
                await asyncio.gather(*(one() for _ in range(min(16, args.requests - k))))
            async with client.get("/health") as r:
                if r.status != 200:
                    findings.append(("/health", r.status))
            await asyncio.sleep(0.2)
            engine.check_integrity()
            st = engine.stats()
            if st.free_blocks != st.total_blocks or st.running or st.waiting:
                findings.append(("pages or requests left", str(st)))
    print(f"server fuzz, seed {args.seed}: {args.requests} requests, statuses {dict(sorted(statuses.items()))}, "
          f"{len(findings)} findings")
    for f in findings[:20]:
        print("   ", f)
    if args.verbose:
        for m, c in messages.most_common():
            print(f"{c:5d}  {m}")
    return 1 if findings else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["engine", "server"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=60, help="engine: engines built, each with one request mix")
    ap.add_argument("--round-timeout", type=float, default=120.0, help="engine: seconds before a round is a hang")
    ap.add_argument("--requests", type=int, default=400, help="server: requests sent")
    ap.add_argument("--junk", type=float, default=0.25, help="server: share of fields given a junk value")
    ap.add_argument("--verbose", action="store_true", help="server: every refusal message, counted")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("acb").setLevel(logging.ERROR)  # refusals and fallbacks log by design
    return asyncio.run(fuzz_engine(args) if args.mode == "engine" else fuzz_server(args))


if __name__ == "__main__":
    sys.exit(main())
