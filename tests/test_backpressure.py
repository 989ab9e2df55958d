"""The pure parts of backpressure and liveness: the gateway's in-flight limit and its Retry-After,
the scheduler queue's wait estimate, the migration token bucket, a replica's step evidence."""

import time

from services.gateway.admission import InflightLimit
from services.gateway.migration import ReplicaLiveness, TokenBucket
from services.scheduler.admission import AdmissionQueue, QueuedRequest
from shared.protocol import Heartbeat


def test_the_inflight_limit_refuses_past_it_and_says_when_to_come_back():
    limit = InflightLimit(2)
    assert limit.try_acquire() and limit.try_acquire() and not limit.try_acquire()
    assert limit.refused == 1 and limit.retry_after() == 1.0  # no completion rate known yet: the minimum
    now = 100.0
    limit.release(now)
    for i in range(20):  # 10 completions a second, two in flight: they clear in well under a second
        assert limit.try_acquire()
        limit.release(now + 0.1 * (i + 1))
    assert limit.retry_after() == 1.0
    slow = InflightLimit(100)
    for _ in range(100):
        slow.try_acquire()
    slow.release(0.0)
    slow.try_acquire()
    slow.release(2.0)  # one completion in two seconds, a hundred in flight: come back much later
    assert slow.retry_after() == 30.0  # bounded


def test_the_queue_estimates_the_wait_of_each_class():
    q = AdmissionQueue()
    assert q.estimated_wait("standard") is None  # no drain rate yet: no estimate, no early refusal
    for i in range(10):
        q.push(QueuedRequest(f"s{i}", "t", "standard", 0.0, None))
    q.push(QueuedRequest("c0", "t", "critical", 0.0, None))
    q.note_dispatch_rate(dispatched=5, seconds=1.0)
    assert q.estimated_wait("critical") == 1 / 5  # only its own class is ahead of it
    assert q.estimated_wait("standard") == 11 / 5
    assert q.estimated_wait("sheddable") == 11 / 5
    assert q.retry_after() == 11 / 5


def test_the_migration_bucket_spaces_a_burst():
    bucket = TokenBucket(rate=10.0, burst=3)
    delays = [bucket.delay() for _ in range(5)]
    assert delays[:3] == [0.0, 0.0, 0.0]
    assert 0.09 < delays[3] < 0.11 and 0.19 < delays[4] < 0.21


def test_a_replica_steps_or_has_nothing_to_do():
    def hb(steps: int, running: int) -> Heartbeat:
        return Heartbeat(replica_id="r", model="m", deployment="m", state="ready", running=running,
                         steps_total=steps, timestamp=time.time())
    live = ReplicaLiveness(seen=0.0, steps=10, stepped=0.0)
    live.beat(hb(10, 3), now=5.0)  # work, no step: the step clock stands
    assert (live.seen, live.stepped) == (5.0, 0.0)
    live.beat(hb(11, 3), now=6.0)  # a step
    assert live.stepped == 6.0
    live.beat(hb(11, 0), now=9.0)  # nothing to do is not a stall
    assert live.stepped == 9.0
