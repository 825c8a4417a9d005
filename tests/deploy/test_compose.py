"""deploy/compose.yaml (and its GPU override): valid Compose files by the Compose
Specification's own JSON schema (the copy check-jsonschema bundles; `docker compose config`
needs the compose plugin, which this machine lacks), before and after interpolation, wired as
the README says: certificates and migration first, workers and Redis only on internal networks
that the gateways share, gateways reaching workers over mutual TLS with the files the `certs`
service makes (its script is run here, and what it writes completes a handshake), the CA's key
in no volume but the CA's, both gateways keeping their limits in that Redis, secrets from the
env file and never written into the compose file."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import master_key_bytes
from gateway.workers.tls import WorkerTLS
from tests.deploy.tools import (
    DEPLOY,
    handshake,
    prefixgate,
    redis_check_passes,
    release_version,
    run,
)

COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yaml"
COMPOSE_SMOKE = DEPLOY / "smoke" / "compose.yaml"
VERSION = release_version()
ENV_EXAMPLE = DEPLOY / "compose.env.example"
GATEWAYS = ("gateway", "gateway-2")
WORKERS = ("worker-1", "worker-2")
PREFIXGATE_SERVICES = ("certs", "migrate", *GATEWAYS, *WORKERS)
SECRETISH = re.compile(r"SECRET|KEY|TOKEN|PASSWORD|DATABASE_URL|REDIS_URL|_AUTH$")
# Paths, not secrets: the files of a role's TLS volume.
TLS_FILES = {
    "PREFIXGATE_WORKER_TLS_CERT": "tls.crt",
    "PREFIXGATE_WORKER_TLS_KEY": "tls.key",
    "PREFIXGATE_WORKER_TLS_CA": "ca.crt",
}
SHARED_SECRETS = ("PREFIXGATE_WORKER_SECRET", "PREFIXGATE_WORKER_SIGNING_KEY")
# Compose's ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}
VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """`value` (a parsed compose file) with variables replaced as Compose does, after parsing."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        present = name in env and (env[name] != "" or not (op or "").startswith(":"))
        if op is None:
            return env.get(name, "")
        if op.endswith("-"):
            return env[name] if present else arg
        if not present:
            raise KeyError(f"{name} is required: {arg}")
        return env[name]

    return VARIABLE.sub(substitute, value)


def required_variables(path: Path) -> set[str]:
    return {m["name"] for m in VARIABLE.finditer(path.read_text()) if (m["op"] or "").endswith("?")}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The env file an operator makes from the committed example."""
    path = tmp_path_factory.mktemp("compose") / "compose.env"
    subprocess.run(
        [sys.executable, str(DEPLOY / "generate_secrets.py"), str(ENV_EXAMPLE), str(path)],
        check=True,
        capture_output=True,
    )
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


@pytest.fixture(scope="module")
def compose(env: dict[str, str]) -> dict[str, Any]:
    loaded: dict[str, Any] = interpolate(yaml.safe_load(COMPOSE.read_text()), env)
    return loaded


def schema_check(*paths: Path) -> None:
    result = run("check-jsonschema", "--builtin-schema", "vendor.compose-spec", *map(str, paths))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_files_pass_the_compose_spec_schema() -> None:
    schema_check(COMPOSE, COMPOSE_GPU, COMPOSE_SMOKE)


def test_interpolated_compose_files_pass_the_compose_spec_schema(
    env: dict[str, str], tmp_path: Path
) -> None:
    written = []
    for source in (COMPOSE, COMPOSE_GPU):
        target = tmp_path / source.name
        target.write_text(yaml.safe_dump(interpolate(yaml.safe_load(source.read_text()), env)))
        written.append(target)
    schema_check(*written)


def test_the_schema_check_rejects_a_misspelt_key(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("depends_on:", "depend_on:", 1))
    result = run("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(broken))
    assert result.returncode != 0


def test_every_required_variable_is_in_the_env_example() -> None:
    example = ENV_EXAMPLE.read_text()
    defined = {line.split("=", 1)[0] for line in example.splitlines() if "=" in line}
    assert required_variables(COMPOSE) <= defined
    for line in example.splitlines():
        if line and not line.startswith("#"):
            assert line.split("=", 1)[1] == "CHANGE_ME", f"not a placeholder: {line}"


def test_secrets_come_from_the_env_file(env: dict[str, str]) -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    for name, service in raw["services"].items():
        for variable, value in service.get("environment", {}).items():
            if SECRETISH.search(variable) and variable not in TLS_FILES:
                assert "${" in str(value), f"{name}: {variable} is written into compose.yaml"
    command = raw["services"]["redis"]["command"]
    assert command[command.index("--requirepass") + 1].startswith("${REDIS_PASSWORD")


def test_migration_runs_before_the_gateway(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    for gateway in GATEWAYS:
        needs = services[gateway]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully"
        for dependency in (*WORKERS, "redis"):
            assert needs[dependency]["condition"] == "service_healthy", (gateway, dependency)


def test_gateway_routes_to_both_workers_on_their_port_over_https(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for gateway in GATEWAYS:
        workers = services[gateway]["environment"]["PREFIXGATE_WORKERS"].split(",")
        assert workers == [f"https://{worker}:8001" for worker in WORKERS], gateway
    for worker in WORKERS:
        command = services[worker]["command"]
        assert command[0] == "worker" and command[command.index("--port") + 1] == "8001"
        # The health check reads PREFIXGATE_PORT; the worker listens on --port.
        assert services[worker]["environment"]["PREFIXGATE_PORT"] == "8001"
        for shared in SHARED_SECRETS:
            value = services[worker]["environment"][shared]
            assert value == services["gateway"]["environment"][shared], (worker, shared)
    assert len(services["gateway"]["environment"]["PREFIXGATE_WORKER_SIGNING_KEY"]) >= 32


def test_every_gateway_gets_the_master_key_the_generator_made_and_it_is_a_valid_one(
    compose: dict[str, Any], env: dict[str, str]
) -> None:
    """A gateway refuses a master key that is not 32 bytes of URL-safe base64: the generator's
    must pass, and no other service (a worker, the migration) gets it."""
    for name, service in compose["services"].items():
        given = service.get("environment", {}).get("PREFIXGATE_MASTER_KEY")
        assert (given is not None) == (name in GATEWAYS), name
        if given is not None:
            assert given == env["PREFIXGATE_MASTER_KEY"], name
    assert len(master_key_bytes(env["PREFIXGATE_MASTER_KEY"])) == 32


def test_nobody_chooses_plain_http_to_workers(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert "PREFIXGATE_WORKER_PLAINTEXT" not in service.get("environment", {}), name


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """The service's volumes (short syntax, `volume:target[:ro]`): target -> (volume, read-only)."""
    found = {}
    for entry in service.get("volumes", []):
        volume, target, *mode = entry.split(":")
        found[target] = (volume, mode == ["ro"])
    return found


def tls_files(service: dict[str, Any]) -> dict[str, tuple[str, str, bool]]:
    """Each TLS setting of a gateway or worker: (volume, file in it, mounted read-only)."""
    found = {}
    for setting in TLS_FILES:
        path = Path(service["environment"][setting])
        (volume, read_only) = mounts(service)[str(path.parent)]
        found[setting] = (volume, path.name, read_only)
    return found


def test_certificates_are_made_before_anything_uses_them(compose: dict[str, Any]) -> None:
    services = compose["services"]
    certs = services["certs"]
    assert certs["restart"] == "no" and certs["network_mode"] == "none"
    for name in (*GATEWAYS, *WORKERS):
        assert services[name]["depends_on"]["certs"]["condition"] == (
            "service_completed_successfully"
        ), name


def test_each_role_reads_its_own_tls_volume_and_only_the_certs_service_the_cas(
    compose: dict[str, Any],
) -> None:
    """Gateways and workers each read a certificate, its key and the CA's certificate from a
    volume of their role, read-only; the volume the CA's key is in is mounted by the certs
    service alone."""
    services = compose["services"]
    role_volumes = {}
    for role, names in (("gateway", GATEWAYS), ("worker", WORKERS)):
        volumes = set()
        for name in names:
            for setting, (volume, file, read_only) in tls_files(services[name]).items():
                assert file == TLS_FILES[setting] and read_only, (name, setting)
                volumes.add(volume)
        (role_volumes[role],) = volumes  # one for the role: every worker serves one certificate
    assert role_volumes["gateway"] != role_volumes["worker"]
    issued = {volume for volume, _ in mounts(services["certs"]).values()}
    (ca_volume,) = issued - set(role_volumes.values())
    for name, service in services.items():
        if name != "certs":
            assert ca_volume not in {volume for volume, _ in mounts(service).values()}, name


def run_certs_service(compose: dict[str, Any], volumes: Path) -> None:
    """Run the certs service's command as its container would, each volume it mounts a
    directory volumes/NAME, with this checkout's `prefixgate` on the PATH."""
    certs = compose["services"]["certs"]
    (script,) = certs["command"]
    for target, (volume, _) in sorted(mounts(certs).items(), key=lambda item: -len(item[0])):
        (volumes / volume).mkdir(exist_ok=True)
        script = script.replace(target, str(volumes / volume))
    assert "/etc/" not in script, "the script writes where no volume is mounted"
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(
        [*certs["entrypoint"], script],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def role_tls(compose: dict[str, Any], name: str, volumes: Path) -> WorkerTLS:
    """The files a gateway or worker service loads, where run_certs_service wrote them."""
    placed = tls_files(compose["services"][name])
    return WorkerTLS(*(volumes / placed[setting][0] / placed[setting][1] for setting in TLS_FILES))


def test_the_certs_service_makes_what_gateways_and_workers_need(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """Its script, run for real: each worker and gateway finds its files, they complete mutual
    TLS (and neither certificate serves the other role), keys are 0600, and the CA's key is
    in the CA's volume alone."""
    run_certs_service(compose, tmp_path)
    worker, gateway = (
        role_tls(compose, "worker-1", tmp_path),
        role_tls(compose, "gateway", tmp_path),
    )
    assert role_tls(compose, "worker-2", tmp_path) == worker
    assert role_tls(compose, "gateway-2", tmp_path) == gateway
    assert handshake(server=worker, client=gateway) is None
    assert handshake(server=worker, client=worker) is not None
    assert handshake(server=gateway, client=gateway) is not None
    ca_keys = list(tmp_path.glob("*/ca.key"))
    assert len(ca_keys) == 1
    for held in (worker, gateway):
        assert {path.name for path in held.cert.parent.iterdir()} == set(TLS_FILES.values())
        assert stat.S_IMODE(held.key.stat().st_mode) == 0o600
        assert held.cert.parent != ca_keys[0].parent


def test_the_certs_service_keeps_what_it_made_and_passes_on_a_renewal(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """Run again (every `up`), it keeps the CA and the certificates; after
    `prefixgate certs issue ... --force` in its CA volume (deploy/README.md), it hands the new
    certificate to the role, which still completes mutual TLS with the other."""
    run_certs_service(compose, tmp_path)
    worker, gateway = (
        role_tls(compose, "worker-1", tmp_path),
        role_tls(compose, "gateway", tmp_path),
    )
    first = {path: path.read_bytes() for path in (worker.cert, worker.ca, gateway.cert)}
    run_certs_service(compose, tmp_path)
    assert {path: path.read_bytes() for path in first} == first
    (ca_key,) = tmp_path.glob("*/ca.key")
    prefixgate("certs", "issue", "worker", "--dir", str(ca_key.parent), "--server", "--force")
    run_certs_service(compose, tmp_path)
    assert worker.cert.read_bytes() != first[worker.cert]
    assert worker.ca.read_bytes() == first[worker.ca]
    assert handshake(server=worker, client=gateway) is None


def test_workers_are_isolated_from_the_database_and_the_outside(compose: dict[str, Any]) -> None:
    services, networks = compose["services"], compose["networks"]
    database_networks = set(services["postgres"]["networks"])
    for worker in WORKERS:
        joined = set(services[worker]["networks"])
        assert not joined & database_networks
        assert all(networks[network].get("internal") for network in joined)
        assert "ports" not in services[worker]
        secret_names = {
            name
            for name in services[worker]["environment"]
            if SECRETISH.search(name) and name not in TLS_FILES
        }
        assert secret_names == set(SHARED_SECRETS)
    for gateway in GATEWAYS:
        assert set(services[gateway]["networks"]) >= database_networks | set(
            services["worker-1"]["networks"]
        )
        for published in services[gateway]["ports"]:
            assert published.startswith("127.0.0.1:"), "a laptop's gateway listens on loopback"


def test_the_gateways_share_one_redis_that_only_they_reach(
    compose: dict[str, Any], env: dict[str, str]
) -> None:
    services, networks = compose["services"], compose["networks"]
    redis = services["redis"]
    assert redis["networks"], "redis joins no network"
    for network in redis["networks"]:
        assert networks[network].get("internal") is True, network
        on_it = {
            name for name, service in services.items() if network in service.get("networks", [])
        }
        assert on_it == {"redis", *GATEWAYS}, f"{network} is shared with {on_it - set(GATEWAYS)}"
    assert "ports" not in redis
    url = f"redis://:{env['REDIS_PASSWORD']}@redis:6379/0"
    for gateway in GATEWAYS:
        assert services[gateway]["environment"]["PREFIXGATE_REDIS_URL"] == url, gateway
    for name in ("migrate", *WORKERS):
        assert "PREFIXGATE_REDIS_URL" not in services[name]["environment"], name
    command = redis["command"]
    assert command[command.index("--requirepass") + 1] == env["REDIS_PASSWORD"]
    assert redis["environment"]["REDISCLI_AUTH"] == env["REDIS_PASSWORD"]  # the health check's


def test_redis_keeps_nothing_and_runs_hardened(compose: dict[str, Any], tmp_path: Path) -> None:
    redis = compose["services"]["redis"]
    assert re.fullmatch(r"redis:\d+(\.\d+)*-bookworm", redis["image"]), redis["image"]
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--appendonly") + 1] == "no"
    assert "volumes" not in redis, "Redis holds counters and leases only: nothing to keep"
    assert redis["user"] not in ("root", "0") and redis["read_only"] is True
    assert redis["cap_drop"] == ["ALL"] and "no-new-privileges:true" in redis["security_opt"]
    test = redis["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "redis-cli ping" in test[1]
    # Docker runs CMD-SHELL with /bin/sh -c. redis-cli exits 0 on an error reply (NOAUTH): the
    # check must look for the PONG.
    shell = ["/bin/sh", "-c", test[1]]
    assert redis_check_passes(shell, "PONG", tmp_path)
    assert not redis_check_passes(shell, "NOAUTH Authentication required.", tmp_path)


def test_each_gateway_has_its_own_state_and_port(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gateways = [services[gateway] for gateway in GATEWAYS]
    assert gateways[0]["environment"] == gateways[1]["environment"]
    assert gateways[0]["command"] == gateways[1]["command"] == ["serve"]
    # Two gateways appending to one audit spool and checkpoint file would corrupt both.
    states = [
        next(volume for volume in gateway["volumes"] if volume.endswith(":/var/lib/prefixgate"))
        for gateway in gateways
    ]
    assert states[0] != states[1]
    host_ports = [gateway["ports"][0].rsplit(":", 2)[1] for gateway in gateways]
    assert host_ports[0] != host_ports[1], host_ports


def test_services_are_hardened_and_checked(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in PREFIXGATE_SERVICES:
        service = services[name]
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        # The image deploy/build-images.sh builds and tags with the version; never a build
        # from the repository (the Dockerfile's context is the one that script stages).
        assert service["image"] == f"prefixgate:{VERSION}-cpu" and "build" not in service, name
    for name in ("postgres", "redis", *GATEWAYS, *WORKERS):
        assert services[name]["healthcheck"]["test"], name
    for name in (*GATEWAYS, *WORKERS):
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/opt/prefixgate/healthcheck.py"], name
    # A worker completes a TLS handshake only with a gateway's certificate: its check connects.
    for name in WORKERS:
        assert services[name]["healthcheck"]["test"][3:] == ["--tcp"], name
    for name in GATEWAYS:
        assert services[name]["healthcheck"]["test"][3:] == ["/readyz"], name


def test_gpu_override_gives_each_worker_a_gpu_and_the_cuda_image(env: dict[str, str]) -> None:
    override = interpolate(yaml.safe_load(COMPOSE_GPU.read_text()), env)
    assert set(override["services"]) == set(WORKERS)
    for worker in WORKERS:
        service = override["services"][worker]
        assert service["image"] == f"prefixgate:{VERSION}-cuda" and "build" not in service
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert service["environment"]["PREFIXGATE_DEVICE"] == "cuda"
        # Compose merges volumes by target and environment by name: the TLS files stay.
        assert "/etc/prefixgate/tls" not in mounts(service)
        assert not set(TLS_FILES) & set(service["environment"])
        assert "healthcheck" not in service


def smoke_env(env: dict[str, str]) -> dict[str, str]:
    """The env file deploy/smoke.sh writes: the secrets, the images and the run's ports."""
    ports = ("GATEWAY_1", "GATEWAY_2", "WORKER_1", "WORKER_2", "POSTGRES", "REDIS")
    return env | {
        "PREFIXGATE_IMAGE": f"prefixgate:{VERSION}-cpu",
        "SMOKE_SERVICES_IMAGE": "prefixgate-smoke-services:bookworm",
        **{f"SMOKE_{name}_PORT": str(18000 + i) for i, name in enumerate(ports)},
    }


def test_the_smoke_stack_is_this_stack_on_the_host_network_on_loopback(
    compose: dict[str, Any], env: dict[str, str], tmp_path: Path
) -> None:
    """deploy/smoke/compose.yaml runs the PrefixGate services of deploy/compose.yaml (same
    commands, certificates, environment names, hardening, health checks), every service on the
    host's network, each listener on 127.0.0.1 on a port of its own."""
    variables = smoke_env(env)
    smoke = interpolate(yaml.safe_load(COMPOSE_SMOKE.read_text()), variables)
    written = tmp_path / "smoke.yaml"
    written.write_text(yaml.safe_dump(smoke))
    schema_check(written)
    services = smoke["services"]
    assert set(services) == set(compose["services"])
    assert {s["network_mode"] for n, s in services.items() if n != "certs"} == {"host"}
    assert services["certs"]["network_mode"] == "none"
    assert not [name for name, service in services.items() if "ports" in service]
    for name in PREFIXGATE_SERVICES:
        ours, theirs = services[name], compose["services"][name]
        assert ours["image"] == theirs["image"] == f"prefixgate:{VERSION}-cpu", name
        for key in ("read_only", "cap_drop", "security_opt", "entrypoint", "volumes"):
            assert ours.get(key) == theirs.get(key), (name, key)
        # The same settings, but where the host's network changes addresses.
        assert set(ours.get("environment", {})) - {"PREFIXGATE_HOST", "PREFIXGATE_PORT"} == (
            set(theirs.get("environment", {})) - {"PREFIXGATE_PORT"}
        ), name
        if name in GATEWAYS or name in WORKERS:
            assert ours["healthcheck"]["test"] == theirs["healthcheck"]["test"], name
    if services["certs"]["command"] != compose["services"]["certs"]["command"]:
        pytest.fail("the smoke stack makes its certificates differently")
    listeners = {
        name: (service["environment"]["PREFIXGATE_HOST"], service["environment"]["PREFIXGATE_PORT"])
        for name, service in services.items()
        if name in GATEWAYS
    }
    for name in WORKERS:
        command = services[name]["command"]
        host, port = command[command.index("--host") + 1], command[command.index("--port") + 1]
        # The health check knocks on PREFIXGATE_PORT: the port the worker listens on.
        assert services[name]["environment"]["PREFIXGATE_PORT"] == port, name
        listeners[name] = (host, port)
    redis = services["redis"]["command"]
    listeners["redis"] = (redis[redis.index("--bind") + 1], redis[redis.index("--port") + 1])
    listeners["postgres"] = ("127.0.0.1", services["postgres"]["environment"]["PGPORT"])
    assert {host for host, _ in listeners.values()} == {"127.0.0.1"}
    ports = [port for _, port in listeners.values()]
    assert len(set(ports)) == len(ports) == 6, listeners
    gateway = services["gateway"]["environment"]
    workers = [f"https://127.0.0.1:{listeners[name][1]}" for name in WORKERS]
    assert gateway["PREFIXGATE_WORKERS"].split(",") == workers
    assert gateway["PREFIXGATE_REDIS_URL"].endswith(f"@127.0.0.1:{listeners['redis'][1]}/0")
    assert f"@127.0.0.1:{listeners['postgres'][1]}/" in gateway["PREFIXGATE_DATABASE_URL"]
