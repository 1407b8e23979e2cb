"""SPLITSERVE_<OPTION> environment variables for `splitserve router|prefill|decode`."""

import dataclasses

import pytest

from splitserve import cli
from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE
from splitserve.router.config import RouterConfig
from splitserve.runtime.config import NodeConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No SPLITSERVE_* variable of the machine running the tests leaks into them."""
    import os

    for name in list(os.environ):
        if name.startswith("SPLITSERVE_"):
            monkeypatch.delenv(name)


def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_node_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://redis:6379")
    monkeypatch.setenv("SPLITSERVE_MODEL", "/models")
    monkeypatch.setenv("SPLITSERVE_DEVICE", "cuda")
    monkeypatch.setenv("SPLITSERVE_PORT", "9000")
    monkeypatch.setenv("SPLITSERVE_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("SPLITSERVE_LOAD_FORMAT", "dummy")
    monkeypatch.setenv("SPLITSERVE_ADVERTISE_HOST", "node-7.example")
    for role in ("prefill", "decode"):
        args = parse(role)
        assert args.redis_url == "redis://redis:6379"
        assert args.model_path == "/models"
        assert args.device == "cuda"
        assert args.port == 9000 and isinstance(args.port, int)
        assert args.gpu_memory_utilization == 0.5
        assert args.load_format == "dummy"
        assert args.advertise_host == "node-7.example"
        assert args.kv_cache_mb == NodeConfig("m").kv_cache_mb  # unset: NodeConfig's default


def test_the_command_line_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_PORT", "9000")
    monkeypatch.setenv("SPLITSERVE_DEVICE", "cuda")
    args = parse("prefill", "--port", "7000", "--device", "cpu")
    assert (args.port, args.device) == (7000, "cpu")
    args = parse("router", "--port", "7001", "--redis-url", "redis://r")
    assert args.port == 7001


def test_router_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_REQUEST_TIMEOUT_S", "30")
    monkeypatch.setenv("SPLITSERVE_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("SPLITSERVE_PREFILL", "p1:1,p2:2")
    monkeypatch.setenv("SPLITSERVE_HOST", "0.0.0.0")
    args = parse("router")
    assert args.request_timeout_s == 30.0 and args.max_attempts == 5
    assert args.prefill_addresses == "p1:1,p2:2" and args.host == "0.0.0.0"
    assert args.decode_addresses == ""  # unset: the parser's own default


@pytest.mark.parametrize(
    ("raw", "expected"), [("1", False), ("true", False), ("YES", False), ("on", False)]
)
def test_a_switch_is_on_for_true_words(monkeypatch, raw, expected):
    monkeypatch.setenv("SPLITSERVE_NO_PREFIX_CACHING", raw)
    assert parse("decode").enable_prefix_caching is expected


@pytest.mark.parametrize("raw", ["0", "false", "no", "off", ""])
def test_a_switch_is_off_for_false_words_and_empty(monkeypatch, raw):
    monkeypatch.setenv("SPLITSERVE_NO_PREFIX_CACHING", raw)
    assert parse("decode").enable_prefix_caching is True  # the flag's default


def test_empty_variables_count_as_unset(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_PORT", "")
    monkeypatch.setenv("SPLITSERVE_DTYPE", "")
    monkeypatch.setenv("SPLITSERVE_MAX_ATTEMPTS", "  ")
    assert parse("prefill").port == 0 and parse("prefill").dtype is None
    assert parse("router").port == 8000 and parse("router").max_attempts == 3


def test_the_environment_is_read_at_each_parse(monkeypatch):
    parser = cli.build_parser()
    monkeypatch.setenv("SPLITSERVE_PORT", "9000")
    assert parser.parse_args(["prefill"]).port == 9000
    monkeypatch.delenv("SPLITSERVE_PORT")
    assert parser.parse_args(["prefill"]).port == 0


@pytest.mark.parametrize(
    ("command", "name", "raw", "message"),
    [
        ("prefill", "SPLITSERVE_PORT", "eighty", "SPLITSERVE_PORT='eighty': invalid int value"),
        ("router", "SPLITSERVE_MAX_ATTEMPTS", "3.5", "SPLITSERVE_MAX_ATTEMPTS='3.5': invalid int"),
        (
            "decode",
            "SPLITSERVE_GPU_MEMORY_UTILIZATION",
            "most",
            "SPLITSERVE_GPU_MEMORY_UTILIZATION='most': invalid float value",
        ),
        (
            "decode",
            "SPLITSERVE_LOAD_FORMAT",
            "fast",
            "invalid choice (choose from 'auto', 'dummy')",
        ),
        ("prefill", "SPLITSERVE_NO_PREFIX_CACHING", "maybe", "give 1/true/yes/on or 0/false"),
    ],
)
def test_bad_values_are_argparse_errors_naming_the_variable(
    monkeypatch, capsys, command, name, raw, message
):
    monkeypatch.setenv(name, raw)
    with pytest.raises(SystemExit) as exc:
        parse(command)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"splitserve {command}: error:" in err and message in err


def test_a_bad_value_fails_only_the_commands_that_read_it(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_PORT", "eighty")
    monkeypatch.setenv("SPLITSERVE_KV_CACHE_MB", "lots")  # a node option: the router ignores it
    assert parse("hash", "1,2,3").tokens == "1,2,3"
    monkeypatch.delenv("SPLITSERVE_PORT")
    assert parse("router").port == 8000


def test_every_option_of_the_deployed_commands_has_a_variable():
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0]
    for command in cli.ENV_COMMANDS:
        p = sub.choices[command]
        flags = [a for a in p._actions if a.option_strings and a.dest != "help"]
        names = cli.env_names(command)
        assert len(names) == len(flags) == len(set(names))
        for action in flags:
            assert cli.env_name(action) in names
            assert cli.env_name(action) in action.help  # --help shows it
    assert "SPLITSERVE_ADVERTISE_HOST" in cli.env_names("prefill")
    assert "SPLITSERVE_NO_PREFIX_CACHING" in cli.env_names("decode")
    assert "SPLITSERVE_REDIS_URL" in cli.env_names("router")
    assert "SPLITSERVE_ADVERTISE_HOST" not in cli.env_names("router")


def test_options_are_config_fields():
    """Every option of router/prefill/decode is a field of its config (its dest is the field's
    name), and the field's default is the option's, so each is declared once."""
    sub = cli.build_parser()._subparsers._group_actions[0]
    fields = {f.name: f for f in dataclasses.fields(NodeConfig)}
    for command in ("prefill", "decode"):
        for action in sub.choices[command]._actions:
            if action.dest in ("help", "gpu_lock_dir"):  # the lock is taken before the config
                continue
            assert action.dest in fields, action.dest
            if action.dest != "model_path":  # None: the embedded tiny model
                assert action.default == fields[action.dest].default, action.dest
    router = {a.dest: a for a in sub.choices["router"]._actions}
    assert set(router) - {"help"} == {f.name for f in dataclasses.fields(RouterConfig)}
    assert router["port"].default == 8000  # a router has a well-known port; a node a free one
    assert router["block_size"].default == NodeConfig("m").block_size == DEFAULT_BLOCK_SIZE


def test_up_forwards_the_node_options_given_and_only_those(monkeypatch):
    import signal

    from splitserve import launcher

    specs = []

    class Cluster:  # records the spec instead of starting processes
        def __init__(self, spec):
            specs.append(spec)

        def start(self):
            raise RuntimeError("not starting a cluster in this test")

        def stop(self):
            pass

    monkeypatch.setattr(launcher, "LocalCluster", Cluster)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        for argv in (["--dtype", "bf16", "--kv-cache-mb", "64"], []):
            args = parse("up", "--model", "/m", "--num-decode", "2", *argv)
            assert args.func(args) == 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    given, unset = specs
    assert given.node_args == ("--dtype", "bf16", "--kv-cache-mb", "64")
    assert (given.model_path, given.num_decode, given.startup_timeout_s) == ("/m", 2, 600.0)
    assert unset.node_args == ()


def test_advertised_host(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "getfqdn", lambda: "node-3.cluster.internal")
    assert NodeConfig("m").advertised_host() == "127.0.0.1"
    assert NodeConfig("m", host="10.0.0.5").advertised_host() == "10.0.0.5"
    assert NodeConfig("m", host="0.0.0.0").advertised_host() == "node-3.cluster.internal"
    assert NodeConfig("m", host="::").advertised_host() == "node-3.cluster.internal"
    given = NodeConfig("m", host="0.0.0.0", advertise_host="gpu-host-1")
    assert given.advertised_host() == "gpu-host-1"
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "a1b2c3d4e5f6")
    assert NodeConfig("m", host="0.0.0.0").advertised_host() == "a1b2c3d4e5f6"


def test_up_forwards_its_node_options_switches_as_bare_flags():
    """`up --trust-kv-network --async-scheduling off --dtype bfloat16` gives every node those
    flags (a switch as its flag alone, which the node's parser takes); none given, none sent."""
    args = parse("up", "--trust-kv-network", "--async-scheduling", "off", "--dtype", "bfloat16")
    forwarded = cli.up_node_args(args)
    assert forwarded == ["--dtype", "bfloat16", "--async-scheduling", "off", "--trust-kv-network"]
    node = parse("decode", *forwarded)
    assert node.trust_kv_network is True and node.async_scheduling == "off"
    assert cli.up_node_args(parse("up")) == []


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://redis://127.0.0.1:6379", "only /<database number> may follow"),
        ("redis://host:6379/cache", "only /<database number> may follow"),
        ("http://host:6379", "unknown scheme 'http'"),
        ("host:6379", "unknown scheme 'host'"),
        ("redis://host:port", "not a number in 1..65535"),
        ("redis://host:70000", "not a number in 1..65535"),
        ("redis://", "no host"),
        ("unix://host/tmp/redis.sock", "unix:///path"),
    ],
)
def test_a_malformed_redis_url_is_refused_at_start(url, says):
    """The Redis client reads `redis://redis://h:6379` as a host named "redis" and drops the
    rest: a node or router given it would run without its index and say nothing."""
    from splitserve.cluster_spec import ClusterSpec

    for make in (
        lambda: NodeConfig(model_path="tiny", redis_url=url),
        lambda: RouterConfig(
            model_path="tiny", prefill_addresses=(), decode_addresses=("h:1",), redis_url=url
        ),
        lambda: ClusterSpec(model_path="tiny", redis_url=url),
    ):
        with pytest.raises(ValueError, match="--redis-url") as err:
            make()
        assert says in str(err.value)


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379", "redis://redis:6379/2", "rediss://u:pw@cache.internal:6380/0",
     "redis://[::1]:6379", "unix:///run/redis.sock", "redis://localhost"],
)  # fmt: skip
def test_well_formed_redis_urls_are_taken(url):
    assert NodeConfig(model_path="tiny", redis_url=url).redis_url == url
