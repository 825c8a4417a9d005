"""The Kubernetes manifests (deploy/k8s): every overlay renders with kustomize, as shipped,
with the second model's workers enabled (k8s/models/) and with cert-manager making the TLS
Secrets; every object passes the Kubernetes API's own schema (kubernetes-validate's bundled
OpenAPI-derived schemas, strict: an unknown field fails), and the rendered objects keep the
promises an operator relies on: non-root and read-only pods with probes, workers and Redis
reachable only from gateways, one Deployment per model whose pods the headless Service and the
NetworkPolicy find, gateways in a StatefulSet that keeps each one's audit state (the spool and
the signed checkpoint file) on a claim of its own, gateways and workers given their own
certificate, the CA's and the signing key (and never the CA's key), secrets referenced and
never inlined, and the release's images (the tags deploy/build-images.sh gives them), which an
operator's own overlay can move to their registry with kubectl alone.

The ServiceMonitor (prometheus-operator's monitoring.coreos.com/v1) and cert-manager's Issuer
and Certificate (cert-manager.io/v1) are CRDs the Kubernetes schemas do not hold: each is
checked against a schema of the fields we use, written here from its project's API.
"""

from __future__ import annotations

import base64
import copy
import itertools
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from gateway.settings import Settings
from gateway.workers.certificates import WORKER_SERVER_NAME
from gateway.workers.tls import WorkerTLS
from tests.deploy.tools import (
    DEPLOY,
    handshake,
    make_certificates,
    python_module,
    redis_check_passes,
    release_version,
    run,
)

# The second model's directory, and the line each overlay carries, commented out, to enable it.
SECOND_MODEL = "smollm2-360m-instruct"
SECOND_MODEL_LINE = f"  - ../../models/{SECOND_MODEL}"
# Where the TLS Secrets come from: `prefixgate certs` files (as shipped) or cert-manager.
FILES, CERT_MANAGER = "tls-from-files", "tls-cert-manager"
# What is rendered: each overlay as shipped, with the second model's line enabled, and with
# cert-manager's component in place of the files'.
RENDERS = {
    "cpu": ("cpu", False, FILES),
    "gpu": ("gpu", False, FILES),
    "cpu-two-models": ("cpu", True, FILES),
    "gpu-two-models": ("gpu", True, FILES),
    "cpu-cert-manager": ("cpu", False, CERT_MANAGER),
    "gpu-two-models-cert-manager": ("gpu", True, CERT_MANAGER),
}
GPU_RENDERS = tuple(name for name, (overlay, *_) in RENDERS.items() if overlay == "gpu")
CPU_RENDERS = tuple(name for name, (overlay, *_) in RENDERS.items() if overlay == "cpu")
# The oldest Kubernetes the manifests promise to work on, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29", "latest")
WORKER_PORT = 8001
REDIS_PORT = 6379
EMBEDDED_MODEL = "smollm2-135m-instruct"
MODEL_LABEL = "prefixgate.io/model"
SECRETISH = re.compile(r"SECRET|KEY|TOKEN|PASSWORD|DATABASE_URL|REDIS_URL|_AUTH$")
POD_OWNERS = ("Deployment", "StatefulSet", "Job")
# The controllers whose selectors must not overlap (a Job's is generated for it).
CONTROLLERS = ("Deployment", "StatefulSet")
# Paths, not secrets: the files of the mounted TLS Secret (kubernetes.io/tls's keys).
TLS_FILES = {
    "PREFIXGATE_WORKER_TLS_CERT": "tls.crt",
    "PREFIXGATE_WORKER_TLS_KEY": "tls.key",
    "PREFIXGATE_WORKER_TLS_CA": "ca.crt",
}
# Each role's TLS Secret, and the certificate use it must carry (and not the other).
TLS_SECRETS = {"worker": "prefixgate-worker-tls", "gateway": "prefixgate-gateway-tls"}
TLS_USE = {"worker": "server auth", "gateway": "client auth"}
SIGNING_KEY = "PREFIXGATE_WORKER_SIGNING_KEY"
# The settings that place the gateway's audit files, and the variables that set them.
AUDIT_PATH_SETTINGS = {
    "audit_spool_path": "PREFIXGATE_AUDIT_SPOOL_PATH",
    "audit_checkpoint_path": "PREFIXGATE_AUDIT_CHECKPOINT_PATH",
}
# Each overlay's image placeholders, and the flavour of deploy/build-images.sh's image each
# becomes (the gateways and the migration run the CPU image everywhere).
OVERLAY_FLAVOURS = {
    "cpu": {"prefixgate": "cpu"},
    "gpu": {"prefixgate": "cpu", "prefixgate-cuda": "cuda"},
}
# The operator's own overlay the shipped overlays' comments show: a directory beside deploy/.
OPERATOR_OVERLAY = "my-prefixgate"

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

# cert-manager.io/v1: the fields of Issuer and Certificate we use, with their types and values.
_KEY_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
]  # fmt: skip
_GO_DURATION = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
_CERT_MANAGER_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}},
}
ISSUER_SCHEMA: Obj = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Issuer"},
        "metadata": _CERT_MANAGER_METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "maxProperties": 1,  # one kind of issuer
            "properties": {
                "selfSigned": {"type": "object", "additionalProperties": False},
                "ca": {
                    "type": "object",
                    "required": ["secretName"],
                    "additionalProperties": False,
                    "properties": {"secretName": {"type": "string", "minLength": 1}},
                },
            },
        },
    },
}
CERTIFICATE_SCHEMA: Obj = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": _CERT_MANAGER_METADATA,
        "spec": {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "additionalProperties": False,
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "commonName": {"type": "string", "minLength": 1, "maxLength": 64},
                "dnsNames": {"type": "array", "items": {"type": "string"}},
                "isCA": {"type": "boolean"},
                "usages": {"type": "array", "items": {"enum": _KEY_USAGES}},
                "duration": {"type": "string", "pattern": _GO_DURATION},
                "renewBefore": {"type": "string", "pattern": _GO_DURATION},
                "privateKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                },
                "issuerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                        "group": {"const": "cert-manager.io"},
                    },
                },
            },
        },
    },
}
# Custom resources, checked against the schemas above instead of the Kubernetes API's.
CRD_SCHEMAS = {
    "ServiceMonitor": SERVICE_MONITOR_SCHEMA,
    "Issuer": ISSUER_SCHEMA,
    "Certificate": CERTIFICATE_SCHEMA,
}


# ---- rendering --------------------------------------------------------------------------------


_certificates: list[Path] = []  # made once per session: `prefixgate certs` takes a second


def operator_certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA's directory with a worker's and a gateway's certificate, made by `prefixgate certs`."""
    if not _certificates:
        _certificates.append(make_certificates(tmp_path_factory.mktemp("ca") / "ca"))
    return _certificates[0]


def operator_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s whose secret env files are made from the committed examples and
    whose certificates by `prefixgate certs` (never a developer's own), as an operator would
    make them: the files components/tls-from-files names are copied from the CA's directory,
    and ca.key is not."""
    root = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(DEPLOY / "k8s", root, ignore=shutil.ignore_patterns("*.env", "*.pem", "*.key"))
    ca = operator_certificates(tmp_path_factory)
    for name in ("ca.pem", "worker.pem", "worker.key", "gateway.pem", "gateway.key"):
        shutil.copy2(ca / name, root / "components" / FILES / "certs" / name)
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
    return root


def render(overlay: Path) -> list[Obj]:
    result = run("kubectl", "kustomize", str(overlay))
    assert result.returncode == 0, f"kubectl kustomize {overlay}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Each overlay rendered as shipped, and with the second model enabled as deploy/README.md
    says: by uncommenting its line in the overlay's resources."""
    rendered = {}
    for name, (overlay, second_model, tls) in RENDERS.items():
        root = operator_copy(tmp_path_factory)
        kustomization = root / "overlays" / overlay / "kustomization.yaml"
        text = kustomization.read_text()
        if second_model:
            commented = SECOND_MODEL_LINE.replace("- ", "# - ", 1)
            assert commented + "\n" in text, f"overlays/{overlay} lacks `{commented.strip()}`"
            text = text.replace(commented, SECOND_MODEL_LINE)
        files_line = f"  - ../../components/{FILES}\n"
        assert files_line in text, f"overlays/{overlay} lacks the {FILES} component"
        text = text.replace(files_line, f"  - ../../components/{tls}\n")
        kustomization.write_text(text)
        rendered[name] = render(kustomization.parent)
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


def component(obj: Obj) -> str | None:
    found: str | None = obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")
    return found


def gateway_set(objects: list[Obj]) -> Obj:
    """The gateways' StatefulSet."""
    return one(objects, "StatefulSet", "gateway")


def gateway_service(objects: list[Obj]) -> Obj:
    """The Service clients reach the gateways through (not the StatefulSet's headless one)."""
    found = [
        obj
        for obj in objects
        if obj["kind"] == "Service"
        and component(obj) == "gateway"
        and obj["spec"].get("clusterIP") != "None"
    ]
    assert len(found) == 1, f"expected one client Service for the gateways, found {len(found)}"
    return found[0]


def workers(objects: list[Obj]) -> list[Obj]:
    """Every model's worker Deployment (at least one)."""
    found = [obj for obj in objects if obj["kind"] == "Deployment" and component(obj) == "worker"]
    assert found, "no worker Deployment"
    return found


def secret_data(objects: list[Obj], name: str) -> dict[str, str]:
    """A rendered Secret's keys and decoded values."""
    data = named(objects, "Secret", name)["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def env_sources(objects: list[Obj], container: Obj) -> dict[str, Obj]:
    """Each variable a container gets (from `env`, or from the Secrets of its `envFrom`) and
    where it comes from: its `env` entry, or {"secretRef": name} for an envFrom Secret."""
    sources: dict[str, Obj] = {}
    for source in container.get("envFrom", []):
        name = source["secretRef"]["name"]
        for key in named(objects, "Secret", name)["data"]:
            sources[key] = {"secretRef": name}
    for variable in container.get("env", []):
        sources[variable["name"]] = variable
    return sources


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


@pytest.mark.parametrize("overlay", RENDERS)
def test_every_object_passes_the_kubernetes_schema(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    errors = [
        error for obj in objects if obj["kind"] not in CRD_SCHEMAS for error in schema_errors(obj)
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", RENDERS)
def test_every_custom_resource_matches_its_schema(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    for obj in renders[overlay]:
        if obj["kind"] in CRD_SCHEMAS:
            jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])


def test_the_certificate_schema_rejects_a_misspelt_field(renders: dict[str, list[Obj]]) -> None:
    objects = renders["cpu-cert-manager"]
    broken = copy.deepcopy(named(objects, "Certificate", TLS_SECRETS["worker"]))
    broken["spec"]["dnsName"] = broken["spec"].pop("dnsNames")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, CERTIFICATE_SCHEMA)
    broken = copy.deepcopy(named(objects, "Certificate", TLS_SECRETS["worker"]))
    broken["spec"]["usages"] = ["server-auth"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, CERTIFICATE_SCHEMA)


def test_the_schema_check_rejects_a_misspelt_field(renders: dict[str, list[Obj]]) -> None:
    broken = copy.deepcopy(gateway_set(renders["cpu"]))
    container = pod_spec(broken)["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    assert schema_errors(broken), "a misspelt probe passed the schema check"


@pytest.mark.parametrize("overlay", RENDERS)
def test_service_monitor_matches_its_schema_and_the_gateway_service(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """It scrapes the gateways through their client Service, and through that one alone: a
    second selected Service with the port (the StatefulSet's headless one, say) would scrape
    every gateway twice and double the per-tenant series."""
    objects = renders[overlay]
    monitor = one(objects, "ServiceMonitor", "gateway")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    service = gateway_service(objects)
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    selected = [
        obj
        for obj in objects
        if obj["kind"] == "Service"
        and selects(monitor["spec"]["selector"], obj["metadata"].get("labels", {}))
    ]
    for endpoint in monitor["spec"]["endpoints"]:
        scraped = [
            obj["metadata"]["name"]
            for obj in selected
            if endpoint["port"] in {port["name"] for port in obj["spec"].get("ports", [])}
        ]
        assert scraped == [service["metadata"]["name"]], f"{endpoint['port']}: {scraped}"
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


@pytest.mark.parametrize("overlay", RENDERS)
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


@pytest.mark.parametrize("overlay", RENDERS)
def test_every_container_has_requests_and_limits(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    for owner in pod_owners(renders[overlay]):
        for container in containers(owner):
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[bound]), f"{container['name']} {bound}"


@pytest.mark.parametrize("overlay", RENDERS)
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


@pytest.mark.parametrize("overlay", RENDERS)
def test_long_running_pods_have_probes_and_drain_in_their_grace_period(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """PrefixGate's own (Redis has its probes checked below). A gateway's are HTTP; a
    worker's connect over TCP: it completes a TLS handshake only with a gateway's client
    certificate, which the kubelet cannot present (an httpGet, HTTP or HTTPS, never passes)."""
    deployments = [obj for obj in renders[overlay] if obj["kind"] in ("Deployment", "StatefulSet")]
    assert {component(owner) for owner in deployments} == {"gateway", "worker", "redis"}
    for owner in deployments:
        if component(owner) == "redis":
            continue
        spec = pod_spec(owner)
        for container in spec["containers"]:
            port_names = {port["name"] for port in container["ports"]}
            for probe, path in (
                ("startupProbe", "/healthz"),
                ("livenessProbe", "/healthz"),
                ("readinessProbe", "/readyz"),
            ):
                where = f"{owner['metadata']['name']} {probe}"
                if component(owner) == "worker":
                    assert set(container[probe]) & {"httpGet", "exec", "grpc"} == set(), where
                    check = container[probe]["tcpSocket"]
                else:
                    check = container[probe]["httpGet"]
                    assert check["path"] == path, where
                    assert check.get("scheme", "HTTP") == "HTTP", where
                assert check["port"] in port_names, where
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


@pytest.mark.parametrize("overlay", RENDERS)
def test_gateway_finds_every_models_workers_through_the_headless_service(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    gateway = pod_spec(gateway_set(objects))["containers"][0]
    service = one(objects, "Service", "worker")
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    assert env_value(gateway, "PREFIXGATE_WORKERS") == (
        f"dns://{service['metadata']['name']}:{port['port']}"
    )
    assert gateway["args"][:1] == ["serve"]
    for worker_owner in workers(objects):
        name = worker_owner["metadata"]["name"]
        worker = pod_spec(worker_owner)["containers"][0]
        assert selects({"matchLabels": service["spec"]["selector"]}, template_labels(worker_owner))
        ports = {item["name"]: item["containerPort"] for item in worker["ports"]}
        assert ports[port["targetPort"]] == port["port"] == WORKER_PORT, name
        assert worker["args"][:1] == ["worker"], name
        assert worker["args"][worker["args"].index("--port") + 1] == str(WORKER_PORT), name
    # Nothing but workers behind it: gateways would poll a gateway or Redis as a worker.
    for owner in pod_owners(objects):
        if component(owner) != "worker":
            assert not selects({"matchLabels": service["spec"]["selector"]}, template_labels(owner))


@pytest.mark.parametrize("overlay", RENDERS)
def test_each_model_is_one_deployment_owning_only_its_own_pods(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """Per model: a Deployment whose selector holds the model label (controllers whose
    selectors overlap fight over each other's pods: no Deployment or StatefulSet may select
    another's), labelled with the name it serves (as the models shipped here are; a served
    name that is no label value would differ), its own PodDisruptionBudget, and a topology
    spread over its own pods only."""
    objects = renders[overlay]
    controllers = [obj for obj in objects if obj["kind"] in CONTROLLERS]
    for first, second in itertools.permutations(controllers, 2):
        assert not selects(first["spec"]["selector"], template_labels(second)), (
            f"{first['metadata']['name']} selects the pods of {second['metadata']['name']}"
        )
    models = []
    budgets = [obj for obj in objects if obj["kind"] == "PodDisruptionBudget"]
    for owner in workers(objects):
        name = owner["metadata"]["name"]
        labels = template_labels(owner)
        model = labels.get(MODEL_LABEL)
        assert model, f"{name}: no {MODEL_LABEL} label"
        models.append(model)
        assert owner["spec"]["selector"]["matchLabels"].get(MODEL_LABEL) == model, name
        assert selects(owner["spec"]["selector"], labels), name
        (container,) = pod_spec(owner)["containers"]
        assert env_value(container, "PREFIXGATE_SERVED_MODEL_NAME") == model, name
        (budget,) = [pdb for pdb in budgets if selects(pdb["spec"]["selector"], labels)]
        assert budget["spec"]["maxUnavailable"] == 1, name
        for spread in pod_spec(owner).get("topologySpreadConstraints", []):
            assert spread["labelSelector"]["matchLabels"].get(MODEL_LABEL) == model, name
    assert len(set(models)) == len(models), f"two Deployments serve one model: {models}"
    _, second_model, _ = RENDERS[overlay]
    assert sorted(models) == sorted([EMBEDDED_MODEL] + ([SECOND_MODEL] if second_model else []))


@pytest.mark.parametrize("overlay", RENDERS)
def test_a_models_workers_serve_its_directory_from_a_read_only_volume(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    claims = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "PersistentVolumeClaim"}
    for owner in workers(objects):
        spec = pod_spec(owner)
        (container,) = spec["containers"]
        model_dir = env_value(container, "PREFIXGATE_MODEL_DIR")
        if template_labels(owner)[MODEL_LABEL] == EMBEDDED_MODEL:
            assert model_dir is None, "the embedded model is in the image"
            continue
        assert model_dir, f"{owner['metadata']['name']}: no PREFIXGATE_MODEL_DIR"
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == model_dir]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] in claims
        assert volume["persistentVolumeClaim"]["readOnly"] is True


@pytest.mark.parametrize("overlay", RENDERS)
def test_workers_start_with_the_kernel_the_image_built(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """The image builds the kernel into /opt/prefixgate/kernels (its PREFIXGATE_KERNEL_CACHE),
    which the read-only root cannot lock: an init container copies it, timestamps and all, into
    the writable cache the worker is pointed at."""
    for owner in workers(renders[overlay]):
        spec = pod_spec(owner)
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
        emptydirs = {volume["name"] for volume in spec["volumes"] if "emptyDir" in volume}
        assert shared["name"] in emptydirs


def assert_only_gateways_reach(objects: list[Obj], policy: Obj, port: int) -> None:
    """The policy admits gateway pods alone, and only on `port`."""
    spec = policy["spec"]
    gateway_labels = template_labels(gateway_set(objects))
    others = [template_labels(owner) for owner in pod_owners(objects)]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    assert spec["ingress"], "no ingress rule: nothing could reach them"
    for rule in spec["ingress"]:
        assert rule["ports"] == [{"protocol": "TCP", "port": port}]
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"a peer beyond the namespace's pods: {peer}"
            admitted = [labels for labels in others if selects(peer["podSelector"], labels)]
            assert admitted == [gateway_labels], f"{peer} admits {admitted}"


@pytest.mark.parametrize("overlay", RENDERS)
def test_only_gateways_reach_workers_and_workers_send_only_dns(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    policy = one(objects, "NetworkPolicy", "worker")
    spec = policy["spec"]
    for owner in pod_owners(objects):  # every model's workers, and nothing else
        is_worker = component(owner) == "worker"
        assert selects(spec["podSelector"], template_labels(owner)) == is_worker, owner["metadata"][
            "name"
        ]
    assert_only_gateways_reach(objects, policy, WORKER_PORT)
    for rule in spec["egress"]:
        assert {port["port"] for port in rule["ports"]} == {53}


@pytest.mark.parametrize("overlay", RENDERS)
def test_autoscaler_and_disruption_budgets_select_their_pods(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """The autoscaler scales the gateways' StatefulSet (by the kind, API group and name it
    has: a stale `kind: Deployment` names nothing and scales nothing), and the budget covers
    the gateway pods and no others."""
    objects = renders[overlay]
    gateway = gateway_set(objects)
    autoscaler = one(objects, "HorizontalPodAutoscaler", "gateway")
    assert autoscaler["apiVersion"] == "autoscaling/v2"
    target = autoscaler["spec"]["scaleTargetRef"]
    assert named(objects, target["kind"], target["name"]) is gateway
    assert target["apiVersion"] == gateway["apiVersion"]
    assert "replicas" not in gateway["spec"], "a replica count fights the autoscaler on apply"
    assert autoscaler["spec"]["minReplicas"] >= 2
    budget = one(objects, "PodDisruptionBudget", "gateway")
    assert budget["spec"]["maxUnavailable"] == 1
    covered = [
        owner
        for owner in pod_owners(objects)
        if selects(budget["spec"]["selector"], template_labels(owner))
    ]
    assert covered == [gateway], [owner["metadata"]["name"] for owner in covered]
    # (each model's budget: test_each_model_is_one_deployment_owning_only_its_own_pods)


# ---- the gateways' audit state ----------------------------------------------------------------


def audit_files(container: Obj) -> dict[str, Path]:
    """The spool and the checkpoint file a gateway container writes, placed by the settings'
    own rules (gateway/settings.py) from the state directory and the paths its environment
    sets."""
    state_dir = env_value(container, "PREFIXGATE_STATE_DIR")
    assert state_dir, "no PREFIXGATE_STATE_DIR: the audit state would follow HOME"
    configured: dict[str, Any] = {
        field: Path(value)
        for field, variable in AUDIT_PATH_SETTINGS.items()
        if (value := env_value(container, variable))
    }
    settings = Settings.model_construct(state_dir=Path(state_dir), **configured)
    return {"spool": settings.spool_path, "checkpoints": settings.checkpoint_path}


def storage_of(owner: Obj, container: Obj, path: Path) -> str:
    """What keeps `path` in the container: "claim" (a volume claim template of the owner's, a
    volume for each pod), else the kind of pod volume ("emptyDir", "persistentVolumeClaim",
    ...) of the deepest mount above it, or "root" (the read-only root filesystem)."""
    mounts = [
        mount
        for mount in container.get("volumeMounts", [])
        if path.is_relative_to(mount["mountPath"])
    ]
    if not mounts:
        return "root"
    mount = max(mounts, key=lambda found: len(found["mountPath"]))
    claims = [
        claim
        for claim in owner["spec"].get("volumeClaimTemplates", [])
        if claim["metadata"]["name"] == mount["name"]
    ]
    volumes = [
        volume for volume in pod_spec(owner).get("volumes", []) if volume["name"] == mount["name"]
    ]
    assert len(claims) + len(volumes) == 1, f"{mount['name']}: {len(claims) + len(volumes)} sources"
    if claims:
        return "claim"
    kinds: set[str] = set(volumes[0]) - {"name"}
    (kind,) = kinds
    return kind


def audit_storage(owner: Obj) -> dict[str, str]:
    """For each of a gateway's audit files, what keeps it (storage_of)."""
    (container,) = pod_spec(owner)["containers"]
    return {
        name: storage_of(owner, container, path) for name, path in audit_files(container).items()
    }


@pytest.mark.parametrize("overlay", RENDERS)
def test_each_gateway_keeps_its_audit_state_on_a_claim_of_its_own(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """The spool (events waiting for the database) and the signed checkpoint file (the
    evidence against a cut tail) outlive the pod: each gateway mounts a claim of its own,
    made from the StatefulSet's template, never an emptyDir that a deletion or a reschedule
    empties, nor one claim that every replica would share."""
    objects = renders[overlay]
    gateway = gateway_set(objects)
    assert audit_storage(gateway) == {"spool": "claim", "checkpoints": "claim"}
    (container,) = pod_spec(gateway)["containers"]
    assert storage_of(gateway, container, Path("/tmp")) == "emptyDir", "scratch stays scratch"


@pytest.mark.parametrize("overlay", RENDERS)
def test_gateway_claims_are_kept_writable_and_sized_by_default(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """A modest volume of the cluster's default StorageClass, which the non-root user can
    write (fsGroup); the claims stay when pods go (scale-down, deletion), so a replica that
    returns finds its spool and its checkpoints; pods start and stop together when scaling;
    and the governing Service is a headless one of the gateway pods alone."""
    objects = renders[overlay]
    gateway = gateway_set(objects)
    spec = gateway["spec"]
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in claim["spec"], "the cluster's default StorageClass"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    security = pod_spec(gateway)["securityContext"]
    assert security["fsGroup"] == security["runAsGroup"] not in (None, 0)
    governing = named(objects, "Service", spec["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    selected = [
        owner
        for owner in pod_owners(objects)
        if selects({"matchLabels": governing["spec"]["selector"]}, template_labels(owner))
    ]
    assert selected == [gateway], [owner["metadata"]["name"] for owner in selected]
    assert selects(spec["selector"], template_labels(gateway))


def test_the_audit_state_check_catches_an_emptydir_and_a_moved_path(
    renders: dict[str, list[Obj]],
) -> None:
    """The check above fails when the claim becomes an emptyDir again, when the state
    directory moves onto the scratch volume, and when one audit file is pointed there."""
    broken = copy.deepcopy(gateway_set(renders["cpu"]))
    claims = broken["spec"].pop("volumeClaimTemplates")
    pod_spec(broken)["volumes"] += [
        {"name": claim["metadata"]["name"], "emptyDir": {"sizeLimit": "1Gi"}} for claim in claims
    ]
    assert audit_storage(broken) == {"spool": "emptyDir", "checkpoints": "emptyDir"}

    broken = copy.deepcopy(gateway_set(renders["cpu"]))
    (container,) = pod_spec(broken)["containers"]
    (state_dir,) = [v for v in container["env"] if v["name"] == "PREFIXGATE_STATE_DIR"]
    state_dir["value"] = "/tmp/prefixgate"
    assert audit_storage(broken) == {"spool": "emptyDir", "checkpoints": "emptyDir"}

    broken = copy.deepcopy(gateway_set(renders["cpu"]))
    (container,) = pod_spec(broken)["containers"]
    container["env"].append(
        {"name": AUDIT_PATH_SETTINGS["audit_checkpoint_path"], "value": "/tmp/checkpoints.jsonl"}
    )
    assert audit_storage(broken) == {"spool": "claim", "checkpoints": "emptyDir"}


@pytest.mark.parametrize("overlay", RENDERS)
def test_migration_job_upgrades_the_schema(renders: dict[str, list[Obj]], overlay: str) -> None:
    job = one(renders[overlay], "Job", "migrate")
    (container,) = pod_spec(job)["containers"]
    assert container["args"] == ["db", "upgrade"]
    assert pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")


# ---- traffic between gateways and workers ------------------------------------------------------


def tls_roles(objects: list[Obj]) -> Iterator[tuple[str, Obj, Obj]]:
    """(role, owner, container) of every gateway and every model's workers."""
    owners = [("gateway", gateway_set(objects))]
    owners += [("worker", owner) for owner in workers(objects)]
    for role, owner in owners:
        yield role, owner, pod_spec(owner)["containers"][0]


def mounted_secret(owner: Obj, container: Obj, path: str) -> tuple[str, str, Obj, Obj]:
    """(Secret name, key, mount, volume) of the file at `path`, which must be in a Secret
    volume the container mounts."""
    spec = pod_spec(owner)
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            assert "secret" in volume, f"{path}: {mount['name']} is not a Secret volume"
            key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
            return volume["secret"]["secretName"], key, mount, volume
    raise AssertionError(f"{path} is on no volume the container mounts")


def tls_secret_source(objects: list[Obj], tls: str, name: str) -> Obj:
    """What makes the TLS Secret `name` (the Deployments' reference, after kustomize's
    renaming): the generated Secret (files) or the Certificate that writes it (cert-manager)."""
    if tls == FILES:
        secret = named(objects, "Secret", name)
        assert secret["type"] == "kubernetes.io/tls"
        return secret
    (certificate,) = [
        obj for obj in objects if obj["kind"] == "Certificate" and obj["spec"]["secretName"] == name
    ]
    return certificate


@pytest.mark.parametrize("overlay", RENDERS)
def test_gateways_and_workers_get_their_certificate_the_ca_and_the_signing_key(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """Every TLS setting is a file of the role's own TLS Secret (tls.crt, tls.key, ca.crt),
    mounted read-only and readable by the pod's group alone; the signing key and the worker
    secret come from the Secret both roles share; workers are dialled by dns:// (over HTTPS)."""
    objects = renders[overlay]
    tls = RENDERS[overlay][2]
    for role, owner, container in tls_roles(objects):
        where = f"{owner['metadata']['name']} ({role})"
        secrets_used = set()
        for setting, key in TLS_FILES.items():
            path = env_value(container, setting)
            assert path is not None, f"{where}: no {setting}"
            secret, file, mount, volume = mounted_secret(owner, container, path)
            assert file == key, f"{where}: {setting}={path}"
            assert mount.get("readOnly") is True, where
            assert volume["secret"]["defaultMode"] == 0o440, where
            secrets_used.add(secret)
        (secret,) = secrets_used
        source = tls_secret_source(objects, tls, secret)
        assert source["metadata"]["name"].startswith(TLS_SECRETS[role]), where
        sources = env_sources(objects, container)
        for shared in (SIGNING_KEY, "PREFIXGATE_WORKER_SECRET"):
            assert set(sources[shared]) == {"secretRef"}, f"{where}: {shared}"
        signing_secret = sources[SIGNING_KEY]["secretRef"]
        assert len(secret_data(objects, signing_secret)[SIGNING_KEY]) >= 32
    gateway = pod_spec(gateway_set(objects))["containers"][0]
    assert (env_value(gateway, "PREFIXGATE_WORKERS") or "").startswith("dns://")


@pytest.mark.parametrize("overlay", RENDERS)
def test_nobody_chooses_plain_http_to_workers(renders: dict[str, list[Obj]], overlay: str) -> None:
    objects = renders[overlay]
    for owner in pod_owners(objects):
        for container in containers(owner):
            assert "PREFIXGATE_WORKER_PLAINTEXT" not in env_sources(objects, container)


@pytest.mark.parametrize("overlay", RENDERS)
def test_no_pod_gets_the_cas_key(renders: dict[str, list[Obj]], overlay: str) -> None:
    """From files, no Secret holds the CA's key (or any CA's); with cert-manager, the CA's
    Secret (the CA Issuer's) is mounted by no pod and read by no container."""
    objects = renders[overlay]
    ca_secrets = {
        obj["spec"]["ca"]["secretName"] for obj in objects if obj["kind"] == "Issuer"
        and "ca" in obj["spec"]
    }  # fmt: skip
    for obj in objects:
        if obj["kind"] == "Secret" and obj["type"] == "kubernetes.io/tls":
            data = secret_data(objects, obj["metadata"]["name"])
            assert set(data) == {"tls.crt", "tls.key", "ca.crt"}, obj["metadata"]["name"]
            certificate = x509.load_pem_x509_certificate(data["tls.crt"].encode())
            constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)
            assert constraints.value.ca is False, f"{obj['metadata']['name']} holds a CA's key"
    for owner in pod_owners(objects):
        spec = pod_spec(owner)
        used = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for container in containers(owner):
            used |= {s["secretRef"]["name"] for s in container.get("envFrom", [])}
            used |= {
                v["valueFrom"]["secretKeyRef"]["name"]
                for v in container.get("env", [])
                if "secretKeyRef" in v.get("valueFrom", {})
            }
        assert not used & ca_secrets, owner["metadata"]["name"]
    if RENDERS[overlay][2] == CERT_MANAGER:
        assert ca_secrets, "no CA Issuer"


@pytest.mark.parametrize("overlay", [name for name, (*_, tls) in RENDERS.items() if tls == FILES])
def test_the_tls_secrets_let_a_gateway_and_a_worker_complete_mutual_tls(
    renders: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    """The files each role gets, written out as the Secret volume would and loaded as the code
    loads them: a gateway's and a worker's connect; a worker's cannot pose as a gateway, nor a
    gateway's as a worker (each certificate is for its use alone)."""
    objects = renders[overlay]
    held: dict[str, WorkerTLS] = {}
    for role, owner, container in tls_roles(objects):
        secret, _, _, _ = mounted_secret(
            owner, container, env_value(container, "PREFIXGATE_WORKER_TLS_CERT") or ""
        )
        directory = tmp_path / secret
        directory.mkdir(exist_ok=True)
        for key, value in secret_data(objects, secret).items():
            (directory / key).write_text(value)
        held[role] = WorkerTLS(directory / "tls.crt", directory / "tls.key", directory / "ca.crt")
    assert handshake(server=held["worker"], client=held["gateway"]) is None
    assert handshake(server=held["worker"], client=held["worker"]) is not None
    assert handshake(server=held["gateway"], client=held["gateway"]) is not None
    worker = x509.load_pem_x509_certificate(held["worker"].cert.read_bytes())
    names = worker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert WORKER_SERVER_NAME in names.get_values_for_type(x509.DNSName)
    usage = worker.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]


@pytest.mark.parametrize(
    "overlay", [name for name, (*_, tls) in RENDERS.items() if tls == CERT_MANAGER]
)
def test_cert_manager_issues_each_role_its_certificate_from_a_private_ca(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """A self-signed Issuer signs the CA; the CA Issuer signs the worker's certificate (server
    auth only, valid for the name gateways check) and the gateway's (client auth only), into
    the Secrets the pods mount."""
    objects = renders[overlay]
    issuers = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Issuer"}
    certificates = [obj for obj in objects if obj["kind"] == "Certificate"]
    (ca,) = [c for c in certificates if c["spec"].get("isCA")]
    assert "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    (ca_issuer,) = [i for i in issuers.values() if "ca" in i["spec"]]
    assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    for role, owner, container in tls_roles(objects):
        path = env_value(container, "PREFIXGATE_WORKER_TLS_CERT") or ""
        secret, _, _, _ = mounted_secret(owner, container, path)
        certificate = tls_secret_source(objects, CERT_MANAGER, secret)
        spec = certificate["spec"]
        where = f"{owner['metadata']['name']}: {certificate['metadata']['name']}"
        assert spec["issuerRef"]["name"] == ca_issuer["metadata"]["name"], where
        assert spec["issuerRef"].get("kind", "Issuer") == "Issuer", where
        assert not spec.get("isCA"), where
        other = "client auth" if role == "worker" else "server auth"
        assert TLS_USE[role] in spec["usages"] and other not in spec["usages"], where
        if role == "worker":
            assert WORKER_SERVER_NAME in spec["dnsNames"], where


# ---- secrets and images -----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", RENDERS)
def test_secrets_are_referenced_never_inlined(renders: dict[str, list[Obj]], overlay: str) -> None:
    objects = renders[overlay]
    secrets = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Secret"}
    for owner in pod_owners(objects):
        for container in containers(owner):
            for variable in container.get("env", []):
                if SECRETISH.search(variable["name"]) and variable["name"] not in TLS_FILES:
                    assert "value" not in variable, (
                        f"{container['name']}: {variable['name']} inlined"
                    )
                reference = variable.get("valueFrom", {}).get("secretKeyRef")
                if reference:
                    assert reference["key"] in secrets[reference["name"]]["data"]
            for source in container.get("envFrom", []):
                assert source["secretRef"]["name"] in secrets


@pytest.mark.parametrize("overlay", RENDERS)
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

    for owner in workers(objects):
        worker = pod_spec(owner)["containers"][0]
        assert keys(worker) == {"PREFIXGATE_WORKER_SECRET", SIGNING_KEY}, owner["metadata"]["name"]
    gateway = pod_spec(gateway_set(objects))["containers"][0]
    assert {
        "PREFIXGATE_DATABASE_URL",
        "PREFIXGATE_KEY_HASH_SECRET",
        "PREFIXGATE_AUDIT_SIGNING_KEY",
        "PREFIXGATE_JWT_SECRET",
        "PREFIXGATE_MASTER_KEY",
        "PREFIXGATE_WORKER_SECRET",
        SIGNING_KEY,
        "PREFIXGATE_REDIS_URL",
    } <= keys(gateway)


def test_committed_secret_examples_hold_only_placeholders() -> None:
    """Every value is a placeholder, or holds one, or a reference to a line that is one."""
    examples = sorted((DEPLOY / "k8s").rglob("*.env.example"))
    assert examples
    for example in examples:
        placeholders: set[str] = set()
        for line in example.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, _, value = line.partition("=")
                references = set(re.findall(r"\$\{([A-Za-z0-9_]+)\}", value))
                assert "CHANGE_ME" in value or references, f"{example.name}: {line}"
                assert references <= placeholders, f"{example.name}: {line}"
                if value == "CHANGE_ME":
                    placeholders.add(name)


def overlay_images(overlay: str) -> dict[str, str]:
    """The overlay's `images:` as placeholder -> the reference it becomes."""
    kustomization = yaml.safe_load(
        (DEPLOY / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text()
    )
    return {
        image["name"]: f"{image['newName']}:{image['newTag']}" for image in kustomization["images"]
    }


@pytest.mark.parametrize("overlay", RENDERS)
def test_every_container_runs_an_image_the_overlay_names(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    images = overlay_images(RENDERS[overlay][0])
    for owner in pod_owners(renders[overlay]):
        for container in containers(owner):
            assert container["image"] in images.values(), (
                f"{container['name']}: {container['image']}"
            )
    for role in ("gateway", "migrate"):
        owner = next(
            obj
            for obj in renders[overlay]
            if obj["kind"] in POD_OWNERS and role in obj["metadata"]["name"]
        )
        assert {c["image"] for c in containers(owner)} == {images["prefixgate"]}, role
    redis = one(renders[overlay], "Deployment", "redis")
    assert {c["image"] for c in containers(redis)} == {images["redis"]}
    assert re.fullmatch(r"docker\.io/library/redis:\d+(\.\d+)*-bookworm", images["redis"])


def built_images() -> dict[str, str]:
    """What deploy/build-images.sh tags, flavour -> name:tag, for this release."""
    script = (DEPLOY / "build-images.sh").read_text()
    (name,) = set(re.findall(r"tag=([\w.-]+):\$VERSION-\$1\b", script))
    flavours = re.findall(r"^\s*build_image (\w+)$", script, re.MULTILINE)
    assert flavours, "build-images.sh builds no image?"
    return {flavour: f"{name}:{release_version()}-{flavour}" for flavour in flavours}


@pytest.mark.parametrize("overlay", OVERLAY_FLAVOURS)
def test_overlays_name_the_release_images_build_images_makes(overlay: str) -> None:
    """Each placeholder becomes the image deploy/build-images.sh builds for its flavour, with
    the release's tag (prefixgate:<version>-cpu, -cuda) under a registry path the operator
    replaces: a tag that no build makes would never pull."""
    images = overlay_images(overlay)
    built = built_images()
    assert set(images) - {"redis"} == set(OVERLAY_FLAVOURS[overlay])
    for placeholder, flavour in OVERLAY_FLAVOURS[overlay].items():
        name, _, tag = built[flavour].partition(":")
        path, _, used_tag = images[placeholder].rpartition(":")
        assert used_tag == tag == f"{release_version()}-{flavour}", placeholder
        assert path.rsplit("/", 1)[-1] == name, f"{placeholder}: {path}"


def operator_overlay_example(text: str) -> str:
    """The kustomization.yaml an overlay's opening comment shows an operator."""
    lines = text.splitlines()
    start = lines.index(f"#   # {OPERATOR_OVERLAY}/kustomization.yaml")
    example = []
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            break
        example.append(line.removeprefix("#   "))
    return "\n".join(example) + "\n"


@pytest.mark.parametrize("overlay", OVERLAY_FLAVOURS)
def test_an_operators_overlay_moves_the_images_to_its_registry_with_kubectl_alone(
    tmp_path_factory: pytest.TempPathFactory, overlay: str
) -> None:
    """The overlay of their own that an overlay's comment shows, beside deploy/ in a
    checkout, renders with `kubectl kustomize` (no standalone kustomize): every PrefixGate
    container runs the operator's registry path with the release's tags kept."""
    root = operator_copy(tmp_path_factory)
    text = (root / "overlays" / overlay / "kustomization.yaml").read_text()
    example = operator_overlay_example(text)
    checkout = tmp_path_factory.mktemp("checkout")
    (checkout / "deploy").mkdir()
    shutil.move(root, checkout / "deploy" / "k8s")
    (checkout / OPERATOR_OVERLAY).mkdir()
    (checkout / OPERATOR_OVERLAY / "kustomization.yaml").write_text(example)
    objects = render(checkout / OPERATOR_OVERLAY)
    (entry,) = yaml.safe_load(example)["images"]
    assert entry["newName"] != entry["name"]
    shipped = overlay_images(overlay)
    moved = {
        placeholder: reference.replace(entry["name"], entry["newName"], 1)
        for placeholder, reference in shipped.items()
        if placeholder != "redis"
    }
    assert all(moved[p] != shipped[p] for p in moved), f"the example misses one: {moved}"
    used = {c["image"] for owner in pod_owners(objects) for c in containers(owner)}
    assert used == set(moved.values()) | {shipped["redis"]}


def test_manifests_tell_operators_what_kubectl_alone_does_in_the_readmes_namespace() -> None:
    """deploy/README.md's `kubectl apply -k` names one namespace; every kubectl command on the
    deployment's objects the manifests' comments give names the same, each overlay says how to
    apply itself, and none asks for `kustomize edit` (the standalone kustomize, which kubectl
    does not bring)."""
    readme = (DEPLOY / "README.md").read_text()
    (namespace,) = set(re.findall(r"kubectl apply -k deploy/k8s/overlays/\w+ -n ([\w-]+)", readme))
    commands = []
    for path in sorted((DEPLOY / "k8s").rglob("*")):
        if path.is_file() and path.suffix in (".yaml", ".example"):
            text = path.read_text()
            assert "kustomize edit" not in text, path.relative_to(DEPLOY)
            found = re.findall(r"`(kubectl (?:apply|scale|delete|rollout|exec) [^`]*)`", text)
            commands += [(path.relative_to(DEPLOY), " ".join(c.split())) for c in found]
    assert commands
    for where, command in commands:
        assert f" -n {namespace}" in command.replace("# ", ""), f"{where}: {command}"
    for overlay in OVERLAY_FLAVOURS:
        text = (DEPLOY / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text()
        assert f"`kubectl apply -k deploy/k8s/overlays/{overlay} -n {namespace}`" in text
        assert f"`kubectl apply -k {OPERATOR_OVERLAY} -n {namespace}`" in text


@pytest.mark.parametrize("overlay", GPU_RENDERS)
def test_gpu_workers_run_the_cuda_image_on_gpu_nodes(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """Every model's workers: the overlay's patch targets them all."""
    objects = renders[overlay]
    images = overlay_images("gpu")
    assert images["prefixgate-cuda"] != images["prefixgate"]
    for worker_owner in workers(objects):
        spec = pod_spec(worker_owner)
        worker = spec["containers"][0]
        assert {c["image"] for c in containers(worker_owner)} == {images["prefixgate-cuda"]}
        for bound in ("requests", "limits"):
            assert worker["resources"][bound]["nvidia.com/gpu"] == "1"
        assert spec["nodeSelector"]
        assert any(toleration["key"] == "nvidia.com/gpu" for toleration in spec["tolerations"])
        assert env_value(worker, "PREFIXGATE_DEVICE") == "cuda"
    for owner in pod_owners(objects):
        if component(owner) != "worker":
            for container in containers(owner):
                assert "nvidia.com/gpu" not in container["resources"]["limits"], "no engine"
                assert container["image"] != images["prefixgate-cuda"], container["name"]


@pytest.mark.parametrize("overlay", CPU_RENDERS)
def test_cpu_overlay_asks_for_no_gpu(renders: dict[str, list[Obj]], overlay: str) -> None:
    for owner in pod_owners(renders[overlay]):
        spec = pod_spec(owner)
        assert "nodeSelector" not in spec and "tolerations" not in spec
        for container in containers(owner):
            assert "nvidia.com/gpu" not in container["resources"]["limits"]


# ---- Redis ------------------------------------------------------------------------------------


def redis_url(objects: list[Obj]) -> str:
    """The gateways' PREFIXGATE_REDIS_URL, from the Secret their envFrom names."""
    gateway = pod_spec(gateway_set(objects))["containers"][0]
    source = env_sources(objects, gateway)["PREFIXGATE_REDIS_URL"]
    return secret_data(objects, source["secretRef"])["PREFIXGATE_REDIS_URL"]


@pytest.mark.parametrize("overlay", RENDERS)
def test_gateways_get_the_redis_url_by_secret_reference_and_nobody_else_does(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """From a Secret (which an operator can point at their own Redis), never written into the
    Deployment; workers and the migration never get it, nor Redis's password."""
    objects = renders[overlay]
    for owner in pod_owners(objects):
        for container in containers(owner):
            sources = env_sources(objects, container)
            where = f"{owner['metadata']['name']}/{container['name']}"
            if component(owner) == "gateway":
                assert set(sources["PREFIXGATE_REDIS_URL"]) == {"secretRef"}, where
            elif component(owner) == "redis":
                assert "PREFIXGATE_REDIS_URL" not in sources, where
            else:
                assert not {"PREFIXGATE_REDIS_URL", "REDIS_PASSWORD"} & set(sources), where


@pytest.mark.parametrize("overlay", RENDERS)
def test_the_gateways_url_names_the_bundled_redis_and_its_password(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    """The generator fills the example's URL with the password it made for REDIS_PASSWORD,
    which Redis requires; the URL's host and port are the Redis Service's."""
    objects = renders[overlay]
    url = urlsplit(redis_url(objects))
    service = one(objects, "Service", "redis")
    (port,) = service["spec"]["ports"]
    assert url.scheme == "redis"
    assert (url.hostname, url.port) == (service["metadata"]["name"], port["port"])
    redis = one(objects, "Deployment", "redis")
    (container,) = pod_spec(redis)["containers"]
    reference = env_sources(objects, container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    password = secret_data(objects, reference["name"])[reference["key"]]
    assert len(password) >= 32 and url.password == password
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert selects({"matchLabels": service["spec"]["selector"]}, template_labels(redis))
    ports = {item["name"]: item["containerPort"] for item in container["ports"]}
    assert ports[port["targetPort"]] == port["port"] == REDIS_PORT


@pytest.mark.parametrize("overlay", RENDERS)
def test_only_gateways_reach_redis_and_redis_sends_nothing(
    renders: dict[str, list[Obj]], overlay: str
) -> None:
    objects = renders[overlay]
    policy = one(objects, "NetworkPolicy", "redis")
    for owner in pod_owners(objects):
        is_redis = component(owner) == "redis"
        selected = selects(policy["spec"]["podSelector"], template_labels(owner))
        assert selected == is_redis, owner["metadata"]["name"]
    assert_only_gateways_reach(objects, policy, REDIS_PORT)
    assert policy["spec"]["egress"] == []


@pytest.mark.parametrize("overlay", RENDERS)
def test_redis_runs_as_non_root_with_authenticated_probes_and_keeps_nothing(
    renders: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    objects = renders[overlay]
    redis = one(objects, "Deployment", "redis")
    spec = pod_spec(redis)
    (container,) = spec["containers"]
    # One at a time: gateways split between two would each count half of a tenant's use.
    assert redis["spec"]["replicas"] == 1
    assert redis["spec"]["strategy"]["type"] == "Recreate"
    assert spec["securityContext"]["runAsUser"] not in (None, 0)
    assert container["command"] == ["redis-server"], "the image's entrypoint wants root"
    args = container["args"]
    assert args[args.index("--save") + 1] == ""
    assert args[args.index("--appendonly") + 1] == "no"
    assert all("emptyDir" in volume for volume in spec.get("volumes", []))
    # A full Redis must refuse writes before the kernel kills it.
    maxmemory = args[args.index("--maxmemory") + 1]
    assert maxmemory.endswith("mb") and int(maxmemory[:-2]) < 256
    assert container["resources"]["limits"]["memory"] == "256Mi"
    auth = env_sources(objects, container)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]
    password = env_sources(objects, container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert auth == password, "the probes authenticate with the password Redis requires"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container[probe]["exec"]["command"]
        assert "redis-cli ping" in " ".join(command), probe
        assert redis_check_passes(command, "PONG", tmp_path), probe
        assert not redis_check_passes(command, "NOAUTH Authentication required.", tmp_path), probe
        assert not redis_check_passes(command, "LOADING Redis is loading the dataset", tmp_path), (
            probe
        )


def test_without_the_bundled_redis_the_gateways_keep_their_url(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An operator's own Redis: the overlay without the component renders no Redis at all,
    and the gateways still take PREFIXGATE_REDIS_URL from their Secret."""
    root = operator_copy(tmp_path_factory)
    kustomization = root / "overlays" / "cpu" / "kustomization.yaml"
    text = kustomization.read_text()
    line = next(line for line in text.splitlines() if "components/bundled-redis" in line)
    kustomization.write_text(text.replace(line + "\n", ""))
    objects = render(kustomization.parent)
    assert not [obj for obj in objects if "redis" in obj["metadata"]["name"]]
    assert urlsplit(redis_url(objects)).scheme == "redis"
