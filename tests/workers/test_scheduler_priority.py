"""The waiting queue's order by ``priority`` (vLLM's: lower first, arrival order among equals)."""

from __future__ import annotations

from tests.workers.test_scheduler import chunks, make_request, make_scheduler, scripted, step, synthetic
from workers.engine.request import RequestStatus


def admitted_order(priorities: list[int], max_num_seqs: int = 1) -> list[int]:
    """Request ids in the order the scheduler starts them, one at a time, each a 4-token prompt
    and one output token; request i has ``priorities[i]``."""
    scheduler = make_scheduler(max_num_seqs=max_num_seqs)
    for request_id, priority in enumerate(priorities):
        scheduler.add_request(make_request(request_id, 4, max_tokens=1, priority=priority))
    order = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler, scripted())
        order += [r.request_id for r in batch.requests if r.start_position == 0]
    return order


def test_lower_priority_values_are_admitted_first_and_equal_ones_in_arrival_order():
    assert admitted_order([0, 0, 0, 0]) == [0, 1, 2, 3]  # one priority: first come, first served
    assert admitted_order([5, 1, 3, 1, -2, 3]) == [4, 1, 3, 2, 5, 0]


def test_an_urgent_arrival_goes_ahead_of_the_queue_but_never_stops_a_running_request():
    scheduler = make_scheduler(max_num_seqs=1)
    for request_id in range(3):
        scheduler.add_request(make_request(request_id, 4, max_tokens=3))
    batch, _ = step(scheduler, scripted())
    assert chunks(batch) == [(0, 0, 4, True)]
    scheduler.add_request(make_request(9, 4, max_tokens=1, priority=-1))
    assert [r.request_id for r in scheduler.waiting] == [9, 1, 2]
    started = []
    while scheduler.has_unfinished():
        batch, _ = step(scheduler, scripted())
        started += [r.request_id for r in batch.requests if r.start_position == 0]
    assert started == [9, 1, 2]  # request 0 ran to its end first


def test_a_preempted_request_goes_back_ahead_of_its_priority_but_behind_more_urgent_ones():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=4)
    execute = synthetic(num_blocks=4)
    first = make_request(0, 6, max_tokens=6, priority=1)
    second = make_request(1, 6, max_tokens=6, priority=1)
    scheduler.add_request(first)
    scheduler.add_request(second)
    for _ in range(3):  # both hold 2 blocks, all the pool
        step(scheduler, execute)
    scheduler.add_request(make_request(2, 4, max_tokens=1, priority=0))
    scheduler.add_request(make_request(3, 4, max_tokens=1, priority=1))
    step(scheduler, execute)  # the first needs a third block: the second is preempted
    assert second.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in scheduler.waiting] == [2, 1, 3]


def test_a_request_holding_pulled_kv_is_never_overtaken():
    """A gen request whose KV arrived holds its blocks at the front of the queue: a more urgent
    arrival queues behind it, or it could wait for the blocks it holds itself."""
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4)
    remote = make_request(0, 10, max_tokens=2, priority=5)
    remote.output_token_ids.append(7)  # the ctx engine's first token
    scheduler.add_remote_request(remote)
    step(scheduler, scripted())  # allocates its blocks and publishes the pull
    assert [p.request_id for p in scheduler.take_kv_pulls()] == [0]
    scheduler.add_request(make_request(1, 4, max_tokens=1, priority=0))
    scheduler.finish_remote_kv(0)
    scheduler.add_request(make_request(2, 4, max_tokens=1, priority=-3))
    assert [r.request_id for r in scheduler.waiting] == [0, 2, 1]
