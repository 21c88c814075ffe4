"""Mailboxes, tell/try_tell/ask, inboxes and ids on the real runtime."""

from __future__ import annotations

import anyio
import pytest

from actors.runtime import (
    Actor,
    ActorStopped,
    ActorSystem,
    AskCycle,
    AskTimeout,
    Context,
    HandlerFailed,
    MailboxClosed,
    MailboxFull,
    ReceiveTimeout,
    UnexpectedReply,
    UnknownAddress,
    use_correlation,
)
from messages import Envelope

from ._actors import Echo, Forward, Fragile, Gate, Relay, Silent, Streamer
from .demo_messages import Add, Count, GetTotal, Ping, Pong, Total, Work

pytestmark = pytest.mark.anyio


async def test_full_mailbox_makes_tell_wait_and_try_tell_report_full() -> None:
    """A full mailbox blocks ``tell`` until space frees, and ``try_tell`` returns False."""
    gate = anyio.Event()
    seen: list[Envelope] = []
    async with ActorSystem() as system:
        ref = system.spawn("gate", lambda: Gate(gate, seen), capacity=2)
        await ref.tell(Add(amount=1))
        await anyio.wait_all_tasks_blocked()  # the actor took message 1 and waits on the gate
        await ref.tell(Add(amount=2))
        await ref.tell(Add(amount=3))
        assert ref.statistics().depth == 2
        assert ref.try_tell(Add(amount=99)) is False
        with pytest.raises(MailboxFull):
            ref.tell_nowait(Add(amount=99))
        done = anyio.Event()

        async def blocked_sender() -> None:
            await ref.tell(Add(amount=4))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_sender)
            await anyio.wait_all_tasks_blocked()
            assert not done.is_set()
            assert ref.statistics().waiting_senders == 1
            gate.set()
            await done.wait()
        stats = ref.statistics()
        assert stats.rejected == 2
    assert [e.body.amount for e in seen if isinstance(e.body, Add)] == [1, 2, 3, 4]


async def test_ask_without_reply_raises_ask_timeout() -> None:
    """An ask that gets no reply fails with the typed ``AskTimeout`` at its deadline."""
    async with ActorSystem() as system:
        ref = system.spawn("silent", Silent)
        with anyio.fail_after(5):
            with pytest.raises(AskTimeout) as info:
                await ref.ask(Ping(n=1), timeout=0.05)
        assert info.value.address == "silent"
        assert info.value.kind == "demo.ping"


async def test_ask_returns_typed_reply_and_checks_expect() -> None:
    """``ask`` returns the reply body; a reply of another type is ``UnexpectedReply``."""
    async with ActorSystem() as system:
        ref = system.spawn("echo", Echo)
        pong = await ref.ask(Ping(n=3), timeout=5.0, expect=Pong)
        assert pong == Pong(n=3)
        with pytest.raises(UnexpectedReply):
            await ref.ask(Ping(n=4), timeout=5.0, expect=Total)


async def test_ask_cycle_is_detected_without_hanging() -> None:
    """A asks B asks A raises ``AskCycle`` at once instead of waiting out the deadline."""
    async with ActorSystem() as system:
        system.spawn("a", lambda: Relay("b"))
        system.spawn("b", lambda: Relay("a"))
        with anyio.fail_after(2):  # far below the asks' 5 s deadlines
            with pytest.raises(AskCycle) as info:
                await system.ask("a", Ping(n=1), timeout=30.0)
        assert info.value.chain == ("a", "b", "a")


async def test_self_ask_is_a_cycle() -> None:
    """An actor asking itself is the shortest cycle and fails the same way."""
    async with ActorSystem() as system:
        system.spawn("narcissus", lambda: Relay("narcissus"))
        with anyio.fail_after(2):
            with pytest.raises(AskCycle):
                await system.ask("narcissus", Ping(n=1), timeout=30.0)


async def test_handler_failure_fails_the_ask_fast() -> None:
    """A handler that raises answers its asker with ``HandlerFailed`` before the deadline."""
    async with ActorSystem() as system:
        system.spawn("relay", lambda: Relay("nowhere"))
        with anyio.fail_after(2):
            with pytest.raises(HandlerFailed) as info:
                await system.ask("relay", Ping(n=1), timeout=30.0)
        assert info.value.error == "UnknownAddress"


async def test_inbox_streams_until_end_and_late_sends_are_dead_letters() -> None:
    """An inbox yields a stream in order until ``end_stream``; sends after close are dead letters."""
    async with ActorSystem() as system:
        streamer = system.spawn("streamer", Streamer)
        async with system.open_inbox(capacity=2) as inbox:
            await streamer.tell(Work(job="s", amounts=(5, 6, 7, 8, 9), reply_to=inbox.address))
            got = [e.body.n async for e in inbox if isinstance(e.body, Count)]
            with pytest.raises(MailboxClosed):
                await inbox.receive(timeout=1.0)
        assert got == [5, 6, 7, 8, 9]
        with pytest.raises(UnknownAddress):
            await system.tell(inbox.address, Count(n=1))
        assert system.dead_letters()[-1].envelope.receiver == inbox.address


async def test_inbox_receive_deadline() -> None:
    """``Inbox.receive`` with a deadline and nothing sent raises ``ReceiveTimeout``."""
    async with ActorSystem() as system, system.open_inbox() as inbox:
        with pytest.raises(ReceiveTimeout):
            await inbox.receive(timeout=0.02)


async def test_correlation_and_causation_propagate() -> None:
    """Messages caused by a handled message carry its correlation id and its msg_id as cause."""
    gate = anyio.Event()
    gate.set()
    seen: list[Envelope] = []
    async with ActorSystem() as system:
        system.spawn("sink", lambda: Gate(gate, seen))
        forward = system.spawn("forward", lambda: Forward("sink"))
        with use_correlation("req-42"):
            await forward.tell(Add(amount=1))
        await forward.tell(Add(amount=2), correlation_id="req-43")
    first, second = seen
    assert first.correlation_id == "req-42"
    assert first.sender == "forward"
    assert first.causation_id is not None
    assert first.causation_id != first.msg_id
    assert second.correlation_id == "req-43"


async def test_statistics_count_handled_failed_and_time_in_mailbox() -> None:
    """Mailbox statistics report handled/failed counts and a time-in-mailbox percentile."""
    births: list[int] = []
    async with ActorSystem() as system:
        ref = system.spawn("fragile", lambda: Fragile(births))
        for amount in (1, 2, -1, 3):
            await ref.tell(Add(amount=amount))
        total = await ref.ask(GetTotal(), timeout=5.0, expect=Total)
        stats = system.statistics()
        one = stats.actor("fragile")
        assert (one.handled, one.failed, one.restarts) == (4, 1, 1)
        assert one.sent == 5
        assert one.time_in_mailbox_p99 >= one.time_in_mailbox_p50 > 0
        assert stats.as_dict()["handled"] == 4
    assert total == Total(total=3, count=1)  # fresh instance after the failure saw only Add(3)


async def test_tell_to_stopped_actor_raises_and_records_dead_letter() -> None:
    """After ``stop`` a tell raises ``ActorStopped`` and the message is a dead letter."""
    async with ActorSystem() as system:
        ref = system.spawn("echo", Echo)
        await system.stop()
        with pytest.raises(ActorStopped):
            await ref.tell(Ping(n=1))
        assert system.dead_letters()[-1].envelope.body == Ping(n=1)
        assert system.statistics().dead_letters == 1


async def test_an_error_in_the_system_block_propagates_unwrapped() -> None:
    """An exception raised inside ``async with ActorSystem()`` leaves it as itself, not a group."""

    async def failing_block() -> None:
        async with ActorSystem() as system:
            system.spawn("echo", Echo)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        await failing_block()


class _Requester(Actor):
    """On ``Count`` sends ``Ping`` to ``echo`` with itself as the reply slot; records what comes back."""

    def __init__(self, sent: list[str], answers: list[Envelope], arrived: anyio.Event) -> None:
        self.sent = sent
        self.answers = answers
        self.arrived = arrived

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        if isinstance(envelope.body, Count):
            self.sent.append(await ctx.request("echo", Ping(n=envelope.body.n)))
        elif isinstance(envelope.body, Pong):
            self.answers.append(envelope)
            self.arrived.set()


async def test_replies_and_notes_to_self_use_the_reserved_room_of_a_full_mailbox() -> None:
    """Ordinary sends stop at ``capacity``; replies and ``post`` still fit, up to ``reserve`` more, and are received in order."""
    gate = anyio.Event()
    seen: list[Envelope] = []
    async with ActorSystem() as system:
        ref = system.spawn("gate", lambda: Gate(gate, seen), capacity=2, reserve=2)
        await ref.tell(Add(amount=0))
        await anyio.wait_all_tasks_blocked()  # the actor holds message 0 at the gate
        await ref.tell(Add(amount=1))
        await ref.tell(Add(amount=2))
        assert ref.try_tell(Add(amount=99)) is False
        request = Envelope("m-x", "c-x", None, "external", "other", 0.0, Ping(n=1, reply_to="gate"))
        assert system.reply_nowait(request, Pong(n=1)) is True
        assert ref.post(Count(n=3)) is True
        assert system.reply_nowait(request, Pong(n=2)) is False  # NOTE: the reserve is used up
        assert ref.statistics().depth == 4
        gate.set()
    handled = [e.body for e in seen]
    assert handled == [Add(amount=0), Add(amount=1), Add(amount=2), Pong(n=1), Count(n=3)]
    assert [d.reason for d in system.dead_letters()] == ["reply slot full"]


async def test_end_stream_delivers_its_final_message_into_a_full_inbox() -> None:
    """A stream whose buffer is full still gets its final message (the reserved slot), then ends; a second final is a dead letter."""
    async with ActorSystem() as system:
        inbox = system.open_inbox(2)
        assert system.try_tell(inbox.address, Add(amount=1))
        assert system.try_tell(inbox.address, Add(amount=2))
        assert not system.try_tell(inbox.address, Add(amount=3))
        assert system.end_stream(inbox.address, Total(total=3, count=2)) is True
        assert system.end_stream(inbox.address, Total(total=0, count=0)) is False
        bodies = [e.body async for e in inbox]
    assert bodies == [Add(amount=1), Add(amount=2), Total(total=3, count=2)]


async def test_request_answers_arrive_in_the_mailbox_named_by_their_causation_id() -> None:
    """``ctx.request`` returns the request's msg_id; the answer lands in the sender's own mailbox carrying it as causation_id."""
    sent: list[str] = []
    answers: list[Envelope] = []
    arrived = anyio.Event()
    async with ActorSystem() as system:
        system.spawn("echo", Echo)
        ref = system.spawn("asker", lambda: _Requester(sent, answers, arrived))
        await ref.tell(Count(n=7))
        with anyio.fail_after(5):
            await arrived.wait()
        assert system.is_open("asker")
        assert not system.is_open("nowhere")
    assert [a.causation_id for a in answers] == sent
    assert answers[0].body == Pong(n=7)


async def test_blocked_senders_enter_in_order() -> None:
    """Senders blocked on a full mailbox are admitted first come first served as it drains, never overtaken by a new send."""
    gate = anyio.Event()
    seen: list[Envelope] = []
    async with ActorSystem() as system:
        ref = system.spawn("gate", lambda: Gate(gate, seen), capacity=1)
        await ref.tell(Add(amount=0))
        await anyio.wait_all_tasks_blocked()
        await ref.tell(Add(amount=1))
        async with anyio.create_task_group() as tg:
            for n in (2, 3, 4):
                tg.start_soon(ref.tell, Add(amount=n))
                await anyio.wait_all_tasks_blocked()
            assert ref.statistics().waiting_senders == 3
            assert not ref.try_tell(Add(amount=99))
            gate.set()
    assert [e.body.amount for e in seen if isinstance(e.body, Add)] == [0, 1, 2, 3, 4]


async def test_closing_a_stream_refuses_its_blocked_senders() -> None:
    """A sender blocked on a full inbox gets MailboxClosed when the stream ends; what was accepted is still read."""
    refused: list[str] = []
    async with ActorSystem() as system:
        inbox = system.open_inbox(1)
        await system.tell(inbox.address, Add(amount=1))

        async def blocked() -> None:
            try:
                await system.tell(inbox.address, Add(amount=2))
            except MailboxClosed:
                refused.append("closed")

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked)
            await anyio.wait_all_tasks_blocked()
            system.end_stream(inbox.address)
        bodies = [e.body async for e in inbox]
    assert refused == ["closed"]
    assert bodies == [Add(amount=1)]
