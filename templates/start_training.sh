#!/usr/bin/env bash
# start_training.sh: the process a dflashctl run's tmux pane runs. A CONSTANT script: every value arrives as
# an argument or in a file of the run directory, so nothing is ever spliced into shell text.
#
#   bash start_training.sh RUN_DIR -- COMMAND [ARGS...]
#
# RUN_DIR/launch.env0  NUL-separated KEY=VALUE entries: the command's WHOLE environment (env -i), written by
#                      the agent (mode 0600; values never appear on a command line or in `ps`).
# RUN_DIR/train.log    stdout+stderr of COMMAND and of this script, appended (also shown in the pane).
# RUN_DIR/log.mark     the run's mark (orchestrator/ownlines.py): each line of this script's own in train.log
#                      begins with `[dflashctl MARK] `, so readers never take it for the command's output.
# RUN_DIR/stop.json    written by `dflashctl stop` (and launch --replace) before its first signal: who and
#                      when; copied into exit.json as "stopped" (null when nobody stopped the run).
# RUN_DIR/pid          the process group id of COMMAND (what `dflashctl stop` signals).
# RUN_DIR/exit.json    {"exit_code", "signal", "started", "ended", "stopped", "root_cause"}, written when COMMAND
#                      ends, on failure too, by write-temp-then-rename (its appearance means the log is
#                      complete); root_cause: RUN_DIR/root_cause.json as the trainer's launcher wrote it
#                      when a rank failed, else null.
set -u
run_dir=$1
shift
[ "${1:-}" = "--" ] && shift

started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
mark=$(cat "$run_dir/log.mark" 2>/dev/null)
case $mark in ''|*[!0-9a-f]*) own="[dflashctl]" ;; *) own="[dflashctl $mark]" ;; esac
rc=
sig=null
child=
tee_pid=

write_exit() {
    # Called once, from the EXIT trap: even when bash itself is ended by a signal, the run gets its exit.json.
    local code=${rc:-}
    if [ -z "$code" ]; then code=1; fi
    if [ -n "$tee_pid" ]; then
        # Close our end of the log pipe so tee sees EOF; wait (bounded) so the log is complete before
        # exit.json appears (a follower stops reading when it does).
        exec 1>&- 2>&-
        for _ in $(seq 1 100); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done
    fi
    local ended tmp stopped=null cause=null
    ended=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    # stop.json and root_cause.json (trainer.launch, when a rank failed) are one JSON object each, written
    # whole (temp + rename); anything else is ignored.
    if [ -s "$run_dir/stop.json" ]; then
        stopped=$(tr -d '\n' < "$run_dir/stop.json")
        case $stopped in '{'*'}') ;; *) stopped=null ;; esac
    fi
    if [ -s "$run_dir/root_cause.json" ]; then
        cause=$(tr -d '\n' < "$run_dir/root_cause.json")
        case $cause in '{'*'}') ;; *) cause=null ;; esac
    fi
    tmp="$run_dir/.exit.json.$$"
    printf '{"exit_code": %d, "signal": %s, "started": "%s", "ended": "%s", "stopped": %s, "root_cause": %s}\n' \
        "$code" "$sig" "$started" "$ended" "$stopped" "$cause" > "$tmp" && mv -f "$tmp" "$run_dir/exit.json"
}
trap write_exit EXIT

envs=()
if [ -f "$run_dir/launch.env0" ]; then
    mapfile -d '' -t envs < "$run_dir/launch.env0"
fi
# The secret variables (launch.secret0, 0600): read, then deleted before anything runs, so none stays on disk.
if [ -f "$run_dir/launch.secret0" ]; then
    mapfile -d '' -t secrets < "$run_dir/launch.secret0"
    rm -f "$run_dir/launch.secret0"
    envs+=("${secrets[@]}")
fi

# All output, ours and the command's, goes through one tee: appended to train.log and shown in the pane.
# -i: a Ctrl-C typed into an attached pane must not kill the logger while the trainer shuts down cleanly.
exec > >(exec tee -ai "$run_dir/train.log") 2>&1
tee_pid=$!

# The command line itself is in train.log already: the agent wrote it there, quoted on one line.
echo "$own run $(basename "$run_dir") started $started"

# Job control on: the command gets its own process group (so a stop signals the trainer and its workers,
# never tee or this script), and it does not inherit the ignored SIGINT that non-interactive shells give
# background jobs (python would then never raise KeyboardInterrupt).
set -m
env -i "${envs[@]}" "$@" &
child=$!
set +m  # the group is made; no job-status chatter in the log
echo "$child" > "$run_dir/pid"

# A signal sent to this script (tmux kill, Ctrl-C in the pane) is passed on to the command's group; the
# script stays alive to record how the command ended.
forward() { kill -s "$1" -- "-$child" 2>/dev/null; }
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward HUP' HUP

while :; do
    wait "$child"
    rc=$?
    # wait returns early (status > 128) when a trapped signal arrives while the command still runs.
    kill -0 "$child" 2>/dev/null || break
done
# bash keeps the status of a reaped background job: this is the command's own status.
wait "$child" 2>/dev/null
last=$?
[ "$last" -ne 127 ] && rc=$last
if [ "$rc" -gt 128 ]; then
    name=$(kill -l "$((rc - 128))" 2>/dev/null) && sig="\"SIG$name\""
fi
echo "$own command ended: exit code $rc${name:+ (signal SIG$name)}"
exit "$rc"
