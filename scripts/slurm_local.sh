#!/usr/bin/env bash
# A real single-node Slurm with accounting on this machine, for tests/test_slurm.py (Debian, root, no systemd).
#
#   bash scripts/slurm_local.sh up       # install (first time) and start munged, MariaDB, slurmdbd, slurmctld, slurmd
#   bash scripts/slurm_local.sh status   # which of our daemons are alive, and sinfo
#   bash scripts/slurm_local.sh down     # stop exactly the pids `up` started, in reverse order
#
# Both are idempotent: `up` starts only what is not running from its own pid files and waits until the
# node is idle; `down` with nothing running does nothing. State (pid files, logs, spool, job state) lives in
# $TESSERA_SLURM_DIR (default /tmp/tessera-slurm); /etc/slurm/{slurm,slurmdbd}.conf are (re)written by `up`
# because sbatch/sacct read /etc/slurm/slurm.conf. Cluster name: tessera, partition: debug.
#
# Why accounting: nemo-run reads job status only from `sacct`; without slurmdbd + MariaDB it retries and
# raises PersistentSacctFailure even for a COMPLETED job (../shared/reference/local-slurm.md).
# Exit codes: 0 up/down done; 2 this machine cannot run Slurm (not root, no apt-get); 1 anything else.
set -euo pipefail

STATE="${TESSERA_SLURM_DIR:-/tmp/tessera-slurm}"
CLUSTER=tessera
PIDS="$STATE/pids"
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
HOST="$(hostname)"

log() { echo "slurm_local: $*" >&2; }

alive() {  # alive NAME: our pid file for NAME names a running process
  local f="$PIDS/$1.pid"
  [[ -s "$f" ]] && kill -0 "$(cat "$f")" 2>/dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND until it succeeds
  local limit=$1 what=$2; shift 2
  for _ in $(seq $((limit * 5))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  log "timed out after ${limit}s waiting for $what"; return 1
}

record_pid() {  # record_pid NAME DAEMON_PIDFILE: copy the daemon's own pid file into ours
  wait_for 30 "$1 pid file $2" test -s "$2"
  cp "$2" "$PIDS/$1.pid"
}

install_packages() {
  if command -v slurmctld slurmd sbatch munged slurmdbd mariadbd >/dev/null 2>&1 \
      && [[ $(command -v slurmctld slurmd sbatch munged slurmdbd mariadbd | wc -l) == 6 ]]; then
    return 0
  fi
  command -v apt-get >/dev/null || { log "no apt-get: cannot install ${PKGS[*]}"; exit 2; }
  # Without systemd a package's postinst would try to start its daemon; policy-rc.d=101 forbids that (Docker
  # images ship one; add it only for this install when missing).
  local added_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && added_policy=1
  fi
  log "installing ${PKGS[*]} (about a minute the first time)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${PKGS[@]}" >"$STATE/apt.log" 2>&1 \
    || { apt-get update -q >>"$STATE/apt.log" 2>&1 && apt-get install -y -q --no-install-recommends "${PKGS[@]}" >>"$STATE/apt.log" 2>&1; } \
    || { log "apt-get install failed, see $STATE/apt.log"; exit 1; }
  [[ $added_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d
  return 0
}

start_munge() {
  alive munged && return 0
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  rm -f /run/munge/munged.pid
  # --force: start even if a stale socket from an earlier, killed munged is left behind
  runuser -u munge -- munged --force
  record_pid munged /run/munge/munged.pid
}

start_mariadb() {
  alive mariadb && return 0
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  if [[ ! -d /var/lib/mysql/mysql ]]; then
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$STATE/mariadb-install.log" 2>&1
  fi
  rm -f /run/mysqld/mysqld.pid
  # setsid: detach from this shell's session so the server outlives `up` (mariadbd does not daemonize)
  setsid mariadbd --user=mysql --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
    --pid-file=/run/mysqld/mysqld.pid --skip-networking=0 --bind-address=127.0.0.1 \
    >"$STATE/mariadb.log" 2>&1 </dev/null &
  record_pid mariadb /run/mysqld/mysqld.pid
  wait_for 60 "MariaDB socket" mariadb -e "SELECT 1"
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
              CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

write_confs() {
  mkdir -p /etc/slurm "$STATE/spool/ctld" "$STATE/spool/d" "$STATE/log"
  cat >/etc/slurm/slurmdbd.conf <<EOF
# written by scripts/slurm_local.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
EOF
  chmod 600 /etc/slurm/slurmdbd.conf  # slurmdbd refuses a config others can read (it holds the DB password)
  # The node line is what this machine reports, so CPUs/memory always match (`slurmd -C`, first line).
  local node_line
  node_line="$(slurmd -C | head -n1)"
  cat >/etc/slurm/slurm.conf <<EOF
# written by scripts/slurm_local.sh
ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
$node_line
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_slurm() {
  if ! alive slurmdbd; then
    rm -f "$STATE/slurmdbd.pid"
    slurmdbd
    record_pid slurmdbd "$STATE/slurmdbd.pid"
  fi
  wait_for 60 "slurmdbd to answer sacctmgr" sacctmgr -n list cluster
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
  if ! alive slurmctld; then
    rm -f "$STATE/slurmctld.pid"
    slurmctld
    record_pid slurmctld "$STATE/slurmctld.pid"
  fi
  if ! alive slurmd; then
    rm -f "$STATE/slurmd.pid"
    slurmd
    record_pid slurmd "$STATE/slurmd.pid"
  fi
  wait_for 60 "node $HOST to be idle" bash -c "sinfo -h -N -o %t | grep -qE '^(idle|mix|alloc)'"
}

up() {
  [[ $(id -u) == 0 ]] || { log "must run as root (daemons, /etc/slurm, apt)"; exit 2; }
  mkdir -p "$PIDS"
  getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >>/etc/hosts  # slurmctld must resolve itself
  install_packages
  start_munge
  start_mariadb
  write_confs
  start_slurm
  log "up: cluster $CLUSTER, node $HOST, partition debug; state in $STATE"
}

down() {
  local name pid
  for name in slurmd slurmctld slurmdbd mariadb munged; do  # reverse start order
    alive "$name" || { rm -f "$PIDS/$name.pid"; continue; }
    pid="$(cat "$PIDS/$name.pid")"
    kill "$pid"
    wait_for 30 "$name ($pid) to exit" bash -c "! kill -0 $pid" || kill -9 "$pid"
    rm -f "$PIDS/$name.pid"
  done
  log "down"
}

status() {
  local name
  for name in munged mariadb slurmdbd slurmctld slurmd; do
    if alive "$name"; then echo "$name: running (pid $(cat "$PIDS/$name.pid"))"; else echo "$name: stopped"; fi
  done
  alive slurmctld && sinfo
  return 0
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 1 ;;
esac
