"""Speculative decoding (EngineConfig.speculative_method="ngram" / "draft") against none, same run, SmolLM2.

    python benchmarks/speculative.py                                 # grounded at 1, 4, 16 + standard at 64
    python benchmarks/speculative.py --concurrency 1,4 --standard 0  # quick look
    python benchmarks/speculative.py --methods none,draft-tiny,draft-tiny:always,draft-self:always

Methods: ``none``, ``ngram``, ``draft-self`` (SmolLM2 drafting for itself: every greedy
proposal is its own argmax, so it measures what acceptance the machinery delivers, at the
cost of a draft as big as the model) and ``draft-tiny`` (a random 2-layer model with
SmolLM2's vocabulary: what a small draft's mirror forward and chain cost; its proposals
are nearly all rejected), ``draft-layersN`` (SmolLM2's first N layers with its norm and head:
a layer-skip draft, small and often right). ``:always`` pins the controller to propose all it may
(``acb.testing.speculate_always``), else the engine's cost model decides. SmolLM2-135M is
the smallest of its family here, so no real small sibling is measured.

The input-grounded workload (benchmarks/workloads.py ``input_grounded``: quote, summarise,
edit or continue a passage of real text) runs as a closed loop of ``c`` streams (each
stream submits its next prompt when the last one ends), and the standard workload's 64
prompts all at once, each first without speculation, then with it, on one loaded model.
Per request: generated tokens per second of its stream (tokens after the first over the
time from the first to the last, so queueing and prefill are left out) and its tokens'
inter-token latencies (a chunk of several tokens, one verified run, shares its gap evenly
among them). Reported: the p50 over requests of the first, the p50 over tokens of the
second, total generated tokens per second, and the proposals' acceptance.
Writes JSON (default bench-results/speculative.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402


async def closed_loop(engine, prompts: list[list[int]], concurrency: int, new: int, ignore_eos: bool) -> dict:
    """``concurrency`` streams working through ``prompts``; per-stream and total measures."""
    queue = list(reversed(list(enumerate(prompts))))
    outputs: list[list[int]] = [[] for _ in prompts]
    rates: list[float] = []
    itls: list[float] = []
    generated = 0
    s0 = engine.stats()

    async def stream() -> None:
        nonlocal generated
        while queue:
            index, prompt = queue.pop()
            times: list[tuple[float, int]] = []
            async for chunk in engine.stream(prompt, max_new_tokens=new, ignore_eos=ignore_eos):
                if chunk.token_ids:
                    times.append((time.perf_counter(), len(chunk.token_ids)))
                    outputs[index] += chunk.token_ids
            n = sum(k for _, k in times)
            generated += n
            if n > 1 and times[-1][0] > times[0][0]:
                rates.append((n - times[0][1]) / (times[-1][0] - times[0][0]))
            for (t0, _), (t1, k) in zip(times, times[1:]):
                itls.extend([(t1 - t0) / k] * k)

    t0 = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    proposed = s1.spec_proposed_tokens - s0.spec_proposed_tokens
    accepted = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    return {
        "concurrency": concurrency, "requests": len(prompts), "generated": generated, "wall_s": wall,
        "per_stream_tok_s_p50": statistics.median(rates) if rates else None,
        "itl_p50_ms": 1e3 * statistics.median(itls) if itls else None,
        "total_tok_s": generated / wall, "steps": s1.steps - s0.steps,
        "proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed if proposed else None,
        "outputs": outputs,
    }


def tiny_draft(model):
    """A random 2-layer Llama with ``model``'s vocabulary (tied embeddings, as SmolLM2's)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    c = model.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=True, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=next(model.parameters()).dtype).eval()


def truncated_draft(model, layers: int):
    """``model``'s first ``layers`` decoder layers, its final norm and head (a layer-skip draft:
    small, the same vocabulary, and often the model's own next token)."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(cfg, dtype=next(model.parameters()).dtype)
    keep = {k: v for k, v in model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(keep)
    return draft.eval()


def engine_config(model, mode: str, args):
    """(EngineConfig, pinned) of a method name (module docstring)."""
    import acb

    method, _, always = mode.partition(":")
    fields = dict(num_blocks=args.num_blocks)
    if method == "ngram":
        fields.update(speculative_method="ngram")
    elif method == "draft-self":
        fields.update(speculative_method="draft", draft_model=model)
    elif method == "draft-tiny":
        fields.update(speculative_method="draft", draft_model=tiny_draft(model))
    elif method.startswith("draft-layers"):
        fields.update(speculative_method="draft", draft_model=truncated_draft(model, int(method[12:])))
    elif method != "none":
        raise SystemExit(f"unknown method {mode!r}")
    return acb.EngineConfig(**fields), always == "always"


async def run_mode(model, tok, method: str, args, grounded, standard) -> list[dict]:
    import acb
    from acb.testing import speculate_always

    config, pinned = engine_config(model, method, args)
    out = []
    async with acb.Engine(model, tokenizer=tok, config=config) as engine:
        if pinned:
            speculate_always(engine)
        await engine.generate(grounded.prompts[0], max_new_tokens=8)  # warm-up (kernels, prepacking)
        for c in args.concurrency:
            prompts = grounded.prompts[: max(args.min_requests, args.per_stream * c)]
            r = await closed_loop(engine, prompts, c, grounded.max_new_tokens, ignore_eos=False)
            r.update(workload="grounded", method=method)
            print(json.dumps({k: v for k, v in r.items() if k != "outputs"}), flush=True)
            out.append(r)
        if standard is not None:
            r = await closed_loop(engine, standard.prompts, len(standard.prompts), standard.max_new_tokens,
                                  ignore_eos=True)
            r.update(workload="standard", method=method)
            print(json.dumps({k: v for k, v in r.items() if k != "outputs"}), flush=True)
            out.append(r)
    return out


async def main(args) -> None:
    from systems import load_model

    model, tok = load_model()
    grounded = workloads.input_grounded(tok, n=max(args.concurrency + [2]) * args.per_stream, max_new_tokens=args.new)
    standard = workloads.standard(limit=args.standard) if args.standard else None
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_start = os.getloadavg()
    results = []
    for _ in range(args.repeat):  # alternated, so drift on a shared machine falls on both
        for method in args.methods:
            results += await run_mode(model, tok, method, args, grounded, standard)
    load_end = os.getloadavg()
    plain = {(r["workload"], r["concurrency"]): r["outputs"] for r in results if r["method"] == "none"}
    # (with --repeat, each configuration is compared with the last run without speculation)
    for r in results:  # greedy: speculation must not change a single token
        r["identical_to_none"] = r["outputs"] == plain[(r["workload"], r["concurrency"])]
        del r["outputs"]
    record = {"date": started, "source": "benchmarks/speculative.py", "started": started,
              "load_start": load_start, "load_end": load_end,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "command": " ".join(["python"] + sys.argv), "workload_notes": grounded.notes, "results": results}
    print_table(results)
    print("greedy outputs identical with and without speculation:", all(r["identical_to_none"] for r in results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f}; wrote {out}")


def print_table(results: list[dict]) -> None:
    base = {(r["workload"], r["concurrency"]): r for r in results if r["method"] == "none"}
    print("| workload | streams | method | per-stream tok/s p50 | ITL p50 ms | total tok/s | acceptance | vs none |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        b = base.get((r["workload"], r["concurrency"]))
        ratio = r["per_stream_tok_s_p50"] / b["per_stream_tok_s_p50"] if b and b["per_stream_tok_s_p50"] else None
        acc = f"{r['acceptance']:.2f} ({r['accepted']}/{r['proposed']})" if r["acceptance"] is not None else "-"
        print(f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['per_stream_tok_s_p50']:.1f} | "
              f"{r['itl_p50_ms']:.1f} | {r['total_tok_s']:.1f} | {acc} | {ratio:.2f}x |" if ratio else
              f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['per_stream_tok_s_p50']:.1f} | "
              f"{r['itl_p50_ms']:.1f} | {r['total_tok_s']:.1f} | {acc} | |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4, 16],
                   help="grounded streams ('' for none)")
    p.add_argument("--methods", type=lambda s: [x for x in s.split(",") if x], default=["none", "ngram"],
                   help="none, ngram, draft-self, draft-tiny, draft-layersN, each optionally :always (first: none)")
    p.add_argument("--repeat", type=int, default=1, help="alternate the methods this many times")
    p.add_argument("--per-stream", type=int, default=2, help="grounded requests per stream")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--new", type=int, default=128, help="max new tokens of a grounded request")
    p.add_argument("--standard", type=int, default=64, help="standard-workload prompts run at once (0: skip)")
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--out", default=str(HERE.parent / "bench-results" / "speculative.json"))
    asyncio.run(main(p.parse_args()))
