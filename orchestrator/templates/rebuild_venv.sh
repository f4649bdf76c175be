# dflashctl rebuild-venv: build a locked, verified uv venv in the target and switch `current` to it.
# Run as ONE command: bash -c "$(cat rebuild_venv.sh)" rebuild-venv MODE WORKDIR LOCK_HASH BUNDLE_HASH
#   PYTHON KEEP FORCE OFFLINE UV_CACHE_DIR WHEEL WHEEL_SHA256 [uv pip sync options...]
# with a tar on stdin (lock.txt + the bundle wheel) for MODE=build. Every value arrives as an argument;
# nothing is spliced into this text. Needs bash, python3 and uv only (no venv exists yet); uv is found on
# PATH, as `python3 -m uv`, or installed with `python3 -m pip install --user uv`.
# Output: JSON event lines on stdout (progress, log, result | error), the agent protocol's shape.
# Any failing step removes the half-built venv and leaves `current` as it was.
set -u
set -o pipefail
mode=$1 workdir=$2 lock_hash=$3 bundle_hash=$4 py_req=$5 keep=$6 force=$7 offline=$8 cache=$9
wheel=${10} wheel_sha=${11}
shift 11
sync_opts=("$@")
STAMP=dflashctl-stamp
venvs="$workdir/venvs"
cur="$venvs/current"
new="" name="" stage="" steplog="" built=0 step=start
# pct exec --keep-env 0 and sshd leave HOME/PATH to us (the caller sets them); never inherit a venv.
export HOME="${HOME:-/root}" NO_COLOR=1
unset VIRTUAL_ENV PYTHONPATH PYTHONHOME CONDA_PREFIX

usec() { local t=${EPOCHREALTIME:-}; if [ -n "$t" ]; then REPLY=${t/./}; else REPLY=$(($(date +%s) * 1000000)); fi; }
usec; t_start=$REPLY t_step=$REPLY
timings=""
lap() { usec; timings+="${timings:+,}\"$1\":$(((REPLY - t_step) / 1000))"; t_step=$REPLY; }

# JSON string of $1 in REPLY (no subshell: uv's lines pass through here one by one).
jstr() {
    local s=$1
    s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/ }; s=${s//$'\r'/}; s=${s//$'\n'/\\n}; s=${s//[[:cntrl:]]/}
    REPLY="\"$s\""
}
progress() {
    local st msg; jstr "$1"; st=$REPLY; jstr "$2"; msg=$REPLY
    printf '{"event":"progress","step":%s,"message":%s}\n' "$st" "$msg"
}
# Copy a command's output lines to the step log and to stdout as log events.
stream() {
    local src=$1 line
    while IFS= read -r line || [ -n "$line" ]; do
        [ -n "$steplog" ] && printf '%s\n' "$line" >>"$steplog"
        jstr "$line"; printf '{"event":"log","source":"%s","line":%s}\n' "$src" "$REPLY"
    done
}
tail_json() {
    local out="" line
    if [ -n "$steplog" ] && [ -f "$steplog" ]; then
        while IFS= read -r line; do jstr "$line"; out+="${out:+,}$REPLY"; done < <(tail -n 25 "$steplog")
    fi
    REPLY="[$out]"
}
# fail TYPE MESSAGE FIX: the error event (with the failing step and its last output lines), then exit.
fail() {
    local msg fix st tl; jstr "$2"; msg=$REPLY; jstr "$3"; fix=$REPLY; jstr "$step"; st=$REPLY; tail_json; tl=$REPLY
    printf '{"event":"error","type":"%s","step":%s,"message":%s,"fix":%s,"data":{"step":%s,"tail":%s}}\n' \
        "$1" "$st" "$msg" "$fix" "$st" "$tl"
    exit 1
}
cleanup() {
    if [ "$built" != 1 ] && [ -n "$new" ] && [ -d "$new" ]; then rm -rf -- "$new"; fi
    [ -n "$stage" ] && rm -rf -- "$stage"
    [ -n "$steplog" ] && rm -f -- "$steplog"
    rm -f -- "$venvs/.current.tmp.$$" "$venvs/.previous.tmp.$$"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# Switch link $1 (current|previous) to $2 atomically: a new symlink renamed over the old one.
relink() { ln -sfn -- "$2" "$venvs/.$1.tmp.$$" && mv -fT -- "$venvs/.$1.tmp.$$" "$venvs/$1"; }
link_target() { if [ -L "$venvs/$1" ]; then REPLY=$(readlink -- "$venvs/$1"); else REPLY=""; fi; }
stamp_of() { local a="" b="" c=""; [ -f "$venvs/$1/$STAMP" ] && read -r a b c <"$venvs/$1/$STAMP"; REPLY="$a $b $c"; }
# The fingerprint file is one line of JSON written by venvinfo: embedded as is ("null" when unreadable).
fp_json() {
    local f="$venvs/$1/dflashctl-fingerprint.json" t=""
    [ -f "$f" ] && IFS= read -r t <"$f"
    case $t in "{"*"}") REPLY=$t ;; *) REPLY=null ;; esac
}
result() { printf '{"event":"result","data":{%s,"timings":{%s}}}\n' "$1" "$timings"; exit 0; }

mkdir -p -- "$venvs" 2>/dev/null || { steplog=""; step=workdir; fail WorkdirError "cannot create $venvs" "check the target's workdir and its permissions"; }
cd -- "$workdir" || fail WorkdirError "cannot enter $workdir" "check the target's workdir"
workdir=$PWD venvs="$PWD/venvs" cur="$PWD/venvs/current"

# --- no-op fast path: current already built from this lock and this bundle (one stat, one read) --------
if [ "$mode" = build ] && [ "$force" != 1 ] && [ -x "$cur/bin/python" ] && [ -f "$cur/$STAMP" ]; then
    read -r s_lock s_bundle s_py <"$cur/$STAMP"
    if [ "$s_lock" = "$lock_hash" ] && [ "$s_bundle" = "$bundle_hash" ] && [ "$s_py" = "$py_req" ]; then
        cat >/dev/null  # the payload is not needed
        link_target current; now=$REPLY; fp_json "$now"; fp=$REPLY; lap noop
        jstr "$now"; result "\"action\":\"noop\",\"venv\":$REPLY,\"lock_hash\":\"$lock_hash\",\"bundle_hash\":\"$bundle_hash\",\"fingerprint\":$fp"
    fi
fi

# --- one rebuild at a time per workdir ------------------------------------------------------------------
step=lock
exec 9>"$venvs/.lock"
if command -v flock >/dev/null 2>&1; then
    flock -n 9 || fail LockHeld "another rebuild-venv is running in $workdir" "wait for it to finish, then run it again"
fi

# --- rollback: swap current and previous ----------------------------------------------------------------
if [ "$mode" = rollback ]; then
    step=rollback
    link_target previous; prev=$REPLY
    link_target current; now=$REPLY
    if [ -z "$prev" ] || [ ! -f "$venvs/$prev/$STAMP" ]; then
        fail NoPrevious "no previous venv to roll back to in $venvs" "build one first: dflashctl rebuild-venv"
    fi
    relink current "$prev" || fail SwitchFailed "cannot switch $cur to $prev" "check $venvs"
    [ -n "$now" ] && relink previous "$now"
    stamp_of "$prev"; read -r p_lock p_bundle _ <<<"$REPLY"
    lap rollback
    fp_json "$prev"; fp=$REPLY; jstr "$prev"; p=$REPLY; jstr "$now"
    result "\"action\":\"rollback\",\"venv\":$p,\"previous\":$REPLY,\"lock_hash\":\"$p_lock\",\"bundle_hash\":\"$p_bundle\",\"fingerprint\":$fp"
fi

# --- uv --------------------------------------------------------------------------------------------------
step=uv
steplog=$(mktemp "$venvs/.rebuild.XXXXXX.log") || fail WorkdirError "cannot write in $venvs" "check its permissions"
uv_installed=false
find_uv() {
    if command -v uv >/dev/null 2>&1; then UV=(uv); return 0; fi
    if [ -x "$HOME/.local/bin/uv" ]; then UV=("$HOME/.local/bin/uv"); return 0; fi
    if command -v python3 >/dev/null 2>&1 && python3 -m uv --version >/dev/null 2>&1; then UV=(python3 -m uv); return 0; fi
    return 1
}
if ! find_uv; then
    command -v python3 >/dev/null 2>&1 || fail PythonMissing "no python3 on PATH ($PATH) in $workdir's machine" "install python3 (apt-get install -y python3)"
    [ "$offline" = 1 ] && fail UvMissing "uv is not installed and --offline forbids installing it" "install uv first (python3 -m pip install --user uv), or run without --offline"
    progress uv "uv not found: installing it with python3 -m pip install --user uv"
    python3 -m pip install --user --disable-pip-version-check --no-input uv 2>&1 | stream pip
    find_uv || fail UvMissing "uv is not installed and python3 -m pip install --user uv did not install it" \
        "install uv in the target: python3 -m pip install --user uv (add --break-system-packages on Debian/Ubuntu), pipx install uv, or copy the static uv binary from https://github.com/astral-sh/uv/releases into /usr/local/bin"
    uv_installed=true
fi
uv_version=$("${UV[@]}" --version 2>/dev/null | head -n 1)
# The cache lives on the venvs' file system, so installs are hardlinks, not copies.
[ -n "$cache" ] || cache="$workdir/uv-cache"
mkdir -p -- "$cache" || fail WorkdirError "cannot create the uv cache $cache" "fix the venv profile's uv_cache_dir"
export UV_CACHE_DIR="$cache"
# Trust the container's CA store (as curl and pip do): a proxy's CA is installed there, not in uv's own roots.
export UV_NATIVE_TLS="${UV_NATIVE_TLS:-1}"
[ "$offline" = 1 ] && export UV_OFFLINE=1
progress uv "$uv_version, cache $cache"
lap uv

# --- stage: the lock and the bundle wheel from stdin ----------------------------------------------------
step=stage
stage=$(mktemp -d "$venvs/.stage.XXXXXX") || fail WorkdirError "cannot write in $venvs" "check its permissions"
tar -xf - -C "$stage" 2>>"$steplog" || fail PayloadError "could not unpack the lock and bundle sent on stdin" "run it again; check free disk space in $workdir"
[ -f "$stage/lock.txt" ] && [ -f "$stage/$wheel" ] || fail PayloadError "the payload lacks lock.txt or $wheel" "run it again"
# The bundle joins the lock in ONE exact sync (hash-pinned like every other line).
{ cat "$stage/lock.txt"; printf '\n%s --hash=sha256:%s\n' "$stage/$wheel" "$wheel_sha"; } >"$stage/requirements.txt"

# --- a new venv ------------------------------------------------------------------------------------------
step=venv
usec; ms=$(((REPLY / 1000) % 1000)); ms=00$ms
name="$lock_hash-$(date -u +%Y%m%dT%H%M%S).${ms: -3}Z"
new="$venvs/$name"
[ -e "$new" ] && { name="$name-$$"; new="$venvs/$name"; }
progress venv "creating $new (python $py_req)"
"${UV[@]}" venv --no-project --python "$py_req" "$new" 2>&1 | stream uv \
    || fail VenvFailed "uv venv could not create a python $py_req venv in $new" "install python $py_req in the target, or set the venv profile's python to one it has"
lap venv

# --- driver: this machine's NVIDIA driver must run the venv's torch (orchestrator/agent/driver.py): from
# the lock before the sync downloads it, from the fingerprint (torch.version.cuda) before the switch. The
# new venv's python runs the check with the bundle first on sys.path (-I: nothing else of the environment).
driver_check() {
    step=driver
    PYTHONUNBUFFERED=1 "$new/bin/python" -I -c 'import sys; sys.path.insert(0, sys.argv[1])
from orchestrator.agent.driver import main; sys.exit(main(sys.argv[2:]))' "$stage/$wheel" check "$@" 2>>"$steplog"
    local rc=$?
    [ "$rc" = 3 ] && exit 1  # the check reported both versions and the fix
    [ "$rc" = 0 ] || fail DriverCheckCrashed "the NVIDIA driver check died with exit code $rc" "see the output below"
    lap "driver_${1#--}"
}
driver_check --lock "$stage/lock.txt"

# --- sync the lock + bundle ------------------------------------------------------------------------------
step=sync
: >"$steplog"
progress sync "uv pip sync of the lock ($lock_hash) and bundle $bundle_hash"
"${UV[@]}" pip sync --python "$new/bin/python" "${sync_opts[@]}" "$stage/requirements.txt" 2>&1 | stream uv \
    || fail SyncFailed "uv pip sync of lock $lock_hash failed" "read uv's message above"
"${UV[@]}" pip freeze --python "$new/bin/python" >"$new/.uv-freeze.txt" 2>>"$steplog" || : >"$new/.uv-freeze.txt"
lap sync

# --- verify: import everything, check the bundle's imports, write the fingerprint ---------------------
step=verify
: >"$steplog"
progress verify "importing every top-level module of the lock and the bundle"
PYTHONUNBUFFERED=1 "$new/bin/python" -I -m orchestrator.agent.venvinfo verify --venv "$new" --lock-hash "$lock_hash" \
    --bundle-hash "$bundle_hash" --python-request "$py_req" --freeze "$new/.uv-freeze.txt" --uv-version "$uv_version" \
    2>>"$steplog"
rc=$?
[ "$rc" = 3 ] && exit 1  # the verifier already reported which module failed
[ "$rc" = 0 ] || fail VerifyCrashed "the verify step died with exit code $rc" "see the last module it imported (above) and the output below"
printf '%s %s %s\n' "$lock_hash" "$bundle_hash" "$py_req" >"$new/.stamp.tmp" && mv -f "$new/.stamp.tmp" "$new/$STAMP" \
    || fail WorkdirError "cannot write $new/$STAMP" "check free disk space"
lap verify
driver_check --fingerprint "$new/dflashctl-fingerprint.json"

# --- switch current (previous keeps the old one for --rollback) ----------------------------------------
step=switch
link_target current; old=$REPLY
if [ -n "$old" ] && [ "$old" != "$name" ] && [ -d "$venvs/$old" ]; then
    relink previous "$old" || fail SwitchFailed "cannot update $venvs/previous" "check $venvs"
fi
relink current "$name" || fail SwitchFailed "cannot switch $cur to $name (is it a directory, not a link?)" "move $cur away"
built=1
lap switch

# --- prune: keep the newest $keep complete venvs; never current or previous; drop leftovers -----------
step=prune
link_target previous; prev=$REPLY
pruned=""
n=0
while read -r _ d; do
    [ -n "$d" ] || continue
    if [ "$d" = "$name" ] || [ "$d" = "$prev" ]; then n=$((n + 1)); continue; fi
    if [ -f "$venvs/$d/$STAMP" ] && [ "$n" -lt "$keep" ]; then n=$((n + 1)); continue; fi
    # Renamed now (the name is free at once), deleted below in the background.
    mv -f -- "${venvs:?}/$d" "$venvs/.trash.$d" && { jstr "$d"; pruned+="${pruned:+,}$REPLY"; }
done < <(for p in "$venvs"/*-*; do
    b=${p##*/}
    [ -d "$p" ] && [ ! -L "$p" ] && printf '%s %s\n' "${b#*-}" "$b"
done | sort -r)
for p in "$venvs"/.stage.* "$venvs"/.rebuild.*.log; do
    [ -e "$p" ] && [ "$p" != "$stage" ] && [ "$p" != "$steplog" ] && rm -rf -- "$p"
done
rm -f -- "$steplog"; steplog=""
# Deleting a torch venv is tens of thousands of unlinks (seconds on a busy disk): housekeeping that need
# not hold up the result. Detached, without our lock fd (9) or the output pipes; a leftover .trash.* is
# picked up by the next rebuild.
if compgen -G "$venvs/.trash.*" >/dev/null; then
    (trap - EXIT; exec setsid rm -rf -- "$venvs"/.trash.*) </dev/null >/dev/null 2>&1 9>&- &
fi
lap prune

usec; total=$(((REPLY - t_start) / 1000))
jstr "$name"; n_=$REPLY; jstr "$old"; o_=$REPLY; jstr "$new"; p_=$REPLY; jstr "$uv_version"; u_=$REPLY
result "\"action\":\"built\",\"venv\":$n_,\"path\":$p_,\"previous\":$o_,\"lock_hash\":\"$lock_hash\",\"bundle_hash\":\"$bundle_hash\",\"uv\":$u_,\"uv_installed\":$uv_installed,\"pruned\":[$pruned],\"total_ms\":$total"
