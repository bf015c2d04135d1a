"""Mailbox: a worker thread's calls reach the event loop in order, one wake-up per burst."""
import asyncio
import threading

import pytest

from services.common.mailbox import Mailbox


def test_calls_from_a_thread_run_on_the_loop_in_order_with_one_wake_up_per_burst():
    async def main():
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        wakes = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            wakes.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counting
        seen = []
        done = asyncio.Event()

        def burst():
            for i in range(100):
                box.post(seen.append, i)
            box.post(done.set)

        t = threading.Thread(target=burst)
        t.start()
        t.join()                        # the whole burst is posted before the loop runs again
        await asyncio.wait_for(done.wait(), 5)
        return seen, wakes

    seen, wakes = asyncio.run(main())
    assert seen == list(range(100))
    assert len(wakes) == 1


def test_a_later_burst_wakes_the_loop_again():
    async def main():
        box = Mailbox(asyncio.get_running_loop())
        out: asyncio.Queue = asyncio.Queue()
        for burst in range(3):
            t = threading.Thread(target=lambda b=burst: [box.post(out.put_nowait, (b, i)) for i in range(5)])
            t.start()
            t.join()
            got = [await asyncio.wait_for(out.get(), 5) for _ in range(5)]
            assert got == [(burst, i) for i in range(5)]

    asyncio.run(main())


def test_a_failing_call_is_reported_and_the_calls_after_it_still_run():
    async def main():
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["exception"]))
        box = Mailbox(loop)
        seen = []
        done = asyncio.Event()

        def boom():
            raise ValueError("bad call")

        t = threading.Thread(target=lambda: (box.post(boom), box.post(seen.append, 1), box.post(done.set)))
        t.start()
        t.join()
        await asyncio.wait_for(done.wait(), 5)
        return seen, errors

    seen, errors = asyncio.run(main())
    assert seen == [1]
    assert len(errors) == 1 and isinstance(errors[0], ValueError)


def test_posting_to_a_closed_loop_raises_and_a_new_post_may_try_again():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        box.post(print, "never")
    with pytest.raises(RuntimeError):          # not silently swallowed as "already scheduled"
        box.post(print, "never")
