"""The Kubernetes manifests and the Grafana dashboard under deploy/, checked without a cluster:
they parse, and every port, probe path, command, user, volume and metric they name exists in the
project (the metric names Triton itself exports are checked against a live server in
tests/live/test_deploy_metrics.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from bls_models.metrics import FAMILIES
from tritonlocal import flags

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DASHBOARD = DEPLOY / "grafana" / "triton-bls-dashboard.json"
# Triton metrics that exist only on a GPU host (not exported by the CPU server here).
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}


def documents() -> dict[str, dict]:
    found = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found[doc["kind"]] = doc
    return found


def container() -> dict:
    (only,) = documents()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def referenced_metrics() -> set[str]:
    texts = [DASHBOARD.read_text(), (KUBERNETES / "prometheus-adapter-rules.yaml").read_text(),
             (KUBERNETES / "hpa.yaml").read_text()]
    return set(re.findall(r"\b((?:nv|bls)_[a-z_]+)\b", "\n".join(texts)))


def test_every_manifest_parses_and_the_kustomization_lists_them_all():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert {"Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler",
            "ConfigMap"} <= set(documents())


def test_ports_and_probes_are_the_servers():
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    served = {f.split("=")[0].removeprefix("--").removesuffix("-port"): int(f.split("=")[1])
              for f in flags.container_flags() if f.split("=")[0].endswith("-port")}
    assert ports == served
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    service = documents()["Service"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    monitor = documents()["ServiceMonitor"]["spec"]["endpoints"][0]
    assert monitor["port"] in ports and monitor["path"] == "/metrics"


def test_the_liveness_probe_is_the_projects_check_and_its_arguments_parse():
    command = container()["livenessProbe"]["exec"]["command"]
    assert command[:3] == ["python3", "-m", "tritonlocal.liveness"]
    # The same arguments against a port where nothing listens and a pid that does not exist:
    # "cannot tell" (2), not an argument error (2 from argparse has a usage line).
    done = subprocess.run([sys.executable, "-m", "tritonlocal.liveness", *command[3:],
                           "--server-pid", "999999999"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "usage:" not in done.stderr, done.stderr


def test_the_pod_runs_as_the_images_user_with_room_in_dev_shm():
    spec = documents()["Deployment"]["spec"]["template"]["spec"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = re.findall(r"^USER (\d+)", dockerfile, flags=re.MULTILINE)[-1]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert str(spec["securityContext"]["runAsUser"]) == uid
    assert container()["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    size_gib = float(shm["sizeLimit"].removesuffix("Gi"))
    makefile = (ROOT / "Makefile").read_text()
    docker_shm = re.search(r"^SHM_SIZE\s*\?=\s*(\d+)g", makefile, flags=re.MULTILINE).group(1)
    assert size_gib >= float(docker_shm), "Kubernetes gives /dev/shm less than docker-run does"
    assert "/var/cache/bls" in mounts
    image = re.search(r"^IMAGE\s*\?=\s*(\S+)", makefile, flags=re.MULTILINE).group(1)
    assert container()["image"] == image


def test_the_autoscaler_reads_metrics_the_adapter_provides():
    hpa = documents()["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == documents()["Deployment"]["metadata"]["name"]
    rules = yaml.safe_load(documents()["ConfigMap"]["data"]["rules.yaml"])["rules"]
    provided = {rule["name"]["as"] for rule in rules}
    assert {m["pods"]["metric"]["name"] for m in hpa["metrics"]} <= provided


def test_every_bls_metric_the_deployment_uses_is_one_the_orchestrators_export():
    used = {m for m in referenced_metrics() if m.startswith("bls_")}
    exported = set(FAMILIES) | {f"{n}_{s}" for n, (k, _) in FAMILIES.items() if k == "HISTOGRAM"
                                for s in ("bucket", "sum", "count")}
    assert used and used <= exported, used - exported


def test_the_dashboard_is_valid_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_scrape_annotations_name_the_metrics_port():
    annotations = documents()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    assert annotations["prometheus.io/path"] == "/metrics"
