"""deploy/ is checked offline: the images copy every package, the Kubernetes manifests
validate against the API schema, the dashboard and alert rules are well formed and name
only metrics the daemon exports, and compose and systemd use real flags."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"


def packages() -> set[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {p.split(".")[0] for p in cfg["tool"]["setuptools"]["packages"]}


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.engine"])
def test_each_image_copies_every_package_in_pyproject(dockerfile):
    copied = set(re.findall(r"^COPY\s+(\S+)\s+\S+\s*$", (DEPLOY / dockerfile).read_text(), re.M))
    assert packages() <= copied, packages() - copied
    assert {"pyproject.toml"} <= {
        w
        for line in re.findall(r"^COPY (.+)$", (DEPLOY / dockerfile).read_text(), re.M)
        for w in line.split()
    }


def test_the_daemon_image_builds_where_a_container_engine_and_its_base_are_present():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True, timeout=20).returncode != 0:
        pytest.skip("no container engine running here")
    if subprocess.run([docker, "image", "inspect", "python:3.11-slim"], capture_output=True).returncode != 0:
        pytest.skip("base image python:3.11-slim is not available offline")
    r = subprocess.run(
        [docker, "build", "-f", str(DEPLOY / "Dockerfile"), "-t", "weightsync:test", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]


def manifests() -> list[tuple[str, dict]]:
    out = []
    for p in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [(p.name, doc) for doc in yaml.safe_load_all(p.read_text()) if doc]
    return out


def test_kubernetes_manifests_validate_against_the_api_schema():
    import kubernetes_validate

    kinds = set()
    for name, doc in manifests():
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("monitoring.coreos.com"):  # a CRD: its shape, by hand
            spec = doc["spec"]
            assert spec["selector"]["matchLabels"] and spec["endpoints"][0]["port"] == "metrics", name
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert {"StatefulSet", "Service", "ServiceMonitor", "Secret", "Deployment"} <= kinds


def test_kubectl_client_dry_run_accepts_the_manifests_where_it_can():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    r = subprocess.run(
        [
            kubectl,
            "apply",
            "--dry-run=client",
            "--validate=false",
            "-f",
            str(DEPLOY / "k8s" / "service.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode != 0 and ("connection refused" in r.stderr or "unable to recognize" in r.stderr):
        pytest.skip("kubectl needs an API server for discovery, even with --dry-run=client")
    assert r.returncode == 0, r.stderr


def exported_metric_names() -> set[str]:
    from orchestrator.daemon.metrics import Metrics

    m = Metrics()
    m.publish(
        {
            "state": "READY",
            "version": 1,
            "dirty": False,
            "spool": {"bytes": 1},
            "queues": {"pending_buckets": 0},
            "engines": [
                {
                    "engine_id": "e0",
                    "state": "READY",
                    "version": 1,
                    "finalize_count": 1,
                    "heartbeat_age_s": 0.1,
                }
            ],
        }
    )
    m.sync_ended(
        {
            "status": "FAILED",
            "kind": "rollback",
            "seconds": 1.0,
            "bytes": 1,
            "buckets": 1,
            "code": "TIMEOUT",
            "transport": "inline",
        }
    )
    m.apply_seconds.labels("e0").inc(0.1)
    m.buckets_applied.labels("e0").inc(2)
    m.finalize_seconds.labels("e0").observe(0.1)
    m.catchups.labels("ok").inc()
    names = set()
    for fam in m.registry.collect():
        names.update(s.name for s in fam.samples)
    return names


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(weightsync_[a-z_]+)", expr))


def test_the_dashboard_is_grafana_shaped_and_plots_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "weightsync-dashboard.json").read_text())
    assert (
        dash["uid"]
        and dash["title"]
        and isinstance(dash["schemaVersion"], int)
        and dash["schemaVersion"] >= 30
    )
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exported = exported_metric_names()
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for want in ("sync time", "gb/s", "engines by state", "version per engine", "failures"):
        assert want in titles, want
    for p in dash["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["x"] + g["w"] <= 24, p["title"]
        assert p["type"] and p["targets"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"]
            assert metric_names(t["expr"]) <= exported, (p["title"], metric_names(t["expr"]) - exported)


def test_alert_rules_parse_and_name_exported_metrics():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exported = exported_metric_names()
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert {
        "WeightsyncEngineLost",
        "WeightsyncVersionSkew",
        "WeightsyncSyncsFailing",
        "WeightsyncRollbackHappened",
    } <= set(alerts)
    for name, r in alerts.items():
        assert metric_names(r["expr"]) and metric_names(r["expr"]) <= exported, name


def _flags_ok(argv: list[str]) -> None:
    sub = argv[0]
    help_text = subprocess.run(
        [sys.executable, "-m", "orchestrator", sub, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"},
    ).stdout
    for flag in [a for a in argv[1:] if a.startswith("--")]:
        assert flag in help_text, (sub, flag)


def test_compose_and_systemd_use_real_subcommands_and_flags():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for svc in compose["services"].values():
        _flags_ok(svc["command"])
    for unit in (DEPLOY / "systemd").glob("*.service"):
        text = unit.read_text().replace("\\\n", " ")
        for line in re.findall(r"^ExecStart=\S*weightsync (.+)$", text, re.M):
            _flags_ok(line.split())
