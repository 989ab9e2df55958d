"""The admission queue: priority classes, fairness across tenants, bounds, deadlines."""

from services.scheduler.admission import AdmissionQueue, QueuedRequest


def req(rid, tenant="t", priority="standard", at=0.0, deadline=None):
    return QueuedRequest(rid, tenant, priority, at, deadline)


def drain(q):
    out = []
    while (item := q.pop()) is not None:
        out.append(item.request_id)
    return out


def test_higher_classes_go_first():
    q = AdmissionQueue()
    for r in [req("s1", priority="sheddable"), req("n1"), req("c1", priority="critical"), req("n2")]:
        assert q.push(r) is None
    assert drain(q) == ["c1", "n1", "n2", "s1"]


def test_tenants_take_turns_within_a_class():
    q = AdmissionQueue()
    for i in range(6):
        q.push(req(f"big{i}", tenant="big", at=i))
    q.push(req("small0", tenant="small", at=10))
    q.push(req("small1", tenant="small", at=11))
    order = drain(q)
    assert order[:4] == ["big0", "small0", "big1", "small1"]  # the burst does not starve the other tenant
    assert order[4:] == ["big2", "big3", "big4", "big5"]


def test_full_queue_displaces_the_newest_lower_class_request_or_refuses():
    q = AdmissionQueue(max_size=3)
    q.push(req("n1", at=1))
    q.push(req("s1", priority="sheddable", at=2))
    q.push(req("s2", priority="sheddable", at=3))
    displaced = q.push(req("c1", priority="critical", at=4))
    assert displaced.request_id == "s2" and len(q) == 3
    refused = q.push(req("s3", priority="sheddable", at=5))
    assert refused.request_id == "s3"
    assert drain(q) == ["c1", "n1", "s1"]


def test_cancel_removes_and_positions_are_consistent():
    q = AdmissionQueue()
    for i in range(3):
        q.push(req(f"a{i}", tenant="a"))
        q.push(req(f"b{i}", tenant="b"))
    assert q.position("a0") == 0 and q.position("b0") == 1 and q.position("a1") == 2
    assert q.remove("a1").request_id == "a1" and q.remove("missing") is None
    assert drain(q) == ["a0", "b0", "a2", "b1", "b2"]


def test_requests_that_cannot_start_before_their_deadline_are_refused_early():
    q = AdmissionQueue()
    q.note_dispatch_rate(dispatched=2, seconds=1.0)  # two per second
    for i in range(6):
        q.push(req(f"r{i}", deadline=100.0 + 1.6))  # positions 0..5 need 0..2.5 s
    expired = {item.request_id for item in q.expired(now=100.0)}
    assert expired == {"r4", "r5"}  # 2.0 s and 2.5 s of waiting: past the deadline
    assert drain(q) == ["r0", "r1", "r2", "r3"]
    assert q.oldest_wait(5.0) == 0.0
