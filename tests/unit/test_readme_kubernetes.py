"""The Kubernetes example infer/deploy/README.md points to (kubernetes.yaml beside it): it parses,
its commands are ones the two programs accept, and its timings give a replica the time to
drain.

No Kubernetes schema validator installs offline here (kubeconform is not on PyPI), so this
checks the manifest's shape and the fields the README's advice depends on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infer.cli import build_parser

MANIFESTS = Path(__file__).resolve().parents[2] / "infer" / "deploy" / "kubernetes.yaml"


def _manifests() -> list[dict[str, Any]]:
    text = MANIFESTS.read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_every_manifest_has_the_basic_fields() -> None:
    docs = _manifests()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["Deployment", "Deployment", "Service", "Service", "ServiceAccount", "Role", "RoleBinding"]
    )
    for doc in docs:
        assert isinstance(doc["apiVersion"], str) and doc["metadata"]["name"]
        if doc["kind"] == "Deployment":
            spec = doc["spec"]
            labels = spec["template"]["metadata"]["labels"]
            assert spec["selector"]["matchLabels"].items() <= labels.items()
            for container in spec["template"]["spec"]["containers"]:
                assert container["name"] and container["image"] and container["command"]


def test_the_replicas_are_probed_on_health_and_have_time_to_drain() -> None:
    docs = _manifests()
    pod = _named(docs, "Deployment", "infer")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    command = container["command"]
    assert command[:2] == ["infer", "serve"]
    args = build_parser().parse_args(command[1:])  # flags infer serve accepts
    assert args.host == "0.0.0.0"
    port = args.port
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert container["ports"] == [{"containerPort": port}]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # The grace period covers the preStop sleep and then the whole drain.
    drain = args.drain_grace_s + args.drain_timeout_s
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain
    replicas = _named(docs, "Service", "infer-replicas")
    assert replicas["spec"]["clusterIP"] == "None"
    assert replicas["spec"]["selector"] == {"app": "infer"}


def test_the_gateway_finds_the_replica_pods() -> None:
    launch = pytest.importorskip("sglang_router.launch_router")
    docs = _manifests()
    pod = _named(docs, "Deployment", "infer-gateway")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    command = container["command"]
    assert command[:2] == ["sglang-router", "launch"]
    router = launch.parse_router_args(command[2:])  # flags sglang-router accepts
    assert router.service_discovery
    assert router.selector == {"app": "infer"}
    replica = _named(docs, "Deployment", "infer")["spec"]["template"]["spec"]["containers"][0]
    assert router.service_discovery_port == replica["ports"][0]["containerPort"]
    # It reads pods through its service account, which the Role lets it list and watch.
    account = pod["serviceAccountName"]
    binding = _named(docs, "RoleBinding", account)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = _named(docs, "Role", binding["roleRef"]["name"])
    [rule] = role["rules"]
    assert "pods" in rule["resources"] and {"list", "watch"} <= set(rule["verbs"])
    front = _named(docs, "Service", "infer")
    assert front["spec"]["selector"] == pod_labels(docs, "infer-gateway")
    assert front["spec"]["ports"][0]["targetPort"] == container["ports"][0]["containerPort"]


def pod_labels(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    labels: dict[str, str] = _named(docs, "Deployment", name)["spec"]["template"]["metadata"][
        "labels"
    ]
    return labels
