#!/usr/bin/env bash
# The wheels check.sh installs on a GPU machine that has no package index: our dependencies that
# such a machine's image lacks (it has torch, triton, transformers, numpy, safetensors, numba and
# pytest), built for CPython 3.12 on x86-64 Linux. Run this where pip reaches an index; the
# folder it fills is git-ignored and travels with the working tree (about 20 MB).
#
#     experiments/gpu/fetch_wheels.sh [FOLDER]     # default: experiments/gpu/wheels
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-experiments/gpu/wheels}
PYTHON=${PYTHON:-python3}
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# faiss-cpu: the index kinds on the CPU (faiss-gpu's wheels need CUDA 12's runtime: flat-torch
# searches exactly on the GPU instead); lmdb: the default disk store
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" faiss-cpu==1.15.1 lmdb==3.0.0
ls -l "$dest"
