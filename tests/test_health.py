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
