#!/usr/bin/env bash
# On the GPU machine, in a device call after one that started vllm_vs_wmtp.py --background:
#   bash benchmarks/peer/wait.sh [STATE [SECONDS]]
# waits until that run ends or SECONDS (default 560) pass, then copies STATE/peer.json and the tails
# of its logs (3 MB each) to $OUT, and prints the result lines so far. STATE: the run's --state
# (default /root/peer/run). Exit 0 when the run has ended, 3 while it still runs.
state=${1:-/root/peer/run}
limit=${2:-560}
pid=$(cat "$state/run.pid" 2>/dev/null) || { echo "no $state/run.pid"; exit 1; }
end=$((SECONDS + limit))
while kill -0 "$pid" 2>/dev/null && ((SECONDS < end)); do sleep 5; done
out=${OUT:-$state/out}
mkdir -p "$out"
[[ -f $state/peer.json ]] && cp "$state/peer.json" "$out/"
for f in "$state"/run.log "$state"/log_*.txt; do
  [[ -f $f ]] && tail -c 3000000 "$f" > "$out/$(basename "$f")"
done
grep -h '^\[\|^== \|^wrote\|Error\|error:' "$state/run.log" | tail -60
if kill -0 "$pid" 2>/dev/null; then echo "still running (pid $pid)"; exit 3; fi
echo "finished"
