#!/usr/bin/env bash
# A real single-host Slurm cluster for hpcrl's tests: `start`, `stop`, `status`.
#
# start: installs Debian's Slurm (slurmctld, slurmd, slurmdbd with MariaDB,
#   munge) plus Open MPI/PMIx (and bubblewrap, the reward sandbox of
#   hpcrl/reward/sandbox.py) if missing, writes the configs, and starts
#   munged -> mariadb -> slurmdbd -> slurmctld -> two slurmd "virtual nodes"
#   (node1, node2: heterogeneous jobs need two nodes), then waits until both
#   nodes are idle and sacct answers. Idempotent: a daemon that is already up
#   is left alone (and is not recorded as ours).
# stop: stops, in reverse order, only the daemons this script started (their
#   pids are recorded in $STATE/started).
# status: sinfo + which recorded daemons are alive.
#
# Needs root and apt (the CI machine); no systemd. Settings follow
# ../shared/ENVIRONMENT.md: fast backfill (hetjobs start only there),
# cred_expire=10, config_overrides, TmpFS per node (srun --mpi=pmix).
# Partitions, all over both nodes: debug (the default; never preempted),
# scavenger and scavenger_cancel (preemptible capacity: a job there is
# requeued, or cancelled, when a job of `high` needs its CPUs; 20 s of
# grace after SIGTERM) and high (PriorityTier 10: preempts the scavengers).
set -euo pipefail

STATE=${HPCRL_SLURM_STATE:-/var/lib/hpcrl-slurm}
CONF_DIR=/etc/slurm
MARKER="# written by hpcrl scripts/slurm_cluster.sh"
HOST=$(hostname -s)
DB_PASS=hpcrl-slurmdbd
PKGS=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server openmpi-bin libopenmpi-dev libpmix2 bubblewrap)

say() { echo "[slurm_cluster] $*" >&2; }

alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

pidfile_alive() { [[ -f "$1" ]] && alive "$(cat "$1")"; }

record() { echo "$1 $2" >>"$STATE/started"; }  # name pid

install_packages() {
    local missing=()
    for p in "${PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

write_configs() {
    mkdir -p "$CONF_DIR" "$STATE"/{ctld,log,spool,tmp/node1,tmp/node2}
    if [[ -f $CONF_DIR/slurm.conf ]] && ! grep -qF "$MARKER" "$CONF_DIR/slurm.conf"; then
        say "$CONF_DIR/slurm.conf exists and is not ours; refusing to overwrite it"
        exit 1
    fi
    local before=""
    [[ -f $CONF_DIR/slurm.conf ]] && before=$(md5sum <"$CONF_DIR/slurm.conf")
    cat >"$CONF_DIR/slurm.conf" <<EOF
$MARKER
ClusterName=hpcrl
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
TmpFS=$STATE/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2,sched_min_interval=0
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
DefMemPerCPU=1000
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=node1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6821 CPUs=4 RealMemory=8000 State=UNKNOWN
NodeName=node2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6822 CPUs=4 RealMemory=8000 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=scavenger Nodes=node1,node2 MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=20
PartitionName=scavenger_cancel Nodes=node1,node2 MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime=20
PartitionName=high Nodes=node1,node2 MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
    if [[ -n $before && $before != "$(md5sum <"$CONF_DIR/slurm.conf")" ]]; then
        restart_on_new_config
    fi
    cat >"$CONF_DIR/slurmdbd.conf" <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$CONF_DIR/slurmdbd.conf"
}

restart_on_new_config() {  # a running controller and its nodes keep the old slurm.conf: stop them (start restarts)
    local d pf
    for d in slurmctld slurmd-node1 slurmd-node2; do
        pf=$STATE/$d.pid
        if pidfile_alive "$pf"; then
            say "slurm.conf changed: restarting $d"
            kill "$(cat "$pf")"
            for _ in $(seq 40); do pidfile_alive "$pf" || break; sleep 0.25; done
        fi
    done
}

start_munge() {
    if pgrep -x munged >/dev/null; then return 0; fi
    [[ -f /etc/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    sleep 0.5
    record munged "$(cat /run/munge/munged.pid)"
}

start_mariadb() {
    if mariadb-admin --socket=/run/mysqld/mysqld.sock ping >/dev/null 2>&1; then return 0; fi
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    runuser -u mysql -- /usr/sbin/mariadbd --skip-networking --socket=/run/mysqld/mysqld.sock \
        --pid-file=/run/mysqld/hpcrl-mariadb.pid >>"$STATE/log/mariadb.log" 2>&1 &
    for _ in $(seq 60); do
        mariadb-admin --socket=/run/mysqld/mysqld.sock ping >/dev/null 2>&1 && break
        sleep 0.5
    done
    pidfile_alive /run/mysqld/hpcrl-mariadb.pid || { say "mariadb did not start; see $STATE/log/mariadb.log"; exit 1; }
    record mariadb "$(cat /run/mysqld/hpcrl-mariadb.pid)"
    mariadb --socket=/run/mysqld/mysqld.sock -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

start_daemon() {  # name pidfile command...
    local name=$1 pidfile=$2; shift 2
    pidfile_alive "$pidfile" && return 0
    "$@"
    for _ in $(seq 40); do pidfile_alive "$pidfile" && break; sleep 0.25; done
    pidfile_alive "$pidfile" || { say "$name did not start; see $STATE/log/"; exit 1; }
    record "$name" "$(cat "$pidfile")"
}

wait_ready() {
    for _ in $(seq 120); do
        if [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | grep -cE ' (idle|mix|alloc)$') -eq 2 ]] \
            && sacct -n -X -S now-1minutes >/dev/null 2>&1; then
            say "cluster up: $(sinfo -h -N -o '%N:%t' | sort -u | tr '\n' ' ')"
            return 0
        fi
        sleep 0.5
    done
    say "cluster did not become ready"; sinfo -N >&2 || true; exit 1
}

start() {
    if [[ ! -f $CONF_DIR/slurm.conf ]] || grep -qF "$MARKER" "$CONF_DIR/slurm.conf"; then :; else
        if sinfo -h >/dev/null 2>&1; then say "a Slurm cluster not started by this script is up; using it"; return 0; fi
    fi
    install_packages
    write_configs
    touch "$STATE/started"
    start_munge
    start_mariadb
    start_daemon slurmdbd "$STATE/slurmdbd.pid" slurmdbd
    for _ in $(seq 40); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.25; done
    sacctmgr -i -Q add cluster hpcrl >/dev/null 2>&1 || true
    start_daemon slurmctld "$STATE/slurmctld.pid" slurmctld
    start_daemon slurmd-node1 "$STATE/slurmd-node1.pid" slurmd -N node1
    start_daemon slurmd-node2 "$STATE/slurmd-node2.pid" slurmd -N node2
    wait_ready
}

stop() {
    [[ -f $STATE/started ]] || { say "nothing recorded as started"; return 0; }
    if command -v squeue >/dev/null && squeue -h >/dev/null 2>&1; then
        scancel --quiet --state=PENDING,RUNNING -u root 2>/dev/null || true
    fi
    tac "$STATE/started" | while read -r name pid; do
        if alive "$pid"; then
            say "stopping $name ($pid)"; kill "$pid"
            for _ in $(seq 40); do alive "$pid" || break; sleep 0.25; done
            alive "$pid" && kill -9 "$pid"
        fi
    done
    rm -f "$STATE/started"
}

status() {
    if [[ -f $STATE/started ]]; then
        while read -r name pid; do
            if alive "$pid"; then echo "$name $pid running"; else echo "$name $pid dead"; fi
        done <"$STATE/started"
    fi
    sinfo -N 2>/dev/null || { echo "slurm: not reachable"; return 1; }
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
