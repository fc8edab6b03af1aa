#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) for the GPU machine, which has no package index. Its wheels
# (cp312, CUDA 13) are ~100 MB zipped, 88 of them one wheel of compiler libraries; a device call carries
# 64 MiB with the tree, so that wheel travels as an xz tar (64 MB) in two halves, over two calls:
#   here:     bash benchmarks/flash_wheels.sh pack  -> .flash1/ (one half, 32 MB), .flash2/ (the other and
#             the small wheels, 42 MB)
#   device #1: carry [".flash1"], run anything (the part stays: ignored paths are kept while the machine is)
#   device #2: carry [".whl", ".flash2"]; benchmarks/h200_checks.sh joins them into .whl/ (or, by hand,
#             `bash benchmarks/flash_wheels.sh join`) and installs them with the rest of .whl/
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
    mkdir "$tmp/files" && (cd "$tmp/files" && python3 -m zipfile -e "../$big" . && tar -cf - . | xz -T0 -9 > ../big.tar.xz)
    rm -rf .flash1 .flash2 .flash3 && mkdir -p .flash1 .flash2
    (cd "$tmp" && sha256sum big.tar.xz) > .flash2/big.tar.xz.sha256
    split -n 2 "$tmp/big.tar.xz" "$tmp/part_"
    mv "$tmp/part_aa" .flash1/ && mv "$tmp/part_ab" .flash2/
    find "$tmp" -maxdepth 1 -name '*.whl' ! -name "$big" -exec mv {} .flash2/ \;
    rm -rf "$tmp"
    du -sh .flash1 .flash2 ;;
  join)
    mkdir -p .whl
    tmp=$(mktemp -d)
    cat .flash1/part_aa .flash2/part_ab > "$tmp/big.tar.xz"
    (cd "$tmp" && sha256sum -c "$OLDPWD/.flash2/big.tar.xz.sha256")
    # the wheel again, stored (pip reads any zip; it is unpacked at once)
    mkdir "$tmp/files" && xz -dc "$tmp/big.tar.xz" | tar -xf - -C "$tmp/files"
    python3 - "$tmp/files" ".whl/$big" <<'PY'
import os, sys, zipfile
root, out = sys.argv[1:]
with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            z.write(p, os.path.relpath(p, root))
PY
    rm -rf "$tmp"
    cp .flash2/*.whl .whl/ ;;
  *) echo "usage: $0 pack|join" >&2; exit 2 ;;
esac
