#!/usr/bin/env bash
# The compose stack brought up for real and checked end to end: `deploy/smoke.sh` (as root, or
# a user in the docker group; about ten minutes the first time, most of it the image build).
#
#  1. the images: prefixgate:<version>-cpu (deploy/build-images.sh, unless it exists) and
#     PostgreSQL + Redis from Debian's packages (deploy/smoke/Dockerfile);
#  2. deploy/smoke/compose.yaml up: certificates, PostgreSQL, the one-shot migration, Redis,
#     two workers and two gateways, all on the host's network on 127.0.0.1, on ports
#     SMOKE_PORT_BASE (default 18000) to SMOKE_PORT_BASE+5, with fresh secrets;
#  3. two tenants and a public system prompt made with the CLI; deploy/smoke/check.py through
#     each gateway with the real openai client (a chat, a stream, a second turn with cached
#     tokens, another user of the tenant and the other tenant with the same prompt, who get the
#     public prompt's blocks and nothing more, the console's login page);
#  4. down, volumes included; then nothing of the run may be left: no container, no volume,
#     no listener on its ports.
# Prints a summary with each phase's time; exits non-zero when anything failed. Not part of
# `make test`. SMOKE_KEEP=1 leaves the stack up on failure, for a look.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
PROJECT=prefixgate-smoke
COMPOSE_FILE=$ROOT/deploy/smoke/compose.yaml
BASE=${SMOKE_PORT_BASE:-18000}
SERVICES_IMAGE=prefixgate-smoke-services:bookworm

fail() { echo "smoke: $*" >&2; exit 1; }
say() { echo "smoke: $*" >&2; }
seconds_since() { echo $(($(date +%s) - $1)); }

[ -x "$PYTHON" ] || fail "no Python at $PYTHON: run 'make .venv/.installed' or set PYTHON"
docker info >/dev/null 2>&1 || fail "no Docker daemon answers; start one, e.g. as root: \
dockerd --bridge=none --iptables=false &"
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE=(docker-compose)
else
    fail "neither the compose plugin nor docker-compose is installed (apt-get install docker-compose)"
fi
VERSION=$("$PYTHON" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$ROOT/pyproject.toml")
IMAGE=prefixgate:$VERSION-cpu

declare -A PORTS=(
    [SMOKE_GATEWAY_1_PORT]=$BASE [SMOKE_GATEWAY_2_PORT]=$((BASE + 1))
    [SMOKE_WORKER_1_PORT]=$((BASE + 2)) [SMOKE_WORKER_2_PORT]=$((BASE + 3))
    [SMOKE_POSTGRES_PORT]=$((BASE + 4)) [SMOKE_REDIS_PORT]=$((BASE + 5))
)
listening() { "$PYTHON" -c 'import socket, sys; sys.exit(socket.socket().connect_ex(("127.0.0.1", int(sys.argv[1]))) != 0)' "$1"; }
for name in "${!PORTS[@]}"; do
    if listening "${PORTS[$name]}"; then
        fail "port ${PORTS[$name]} ($name) is taken: set SMOKE_PORT_BASE to a free range"
    fi
done

started=$(date +%s)
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    "$ROOT/deploy/build-images.sh"
fi
BUILD_S=$(seconds_since "$started")
base_image=$(docker image inspect prefixgate-base:bookworm >/dev/null 2>&1 \
    && echo prefixgate-base:bookworm || echo python:3.11-slim-bookworm)
phase=$(date +%s)
DOCKER_BUILDKIT=0 docker build --quiet --network host --build-arg "BASE_IMAGE=$base_image" \
    -t "$SERVICES_IMAGE" "$ROOT/deploy/smoke" >/dev/null
SERVICES_S=$(seconds_since "$phase")

# The run's secrets live in SCRATCH: removed on every exit, with the stack if it went up.
SCRATCH=$(mktemp -d)
ENV_FILE=$SCRATCH/compose.env
compose() { "${COMPOSE[@]}" -p "$PROJECT" -f "$COMPOSE_FILE" --env-file "$ENV_FILE" "$@"; }
UP=false
DOWN_S=
cleanup() {
    local status=$?
    if $UP && [ "$status" -ne 0 ] && [ "${SMOKE_KEEP:-}" = 1 ]; then
        say "left up for a look (SMOKE_KEEP=1): ${COMPOSE[*]} -p $PROJECT -f $COMPOSE_FILE --env-file $ENV_FILE down -v"
        return
    fi
    if $UP && [ -z "$DOWN_S" ]; then
        compose down --volumes --remove-orphans --timeout 60 >/dev/null 2>&1 || true
    fi
    rm -rf "$SCRATCH"
}
trap cleanup EXIT
python3 "$ROOT/deploy/generate_secrets.py" "$ROOT/deploy/compose.env.example" "$ENV_FILE" >/dev/null
{
    echo "PREFIXGATE_IMAGE=$IMAGE"
    echo "SMOKE_SERVICES_IMAGE=$SERVICES_IMAGE"
    for name in "${!PORTS[@]}"; do echo "$name=${PORTS[$name]}"; done
} >>"$ENV_FILE"

say "up: ${COMPOSE[*]} -p $PROJECT -f deploy/smoke/compose.yaml (ports $BASE-$((BASE + 5)))"
phase=$(date +%s)
UP=true
compose up --detach >&2
GATEWAYS=("http://127.0.0.1:${PORTS[SMOKE_GATEWAY_1_PORT]}" "http://127.0.0.1:${PORTS[SMOKE_GATEWAY_2_PORT]}")
ready() { "$PYTHON" -c 'import httpx, sys; sys.exit(httpx.get(sys.argv[1] + "/readyz", timeout=5).status_code != 200)' "$1" 2>/dev/null; }
# A container that exited with an error (a long-running service, or a one-shot that failed).
crashed() {
    docker ps -a --filter "label=com.docker.compose.project=$PROJECT" --filter status=exited \
        --format '{{.Names}} {{.Status}}' | grep -v 'Exited (0)' || true
}
deadline=$(($(date +%s) + 600))
for url in "${GATEWAYS[@]}"; do
    until ready "$url"; do
        failed=$(crashed)
        if [ -n "$failed" ]; then
            for name in $(echo "$failed" | cut -d' ' -f1); do docker logs --tail 30 "$name" >&2; done
            fail "exited: $failed"
        fi
        if [ "$(date +%s)" -gt "$deadline" ]; then
            compose ps >&2
            compose logs --tail 40 >&2
            fail "$url was not ready within 10 minutes"
        fi
        sleep 2
    done
done
UP_S=$(seconds_since "$phase")

# Two tenants and a key each, and a public prefix, made with the CLI inside a gateway.
phase=$(date +%s)
KEYS=()
for tenant in acme globex; do
    compose exec -T gateway prefixgate tenants create "$tenant" >/dev/null
    key=$(compose exec -T gateway prefixgate keys create --tenant "$tenant" --name smoke --json \
        | "$PYTHON" -c "import json, sys; print(json.load(sys.stdin)['key'])")
    KEYS+=(--key "$tenant=$key")
done
# The checks' system prompt, public: both tenants may read its blocks, nothing more.
"$PYTHON" "$ROOT/deploy/smoke/check.py" --system-prompt | compose exec -T gateway \
    prefixgate prefixes add --model smollm2-135m-instruct --namespace default \
    --name smoke-help-desk --text-file /dev/stdin >/dev/null
# Gateways reload public prefixes every PREFIXGATE_REGISTRY_REFRESH_S (2 s): a request sent
# sooner scopes the prompt private, and its blocks never match the public ones after it.
sleep 5
REPORT=$SCRATCH/report.json
checks_status=0
"$PYTHON" "$ROOT/deploy/smoke/check.py" --gateway "${GATEWAYS[0]}" --gateway "${GATEWAYS[1]}" \
    "${KEYS[@]}" >"$REPORT" || checks_status=$?
CHECKS_S=$(seconds_since "$phase")
if [ "$checks_status" -ne 0 ] && [ "${SMOKE_KEEP:-}" = 1 ]; then
    cat "$REPORT" >&2
    exit 1  # the exit trap leaves the stack up
fi
containers=$(compose ps -q | wc -l)

phase=$(date +%s)
compose down --volumes --remove-orphans --timeout 60 >/dev/null 2>&1
DOWN_S=$(seconds_since "$phase")
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
left_volumes=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
listeners=()
for name in "${!PORTS[@]}"; do
    if listening "${PORTS[$name]}"; then listeners+=("${PORTS[$name]}"); fi
done

"$PYTHON" - "$REPORT" <<EOF
import json, sys
report = json.load(open(sys.argv[1]))
for url, checks in report["gateways"].items():
    for check in checks:
        mark = "ok  " if check["held"] else "FAIL"
        print(f"{mark} {url} {check['check']:<13} {check['seconds']:>6.2f} s  {check['seen']}")
EOF
echo "image $IMAGE: $(($(docker image inspect --format '{{.Size}}' "$IMAGE") / 1000000)) MB"
echo "times: PrefixGate image ${BUILD_S} s (0 when it existed), PostgreSQL+Redis image ${SERVICES_S} s, up to both gateways ready ${UP_S} s, checks ${CHECKS_S} s, down ${DOWN_S} s"
echo "containers while up: $containers; after down: $left containers, $left_volumes volumes, listeners on ports: ${listeners[*]:-none}"
if [ "$checks_status" -ne 0 ] || [ "$left" -ne 0 ] || [ "$left_volumes" -ne 0 ] || [ ${#listeners[@]} -ne 0 ]; then
    echo "smoke: FAILED"
    exit 1
fi
echo "smoke: held"
