#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` from the llama.cpp sources vendored in the
# llama-cpp-python 0.3.36 sdist (the same llama.cpp the llama-cpp backend runs).
#
# Usage: scripts/build_llama_server.sh [DEST_DIR]
#   DEST_DIR defaults to .cache/llama-server (relative to the repository root).
#   Result: DEST_DIR/bin/llama-server (one static binary; it needs only the system's
#   libc, libstdc++, libgomp, libm and libgcc_s).
#
# Idempotent: if DEST_DIR/bin/llama-server exists and `--version` runs, exits 0 at once.
#
# Build settings match the project's llama-cpp-python build (README: GGML_LLAMAFILE=OFF,
# otherwise llama.cpp defaults, so GGML_NATIVE=ON: -march=native, as pip's build does).
# No curl, no OpenSSL, no web UI (no network at build time besides the pip download).
#
# Environment:
#   PYTHON                 python whose pip downloads the sdist (default python3)
#   LLAMA_CPP_PYTHON_SDIST an already downloaded llama_cpp_python-0.3.36.tar.gz (skips pip)
#   JOBS                   parallel compile jobs (default 2)
#   NICE                   nice level of the compile (default 19)
#   GGML_NATIVE            ON (default, -march=native) or OFF (portable x86-64 build)
#   KEEP_BUILD=1           keep the temporary source/build folder (its path is printed)
#
# Wall time on 2 cores (nice 19, -j 2, Ninja): about 4 minutes (250 s, 2026-12-02).
set -euo pipefail

VERSION=0.3.36
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$REPO_ROOT/.cache/llama-server}"
case "$DEST" in /*) ;; *) DEST="$PWD/$DEST" ;; esac
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
NICE="${NICE:-19}"
GGML_NATIVE="${GGML_NATIVE:-ON}"

log() { printf '[build_llama_server] %s\n' "$*" >&2; }

if [ -x "$DEST/bin/llama-server" ] && "$DEST/bin/llama-server" --version >/dev/null 2>&1; then
    log "already built: $DEST/bin/llama-server"
    exit 0
fi

command -v cmake >/dev/null || { log "cmake not found (apt-get install cmake, or pip install cmake)"; exit 1; }
command -v c++ >/dev/null || command -v g++ >/dev/null || { log "no C++ compiler found"; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
cleanup() {
    if [ "${KEEP_BUILD:-0}" = 1 ]; then log "kept build folder: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

start=$(date +%s)

if [ -n "${LLAMA_CPP_PYTHON_SDIST:-}" ]; then
    log "using sdist $LLAMA_CPP_PYTHON_SDIST"
    SDIST="$LLAMA_CPP_PYTHON_SDIST"
else
    PIP=("$PYTHON" -m pip)
    if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then  # a Python without pip: a venv has it
        "$PYTHON" -m venv "$WORK/venv"
        PIP=("$WORK/venv/bin/python" -m pip)
    fi
    log "downloading llama-cpp-python==$VERSION sdist with ${PIP[*]}"
    "${PIP[@]}" download --quiet --no-deps --no-binary :all: -d "$WORK/dl" \
        "llama-cpp-python==$VERSION"
    SDIST="$(ls "$WORK"/dl/llama_cpp_python-"$VERSION".tar.gz)"
fi

log "extracting $(basename "$SDIST")"
mkdir -p "$WORK/src"
tar -xzf "$SDIST" -C "$WORK/src"
SRC="$WORK/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/tools/server/CMakeLists.txt" ] || { log "no tools/server in $SRC"; exit 1; }

GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi

# No AMX: -march=native enables it on CPUs that report it, but a virtual machine may report
# AMX without letting a process use its tiles, and ggml's AMX matmul then crashes
# (segmentation fault at ldtilecfg, seen 2026-12-03). The same flags as the README's
# llama-cpp-python build; only where the compiler knows them (x86).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if echo 'int main(void){return 0;}' | cc $NO_AMX -x c -o /dev/null - >/dev/null 2>&1; then
    export CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX"
fi

log "configuring (Release, static, GGML_NATIVE=$GGML_NATIVE, GGML_LLAMAFILE=OFF, no AMX)"
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_LLAMAFILE=OFF \
    -DGGML_NATIVE="$GGML_NATIVE" \
    -DGGML_BACKEND_DL=OFF \
    >"$WORK/configure.log" 2>&1 || { tail -40 "$WORK/configure.log" >&2; log "configure failed"; exit 1; }

log "building target llama-server (nice $NICE, -j $JOBS); log: $WORK/build.log"
nice -n "$NICE" cmake --build "$WORK/build" --target llama-server -j "$JOBS" \
    >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; log "build failed"; exit 1; }

mkdir -p "$DEST/bin"
install -m 0755 "$WORK/build/bin/llama-server" "$DEST/bin/llama-server.tmp"
mv -f "$DEST/bin/llama-server.tmp" "$DEST/bin/llama-server"
# a static build needs no llama/ggml shared libraries; copy any that a shared build made
for lib in "$WORK"/build/bin/*.so*; do
    if [ -e "$lib" ]; then cp -a "$lib" "$DEST/bin/"; fi
done

"$DEST/bin/llama-server" --version >&2
log "done in $(( $(date +%s) - start )) s: $DEST/bin/llama-server"
