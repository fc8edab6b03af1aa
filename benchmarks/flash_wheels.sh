#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) for the GPU machine, which has no package index. Its wheels
# (cp312, CUDA 13) are ~100 MB; a device call carries 64 MiB with the tree, so they travel in three:
#   here:         bash benchmarks/flash_wheels.sh pack   -> .flash1/, .flash2/ (46 MB each), .flash3/ (the rest)
#   device #1, #2: carry [".flash1"], then [".flash2"], run anything (the parts stay: ignored paths are kept)
#   device #3:    carry [".whl", ".flash3"], start with `bash benchmarks/flash_wheels.sh join &&` -> .whl/
#                 (benchmarks/h200_checks.sh then installs them with the rest of .whl/)
set -euo pipefail
big=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
case "${1:-}" in
  pack)
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$tmp" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
      torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
    rm -rf .flash1 .flash2 .flash3 && mkdir -p .flash1 .flash2 .flash3
    (cd "$tmp" && sha256sum "$big") > .flash3/"$big".sha256
    split -n 2 "$tmp/$big" .flash3/part_
    mv .flash3/part_aa .flash1/ && mv .flash3/part_ab .flash2/
    find "$tmp" -name '*.whl' ! -name "$big" -exec mv {} .flash3/ \;
    rm -rf "$tmp"
    du -sh .flash1 .flash2 .flash3 ;;
  join)
    mkdir -p .whl
    cat .flash1/part_aa .flash2/part_ab > ".whl/$big"
    (cd .whl && sha256sum -c "../.flash3/$big.sha256")
    cp .flash3/*.whl .whl/ ;;
  *) echo "usage: $0 pack|join" >&2; exit 2 ;;
esac
