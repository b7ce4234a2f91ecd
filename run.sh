#!/usr/bin/env bash
# Train the 124M speedrun model on every GPU of this machine:
#   bash run.sh [--flag=value ...]       flags pass through to train_gpt2.py
#   NPROC=4 bash run.sh                  use 4 GPUs instead of all (without a GPU: 4 CPU processes)
#   FINEWEB_SHARDS=20 bash run.sh        fetch this many FineWeb train shards instead of those the run reads
# Runs in the active virtual environment, else in ./.venv (set up once). Without a GPU or FineWeb it runs the smoke
# preset on the sample corpus, unless the flags name a --preset. SIGINT/SIGTERM stops at the next logged step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

TORCH=torch==2.11.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

count_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        # no driver: no "GPU n:" lines, a count of 0
        nvidia-smi -L 2>/dev/null | grep -c '^GPU [0-9]' || true
    else
        echo 0
    fi
}

names_preset() {
    case " $* " in *" --preset"*) return 0 ;; esac
    return 1
}

# ./.venv: torch's CPU build where there is no GPU (no CUDA libraries to download), then the rest from pyproject.toml.
setup_venv() {
    echo "run.sh: setting up ./.venv for this project (once)" >&2
    if [ ! -x .venv/bin/pip ] && ! python3 -m venv .venv; then
        echo "error: python3 -m venv .venv failed (see above): install Python 3.10 or newer with its venv module," \
             "or activate a virtual environment that has this project's packages" >&2
        exit 2
    fi
    if [ "$gpus" -eq 0 ] && ! .venv/bin/pip install "$TORCH" --index-url "$CPU_INDEX" 2>/dev/null; then
        echo "run.sh: $CPU_INDEX cannot be reached; installing PyPI's $TORCH instead" >&2
        .venv/bin/pip install "$TORCH"
    fi
    .venv/bin/pip install .
}

# train_gpt2.py with these flags in NPROC processes.
train() {
    if [ "$NPROC" -eq 1 ]; then
        exec python train_gpt2.py "$@"  # no launcher, so an error stays one line
    fi
    # torchrun gets its own process group (set -m), out of Ctrl-C's reach: signals go to the workers alone, so all
    # exit 0 (torchrun, signalled itself, would exit 1 with a traceback).
    trap 'forward INT' INT
    trap 'forward TERM' TERM
    trap 'forward HUP' HUP
    set -m
    torchrun --standalone --nproc_per_node="$NPROC" train_gpt2.py "$@" &
    launcher=$!
    set +m
    while :; do
        wait "$launcher" && status=0 || status=$?  # a trapped signal ends the wait early
        kill -0 "$launcher" 2>/dev/null || break
    done
    wait "$launcher" && status=0 || status=$?  # torchrun's own status
    exit "$status"
}

# Send signal $1 to torchrun's children, the workers, or to torchrun before it has started them.
# shellcheck disable=SC2329  # the traps call it
forward() {
    local workers="" file
    for file in /proc/"$launcher"/task/*/children; do
        [ -r "$file" ] && workers+=" $(<"$file")"
    done
    # shellcheck disable=SC2086  # one pid per word
    kill -s "$1" ${workers:-$launcher} 2>/dev/null || true
}

gpus=$(count_gpus)
if [ "$gpus" -gt 0 ]; then
    NPROC=${NPROC:-$gpus}
    if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]] || [ "$NPROC" -gt "$gpus" ]; then
        echo "error: NPROC=$NPROC: give the number of GPUs to train on, from 1 to this machine's $gpus" >&2
        exit 2
    fi
else
    NPROC=${NPROC:-1}
    if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then
        echo "error: NPROC=$NPROC: give the number of CPU processes to train with, 1 or more (no GPU found)" >&2
        exit 2
    fi
fi

if [ -z "${VIRTUAL_ENV:-}" ]; then
    # ready once `pip install .` has finished (-I: a build's egg-info in this folder does not count)
    if ! .venv/bin/python -I -c 'import importlib.metadata as m; m.distribution("gpt-speedrun")' 2>/dev/null; then
        setup_venv
    fi
    VIRTUAL_ENV=$PWD/.venv
fi
export VIRTUAL_ENV PATH="$VIRTUAL_ENV/bin:$PATH"

case " $* " in
    # --help needs no GPU, data or torch.
    *" --help "* | *" -h "*) exec python -c 'import sys, runtime.cli as cli, runtime.config as c, runtime.errors as e
e.exit_on_user_error(cli.parse_config, c.TrainConfig, sys.argv[1:], c.PRESETS)' "$@" ;;
esac

if [ "$gpus" -eq 0 ]; then
    # Keep the head's large tensors in the heap, not mapped and zeroed anew each step; the user's tunables win.
    ours=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824
    export GLIBC_TUNABLES="$ours${GLIBC_TUNABLES:+:$GLIBC_TUNABLES}"
    if names_preset "$@"; then
        echo "run.sh: no GPU found, running the --preset you named on the CPU" >&2
        train "$@"
    fi
    echo "run.sh: no GPU found, running the CPU smoke preset" >&2
    train --preset smoke "$@"
fi

shopt -s nullglob
train_shards=(data/fineweb10B/fineweb_train_*.bin)
val_shards=(data/fineweb10B/fineweb_val_*.bin)
shopt -u nullglob
case " $* " in
    # The user brings their own data or runs the smoke preset: FineWeb is not needed.
    *" --train_files"* | *" --preset=smoke "* | *" --preset smoke "*) ;;
    *)
        # The shards these flags read on NPROC GPUs, or FINEWEB_SHARDS; a bad value stops here, before any download.
        shards_code='import os, sys, runtime.config as c, runtime.errors as e
print(e.exit_on_user_error(c.fineweb_shards, sys.argv[1:], os.environ["FINEWEB_SHARDS"], int(os.environ["NPROC"])))'
        FINEWEB_SHARDS=$(FINEWEB_SHARDS=${FINEWEB_SHARDS:-} NPROC=$NPROC python -c "$shards_code" "$@")
        if [ "${#train_shards[@]}" -lt "$FINEWEB_SHARDS" ] || [ "${#val_shards[@]}" -eq 0 ]; then
            # A torch that cannot use these GPUs stops here too, not after the download.
            python -c 'import sys, runtime.dist as d, runtime.errors as e
e.exit_on_user_error(d.device_for_flags, sys.argv[1:])' "$@"
            if ! python data/cached_fineweb10B.py "$FINEWEB_SHARDS"; then
                if names_preset "$@"; then
                    echo "run.sh: FineWeb could not be fetched (see above), and the --preset you named reads it:" \
                         "copy the shards into data/fineweb10B/ and run again" >&2
                    exit 1
                fi
                # No network: still show a working run.
                echo "run.sh: FineWeb could not be fetched (see above); running the smoke preset on the sample" \
                     "corpus instead. For the speedrun, copy the shards into data/fineweb10B/ and run again." >&2
                exec python train_gpt2.py --preset smoke "$@"
            fi
        fi
        ;;
esac

# Without writable bytecode Python compiles every module at each start; it still reads PYTHONPYCACHEPREFIX's
# folder, which runtime.bytecode fills once.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/gpt-speedrun/pycache}"
    python -m runtime.bytecode
fi

train "$@"
