"""The host slots' table (gateway/slots/host_table.py): the Redis scripts' rules, plain data,
owners are worker connections."""

from __future__ import annotations

from gateway.core.slots import Limit
from gateway.slots.host_table import HostSlots

LANE = Limit("lane:fast", 3)
EP_A, EP_B = Limit("ep:c:a", 2), Limit("ep:c:b", 2)


def test_the_table_grants_a_lane_slot_and_the_first_endpoint_with_room() -> None:
    table = HostSlots()
    assert table.acquire(1, "t1", LANE, [EP_A, EP_B]) == 0
    assert table.acquire(2, "t2", LANE, [EP_A, EP_B]) == 0
    assert table.acquire(1, "t3", LANE, [EP_A, EP_B]) == 1  # a is full
    assert table.acquire(2, "t4", LANE, [EP_A, EP_B]) == -1  # the lane is full
    assert table.acquire(1, "t1", LANE, [EP_A, EP_B]) == 0  # a retry reports, takes nothing
    assert table.in_use([LANE.key, EP_A.key, EP_B.key]) == [3, 2, 1]


def test_all_or_nothing_and_release_is_exact() -> None:
    table = HostSlots()
    full = Limit("ep:c:full", 0)
    assert table.acquire(1, "t1", LANE, [full]) == -1
    assert table.in_use([LANE.key]) == [0]  # no lane slot without an endpoint slot
    table.acquire(1, "t1", LANE, [EP_A])
    table.release(1, "t1", [LANE.key, EP_A.key])
    table.release(1, "t1", [LANE.key, EP_A.key])  # idempotent
    assert table.in_use([LANE.key, EP_A.key]) == [0, 0]
    assert table.owned == {1: {}}


def test_move_gives_up_one_endpoint_and_takes_another_keeping_the_lane() -> None:
    table = HostSlots()
    table.acquire(1, "t1", LANE, [EP_A])
    assert table.move(1, "t1", EP_A.key, [EP_B]) == 0
    assert table.in_use([LANE.key, EP_A.key, EP_B.key]) == [1, 0, 1]
    assert table.move(1, "t1", EP_B.key, [Limit("ep:c:full", 0)]) == -1
    assert table.in_use([LANE.key, EP_B.key]) == [1, 0]  # the lane slot only


def test_reclaim_drops_everything_a_connection_held_or_waited_for() -> None:
    table = HostSlots()
    table.acquire(1, "t1", LANE, [EP_A])
    table.acquire(1, "t2", LANE, [EP_B])
    table.acquire(2, "t3", LANE, [EP_A])
    table.join(1, "w1", LANE.key)
    assert table.reclaim(1) == 2
    assert table.in_use([LANE.key, EP_A.key, EP_B.key]) == [1, 1, 0]
    assert table.queues[LANE.key] == {}


def test_waiters_of_other_workers_keep_their_place() -> None:
    table = HostSlots()
    one = Limit("lane:one", 1)
    table.acquire(1, "held", one, [EP_A])
    table.join(1, "w1", one.key)  # worker 1 waits first
    table.release(1, "held", [one.key, EP_A.key])
    # A newcomer of worker 2 stands behind worker 1's waiter; worker 2's own later waiter too.
    assert table.acquire(2, "new", one, [EP_A]) == -1
    table.join(2, "w2", one.key)
    assert table.acquire(2, "w2", one, [EP_A]) == -1
    assert table.acquire(1, "w1", one, [EP_A]) == 0
    assert table.queues[one.key] == {"w2": 2}
