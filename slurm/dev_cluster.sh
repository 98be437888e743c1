#!/usr/bin/env bash
# A real single-node Slurm for tests, CI and by-hand experiments.
#
#   slurm/dev_cluster.sh up      install (first time), start munged, slurmctld, slurmd; wait for idle
#   slurm/dev_cluster.sh status  daemons, node state, queue
#   slurm/dev_cluster.sh down    cancel every job, stop the daemons, remove the state directory
#
# Runs as root (CI is root; on a workstation: `sudo slurm/dev_cluster.sh up`), without
# systemd: the daemons are started directly. `up` is idempotent. Everything Slurm writes
# (slurm.conf, state, spool, logs, pid files) lives in $DISAGG_SLURM_STATE
# (default /tmp/disagg-slurm). /etc/slurm/slurm.conf is made a symlink to our slurm.conf
# so that sbatch/srun/squeue find it without SLURM_CONF; a real slurm.conf already there
# is left alone and `up` prints the SLURM_CONF line to export instead.
#
# Measured on these machines (Debian 12, Slurm 22.05.8, 2 cores, as root; `up`/`down` print theirs):
#   apt-get update + install ............. 12 s quiet, 45 s with the machine busy (once per machine)
#   up, packages there, munged stopped ... 1.3 s until `sinfo` says idle (0.3 s with munged running)
#   up when already up ................... 0.07 s
#   down ................................. 2.2 s (daemons stopped together; one by one it was 5.8 s)
#   sbatch -> RUNNING .................... 0.9 s (batch_sched_delay=0,sched_min_interval=0; ~3 s without)
#   srun -n 2 --mpi=pmix hostname ........ 0.24 s
#   rendered 4-step script, sbatch -> COMPLETED 1.9 s; through submitit 1.6 s
set -euo pipefail

STATE_DIR=${DISAGG_SLURM_STATE:-/tmp/disagg-slurm}
CONF="$STATE_DIR/slurm.conf"
ETC_CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)
# More CPUs than the machine has: with the real 2 cores, a job asking for more tasks
# than cores stays PENDING forever. slurmd accepts the advertised numbers because of
# SlurmdParameters=config_overrides.
NODE_CPUS=${DISAGG_SLURM_CPUS:-16}
PACKAGES=(slurmctld slurmd slurm-client munge libpmix-dev)

log() { printf 'dev_cluster: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
now_ms() { date +%s%3N; }

require_root() {
    [[ $(id -u) -eq 0 ]] || die "run as root (sudo $0 $*): slurmd and munged need it"
}

pid_alive() {  # pid_alive FILE: the pid recorded in FILE is a live process
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    local missing=()
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    ((${#missing[@]} == 0)) && return 0
    local t0; t0=$(now_ms)
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # libpmix-dev must be there before slurmd starts: slurmd loads mpi/pmix at start,
    # and without it `srun --mpi=pmix` hangs instead of failing.
    apt-get install -y -qq libpmix-dev >/dev/null
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
    log "installed in $(( $(now_ms) - t0 )) ms"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0  # a munged is already answering (ours from an earlier `up`, or the host's)
    fi
    # The munge package creates /etc/munge/munge.key; /run/munge is not persistent.
    [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (reinstall munge)"
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$STATE_DIR/munged.ours"  # `down` stops only a munged that `up` started
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not answer"
}

write_conf() {
    local mem_mb
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$STATE_DIR"/{state,spool,log,run}
    cat >"$CONF" <<EOF
# Written by slurm/dev_cluster.sh: a single-node development cluster.
ClusterName=disagg-dev
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# Debian's libpmix-dev: \`srun --mpi=pmix -n TP\` gives one world of TP ranks.
MpiDefault=pmix
# No cgroup.conf: linuxproc tracking and no task plugin work without systemd/cgroup
# delegation. (CgroupPlugin=disabled does not exist in 22.05 and stops slurmd.)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Submit-to-run under 1 s instead of ~3 s.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
# Trust the node line below rather than the hardware (see NODE_CPUS in the script).
SlurmdParameters=config_overrides
ReturnToService=2
# No accounting: sacct fails; job state comes from squeue/scontrol.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Finished jobs stay visible to \`scontrol show job\` for 5 minutes.
MinJobAge=300
KillWait=5
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmdPidFile=$STATE_DIR/run/slurmd.pid
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$NODE_CPUS Sockets=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    if [[ -L $ETC_CONF || ! -e $ETC_CONF ]]; then
        mkdir -p "$(dirname "$ETC_CONF")"
        ln -sfn "$CONF" "$ETC_CONF"
    else
        log "$ETC_CONF is a real file; left alone. Use: export SLURM_CONF=$CONF"
    fi
}

wait_idle() {
    local state=""
    for _ in $(seq 150); do
        state=$(SLURM_CONF=$CONF sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null || true)
        [[ $state == idle || $state == mixed || $state == allocated ]] && return 0
        sleep 0.1
    done
    die "node $HOST is '${state:-unknown}' after 15 s; see $STATE_DIR/log/"
}

cmd_up() {
    require_root up
    local t0; t0=$(now_ms)
    if pid_alive "$STATE_DIR/run/slurmctld.pid" && pid_alive "$STATE_DIR/run/slurmd.pid"; then
        wait_idle
        log "already up ($CONF)"
        return 0
    fi
    install_packages
    mkdir -p "$STATE_DIR"
    start_munge
    write_conf
    pid_alive "$STATE_DIR/run/slurmctld.pid" || slurmctld -f "$CONF"
    pid_alive "$STATE_DIR/run/slurmd.pid" || slurmd -f "$CONF"
    wait_idle
    log "up in $(( $(now_ms) - t0 )) ms: node $HOST idle with $NODE_CPUS CPUs ($CONF)"
}

stop_pidfiles() {  # stop_pidfiles FILE...: SIGTERM to all at once, SIGKILL what is left after 10 s
    # Each daemon takes ~1.5-2 s to exit on SIGTERM; one after the other that was ~6 s.
    local pids=() file pid
    for file in "$@"; do
        pid_alive "$file" && pids+=("$(cat "$file")")
    done
    ((${#pids[@]} == 0)) && return 0
    kill "${pids[@]}" 2>/dev/null || true
    for pid in "${pids[@]}"; do
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid ignored SIGTERM for 10 s; killing"
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
}

cmd_down() {
    require_root down
    local t0; t0=$(now_ms)
    if pid_alive "$STATE_DIR/run/slurmctld.pid"; then
        SLURM_CONF=$CONF scancel --full --user=root --quiet 2>/dev/null || true
        scancel_others
        for _ in $(seq 100); do  # wait until every job step has left the node
            [[ -z $(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.1
        done
    fi
    local daemons=("$STATE_DIR/run/slurmd.pid" "$STATE_DIR/run/slurmctld.pid")
    # Only a munged that `up` started; a host's own munged keeps running.
    [[ -e $STATE_DIR/munged.ours ]] && daemons+=(/run/munge/munged.pid)
    stop_pidfiles "${daemons[@]}"
    [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$CONF" ]] && rm -f "$ETC_CONF"
    rm -rf "$STATE_DIR"
    log "down in $(( $(now_ms) - t0 )) ms"
}

scancel_others() {  # jobs of other users (a developer who submitted without sudo)
    local ids
    ids=$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null || true)
    [[ -n $ids ]] && SLURM_CONF=$CONF scancel --full $ids 2>/dev/null || true
}

cmd_status() {
    local up=1
    for d in slurmctld slurmd; do
        if pid_alive "$STATE_DIR/run/$d.pid"; then
            echo "$d: running (pid $(cat "$STATE_DIR/run/$d.pid"))"
        else
            echo "$d: stopped"; up=0
        fi
    done
    ((up)) || return 1
    echo "SLURM_CONF=$CONF"
    SLURM_CONF=$CONF sinfo -N -o '%N %T %c %m'
    SLURM_CONF=$CONF squeue
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
