# Sourced by reproduce.sh and train_lm.sh: jobs spread over slots that run side by side, and a check of their
# numeric environment variables and output folder.

# whole NAME VALUE MIN: print VALUE as a decimal number; fail (status 1) with a message naming NAME and VALUE
#   unless VALUE is a whole number >= MIN. Use as `x=$(whole NAME "$value" MIN) || exit 1`.
whole() {
  if [[ ! $2 =~ ^[0-9]+$ ]] || (( 10#$2 < $3 )); then
    echo "$(basename "$0"): $1 = '$2' must be a whole number >= $3" >&2; return 1
  fi
  echo $(( 10#$2 ))
}

# out_folder PATH: make the output folder PATH; fail (status 1) with a message naming it when it is a file or
#   cannot be made (jobs would fail one by one, each pointing at a log under it that cannot exist).
#   Use as `out_folder "$out" || exit 1`.
out_folder() {
  if [[ -e $1 && ! -d $1 ]]; then
    echo "$(basename "$0"): OUT = '$1' is a file; give a folder for the runs" >&2; return 1
  fi
  mkdir -p -- "$1" || return 1
}

# spread N_JOBS N_SLOTS RUNNER [ARGS...]: slot s runs jobs s, s + N_SLOTS, ... one after another, each as
#   `RUNNER JOB_INDEX SLOT_INDEX ARGS...`, which returns 0 (finished), 124 (cut by the time limit) or another status
#   (failed). Returns 1 when a job failed, else 124 when one was cut, else 0. Its locals start with _spread_ (bash
#   scopes dynamically: RUNNER sees them), so they hide none of the caller's arrays.
spread() {
  local _spread_n=$1 _spread_slots=$2 _spread_runner=$3 _spread_s _spread_pid _spread_code _spread_status=0
  local _spread_pids=()
  shift 3
  for ((_spread_s = 0; _spread_s < _spread_slots; _spread_s++)); do
    (
      _spread_failed=0; _spread_cut=0
      for ((_spread_i = _spread_s; _spread_i < _spread_n; _spread_i += _spread_slots)); do
        "$_spread_runner" "$_spread_i" "$_spread_s" "$@"
        case $? in 0) ;; 124) _spread_cut=1 ;; *) _spread_failed=1 ;; esac
      done
      (( _spread_failed )) && exit 1
      (( _spread_cut )) && exit 124
      exit 0
    ) &
    _spread_pids+=($!)
  done
  for _spread_pid in "${_spread_pids[@]}"; do
    wait "$_spread_pid"; _spread_code=$?
    if (( _spread_code == 1 )); then _spread_status=1
    elif (( _spread_code == 124 && _spread_status == 0 )); then _spread_status=124; fi
  done
  return $_spread_status
}
