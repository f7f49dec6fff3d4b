#!/usr/bin/env bash
# Run paper recipes side by side on one machine: each JOB is RECIPE or RECIPE:MIXER,MIXER (a subset of its
# mixers), one process per job (small synthetic-task models leave a GPU mostly idle, so several share it), results
# in OUT/RECIPE[.MIXERS].jsonl (resumable: rerunning skips the runs already there), then the report in OUT/report.
# usage: bash benchmarks/reproduce.sh OUT "JOB JOB ..." [extra `kalmix bench run` flags]
# e.g.   bash benchmarks/reproduce.sh runs/bench "vla_capacity:vla vla_capacity:deltanet,attention kalman_mad"
set -uo pipefail
out=${1:?output folder}; jobs=${2:?jobs}; shift 2
mkdir -p "$out"
pids=()
for job in $jobs; do
  recipe=${job%%:*}; mixers=""
  [[ $job == *:* ]] && mixers=${job#*:}
  file="$out/$recipe${mixers:+.${mixers//,/-}}.jsonl"
  python3 -m kalmix.cli bench run "$recipe" --out "$file" ${mixers:+--mixers ${mixers//,/ }} "$@" \
      > "$out/${file##*/}.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
python3 -m kalmix.cli bench report "$out"/*.jsonl --out "$out/report" || status=1
exit $status
