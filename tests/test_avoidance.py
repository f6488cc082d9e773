"""A node that could not reach the store is avoided by the next actors for a while (soma_cluster/avoidance.py):
the decision on the scheduler's fake clock, no Ray."""

from __future__ import annotations

from test_schedule import by, scheduler, started

from soma_cluster.avoidance import AVOID_S, Avoidance
from soma_cluster.events import history
from soma_cluster.jobs import Cause, LostAs
from soma_cluster.messages import Incarnation
from soma_cluster.schedule import Lost, Start

UNREACHABLE = Lost(LostAs.STORAGE_UNREACHABLE, "storage s3://b/c: read x failed", Cause.STORAGE_UNREACHABLE)


def test_avoidance_marks_a_node_for_storage_only_and_expires():
    now = [0.0]
    a = Avoidance(lambda: now[0])
    assert not a.lost("node-a", Cause.HANG) and not a.lost(None, Cause.STORAGE_UNREACHABLE)
    assert not a.lost("node-a", Cause.NODE_LOST)  # a dead node is out of Ray's placement anyway
    assert a.nodes() == frozenset()
    assert a.lost("node-a", Cause.STORAGE_UNREACHABLE)
    now[0] = AVOID_S - 1
    assert a.nodes() == {"node-a"}
    now[0] = AVOID_S
    assert a.nodes() == frozenset()  # expired
    a.lost("node-a", Cause.STORAGE_UNREACHABLE)
    a.lost("node-b", Cause.STORAGE_UNREACHABLE)
    a.reached("node-a")  # it read or wrote the store since
    assert a.nodes() == {"node-b"}


def test_a_retry_after_storage_unreachable_avoids_the_node_until_it_reaches_the_store(tmp_path):
    now = [0.0]
    s = scheduler(tmp_path, now)
    s.restore({})
    first = by(s.requests(capacity=2, room=2), Start)
    assert [u.unit.avoid for u in first] == [frozenset(), frozenset()]
    u0, u1 = first[0].unit, first[1].unit
    s.on_setup(u0.id, started([0]))  # on node-a (the helper's Incarnation)
    s.on_lost(u0.id, UNREACHABLE)
    # the other expert's actor failed in its set-up, before it reported: its error names the node
    s.on_lost(u1.id, Lost(LostAs.STORAGE_UNREACHABLE, "x", Cause.STORAGE_UNREACHABLE, node="node-b"))
    hist = history(s.store)
    failed = {n: [e for e in h.events if e["event"] == "failed"][-1] for n, h in hist.items()}
    assert failed["expert-0000"]["node"] == "node-a" and failed["expert-0000"]["counted"] is False
    assert failed["expert-0001"]["node"] == "node-b"
    now[0] += 30.0  # past both backoffs
    retries = by(s.requests(capacity=2, room=2), Start)
    assert [r.unit.avoid for r in retries] == [{"node-a", "node-b"}] * 2
    queued = [e for e in history(s.store)["expert-0000"].events if e["event"] == "queued"]
    assert "avoid" not in queued[0] and queued[-1]["avoid"] == ["node-a", "node-b"] and queued[-1]["cause"] == "retry"
    # the retry landed on node-a anyway (no room elsewhere) and read the store there: node-a is fine again
    report = started([0])
    s.on_setup(retries[0].unit.id, report)
    assert report.process == Incarnation("node-a", 4242, 1000.0)
    assert s.avoid.nodes() == {"node-b"}
    now[0] += AVOID_S
    assert s.avoid.nodes() == frozenset()  # and node-b's avoidance has expired


def test_other_losses_avoid_nothing(tmp_path):
    now = [0.0]
    s = scheduler(tmp_path, now)
    s.restore({})
    unit = by(s.requests(capacity=1, room=1), Start)[0].unit
    s.on_setup(unit.id, started([0]))
    s.on_lost(unit.id, Lost(LostAs.HANG, "no heartbeat for 200 s", Cause.HANG))
    now[0] += 30.0
    assert [r.unit.avoid for r in by(s.requests(capacity=2, room=2), Start)] == [frozenset(), frozenset()]
    failed = [e for e in history(s.store)["expert-0000"].events if e["event"] == "failed"]
    assert "node" not in failed[0]
