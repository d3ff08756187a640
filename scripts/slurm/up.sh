#!/usr/bin/env bash
# Bring up a real SLURM (Debian slurm-wlm 22.05 + munge) on this one machine, with N fake nodes.
#
#   sudo bash scripts/slurm/up.sh [--nodes N] [--gpus G] [--cpus C] [--mem MB] [--accounting] [--no-install]
#
# --gpus G: each fake node declares G fake GPUs (GRES gpu:G backed by /dev/fakegpu0..G-1 device
# nodes), so SLURM really allocates GPUs and sets CUDA_VISIBLE_DEVICES per task, hetjobs included.
# Nothing computes on them: jobs still run on CPU (hpcrl: deployment.compute = "cpu").
#
# Why fake nodes: hetjob components never share a node, so a hetjob on a one-node cluster stays
# pending forever. Debian's build supports several slurmd on one host: each fake node nX has
# NodeAddr=127.0.0.1, its own Port= and NodeHostname=<this host>, and runs as `slurmd -N nX`.
#
# Idempotent: running daemons are kept when slurm.conf is unchanged; a changed slurm.conf
# (e.g. another --nodes) restarts slurmctld and the slurmd daemons (22.05 cannot add nodes
# with `scontrol reconfigure`). No systemd: daemons are started by hand, as root.
# Undo with scripts/slurm/down.sh.
set -euo pipefail

START_NS=$(date +%s%N)
NODES=${HPCRL_SLURM_NODES:-4}
GPUS=${HPCRL_SLURM_GPUS:-0}
CPUS=${HPCRL_SLURM_CPUS:-2}
MEM_MB=${HPCRL_SLURM_MEM_MB:-2048}
ACCOUNTING=0
INSTALL=1
BASE_PORT=${HPCRL_SLURM_BASE_PORT:-17001}   # slurmd of node nX listens on BASE_PORT+X-1
CTLD_PORT=${HPCRL_SLURM_CTLD_PORT:-6817}
DBD_PORT=${HPCRL_SLURM_DBD_PORT:-6819}

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --cpus) CPUS=$2; shift 2 ;;
    --mem) MEM_MB=$2; shift 2 ;;
    --accounting) ACCOUNTING=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "up.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ $EUID -eq 0 ]] || { echo "up.sh: must run as root (daemons and /etc/slurm)" >&2; exit 1; }
[[ $NODES =~ ^[1-9][0-9]*$ ]] || { echo "up.sh: --nodes must be a positive integer" >&2; exit 2; }
[[ $GPUS =~ ^[0-9]+$ ]] && (( GPUS <= 64 )) || { echo "up.sh: --gpus must be an integer 0..64" >&2; exit 2; }

log() { printf '[slurm-up %5.1fs] %s\n' "$(elapsed)" "$*"; }
# awk, not bc: bc is not always installed
elapsed() { awk -v a="$START_NS" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }'; }

HOST=$(hostname -s)
CONF_DIR=/etc/slurm
SPOOL=/var/spool/slurmd
CTLD_SPOOL=/var/spool/slurmctld
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm

# -- 1. packages -------------------------------------------------------------------------------
need_pkgs=()
for bin in sinfo slurmctld slurmd munged; do command -v "$bin" >/dev/null || need_pkgs+=("$bin"); done
if [[ ${#need_pkgs[@]} -gt 0 || ( $ACCOUNTING -eq 1 && ! -x /usr/sbin/slurmdbd ) ]]; then
  [[ $INSTALL -eq 1 ]] || { echo "up.sh: missing ${need_pkgs[*]} and --no-install given" >&2; exit 1; }
  pkgs=(slurm-wlm slurmctld slurmd munge slurm-client)
  [[ $ACCOUNTING -eq 1 ]] && pkgs+=(slurmdbd mariadb-server)
  log "installing ${pkgs[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${pkgs[@]}" >/tmp/hpcrl-slurm-apt.log 2>&1 \
    || { apt-get update -q >>/tmp/hpcrl-slurm-apt.log 2>&1 \
         && apt-get install -y -q "${pkgs[@]}" >>/tmp/hpcrl-slurm-apt.log 2>&1; } \
    || { echo "up.sh: apt-get failed, see /tmp/hpcrl-slurm-apt.log" >&2; exit 1; }
fi

# -- 2. name resolution: every fake node resolves to loopback ----------------------------------
node_names=()
for i in $(seq 1 "$NODES"); do node_names+=("n$i"); done
if ! grep -q '# hpcrl-slurm-nodes' /etc/hosts || \
   [[ "$(grep '# hpcrl-slurm-nodes' /etc/hosts)" != "127.0.0.1 ${node_names[*]} # hpcrl-slurm-nodes" ]]; then
  # /etc/hosts may be a bind mount (containers): rewrite it in place, never replace the file
  hosts=$(grep -v '# hpcrl-slurm-nodes' /etc/hosts || true)
  printf '%s\n127.0.0.1 %s # hpcrl-slurm-nodes\n' "$hosts" "${node_names[*]}" >/etc/hosts
fi

# -- 3. directories ----------------------------------------------------------------------------
mkdir -p "$CONF_DIR" "$SPOOL" "$CTLD_SPOOL" "$LOG_DIR" "$RUN_DIR" /run/munge
for n in "${node_names[@]}"; do mkdir -p "$SPOOL/$n"; done
chown munge:munge /run/munge

# -- 4. slurm.conf -----------------------------------------------------------------------------
acct_lines="AccountingStorageType=accounting_storage/none"
if [[ $ACCOUNTING -eq 1 ]]; then
  acct_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux"
fi
node_lines=""
gres_node=""
gres_types=""
if (( GPUS > 0 )); then
  # fake GPUs: character devices SLURM can "bind" (major 195 = nvidia's; no driver behind them)
  for g in $(seq 0 $((GPUS - 1))); do
    [[ -e /dev/fakegpu$g ]] || mknod "/dev/fakegpu$g" c 195 "$g"
  done
  gres_node=" Gres=gpu:$GPUS"
  gres_types="GresTypes=gpu"
fi
for i in $(seq 1 "$NODES"); do
  node_lines+="NodeName=n$i NodeAddr=127.0.0.1 NodeHostname=$HOST Port=$((BASE_PORT + i - 1)) CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB$gres_node State=UNKNOWN
"
done
gres_conf="# Written by hpcrl scripts/slurm/up.sh: $GPUS fake GPU(s) per node"
if (( GPUS > 0 )); then
  gres_conf+="
NodeName=n[1-$NODES] Name=gpu File=/dev/fakegpu[0-$((GPUS - 1))]"
fi
new_conf=$(cat <<EOF
# Written by hpcrl scripts/slurm/up.sh -- one machine, $NODES fake nodes. Rerun up.sh to change.
ClusterName=hpcrl
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
# linuxproc/none: no cgroups in containers; good enough to track and kill job processes
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# fake nodes all report the host's real CPUs/memory: trust slurm.conf instead of draining them
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# hetjobs start in ~1 s instead of ~22 s with a fast backfill loop
SchedulerParameters=bf_interval=1,bf_hetjob_immediate,sched_interval=1
# quick teardown when a job is cancelled (the 'one component died -> job ends' path)
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=60
SlurmdTimeout=60
StateSaveLocation=$CTLD_SPOOL
SlurmdSpoolDir=$SPOOL/%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# final job states without a database (sacct needs --accounting)
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
$acct_lines
$gres_types
${node_lines}PartitionName=debug Nodes=ALL Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
EOF
)
conf_changed=0
if [[ ! -f $CONF_DIR/slurm.conf ]] || [[ "$(cat "$CONF_DIR/slurm.conf")" != "$new_conf" ]]; then
  printf '%s\n' "$new_conf" >"$CONF_DIR/slurm.conf"
  conf_changed=1
fi
if [[ ! -f $CONF_DIR/gres.conf ]] || [[ "$(cat "$CONF_DIR/gres.conf")" != "$gres_conf" ]]; then
  printf '%s\n' "$gres_conf" >"$CONF_DIR/gres.conf"
  conf_changed=1
fi

# -- helpers -----------------------------------------------------------------------------------
pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS DESCRIPTION CMD...
  local t=$1 what=$2; shift 2
  local deadline=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) >= deadline )); then echo "up.sh: timed out waiting for $what" >&2; return 1; fi
    sleep 0.2
  done
}
stop_pidfile() {  # stop the daemon recorded in a pid file, by that id only
  local f=$1
  if pid_alive "$f"; then
    local pid; pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

# -- 5. munge ----------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating munge key"
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged bash -c 'munge -n | unmunge'
fi

# -- 6. accounting (optional) ------------------------------------------------------------------
if [[ $ACCOUNTING -eq 1 ]]; then
  if ! mysqladmin ping >/dev/null 2>&1; then
    log "starting mariadb"
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    (mysqld_safe >/dev/null 2>&1 &)
    wait_for 30 mariadb mysqladmin ping
  fi
  mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  dbd_conf="AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log"
  if [[ ! -f $CONF_DIR/slurmdbd.conf ]] || [[ "$(cat "$CONF_DIR/slurmdbd.conf")" != "$dbd_conf" ]]; then
    printf '%s\n' "$dbd_conf" >"$CONF_DIR/slurmdbd.conf"
    chmod 600 "$CONF_DIR/slurmdbd.conf"
    stop_pidfile "$RUN_DIR/slurmdbd.pid"
  fi
  if ! pid_alive "$RUN_DIR/slurmdbd.pid"; then
    log "starting slurmdbd"
    slurmdbd
    wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/$DBD_PORT"
  fi
fi

# -- 7. slurmctld + one slurmd per fake node ---------------------------------------------------
if [[ $conf_changed -eq 1 ]]; then
  # the node set may have changed: stop every slurm daemon (by pid file), start afresh
  if pid_alive "$RUN_DIR/slurmctld.pid"; then log "slurm.conf changed: restarting daemons"; fi
  bash "$(dirname "$0")/down.sh" --keep-dbd >/dev/null
fi
if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
  log "starting slurmctld"
  slurmctld
  wait_for 30 slurmctld scontrol ping
fi
if [[ $ACCOUNTING -eq 1 ]] && ! sacctmgr -n list cluster format=cluster 2>/dev/null | grep -qw hpcrl; then
  sacctmgr -i add cluster hpcrl >/dev/null
fi
for n in "${node_names[@]}"; do
  if ! pid_alive "$RUN_DIR/slurmd-$n.pid"; then
    slurmd -N "$n"
  fi
done

# -- 8. wait until every node is idle ----------------------------------------------------------
all_up() {
  local states; states=$(sinfo -h -N -p debug -o '%N %T' | sort -u)
  [[ $(wc -l <<<"$states") -eq $NODES ]] || return 1
  ! grep -Evq ' (idle|mixed|allocated|completing)$' <<<"$states"
}
deadline=$(( $(date +%s) + 30 ))
until all_up; do
  # a node left down/drained by an earlier crash comes back with an explicit resume
  bad=$(sinfo -h -N -o '%N %T' | awk '$2 ~ /down|drain|fail/ {print $1}' | sort -u | paste -sd, -)
  [[ -n $bad ]] && scontrol update NodeName="$bad" State=RESUME >/dev/null 2>&1 || true
  if (( $(date +%s) >= deadline )); then
    echo "up.sh: nodes not idle after 30 s:" >&2; sinfo -N >&2; exit 1
  fi
  sleep 0.3
done

sinfo -N -p debug -o "%N %T %G"
log "SLURM up: $NODES nodes (${node_names[*]}), $GPUS fake GPU(s) each, accounting=$([[ $ACCOUNTING -eq 1 ]] && echo on || echo off), took $(elapsed) s"
