"""The prefix cache's disk tier (``EngineConfig.kv_disk_path`` / ``kv_disk_space``): full pages go to
files in the background and a later engine (a later process) loads them instead of computing them,
bit for bit; a file that is corrupt, truncated, foreign or half-written is never served; anything
that changes the KV values changes the keys; a directory that stops taking writes, a budget, two
engines on one directory, and bad settings refused by name."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import acb
from acb.core import kv_disk_files as files
from acb.testing import random_prompts, reference_greedy, tiny_engine, tiny_lora_model, tiny_model

ROOT = Path(__file__).resolve().parent.parent
PS = 8  # tiny_engine's page size
PROMPTS = random_prompts(3, 60, 90, seed=62)


def page_files(path) -> list[Path]:
    return sorted(Path(path).glob("*" + files.SUFFIX))


async def run(engine, prompts, max_new=6):
    return await asyncio.gather(*(engine.generate(p, max_new_tokens=max_new, temperature=0, ignore_eos=True)
                                  for p in prompts))


async def fill(path, prompts=PROMPTS, **fields):
    """An engine over ``path`` computes ``prompts`` and is closed (its writes finished)."""
    async with tiny_engine(kv_disk_path=str(path), **fields) as engine:
        done = await run(engine, prompts)
    stats = engine.stats()
    assert stats.disk_pages_written > 0 and stats.disk_errors == 0
    return done


async def test_a_restarted_engine_loads_the_prefix_from_disk_bit_for_bit(tmp_path):
    model = tiny_model("llama")
    want = [reference_greedy(model, p, 6) for p in PROMPTS]
    first = await fill(tmp_path)
    assert [c.token_ids for c in first] == want
    assert all(c.metrics.num_cached_prompt_tokens == 0 for c in first)
    async with tiny_engine(kv_disk_path=str(tmp_path), debug_checks=True) as engine:
        again = await run(engine, PROMPTS)
        stats = engine.stats()
    assert [c.token_ids for c in again] == want  # float32: the same bits as computing them
    full = [(len(p) - 1) // PS for p in PROMPTS]
    assert [c.metrics.num_cached_prompt_tokens for c in again] == [n * PS for n in full]
    assert stats.disk_hits == stats.disk_pages_read == sum(full)
    assert stats.disk_errors == 0 and stats.disk_bytes_read > 0 and stats.disk_load_s > 0
    assert stats.prefix_hit_rate > 0.8


@pytest.mark.parametrize("fields", [dict(dtype="bfloat16"), dict(kv_cache_dtype="int8")])
async def test_pages_from_disk_equal_pages_from_the_cache_in_bf16_and_int8(tmp_path, fields):
    async with tiny_engine(kv_disk_path=str(tmp_path), **fields) as engine:
        await run(engine, PROMPTS)
        warm = await run(engine, PROMPTS)  # from the engine's own pages
    assert all(c.metrics.num_cached_prompt_tokens > 0 for c in warm)
    async with tiny_engine(kv_disk_path=str(tmp_path), **fields) as engine:
        loaded = await run(engine, PROMPTS)
        stats = engine.stats()
    assert [c.token_ids for c in loaded] == [c.token_ids for c in warm]
    assert stats.disk_hits == sum((len(p) - 1) // PS for p in PROMPTS) and stats.disk_errors == 0


async def test_pages_the_pool_evicted_come_back_from_disk_in_the_same_engine(tmp_path):
    prompts = random_prompts(5, 88, 90, seed=7)  # 11 full pages each; the pool holds 3 prompts' worth
    model = tiny_model("llama")
    async with tiny_engine(kv_disk_path=str(tmp_path), num_blocks=36) as engine:
        for p in prompts:
            await run(engine, [p])
            async with asyncio.timeout(30):
                while not engine.kv.disk.idle():
                    await asyncio.sleep(0.01)
        assert engine.stats().disk_hits == 0
        again = await engine.generate(prompts[0], max_new_tokens=6, temperature=0, ignore_eos=True)
        stats = engine.stats()
    assert again.token_ids == reference_greedy(model, prompts[0], 6)
    full = (len(prompts[0]) - 1) // PS
    assert again.metrics.num_cached_prompt_tokens == full * PS
    assert stats.disk_hits == full  # none of its pages was left in the pool


async def test_the_disk_counters_reach_the_metrics_page(tmp_path):
    from acb.integrations.metrics import ServerMetrics

    await fill(tmp_path)
    async with tiny_engine(kv_disk_path=str(tmp_path)) as engine:
        await run(engine, PROMPTS[:1])
        text = ServerMetrics().render(engine.stats())
    hits = next(line for line in text.splitlines() if line.startswith("acb_kv_disk_hits_total"))
    assert float(hits.split()[-1]) == (len(PROMPTS[0]) - 1) // PS
    assert "acb_kv_disk_errors_total 0" in text and "acb_kv_disk_pages_written_total" in text


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
async def test_a_damaged_page_file_is_detected_deleted_and_recomputed(tmp_path, damage):
    prompt = PROMPTS[0]
    want = reference_greedy(tiny_model("llama"), prompt, 6)
    await fill(tmp_path, [prompt])
    async with tiny_engine(kv_disk_path=str(tmp_path)) as probe:  # which file is the prompt's 3rd page
        key = probe.kv.disk.keys(prompt, 3, None)[2]
    victim = Path(files.page_path(str(tmp_path), key))
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[files.HEADER_SIZE + len(data) // 3] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "foreign":  # another page's file under this page's name
        other = next(p for p in page_files(tmp_path) if p != victim)
        data = bytearray(other.read_bytes())
    else:
        data = bytearray(os.urandom(len(data)))
    victim.write_bytes(bytes(data))
    async with tiny_engine(kv_disk_path=str(tmp_path), debug_checks=True) as engine:
        done = await engine.generate(prompt, max_new_tokens=6, temperature=0, ignore_eos=True)
        stats = engine.stats()
    assert done.token_ids == want
    assert stats.disk_errors == 1
    assert done.metrics.num_cached_prompt_tokens == 2 * PS  # the pages before the bad one
    assert stats.disk_hits == 2
    # deleted, then written again from the recomputed page (a good file now)
    assert files.read_page(str(victim), engine.kv.disk.fingerprint, key, engine.kv.disk.page_bytes)


@pytest.mark.parametrize("change", [dict(seed=1), dict(dtype="bfloat16"), dict(page_size=4),
                                    dict(kv_cache_dtype="int8"), dict(cpu_fused_forward=False)])
async def test_pages_are_never_reused_by_another_model_dtype_or_layout(tmp_path, change):
    await fill(tmp_path)
    written = len(page_files(tmp_path))
    async with tiny_engine(kv_disk_path=str(tmp_path), **change) as engine:
        done = await run(engine, PROMPTS)
        stats = engine.stats()
    assert stats.disk_hits == 0 and stats.disk_pages_read == 0 and stats.disk_errors == 0
    assert all(c.metrics.num_cached_prompt_tokens == 0 for c in done)
    assert len(page_files(tmp_path)) > written  # its own pages, under its own keys


async def test_an_adapter_never_reuses_the_base_models_pages_nor_the_reverse(tmp_path):
    lora = tiny_lora_model("llama", seed=4, r=4)
    prompt = PROMPTS[0]
    await fill(tmp_path, [prompt])
    async with tiny_engine(kv_disk_path=str(tmp_path), max_adapters=1, max_adapter_rank=4) as engine:
        await engine.load_adapter(lora, "a")
        with_adapter = await engine.generate(prompt, adapter="a", max_new_tokens=6, ignore_eos=True)
        assert with_adapter.metrics.num_cached_prompt_tokens == 0
        assert engine.stats().disk_hits == 0
        base = await engine.generate(prompt, max_new_tokens=6, ignore_eos=True)  # the base pages still serve
        assert base.metrics.num_cached_prompt_tokens == (len(prompt) - 1) // PS * PS
    assert with_adapter.token_ids == reference_greedy(lora, prompt, 6)
    async with tiny_engine(kv_disk_path=str(tmp_path), max_adapters=1, max_adapter_rank=4) as engine:
        await engine.load_adapter(lora, "a")  # a restart: the adapter's own pages come from disk
        again = await engine.generate(prompt, adapter="a", max_new_tokens=6, ignore_eos=True)
    assert again.metrics.num_cached_prompt_tokens > 0 and again.token_ids == with_adapter.token_ids


async def test_a_directory_that_stops_taking_writes_keeps_serving_with_one_warning(tmp_path, monkeypatch, caplog):
    await fill(tmp_path, PROMPTS[:1])

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(files, "write_page", read_only)
    want = [reference_greedy(tiny_model("llama"), p, 6) for p in PROMPTS]
    with caplog.at_level(logging.WARNING, logger="acb"):
        async with tiny_engine(kv_disk_path=str(tmp_path)) as engine:
            done = await run(engine, PROMPTS)
            done += await run(engine, random_prompts(4, 40, 60, seed=5))
            stats = engine.stats()
    assert [c.token_ids for c in done[:3]] == want
    assert done[0].metrics.num_cached_prompt_tokens > 0  # reads go on
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "Read-only" in warnings[0].getMessage()
    assert stats.disk_pages_written == 0 and stats.disk_dropped_writes > 0


async def test_the_directory_stays_within_its_budget_least_recently_used_out(tmp_path):
    async with tiny_engine(kv_disk_path=str(tmp_path)) as probe:
        file_bytes = probe.kv.disk.file_bytes
    budget = 12 * file_bytes
    space = budget / 2**30
    prompts = random_prompts(6, 50, 60, seed=9)  # 6 or 7 full pages each: far over 12 pages
    async with tiny_engine(kv_disk_path=str(tmp_path), kv_disk_space=space, debug_checks=True) as engine:
        for p in prompts:
            await run(engine, [p])
        kept = engine.kv.disk.keys(prompts[-1], (len(prompts[-1]) - 1) // PS, None)
    sizes = [f.stat().st_size for f in page_files(tmp_path)]
    assert sum(sizes) <= budget
    present = {bytes.fromhex(f.name[:64]) for f in page_files(tmp_path)}
    assert set(kept) <= present  # the newest prompt's pages are what stays
    first = engine.kv.disk.keys(prompts[0], 5, None)
    assert not set(first) & present
    async with tiny_engine(kv_disk_path=str(tmp_path), kv_disk_space=space) as engine:  # a restart reads them
        done = await engine.generate(prompts[-1], max_new_tokens=4, temperature=0, ignore_eos=True)
    assert done.metrics.num_cached_prompt_tokens == len(kept) * PS


async def test_two_engines_on_one_directory(tmp_path):
    prompts = random_prompts(8, 40, 80, seed=21)
    model = tiny_model("llama")
    want = [reference_greedy(model, p, 6) for p in prompts]
    a = tiny_engine(kv_disk_path=str(tmp_path), debug_checks=True)
    b = tiny_engine(kv_disk_path=str(tmp_path), debug_checks=True)
    async with a, b:
        got = await asyncio.gather(run(a, prompts[:5]), run(b, prompts[3:]))
        async with asyncio.timeout(30):
            while not (a.kv.disk.idle() and b.kv.disk.idle()):
                await asyncio.sleep(0.01)
        # each reads what the other wrote (a file unknown to its index is found by name)
        crossed = await asyncio.gather(run(a, prompts[5:6]), run(b, prompts[:1]))
    assert [c.token_ids for c in got[0] + got[1][2:]] == want
    assert [c.token_ids for part in crossed for c in part] == [want[5], want[0]]
    assert all(c.metrics.num_cached_prompt_tokens > 0 for part in crossed for c in part)
    assert a.stats().disk_errors == b.stats().disk_errors == 0
    assert not list(Path(tmp_path).glob(".*.tmp"))


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="kv_disk_space"):
        acb.EngineConfig(kv_disk_path=str(tmp_path), kv_disk_space=0)
    with pytest.raises(ValueError, match="kv_disk_path"):
        acb.EngineConfig(kv_disk_path="")
    with pytest.raises(ValueError, match="kv_disk_path"):
        acb.EngineConfig(kv_disk_path=str(tmp_path), tensor_parallel_size=2)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="kv_disk_path.*not a directory|kv_disk_path.*cannot be created"):
        tiny_engine(kv_disk_path=str(a_file))
    with pytest.raises(ValueError, match="kv_disk_path.*cannot be created"):
        tiny_engine(kv_disk_path=str(a_file / "below"))
    with pytest.raises(ValueError, match="kv_disk_space must hold at least one page"):
        tiny_engine(kv_disk_path=str(tmp_path), kv_disk_space=1000 / 2**30)
    if os.geteuid() != 0:  # root writes anywhere: the permission bits do not stop it
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="kv_disk_path.*not writable"):
            tiny_engine(kv_disk_path=str(locked))


# --------------------------------------------------------------------------- kill -9 mid-write
_WRITER = textwrap.dedent("""
    import asyncio, sys
    from acb.testing import random_prompts, tiny_engine

    async def main():
        async with tiny_engine(kv_disk_path=sys.argv[1]) as engine:
            print("ready", flush=True)
            for i in range(10_000):
                await asyncio.gather(*(engine.generate(p, max_new_tokens=9, ignore_eos=True)
                                       for p in random_prompts(4, 30, 120, seed=1000 + i)))

    asyncio.run(main())
""")


@pytest.mark.extras  # a process started, killed and started again: CI's extras step
def test_a_process_killed_mid_write_never_leaves_a_page_that_is_served(tmp_path):
    """Two writers on one directory (the same prompts, so their writes of a page race too), each
    killed with SIGKILL at its own random point of the writes."""
    rng = random.Random(62)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        for proc, files_before_kill in zip(procs, (4, 12), strict=True):
            deadline = time.monotonic() + 60
            while len(page_files(tmp_path)) < files_before_kill and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.3))  # a random point of the writes
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert len(page_files(tmp_path)) > 5
    # every file there checks or is caught: damage one more by hand, as a torn write would be
    torn = page_files(tmp_path)[0]
    torn.write_bytes(torn.read_bytes()[: files.HEADER_SIZE + 10])
    prompts = [p for i in range(3) for p in random_prompts(4, 30, 120, seed=1000 + i)]
    model = tiny_model("llama")

    async def again():
        async with tiny_engine(kv_disk_path=str(tmp_path), debug_checks=True) as engine:
            done = await run(engine, prompts, max_new=9)
        return done, engine.stats()

    done, stats = asyncio.run(again())
    assert [c.token_ids for c in done] == [reference_greedy(model, p, 9) for p in prompts]
    assert stats.disk_hits > 0  # what the killed processes finished is reused
    assert stats.disk_errors <= 1  # the torn file, if a prompt reached it; no other file is bad
    assert not list(Path(tmp_path).glob(".*.tmp"))  # their unfinished temporaries are gone


# --------------------------------------------------------------------------- the file format alone
def test_a_page_file_round_trips_and_every_kind_of_damage_is_named(tmp_path):
    fp, key, payload = b"f" * 32, b"k" * 32, os.urandom(1000)
    size = files.write_page(str(tmp_path), key, fp, 7, payload)
    path = files.page_path(str(tmp_path), key)
    assert size == os.path.getsize(path) == files.HEADER_SIZE + 1000
    assert files.read_page(path, fp, key, 1000) == payload
    assert files.read_chain_hash(path) == 7
    with pytest.raises(files.CorruptPage, match="foreign"):
        files.read_page(path, b"g" * 32, key, 1000)
    with pytest.raises(files.CorruptPage, match="expected"):
        files.read_page(path, fp, key, 999)
    raw = bytearray(Path(path).read_bytes())
    raw[20] ^= 1
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(files.CorruptPage, match="header checksum"):
        files.read_page(path, fp, key, 1000)
    assert not list(tmp_path.glob(".*.tmp"))


def test_keys_chain_over_the_prefix_and_are_salted_by_the_fingerprint_and_adapter():
    tokens = list(range(40))
    root = files.disk_root(b"a" * 32, None)
    keys = files.disk_keys(root, tokens, 8, 4)
    assert len(set(keys)) == 4
    assert files.disk_keys(root, [99] + tokens[1:], 8, 4)[1] != keys[1]  # a page depends on all before it
    assert files.disk_keys(files.disk_root(b"b" * 32, None), tokens, 8, 4)[0] != keys[0]
    assert files.disk_keys(files.disk_root(b"a" * 32, 5), tokens, 8, 4)[0] != keys[0]


def test_temporaries_of_a_dead_writer_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".{'ab' * 32}.{int(dead.stdout)}.1.tmp"
    live = tmp_path / f".{'cd' * 32}.{os.getppid()}.1.tmp"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    assert files.remove_stale_temporaries(str(tmp_path)) == 1
    assert not stale.exists() and live.exists()
