"""Ports taken by other processes on the machine while `splitserve up` starts (parallel tests,
other clusters): its Redis and its /metrics never end up on another process's port."""

import time

import redis
from support.processes import start_redis

from splitserve import launcher
from splitserve.launcher import ClusterSpec, LocalCluster


def test_a_redis_port_taken_before_redis_binds_it_is_given_up_for_another(tmp_path, monkeypatch):
    other = start_redis(tmp_path)  # a Redis of someone else, already on the port up picks first
    taken = int(other.address.rsplit(":", 1)[1])
    picks = [taken]
    real_free_port = launcher.free_port
    monkeypatch.setattr(
        launcher, "free_port", lambda host: picks.pop() if picks else real_free_port(host)
    )
    cluster = LocalCluster(ClusterSpec(model_path="m"))
    try:
        url = cluster._start_redis(time.monotonic() + 30)
        port = int(url.rsplit(":", 1)[1])
        assert not picks and port != taken  # it tried the taken port first, then another;
        # the other Redis's answers on the taken port were not taken for its own
        (ours,) = [p for p in cluster._procs if p.name == "redis"]  # the failed one is forgotten
        client = redis.Redis(port=port)
        assert client.info("server")["process_id"] == ours.popen.pid
        client.close()
    finally:
        cluster.stop()
    assert other.popen.poll() is None  # stop() ended its own Redis only
    other.stop()
