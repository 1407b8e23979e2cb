"""`splitserve health`: a grpc.health.v1 Check, exit 0 only for SERVING."""

import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.launcher import free_port
from splitserve.runtime.health import check, check_address, default_address

EXE = shutil.which("splitserve", path=str(Path(sys.executable).parent))
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def server():
    """A gRPC server with the standard health service: the whole server SERVING, one service
    NOT_SERVING (what a component reports while it stops)."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    servicer.set("", SERVING)
    servicer.set("splitserve.Stopping", NOT_SERVING)
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(None)


def _run(*args, env=None):
    base = {"PATH": str(Path(sys.executable).parent)}
    env = {**base, **(env or {})}
    return subprocess.run(
        [EXE, "health", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_serving_server(server):
    address, _ = server
    result = check(address)
    assert result.serving and result.message == f"{address} (server): SERVING"


def test_not_serving_and_unknown_services(server):
    address, servicer = server
    result = check(address, "splitserve.Stopping")
    assert not result.serving and result.message.endswith("NOT_SERVING")
    result = check(address, "no.such.Service")
    assert not result.serving and "unknown service" in result.message
    servicer.set("", NOT_SERVING)
    assert not check(address).serving


def test_nothing_listening_is_unhealthy_with_a_reason():
    result = check(f"127.0.0.1:{free_port()}", timeout_s=2)
    assert not result.serving and "not reachable" in result.message


def test_a_server_without_the_health_service():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        result = check(f"127.0.0.1:{port}", timeout_s=2)
    finally:
        srv.stop(None)
    assert not result.serving and "no grpc.health.v1 service" in result.message


def test_default_address_follows_the_components_variables():
    assert default_address({}) == "127.0.0.1:8000"
    assert default_address({"SPLITSERVE_HOST": "0.0.0.0", "SPLITSERVE_PORT": "9001"}) == (
        "127.0.0.1:9001"
    )
    assert default_address({"SPLITSERVE_HOST": "10.1.2.3"}) == "10.1.2.3:8000"
    assert default_address({"SPLITSERVE_HOST": "::1", "SPLITSERVE_PORT": "7"}) == "[::1]:7"
    assert default_address({"SPLITSERVE_HOST": "::"}) == "127.0.0.1:8000"


def test_default_address_of_a_port_picked_at_start_comes_from_the_port_file(tmp_path):
    port_file = tmp_path / "port"
    env = {"SPLITSERVE_PORT": "0", "SPLITSERVE_PORT_FILE": str(port_file)}
    assert default_address(env) == "127.0.0.1:0"  # not written yet: unreachable, so unhealthy
    port_file.write_text("43117")
    assert default_address(env) == "127.0.0.1:43117"
    assert default_address({**env, "SPLITSERVE_PORT": "9001"}) == "127.0.0.1:9001"


def test_check_address():
    assert check_address("router:8000") == "router:8000"
    for bad in ("router", "router:", ":8000", "router:http", "router:70000"):
        with pytest.raises(ValueError, match="not host:port"):
            check_address(bad)


def test_console_script_exit_status(server):
    address, _ = server
    ok = _run("--address", address)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    stopping = _run("--address", address, "--service", "splitserve.Stopping")
    assert stopping.returncode == 1 and "NOT_SERVING" in stopping.stderr
    down = _run("--address", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert down.returncode == 1 and "not reachable" in down.stderr
    bad = _run("--address", "no-port")
    assert bad.returncode == 1 and "not host:port" in bad.stderr
    for proc in (ok, stopping, down, bad):
        assert "Traceback" not in proc.stderr


def test_console_script_defaults_to_this_containers_component(server):
    address, _ = server
    port = address.rpartition(":")[2]
    proc = _run(env={"SPLITSERVE_HOST": "0.0.0.0", "SPLITSERVE_PORT": port})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"127.0.0.1:{port} (server): SERVING")


# Server reflection, served beside health by every component (runtime.server.Server): v1 (what
# grpcurl and current tools ask first) and v1alpha. The v1 messages are v1alpha's with the same
# field numbers, so a raw client sends and reads v1alpha-serialized messages on the v1 path.
REFLECTION_V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
REFLECTION_V1ALPHA = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


async def _reflect(address, path, requests):
    from grpc_reflection.v1alpha import reflection_pb2

    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            path,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return [reply async for reply in call(iter(requests), timeout=10)]


def test_reflection_v1_and_v1alpha_on_a_component_server():
    import asyncio

    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2 as pb

    from splitserve.runtime.server import Server
    from splitserve.v1 import router_pb2  # noqa: F401 (its descriptors in the default pool)

    def files(reply):
        out = []
        for raw in reply.file_descriptor_response.file_descriptor_proto:
            proto = descriptor_pb2.FileDescriptorProto()
            proto.ParseFromString(raw)
            out.append(proto)
        return out

    async def main():
        server = Server("127.0.0.1", 0, ["splitserve.v1.RouterService"])
        await server.start()
        try:
            requests = [
                pb.ServerReflectionRequest(list_services=""),
                pb.ServerReflectionRequest(file_containing_symbol="splitserve.v1.RouterService"),
                pb.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection"
                ),
                pb.ServerReflectionRequest(file_by_filename="grpc/reflection/v1/reflection.proto"),
                pb.ServerReflectionRequest(file_containing_symbol="no.such.Service"),
            ]
            v1 = await _reflect(server.address, REFLECTION_V1, requests)
            v1alpha = await _reflect(server.address, REFLECTION_V1ALPHA, requests[:2])
        finally:
            await server.stop(0)
        return v1, v1alpha

    v1, v1alpha = asyncio.run(main())
    listed, router, v1_file, by_name, missing = v1
    names = [s.name for s in listed.list_services_response.service]
    assert sorted(names) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        "splitserve.v1.RouterService",
    ]
    assert listed.original_request.list_services == ""
    router_files = {f.name: f for f in files(router)}
    assert set(router_files) == {"splitserve/v1/router.proto", "splitserve/v1/common.proto"}
    assert [s.name for s in router_files["splitserve/v1/router.proto"].service] == ["RouterService"]
    # The v1 file: v1alpha's messages, field for field, under package grpc.reflection.v1; it is
    # complete enough for a client to build a pool from.
    (proto,) = files(v1_file)
    assert files(by_name) == [proto]
    assert (proto.name, proto.package) == (
        "grpc/reflection/v1/reflection.proto",
        "grpc.reflection.v1",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    service = pool.FindServiceByName("grpc.reflection.v1.ServerReflection")
    method = service.methods_by_name["ServerReflectionInfo"]
    assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    for alpha in pb.DESCRIPTOR.message_types_by_name.values():
        ours = pool.FindMessageTypeByName(f"grpc.reflection.v1.{alpha.name}")
        assert [(f.name, f.number, f.type) for f in ours.fields] == [
            (f.name, f.number, f.type) for f in alpha.fields
        ]
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    # v1alpha answers as before.
    assert sorted(s.name for s in v1alpha[0].list_services_response.service) == sorted(names)
    assert {f.name for f in files(v1alpha[1])} == set(router_files)
