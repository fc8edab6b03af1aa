#!/usr/bin/env bash
# A/B on one GPU: bench step's T_iter (or, BENCH=ttft, a real prefill's TTFT) for several revisions,
# interleaved round by round. Machines of the same GPU model differ by a few percent in T_iter (power cap, clocks), so
# runs on different machines cannot resolve a 1% change; interleaving on one can.
#   here:       benchmarks/ab_step.sh pack REV [REV ...]   # git archive each into .ab/<rev>.tar (gzip, ~9 MB)
#   on the GPU: benchmarks/ab_step.sh run [ROUNDS] [MODES]  # (carry .ab and .whl) -> $OUT/ab_*.json,
#                                                           #    $OUT/ab_summary.txt; REVS=A,B (short
#                                                           #    hashes as packed) times only those
#   or, the working tree under settings: benchmarks/ab_step.sh env ROUNDS MODES VAR=VALUE [VAR=VALUE ...]
#                                                           # -> $OUT/ab_VAR-VALUE_*.json, the first the baseline
# Env: PRESET (qwen3.6-35b-a3b), LAYERS (the preset's first N layers only; default all), CONTEXT (1040000), D (7),
# ITERS (60); BENCH=ttft: TOKENS (131072),
# CHUNK (16384), and the prefill's split (attention / recurrent / MoE / rest) in the summary.
set -euo pipefail
cmd=${1:-}
case $cmd in
pack)
  shift
  [[ $# -ge 1 ]] || { echo "ab_step.sh pack: name at least one revision" >&2; exit 2; }
  rm -rf .ab && mkdir -p .ab  # gzip: ~9 MB a revision (tar -x detects it); a device call carries 64 MiB in all
  for rev in "$@"; do
    sha=$(git rev-parse --short "$rev")
    git archive --format=tar.gz -o ".ab/$sha.tar" "$sha"
    echo "$sha" >> .ab/order  # the first is the baseline of the summary
    echo ".ab/$sha.tar ($rev)"
  done ;;
run | env)
  rounds=${2:-2} modes=${3:-windowed} out=${OUT:-ab_out}
  [[ $cmd == env || -f .ab/order ]] || { echo "ab_step.sh run: no .ab/order (pack the revisions first, carry .ab)" >&2; exit 2; }
  [[ $cmd == run || $# -ge 5 ]] || { echo "ab_step.sh env: name at least two VAR=VALUE settings" >&2; exit 2; }
  mkdir -p "$out" /tmp/ab
  out=$(cd "$out" && pwd)
  site=""
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    site=/tmp/site
  fi
  declare -A dir setting
  if [[ $cmd == run ]]; then
    mapfile -t revs < .ab/order
    if [[ -n ${REVS:-} ]]; then
      IFS=, read -r -a revs <<< "$REVS"  # the first the baseline
    fi
    for rev in "${revs[@]}"; do
      [[ -f ".ab/$rev.tar" ]] || { echo "ab_step.sh run: no .ab/$rev.tar (packed: $(tr '\n' ' ' < .ab/order))" >&2; exit 2; }
      mkdir -p "/tmp/ab/$rev" && tar -xf ".ab/$rev.tar" -C "/tmp/ab/$rev"
      dir[$rev]=/tmp/ab/$rev setting[$rev]=WMTP_COMMIT=$rev
    done
  else
    revs=()
    for kv in "${@:4}"; do
      rev=${kv//=/-}; revs+=("$rev"); dir[$rev]=$PWD setting[$rev]=$kv
    done
  fi
  for ((r = 1; r <= rounds; r++)); do
    for rev in "${revs[@]}"; do
      if [[ ${BENCH:-step} == ttft ]]; then
        args=(ttft --tokens "${TOKENS:-131072}" --chunk "${CHUNK:-16384}" --split)
      else
        args=(step --context "${CONTEXT:-1040000}" --iters "${ITERS:-60}")
      fi
      (cd "${dir[$rev]}" && export "${setting[$rev]}" && PYTHONPATH="${dir[$rev]}:$site" PYTHONUNBUFFERED=1 python3 -m wmtp bench \
         "${args[@]}" --preset "${PRESET:-qwen3.6-35b-a3b}" ${LAYERS:+--layers "$LAYERS"} -d "${D:-7}" --modes "$modes" \
         --out "$out/ab_${rev}_$r.json" | grep -E "t_iter |TTFT" || true)
      [[ -f "$out/ab_${rev}_$r.json" ]] || echo "ab_step.sh: $rev round $r failed (no JSON)" | tee -a "$out/ab_summary.txt" >&2
    done
  done
  python3 - "$out" "${revs[@]}" <<'PY' | tee -a "$out/ab_summary.txt"
import json, statistics, sys
out, revs = sys.argv[1], sys.argv[2:]
rows = {}
for rev in revs:
    for r in range(1, 1000):
        try:
            d = json.load(open(f"{out}/ab_{rev}_{r}.json"))
        except FileNotFoundError:
            break
        for row in d["rows"]:
            t = row["ttft_s"] if d["kind"] == "ttft" else row["t_iter_s"][0]
            rows.setdefault((row["mode"], rev), []).append((t * 1e3, row.get("split_s", {})))
for mode in sorted({m for m, _ in rows}):
    base = statistics.mean(x for x, _ in rows.get((mode, revs[0]), [(float("nan"), {})]))
    for rev in revs:
        runs = rows.get((mode, rev), [])
        if runs:
            t = [x for x, _ in runs]
            split = {k: statistics.mean(s[k] for _, s in runs) for k in runs[0][1]}
            print(f"{mode:9s} {rev}: {' / '.join(f'{x:.3f}' for x in t)} ms, mean {statistics.mean(t):.3f}"
                  f" ({statistics.mean(t) / base:.4f} of {revs[0]})"
                  + "".join(f", {k} {v:.3f} s" for k, v in split.items()))
PY
  ;;
*)
  echo "usage: benchmarks/ab_step.sh pack REV [REV ...] | run [ROUNDS] [MODES] | env ROUNDS MODES VAR=VALUE ..." >&2; exit 2 ;;
esac
