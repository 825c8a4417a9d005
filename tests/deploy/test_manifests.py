"""The Kubernetes manifests (deploy/k8s): every overlay renders with kustomize, every object
passes the Kubernetes API's own schema (kubernetes-validate's bundled OpenAPI-derived schemas,
strict: an unknown field fails), and the rendered objects keep the promises an operator relies
on: non-root and read-only pods with probes, workers reachable only from gateways, secrets
referenced and never inlined, and the images each overlay names.

The ServiceMonitor is a CRD the Kubernetes schemas do not hold: it is checked against a schema
of the fields we use, written here from prometheus-operator's monitoring.coreos.com/v1 API.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.tools import DEPLOY, python_module, run

OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes the manifests promise to work on, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29", "latest")
WORKER_PORT = 8001
SECRETISH = re.compile(r"SECRET|KEY|TOKEN|PASSWORD|DATABASE_URL")
POD_OWNERS = ("Deployment", "StatefulSet", "Job")

Obj = dict[str, Any]

_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_SECRET_KEY_SELECTOR = {
    "type": "object",
    "required": ["name", "key"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "key": {"type": "string", "minLength": 1},
        "optional": {"type": "boolean"},
    },
}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array"},
    },
}
SERVICE_MONITOR_SCHEMA: Obj = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": _SECRET_KEY_SELECTOR,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


# ---- rendering --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Each overlay rendered as an operator would: from a copy of deploy/k8s whose secret env
    files are made from the committed examples (never a developer's own)."""
    root = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(DEPLOY / "k8s", root, ignore=shutil.ignore_patterns("*.env"))
    for example in sorted((root / "base" / "secrets").glob("*.env.example")):
        subprocess.run(
            [
                sys.executable,
                str(DEPLOY / "generate_secrets.py"),
                str(example),
                str(example.with_suffix("")),
            ],
            check=True,
            capture_output=True,
        )
    rendered = {}
    for overlay in OVERLAYS:
        result = run("kubectl", "kustomize", str(root / "overlays" / overlay))
        assert result.returncode == 0, f"kubectl kustomize overlays/{overlay}: {result.stderr}"
        rendered[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return rendered


def one(objects: list[Obj], kind: str, component: str) -> Obj:
    """The single object of `kind` for a component (gateway, worker, migrate)."""
    found = [
        obj
        for obj in objects
        if obj["kind"] == kind
        and obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
    return found[0]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name}, found {len(found)}"
    return found[0]


def pod_owners(objects: list[Obj]) -> Iterator[Obj]:
    return (obj for obj in objects if obj["kind"] in POD_OWNERS)


def pod_spec(owner: Obj) -> Obj:
    spec: Obj = owner["spec"]["template"]["spec"]
    return spec


def containers(owner: Obj, init: bool = True) -> list[Obj]:
    spec = pod_spec(owner)
    listed: list[Obj] = spec["containers"] + (spec.get("initContainers", []) if init else [])
    return listed


def env_value(container: Obj, name: str) -> str | None:
    for variable in container.get("env", []):
        if variable["name"] == name:
            value = variable.get("value")
            return str(value) if value is not None else None
    return None


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels only, as ours are) matches `labels`."""
    assert set(selector) <= {"matchLabels"}, f"unexpected selector form: {selector}"
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def template_labels(owner: Obj) -> dict[str, str]:
    labels: dict[str, str] = owner["spec"]["template"]["metadata"]["labels"]
    return labels


# ---- schema validation ------------------------------------------------------------------------


def schema_errors(obj: Obj) -> list[str]:
    """Why `obj` fails the Kubernetes API's schema (for every version checked), or []."""
    validator = python_module("kubernetes_validate", "kubernetes-validate")
    latest = validator.latest_version()
    errors = []
    for version in KUBERNETES_VERSIONS:
        target = latest if version == "latest" else version
        try:
            validator.validate(obj, target, strict=True)
        except validator.ValidationError as error:
            where = ".".join(str(part) for part in error.path)
            errors.append(
                f"{obj['kind']}/{obj['metadata']['name']} on {target}: {where}: {error.message}"
            )
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_the_kubernetes_schema(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    errors = [
        error for obj in objects if obj["kind"] != "ServiceMonitor" for error in schema_errors(obj)
    ]
    assert not errors, "\n".join(errors)


def test_the_schema_check_rejects_a_misspelt_field(renders: dict[str, list[Obj]]) -> None:
    broken = copy.deepcopy(one(renders["cpu"], "Deployment", "gateway"))
    container = pod_spec(broken)["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    assert schema_errors(broken), "a misspelt probe passed the schema check"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_matches_its_schema_and_the_gateway_service(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    monitor = one(objects, "ServiceMonitor", "gateway")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    service = one(objects, "Service", "gateway")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    port_names = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        credentials = endpoint["authorization"]["credentials"]
        secret = named(objects, "Secret", credentials["name"])  # the generated, hashed name
        assert credentials["key"] in secret["data"]


def test_the_service_monitor_schema_rejects_a_misspelt_field(renders: dict[str, list[Obj]]) -> None:
    broken = copy.deepcopy(one(renders["cpu"], "ServiceMonitor", "gateway"))
    broken["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)


# ---- what every pod promises ------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_as_non_root_on_a_read_only_root(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    for owner in pod_owners(renders[overlay]):
        spec = pod_spec(owner)
        name = owner["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        # Service links would inject PREFIXGATE_*-named variables: settings come from those.
        assert spec["enableServiceLinks"] is False, name
        for container in containers(owner):
            context = container["securityContext"]
            where = f"{name}/{container['name']}"
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert context.get("runAsUser", 1) != 0, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    for owner in pod_owners(renders[overlay]):
        for container in containers(owner):
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[bound]), f"{container['name']} {bound}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_paths_are_volumes(renders: dict[str, list[Obj]], overlay: str) -> None:
    """The root filesystem is read-only: every directory a setting points the process at is a
    mounted volume (or below one)."""
    writable = ("PREFIXGATE_STATE_DIR", "PREFIXGATE_KERNEL_CACHE", "TRITON_CACHE_DIR", "HOME")
    for owner in pod_owners(renders[overlay]):
        for container in containers(owner, init=False):
            mounts = [mount["mountPath"] for mount in container.get("volumeMounts", [])]
            assert "/tmp" in mounts, container["name"]
            for name in writable:
                path = env_value(container, name)
                if path is None:
                    continue
                assert any(path == mount or path.startswith(mount + "/") for mount in mounts), (
                    f"{container['name']}: {name}={path} is on the read-only root"
                )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_long_running_pods_have_probes_and_drain_in_their_grace_period(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    deployments = [obj for obj in renders[overlay] if obj["kind"] in ("Deployment", "StatefulSet")]
    assert {
        one(renders[overlay], "Deployment", c)["metadata"]["name"] for c in ("gateway", "worker")
    }
    for owner in deployments:
        spec = pod_spec(owner)
        for container in spec["containers"]:
            port_names = {port["name"] for port in container["ports"]}
            for probe, path in (
                ("startupProbe", "/healthz"),
                ("livenessProbe", "/healthz"),
                ("readinessProbe", "/readyz"),
            ):
                check = container[probe]["httpGet"]
                assert check["path"] == path, f"{container['name']} {probe}"
                assert check["port"] in port_names, f"{container['name']} {probe}"
            pause = container["lifecycle"]["preStop"]["exec"]["command"]
            assert pause[0] == "sleep"
            grace = env_value(container, "PREFIXGATE_SHUTDOWN_GRACE_S")
            assert grace is not None, f"{container['name']}: the drain time is left implicit"
            needed = int(pause[1]) + float(grace) + 5
            assert spec["terminationGracePeriodSeconds"] >= needed, owner["metadata"]["name"]


def test_no_object_names_a_namespace(renders: dict[str, list[Obj]]) -> None:
    for objects in renders.values():
        assert not [obj["metadata"]["name"] for obj in objects if "namespace" in obj["metadata"]]


# ---- gateways and workers ---------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_finds_workers_through_the_headless_service(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    gateway = pod_spec(one(objects, "Deployment", "gateway"))["containers"][0]
    worker_owner = one(objects, "Deployment", "worker")
    worker = pod_spec(worker_owner)["containers"][0]
    service = one(objects, "Service", "worker")
    assert service["spec"]["clusterIP"] == "None"
    assert selects({"matchLabels": service["spec"]["selector"]}, template_labels(worker_owner))
    (port,) = service["spec"]["ports"]
    assert env_value(gateway, "PREFIXGATE_WORKERS") == (
        f"dns://{service['metadata']['name']}:{port['port']}"
    )
    target = {item["name"]: item["containerPort"] for item in worker["ports"]}[port["targetPort"]]
    assert target == port["port"] == WORKER_PORT
    assert worker["args"][:1] == ["worker"]
    assert worker["args"][worker["args"].index("--port") + 1] == str(WORKER_PORT)
    assert gateway["args"][:1] == ["serve"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_start_with_the_kernel_the_image_built(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """The image builds the kernel into /opt/prefixgate/kernels (its PREFIXGATE_KERNEL_CACHE),
    which the read-only root cannot lock: an init container copies it, timestamps and all, into
    the writable cache the worker is pointed at."""
    spec = pod_spec(one(renders[overlay], "Deployment", "worker"))
    (worker,) = spec["containers"]
    (init,) = spec["initContainers"]
    cache = env_value(worker, "PREFIXGATE_KERNEL_CACHE")
    assert cache is not None
    assert f"cp -a /opt/prefixgate/kernels/. {cache}/" in " ".join(init["command"])
    (shared,) = [
        mount
        for mount in init["volumeMounts"]
        if cache.startswith(mount["mountPath"] + "/") and mount in worker["volumeMounts"]
    ]
    assert shared["name"] in {volume["name"] for volume in spec["volumes"] if "emptyDir" in volume}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_gateways_reach_workers_and_workers_send_only_dns(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    (policy,) = [obj for obj in objects if obj["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    worker_labels = template_labels(one(objects, "Deployment", "worker"))
    gateway_labels = template_labels(one(objects, "Deployment", "gateway"))
    assert selects(spec["podSelector"], worker_labels)
    assert not selects(spec["podSelector"], gateway_labels)
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    assert spec["ingress"], "no ingress rule: nothing could reach the workers"
    for rule in spec["ingress"]:
        assert rule["ports"] == [{"protocol": "TCP", "port": WORKER_PORT}]
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"a peer beyond the namespace's pods: {peer}"
            assert selects(peer["podSelector"], gateway_labels)
            assert not selects(peer["podSelector"], worker_labels)
    for rule in spec["egress"]:
        assert {port["port"] for port in rule["ports"]} == {53}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_and_disruption_budgets_select_their_pods(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    gateway = one(objects, "Deployment", "gateway")
    autoscaler = one(objects, "HorizontalPodAutoscaler", "gateway")
    assert autoscaler["apiVersion"] == "autoscaling/v2"
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", gateway["metadata"]["name"])
    assert "replicas" not in gateway["spec"], "a replica count fights the autoscaler on apply"
    assert autoscaler["spec"]["minReplicas"] >= 2
    for component in ("gateway", "worker"):
        budget = one(objects, "PodDisruptionBudget", component)
        assert selects(
            budget["spec"]["selector"], template_labels(one(objects, "Deployment", component))
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_migration_job_upgrades_the_schema(renders: dict[str, list[Obj]], overlay: str) -> None:
    job = one(renders[overlay], "Job", "migrate")
    (container,) = pod_spec(job)["containers"]
    assert container["args"] == ["db", "upgrade"]
    assert pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")


# ---- secrets and images -----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_inlined(renders: dict[str, list[Obj]], overlay: str) -> None:
    objects = renders[overlay]
    secrets = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Secret"}
    for owner in pod_owners(objects):
        for container in containers(owner):
            for variable in container.get("env", []):
                if SECRETISH.search(variable["name"]):
                    assert "value" not in variable, (
                        f"{container['name']}: {variable['name']} inlined"
                    )
                reference = variable.get("valueFrom", {}).get("secretKeyRef")
                if reference:
                    assert reference["key"] in secrets[reference["name"]]["data"]
            for source in container.get("envFrom", []):
                assert source["secretRef"]["name"] in secrets


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_get_the_worker_secret_and_nothing_else(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    secrets = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Secret"}

    def keys(container: Obj) -> set[str]:
        return {
            key
            for source in container.get("envFrom", [])
            for key in secrets[source["secretRef"]["name"]]["data"]
        }

    worker = pod_spec(one(objects, "Deployment", "worker"))["containers"][0]
    gateway = pod_spec(one(objects, "Deployment", "gateway"))["containers"][0]
    assert keys(worker) == {"PREFIXGATE_WORKER_SECRET"}
    assert {
        "PREFIXGATE_DATABASE_URL",
        "PREFIXGATE_KEY_HASH_SECRET",
        "PREFIXGATE_AUDIT_SIGNING_KEY",
        "PREFIXGATE_JWT_SECRET",
        "PREFIXGATE_WORKER_SECRET",
    } <= keys(gateway)


def test_committed_secret_examples_hold_only_placeholders() -> None:
    examples = sorted((DEPLOY / "k8s").rglob("*.env.example"))
    assert examples
    for example in examples:
        for line in example.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                assert "CHANGE_ME" in line.partition("=")[2], f"{example.name}: {line}"


def overlay_images(overlay: str) -> dict[str, str]:
    """The overlay's `images:` as placeholder -> the reference it becomes."""
    kustomization = yaml.safe_load(
        (DEPLOY / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text()
    )
    return {
        image["name"]: f"{image['newName']}:{image['newTag']}" for image in kustomization["images"]
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_an_image_the_overlay_names(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    images = overlay_images(overlay)
    for owner in pod_owners(renders[overlay]):
        for container in containers(owner):
            assert container["image"] in images.values(), (
                f"{container['name']}: {container['image']}"
            )
    for component in ("gateway", "migrate"):
        owner = next(
            obj
            for obj in renders[overlay]
            if obj["kind"] in POD_OWNERS and component in obj["metadata"]["name"]
        )
        assert {c["image"] for c in containers(owner)} == {images["prefixgate"]}, component


def test_gpu_workers_run_the_cuda_image_on_gpu_nodes(renders: dict[str, list[Obj]]) -> None:
    objects = renders["gpu"]
    images = overlay_images("gpu")
    worker_owner = one(objects, "Deployment", "worker")
    spec = pod_spec(worker_owner)
    worker = spec["containers"][0]
    assert {c["image"] for c in containers(worker_owner)} == {images["prefixgate-cuda"]}
    assert images["prefixgate-cuda"] != images["prefixgate"]
    for bound in ("requests", "limits"):
        assert worker["resources"][bound]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"]
    assert any(toleration["key"] == "nvidia.com/gpu" for toleration in spec["tolerations"])
    assert env_value(worker, "PREFIXGATE_DEVICE") == "cuda"
    gateway = pod_spec(one(objects, "Deployment", "gateway"))["containers"][0]
    assert "nvidia.com/gpu" not in gateway["resources"]["limits"], "the gateway runs no engine"


def test_cpu_overlay_asks_for_no_gpu(renders: dict[str, list[Obj]]) -> None:
    for owner in pod_owners(renders["cpu"]):
        spec = pod_spec(owner)
        assert "nodeSelector" not in spec and "tolerations" not in spec
        for container in containers(owner):
            assert "nvidia.com/gpu" not in container["resources"]["limits"]
