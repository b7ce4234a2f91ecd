#!/usr/bin/env bash
# Train the 124M speedrun model on every GPU of this machine:
#   bash run.sh [--flag=value ...]       flags pass through to train_gpt2.py
#   NPROC=4 bash run.sh                  use 4 GPUs instead of all
#   FINEWEB_SHARDS=20 bash run.sh        fetch this many FineWeb train shards (100M tokens each) instead of as many
#                                        as the run reads
# On a machine without a GPU, or when FineWeb cannot be fetched, it runs the smoke preset on the sample corpus,
# unless the flags name a --preset: that one runs as asked (on the CPU), or stops when its data cannot be fetched.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

count_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        # A failing nvidia-smi (no driver) prints no "GPU n:" lines, so the count is 0.
        nvidia-smi -L 2>/dev/null | grep -c '^GPU [0-9]' || true
    else
        echo 0
    fi
}

case " $* " in
    # The flags' help needs neither GPUs, data nor torch: train_gpt2.py's own --help loads torch first (10.5-13.3 s
    # on the H200 image), runtime.config does not (0.41-0.43 s there).
    *" --help "* | *" -h "*) exec python -c 'import sys, runtime.cli as cli, runtime.config as c, runtime.errors as e
e.exit_on_user_error(cli.parse_config, c.TrainConfig, sys.argv[1:], c.PRESETS)' "$@" ;;
esac

names_preset() {
    case " $* " in *" --preset"*) return 0 ;; esac
    return 1
}

gpus=$(count_gpus)
if [ "$gpus" -eq 0 ]; then
    # On the CPU the head's (tokens x 50,304) fp32 tensors are larger than glibc's largest mmap threshold (32 MiB),
    # so each is mapped and unmapped every step and the kernel zeroes its pages at each first touch again: 3.5M page
    # faults and 12 s of system time in an 8-step smoke run on a 2-core AMD EPYC. Every block from the heap
    # (mmap_max=0), which keeps up to 1 GiB free at its top for the next step (trim_threshold), took the smoke run from
    # 60.6-61.6 s to 28.3-28.6 s there (the two set through mallopt, runtime/memory.py), with the same losses; freed
    # blocks stay in the process. Huge pages (glibc.malloc.hugetlb=1), which run.sh also asked for until 2026-12-03,
    # added nothing there (27.9-30.2 s) and cost much on a 2-core Intel Xeon VM: smoke run 22.5-29.8 s against
    # 15.1-15.7 s without, 14.8-19.4 s of system time against 0.7-2.0 (bench/results/README.md, "The CPU's
    # allocator"). The user's own tunables follow and win.
    ours=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824
    export GLIBC_TUNABLES="$ours${GLIBC_TUNABLES:+:$GLIBC_TUNABLES}"
    if names_preset "$@"; then
        echo "run.sh: no GPU found, running the --preset you named on the CPU" >&2
        exec python train_gpt2.py "$@"
    fi
    echo "run.sh: no GPU found, running the CPU smoke preset" >&2
    exec python train_gpt2.py --preset smoke "$@"
fi
NPROC=${NPROC:-$gpus}
if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]] || [ "$NPROC" -gt "$gpus" ]; then
    echo "error: NPROC=$NPROC: give the number of GPUs to train on, from 1 to this machine's $gpus" >&2
    exit 2
fi

shopt -s nullglob
train_shards=(data/fineweb10B/fineweb_train_*.bin)
val_shards=(data/fineweb10B/fineweb_val_*.bin)
shopt -u nullglob
case " $* " in
    # The user brings their own data or runs the smoke preset: FineWeb is not needed.
    *" --train_files"* | *" --preset=smoke "* | *" --preset smoke "*) ;;
    *)
        # As many shards as these flags read on NPROC GPUs (record #28: 9), or FINEWEB_SHARDS; a bad flag or
        # FINEWEB_SHARDS stops here, before any download, with the message train_gpt2 would give. runtime.config
        # answers without torch: in 0.7-1.0 s on the H200 image, where train_gpt2 took 10.9-12.5 s.
        shards_code='import os, sys, runtime.config as c, runtime.errors as e
print(e.exit_on_user_error(c.fineweb_shards, sys.argv[1:], os.environ["FINEWEB_SHARDS"], int(os.environ["NPROC"])))'
        FINEWEB_SHARDS=$(FINEWEB_SHARDS=${FINEWEB_SHARDS:-} NPROC=$NPROC python -c "$shards_code" "$@")
        if [ "${#train_shards[@]}" -lt "$FINEWEB_SHARDS" ] || [ "${#val_shards[@]}" -eq 0 ]; then
            # Before the download, the device: a torch that cannot use these GPUs (one built for a newer CUDA than
            # the driver runs) stops here with train_gpt2's message, not after the download.
            python -c 'import sys, runtime.dist as d, runtime.errors as e
e.exit_on_user_error(d.device_for_flags, sys.argv[1:])' "$@"
            if ! python data/cached_fineweb10B.py "$FINEWEB_SHARDS"; then
                if names_preset "$@"; then
                    echo "run.sh: FineWeb could not be fetched (see above), and the --preset you named reads it:" \
                         "copy the shards into data/fineweb10B/ and run again" >&2
                    exit 1
                fi
                # No network (or no hub): still show a working run instead of stopping at the download.
                echo "run.sh: FineWeb could not be fetched (see above); running the smoke preset on the sample" \
                     "corpus instead. For the speedrun, copy the shards into data/fineweb10B/ and run again." >&2
                exec python train_gpt2.py --preset smoke "$@"
            fi
        fi
        ;;
esac

# Python compiles a module's source at every start when it may not write bytecode (PYTHONDONTWRITEBYTECODE, set in
# some images) and the packages were installed without any: 5.7-13.7 s of each cold start on an H200
# (runtime/bytecode.py). It still reads bytecode from PYTHONPYCACHEPREFIX's folder, which is filled here once
# (bench.run does the same, with the folder of runtime.bytecode.cache_prefix).
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/gpt-speedrun/pycache}"
    python -m runtime.bytecode
fi

if [ "$NPROC" -eq 1 ]; then
    exec python train_gpt2.py "$@"  # one process needs no launcher, and an error then stays one line
fi
exec torchrun --standalone --nproc_per_node="$NPROC" train_gpt2.py "$@"
