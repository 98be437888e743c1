#!/usr/bin/env bash
# A real single-node Slurm for tests, CI and by-hand experiments, and an emulated multi-node one.
#
#   slurm/dev_cluster.sh up      install (first time), start munged, slurmctld, slurmd; wait for idle
#   slurm/dev_cluster.sh status  daemons, node state, queue
#   slurm/dev_cluster.sh down    cancel every job, stop the daemons, remove the state directory
#
#   slurm/dev_cluster.sh up --nodes 15 --gpus-per-node 4   an emulated cluster (see below)
#   slurm/dev_cluster.sh status --emulated; slurm/dev_cluster.sh down --emulated
#
# The emulated cluster is Slurm's multiple-slurmd mode: nodes n0..n<N-1>, all on this machine
# (NodeHostname=localhost, NodeAddr=127.0.0.1, a port each), one `slurmd -N nX` per node, each
# with fake GPUs (character devices, so CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS are set in
# tasks; anything that really calls CUDA fails: emulated runs use the CPU). It has its own state
# directory (/tmp/disagg-slurm-emu) and ports (6827, 6830+i), so it runs beside the single-node
# cluster; its clients need SLURM_CONF=/tmp/disagg-slurm-emu/slurm.conf (`up` prints it).
# $(hostname) is the same on every emulated node: steps tell nodes apart by SLURMD_NODENAME.
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
#   up --nodes 15 --gpus-per-node 4 ..... 1.5 s until every node is idle; 15 slurmds ~95 MB RSS in all
#   down --emulated ...................... 2.3 s
#   srun --mpi=pmix, 4 ranks on 2 nodes, mpi4py import + allreduce: 2.7 s (machine busy)
set -euo pipefail

# Emulated multi-node mode: --nodes/--gpus-per-node on `up`, --emulated on status/down.
EMULATED=0
NUM_NODES=1
GPUS_PER_NODE=0
CMD=${1:-}
(($# > 0)) && shift
while (($# > 0)); do
    case $1 in
        --nodes) NUM_NODES=${2:?--nodes needs a number}; EMULATED=1; shift 2 ;;
        --gpus-per-node) GPUS_PER_NODE=${2:?--gpus-per-node needs a number}; EMULATED=1; shift 2 ;;
        --emulated) EMULATED=1; shift ;;
        *) echo "dev_cluster: unknown option $1" >&2; exit 2 ;;
    esac
done
[[ $NUM_NODES =~ ^[0-9]+$ && $NUM_NODES -ge 1 ]] || { echo "dev_cluster: --nodes must be >= 1" >&2; exit 2; }
[[ $GPUS_PER_NODE =~ ^[0-9]+$ ]] || { echo "dev_cluster: --gpus-per-node must be >= 0" >&2; exit 2; }

DEFAULT_STATE=/tmp/disagg-slurm
EMULATED_STATE=/tmp/disagg-slurm-emu
if ((EMULATED)); then
    STATE_DIR=${DISAGG_SLURM_STATE:-$EMULATED_STATE}
else
    STATE_DIR=${DISAGG_SLURM_STATE:-$DEFAULT_STATE}
fi
# Ports of the emulated cluster: beside the single-node one (Slurm's defaults 6817/6818).
EMU_CTLD_PORT=6827
EMU_SLURMD_PORT0=6830
# Per emulated node: CPUs and MB that keep a 15-node allocation's totals plausible on this machine.
EMU_NODE_CPUS=8
EMU_NODE_MEM=1500
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

node_names() {  # the emulated nodes, one a line (n0 .. n<N-1>), from the written slurm.conf
    sed -n 's/^NodeName=\(n[0-9]*\) .*/\1/p' "$CONF"
}

write_emulated_conf() {
    rm -rf "$STATE_DIR"  # a bad earlier config leaves nodes drained in the saved state
    mkdir -p "$STATE_DIR"/{state,spool,log,run,tmp,dev}
    local i last=$((NUM_NODES - 1)) gres=""
    if ((GPUS_PER_NODE > 0)); then
        # Character devices, not plain files: slurmd rejects those (and `Count=` alone).
        for ((i = 0; i < GPUS_PER_NODE; i++)); do mknod -m 666 "$STATE_DIR/dev/nvidia$i" c 1 3; done
        gres=" Gres=gpu:$GPUS_PER_NODE"
        printf 'AutoDetect=off\nNodeName=n[0-%d] Name=gpu File=%s/dev/nvidia[0-%d]\n' \
            "$last" "$STATE_DIR" "$((GPUS_PER_NODE - 1))" >"$STATE_DIR/gres.conf"
    fi
    for ((i = 0; i < NUM_NODES; i++)); do mkdir -p "$STATE_DIR/spool/n$i" "$STATE_DIR/tmp/n$i"; done
    {
        printf '%s\n' \
            "# Written by slurm/dev_cluster.sh: an emulated cluster of $NUM_NODES nodes x $GPUS_PER_NODE fake GPUs." \
            "ClusterName=disagg-emu" \
            "SlurmctldHost=$HOST(127.0.0.1)" \
            "SlurmctldPort=$EMU_CTLD_PORT" \
            "SlurmUser=root" \
            "AuthType=auth/munge" \
            "MpiDefault=pmix" \
            "ProctrackType=proctrack/linuxproc" \
            "TaskPlugin=task/none" \
            "SelectType=select/cons_tres" \
            "SelectTypeParameters=CR_Core" \
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0" \
            "SlurmdParameters=config_overrides" \
            "ReturnToService=2" \
            "AccountingStorageType=accounting_storage/none" \
            "JobAcctGatherType=jobacct_gather/none" \
            "JobCompType=jobcomp/none" \
            "MinJobAge=300" \
            "KillWait=5" \
            "GresTypes=gpu" \
            "StateSaveLocation=$STATE_DIR/state" \
            "SlurmctldLogFile=$STATE_DIR/log/slurmctld.log" \
            "SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid" \
            "# Per node (%n): PMIx keeps its files in TmpFS (one shared directory: multi-node steps fail" \
            "# with 'pmixp_mkdir ... File exists'); spool directories and pid files would collide too." \
            "TmpFS=$STATE_DIR/tmp/%n" \
            "SlurmdSpoolDir=$STATE_DIR/spool/%n" \
            "SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log" \
            "SlurmdPidFile=$STATE_DIR/run/slurmd-%n.pid"
        for ((i = 0; i < NUM_NODES; i++)); do
            echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((EMU_SLURMD_PORT0 + i))" \
                "CPUs=$EMU_NODE_CPUS Sockets=1 CoresPerSocket=$EMU_NODE_CPUS ThreadsPerCore=1" \
                "RealMemory=$EMU_NODE_MEM$gres State=UNKNOWN"
        done
        # DefCpuPerGPU=1: without it a GPU step takes every CPU of the node per task and does not fit.
        # "batch": the partition configs/dsv4.yaml names, so that it runs here unchanged.
        echo "PartitionName=batch Nodes=n[0-$last] Default=YES MaxTime=INFINITE State=UP DefCpuPerGPU=1"
    } >"$CONF"
    # Only where nothing is there: the single-node cluster keeps /etc/slurm/slurm.conf.
    if [[ ! -e $ETC_CONF && ! -L $ETC_CONF ]]; then
        mkdir -p "$(dirname "$ETC_CONF")"
        ln -sfn "$CONF" "$ETC_CONF"
    fi
}

start_emulated_slurmds() {
    local node
    for node in $(node_names); do
        # PMIX_HOSTNAME: otherwise PMIx files every node's data under the one real host name, and
        # MPI_Init fails once a step has ranks on two nodes.
        PMIX_HOSTNAME=$node slurmd -f "$CONF" -N "$node"
    done
}

wait_emulated_idle() {
    local bad="" states=""
    for _ in $(seq 300); do
        states=$(SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null || true)
        bad=$(grep -v -x -E 'idle|mixed|allocated' <<<"$states" || true)
        [[ -n $states && -z $bad ]] && return 0
        sleep 0.1
    done
    die "emulated nodes not idle after 30 s (states: $(sort -u <<<"$states" | tr '\n' ' ')); see $STATE_DIR/log/"
}

emulated_pidfiles() {  # every slurmd pid file of the emulated cluster
    local f
    for f in "$STATE_DIR"/run/slurmd-*.pid; do [[ -e $f ]] && echo "$f"; done
    return 0
}

cmd_up_emulated() {
    require_root up
    local t0; t0=$(now_ms)
    if pid_alive "$STATE_DIR/run/slurmctld.pid" && [[ $(node_names | wc -l) -eq $NUM_NODES ]] \
            && grep -q "^# Written .* $NUM_NODES nodes x $GPUS_PER_NODE fake GPUs\.$" "$CONF"; then
        wait_emulated_idle
        log "already up ($CONF)"
        return 0
    fi
    [[ -e $STATE_DIR/run/slurmctld.pid ]] && cmd_down  # another shape, or half up: start afresh
    install_packages
    write_emulated_conf
    start_munge
    slurmctld -f "$CONF"
    start_emulated_slurmds
    wait_emulated_idle
    log "up in $(( $(now_ms) - t0 )) ms: $NUM_NODES nodes n0..n$((NUM_NODES - 1)) x $GPUS_PER_NODE GPUs idle"
    log "export SLURM_CONF=$CONF"
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
    mapfile -t -O 2 daemons < <(emulated_pidfiles)
    # Only a munged that `up` started, and only while the other dev cluster does not use it;
    # a host's own munged keeps running.
    [[ -e $STATE_DIR/munged.ours ]] && ! other_cluster_up && daemons+=(/run/munge/munged.pid)
    stop_pidfiles "${daemons[@]}"
    [[ -L $ETC_CONF && $(readlink "$ETC_CONF") == "$CONF" ]] && rm -f "$ETC_CONF"
    rm -rf "$STATE_DIR"
    log "down in $(( $(now_ms) - t0 )) ms"
}

other_cluster_up() {  # the single-node cluster when this is the emulated one, or the reverse
    local other=$DEFAULT_STATE
    [[ $STATE_DIR == "$DEFAULT_STATE" ]] && other=$EMULATED_STATE
    pid_alive "$other/run/slurmctld.pid"
}

scancel_others() {  # jobs of other users (a developer who submitted without sudo)
    local ids
    ids=$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null || true)
    [[ -n $ids ]] && SLURM_CONF=$CONF scancel --full $ids 2>/dev/null || true
}

cmd_status() {
    local up=1 daemons=(slurmctld slurmd) d
    if ((EMULATED)); then
        daemons=(slurmctld)
        for d in $(node_names 2>/dev/null); do daemons+=("slurmd-$d"); done
    fi
    for d in "${daemons[@]}"; do
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

case $CMD in
    up) if ((EMULATED)); then cmd_up_emulated; else cmd_up; fi ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up [--nodes N --gpus-per-node G] | down [--emulated] | status [--emulated]" >&2; exit 2 ;;
esac
