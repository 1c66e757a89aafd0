#!/bin/sh
# Install simpler-daemon under systemd (run from the repository, as root):
#
#   sudo deploy/install.sh [--venv DIR] [--root DIR] [--no-start]
#
#   --venv DIR   use this existing environment (DIR/bin holds the programs) instead of
#                creating /opt/simpler-daemon and pip-installing the repository into it
#   --root DIR   install below DIR (a staging tree for a package); implies --no-start
#   --no-start   copy files only: no systemd-sysusers, systemd-tmpfiles or systemctl
#
# What it does: the programs (simpler-daemon, simplerctl, simpler-remote-worker,
# simpler-remote-l3-session) linked into /usr/local/bin, so they are on PATH; the unit,
# sysusers.d and tmpfiles.d files; /etc/simpler-daemon/daemon.toml from
# deploy/config/daemon.toml unless one exists (an operator's config is never
# overwritten); the network-online.target drop-in when that config listens on TCP or
# opens remote workers; then the user, the directories and `systemctl enable --now`.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
venv=""
root=""
start=1
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv=$2; shift 2 ;;
        --root) root=$2; start=0; shift 2 ;;
        --no-start) start=0; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ -z "$venv" ]; then
    venv=/opt/simpler-daemon
    python=$(command -v python3.11 || command -v python3)
    "$python" -m venv "$root$venv"
    "$root$venv/bin/pip" install --quiet "$repo"
    venv_bin="$root$venv/bin"
    link_to="$venv/bin"  # the links point at the installed path, not the staging tree
else
    venv=$(cd "$venv" && pwd)
    venv_bin="$venv/bin"
    link_to="$venv_bin"
fi

install -d "$root/usr/local/bin"
for program in simpler-daemon simplerctl simpler-remote-worker simpler-remote-l3-session; do
    [ -x "$venv_bin/$program" ] || { echo "install.sh: $venv_bin/$program is missing" >&2; exit 1; }
    ln -sfn "$link_to/$program" "$root/usr/local/bin/$program"
done

install -D -m 0644 "$here/systemd/simpler-daemon.service" "$root/etc/systemd/system/simpler-daemon.service"
install -D -m 0644 "$here/sysusers.d/simpler-daemon.conf" "$root/usr/lib/sysusers.d/simpler-daemon.conf"
install -D -m 0644 "$here/tmpfiles.d/simpler-daemon.conf" "$root/usr/lib/tmpfiles.d/simpler-daemon.conf"
config="$root/etc/simpler-daemon/daemon.toml"
if [ ! -e "$config" ]; then
    install -D -m 0644 "$here/config/daemon.toml" "$config"
fi

# Only a daemon that needs the network at start waits for it (see the drop-in).
needs_network=$("$venv_bin/python" - "$config" <<'PY'
import sys
from simpler_daemon.server.config import load
config = load(sys.argv[1], env={})
print("yes" if config.grpc.tcp_listen or config.workers.remote else "no")
PY
)
drop_in="$root/etc/systemd/system/simpler-daemon.service.d/network-online.conf"
if [ "$needs_network" = yes ]; then
    install -D -m 0644 "$here/systemd/simpler-daemon.service.d/network-online.conf" "$drop_in"
else
    rm -f "$drop_in"
fi

if [ "$start" = 1 ]; then
    systemd-sysusers
    systemd-tmpfiles --create
    systemctl daemon-reload
    systemctl enable --now simpler-daemon
fi
echo "installed: /usr/local/bin/simplerctl finds the daemon at /run/simpler-daemon/daemon.sock"
