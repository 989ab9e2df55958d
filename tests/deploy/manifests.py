"""Loading what the deployment files describe, for the tests beside this module.

`render_kustomization` builds a kustomization the way `kubectl kustomize` does for the subset
deploy/k8s uses (resources, and RFC 6902 patches with a target), so the manifests are checked
without kubectl; anything else in a kustomization is an error rather than silently ignored.
test_k8s.py compares the result with kubectl's where kubectl is installed.
"""

from __future__ import annotations

import copy
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VARIANTS = {"base": K8S_DIR / "base", "gpu": K8S_DIR / "overlays" / "gpu"}

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}

# The flags (argparse dests) of each service's HTTP server (/health, /metrics): port, bind address.
HTTP_PORT_FLAG = {"engine": "http_port", "gateway": "port", "scheduler": "http_port", "scaler": "http_port",
                  "control": "port"}
HTTP_HOST_FLAG = {"engine": "http_host", "gateway": "host", "scheduler": "http_host", "scaler": "http_host",
                  "control": "host"}


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


_SUPPORTED_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}


def render_kustomization(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - _SUPPORTED_KUSTOMIZATION_KEYS
    if unsupported:
        raise ValueError(f"{directory}: kustomization fields this renderer does not apply: {sorted(unsupported)}")
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects.extend(render_kustomization(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path", "target"}:
            raise ValueError(f"{directory}: only patches with a path and a target are supported: {patch}")
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [obj for obj in objects if _matches(obj, patch["target"])]
        if not targets:
            raise ValueError(f"{directory}: patch {patch['path']} matches no object")
        for obj in targets:
            apply_json_patch(obj, ops)
    return objects


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    actual = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"],
              "namespace": obj["metadata"].get("namespace")}
    unknown = set(target) - set(actual)
    if unknown:
        raise ValueError(f"unsupported patch target fields: {sorted(unknown)}")
    return all(actual[key] == value for key, value in target.items())


def apply_json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / replace / remove, in place."""
    for op in ops:
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if kind not in ("add", "replace", "remove"):
            raise ValueError(f"unsupported JSON patch op {kind!r}")
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                node[index] = copy.deepcopy(op["value"])
            else:
                del node[index]
        else:
            if kind != "add" and last not in node:
                raise KeyError(f"{op['path']}: nothing to {kind}")
            if kind == "remove":
                del node[last]
            else:
                node[last] = copy.deepcopy(op["value"])


def render_k8s(variant: str) -> list[dict]:
    return render_kustomization(K8S_VARIANTS[variant])


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


@dataclass
class ServiceCommand:
    """One container that runs `python -m services.<module> ...`, with its environment."""

    where: str  # e.g. "compose:engine-cpu" or "k8s-gpu:strata-engine-tiny-llama/engine"
    argv: list[str]
    environ: dict[str, str]

    @property
    def module(self) -> str:
        return self.argv[2].removeprefix("services.")

    @property
    def flags(self) -> list[str]:
        return self.argv[3:]

    def parse(self):
        """The service's own argument parser applied to these flags (SystemExit on a bad flag)."""
        main = importlib.import_module(f"services.{self.module}.__main__")
        return main.build_parser().parse_args(self.flags)


def _is_service_command(argv: list[str]) -> bool:
    return len(argv) >= 3 and argv[:2] == ["python", "-m"] and argv[2].startswith("services.")


def compose_commands(config: dict | None = None) -> list[ServiceCommand]:
    """The Strata containers of compose.yaml, or of a configuration as `docker compose config`
    merges it from several files."""
    out = []
    for name, service in (load_compose() if config is None else config)["services"].items():
        argv = service.get("command")
        if isinstance(argv, list) and _is_service_command(argv):
            out.append(ServiceCommand(f"compose:{name}", argv, dict(service.get("environment") or {})))
    return out


def container_environ(objects: list[dict], container: dict) -> dict[str, str]:
    """The variables a container gets from its ConfigMaps and literal values (not fieldRefs)."""
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config = find(objects, "ConfigMap", source["configMapRef"]["name"])
        environ.update(config.get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            environ[var["name"]] = var["value"]
    return environ


def k8s_commands(variant: str) -> list[ServiceCommand]:
    objects = render_k8s(variant)
    out = []
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            argv = [*container.get("command", []), *container.get("args", [])]
            if _is_service_command(argv):
                out.append(ServiceCommand(f"k8s-{variant}:{workload['metadata']['name']}/{container['name']}", argv,
                                          container_environ(objects, container)))
    return out


def all_commands() -> list[ServiceCommand]:
    return [*compose_commands(), *(c for variant in K8S_VARIANTS for c in k8s_commands(variant))]


def local_stack_modules() -> set[str]:
    """The services the local stack (`strata up`, the end-to-end tests) starts, from its source."""
    source = (ROOT / "shared" / "localstack.py").read_text()
    return set(re.findall(r"\"services\.(\w+)\"", source))


def health_url_port(probe_command: list[str]) -> int:
    """The port of the http://127.0.0.1:PORT/health URL an exec-style health check fetches."""
    match = re.search(r"http://127\.0\.0\.1:(\d+)/health", " ".join(probe_command))
    assert match, f"no loopback /health URL in {probe_command}"
    return int(match.group(1))


def duration_seconds(value: str) -> float:
    """A compose duration such as '1m30s' or '40s'."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)
