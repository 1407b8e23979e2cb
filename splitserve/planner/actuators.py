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
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import splitserve.settings as settings
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
_NUMBER = '{{index .Labels "com.docker.compose.container-number"}}'


def _run(argv: Sequence[str], env: dict[str, str]) -> str:
    return subprocess.run(
        list(argv), env=settings.environment(**env), check=True, capture_output=True, text=True
    ).stdout


class ComposeActuator:
    """``COMMAND -f FILE up -d --no-recreate --no-deps --scale prefill=P --scale decode=D``.

    Every ``up`` names both pools' scales (a service left out would go back to its default);
    ``SPLITSERVE_NUM_PREFILL``/``_DECODE`` are set too, which ``compose.cpu.yaml``'s ``scale``
    reads. To shrink, the newest replicas are first stopped (SIGTERM, the drain, for up to
    ``grace_s``) and removed through the container engine. The commands run on a thread of
    their own, so the planner keeps reading meanwhile. Replicas are found by the labels both
    docker compose and podman-compose give their containers (``com.docker.compose.project``,
    ``.service``, ``.container-number``)."""

    name = "compose"

    def __init__(
        self,
        files: Sequence[str],
        command: str = "docker compose",
        project: str | None = None,
        services: dict[str, str] | None = None,
        run: Runner = _run,
        grace_s: int = 45,
    ) -> None:
        self.grace_s = grace_s  # the services' stop_grace_period: longer than the drain
        self.base = shlex.split(command)
        for f in files:
            self.base += ["-f", f]
        # Both tools name a project after the folder of its first file unless told.
        self.project = project or os.path.basename(os.path.dirname(os.path.abspath(files[0])))
        self.project = self.project.lower()
        self.base += ["-p", self.project]
        self.engine = "podman" if "podman" in command else "docker"
        self.services = services or {"prefill": "prefill", "decode": "decode"}
        self._run = run
        self._counts: Counts | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def replicas(self, role: str) -> list[str]:
        """The running containers of ``role``'s service, newest (highest number) first."""
        argv = [self.engine, "ps", "--format", "{{.Names}} " + _NUMBER]
        argv += ["--filter", f"label=com.docker.compose.project={self.project}"]
        argv += ["--filter", f"label=com.docker.compose.service={self.services[role]}"]
        rows = [line.split() for line in self._run(argv, {}).splitlines() if line.strip()]
        rows.sort(key=lambda r: int(r[1]) if len(r) > 1 and r[1].isdigit() else 0, reverse=True)
        return [r[0] for r in rows]

    def current(self) -> Counts:
        if self._counts is None:
            self._counts = Counts(*(len(self.replicas(role)) for role in ROLES))
        return self._counts

    def scale(self, role: str, count: int) -> None:
        have = getattr(self.current(), role)
        counts = self.current()._replace(**{role: count})
        argv = [*self.base, "up", "-d", "--no-recreate", "--no-deps"]
        for r in ROLES:
            argv += ["--scale", f"{self.services[r]}={getattr(counts, r)}"]
        argv += [self.services[r] for r in ROLES]
        env = {"SPLITSERVE_NUM_PREFILL": str(counts.prefill)}
        env["SPLITSERVE_NUM_DECODE"] = str(counts.decode)
        self._counts = counts

        def act() -> None:
            with self._lock:  # one compose command at a time, in the order asked
                try:
                    # NOTE: podman-compose's `up --scale` never removes a replica; so both
                    # tools get the newest ones stopped (SIGTERM: the drain) and removed first.
                    for name in self.replicas(role)[: max(have - count, 0)]:
                        logger.info("compose: draining %s", name)
                        self._run([self.engine, "stop", "-t", str(self.grace_s), name], {})
                        self._run([self.engine, "rm", name], {})
                    logger.info("compose: %s", shlex.join(argv))
                    self._run(argv, env)
                except (OSError, subprocess.CalledProcessError) as exc:
                    logger.error("compose: scaling %s to %d failed: %s", role, count, exc)

        thread = threading.Thread(target=act, name="compose-scale", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Until every compose command asked for so far has ended (tests, shutdown)."""
        for thread in list(self._threads):
            thread.join(timeout)


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
