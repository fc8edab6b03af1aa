#!/usr/bin/env bash
# On the GPU machine, in the repo root: gather the pieces fetch_wheels.sh made, one device call each,
# then install them (the machine keeps its files between calls only while it is held: make the calls
# back to back).
#   bash benchmarks/peer/install_wheels.sh stash .peer/p1          # calls 1 .. N-1
#   bash benchmarks/peer/install_wheels.sh install .peer/pN        # call N: stash, reassemble, install
# install: every wheel of MANIFEST whose chunks are all there and whose sha256 matches is installed
# with pip --no-index --no-deps --target $SITE (default /tmp/site), together with the repo's own
# .whl/*.whl (fla-core, for wmtp's chunked GDN prefill); a wheel with chunks missing is reported and
# left out. Then `import vllm` is checked. Use PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD.
set -euo pipefail
store=${STORE:-/root/peer}
site=${SITE:-/tmp/site}
cmd=${1:?stash or install}; shift
mkdir -p "$store"
for d in "$@"; do
  if [[ -d $d ]]; then
    n=$(find "$d" -maxdepth 1 -type f | wc -l)
    mv -f "$d"/* "$store"/
    echo "stashed $d: $n files -> $store ($(du -sm "$store" | cut -f1) MiB there)"
  else
    echo "no $d here"
  fi
done
[[ $cmd == install ]] || exit 0

python3 - "$store" <<'EOF'
import hashlib, sys
from pathlib import Path

store = Path(sys.argv[1])
ok, missing = [], []
for line in (store / "MANIFEST").read_text().splitlines():
    sha, name = line.split()
    whole = store / name
    parts = sorted(store.glob(name + ".part*"))
    if parts:
        with open(whole, "wb") as out:
            for p in parts:
                out.write(p.read_bytes())
    if whole.exists() and hashlib.sha256(whole.read_bytes()).hexdigest() == sha:
        for p in parts:
            p.unlink()
        ok.append(name)
    else:
        whole.unlink(missing_ok=True)
        missing.append(name)
(store / "INSTALL").write_text("".join(f"{n}\n" for n in ok))
print(f"{len(ok)} wheels complete" + (f"; incomplete, left out: {missing}" if missing else ""))
EOF
mapfile -t wheels < <(sed "s|^|$store/|" "$store/INSTALL")
extra=()
compgen -G ".whl/*.whl" > /dev/null && extra=(.whl/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  "${wheels[@]}" "${extra[@]}"
echo "installed ${#wheels[@]} + ${#extra[@]} wheels into $site ($(du -sm "$site" | cut -f1) MiB)"
PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages python3 -c "
import importlib.util as u, vllm, flashinfer
print('vllm', vllm.__version__, '| flashinfer', flashinfer.__version__, '| cutlass (CuTe DSL):',
      u.find_spec('cutlass') is not None, '| quack:', u.find_spec('quack') is not None, '| fla:', u.find_spec('fla') is not None)
from vllm import LLM
"
