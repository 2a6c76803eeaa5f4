"""PromptWorker: work runs off the event loop, is answered by its deadline (400 when it ran too
long, 503 when it never started), pending jobs are bounded; gil_free_encoder gives the same
ids as the tokenizer's own encode (the reference) and lets other threads run meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.serve.engine.prompt_worker import PromptWorker, gil_free_encoder
from qkv.serve.api.schemas import ApiError


def test_work_runs_on_another_thread_and_returns() -> None:
    worker = PromptWorker(timeout=5)
    loop_thread = threading.get_ident()
    result = asyncio.run(worker.run(lambda x: (x * 2, threading.get_ident()), 21))
    worker.close()
    assert result[0] == 42 and result[1] != loop_thread


def test_an_error_in_the_work_reaches_the_caller() -> None:
    worker = PromptWorker(timeout=5)

    def fail() -> None:
        raise ApiError(400, "bad template")

    with pytest.raises(ApiError, match="bad template"):
        asyncio.run(worker.run(fail))
    worker.close()


def test_work_past_the_deadline_is_400_and_the_loop_is_free_meanwhile() -> None:
    worker = PromptWorker(timeout=0.3, threads=1)
    release = threading.Event()

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        with pytest.raises(ApiError) as caught:
            await worker.run(release.wait, 10)
        ticker.cancel()
        assert caught.value.status == 400 and caught.value.code == "prompt_timeout"
        return ticks

    assert asyncio.run(main()) >= 5  # the loop kept running while the work blocked
    release.set()
    worker.close()


def test_work_that_never_started_is_503_and_pending_is_bounded() -> None:
    worker = PromptWorker(timeout=0.3, threads=1, max_pending=2)
    release = threading.Event()

    async def main() -> None:
        first = asyncio.ensure_future(worker.run(release.wait, 10))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as queued:  # waits behind the first job, never starts
            await worker.run(lambda: None)
        assert queued.value.status == 503 and "Retry-After" in queued.value.headers
        second = asyncio.ensure_future(worker.run(release.wait, 10))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as busy:  # two pending already (one abandoned still counts)
            await worker.run(lambda: None)
        assert busy.value.status == 503 and "prompts already" in busy.value.message
        for job in (first, second):
            with pytest.raises(ApiError):
                await job

    asyncio.run(main())
    release.set()
    deadline = time.monotonic() + 5
    while worker.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.pending == 0
    worker.close()


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import chat_tokenizer

    return chat_tokenizer()


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200), st.booleans())
def test_gil_free_encoder_gives_the_same_ids(tokenizer, text: str, special: bool) -> None:
    reference = tokenizer.encode(text, add_special_tokens=special)
    got = gil_free_encoder(tokenizer)(text, add_special_tokens=special)
    assert got.ids == reference.ids and got.offsets == reference.offsets


def test_gil_free_encoder_lets_other_threads_run(tokenizer) -> None:
    text = "Keys, queries and values. " * 20_000  # new words each run: no cache hit makes it quick
    done = threading.Event()
    worker = threading.Thread(target=lambda: (gil_free_encoder(tokenizer)(text), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert ticks >= 10


def test_a_tokenizer_panic_is_a_json_500_not_a_crash() -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    panicking = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    panicking.pre_tokenizer = pre_tokenizers.Split(Regex("(a|aa)+$"), behavior="isolated")  # backtracks past onig's limit
    worker = PromptWorker(timeout=20)
    with pytest.raises(ApiError) as caught:
        asyncio.run(worker.run(gil_free_encoder(panicking), "a" * 40 + "!"))
    worker.close()
    assert caught.value.status == 500 and "tokenizer failed" in caught.value.message
