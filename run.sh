#!/usr/bin/env bash
# cosyvoice-opt launcher. Sets up whatever is missing (system packages, .venv with the package installed), then:
#   ./run.sh [app flags]   launch the WebUI (default 0.0.0.0:7860)
#   ./run.sh test [args]   run the whole test suite (extra args go to pytest, e.g. -m gpu, -k parity)
#   ./run.sh cluster --replicas N [flags]   the WebUI and the HTTP API from N engine replicas on Ray Serve, on
#                          port 7860 (python -m cosyvoice_opt cluster --help lists the flags)
#   ./run.sh gpustat       watch the GPUs from a terminal (utilisation, memory, processes; gpustat -i 1)
# App flags: --model-dir D --port N --host H --share --precision auto|fp32|fp16|bf16 --max-batch-size N
#            --max-queue-wait S --concurrency N --auth user:pass|FILE --allow-settings --api-key KEY
#            --random tiny|full --voices-dir D --max-file-size MiB --compile
set -euo pipefail
cd "$(dirname "$0")"

VENV=.venv
# Debian/Ubuntu packages. The WebUI streams audio through ffmpeg; the tests also speak prompts with espeak-ng,
# drive a real headless Chromium, and read audio with libsndfile.
UI_PACKAGES=(ffmpeg)
TEST_PACKAGES=(ffmpeg espeak-ng chromium chromium-driver libsndfile1)

# Install the missing ones as root or with passwordless sudo; otherwise say in one line what to install, and go on.
ensure_system_packages() {
    if ! command -v dpkg >/dev/null 2>&1; then
        local have=1 p
        for p in "$@"; do command -v "$p" >/dev/null 2>&1 || have=0; done
        [ "$have" = 1 ] || echo "note: not a Debian/Ubuntu system; install with your package manager if missing: $*" >&2
        return 0
    fi
    local missing=() p
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -gt 0 ] || return 0
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "warning: missing system packages; install them with: sudo apt-get install ${missing[*]}" >&2
            return 0
        fi
    fi
    echo "installing system packages: ${missing[*]}"
    if ! { "${sudo[@]}" apt-get update -qq &&
           "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; }; then
        echo "warning: could not install ${missing[*]}; install them with: sudo apt-get install ${missing[*]}" >&2
    fi
}

# .venv with requirements.txt, then this package (editable, its console script `cosyvoice-opt`); redone whenever
# requirements.txt or pyproject.toml changes.
ensure_env() {
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -c "import ensurepip" 2>/dev/null || ensure_system_packages python3-venv
        echo "creating $VENV (first run: torch is large, this takes a few minutes)"
        python3 -m venv "$VENV"
    fi
    local want have
    want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
    have=$(cat "$VENV/.requirements.sha256" 2>/dev/null || true)
    if [ "$want" != "$have" ]; then
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -r requirements.txt
        "$VENV/bin/python" -m pip install -q --no-deps -e .
        echo "$want" > "$VENV/.requirements.sha256"
    fi
}

if [ "${1:-}" = "test" ]; then
    ensure_system_packages "${TEST_PACKAGES[@]}"
else
    ensure_system_packages "${UI_PACKAGES[@]}"
fi
ensure_env

# expandable_segments: the engine's tensors change shape per chunk and per batch size; growing segments
# instead of caching fixed-size blocks keeps reserved memory close to what is allocated (see README).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

if [ "${1:-}" = "test" ]; then
    shift
    exec "$VENV/bin/python" -m pytest "$@"
fi
if [ "${1:-}" = "cluster" ]; then
    shift
    exec "$VENV/bin/python" -m cosyvoice_opt cluster "$@"
fi
if [ "${1:-}" = "gpustat" ]; then
    shift
    exec "$VENV/bin/gpustat" --interval 1 "$@"
fi
exec "$VENV/bin/python" app.py "$@"
