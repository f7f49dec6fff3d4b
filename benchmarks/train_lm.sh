#!/usr/bin/env bash
# Train one ~125M model per mixer on the same tokens with the same recipe (kalmix train's gpu-125m preset), one
# after another, each on every GPU (torchrun, DDP); then draw their loss curves on one PNG. Extra arguments go to
# every run (e.g. --train.steps 3052 for 200M tokens of 65,536 per step).
# usage: bash benchmarks/train_lm.sh OUT_DIR "JOB JOB ..." [--key value ...]
#   JOB = MIXER[:SEED] (seed 0 by default): the run OUT_DIR/MIXER (OUT_DIR/MIXER.sSEED with a seed); every run
#         reads one data folder, OUT_DIR/data (tokenizer and shards, made by the first run).
# environment:
#   GPUS   number of GPUs per run (default: every GPU nvidia-smi lists; 0 or none: one process, no torchrun)
#   PRESET the kalmix train preset or config (default gpu-125m; cpu-tiny runs on a CPU with GPUS=0)
#   LIMIT  seconds from the start after which the running job gets SIGTERM (default 0: no limit). A run cut there
#          writes its checkpoint and stops; the same command again resumes it, and finished runs are skipped.
# exit status: 0 when every run finished, 124 when the limit cut one (run the command again), 1 when one failed.
set -uo pipefail
out=${1:?output folder}; jobs=${2:-"attention gdn kaczmarz gka vla kalman"}; shift 2 || true
mkdir -p "$out"
if [[ -z ${GPUS+set} ]]; then GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l); fi
gpus=${GPUS:-0}; limit=${LIMIT:-0}; start=$(date +%s); runs=()
for job in $jobs; do
  IFS=: read -r mixer seed <<< "$job"
  dir="$out/$mixer${seed:+.s$seed}"; runs+=("$dir")
  if [[ -f $dir/model/config.json ]]; then echo "$job: finished before"; continue; fi
  cmd=(-m kalmix.cli train "${PRESET:-gpu-125m}" --model.mixer "$mixer" --seed "${seed:-0}" --run_dir "$dir" --data_dir "$out/data"
       --log.progress false "$@")
  if (( gpus > 1 )); then cmd=(torchrun --standalone --nproc-per-node "$gpus" "${cmd[@]}"); else cmd=(python3 "${cmd[@]}"); fi
  if (( limit > 0 )); then
    left=$(( start + limit - $(date +%s) ))
    if (( left < 60 )); then echo "$job: not started (time limit)"; exit 124; fi
    cmd=(timeout -s TERM -k 90 "$left" "${cmd[@]}")
  fi
  mkdir -p "$dir"
  "${cmd[@]}" >> "$dir.log" 2>&1
  status=$?
  case $status in
    0) echo "$job: finished" ;;
    124|137|143) echo "$job: cut by the time limit; run the command again to resume"; exit 124 ;;
    *) echo "$job: failed with status $status; see $dir.log"; exit 1 ;;
  esac
done
python3 -m kalmix.cli plot "${runs[@]}" --out "$out/loss.png"
