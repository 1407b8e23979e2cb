"""Where the planner acts, behind one small interface: ``current()`` and ``scale(role, n)``.

- ``LocalActuator``: the ``splitserve up`` launcher starts nodes (a GPU of ``--gpus`` with
  room each) and drains them (SIGTERM);
- ``ComposeActuator``: ``docker compose`` / ``podman-compose`` ``up -d --scale`` of the
  ``prefill`` and ``decode`` services (a removed replica gets SIGTERM and drains);
- ``KubernetesActuator``: patches the scale subresource of the prefill and decode Deployments
  (the official ``kubernetes`` client, imported only here, in-cluster or from a kubeconfig);
  the Deployment controller sends SIGTERM to the pods it removes.

Every actuator shrinks a pool only by a node's own drain: a node stops taking work, finishes
what it accepted and exits, so no request is lost.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from splitserve.planner.policy import ROLES, Counts

logger = logging.getLogger(__name__)


class Actuator(Protocol):
    name: str

    def current(self) -> Counts:
        """The nodes of each pool running or starting (those draining not counted)."""
        ...

    def scale(self, role: str, count: int) -> None:
        """Make the ``role`` pool ``count`` nodes (starts return at once; nodes join later)."""
        ...


class LocalActuator:
    """Nodes of a ``splitserve.launcher.LocalCluster`` started with ``max_nodes``."""

    name = "local"

    def __init__(self, cluster: Any) -> None:  # a LocalCluster (not imported: no cycle)
        self.cluster = cluster

    def current(self) -> Counts:
        counts = self.cluster.node_counts()
        return Counts(counts["prefill"], counts["decode"])

    def scale(self, role: str, count: int) -> None:
        have = getattr(self.current(), role)
        for _ in range(count - have):
            logger.info("local: started %s", self.cluster.add_node(role))
        for _ in range(have - count):
            logger.info("local: draining %s", self.cluster.drain_node(role))


Runner = Callable[[Sequence[str], dict[str, str]], str]


def _run(argv: Sequence[str], env: dict[str, str]) -> str:
    return subprocess.run(
        list(argv), env={**os.environ, **env}, check=True, capture_output=True, text=True
    ).stdout


class ComposeActuator:
    """``COMMAND -f FILE up -d --no-recreate --no-deps --scale prefill=P --scale decode=D``.

    Every ``up`` names both pools' scales (a service left out would go back to its default);
    ``SPLITSERVE_NUM_PREFILL``/``_DECODE`` are set too, which ``compose.cpu.yaml``'s ``scale``
    reads."""

    name = "compose"

    def __init__(
        self,
        files: Sequence[str],
        command: str = "docker compose",
        project: str | None = None,
        services: dict[str, str] | None = None,
        run: Runner = _run,
    ) -> None:
        self.base = shlex.split(command)
        for f in files:
            self.base += ["-f", f]
        if project:
            self.base += ["-p", project]
        self.services = services or {"prefill": "prefill", "decode": "decode"}
        self._run = run
        self._counts: Counts | None = None

    def current(self) -> Counts:
        if self._counts is None:
            counts = []
            for role in ROLES:
                out = self._run([*self.base, "ps", "-q", self.services[role]], {})
                counts.append(len([line for line in out.splitlines() if line.strip()]))
            self._counts = Counts(*counts)
        return self._counts

    def scale(self, role: str, count: int) -> None:
        counts = self.current()._replace(**{role: count})
        argv = [*self.base, "up", "-d", "--no-recreate", "--no-deps"]
        for r in ROLES:
            argv += ["--scale", f"{self.services[r]}={getattr(counts, r)}"]
        argv += [self.services[r] for r in ROLES]
        env = {"SPLITSERVE_NUM_PREFILL": str(counts.prefill)}
        env["SPLITSERVE_NUM_DECODE"] = str(counts.decode)
        logger.info("compose: %s", shlex.join(argv))
        self._run(argv, env)
        self._counts = counts


class KubernetesActuator:
    """The ``replicas`` of two Deployments' scale subresource (RBAC: get and patch on
    ``deployments/scale``, nothing else; deploy/kubernetes/base/planner.yaml)."""

    name = "kubernetes"

    def __init__(
        self,
        namespace: str,
        deployments: dict[str, str] | None = None,
        api: Any = None,
    ) -> None:
        self.namespace = namespace
        self.deployments = deployments or {
            "prefill": "splitserve-prefill",
            "decode": "splitserve-decode",
        }
        self.api = api if api is not None else _apps_api()

    def current(self) -> Counts:
        replicas = []
        for role in ROLES:
            scale = self.api.read_namespaced_deployment_scale(
                self.deployments[role], self.namespace
            )
            replicas.append(int(scale.spec.replicas or 0))
        return Counts(*replicas)

    def scale(self, role: str, count: int) -> None:
        name = self.deployments[role]
        logger.info("kubernetes: %s/%s replicas=%d", self.namespace, name, count)
        self.api.patch_namespaced_deployment_scale(
            name, self.namespace, {"spec": {"replicas": count}}
        )


def _apps_api() -> Any:
    """AppsV1Api in the pod's service account, else from the kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ValueError(
            "the kubernetes actuator needs the kubernetes client: "
            "pip install 'splitserve[kubernetes]'"
        ) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.AppsV1Api()
