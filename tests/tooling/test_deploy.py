"""The Kubernetes manifests and the Grafana dashboard under deploy/, checked without a cluster:
they parse and match Kubernetes 1.31's schemas, and every port, probe path, command, user, volume,
secret and metric they name exists in the project (the metric names Triton itself exports are
checked against a live server in tests/live/test_deploy_metrics.py)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml

from bls_models.metrics import FAMILIES
from tests.helpers import referenced_metrics
from tritonlocal import flags

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DASHBOARD = DEPLOY / "grafana" / "triton-bls-dashboard.json"
# Triton's counters that are wrong for an orchestrator (its execute() hands requests off and
# returns None, so r24.10's PbMetricReporter reports each a success, with execute()'s hand-off as
# its compute time; docs/operations.md, "Triton's own counters and the orchestrators"). A query
# may read them only for the models that do not export bls_* metrics: on the left of an
# ``unless on(..., model, ...)`` whose right side is a bls_ series. Queue time is measured
# before execute(): a per-model panel keeps it, with its own denominator, the success count.
BLIND_TO_ORCHESTRATORS = {
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_request_duration_us",
    "nv_inference_compute_infer_duration_us", "nv_inference_compute_input_duration_us",
    "nv_inference_compute_output_duration_us"}
QUEUE = "nv_inference_queue_duration_us"
# The Kubernetes release the manifests are checked against (kubernetes-validate bundles its schemas).
KUBERNETES_VERSION = "1.31.0"
# Documents kubernetes-validate has no schema for: a custom resource and kustomize's own file. Only
# the project's own checks below read them; every other document must match its schema.
NOT_CHECKABLE = {("monitoring.coreos.com/v1", "ServiceMonitor"),
                 ("kustomize.config.k8s.io/v1beta1", "Kustomization")}
# Applied by hand, never by `kubectl apply -k`: its placeholder must not overwrite the real one.
NOT_IN_KUSTOMIZATION = {"kustomization.yaml", "admin-secret.yaml"}
ADMIN_VARIABLE = "TRITONLOCAL_ADMIN_HEADER"
# The entry script refuses a credential shorter than this (tritonlocal/flags.py).
MIN_CREDENTIAL_CHARS = flags.MIN_CREDENTIAL_CHARS


def documents() -> dict[str, dict]:
    found = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found[doc["kind"]] = doc
    return found


def every_document() -> list[tuple[str, dict]]:
    """(file name, document) for every document of every manifest, kustomization.yaml included."""
    return [(path.name, doc) for path in sorted(KUBERNETES.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def container() -> dict:
    (only,) = documents()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def test_every_manifest_parses_and_the_kustomization_lists_them_all_but_the_secret():
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in KUBERNETES.glob("*.yaml")} - NOT_IN_KUSTOMIZATION
    assert {"Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler",
            "ConfigMap", "Secret"} <= set(documents())


def _schema_cases():
    return [pytest.param(doc, id=f"{name}:{doc['kind']}") for name, doc in every_document()
            if (doc["apiVersion"], doc["kind"]) not in NOT_CHECKABLE]


@pytest.mark.parametrize("doc", _schema_cases())
def test_every_kubernetes_document_matches_the_1_31_schema(doc):
    """Strict: a field the schema does not know (a misspelling) fails, not only a wrong type."""
    group = doc["apiVersion"].rpartition("/")[0]
    # Built-in API groups: the core group, a name without a dot, or one under k8s.io. A custom
    # resource that happened to share a built-in kind's name would be checked against the wrong
    # schema (kubernetes-validate keys its schemas by kind and the group's first label only).
    assert "." not in group or group.endswith(".k8s.io"), doc["apiVersion"]
    try:
        version, problem = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True), ""
    except kubernetes_validate.ValidationError as error:  # whose own text prints the whole schema
        version, problem = None, f"{'.'.join(map(str, error.path))}: {error.message}"
    assert not problem, problem
    assert version == "1.31"


def test_only_the_listed_kinds_go_unvalidated_and_they_cannot_be():
    """A kind added to NOT_CHECKABLE but to no manifest, or one kubernetes-validate could check
    after all, fails here; a new unlisted kind fails the schema check above."""
    skipped = {(doc["apiVersion"], doc["kind"]) for _, doc in every_document()
               if (doc["apiVersion"], doc["kind"]) in NOT_CHECKABLE}
    assert skipped == NOT_CHECKABLE
    for _, doc in every_document():
        if (doc["apiVersion"], doc["kind"]) in NOT_CHECKABLE:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _misspell(mapping: dict, key: str, wrong: str) -> None:
    mapping[wrong] = mapping.pop(key)


def _server(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def _admin_env(doc: dict) -> dict:
    return next(e for e in _server(doc)["env"] if e["name"] == ADMIN_VARIABLE)


BREAKAGES = {
    "misspelled-volumeMounts": ("Deployment",
                                lambda d: _misspell(_server(d), "volumeMounts", "volumeMount")),
    "misspelled-secretKeyRef": ("Deployment", lambda d: _misspell(
        _admin_env(d)["valueFrom"], "secretKeyRef", "secretKeyref")),
    "port-as-string": ("Deployment", lambda d: _server(d)["ports"][0].update(containerPort="8000")),
    "misspelled-stringData": ("Secret", lambda d: _misspell(d, "stringData", "stringdata")),
    "misspelled-port": ("Service", lambda d: _misspell(d["spec"]["ports"][0], "port", "prot")),
    "misspelled-maxReplicas": ("HorizontalPodAutoscaler",
                               lambda d: _misspell(d["spec"], "maxReplicas", "maxReplica")),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_schema_check_fails_a_broken_manifest(breakage):
    """The check above on a copy broken in memory: it must fail. An unknown field (volumeMount,
    secretKeyref, stringdata) fails only because the check is strict."""
    kind, breaks = BREAKAGES[breakage]
    broken = copy.deepcopy(documents()[kind])
    breaks(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_server_takes_the_admin_header_from_the_secret_which_holds_a_refused_placeholder():
    secret = documents()["Secret"]
    env = {e["name"]: e for e in container()["env"]}
    source = env[ADMIN_VARIABLE]
    assert set(source) == {"name", "valueFrom"}
    ref = source["valueFrom"]["secretKeyRef"]
    # Not optional: without the Secret, the container is not created.
    assert ref == {"name": secret["metadata"]["name"], "key": ADMIN_VARIABLE}
    assert set(secret["stringData"]) == {ADMIN_VARIABLE} and "data" not in secret
    name, equals, value = secret["stringData"][ADMIN_VARIABLE].partition("=")
    assert (name, equals) == ("triton-admin-key", "=")
    assert len(value) < MIN_CREDENTIAL_CHARS, "the placeholder must be refused by the entry script"
    with pytest.raises(ValueError, match=f"at least {MIN_CREDENTIAL_CHARS}"):
        flags.parse_header(secret["stringData"][ADMIN_VARIABLE])
    # The command in the file's header comment creates the same Secret, key and header name, with
    # a generated value long enough.
    comment = " ".join(line.lstrip("#").strip().removesuffix("\\").strip()
                       for line in (KUBERNETES / "admin-secret.yaml").read_text().splitlines()
                       if line.startswith("#"))
    command = re.search(r"kubectl create secret generic (\S+) --from-literal=(\w+)="
                        r'"([\w-]+)=\$\(openssl rand -hex (\d+)\)"', comment)
    assert command, comment
    assert command.groups()[:3] == (secret["metadata"]["name"], ADMIN_VARIABLE, name)
    assert 2 * int(command.group(4)) >= MIN_CREDENTIAL_CHARS


def test_ports_and_probes_are_the_servers():
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    served = {f.split("=")[0].removeprefix("--").removesuffix("-port"): int(f.split("=")[1])
              for f in flags.container_flags(flags.new_credential())
              if f.split("=")[0].endswith("-port")}
    assert ports == served
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    service = documents()["Service"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    monitor = documents()["ServiceMonitor"]["spec"]["endpoints"][0]
    assert monitor["port"] in ports and monitor["path"] == "/metrics"


@pytest.mark.parametrize("probe", ["livenessProbe", "readinessProbe"])
def test_the_probes_are_the_projects_check_and_their_arguments_parse(probe):
    command = container()[probe]["exec"]["command"]
    assert command[:3] == ["python3", "-m", "tritonlocal.liveness"]
    assert ("--ready" in command) == (probe == "readinessProbe")
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


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every query of the dashboard, Grafana's variables filled in."""
    return [(panel["title"], target["expr"].replace("$__rate_interval", "1m"))
            for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def adapter_queries() -> list[tuple[str, str]]:
    """(rule name, query) for every rule of the prometheus-adapter, its templates filled in."""
    rules = yaml.safe_load(documents()["ConfigMap"]["data"]["rules.yaml"])["rules"]
    return [(rule["name"]["as"], rule["metricsQuery"]
             .replace("<<.Series>>", rule["name"]["matches"])
             .replace("<<.LabelMatchers>>", 'namespace="ns",pod=~"triton-bls-.*"')
             .replace("<<.GroupBy>>", "pod")) for rule in rules]


def _children(node) -> list:
    kind = type(node).__name__
    if kind == "BinaryExpr":
        return [node.lhs, node.rhs]
    if kind == "Call":
        return list(node.args)
    return [child for child in (getattr(node, name, None) for name in ("expr",)) if child]


def metric_names(node) -> set[str]:
    if type(node).__name__ in ("VectorSelector", "MatrixSelector"):
        selector = node if type(node).__name__ == "VectorSelector" else node.vector_selector
        return {selector.name}
    return set().union(*(metric_names(child) for child in _children(node)))


def unguarded(node) -> set[str]:
    """The metrics of ``node`` read for every model: not on the left of an ``unless on(model)``
    whose right side reads the orchestrators' own bls_ series."""
    if type(node).__name__ == "BinaryExpr" and str(node.op) == "unless":
        matching = node.modifier.matching if node.modifier else None
        on_model = matching is not None and "model" in set(matching.labels)
        if on_model and any(name.startswith("bls_") for name in metric_names(node.rhs)):
            return unguarded(node.rhs)
    if type(node).__name__ in ("VectorSelector", "MatrixSelector"):
        return metric_names(node)
    return set().union(*(unguarded(child) for child in _children(node)))


@pytest.mark.parametrize("where, query, per_model", [
    *(pytest.param(title, query, True, id=title) for title, query in dashboard_queries()),
    *(pytest.param(name, query, False, id=name) for name, query in adapter_queries())])
def test_no_query_reads_for_the_orchestrators_what_triton_counts_wrong_for_them(where, query,
                                                                              per_model):
    """A dashboard panel (one series per model) may divide Triton's queue time by its success
    count: for an orchestrator, both count the wait before execute(). A pod-wide adapter rule
    may not: it would mix the orchestrators' hand-offs into the sub-models' queueing."""
    tree = promql_parser.parse(query)
    wrong = unguarded(tree) & (BLIND_TO_ORCHESTRATORS | {QUEUE})
    if per_model and QUEUE in wrong:
        wrong -= {QUEUE, "nv_inference_request_success"}
    assert not wrong, f"{where!r} reads {sorted(wrong)} for the orchestrators too: {query}"


def test_the_orchestrators_failures_and_latency_come_from_their_own_metrics():
    queries = {title: promql_parser.parse(query).prettify() for title, query in dashboard_queries()}
    failed = next(q for title, q in queries.items() if title.startswith("Failed requests"))
    assert re.search(r'bls_requests_total\{code!="SUCCESS"\}', failed), failed
    compute = next(q for title, q in queries.items() if title.startswith("Compute time"))
    assert {"bls_request_latency_seconds_sum", "bls_request_latency_seconds_count"} <= set(
        re.findall(r"bls_[a-z_]+", compute)), compute


def test_the_check_of_the_queries_catches_a_bare_triton_counter():
    """The check above, on the dashboard's query as it was before the orchestrators' own series."""
    bare = "sum by (model) (rate(nv_inference_request_failure[1m]))"
    assert unguarded(promql_parser.parse(bare)) == {"nv_inference_request_failure"}
    guarded = f"{bare} unless on(model) sum by (model) (rate(bls_requests_total[1m]))"
    assert unguarded(promql_parser.parse(guarded)) == {"bls_requests_total"}
    wrong_side = f"sum by (model) (rate(bls_requests_total[1m])) unless on(model) {bare}"
    assert "nv_inference_request_failure" in unguarded(promql_parser.parse(wrong_side))


def test_the_scrape_annotations_name_the_metrics_port():
    annotations = documents()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    assert annotations["prometheus.io/path"] == "/metrics"
