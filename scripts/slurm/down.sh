#!/usr/bin/env bash
# Stop the one-machine SLURM started by scripts/slurm/up.sh.
#
#   sudo bash scripts/slurm/down.sh [--all] [--purge]
#
#   (default)  slurmctld, every slurmd -N nX, slurmdbd; munged and mariadb keep running
#   --all      also stop munged and mariadb
#   --keep-dbd leave slurmdbd running (up.sh uses it to restart only slurmctld and slurmd)
#   --purge    also delete SLURM's saved state (queued jobs, node states, job ids restart at 1)
#
# Daemons are stopped by the pids in their pid files, never by process name, so nothing else on
# the machine is touched.
set -euo pipefail

ALL=0
PURGE=0
KEEP_DBD=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --all) ALL=1; shift ;;
    --purge) PURGE=1; shift ;;
    --keep-dbd) KEEP_DBD=1; shift ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "down.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ $EUID -eq 0 ]] || { echo "down.sh: must run as root" >&2; exit 1; }

RUN_DIR=/run/slurm
pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_pidfile() {  # TERM, wait up to 5 s, then KILL -- the recorded pid only
  local f=$1
  if pid_alive "$f"; then
    local pid; pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

# A controller that answers gets the clean path: it tells every slurmd to exit and saves state.
if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q UP; then
  scontrol shutdown >/dev/null 2>&1 || true
  for _ in $(seq 1 50); do
    alive=0
    for f in "$RUN_DIR"/slurmctld.pid "$RUN_DIR"/slurmd-*.pid; do pid_alive "$f" && alive=1; done
    [[ $alive -eq 0 ]] && break
    sleep 0.1
  done
fi
for f in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR"/slurmctld.pid; do
  [[ -e $f ]] && stop_pidfile "$f"
done
[[ $KEEP_DBD -eq 1 ]] || stop_pidfile "$RUN_DIR/slurmdbd.pid"

if [[ $ALL -eq 1 ]]; then
  stop_pidfile /run/munge/munged.pid
  if command -v mysqladmin >/dev/null && mysqladmin ping >/dev/null 2>&1; then
    mysqladmin shutdown || true
  fi
fi
if [[ $PURGE -eq 1 ]]; then
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
fi
echo "SLURM down$([[ $ALL -eq 1 ]] && echo ' (munged, mariadb too)')$([[ $PURGE -eq 1 ]] && echo ', state purged')"
