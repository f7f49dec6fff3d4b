#!/usr/bin/env bash
# Run paper recipes side by side, spread over GPUs, within a time limit; then render the report.
#
# usage: bash benchmarks/reproduce.sh OUT "JOB JOB ..." [extra `kalmix bench run` flags]
#   JOB = RECIPE[:MIXERS[:SEEDS]]: RECIPE a shipped recipe's name or a YAML file, MIXERS a comma list of its mixer
#         labels (empty: all), SEEDS a comma list replacing train.seeds; results in OUT/NAME[.MIXERS][.sSEEDS].jsonl,
#         one file per job (NAME: the recipe's file name without .yaml).
# environment:
#   GPUS     GPU ids to use (default: every GPU nvidia-smi lists; none: CPU)
#   PER_GPU  processes per GPU (default 2); job i runs on slot i mod (GPUS × PER_GPU), a slot's jobs one after another
#   LIMIT    seconds from the start after which every job gets SIGTERM (default 480; 0: no limit). A run cut there
#            saves its checkpoint and is not recorded; the same command run again resumes it.
# exit status: 0 when every job finished, 124 when the limit cut one (run the command again), 1 when a job failed.
# e.g.  GPUS="0 1 2 3" PER_GPU=3 bash benchmarks/reproduce.sh runs/bench \
#         "kaczmarz_mqar_extrapolation:kaczmarz kaczmarz_mqar_extrapolation:gdn vla_capacity:vla:42,123 kalman_mad::0,1"
set -uo pipefail
source "$(dirname "$0")/spread.sh"
out=${1:?output folder}; jobs=${2:?jobs}; shift 2
per_gpu=$(whole PER_GPU "${PER_GPU:-2}" 1) || exit 1
limit=$(whole LIMIT "${LIMIT:-480}" 0) || exit 1
out_folder "$out" || exit 1
if [[ -z ${GPUS+set} ]]; then
  GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')
fi
read -r -a gpus <<< "${GPUS:-}"
start=$(date +%s)
slots=()
if (( ${#gpus[@]} )); then
  for gpu in "${gpus[@]}"; do for ((k = 0; k < per_gpu; k++)); do slots+=("$gpu"); done; done
else
  for ((k = 0; k < per_gpu; k++)); do slots+=(""); done
fi

run_job() {  # JOB GPU: one `kalmix bench run`, under the time left; prints its status word
  local job=$1 gpu=$2 recipe mixers="" seeds="" name file left status
  shift 2
  IFS=: read -r recipe mixers seeds <<< "$job"
  name=$(basename "$recipe" .yaml)
  file="$out/$name${mixers:+.${mixers//,/-}}${seeds:+.s${seeds//,/-}}.jsonl"
  local cmd=(python3 -m kalmix.cli bench run "$recipe" --out "$file")
  [[ -n $mixers ]] && cmd+=(--mixers ${mixers//,/ })
  [[ -n $seeds ]] && cmd+=(--set "train.seeds=[$seeds]")
  cmd+=("$@")
  if (( limit > 0 )); then
    left=$(( start + limit - $(date +%s) ))
    if (( left < 30 )); then echo "$job: not started (time limit)"; return 124; fi
    cmd=(timeout -s TERM -k 60 "$left" "${cmd[@]}")
  fi
  CUDA_VISIBLE_DEVICES=$gpu "${cmd[@]}" >> "$file.log" 2>&1
  status=$?
  case $status in
    0) echo "$job: finished (GPU ${gpu:-none})"; return 0 ;;
    124|137) echo "$job: cut by the time limit (GPU ${gpu:-none}); run again to resume"; return 124 ;;
    *) echo "$job: failed with status $status (GPU ${gpu:-none}); see $file.log"; return $status ;;
  esac
}

read -r -a all <<< "$jobs"
job_at() { run_job "${all[$1]}" "${slots[$2]}" "${@:3}"; }    # JOB_INDEX SLOT_INDEX ARGS...
spread ${#all[@]} ${#slots[@]} job_at "$@"
status=$?
shopt -s nullglob
results=("$out"/*.jsonl)
if (( ${#results[@]} )); then
  python3 -m kalmix.cli bench report "${results[@]}" --out "$out/report" > /dev/null || status=1
fi
exit $status
