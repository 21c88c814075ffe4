"""``LoopWaker``: the engine thread's wake-ups reach the loop through the waker's thread, coalesced per chain."""

from __future__ import annotations

import asyncio
import threading

from actors.batch_scheduler.chain import Chain, LoopWaker
from actors.batch_scheduler.core import StepOut

_NAME = "kvtier-loop-waker"


def _waker_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == _NAME and t.is_alive())


def test_a_wake_calls_the_function_on_the_loop() -> None:
    """``wake(loop, fn)`` from another thread runs ``fn`` on the loop's thread."""
    loop = asyncio.new_event_loop()
    waker = LoopWaker()
    try:
        done = loop.create_future()
        seen: list[int] = []

        def fn() -> None:
            seen.append(threading.get_ident())
            done.set_result(None)

        sender = threading.Thread(target=waker.wake, args=(loop, fn))
        sender.start()
        sender.join()
        loop.run_until_complete(asyncio.wait_for(done, 10))
        assert seen == [threading.get_ident()]
    finally:
        waker.close()
        loop.close()


def test_a_chain_with_a_waker_posts_one_wake_for_outputs_handed_over_together() -> None:
    """Two steps handed over before the loop runs: one post, both outputs in ``results``."""
    loop = asyncio.new_event_loop()
    waker = LoopWaker()
    try:
        posts: list[int] = []
        done = loop.create_future()

        def post() -> bool:
            posts.append(len(chain.results))
            loop.call_soon(done.set_result, None)
            return True

        chain = Chain(1, loop, post, budget=4, waker=waker)

        def engine_thread() -> None:
            chain.hand_over(StepOut())
            chain.hand_over(StepOut())

        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join()
        loop.run_until_complete(asyncio.wait_for(done, 10))
        assert posts == [2]
        assert chain.wake_pending
    finally:
        waker.close()
        loop.close()


def test_close_ends_the_thread() -> None:
    """After ``close`` the waker's thread ends (it never waits for the caller)."""
    before = _waker_threads()
    waker = LoopWaker()
    assert _waker_threads() == before + 1
    waker.close()
    waker._thread.join(10)
    assert _waker_threads() == before
