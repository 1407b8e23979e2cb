"""The generated protobuf modules are exactly what scripts/gen_proto.sh makes from
proto/splitserve/v1/*.proto (they are never edited by hand), and they import with this grpcio."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date(tmp_path):
    subprocess.run(
        ["bash", str(REPO / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    stubs = "splitserve/v1/*_pb2*.py*"
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.glob(stubs))
    committed = sorted(p.relative_to(REPO / "proto") for p in (REPO / "proto").glob(stubs))
    assert generated == committed and len(generated) == 9
    stale = [
        str(p)
        for p in generated
        if (tmp_path / p).read_bytes() != (REPO / "proto" / p).read_bytes()
    ]
    assert not stale, f"regenerate with scripts/gen_proto.sh: {stale}"


def test_stubs_import_and_name_the_services():
    from splitserve.v1 import nodes_pb2, router_pb2

    assert set(nodes_pb2.DESCRIPTOR.services_by_name) == {
        "PrefillNodeService",
        "DecodeNodeService",
        "NodeStatsService",
    }
    assert set(router_pb2.DESCRIPTOR.services_by_name) == {"RouterService"}
