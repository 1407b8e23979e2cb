"""The generated protobuf modules import with this grpcio and name the services (that they are
exactly what scripts/gen_proto.sh makes: tests/cluster/test_packaging.py)."""


def test_stubs_import_and_name_the_services():
    from splitserve.v1 import nodes_pb2, router_pb2

    assert set(nodes_pb2.DESCRIPTOR.services_by_name) == {
        "PrefillNodeService",
        "DecodeNodeService",
        "NodeStatsService",
    }
    assert set(router_pb2.DESCRIPTOR.services_by_name) == {"RouterService"}
