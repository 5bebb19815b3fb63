"""A striped call's units are distinct bytes of its declared data (hardening round 5, item 5): a unit that
overlaps another, or lies past the declared length, is refused, so what the receiver holds ahead stays
inside the push's own reserved bytes (every overlapping unit was held: 384 MiB on a push declaring
4 MiB took the coordinator's RSS from 279 to 659 MiB)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from atoll.coordinator.transport.connection import Connection
from atoll.coordinator.transport.striped import Striped
from atoll.protos.bulk import END, UNIT

MiB = 1 << 20


def unit(offset: int, length: int, fill: int = 1) -> bytes:
    return UNIT.pack(offset, length) + bytes([fill]) * length


async def receive(sends: list[list[bytes]], declared: int, take: int):
    """Serve a striped call over socket pairs whose client ends send ``sends`` (one list a connection):
    read ``take`` bytes in order; (what came, the error if any, the most bytes held ahead)."""
    pairs = [socket.socketpair() for _ in sends]
    for a, b in pairs:
        a.setblocking(False)
        b.setblocking(False)
    loop = asyncio.get_running_loop()
    conns = [Connection(a) for a, _ in pairs]
    data = Striped(conns)
    data.bound(declared)
    held = 0

    async def client(sock, parts):
        for part in parts:
            await loop.sock_sendall(sock, part)

    async def watch():
        nonlocal held
        while True:
            held = max(held, data.held)
            await asyncio.sleep(0)

    writers = [asyncio.create_task(client(b, parts)) for (_, b), parts in zip(pairs, sends, strict=True)]
    watcher = asyncio.create_task(watch())
    out, error = bytearray(), None
    try:
        while len(out) < take:
            view = memoryview(bytearray(take - len(out)))
            n = await asyncio.wait_for(data.recv_into(view), 10)
            out += view[:n]
    except ValueError as err:
        error = err
    finally:
        held = max(held, data.held)
        await data.close()
        for w in [*writers, watcher]:
            w.cancel()
        await asyncio.gather(*writers, watcher, return_exceptions=True)
        for a, b in pairs:
            a.close()
            b.close()
    return bytes(out), error, held


def test_units_in_order_over_two_connections_arrive_whole():
    got, error, _ = asyncio.run(
        receive(
            [[unit(0, MiB, 1), unit(2 * MiB, MiB, 3), UNIT.pack(END, 0)], [unit(MiB, MiB, 2), UNIT.pack(END, 0)]],
            declared=3 * MiB,
            take=3 * MiB,
        )  # fmt: skip
    )
    assert error is None and got == bytes([1]) * MiB + bytes([2]) * MiB + bytes([3]) * MiB


@pytest.mark.parametrize(
    "sends",
    [
        # a unit overlapping one held ahead (both past the frontier, on two connections)
        [[unit(3 * MiB, MiB)], [unit(3 * MiB + 4096, MiB)]],
        # the same offsets as many times as there are connections: the second one is refused
        [[unit(2 * MiB, MiB)], [unit(2 * MiB, MiB)]],
        # a unit that ends past the declared data
        [[unit(4 * MiB - 100, MiB)], []],
    ],
    ids=["overlapping", "repeated", "past-the-end"],
)
def test_a_unit_out_of_place_is_refused_and_nothing_outside_the_declared_bytes_is_held(sends):
    got, error, held = asyncio.run(receive(sends, declared=4 * MiB, take=MiB))
    assert isinstance(error, ValueError) and "overlaps another, or lies outside the declared data" in str(error)
    assert held <= MiB and got == b""  # (the first unit, at most: the second is never held)


def test_many_overlapping_units_hold_at_most_the_declared_bytes():
    """The attack as it was: units at every 64 KiB step of a 4 MiB push, each 1 MiB long (overlapping),
    with the first bytes never sent: the first overlap is refused, what was held is inside 4 MiB."""
    step = 64 << 10
    parts = [unit(o, MiB) for o in range(step, 4 * MiB - MiB, step)]
    got, error, held = asyncio.run(receive([parts, []], declared=4 * MiB, take=MiB))
    assert isinstance(error, ValueError) and 0 < held <= 4 * MiB
