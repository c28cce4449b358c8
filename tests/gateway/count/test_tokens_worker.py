"""gigatoken in a child process: the same counts as in-process, replaced past its memory bound,
restarted when killed, gone when closed. ``counting.max_encoder_rss_mb: null`` keeps it in the
gateway's own process."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from gateway.count.tokenizers.backends import EncoderLimits
from gateway.count.tokenizers.encoders import GigatokenEncoder
from gateway.count.tokenizers.sources import load_vocabulary
from gateway.count.tokenizers.worker import ChildEncoder
from gateway.count.tokens import TokenCounter
from gateway.settings import TokenizerSettings, parse_settings
from tests.conftest import lanes_config

CL100K = TokenizerSettings(source="builtin", name="cl100k_base")
TEXTS = [
    "plain prose, with punctuation; and numbers 12345.",
    "日本語と中文 🎉 e\u0301 क़ <|endoftext|> tail",
    '{"id": 17, "tags": ["a", "b"]}\n' * 50,
]


def _alive(pid: int) -> bool:
    """Running: a zombie (killed, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_child_counts_exactly_what_the_in_process_tokenizer_counts() -> None:
    inproc = load_vocabulary(CL100K, limits=EncoderLimits(max_rss_mb=None)).encoder
    child = load_vocabulary(CL100K, limits=EncoderLimits(max_rss_mb=512)).encoder
    assert isinstance(inproc, GigatokenEncoder) and isinstance(child, ChildEncoder)
    try:
        assert child.count_many(TEXTS) == inproc.count_many(TEXTS)
        assert child.try_count_many(TEXTS[:1]) == inproc.count_many(TEXTS[:1])
        assert [child.encode(t) for t in TEXTS] == [inproc.encode(t) for t in TEXTS]
        big = "word " * 300_000  # above the GIL-free batch threshold
        assert child.count_many([big]) == inproc.count_many([big])
        assert child.pid != os.getpid()
    finally:
        child.close()


def test_past_its_bound_the_child_is_replaced_and_memory_comes_back() -> None:
    # A replacement is a fork of the template, then a count of warm_chars through its pipe:
    # 2M characters keep it busy long enough (~0.1 s) to see the old child answer meanwhile.
    limits = EncoderLimits(max_rss_mb=128, warm_chars=2_000_000)
    child = load_vocabulary(CL100K, limits=limits).encoder
    assert isinstance(child, ChildEncoder)
    try:
        first_pid, loaded, template = child.pid, child.rss_mb, child.template_pid
        bound = child.bound_mb
        assert bound >= loaded  # a bound under the loaded size is raised, not looped on
        rng = np.random.default_rng(5)
        peak = 0.0
        # Calls the old child answered while its replacement was loading, by recycle.
        answered_meanwhile: dict[int, int] = {}
        deadline = time.monotonic() + 240
        with capture_logs() as logs:
            # base64 grows gigatoken's cache ~6 MB per MB of text; each replacement loads while
            # this loop keeps the old child busy.
            while child.recycles < 2 and time.monotonic() < deadline:
                text = base64.b64encode(rng.bytes(30_000)).decode()
                pending = child._pending
                assert child.count_many([text])[0] > 0
                if pending is not None and pending.is_alive():  # answered, the load still on
                    answered_meanwhile[child.recycles] = (
                        answered_meanwhile.get(child.recycles, 0) + 1
                    )
                peak = max(peak, child.rss_mb)
        assert child.recycles >= 2, (loaded, bound, peak)
        assert child.pid != first_pid
        assert _gone(first_pid)
        # No count waited for a load: during each of the two loads the old child kept answering.
        assert answered_meanwhile.get(0, 0) > 0 and answered_meanwhile.get(1, 0) > 0, (
            answered_meanwhile
        )
        events = [e["event"] for e in logs]
        assert "tokenizer.recycle_started" in events and "tokenizer.recycled" in events
        # Each replacement was a fork of the one template: no tokenizer loaded again.
        assert child.template_pid == template and "tokenizer.template_ready" not in events
        assert [e["template_pid"] for e in logs if e["event"] == "tokenizer.child_warmed"] == [
            template
        ] * child.recycles
        # The replacement counts as the first did.
        assert child.count_many(TEXTS) == load_vocabulary(
            CL100K, limits=EncoderLimits(max_rss_mb=None)
        ).encoder.count_many(TEXTS)
    finally:
        child.close()


def _huge_kb(pid: int) -> int:
    """The process's anonymous memory mapped in transparent huge pages, in kB."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
        line = next(x for x in rollup if x.startswith("AnonHugePages:"))
    return int(line.split()[1])


def _thp_mode() -> str:
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return modes.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(_thp_mode() == "never", reason="no transparent huge pages on this host")
def test_the_cache_table_a_counting_child_grows_gets_no_huge_pages() -> None:
    """gigatoken asks for huge pages on its pre-token cache's table; each doubling of it in a
    counting child faulted its new table in 2 MiB at a time (lifetime.no_huge_pages: 310 ms
    of CPU for the doubling to 128 MiB, against 90 ms with 4 KiB pages). The child keeps the
    template's huge pages it shares, and gets none for what it grows."""
    child = load_vocabulary(CL100K, limits=EncoderLimits(max_rss_mb=4096)).encoder
    assert isinstance(child, ChildEncoder)
    try:
        shared_kb = _huge_kb(child.pid)
        loaded = child.rss_mb
        letters = bytes.maketrans(bytes(range(256)), b"abcdefghijklmnopqrstuvwxyz      " * 8)
        rng = np.random.default_rng(31)
        while child.rss_mb < loaded + 48:  # new words: the table doubles at least once
            child.count_many([rng.bytes(400_000).translate(letters).decode("ascii")])
        assert _huge_kb(child.pid) <= shared_kb, "the child's new table is in huge pages"
        with open(f"/proc/{child.pid}/status", encoding="ascii") as status:
            assert "THP_enabled:\t0" in status.read()
    finally:
        child.close()


def test_a_killed_child_is_replaced_and_the_call_answered() -> None:
    child = load_vocabulary(CL100K, limits=EncoderLimits(max_rss_mb=512)).encoder
    assert isinstance(child, ChildEncoder)
    try:
        expected = child.count_many(TEXTS)
        victim = child.pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        assert _gone(victim)
        with capture_logs() as logs:
            assert child.count_many(TEXTS) == expected
        assert child.pid != victim
        assert any(e.get("where") == "tokenizer.child" for e in logs)
    finally:
        child.close()
    assert not _alive(child.pid or 0) or _gone(child.pid or 0)
    assert _gone(child.template_pid)


def test_a_killed_template_is_started_again_when_a_child_is_needed() -> None:
    child = load_vocabulary(CL100K, limits=EncoderLimits(max_rss_mb=512)).encoder
    assert isinstance(child, ChildEncoder)
    try:
        expected = child.count_many(TEXTS)
        template, victim = child.template_pid, child.pid
        os.kill(template, signal.SIGKILL)
        assert _gone(template)
        assert child.count_many(TEXTS) == expected  # the counting child lives on without it
        os.kill(victim, signal.SIGKILL)
        assert _gone(victim)
        with capture_logs() as logs:
            assert child.count_many(TEXTS) == expected
        assert child.template_pid != template and child.pid != victim
        where = [e.get("where") for e in logs if e["event"] == "error.swallowed"]
        assert where == ["tokenizer.child", "tokenizer.template"]
        assert [e["event"] for e in logs].count("tokenizer.template_ready") == 1
    finally:
        child.close()
    assert _gone(child.template_pid) and _gone(child.pid)


@pytest.mark.parametrize("bound", [None, 384.0])
def test_the_setting_chooses_where_gigatoken_runs(bound: float | None) -> None:
    config = lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    config["counting"] = {"max_encoder_rss_mb": bound}
    counter = TokenCounter.from_settings(parse_settings(config, environ={}))
    encoder = counter._model("qwen3.6").vocab.encoder
    try:
        if bound is None:
            assert isinstance(encoder, GigatokenEncoder)
        else:
            assert isinstance(encoder, ChildEncoder) and encoder.max_rss_mb == bound
            pid = encoder.pid
    finally:
        counter.close()
    if bound is not None:
        assert pid is not None and _gone(pid)


async def test_with_the_child_the_event_loop_never_waits_for_a_count() -> None:
    import threading

    from gateway.protocols.openai import ChatPrompt

    config = lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    counter = TokenCounter.from_settings(parse_settings(config, environ={}))
    encoder = counter._model("qwen3.6").vocab.encoder
    assert isinstance(encoder, ChildEncoder) and encoder.out_of_process
    threads: list[str] = []
    real = encoder.count_many

    def spy(texts: list[str]) -> list[int]:
        threads.append(threading.current_thread().name)
        return real(texts)

    encoder.count_many = spy  # type: ignore[method-assign]
    try:
        prompt = ChatPrompt(messages=({"role": "user", "content": "a small miss " * 20},))
        count = await counter.count("qwen3.6", prompt, exact_above=0)
        assert count.method == "exact" and count.tokens > 0
        assert threads and threading.main_thread().name not in threads
    finally:
        counter.close()


async def test_a_bound_finished_in_the_worker_looks_the_cache_up_once() -> None:
    """The request's exact count after a bound decided the lane, with the encoder in its child:
    ``meanwhile`` looks each piece up in the cache, and the worker encodes only the misses
    (before: the worker's ``exact`` planned and looked every piece up a second time)."""
    from gateway.count.tokenizers.cache import CountCache
    from gateway.count.usage import ExactCount
    from gateway.protocols.openai import ChatPrompt

    config = lanes_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    counter = TokenCounter.from_settings(parse_settings(config, environ={}))
    lookups: list[bytes] = []

    class Spy(CountCache):
        def get(self, digest: bytes) -> int | None:
            lookups.append(digest)
            return super().get(digest)

    counter._cache = Spy(1000)
    try:
        messages = (
            {"role": "system", "content": "be brief " * 50},
            {"role": "user", "content": "a fresh miss " * 900},  # past DIRECT_MAX_BYTES
        )
        prompt = ChatPrompt(messages=messages)
        bound = await counter.count("qwen3.6", prompt, exact_above=10**9)
        assert bound.method == "bound" and lookups == []
        exact = ExactCount(counter, bound)
        exact.meanwhile()
        tokens = await exact.tokens(wait_s=30)
        pieces = len(bound.plan.pieces) if bound.plan else 0
        assert pieces >= 2 and len(lookups) == pieces  # once each, not twice
        assert tokens == counter.count_sync("qwen3.6", prompt, exact_above=0).tokens
    finally:
        counter.close()


def test_when_the_gateway_dies_its_template_and_children_end(tmp_path: Path) -> None:
    """No process outlives the gateway: the template reads the end of its control socket, each
    counting child the end of its pipe."""
    script = tmp_path / "holder.py"
    script.write_text(
        "import sys, time\n"
        "from gateway.count.tokenizers.backends import EncoderLimits\n"
        "from gateway.count.tokenizers.sources import load_vocabulary\n"
        "from gateway.settings import TokenizerSettings\n"
        "enc = load_vocabulary(TokenizerSettings(source='builtin', name='cl100k_base'),\n"
        "                      limits=EncoderLimits(max_rss_mb=512)).encoder\n"
        "print('pids', enc.template_pid, enc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=os.environ.copy()
    )
    try:
        assert holder.stdout is not None
        line = b""
        while not line.startswith(b"pids "):  # the log's lines come first
            line = holder.stdout.readline()
            assert line, "the holder exited before it printed its children"
        template, child = (int(pid) for pid in line.split()[1:])
        assert _alive(template) and _alive(child)
        holder.kill()  # SIGKILL: no finalizer, no close()
        holder.wait(timeout=10)
        assert _gone(template) and _gone(child)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()
