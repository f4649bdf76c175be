# dflashctl: install Debian packages the workstation brought (tmux and its libraries for a container that has
# no tmux and no reachable mirror). Run as ONE command: bash -c "$(cat install_debs.sh)" install-debs CHECK
# with a tar on stdin: `debs.sha256` (`sha256  file` lines, sha256sum's format: the SHA256 of each file in
# the release's Packages index) and the .deb files it names. Every file is checked before dpkg sees any;
# then `dpkg -i` installs them all at once (dpkg orders them by their dependencies), and CHECK (a command
# name, e.g. tmux) must then be on PATH. Needs root, tar, coreutils and dpkg; writes only a temporary
# directory, removed on exit. Output: dpkg's lines; the last line `installed: <CHECK -V>` or an error line
# `error: ...` (exit 1).
set -u
check=$1
[ "$(id -u)" = 0 ] || { echo "error: not root: dpkg -i needs root in the target"; exit 1; }
command -v dpkg >/dev/null 2>&1 || { echo "error: no dpkg in the target (not a Debian-based system)"; exit 1; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/dflashctl-debs.XXXXXX") || { echo "error: cannot make a temporary directory"; exit 1; }
trap 'rm -rf -- "$dir"' EXIT
trap 'exit 130' INT TERM HUP
tar -x -C "$dir" -f - || { echo "error: the package tar did not arrive whole"; exit 1; }
cd -- "$dir" || exit 1
[ -s debs.sha256 ] || { echo "error: no debs.sha256 in the package tar"; exit 1; }
if ! out=$(sha256sum --check --strict debs.sha256 2>&1); then
    printf '%s\n' "$out" | grep -v ': OK$'
    echo "error: a package differs from its SHA256 in the Packages index; nothing was installed"
    exit 1
fi
files=()
while read -r _sum file; do files+=("./$file"); done <debs.sha256
export DEBIAN_FRONTEND=noninteractive
if ! dpkg -i -- "${files[@]}" 2>&1; then
    echo "error: dpkg -i failed (its lines above say why)"
    exit 1
fi
command -v "$check" >/dev/null 2>&1 || { echo "error: $check is still not on PATH after dpkg -i"; exit 1; }
version=$("$check" -V 2>/dev/null | head -n 1)
echo "installed: ${version:-$check}"
