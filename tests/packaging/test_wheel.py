"""The wheel is the product: built as a release builds it (sdist, then the wheel from the
sdist), installed into a fresh virtual environment, and run from an empty directory: nothing
may come from the source tree.

The fresh environment gets the project's dependencies from this checkout's .venv (a path in a
.pth file, which loads neither this checkout's editable install nor its source) so that the
test installs the wheel alone, without downloading torch again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.local_server import free_port, wait_until_ready
from engine.kernels.cpu.build import HEADERS, SOURCES, build_directory
from tests.deploy.tools import release_version

ROOT = Path(__file__).resolve().parents[2]
VERSION = release_version()
# What the server reads at run time, beside the Python modules: the CPU kernel's sources
# (built on first use), and one of each kind of the rest.
RUNTIME_DATA = [
    *(f"engine/kernels/cpu/{name}" for name in SOURCES + HEADERS),
    "tenancy/migrations/env.py",
    "tenancy/migrations/script.py.mako",
    "tenancy/migrations/versions/0001_initial_schema.py",
    "policies/default.yaml",
    "engine/model/chat_templates/smollm2-tools.jinja",
    "gateway/console/templates/login.html",
    "gateway/console/static/console.css",
    "gateway/limits/limits.lua",
]


def _run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"{command}: {result.stdout}\n{result.stderr}"
    return result.stdout


def _contents(wheel: Path) -> dict[str, str]:
    """Each file's SHA-256 by name (a zip's timestamps differ between builds; contents must not)."""
    with zipfile.ZipFile(wheel) as archive:
        return {name: hashlib.sha256(archive.read(name)).hexdigest() for name in archive.namelist()}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, the wheel built from it, and a wheel built straight from a copy of the
    tracked files (a clean clone: no build/ or egg-info left over from development)."""
    scratch = tmp_path_factory.mktemp("release")
    source = scratch / "source"
    tracked = _run("git", "ls-files", "-z", cwd=ROOT).split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():  # a file deleted but not yet committed is skipped
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    build = [sys.executable, "-m", "build", "--no-isolation"]
    _run(*build, "--outdir", scratch / "release", source, cwd=scratch)
    _run(*build, "--wheel", "--outdir", scratch / "direct", source, cwd=scratch)
    (sdist,) = (scratch / "release").glob("*.tar.gz")
    (wheel,) = (scratch / "release").glob("*.whl")
    (direct,) = (scratch / "direct").glob("*.whl")
    return {"sdist": sdist, "wheel": wheel, "direct": direct}


def test_the_sdist_builds_the_same_wheel_with_everything_the_server_reads(
    release: dict[str, Path],
) -> None:
    assert release["wheel"].name == f"prefixgate-{VERSION}-py3-none-any.whl"
    from_sdist, direct = _contents(release["wheel"]), _contents(release["direct"])
    assert from_sdist == direct
    missing = [name for name in RUNTIME_DATA if name not in from_sdist]
    assert missing == []
    versions = sorted((ROOT / "tenancy" / "migrations" / "versions").glob("[0-9]*.py"))
    assert versions and all(f"tenancy/migrations/versions/{v.name}" in from_sdist for v in versions)
    assert f"prefixgate-{VERSION}.dist-info/licenses/LICENSE" in from_sdist
    # Only the product: no tests, benchmarks or byte code.
    tops = {name.split("/")[0] for name in from_sdist}
    assert tops == {"engine", "gateway", "policies", "tenancy", f"prefixgate-{VERSION}.dist-info"}
    assert not [name for name in from_sdist if "__pycache__" in name or name.endswith(".pyc")]


@pytest.fixture(scope="module")
def installed(release: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv holding the wheel; the dependencies seen through a .pth file."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv.parent)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    dependencies = {sysconfig.get_paths()[kind] for kind in ("purelib", "platlib")}
    (site / "site-packages" / "dependencies.pth").write_text("\n".join(sorted(dependencies)))
    pip = [sys.executable, "-m", "pip", "--python", venv / "bin" / "python"]
    _run(*pip, "install", "--quiet", "--no-deps", release["wheel"], cwd=venv.parent)
    yield venv


def test_the_installed_wheel_runs_from_an_empty_directory(
    installed: Path, tmp_path: Path, smollm2_dir: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    # The default state directory, moved into the test's scratch by the XDG variable.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFIXGATE_")}
    env |= {"XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": ""}
    env["PATH"] = f"{installed / 'bin'}{os.pathsep}{env['PATH']}"
    prefixgate = installed / "bin" / "prefixgate"

    imports = "import gateway, tenancy; print(gateway.__file__); print(tenancy.__file__)"
    where = _run(installed / "bin" / "python", "-c", imports, cwd=empty, env=env)
    assert all(line.startswith(str(installed)) for line in where.split()), where
    # The kernel the installed package builds on first use is keyed by its sources' bytes,
    # the compiler flags and torch: the same key as this checkout's build, so the build the
    # server loads below is exactly the build of the wheel's sources (the image build
    # compiles them from the wheel).
    key = "from engine.kernels.cpu.build import build_directory; print(build_directory().name)"
    installed_key = _run(installed / "bin" / "python", "-c", key, cwd=empty, env=env).strip()
    assert installed_key == build_directory().name
    assert _run(prefixgate, "--version", cwd=empty, env=env).strip() == f"prefixgate {VERSION}"
    upgraded = _run(prefixgate, "db", "upgrade", cwd=empty, env=env)
    assert (tmp_path / "state" / "prefixgate" / "prefixgate.db").is_file(), upgraded

    port = free_port()
    log = tmp_path / "serve.log"  # beside the working directory, which must stay empty
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [prefixgate, "serve", "--demo", "--port", str(port)], cwd=empty, env=env,
            stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", server, log, timeout_s=180)
        printed = log.read_text(errors="replace")
        keys = [line.strip() for line in printed.splitlines() if line.strip().startswith("pgk_")]
        assert keys, printed
        key = keys[0]
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        answer = api.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=24,
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        console = httpx.get(f"http://127.0.0.1:{port}/admin/login")
        assert console.status_code == 200 and "<form" in console.text
        style = httpx.get(f"http://127.0.0.1:{port}/admin/static/console.css")
        assert style.status_code == 200 and style.text.strip()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert not list(empty.iterdir())  # nothing written to the working directory
