"""The scheduler's replica view carries each replica's effective limits, from its heartbeats and
from its registry entry (a scheduler that just started has only the registry)."""

from services.scheduler.replicas import ReplicaView
from shared.protocol import Heartbeat


def test_limits_come_from_heartbeats_and_from_the_registry():
    view = ReplicaView()
    view.on_heartbeat(Heartbeat(replica_id="a", model="m", deployment="m", state="ready", max_model_len=512,
                                vocab_size=4096), now=1.0)
    # Registry fields are strings (shared.registry writes str(value)); an older engine says nothing.
    view.sync_registry("m", {"a": {"state": "ready"}, "b": {"state": "ready", "max_model_len": "1024",
                                                             "vocab_size": "32000"}, "c": {"state": "ready"}}, now=1.0)
    limits = {rid: (r.max_model_len, r.vocab_size) for rid, r in view.replicas["m"].items()}
    assert limits == {"a": (512, 4096), "b": (1024, 32000), "c": (0, 0)}
