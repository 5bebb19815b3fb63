"""The checked-in generated code must match what the proto compiles to."""

from pathlib import Path

from atoll.protos.generate import GENERATED, REPO_ROOT, generate


def test_generated_code_is_fresh(tmp_path):
    fresh = generate(tmp_path)
    stale = []
    for path, name in zip(fresh, GENERATED, strict=True):
        checked_in = REPO_ROOT / "atoll" / "protos" / name
        if not checked_in.exists() or checked_in.read_bytes() != Path(path).read_bytes():
            stale.append(name)
    assert not stale, f"stale generated files {stale}: run `python -m atoll.protos.generate`"


def test_service_has_the_documented_rpcs():
    from atoll.protos import coordinator_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {
        "Join": (False, False),
        "Heartbeat": (False, False),
        "PushDelta": (True, False),
        "PullUpdate": (False, True),
        "Leave": (False, False),
    }
