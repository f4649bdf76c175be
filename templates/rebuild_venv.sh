# dflashctl rebuild-venv: build a locked, verified uv venv in the target and switch `current` to it.
# Run as ONE command: bash -c "$(cat rebuild_venv.sh)" rebuild-venv MODE WORKDIR LOCK_HASH BUNDLE_HASH
#   PYTHON KEEP FORCE OFFLINE UV_CACHE_DIR WHEEL WHEEL_SHA256 UV_BIN UV_VERSION UV_SHA256 TMUX
#   [uv pip sync options...]
# with a tar on stdin for MODE=build: lock.txt, the bundle wheel, wheels.sha256 (`sha256  file` lines: the
# wheels the workstation brings, in sha256sum's format), and, inline when the workstation does not know
# the target holds them, `uv` (its own uv binary) and wheels/<file>. Every value arrives as an argument;
# nothing is spliced into this text. Needs bash and coreutils; no python3 and no uv beforehand:
# - uv: UV_BIN when given (a local target: the workstation's own), else <workdir>/bin/uv installed from
#   the payload (sha256-checked), else a uv on PATH of exactly UV_VERSION; none of them: a NeedFiles error
#   that makes the workstation send it (still one command per attempt).
# - wheels: kept beside the uv cache in dflashctl-wheels/ (a stable path: uv caches a local wheel by its
#   path), each recorded with its sha256 once checked; one that is missing or differs: NeedFiles.
# - Python: a system python matching PYTHON (the container's python3), else uv's managed Python (a
#   download; not with --offline), else one error naming both versions.
# - TMUX=1 (containers): tmux is installed with apt-get when missing (root only); a failure is a warning whose
#   data names the release and dpkg's installed packages (the workstation then brings Debian's packages).
# Output: JSON event lines on stdout (progress, log, warning, need, result | error), the agent protocol's
# shape. Any failing step removes the half-built venv and leaves `current` as it was.
set -u
set -o pipefail
mode=$1 workdir=$2 lock_hash=$3 bundle_hash=$4 py_req=$5 keep=$6 force=$7 offline=$8 cache=$9
wheel=${10} wheel_sha=${11} uv_bin=${12} uv_want=${13} uv_sha=${14} want_tmux=${15}
shift 15
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

# warning TYPE MESSAGE [DATA]: DATA a JSON object (the event's `data`).
warning() {
    local msg data=${3:-}; jstr "$2"; msg=$REPLY; [ -n "$data" ] || data="{}"
    printf '{"event":"warning","type":"%s","message":%s,"data":%s}\n' "$1" "$msg" "$data"
}
sha_of() { local h; h=$(sha256sum <"$1" 2>/dev/null) || return 1; REPLY=${h%% *}; }
# tmux: every run lives in a tmux session; Debian's container template has none. Installed as root with
# apt-get (an update only when the package lists lack it); otherwise a warning names what is missing.
ensure_tmux() {
    tmux_state=present
    command -v tmux >/dev/null 2>&1 && return 0
    local why
    if [ "$(id -u)" != 0 ]; then why="not root"
    elif ! command -v apt-get >/dev/null 2>&1; then why="no apt-get"
    else
        export DEBIAN_FRONTEND=noninteractive
        progress tmux "tmux is not installed: apt-get install -y tmux"
        if ! apt-get install -y -q --no-install-recommends tmux 2>&1 | stream apt && [ "$offline" != 1 ]; then
            progress tmux "apt-get update (the package lists lack tmux)"
            apt-get update -q 2>&1 | stream apt && apt-get install -y -q --no-install-recommends tmux 2>&1 | stream apt
        fi
        tmux_state=installed
        command -v tmux >/dev/null 2>&1 && { lap tmux; return 0; }
        why="apt-get install tmux failed"
        [ "$offline" = 1 ] && why+=" (--offline: no apt-get update)"
    fi
    tmux_state=missing
    tmux_release
    warning TmuxMissing "tmux is not installed in the target ($why); launch needs it" "$REPLY"
}
# The release and what dpkg has installed, as a JSON object in REPLY: the workstation brings Debian's tmux
# packages for exactly this release (orchestrator/ops/debs.py). `{}` without dpkg.
tmux_release() {
    local os="" code="" arch="" names="" p
    REPLY="{}"
    command -v dpkg >/dev/null 2>&1 || return 0
    if [ -r /etc/os-release ]; then
        os=$(. /etc/os-release && printf '%s' "${ID:-}") code=$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")
    fi
    arch=$(dpkg --print-architecture 2>/dev/null)
    for p in $(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' 2>/dev/null | sed -n 's/^ii *//p'); do
        jstr "$p"; names+="${names:+,}$REPLY"
    done
    jstr "$os"; os=$REPLY; jstr "$code"; code=$REPLY; jstr "$arch"; arch=$REPLY
    REPLY="{\"os\":$os,\"codename\":$code,\"arch\":$arch,\"installed\":[$names]}"
}

mkdir -p -- "$venvs" 2>/dev/null || { steplog=""; step=workdir; fail WorkdirError "cannot create $venvs" "check the target's workdir and its permissions"; }
cd -- "$workdir" || fail WorkdirError "cannot enter $workdir" "check the target's workdir"
workdir=$PWD venvs="$PWD/venvs" cur="$PWD/venvs/current"
tmux_state=unchecked
if [ "$mode" = build ] && [ "$want_tmux" = 1 ]; then step=tmux; ensure_tmux; fi
# MODE=tmux: only tmux (a `kind: system` profile: no venv to build, but runs still live in tmux).
if [ "$mode" = tmux ]; then step=tmux; ensure_tmux; lap tmux; result "\"action\":\"system\",\"tmux\":\"$tmux_state\""; fi

# --- no-op fast path: current already built from this lock and this bundle (one stat, one read) --------
if [ "$mode" = build ] && [ "$force" != 1 ] && [ -x "$cur/bin/python" ] && [ -f "$cur/$STAMP" ]; then
    read -r s_lock s_bundle s_py <"$cur/$STAMP"
    if [ "$s_lock" = "$lock_hash" ] && [ "$s_bundle" = "$bundle_hash" ] && [ "$s_py" = "$py_req" ]; then
        cat >/dev/null  # the payload is not needed
        link_target current; now=$REPLY; fp_json "$now"; fp=$REPLY; lap noop
        jstr "$now"; result "\"action\":\"noop\",\"venv\":$REPLY,\"lock_hash\":\"$lock_hash\",\"bundle_hash\":\"$bundle_hash\",\"tmux\":\"$tmux_state\",\"fingerprint\":$fp"
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

# --- stage: the payload from stdin ----------------------------------------------------------------------
step=stage
steplog=$(mktemp "$venvs/.rebuild.XXXXXX.log") || fail WorkdirError "cannot write in $venvs" "check its permissions"
stage=$(mktemp -d "$venvs/.stage.XXXXXX") || fail WorkdirError "cannot write in $venvs" "check its permissions"
tar -xf - -C "$stage" 2>>"$steplog" || fail PayloadError "could not unpack the lock and bundle sent on stdin" "run it again; check free disk space in $workdir"
[ -f "$stage/lock.txt" ] && [ -f "$stage/$wheel" ] || fail PayloadError "the payload lacks lock.txt or $wheel" "run it again"
# The bundle joins the lock in ONE exact sync (hash-pinned like every other line).
{ cat "$stage/lock.txt"; printf '\n%s --hash=sha256:%s\n' "$stage/$wheel" "$wheel_sha"; } >"$stage/requirements.txt"
lap stage

# --- uv: the workstation's own binary (given, sent inline, installed before, or the same version) ------
step=uv
UV=() uv_pushed=false need_uv=false
if [ "$uv_bin" != - ]; then
    UV=("$uv_bin")
elif [ -f "$stage/uv" ]; then
    sha_of "$stage/uv"; [ "$REPLY" = "$uv_sha" ] || fail PayloadError "the uv binary sent has sha256 $REPLY, not $uv_sha" "run it again"
    mkdir -p -- "$workdir/bin" && chmod 755 "$stage/uv" && mv -f -- "$stage/uv" "$workdir/bin/uv" \
        && printf '%s %s\n' "$uv_sha" "$(stat -c %s "$workdir/bin/uv")" >"$workdir/bin/.uv.sha256" \
        || fail WorkdirError "cannot install uv into $workdir/bin" "check free disk space and permissions in $workdir"
    UV=("$workdir/bin/uv") uv_pushed=true
elif [ -x "$workdir/bin/uv" ] && read -r r_sha r_size <"$workdir/bin/.uv.sha256" 2>/dev/null \
    && [ "$r_sha" = "$uv_sha" ] && [ "$r_size" = "$(stat -c %s "$workdir/bin/uv")" ]; then
    UV=("$workdir/bin/uv")  # checked when it was installed (the record holds its sha256 and size)
else
    for c in "$(command -v uv 2>/dev/null)" "$HOME/.local/bin/uv"; do
        [ -n "$c" ] && [ -x "$c" ] || continue
        read -r _ v _ < <("$c" --version 2>/dev/null)
        if [ "$v" = "$uv_want" ]; then UV=("$c"); break; fi
    done
    [ ${#UV[@]} -gt 0 ] || need_uv=true
fi
# The cache lives on the venvs' file system, so installs are hardlinks, not copies.
[ -n "$cache" ] || cache="$workdir/uv-cache"
mkdir -p -- "$cache" || fail WorkdirError "cannot create the uv cache $cache" "fix the venv profile's uv_cache_dir"
export UV_CACHE_DIR="$cache"
# Trust the container's CA store (as curl and pip do): a proxy's CA is installed there, not in uv's own roots.
export UV_NATIVE_TLS="${UV_NATIVE_TLS:-1}"
# uv's managed Pythons (when the target's own does not match) stay in the workdir.
export UV_PYTHON_INSTALL_DIR="$workdir/python"
# OFFLINE=1 (--offline) or 2 (the wheelhouse holds the whole lock: no index needed; apt-get may still update).
[ "$offline" != 0 ] && export UV_OFFLINE=1

# --- wheels the workstation brings: beside the uv cache, at a stable path --------------------------------
step=wheels
need_wheels=""
if [ -s "$stage/wheels.sha256" ]; then
    store="${cache%/}"; store="${store%/*}/dflashctl-wheels"
    mkdir -p -- "$store/.sha256" || fail WorkdirError "cannot create $store" "check the uv cache's parent directory"
    while read -r sha file; do
        [ -n "$file" ] || continue
        case $file in */* | .*) fail PayloadError "bad wheel file name $file in the payload" "run it again" ;; esac
        have=""; [ -f "$store/$file" ] && read -r have <"$store/.sha256/$file" 2>/dev/null
        if [ "$have" = "$sha" ]; then
            rm -f -- "$stage/wheels/$file"  # kept as it is: a rewritten file would make uv unpack it again
        elif [ -f "$stage/wheels/$file" ]; then
            sha_of "$stage/wheels/$file"; [ "$REPLY" = "$sha" ] || fail PayloadError "wheel $file arrived with sha256 $REPLY, not $sha" "run it again"
            mv -f -- "$stage/wheels/$file" "$store/$file" && printf '%s\n' "$sha" >"$store/.sha256/$file" \
                || fail WorkdirError "cannot write $store/$file" "check free disk space"
        else
            jstr "$file"; need_wheels+="${need_wheels:+,}$REPLY"
        fi
    done <"$stage/wheels.sha256"
    sync_opts+=(--find-links "$store")
fi
if [ "$need_uv" = true ] || [ -n "$need_wheels" ]; then
    # The workstation answers this by sending exactly these, inline, in one more command.
    printf '{"event":"need","uv":%s,"wheels":[%s]}\n' "$need_uv" "$need_wheels"
    fail NeedFiles "the target lacks files the workstation believed it held (uv: $need_uv, wheels: [$need_wheels])" "run it again"
fi
step=uv
uv_version=$("${UV[@]}" --version 2>>"$steplog" | head -n 1)
# The workstation's binary runs only on its own OS and architecture (a Mac's uv cannot run in a container).
[ -n "$uv_version" ] || fail UvUnusable "uv ${UV[0]} does not run on this $(uname -s) $(uname -m) machine" \
    "run dflashctl from a workstation of the target's OS and architecture, or install uv $uv_want in the target (a uv of that version on PATH is used as is)"
if [ "$uv_pushed" = true ]; then progress uv "$uv_version (the workstation's, installed as $workdir/bin/uv), cache $cache"
else progress uv "$uv_version at ${UV[0]}, cache $cache"; fi
lap uv

# --- a new venv: the target's own Python if it matches, else uv's managed one ---------------------------
step=venv
usec; ms=$(((REPLY / 1000) % 1000)); ms=00$ms
name="$lock_hash-$(date -u +%Y%m%dT%H%M%S).${ms: -3}Z"
new="$venvs/$name"
[ -e "$new" ] && { name="$name-$$"; new="$venvs/$name"; }
pref=(--python-preference only-system)
if ! "${UV[@]}" python find --python-preference only-system --no-python-downloads "$py_req" >/dev/null 2>>"$steplog"; then
    own=$(python3 --version 2>/dev/null); own=${own#Python }; own=${own:-none}
    pref=(--python-preference only-managed)
    if "${UV[@]}" python find --python-preference only-managed --no-python-downloads "$py_req" >/dev/null 2>&1; then
        progress venv "python3 here is $own, the profile asks for $py_req: using uv's Python $py_req in $UV_PYTHON_INSTALL_DIR"
    elif [ "$offline" = 1 ]; then
        fail PythonMismatch "the venv profile asks for Python $py_req, but this target's python3 is $own and --offline forbids downloading Python $py_req" \
            "set the venv profile's python to \"${own%.*}\" (what the target has), or run once without --offline so uv downloads Python $py_req into $UV_PYTHON_INSTALL_DIR"
    else
        progress venv "python3 here is $own, the profile asks for $py_req: uv python install $py_req"
        : >"$steplog"
        "${UV[@]}" python install "$py_req" 2>&1 | stream uv || fail PythonMismatch \
            "the venv profile asks for Python $py_req, but this target's python3 is $own and uv could not download Python $py_req" \
            "set the venv profile's python to \"${own%.*}\" (what the target has), or let the target reach uv's Python downloads once"
    fi
fi
progress venv "creating $new (python $py_req)"
"${UV[@]}" venv --no-project "${pref[@]}" --no-python-downloads --python "$py_req" "$new" 2>&1 | stream uv \
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

# --- verify: import what is new, check the bundle's imports, write the fingerprint ----------------------
step=verify
: >"$steplog"
progress verify "importing the top-level modules of the lock and the bundle (wheels verified before are skipped)"
PYTHONUNBUFFERED=1 "$new/bin/python" -I -m orchestrator.agent.venvinfo verify --venv "$new" --lock-hash "$lock_hash" \
    --bundle-hash "$bundle_hash" --python-request "$py_req" --freeze "$new/.uv-freeze.txt" --uv-version "$uv_version" \
    --record "$venvs/.verified-wheels.json" 2>>"$steplog"
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
result "\"action\":\"built\",\"venv\":$n_,\"path\":$p_,\"previous\":$o_,\"lock_hash\":\"$lock_hash\",\"bundle_hash\":\"$bundle_hash\",\"uv\":$u_,\"uv_pushed\":$uv_pushed,\"tmux\":\"$tmux_state\",\"pruned\":[$pruned],\"total_ms\":$total"
