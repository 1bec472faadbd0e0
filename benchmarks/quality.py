"""What a lower precision costs: acb's bf16 (and other) forwards against its float32 one.

    python benchmarks/quality.py                        # float32 vs bfloat16, SmolLM2-135M
    python benchmarks/quality.py --dtypes float32,bfloat16 --tokens 24000 --prompts 16
    python benchmarks/quality.py --dtypes float32,int8,int8_bf16  # int8 weights (EngineConfig.quantization)
    python benchmarks/quality.py --dtypes float32,bfloat16,bfloat16_kv8,int8_bf16_kv8  # int8 KV pages too

A ``--dtypes`` name is a dtype, or ``int8`` (int8 weights and int8 activations, per group of 32
channels, smoothed, in the GEMMs, the lm_head bf16, float32 between them: acb.quantization) /
``int8_bf16`` (the same, bfloat16 between them),
or ``vllm_bfloat16`` / ``vllm_float32``: vLLM's CPU engine in that dtype
(``--vllm-venv``), scored on the same windows through its ``prompt_logprobs`` (what a peer's
bf16 costs on the same text: the context for acb's bf16 figures). A name ending in ``_kv8``
(``bfloat16_kv8``, ``int8_bf16_kv8``, ...) runs with int8 KV pages (``EngineConfig.kv_cache_dtype=
"int8"``), and its teacher-forced scores come from decode steps (every window's positions one
token a step, all windows batched), so that each position reads every earlier one from the
int8 pages, as generation does (a prefill reads its own keys as stored too, but through the
prefill kernel rather than the decode one generation runs).

    python benchmarks/quality.py --dtypes float32,bfloat16,vllm_bfloat16 --vllm-venv /work/vllm-venv

Three measures, each of acb's own forward as the engine runs it (the fused CPU forward,
the native attention kernels over the paged cache):

1. teacher-forced perplexity on held-out real text (the license texts every Debian
   system ships in /usr/share/common-licenses: English prose no benchmark prompt is cut
   from), in windows of ``--window`` tokens, each a fresh prefill;
2. top-1 agreement: the share of those positions where a dtype's argmax next token is
   float32's (acb's forward, and transformers' own forward in that dtype beside it: what the
   dtype itself costs, whoever computes it);
3. greedy generation on the standard workload's prompts (``--prompts`` of them, 64 new
   tokens, EOS ignored) through the engine: how many come out identical to float32's
   and, for the others, where the first token differs. Also against transformers' own
   ``generate`` in the same dtype (bf16 greedy is reported, never pretended exact).

Prints a table and writes JSON (default bench-results/quality.json).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402

LICENSES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic", "CC0-1.0", "GPL-2")


def held_out_text() -> str:
    folder = Path("/usr/share/common-licenses")
    texts = [(folder / name).read_text(errors="replace") for name in LICENSES if (folder / name).is_file()]
    if not texts:
        raise SystemExit("quality.py: /usr/share/common-licenses is missing (not a Debian-like system)")
    return "\n\n".join(texts)


def fp32_probe(tokens: int, window: int):
    """For the sensitivity scripts: SmolLM2 in float32, its linear layers {name: (module, weight
    copy)}, and ``top1()``: the argmax at every position of the first ``tokens`` held-out tokens in
    windows of ``window`` (whatever the model's modules and hooks compute then)."""
    from acb.loading import load, smollm2

    folder, gguf = smollm2()
    model, tok = load(folder, gguf_file=gguf, dtype=torch.float32)
    model.eval()
    ids = tok(held_out_text())["input_ids"][:tokens]
    windows = torch.tensor([ids[i: i + window] for i in range(0, len(ids) - window + 1, window)])
    linears = {n: (m, m.weight.data.clone()) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    @torch.no_grad()
    def top1() -> torch.Tensor:
        return torch.cat([model(windows[i: i + 4]).logits.argmax(-1) for i in range(0, len(windows), 4)])

    return model, linears, top1


def score_and_restore(top1, exact: torch.Tensor, hooks: list, linears: dict) -> tuple[float, float]:
    """(top-1 agreement of ``top1()`` with ``exact``, seconds it took); then the sensitivity
    scripts' hooks removed and every linear's own weight put back."""
    t0 = time.perf_counter()
    agreement = (top1() == exact).float().mean().item()
    for h in hooks:
        h.remove()
    for m, w in linears.values():
        m.weight.data = w
    return agreement, time.perf_counter() - t0


def write_probe_rows(out: str, script: str, tokens: int, exact: torch.Tensor, rows: list[dict]) -> None:
    """The sensitivity scripts' result file: their rows of top-1 agreement, dated, with the command."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "scored_tokens": int(exact.numel()),
                                "source": f"python benchmarks/{script} --tokens {tokens}", "rows": rows}, indent=1))


def window_logits(runner, tokens: list[int], pages: list[int]) -> torch.Tensor:
    """float32 logits at every position of ``tokens``, one fresh prefill through the
    runner's forward (the fused one where it serves) and acb's attention."""
    from acb.attention.context import ForwardContext, run
    from acb.core.step import StepInput

    step = StepInput()
    step.add_row(tokens, 0, pages)
    runner.kv.update_tables(step)  # the block-table deltas first, as ModelRunner.execute applies them
    input_ids, position_ids, _, meta = runner._build(step)
    with torch.inference_mode():
        out = run(runner.fast_paths.varlen_forward, ForwardContext(meta), input_ids=input_ids.unsqueeze(0),
                  position_ids=position_ids.unsqueeze(0), attention_mask=None, use_cache=False,
                  logits_to_keep=torch.arange(len(tokens)))
    return out.logits[0].float()


def teacher_forced(model, ids: list[int], window: int) -> dict:
    """Negative log-likelihood and argmax per position over ``ids`` in windows."""
    from acb import EngineConfig
    from acb.worker.runner import ModelRunner

    page_size = 16
    pages = list(range(-(-window // page_size) + 1))
    runner = ModelRunner(model, len(pages) + 1, page_size)
    runner.configure_fast_paths(EngineConfig(), 1)
    nll, argmax = [], []
    try:
        for s in range(0, len(ids) - 1, window):
            chunk = ids[s: s + window + 1]
            if len(chunk) < 2:
                break
            logits = window_logits(runner, chunk[:-1], pages)
            logp = torch.log_softmax(logits.double(), -1)
            target = torch.tensor(chunk[1:])
            nll += (-logp.gather(1, target[:, None])[:, 0]).tolist()
            argmax += logits.argmax(-1).tolist()
        path = runner.forward_path
    finally:
        runner.release()
    return {"nll": nll, "argmax": argmax, "forward_path": path}


def teacher_forced_decode(model, ids: list[int], window: int, kv_cache_dtype: str | None) -> dict:
    """As :func:`teacher_forced`, but every position is a decode row over the pages the
    earlier positions were written to (all windows batched, one position a step)."""
    from acb import EngineConfig
    from acb.attention.context import ForwardContext, run
    from acb.core.step import StepInput
    from acb.worker.runner import ModelRunner

    windows = [c for c in (ids[s: s + window + 1] for s in range(0, len(ids) - 1, window)) if len(c) >= 2]
    page_size = 16
    per = -(-window // page_size)
    runner = ModelRunner(model, len(windows) * per + 1, page_size, kv_cache_dtype=kv_cache_dtype)
    runner.configure_fast_paths(EngineConfig(kv_cache_dtype=kv_cache_dtype), len(windows))
    nll: list[list[float]] = [[] for _ in windows]
    argmax: list[list[int]] = [[] for _ in windows]
    try:
        for t in range(window):
            live = [i for i, c in enumerate(windows) if t < len(c) - 1]
            if not live:
                break
            step = StepInput()
            for i in live:
                step.add_row([windows[i][t]], t, list(range(i * per, (i + 1) * per)), table_row=i)
            runner.kv.update_tables(step)
            runner.kv.zero_new_pages(step)
            input_ids, position_ids, keep, meta = runner._build(step)
            with torch.inference_mode():
                logits = run(runner.fast_paths.varlen_forward, ForwardContext(meta),
                             input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                             attention_mask=None, use_cache=False, logits_to_keep=keep).logits[0].float()
            logp = torch.log_softmax(logits.double(), -1)
            for j, i in enumerate(live):
                nll[i].append(-logp[j, windows[i][t + 1]].item())
                argmax[i].append(int(logits[j].argmax()))
        path = runner.forward_path + ", decode-scored"
    finally:
        runner.release()
    return {"nll": [x for w in nll for x in w], "argmax": [x for w in argmax for x in w], "forward_path": path}


def hf_teacher_forced(model, ids: list[int], window: int) -> list[int]:
    """transformers' own forward (its attention, no acb) over the same windows: argmax per position."""
    argmax = []
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, window):
            chunk = ids[s: s + window + 1]
            if len(chunk) < 2:
                break
            argmax += model(input_ids=torch.tensor([chunk[:-1]])).logits[0].argmax(-1).tolist()
    return argmax


VLLM_SCRIPT = r'''
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model_dir"], tokenizer=spec["model_dir"], dtype=spec["dtype"], max_model_len=1024)
    nll, argmax = [], []
    outs = llm.generate([TokensPrompt(prompt_token_ids=c) for c in spec["windows"]],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    for chunk, o in zip(spec["windows"], outs):
        for i in range(1, len(chunk)):  # position i: the distribution over token i given tokens < i
            entry = o.prompt_logprobs[i]
            nll.append(-entry[chunk[i]].logprob)
            argmax.append(next(t for t, lp in entry.items() if lp.rank == 1))
    gen = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
                       SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True), use_tqdm=False)
    json.dump({"nll": nll, "argmax": argmax, "greedy": [list(o.outputs[0].token_ids) for o in gen],
               "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}, open(spec["out"], "w"))
'''


def vllm_scored(venv: str, dtype: str, ids: list[int], window: int, prompts: list[list[int]], new: int) -> dict:
    """vLLM's CPU engine in ``dtype``: teacher-forced NLL and argmax over the same windows
    (its ``prompt_logprobs``), and greedy outputs; run by the venv's own python."""
    import os
    import subprocess
    import tempfile

    from acb.loading import smollm2
    from acb.model.loading import _converted_gguf

    windows = [ids[s: s + window + 1] for s in range(0, len(ids) - 1, window)]
    windows = [c for c in windows if len(c) >= 2]
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model_dir": str(_converted_gguf(*smollm2())), "dtype": dtype, "windows": windows,
                "prompts": prompts, "new_tokens": new, "out": os.path.join(tmp, "out.json")}
        Path(tmp, "spec.json").write_text(json.dumps(spec))
        Path(tmp, "run.py").write_text(VLLM_SCRIPT)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                   VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"))
        python = str(Path(venv) / "bin" / "python")
        subprocess.run([python, os.path.join(tmp, "run.py"), os.path.join(tmp, "spec.json")], env=env, check=True,
                       stdout=sys.stderr)
        res = json.loads(Path(spec["out"]).read_text())
    return {"ppl": math.exp(sum(res["nll"]) / len(res["nll"])), "tf": {"nll": res["nll"], "argmax": res["argmax"],
            "forward_path": f"vllm {res['dtype']}"}, "greedy": res["greedy"], "hf": None, "hf_argmax": None,
            "forward_path": f"vllm {res['dtype']}"}


def variant(name: str) -> tuple[torch.dtype, str | None, str | None]:
    """(the model's dtype, EngineConfig.quantization, EngineConfig.kv_cache_dtype) of a ``--dtypes`` name."""
    kv = "int8" if name.endswith("_kv8") else None
    name = name.removesuffix("_kv8")
    if name.startswith("int8"):
        return (torch.bfloat16 if name == "int8_bf16" else torch.float32), "int8", kv
    return getattr(torch, name), None, kv


def greedy(model, tok, prompts: list[list[int]], new: int, quantization: str | None = None,
           kv_cache_dtype: str | None = None) -> list[list[int]]:
    import acb

    async def run():
        config = acb.EngineConfig(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        async with acb.Engine(model, tokenizer=tok, config=config) as engine:
            done = await engine.generate_batch(prompts, max_new_tokens=new, ignore_eos=True)
        return [d.token_ids for d in done]

    return asyncio.run(run())


def hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' own greedy ``generate`` (EOS ignored, as the engine's run), in the model's dtype."""
    from acb.testing import reference_greedy

    return [reference_greedy(model, p, new) for p in prompts]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def divergence_summary(got: list[list[int]], ref: list[list[int]]) -> dict:
    firsts = [first_divergence(g, r) for g, r in zip(got, ref, strict=True)]
    diverged = sorted(f for f in firsts if f is not None)
    return {"identical": sum(f is None for f in firsts), "of": len(firsts), "first_divergence": diverged,
            "token_agreement": sum(x == y for g, r in zip(got, ref, strict=True) for x, y in zip(g, r, strict=False))
            / max(1, sum(len(r) for r in ref))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=24000, help="held-out tokens to score (>= 20000 for the report)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16, help="standard-workload prompts for the greedy comparison")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' own generate in each dtype")
    p.add_argument("--vllm-venv", default=None, help="vLLM's venv, for the vllm_<dtype> variants")
    p.add_argument("--out", default="bench-results/quality.json")
    args = p.parse_args()

    from systems import load_model

    base, tok = load_model()  # float32, never run itself: each dtype runs a fresh copy (an engine
    # prepacks the model it holds, and reference_greedy caches a copy on it)
    ids = tok(held_out_text())["input_ids"][: args.tokens + 1]
    w = workloads.build("standard", None, args.prompts, 2.0)
    results: dict[str, dict] = {}
    names = args.dtypes.split(",")
    if "float32" not in names:  # every measure is against float32: run it first, whatever was asked
        names.insert(0, "float32")
    for name in names:
        t0 = time.perf_counter()
        if name.startswith("vllm_"):
            if not args.vllm_venv:
                raise SystemExit(f"quality.py: {name} needs --vllm-venv")
            results[name] = vllm_scored(args.vllm_venv, name.removeprefix("vllm_"), ids, args.window, w.prompts,
                                        args.new_tokens)
            results[name]["seconds"] = time.perf_counter() - t0
            print(f"-- {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            continue
        dtype, quantization, kv = variant(name)
        model = copy.deepcopy(base).to(dtype)
        if quantization:  # in place, as the engine does (transformers' forward then runs the int8 modules too)
            from acb.model.quantization import quantize_

            quantize_(model, tokenizer=tok)  # the smoothing calibrated on acb's calibration text, as the engine does
        hf_tf = None if kv else hf_teacher_forced(model, ids, args.window)  # transformers has no int8 pages
        tf = teacher_forced_decode(model, ids, args.window, kv) if kv else teacher_forced(model, ids, args.window)
        gen = greedy(model, tok, w.prompts, args.new_tokens, quantization, kv)
        hf = None if args.no_hf or kv else hf_greedy(model, w.prompts, args.new_tokens)
        del model
        results[name] = {"ppl": math.exp(sum(tf["nll"]) / len(tf["nll"])), "tf": tf, "greedy": gen, "hf": hf,
                         "hf_argmax": hf_tf,
                         "forward_path": tf["forward_path"], "seconds": time.perf_counter() - t0}
        print(f"-- {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    ref = results["float32"]
    rows = []
    for name, r in results.items():
        agree = sum(a == b for a, b in zip(r["tf"]["argmax"], ref["tf"]["argmax"], strict=True)) / len(
            ref["tf"]["argmax"])
        hf_agree = None if r["hf_argmax"] is None else sum(
            a == b for a, b in zip(r["hf_argmax"], ref["tf"]["argmax"], strict=True)) / len(ref["tf"]["argmax"])
        row = {"dtype": name, "forward_path": r["forward_path"], "scored_tokens": len(r["tf"]["nll"]),
               "ppl": r["ppl"], "ppl_vs_fp32": r["ppl"] / ref["ppl"] - 1, "top1_agreement": agree,
               "hf_top1_agreement": hf_agree,
               "greedy_vs_fp32": divergence_summary(r["greedy"], ref["greedy"])}
        if r["hf"] is not None:
            row["greedy_vs_hf_same_dtype"] = divergence_summary(r["greedy"], r["hf"])
        rows.append(row)
    head = f"{'dtype':<16}{'path':<26}{'tokens':>8}{'ppl':>9}{'vs fp32':>9}{'top-1':>8}{'HF top-1':>9}" \
           f"{'greedy = fp32':>15}{'greedy = HF':>13}"
    print(head)
    print("-" * len(head))
    for r in rows:
        g = r["greedy_vs_fp32"]
        h = r.get("greedy_vs_hf_same_dtype")
        print(f"{r['dtype']:<16}{r['forward_path']:<26}{r['scored_tokens']:>8}{r['ppl']:>9.4f}"
              f"{r['ppl_vs_fp32']:>+9.2%}{r['top1_agreement']:>8.2%}"
              f"{format(r['hf_top1_agreement'], '.2%') if r['hf_top1_agreement'] is not None else '-':>9}"
              f"{g['identical']:>11}/{g['of']:<3}"
              f"{(str(h['identical']) + '/' + str(h['of'])) if h else '-':>13}")
        if g["first_divergence"]:
            print(f"   {r['dtype']}: first divergence from fp32 at tokens {g['first_divergence']}; "
                  f"token agreement {g['token_agreement']:.1%}")
        if h and h["first_divergence"]:
            print(f"   {r['dtype']}: first divergence from transformers' {r['dtype']} generate at tokens "
                  f"{h['first_divergence']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows,
                               "source": "python benchmarks/quality.py " + " ".join(sys.argv[1:]),
                               "text": "/usr/share/common-licenses: " + ", ".join(LICENSES),
                               "window": args.window}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
