#!/usr/bin/env bash
# Train one ~125M model per job with the same recipe on the same tokens (kalmix train's gpu-125m preset), the
# jobs spread over groups of GPUs that run side by side; then draw their loss curves on one PNG. Extra arguments go
# to every run (e.g. --train.steps 3052 for 200M tokens of 65,536 per step).
# usage: bash benchmarks/train_lm.sh OUT_DIR "JOB JOB ..." [--key value ...]
#   JOB = MIXER[@K][:SEED] (seed 0 by default; @K: softmax attention in every K-th layer, a hybrid): the run
#         OUT_DIR/MIXER[@K] (OUT_DIR/MIXER[@K].sSEED with a seed); every run reads one data folder, OUT_DIR/data
#         (tokenizer and shards, made by the first run while the others wait).
# environment:
#   GPUS    GPU ids to use (default: every GPU nvidia-smi lists; empty: one process per run, on what the config says)
#   PER_RUN GPUs per run (default: all of GPUS): the GPUs split into groups of PER_RUN, each group runs its share of
#           the jobs (job i on group i mod groups) one after another; a run of several GPUs is one torchrun (DDP)
#   PRESET  the kalmix train preset or config (default gpu-125m; cpu-tiny runs on a CPU with GPUS empty)
#   LIMIT   seconds from the start after which every running job gets SIGTERM (default 0: no limit). A run cut there
#           writes its checkpoint and stops; the same command again resumes it, and finished runs are skipped.
# Each process gets OMP_NUM_THREADS = the host's cores / the processes running at once, unless it is set.
# exit status: 0 when every run finished, 124 when the limit cut one (run the command again), 1 when one failed.
set -uo pipefail
source "$(dirname "$0")/spread.sh"
out=${1:?output folder}; jobs=${2:-"attention gdn kaczmarz gka vla kalman"}; shift 2 || true
limit=$(whole LIMIT "${LIMIT:-0}" 0) || exit 1
if [[ -z ${GPUS+set} ]]; then GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' '); fi
read -r -a gpus <<< "${GPUS:-}"
per_run=${PER_RUN:-${#gpus[@]}}
if (( ${#gpus[@]} )); then per_run=$(whole PER_RUN "$per_run" 1) || exit 1; fi
if (( ${#gpus[@]} )) && ! (( per_run >= 1 && ${#gpus[@]} % per_run == 0 )); then
  echo "PER_RUN = $per_run must be at least 1 and divide the ${#gpus[@]} GPUs of GPUS = '${GPUS}'" >&2; exit 1
fi
out_folder "$out" || exit 1
groups=()
if (( ${#gpus[@]} )); then
  for ((g = 0; g < ${#gpus[@]}; g += per_run)); do groups+=("$(IFS=,; echo "${gpus[*]:g:per_run}")"); done
else
  groups=("")
fi
start=$(date +%s)
procs=$(( ${#gpus[@]} ? ${#gpus[@]} : 1 )); threads=$(( $(nproc) / procs ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
read -r -a all <<< "$jobs"
runs=()
for job in "${all[@]}"; do IFS=: read -r mixer seed <<< "$job"; runs+=("$out/$mixer${seed:+.s$seed}"); done

run_job() {  # JOB DIR DEVICES ARGS...: one `kalmix train`, under the time left; prints what became of it
  local job=$1 dir=$2 devices=$3 mixer seed left status n hybrid=()
  shift 3
  IFS=: read -r mixer seed <<< "$job"
  if [[ $mixer == *@* ]]; then hybrid=(--model.attention_every "${mixer#*@}"); mixer=${mixer%@*}; fi
  if [[ -f $dir/model/config.json ]]; then echo "$job: finished before"; return 0; fi
  local cmd=(-m kalmix.cli train "${PRESET:-gpu-125m}" --model.mixer "$mixer" "${hybrid[@]}" --seed "${seed:-0}"
             --run_dir "$dir" --data_dir "$out/data" --log.progress false "$@")
  n=$(( ${#devices} ? $(tr -cd , <<< "$devices" | wc -c) + 1 : 1 ))
  if (( n > 1 )); then
    cmd=(torchrun --standalone --nproc-per-node "$n" "${cmd[@]}")
  else
    cmd=(python3 "${cmd[@]}")
  fi
  if (( limit > 0 )); then
    left=$(( start + limit - $(date +%s) ))
    if (( left < 60 )); then echo "$job: not started (time limit)"; return 124; fi
    cmd=(timeout -s TERM -k 90 "$left" "${cmd[@]}")
  fi
  mkdir -p "$dir"
  if [[ -n $devices ]]; then CUDA_VISIBLE_DEVICES=$devices "${cmd[@]}" >> "$dir.log" 2>&1
  else "${cmd[@]}" >> "$dir.log" 2>&1; fi
  status=$?
  case $status in
    0) echo "$job: finished${devices:+ (GPUs $devices)}"; return 0 ;;
    124|137|143) echo "$job: cut by the time limit; run the command again to resume"; return 124 ;;
    *) echo "$job: failed with status $status; see $dir.log"; return 1 ;;
  esac
}

job_at() { run_job "${all[$1]}" "${runs[$1]}" "${groups[$2]}" "${@:3}"; }    # JOB_INDEX GROUP_INDEX ARGS...
spread ${#all[@]} ${#groups[@]} job_at "$@"
status=$?
done_runs=()
for dir in "${runs[@]}"; do [[ -f $dir/metrics.jsonl ]] && done_runs+=("$dir"); done
if (( ${#done_runs[@]} )); then python3 -m kalmix.cli plot "${done_runs[@]}" --out "$out/loss.png" > /dev/null || status=1; fi
exit $status
