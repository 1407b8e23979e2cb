"""The generated protobuf modules are exactly what scripts/gen_proto.sh makes from proto/*.proto
(they are never edited by hand), and they import with this grpcio."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_up_to_date(tmp_path):
    subprocess.run(
        ["bash", str(REPO / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "proto").glob("*_pb2*.py*"))
    committed = sorted(p.relative_to(REPO) for p in (REPO / "proto").glob("*_pb2*.py*"))
    assert generated == committed and len(generated) == 9
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (REPO / p).read_bytes()]
    assert not stale, f"regenerate with scripts/gen_proto.sh: {stale}"


def test_stubs_import_and_name_the_services():
    from proto import nodes_pb2, router_pb2

    assert set(nodes_pb2.DESCRIPTOR.services_by_name) == {"PrefillNode", "DecodeNode"}
    assert set(router_pb2.DESCRIPTOR.services_by_name) == {"Router"}
