#!/usr/bin/env bash
# cosyvoice-opt launcher.
#   ./run.sh [app flags]   create/update .venv if needed, then launch the WebUI (default 0.0.0.0:7860)
#   ./run.sh test [args]   same environment, run the whole test suite (extra args go to pytest)
# App flags: --model-dir D --port N --host H --share --precision auto|fp32|fp16|bf16 --max-batch-size N
#            --concurrency N --auth user:pass|FILE --api-key KEY --random tiny|full --voices-dir D
#            --max-file-size MiB
set -euo pipefail
cd "$(dirname "$0")"

VENV=.venv
ensure_env() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "creating $VENV (first run: torch is large, this takes a few minutes)"
        python3 -m venv "$VENV"
    fi
    local want have
    want=$(sha256sum requirements.txt | cut -d' ' -f1)
    have=$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)
    if [ "$want" != "$have" ]; then
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -r requirements.txt
        echo "$want" > "$VENV/.requirements.sha256"
    fi
}

ensure_env

# expandable_segments: the engine's tensors change shape per chunk and per batch size; growing segments
# instead of caching fixed-size blocks keeps reserved memory close to what is allocated (see README).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

if [ "${1:-}" = "test" ]; then
    shift
    exec "$VENV/bin/python" -m pytest "$@"
fi

if ! command -v ffmpeg >/dev/null 2>&1; then
    echo "warning: ffmpeg not found; Gradio needs it to stream audio." \
         "Install it: sudo apt-get install ffmpeg (Debian/Ubuntu) or brew install ffmpeg (macOS)." >&2
fi
exec "$VENV/bin/python" app.py "$@"
