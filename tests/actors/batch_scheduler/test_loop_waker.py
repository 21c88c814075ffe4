"""``LoopWaker``: the engine thread's wake-ups reach the loop through the waker's thread, coalesced per chain."""

from __future__ import annotations

import asyncio
import threading
import time

from actors.batch_scheduler.chain import Chain, LoopWaker
from actors.batch_scheduler.core import StepOut


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
    """After ``close`` the waker's thread ends (``close`` itself never waits for it)."""
    waker = LoopWaker()
    started = waker.alive
    waker.close()
    for _ in range(1000):
        if not waker.alive:
            break
        time.sleep(0.01)
    assert started
    assert not waker.alive
