# Sourced by examples/slurm/qwen3b.sbatch and node_task.sh. wait_through_traps PID: wait for a background job and
# return its exit status, through any number of trapped signals (bash's `wait` returns >128 as soon as a trap
# runs; the traps set interrupted=1 so that cut-short wait is told apart from the job's own status).
interrupted=0
wait_through_traps() {
  local status second
  while :; do
    interrupted=0
    wait "$1"
    status=$?
    if [ "$interrupted" = 0 ] || [ "$status" -le 128 ]; then
      return "$status"
    fi
    kill -0 "$1" 2>/dev/null && continue  # still running (or not yet reaped): wait again
    wait "$1"  # it ended as the trap ran: its status, or 127 when that wait already reported it
    second=$?
    [ "$second" = 127 ] && return "$status"
    return "$second"
  done
}
