"""deploy/k8s: every object valid against the Kubernetes OpenAPI schemas (kubernetes-validate's
JSON schemas, strict: unknown fields fail), and wired the way the scaler and the drain need."""

from __future__ import annotations

import copy
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import (
    HTTP_PORT_FLAG,
    K8S_VARIANTS,
    find,
    health_url_port,
    k8s_commands,
    render_k8s,
    workloads,
)

# The oldest Kubernetes release the manifests target (the preStop `sleep` action is on by default
# from 1.30) and the newest whose schemas the pinned kubernetes-validate ships.
KUBERNETES_VERSIONS = ["1.30", "1.37"]
NAMESPACE = "strata"


@pytest.fixture(scope="module", params=sorted(K8S_VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def objects(variant) -> list[dict]:
    return render_k8s(variant)


def engine_of(objects: list[dict]) -> tuple[dict, dict]:
    """The engine Deployment and its container."""
    [deployment] = [w for w in workloads(objects)
                    if w["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def command_of(variant: str, workload: dict):
    prefix = f"k8s-{variant}:{workload['metadata']['name']}/"
    [command] = [c for c in k8s_commands(variant) if c.where.startswith(prefix)]
    return command


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_matches_the_kubernetes_schemas(objects, version):
    errors = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path))
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_the_schemas_reject_a_misspelt_field(objects):
    deployment, _ = engine_of(objects)
    broken = copy.deepcopy(deployment)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_rendering_matches_kubectl_kustomize(variant, objects):
    """The renderer these tests use gives what `kubectl kustomize` gives."""
    out = subprocess.run(["kubectl", "kustomize", str(K8S_VARIANTS[variant])], capture_output=True, text=True,
                         check=True, timeout=60).stdout

    def key(obj):
        return obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]

    assert sorted(objects, key=key) == sorted((o for o in yaml.safe_load_all(out) if o), key=key)


def test_everything_lives_in_the_strata_namespace(objects):
    find(objects, "Namespace", NAMESPACE)
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


def test_selectors_and_services_find_their_pods(objects):
    pods = {w["metadata"]["name"]: w["spec"]["template"] for w in workloads(objects)}
    for workload in workloads(objects):
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
    for service in (o for o in objects if o["kind"] == "Service"):
        selected = [t for t in pods.values() if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            for template in selected:
                names = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports", [])}
                numbers = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names | numbers, f"{service['metadata']['name']}: {port}"


def test_strata_containers_listen_where_their_probes_look(variant, objects):
    """The container's `http` port is the one the service's flags give it, and every probe hits
    /health there."""
    for workload in workloads(objects):
        [container] = workload["spec"]["template"]["spec"]["containers"]
        if container.get("command", [])[:2] != ["python", "-m"]:
            continue
        command = command_of(variant, workload)
        port = getattr(command.parse(), HTTP_PORT_FLAG[command.module])
        assert {"name": "http", "containerPort": port} in container["ports"], command.where
        for probe_kind in ("readinessProbe", "livenessProbe"):
            probe = container[probe_kind]
            if "httpGet" in probe:
                assert probe["httpGet"] == {"path": "/health", "port": "http"}, (command.where, probe_kind)
            else:
                assert health_url_port(probe["exec"]["command"]) == port, (command.where, probe_kind)


def test_engine_is_the_deployment_the_scaler_scales(variant, objects):
    deployment, _ = engine_of(objects)
    scaler = command_of(variant, find(objects, "Deployment", "strata-scaler")).parse()
    engine = command_of(variant, deployment).parse()
    assert scaler.actuator == "kubernetes"
    assert deployment["metadata"]["name"] == scaler.k8s_deployment_prefix + engine.deployment
    # The engine's replica id is its pod's name, unique and stable for the pod's life.
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert engine.replica_id == "$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_engine_threads_are_the_pods_cpu_share(variant, objects):
    """torch's threads come from the pod's CPU request, not the node's core count."""
    _, container = engine_of(objects)
    env = {e["name"]: e for e in container["env"]}
    source = env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert source["resource"] == "requests.cpu" and str(source["divisor"]) == "1"
    assert int(container["resources"]["requests"]["cpu"]) >= 1


def test_engine_probes_and_drain(variant, objects):
    deployment, container = engine_of(objects)
    for probe_kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe_kind]["httpGet"]["path"] == "/health", probe_kind
    pod = deployment["spec"]["template"]["spec"]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain_timeout = command_of(variant, deployment).parse().drain_timeout
    # The grace period runs from the start of preStop: it must hold the pause and the whole drain.
    assert pod["terminationGracePeriodSeconds"] >= pause + drain_timeout + 5
    # A rolling update never removes a ready engine before its replacement is ready.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_gpus_only_in_the_gpu_variant(variant, objects):
    deployment, container = engine_of(objects)
    engine = command_of(variant, deployment).parse()
    resources = container["resources"]
    if variant == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1
        assert engine.device == "cuda" and container["image"] == "strata:cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in deployment["spec"]["template"]["spec"]["tolerations"])
    else:
        assert engine.device == "cpu" and container["image"] == "strata:cpu"
    for workload in workloads(objects):
        if workload is not deployment:
            for c in workload["spec"]["template"]["spec"]["containers"]:
                assert "nvidia.com/gpu" not in str(c.get("resources")), workload["metadata"]["name"]


def test_scaler_may_scale_engine_deployments(objects):
    scaler = find(objects, "Deployment", "strata-scaler")
    account = scaler["spec"]["template"]["spec"]["serviceAccountName"]
    find(objects, "ServiceAccount", account)
    bindings = [b for b in objects if b["kind"] == "RoleBinding"
                and {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in b["subjects"]]
    assert bindings, "no RoleBinding for the scaler's ServiceAccount"
    rules = [rule for b in bindings for rule in find(objects, b["roleRef"]["kind"], b["roleRef"]["name"])["rules"]]

    def allowed(resource: str, verb: str) -> bool:
        return any("apps" in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)

    assert allowed("deployments/scale", "patch") and allowed("deployments/scale", "get")
    assert allowed("deployments", "get") and allowed("deployments", "patch")
    # Namespaced only: nothing cluster-wide.
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_schedulers_run_active_active(objects):
    assert find(objects, "Deployment", "strata-scheduler")["spec"]["replicas"] >= 2
