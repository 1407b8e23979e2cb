"""A renderer of the kustomize features deploy/kubernetes uses (resources, namespace, labels,
images, strategic-merge patches), for checking the manifests where kustomize is not installed;
tests/cluster/test_kubernetes_kubectl.py checks it against `kubectl kustomize`."""

from __future__ import annotations

from pathlib import Path

import yaml

NAMESPACED = {
    "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget",
    "PersistentVolumeClaim", "HorizontalPodAutoscaler",
}  # fmt: skip
MERGE_KEYS = ("name", "mountPath", "containerPort")


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base, patch):
    """Strategic merge as kustomize does it for these files: maps merge, lists of named items
    merge by name (items only in the patch first), other lists and values are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and base and patch:
        items = base + patch
        keys = [k for k in MERGE_KEYS if all(isinstance(i, dict) and k in i for i in items)]
        key = keys[0] if keys else None
        if key is not None:
            by_key = {i[key]: i for i in patch}
            known = {i[key] for i in base}
            merged = [_merge(i, by_key[i[key]]) if i[key] in by_key else i for i in base]
            return [i for i in patch if i[key] not in known] + merged
    return patch


def containers(doc: dict) -> list[dict]:
    if doc["kind"] != "Deployment":
        return []
    return doc["spec"]["template"]["spec"]["containers"]


def render(folder: Path) -> list[dict]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = folder / res
        docs += render(path) if path.is_dir() else load_all(path)
    for patch in k.get("patches", []):
        for p in load_all(folder / patch["path"]):
            i = next(
                i
                for i, d in enumerate(docs)
                if d["kind"] == p["kind"] and d["metadata"]["name"] == p["metadata"]["name"]
            )
            docs[i] = _merge(docs[i], p)
    for image in k.get("images", []):
        for d in docs:
            for c in containers(d):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for label in k.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(label["pairs"])
    if ns := k.get("namespace"):
        for d in docs:
            if d["kind"] in NAMESPACED:
                d["metadata"]["namespace"] = ns
            for s in d.get("subjects", []):
                if s["kind"] == "ServiceAccount":
                    s["namespace"] = ns
    return docs
