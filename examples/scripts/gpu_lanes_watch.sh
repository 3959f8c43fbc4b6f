#!/bin/bash
# Watch the lanes of gpu_lanes.sh for up to SECONDS (or until every lane is done), then copy what they
# have so far into OUT: each lane's results.json files (flattened to <lane>-<run>.json) and one tarball
# of the lanes' logs, tables and traces. A device call runs this in its last minutes, so that the
# results come back even where the next call never comes.
#   bash examples/scripts/gpu_lanes_watch.sh /tmp/lanes 540 $OUT
ROOT=${1:-/tmp/lanes}
SECONDS_MAX=${2:-540}
OUT=${3:-/tmp/lanes-out}
mkdir -p "$OUT"
end=$((SECONDS + SECONDS_MAX))
while [ $SECONDS -lt $end ]; do
  running=$(for log in "$ROOT"/*/lane.log; do grep -q "^lane done" "$log" || echo "$log"; done)
  [ -z "$running" ] && break
  sleep 15
done
for log in "$ROOT"/*/lane.log; do
  echo "== $log: $(tail -c 300 "$log" | tr '\r' '\n' | tail -2)"
done
for path in "$ROOT"/*/out/*/results.json "$ROOT"/*/out/results.json; do
  [ -f "$path" ] || continue
  rel=${path#"$ROOT"/}
  cp "$path" "$OUT/$(echo "${rel%/results.json}" | tr / -).json"
done
# Logs, tables, plots, tensorboard events and the traces of step 3 (all steps' traces outgrow the 16 MiB a
# returned file may have); not the models, checkpoints, Ray's or compile caches.
tar czf "$OUT/lanes.tgz" -C "$ROOT" --exclude='./*/ray' --exclude='./*/cache' --exclude='ckpt' \
  --exclude='workload' --exclude='*.safetensors' --exclude='step_0000[0124-9].json' --exclude='step_000[1-9]?.json' \
  . 2>/dev/null
ls -la "$OUT"
