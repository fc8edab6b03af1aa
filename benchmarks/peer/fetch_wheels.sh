#!/usr/bin/env bash
# Download the wheels of benchmarks/peer/wheels.txt (for CPython 3.12, x86-64 manylinux), slim the
# two that carry files no run here loads, and cut the set into pieces that each fit one device call
# (the call carries the piece plus the repo's working tree: 64 MiB together).
#   bash benchmarks/peer/fetch_wheels.sh [DOWNLOAD_DIR [PIECES_DIR]]
# Defaults: .peer/whl of this checkout, and .peer of the checkout the device calls send
# ($PEER_CHECKOUT, default /work/main; ignore /.peer/ there).
# A piece gets what the call has room for: 64 MiB less that checkout's working tree (what travels:
# tracked and untracked-not-ignored files), less .whl/ (the repo's fla-core, carried by the last
# call), less MARGIN_MIB (default 3) for the tree to grow; PIECE_MIB overrides. SLIM=0 keeps the
# wheels as published; WHEEL_GROUPS=core leaves out the cutedsl group (vllm_vs_wmtp.py then picks vLLM's
# Triton GDN prefill itself and says so).
# Pieces: PIECES_DIR/p1 ... pN in one stream, the cutedsl group first, so the last piece is a core
# one (its call installs). Each holds whole wheels and NAME.whl.partNNN chunks of big ones, plus
# MANIFEST (sha256 of every wheel); install_wheels.sh reassembles and checks them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
dl=${1:-$repo/.peer/whl}
pieces=${2:-${PEER_CHECKOUT:-/work/main}/.peer}
sent=$(cd "$(dirname "$pieces")" && pwd)
if [[ -z ${PIECE_MIB:-} ]]; then
  tree=$(cd "$sent" && { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
         | awk '{s+=$1} END {print s+0}')
  whl=$(du -sb "$sent/.whl" 2>/dev/null | cut -f1 || echo 0)
  piece_mib=$(( (64 * 1048576 - tree - ${whl:-0}) / 1048576 - ${MARGIN_MIB:-3} ))
  echo "working tree $((tree / 1048576)) MiB + .whl $((${whl:-0} / 1048576)) MiB: pieces of <= $piece_mib MiB"
else
  piece_mib=$PIECE_MIB
fi
groups=${WHEEL_GROUPS:-cutedsl,core}
mkdir -p "$dl"

plats=()
for n in 17 24 26 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any)

specs=$(grep -v '^#' "$here/wheels.txt" | awk 'NF {print $1 "=" $3}')
for line in $specs; do
  spec=${line%=*}; group=${line##*=}
  [[ ",$groups," == *",$group,"* ]] || continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${plats[@]}" -d "$dl" "$spec" 2>&1 | grep -v '^WARNING: Location' || true
done

python3 - "$here/wheels.txt" "$dl" "$pieces" "$piece_mib" "$groups" "${SLIM:-1}" <<'EOF'
"""Select the listed wheels in DL, slim two, pack into pieces."""
import base64, hashlib, os, re, shutil, sys, zipfile
from pathlib import Path

listing, dl, pieces, piece_mib, groups, slim = sys.argv[1:7]
dl, pieces, cap = Path(dl), Path(pieces), int(piece_mib) * 2**20
groups = groups.split(",")
# files no run of vllm_vs_wmtp.py loads: FlashAttention 2 (Ampere; Hopper runs FA3, which
# get_flash_attn_version picks on SM90 for every head size but ALiBi / TurboQuant / batch-invariant
# runs), the Rust frontend binary (VLLM_RUST_FRONTEND_PATH only), deep_gemm's extension for other
# Pythons, xgrammar's static C++ archive (for linking C++ programs; Python loads its bindings .so)
DROP = {"vllm": [r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so", r"vllm/vllm-rs",
                 r"vllm/third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-.*\.so"],
        "xgrammar": [r"xgrammar/lib/libxgrammar\.a"]}

def norm(name): return re.sub(r"[-_.]+", "_", name).lower()

wanted = []  # (group, wheel path)
for line in Path(listing).read_text().splitlines():
    if not line.strip() or line.startswith("#"):
        continue
    spec, _, group = line.split()[:3]
    name, version = spec.split("==")
    if group not in groups:
        continue
    hits = [p for p in dl.glob("*.whl") if norm(p.name.split("-")[0]) == norm(name) and p.name.split("-")[1] == version]
    if len(hits) != 1:
        sys.exit(f"{spec}: expected one wheel in {dl}, found {[h.name for h in hits]}")
    wanted.append((group, name, hits[0]))

def slimmed(path, patterns):
    """A copy of the wheel without the members matching ``patterns`` (their RECORD lines too)."""
    out = path.parent / "slim" / path.name
    out.parent.mkdir(exist_ok=True)
    if out.exists() and out.stat().st_mtime >= path.stat().st_mtime:
        return out
    rx = [re.compile(p + "$") for p in patterns]
    dropped = 0
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        for info in zin.infolist():
            if any(r.match(info.filename) for r in rx):
                dropped += info.file_size
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [l for l in data.decode().splitlines() if not any(r.match(l.split(",")[0]) for r in rx)]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED if info.compress_type else zipfile.ZIP_STORED)
    print(f"slimmed {path.name}: {dropped / 2**20:.0f} MiB of files dropped, {path.stat().st_size / 2**20:.0f} -> "
          f"{out.stat().st_size / 2**20:.0f} MiB")
    return out

files = []
for group, name, path in sorted(wanted, key=lambda w: groups.index(w[0])):
    if slim == "1" and name in DROP:
        path = slimmed(path, DROP[name])
    files.append(path)
if len({p.name.split("-")[0].lower() for p in files}) != len(files):
    sys.exit("two versions of one package: the install would stop")

for old in pieces.glob("p[0-9]*"):
    shutil.rmtree(old)
pieces.mkdir(parents=True, exist_ok=True)
manifest = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files)
n, room, dirs = 0, 0, []
def new_piece():
    global n, room
    n += 1
    d = pieces / f"p{n}"
    d.mkdir()
    (d / "MANIFEST").write_text(manifest)
    dirs.append(d)
    room = cap
    return d
cur = new_piece()
for path in files:
    size = path.stat().st_size
    if size <= room:
        shutil.copyfile(path, cur / path.name)
        room -= size
        continue
    with open(path, "rb") as f:
        part = 0
        while True:
            if room < 2**20:
                cur = new_piece()
            chunk = f.read(room)
            if not chunk:
                break
            (cur / f"{path.name}.part{part:03d}").write_bytes(chunk)
            room -= len(chunk)
            part += 1
total = sum(p.stat().st_size for p in files)
print(f"{len(files)} wheels, {total} bytes ({total / 2**20:.1f} MiB) -> {n} pieces of <= {piece_mib} MiB in {pieces}:")
for d in dirs:
    print(f"  {d.name}: {sum(f.stat().st_size for f in d.iterdir()) / 2**20:5.1f} MiB  " +
          " ".join(sorted(f.name.split("-")[0] + (f.name[f.name.rfind('.part'):] if '.part' in f.name else '') for f in d.iterdir() if f.name != 'MANIFEST')))
EOF
