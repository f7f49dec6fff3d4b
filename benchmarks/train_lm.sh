#!/usr/bin/env bash
# Train one ~125M model per mixer on the same tokens with the same recipe (kalmix train's gpu-125m preset), then
# draw their loss curves on one PNG. Extra arguments go to every run (e.g. --train.steps 300).
# usage: bash benchmarks/train_lm.sh OUT_DIR "MIXERS" [--key value ...]
set -euo pipefail
out=${1:?output folder}; mixers=${2:-"attention gdn kaczmarz gka vla kalman"}; shift 2 || true
mkdir -p "$out"
for m in $mixers; do
  python3 -m kalmix.cli train gpu-125m --model.mixer "$m" --run_dir "$out/$m" --data_dir "$out/data" \
      --log.progress false "$@"
done
python3 -m kalmix.cli plot $(for m in $mixers; do echo "$out/$m"; done) --out "$out/loss.png"
