#!/usr/bin/env bash
# Private test servers for lockkit's integration tests.
# lockkit-services-script: the lab runs only a script that carries this line.
#
#   scripts/services.sh up [NAME...]      install what is missing (root), start servers, wait until they answer
#   scripts/services.sh down [NAME...]    stop the servers this script started (by pidfile only)
#   scripts/services.sh restart NAME...   stop then start the named instances (for fault tests)
#   scripts/services.sh status            one line per instance; exit 0 only if all answer
#   scripts/services.sh env               `export` lines to eval: eval "$(scripts/services.sh env)"
#   scripts/services.sh pid NAME          print the pid of one instance (exit 1 if not running)
#   scripts/services.sh pause NAME...     SIGSTOP the named instances (fault lab: a frozen server)
#   scripts/services.sh resume NAME...    SIGCONT them
#   scripts/services.sh kill NAME...      SIGKILL them, keeping their data (`up` starts them again)
#   scripts/services.sh clean             down, then delete all state under target/services
#
# Instances: the table in scripts/instances.tsv (name, kind, port, URL variable, URL form),
# all bound to 127.0.0.1, all state/logs/pids under <repo>/target/services/<name>/. The
# ZooKeeper ensemble's quorum ports are 12881..3 and its election ports 12884..6; each
# etcd member's peer port is its client port + 1000.
#
# Environment knobs:
#   LOCKKIT_PORT_OFFSET       added to every port above (default 0), for a second checkout on the same machine
#   LOCKKIT_SERVICES_TIMEOUT  seconds to wait for a server to answer (default 60)
set -euo pipefail

# Resolved through symlinks: the table and the state belong to the real checkout.
SCRIPT_DIR="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd -P)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd -P)"
SERVICES_DIR="$REPO_ROOT/target/services"
HOST=127.0.0.1
OFFSET="${LOCKKIT_PORT_OFFSET:-0}"
TIMEOUT="${LOCKKIT_SERVICES_TIMEOUT:-60}"
[[ "$OFFSET" =~ ^[0-9]+$ ]] || { echo "[services] LOCKKIT_PORT_OFFSET must be a number" >&2; exit 2; }
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || { echo "[services] LOCKKIT_SERVICES_TIMEOUT must be a number" >&2; exit 2; }

# The instance table (name, kind, port, URL variable, URL form) lives in one place,
# instances.tsv beside this script; lockkit-lab reads the same file.
INSTANCE_TABLE="$SCRIPT_DIR/instances.tsv"
[[ -r "$INSTANCE_TABLE" ]] || { echo "[services] cannot read $INSTANCE_TABLE" >&2; exit 2; }
ALL_INSTANCES=() CLUSTER_NODES=() ZK_NODES=() ETCD_NODES=() URL_VARS=()
declare -A KIND_OF PORT_OF URL_VAR_OF URL_FORM_OF
while read -r _name _kind _port _var _form _extra || [[ -n "${_name:-}" ]]; do
  [[ -z "$_name" || "$_name" == \#* ]] && continue
  [[ -n "$_form" && -z "$_extra" && "$_port" =~ ^[0-9]+$ ]] \
    || { echo "[services] bad row for '$_name' in $INSTANCE_TABLE" >&2; exit 2; }
  ALL_INSTANCES+=("$_name")
  KIND_OF[$_name]=$_kind PORT_OF[$_name]=$_port URL_VAR_OF[$_name]=$_var URL_FORM_OF[$_name]=$_form
  [[ "$_kind" == cluster ]] && CLUSTER_NODES+=("$_name")
  [[ "$_kind" == zk-ensemble ]] && ZK_NODES+=("$_name")
  [[ "$_kind" == etcd-cluster ]] && ETCD_NODES+=("$_name")
  [[ " ${URL_VARS[*]} " == *" $_var "* ]] || URL_VARS+=("$_var")
done < "$INSTANCE_TABLE"
unset _name _kind _port _var _form _extra

ZK_HEAP="${LOCKKIT_ZK_HEAP:-256m}"
# How often the ZooKeeper servers delete empty container nodes (their default is 60 s): a
# test that waits out a sweep (`LOCKKIT_TEST_ZK_CONTAINER_SWEEP_MS`) then waits seconds.
ZK_CONTAINER_SWEEP_MS=2000
MYSQL_DB=lockkit
MYSQL_USER=lockkit
MYSQL_PASSWORD=lockkit
# PostgreSQL: the cluster's superuser is lockkit (password lockkit), with a database lockkit.
PG_DB=lockkit
PG_USER=lockkit
PG_PASSWORD=lockkit

log() { printf '[services] %s\n' "$*"; }
warn() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
  cat >&2 <<EOF
usage: $0 up [NAME...] | down [NAME...] | restart NAME... | status | env | pid NAME | clean
       $0 pause NAME... | resume NAME... | kill NAME...

  up       install missing Debian packages (as root), start the private servers, wait until they answer
  down     stop the servers this script started (pidfiles under target/services), TERM then KILL
  restart  stop and start the named instances
  status   one line per instance; exit status 0 if all answer, 1 otherwise
  env      print export lines: eval "\$($0 env)"
  pid      print the pid of one instance
  pause    SIGSTOP the named instances (the process stays, answers nothing)
  resume   SIGCONT the named instances
  kill     SIGKILL the named instances (no shutdown, data dir kept: persistence is tested)
  clean    down, then remove target/services entirely

instances: ${ALL_INSTANCES[*]}
EOF
}

# ---------------------------------------------------------------------------
# instance table
# ---------------------------------------------------------------------------
kind_of() {
  [[ -n "$1" && -n "${KIND_OF[$1]:-}" ]] || return 1
  echo "${KIND_OF[$1]}"
}

port_of() {
  [[ -n "$1" && -n "${PORT_OF[$1]:-}" ]] || return 1
  echo $((PORT_OF[$1] + OFFSET))
}

zk_quorum_port() { echo $((12880 + $1 + OFFSET)); }
# election ports sit next to the quorum ports, so that checkouts whose LOCKKIT_PORT_OFFSET
# differ by 1000 (or any amount above 6) never share a port
zk_election_port() { echo $((12883 + $1 + OFFSET)); }
etcd_peer_port() { echo $(($(port_of "$1") + 1000)); }

dir_of() { echo "$SERVICES_DIR/$1"; }
pidfile_of() { echo "$SERVICES_DIR/$1/pid"; }

validate_names() {
  local n
  for n in "$@"; do
    kind_of "$n" >/dev/null || { usage; die "unknown instance '$n'"; }
  done
}

mariadb_socket() {
  local sock
  sock="$(dir_of mariadb)/mysqld.sock"
  # unix socket paths are limited to ~107 bytes; fall back to /tmp for deep checkouts
  if ((${#sock} > 100)); then
    sock="/tmp/lockkit-mariadb-$(printf '%s' "$SERVICES_DIR" | cksum | cut -d' ' -f1).sock"
  fi
  echo "$sock"
}

# ---------------------------------------------------------------------------
# process bookkeeping
# ---------------------------------------------------------------------------
# A string that must occur in /proc/<pid>/cmdline for the pid to count as "ours",
# so that a stale pidfile can never make us signal an unrelated process.
marker_of() {
  case "$(kind_of "$1")" in
    redis|cluster) echo ":$(port_of "$1")" ;;   # redis rewrites its title to "redis-server 127.0.0.1:PORT"
    mariadb) echo "$(dir_of mariadb)/my.cnf" ;;
    zk-*) echo "$(dir_of "$1")/zoo.cfg" ;;
    postgres) echo "$(dir_of "$1")/data" ;;
    etcd-*) echo "$(dir_of "$1")/data" ;;
  esac
}

pid_alive() {
  local pid=$1 state
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r /proc/$pid/stat ]] || return 1
  state="$(sed -E 's/^.*\) ([A-Za-z]).*$/\1/' "/proc/$pid/stat" 2>/dev/null)" || return 1
  [[ "$state" != Z && "$state" != X ]]
}

# prints the pid of a running instance started by this script, or fails
owned_pid() {
  local name=$1 pidfile pid cmdline
  pidfile="$(pidfile_of "$name")"
  [[ -s "$pidfile" ]] || return 1
  pid="$(tr -dc '0-9' <"$pidfile")"
  pid_alive "$pid" || return 1
  cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
  [[ "$cmdline" == *"$(marker_of "$name")"* ]] || return 1
  echo "$pid"
}

# Start "$@" detached in its own session; the pid written is the server's own (exec).
# fd 9 (the lock) is closed so servers do not keep holding it.
launch() {
  local name=$1 logfile=$2
  shift 2
  local pidfile
  pidfile="$(pidfile_of "$name")"
  rm -f "$pidfile"
  # shellcheck disable=SC2016
  setsid bash -c 'echo $$ >"$1"; shift; exec "$@"' lockkit-launch "$pidfile" "$@" \
    </dev/null >>"$logfile" 2>&1 9>&- &
}

port_open() {
  # shellcheck disable=SC2016
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$HOST" "$1" 2>/dev/null
}

# ---------------------------------------------------------------------------
# health checks
# ---------------------------------------------------------------------------
redis_ping() {
  # shellcheck disable=SC2016
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "PING\r\n" >&3
    IFS= read -r line <&3 || exit 1
    [[ "$line" == "+PONG"* ]]' _ "$HOST" "$1" 2>/dev/null
}

zk_4lw() {
  # shellcheck disable=SC2016
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "%s" "$3" >&3
    cat <&3' _ "$HOST" "$1" "$2" 2>/dev/null
}

zk_mode() {
  local out
  out="$(zk_4lw "$1" srvr)" || return 1
  sed -n 's/^Mode: *//p' <<<"$out" | tr -d '\r'
}

etcd_ctl() { # port args...
  local port=$1
  shift
  ETCDCTL_API=3 timeout 5 "$(find_bin etcdctl)" --endpoints="http://$HOST:$port" \
    --dial-timeout=2s --command-timeout=3s "$@"
}

mysql_client() {
  if command -v mariadb >/dev/null 2>&1; then echo mariadb
  elif command -v mysql >/dev/null 2>&1; then echo mysql
  else return 1
  fi
}

mysql_tcp_ok() {
  local client
  client="$(mysql_client)" || return 1
  MYSQL_PWD="$MYSQL_PASSWORD" timeout 5 "$client" --no-defaults --protocol=tcp -h "$HOST" \
    -P "$(port_of mariadb)" -u "$MYSQL_USER" --connect-timeout=2 -N -B \
    -e 'SELECT 1' "$MYSQL_DB" >/dev/null 2>&1
}

mysql_root() {
  local client
  client="$(mysql_client)" || return 1
  timeout 10 "$client" --no-defaults --protocol=socket -S "$(mariadb_socket)" \
    -u "$(id -un)" --connect-timeout=2 -N -B "$@"
}

# PostgreSQL's binaries (Debian keeps them under /usr/lib/postgresql/<version>/bin).
pg_bin() {
  local b
  for b in /usr/lib/postgresql/*/bin/"$1"; do
    [[ -x "$b" ]] && { echo "$b"; return 0; }
  done
  find_bin "$1"
}

# psql as the lockkit superuser against database $2 (default lockkit) of instance $1.
pg_psql() {
  local name=$1 db=${2:-$PG_DB}
  shift 2 || shift $#
  PGPASSWORD="$PG_PASSWORD" PGCONNECT_TIMEOUT=2 timeout 10 psql -X -q -w -h "$HOST" \
    -p "$(port_of "$name")" -U "$PG_USER" -d "$db" -tA "$@"
}

pg_ok() { [[ "$(pg_psql "$1" "$PG_DB" -c 'SELECT 1' 2>/dev/null)" == 1 ]]; }

# Creates the lockkit database once the server answers. Fails while it does not.
pg_provision() {
  local name=$1
  [[ "$(pg_psql "$name" postgres -c 'SELECT 1' 2>/dev/null)" == 1 ]] || return 1
  if [[ "$(pg_psql "$name" postgres -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'")" != 1 ]]; then
    pg_psql "$name" postgres -c "CREATE DATABASE $PG_DB" >/dev/null
  fi
}

# PostgreSQL refuses to run as root: as root, its processes run as the postgres user
# (setpriv execs, so the pid recorded is the server's own).
pg_as_owner() {
  if [[ "$(id -u)" == 0 ]]; then
    setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"
  else
    "$@"
  fi
}

answering() {
  local name=$1 port mode
  port="$(port_of "$name")"
  case "$(kind_of "$name")" in
    redis|cluster) redis_ping "$port" ;;
    mariadb) mysql_tcp_ok ;;
    postgres) pg_ok "$name" ;;
    # A member is healthy once a quorum read through it succeeds (a cluster has a leader).
    etcd-*) etcd_ctl "$port" endpoint health >/dev/null 2>&1 ;;
    zk-standalone)
      [[ "$(zk_4lw "$port" ruok)" == imok ]] || return 1
      mode="$(zk_mode "$port")" || return 1
      [[ "$mode" == standalone ]] ;;
    zk-ensemble)
      [[ "$(zk_4lw "$port" ruok)" == imok ]] || return 1
      mode="$(zk_mode "$port")" || return 1
      [[ "$mode" == leader || "$mode" == follower ]] ;;
  esac
}

log_file_of() {
  local d
  d="$(dir_of "$1")"
  case "$(kind_of "$1")" in
    redis|cluster) echo "$d/redis.log" ;;
    mariadb) echo "$d/mariadb.log" ;;
    zk-*) echo "$d/zookeeper.log" ;;
    postgres) echo "$d/postgres.log" ;;
    etcd-*) echo "$d/etcd.log" ;;
  esac
}

show_logs() {
  local name=$1 f d
  d="$(dir_of "$name")"
  for f in "$(log_file_of "$name")" "$d/stdout.log" "$d/install.log"; do
    if [[ -s "$f" ]]; then
      warn "---- last lines of $f ----"
      tail -n 30 "$f" >&2 || true
    fi
  done
}

# ---------------------------------------------------------------------------
# packages
# ---------------------------------------------------------------------------
find_bin() {
  local b
  for b in "$@"; do
    if command -v "$b" >/dev/null 2>&1; then command -v "$b"; return 0; fi
    if [[ -x "/usr/sbin/$b" ]]; then echo "/usr/sbin/$b"; return 0; fi
    if [[ -x "/usr/bin/$b" ]]; then echo "/usr/bin/$b"; return 0; fi
  done
  return 1
}

ZK_JAR=/usr/share/java/zookeeper.jar

missing_packages() {
  local missing=()
  find_bin redis-server >/dev/null || missing+=(redis-server)
  find_bin redis-cli >/dev/null || missing+=(redis-tools)
  find_bin mariadbd mysqld >/dev/null && find_bin mariadb-install-db mysql_install_db >/dev/null \
    || missing+=(mariadb-server)
  mysql_client >/dev/null || missing+=(mariadb-client)
  find_bin java >/dev/null || missing+=(default-jre-headless)
  [[ -f "$ZK_JAR" ]] || missing+=(libzookeeper-java)
  # Apache Curator, a peer client for the ZooKeeper interoperability test (it needs javac too)
  [[ -f /usr/share/java/curator-recipes.jar ]] || missing+=(libcurator-recipes-java)
  find_bin javac >/dev/null || missing+=(default-jdk-headless)
  pg_bin postgres >/dev/null && pg_bin initdb >/dev/null || missing+=(postgresql)
  find_bin psql >/dev/null || missing+=(postgresql-client)
  find_bin setpriv >/dev/null || missing+=(util-linux)
  # nft silences links for the tests of peers gone silent (lockkit_conformance::SilencedLinks)
  find_bin nft >/dev/null || missing+=(nftables)
  find_bin etcd >/dev/null || missing+=(etcd-server)
  find_bin etcdctl >/dev/null || missing+=(etcd-client)
  # the etcd-client crate compiles etcd's protobuf definitions at build time
  find_bin protoc >/dev/null || missing+=(protobuf-compiler)
  [[ -f /usr/include/google/protobuf/descriptor.proto ]] || missing+=(libprotobuf-dev)
  echo "${missing[*]}"
}

# pids of redis/mariadb server processes (used to spot daemons that package scripts might start)
system_server_pids() {
  local p comm
  for p in /proc/[0-9]*; do
    comm="$(cat "$p/comm" 2>/dev/null)" || continue
    case "$comm" in
      redis-server|mariadbd|mysqld|etcd) echo "${p#/proc/}" ;;
      # A system cluster's postmaster only, never a backend of a server of ours.
      postgres)
        if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -e /etc/postgresql -e /var/lib/postgresql; then
          echo "${p#/proc/}"
        fi ;;
    esac
  done
}

ensure_packages() {
  local missing
  missing="$(missing_packages)"
  [[ -z "$missing" ]] && return 0
  if [[ "$(id -u)" != 0 ]]; then
    die "missing packages: $missing
  install them as root, e.g.:
    sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
  (or run this script as root, which installs them)"
  fi
  log "installing Debian packages: $missing"
  mkdir -p "$SERVICES_DIR"
  local aptlog="$SERVICES_DIR/apt.log" policy=/usr/sbin/policy-rc.d created_policy=0 rc=0
  local before
  before=" $(system_server_pids | tr '\n' ' ') "
  # Forbid package maintainer scripts from starting the system services (redis-server, mariadb).
  if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\n# temporary, written by lockkit scripts/services.sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created_policy=1
  fi
  # shellcheck disable=SC2086  # $missing is a word list on purpose
  {
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q \
           --no-install-recommends $missing
  } >"$aptlog" 2>&1 || rc=$?
  if ((created_policy)); then rm -f "$policy"; fi
  if ((rc != 0)); then
    tail -n 40 "$aptlog" >&2 || true
    die "apt-get failed (exit $rc); full log: $aptlog"
  fi
  # Belt and braces: stop any redis/mariadb server that appeared during the install
  # (i.e. a system service started by a maintainer script despite policy-rc.d).
  local p stopped=0
  for p in $(system_server_pids); do
    [[ "$before" == *" $p "* ]] && continue
    warn "stopping system server pid $p ($(cat "/proc/$p/comm" 2>/dev/null)) started by the package install"
    kill -TERM "$p" 2>/dev/null || true
    stopped=1
  done
  if ((stopped)); then sleep 2; fi
  missing="$(missing_packages)"
  [[ -z "$missing" ]] || die "still missing after apt-get install: $missing (see $aptlog)"
  log "packages installed"
}

# ---------------------------------------------------------------------------
# starting instances
# ---------------------------------------------------------------------------
start_redis() {
  local name=$1 d port
  d="$(dir_of "$name")"
  port="$(port_of "$name")"
  mkdir -p "$d"
  local args=(--port "$port" --bind "$HOST" --protected-mode yes --daemonize no
              --dir "$d" --logfile "$d/redis.log" --save "" --appendonly no
              --enable-debug-command local --loglevel notice --repl-diskless-sync-delay 0)
  if [[ "$(kind_of "$name")" == cluster ]]; then
    args+=(--cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000)
  fi
  if [[ "$name" == redis-replica ]]; then
    args+=(--replicaof "$HOST" "$(port_of redis-primary)")
  fi
  if [[ "$name" == redis-aof ]]; then
    args+=(--appendonly yes --appendfsync always)
  fi
  launch "$name" "$d/stdout.log" "$(find_bin redis-server)" "${args[@]}"
}

zk_classpath() {
  local cp="$1:$ZK_JAR" binding=/usr/share/java/slf4j-simple.jar
  # zookeeper.jar's manifest lists slf4j-api but no binding: add slf4j-simple for logging
  if [[ -f "$binding" ]]; then cp="$cp:$binding"; fi
  echo "$cp"
}

start_zk() {
  local name=$1 d port cfg
  d="$(dir_of "$name")"
  port="$(port_of "$name")"
  cfg="$d/zoo.cfg"
  mkdir -p "$d/data"
  {
    echo "# generated by scripts/services.sh"
    echo "tickTime=500"
    echo "initLimit=20"
    echo "syncLimit=10"
    echo "dataDir=$d/data"
    echo "clientPort=$port"
    echo "clientPortAddress=$HOST"
    echo "maxClientCnxns=0"
    echo "minSessionTimeout=1000"
    echo "maxSessionTimeout=60000"
    echo "admin.enableServer=false"
    echo "4lw.commands.whitelist=*"
    echo "autopurge.snapRetainCount=3"
    echo "autopurge.purgeInterval=1"
    if [[ "$(kind_of "$name")" == zk-ensemble ]]; then
      local i
      for i in 1 2 3; do
        echo "server.$i=$HOST:$(zk_quorum_port "$i"):$(zk_election_port "$i")"
      done
    fi
  } >"$cfg"
  if [[ "$(kind_of "$name")" == zk-ensemble ]]; then
    echo "${name#zk-}" >"$d/data/myid"
  fi
  # slf4j-simple logs to stderr, which goes (appended across restarts) to zookeeper.log
  launch "$name" "$d/zookeeper.log" "$(find_bin java)" \
    -Xms32m "-Xmx$ZK_HEAP" -XX:+UseSerialGC -Djava.net.preferIPv4Stack=true \
    -Dzookeeper.admin.enableServer=false -Dzookeeper.jmx.log4j.disable=true \
    "-Dznode.container.checkIntervalMs=$ZK_CONTAINER_SWEEP_MS" \
    -Dorg.slf4j.simpleLogger.defaultLogLevel=info \
    -Dorg.slf4j.simpleLogger.log.org.apache.zookeeper.server.NIOServerCnxn=warn \
    -Dorg.slf4j.simpleLogger.log.org.apache.zookeeper.server.command.FourLetterCommands=warn \
    -Dorg.slf4j.simpleLogger.showDateTime=true \
    "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd HH:mm:ss.SSS" \
    -cp "$(zk_classpath "$d")" \
    org.apache.zookeeper.server.quorum.QuorumPeerMain "$cfg"
}

write_mariadb_cnf() {
  local d sock
  d="$(dir_of mariadb)"
  sock="$(mariadb_socket)"
  {
    echo "# generated by scripts/services.sh"
    echo "[mysqld]"
    echo "datadir=$d/data"
    echo "port=$(port_of mariadb)"
    echo "bind-address=$HOST"
    echo "socket=$sock"
    echo "pid-file=$d/mariadbd.pid"
    echo "log-error=$d/mariadb.log"
    if [[ "$(id -u)" == 0 ]]; then echo "user=root"; fi
    echo "skip-networking=0"
    echo "skip-name-resolve=1"
    echo "skip-external-locking"
    echo "character-set-server=utf8mb4"
    echo "collation-server=utf8mb4_general_ci"
    echo "max_connections=500"
    echo "innodb_buffer_pool_size=128M"
    echo "innodb_log_file_size=64M"
    echo "innodb_flush_log_at_trx_commit=2"
    # A lock wait timeout rolls back the whole transaction, not just its statement: the
    # stricter of MariaDB's two behaviours, which mode=for-update must survive (a lock taken
    # in a transaction a timeout had already ended would be let go at once).
    echo "innodb_rollback_on_timeout=1"
    echo "[client]"
    echo "socket=$sock"
    echo "port=$(port_of mariadb)"
  } >"$d/my.cnf"
}

start_mariadb() {
  local d
  d="$(dir_of mariadb)"
  mkdir -p "$d"
  write_mariadb_cnf
  if [[ ! -f "$d/data/.lockkit-initialized" ]]; then
    rm -rf "$d/data"
    mkdir -p "$d/data"
    log "mariadb: initialising datadir $d/data"
    if ! "$(find_bin mariadb-install-db mysql_install_db)" --defaults-file="$d/my.cnf" \
        --datadir="$d/data" --user="$(id -un)" --auth-root-authentication-method=socket \
        --skip-test-db >"$d/install.log" 2>&1; then
      show_logs mariadb
      die "mariadb-install-db failed"
    fi
    touch "$d/data/.lockkit-initialized"
  fi
  rm -f "$(mariadb_socket)"
  launch mariadb "$d/stdout.log" "$(find_bin mariadbd mysqld)" --defaults-file="$d/my.cnf"
}

mariadb_provision() {
  local q="'"
  local u1="${q}${MYSQL_USER}${q}@${q}127.0.0.1${q}" u2="${q}${MYSQL_USER}${q}@${q}localhost${q}"
  local pw="${q}${MYSQL_PASSWORD}${q}"
  mysql_root <<SQL
CREATE DATABASE IF NOT EXISTS \`${MYSQL_DB}\`;
CREATE USER IF NOT EXISTS ${u1} IDENTIFIED BY ${pw};
CREATE USER IF NOT EXISTS ${u2} IDENTIFIED BY ${pw};
ALTER USER ${u1} IDENTIFIED BY ${pw};
ALTER USER ${u2} IDENTIFIED BY ${pw};
GRANT ALL PRIVILEGES ON \`${MYSQL_DB}\`.* TO ${u1}, ${u2};
GRANT PROCESS ON *.* TO ${u1}, ${u2};
FLUSH PRIVILEGES;
SQL
  # CONNECTION ADMIN exists from MariaDB 10.5.2; older servers need SUPER to KILL others' connections.
  if ! mysql_root -e "GRANT CONNECTION ADMIN ON *.* TO ${u1}, ${u2}" >/dev/null 2>&1; then
    mysql_root -e "GRANT SUPER ON *.* TO ${u1}, ${u2}" >/dev/null
  fi
}

start_postgres() {
  local name=$1 d
  d="$(dir_of "$name")"
  mkdir -p "$d"
  if [[ ! -f "$d/data/.lockkit-initialized" ]]; then
    rm -rf "$d/data"
    mkdir -p "$d/data"
    printf '%s\n' "$PG_PASSWORD" >"$d/pwfile"
    if [[ "$(id -u)" == 0 ]]; then chown -R postgres:postgres "$d"; fi
    log "$name: initialising $d/data"
    if ! pg_as_owner "$(pg_bin initdb)" -D "$d/data" -U "$PG_USER" --pwfile="$d/pwfile" \
        --auth-host=scram-sha-256 --auth-local=trust -E UTF8 --locale=C.UTF-8 \
        >"$d/install.log" 2>&1; then
      show_logs "$name"
      die "initdb failed"
    fi
    rm -f "$d/pwfile"
    touch "$d/data/.lockkit-initialized"
  fi
  if [[ "$(id -u)" == 0 ]]; then chown -R postgres:postgres "$d"; fi
  # A server killed by the lab leaves its pid file behind. PostgreSQL takes it for a live
  # server while the killed postmaster is a zombie nobody has reaped yet: remove it when
  # that pid is not a live process.
  local old_pid
  old_pid="$(head -n 1 "$d/data/postmaster.pid" 2>/dev/null || true)"
  if [[ -n "$old_pid" ]] && { ! pid_alive "$old_pid" \
      || ! tr '\0' ' ' <"/proc/$old_pid/cmdline" 2>/dev/null | grep -qF "$d/data"; }; then
    # Dead, a zombie, or a reused pid that is not our server.
    rm -f "$d/data/postmaster.pid"
  fi
  local as_owner=()
  if [[ "$(id -u)" == 0 ]]; then as_owner=(setpriv --reuid=postgres --regid=postgres --init-groups --); fi
  launch "$name" "$d/stdout.log" "${as_owner[@]}" "$(pg_bin postgres)" -D "$d/data" \
    -c listen_addresses="$HOST" -p "$(port_of "$name")" -c unix_socket_directories= \
    -c max_connections=300 -c fsync=on -c logging_collector=off \
    -c log_destination=stderr -c shared_buffers=32MB
}

# etcd: a single member, or one member of the 3-member cluster (all of ETCD_NODES). Data
# (and its 64 MB preallocated WAL) under the instance's directory; a restart with data
# rejoins as before.
start_etcd() {
  local name=$1 d port peer cluster token n
  d="$(dir_of "$name")"
  port="$(port_of "$name")"
  peer="$(etcd_peer_port "$name")"
  mkdir -p "$d"
  if [[ "$(kind_of "$name")" == etcd-cluster ]]; then
    cluster="" token=lockkit-etcd-cluster
    for n in "${ETCD_NODES[@]}"; do
      cluster+="${cluster:+,}$n=http://$HOST:$(etcd_peer_port "$n")"
    done
  else
    cluster="$name=http://$HOST:$peer" token="lockkit-$name"
  fi
  launch "$name" "$d/etcd.log" "$(find_bin etcd)" --name "$name" --data-dir "$d/data" \
    --listen-client-urls "http://$HOST:$port" --advertise-client-urls "http://$HOST:$port" \
    --listen-peer-urls "http://$HOST:$peer" --initial-advertise-peer-urls "http://$HOST:$peer" \
    --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token "$token" \
    --logger zap --log-level warn
}

start_instance() {
  case "$(kind_of "$1")" in
    redis|cluster) start_redis "$1" ;;
    mariadb) start_mariadb ;;
    zk-*) start_zk "$1" ;;
    postgres) start_postgres "$1" ;;
    etcd-*) start_etcd "$1" ;;
  esac
}

# wait until NAME answers; fail loudly (with logs) on timeout or if the process dies
wait_instance() {
  local name=$1 deadline port pid
  port="$(port_of "$name")"
  deadline=$((SECONDS + TIMEOUT))
  local provisioned=0 grace=0
  while :; do
    if [[ "$(kind_of "$name")" == postgres ]] && ((!provisioned)); then
      if pg_provision "$name" >>"$(dir_of "$name")/install.log" 2>&1; then
        provisioned=1
        continue
      fi
    elif [[ "$(kind_of "$name")" == mariadb ]] && ((!provisioned)); then
      if mysql_root -e 'SELECT 1' >/dev/null 2>&1; then
        if ! mariadb_provision >>"$(dir_of mariadb)/install.log" 2>&1; then
          show_logs mariadb
          die "mariadb: creating database/user failed"
        fi
        provisioned=1
      fi
    elif answering "$name"; then
      break
    fi
    if ! pid="$(owned_pid "$name")"; then
      # the wrapper writes the pidfile asynchronously; allow a short grace period
      if ((++grace > 10)); then
        show_logs "$name"
        die "$name ($HOST:$port) exited during startup"
      fi
    fi
    if ((SECONDS >= deadline)); then
      show_logs "$name"
      die "$name ($HOST:$port) did not answer within ${TIMEOUT}s"
    fi
    sleep 0.2
  done
  log "$name $HOST:$port ... up (pid $(owned_pid "$name" || echo '?'))"
}

cluster_field() { # port field
  timeout 3 "$(find_bin redis-cli)" -h "$HOST" -p "$1" cluster info 2>/dev/null \
    | tr -d '\r' | sed -n "s/^$2://p"
}

cluster_all_ok() {
  local n port
  for n in "${CLUSTER_NODES[@]}"; do
    port="$(port_of "$n")"
    [[ "$(cluster_field "$port" cluster_state)" == ok ]] || return 1
    [[ "$(cluster_field "$port" cluster_known_nodes)" == 3 ]] || return 1
    [[ "$(cluster_field "$port" cluster_slots_assigned)" == 16384 ]] || return 1
  done
}

cluster_all_fresh() {
  local n port
  for n in "${CLUSTER_NODES[@]}"; do
    port="$(port_of "$n")"
    [[ "$(cluster_field "$port" cluster_known_nodes)" == 1 ]] || return 1
    [[ "$(cluster_field "$port" cluster_slots_assigned)" == 0 ]] || return 1
  done
}

wait_cluster_ok() { # seconds
  local deadline=$((SECONDS + $1))
  while ((SECONDS < deadline)); do
    cluster_all_ok && return 0
    sleep 0.3
  done
  return 1
}

ensure_cluster() {
  local n addrs=() cli createlog="$SERVICES_DIR/cluster-create.log"
  for n in "${CLUSTER_NODES[@]}"; do
    if ! owned_pid "$n" >/dev/null || ! redis_ping "$(port_of "$n")"; then
      warn "redis-cluster: $n is not running; not checking cluster formation"
      return 0
    fi
    addrs+=("$HOST:$(port_of "$n")")
  done
  cli="$(find_bin redis-cli)"
  if cluster_all_ok; then
    log "redis-cluster ${addrs[*]} ... formed (cluster_state:ok)"
    return 0
  fi
  if ! cluster_all_fresh; then
    # nodes restarted from their nodes.conf re-join by themselves; give gossip a moment
    if wait_cluster_ok 20; then
      log "redis-cluster ${addrs[*]} ... formed (cluster_state:ok)"
      return 0
    fi
    warn "redis-cluster: inconsistent state, resetting all three nodes and re-creating"
    for n in "${CLUSTER_NODES[@]}"; do
      "$cli" -h "$HOST" -p "$(port_of "$n")" flushall >/dev/null
      "$cli" -h "$HOST" -p "$(port_of "$n")" cluster reset hard >/dev/null
    done
  fi
  log "redis-cluster: creating cluster ${addrs[*]}"
  if ! timeout 60 "$cli" --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes \
      >"$createlog" 2>&1; then
    tail -n 30 "$createlog" >&2 || true
    die "redis-cli --cluster create failed (log: $createlog)"
  fi
  if ! wait_cluster_ok "$TIMEOUT"; then
    for n in "${CLUSTER_NODES[@]}"; do
      warn "---- cluster info $n ----"
      timeout 3 "$cli" -h "$HOST" -p "$(port_of "$n")" cluster info >&2 || true
    done
    die "redis-cluster did not reach cluster_state:ok within ${TIMEOUT}s"
  fi
  log "redis-cluster ${addrs[*]} ... formed (cluster_state:ok)"
}

ensure_zk_ensemble() {
  local n mode leaders=0 all=1 deadline=$((SECONDS + TIMEOUT)) modes
  while :; do
    leaders=0 all=1 modes=""
    for n in "${ZK_NODES[@]}"; do
      if ! owned_pid "$n" >/dev/null; then
        warn "zk-ensemble: $n is not running; not checking the quorum"
        return 0
      fi
      mode="$(zk_mode "$(port_of "$n")" || true)"
      modes+=" $n=${mode:-none}"
      case "$mode" in
        leader) leaders=$((leaders + 1)) ;;
        follower) ;;
        *) all=0 ;;
      esac
    done
    if ((all && leaders == 1)); then
      log "zk-ensemble ... quorum ok:$modes"
      return 0
    fi
    if ((SECONDS >= deadline)); then
      for n in "${ZK_NODES[@]}"; do show_logs "$n"; done
      die "zk-ensemble has no healthy quorum after ${TIMEOUT}s:$modes"
    fi
    sleep 0.3
  done
}

lock_services() {
  mkdir -p "$SERVICES_DIR"
  exec 9>"$SERVICES_DIR/.lock"
  if ! flock -w 300 9; then die "another services.sh is holding $SERVICES_DIR/.lock"; fi
}

# Peer Python clients for the mixed-fleet tests (kazoo's Lock on ZooKeeper, redis-py's Lock
# on Redis), in a private virtualenv under target/services/py, from PyPI.
PY_VENV="$SERVICES_DIR/py"
PY_PEERS=(kazoo==2.11.0 redis==5.2.1)
ensure_python_peers() {
  local py="$PY_VENV/bin/python"
  if [[ -x "$py" ]] && "$py" -c 'import kazoo, redis' 2>/dev/null; then return 0; fi
  log "installing peer Python clients into $PY_VENV: ${PY_PEERS[*]}"
  mkdir -p "$SERVICES_DIR"
  python3 -m venv "$PY_VENV" >"$SERVICES_DIR/pip.log" 2>&1 \
    || { tail -n 20 "$SERVICES_DIR/pip.log" >&2; die "python3 -m venv failed (install python3-venv)"; }
  "$PY_VENV/bin/pip" install -q --disable-pip-version-check "${PY_PEERS[@]}" >>"$SERVICES_DIR/pip.log" 2>&1 \
    || { tail -n 20 "$SERVICES_DIR/pip.log" >&2; die "pip install ${PY_PEERS[*]} failed; full log: $SERVICES_DIR/pip.log"; }
}

cmd_up() {
  local names=("$@") n pid port to_wait=() start_order=()
  ((${#names[@]})) || names=("${ALL_INSTANCES[@]}")
  validate_names "${names[@]}"
  lock_services
  ensure_packages
  ensure_python_peers
  for n in "${names[@]}"; do
    port="$(port_of "$n")"
    if pid="$(owned_pid "$n")"; then
      kill -CONT "$pid" 2>/dev/null || true   # left paused by an interrupted fault test
      if answering "$n"; then
        log "$n $HOST:$port ... already up (pid $pid)"
      else
        log "$n $HOST:$port ... running (pid $pid), waiting for it to answer"
        to_wait+=("$n")
      fi
      continue
    fi
    rm -f "$(pidfile_of "$n")"
    if port_open "$port"; then
      die "$n: port $HOST:$port is already in use by a process this script did not start"
    fi
    start_order+=("$n")
  done
  # launch the fast-to-launch servers first, MariaDB (whose datadir init blocks) last
  for n in "${start_order[@]}"; do
    [[ "$n" == mariadb ]] && continue
    log "$n $HOST:$(port_of "$n") ... starting"
    start_instance "$n"
    to_wait+=("$n")
  done
  for n in "${start_order[@]}"; do
    [[ "$n" == mariadb ]] || continue
    log "$n $HOST:$(port_of "$n") ... starting"
    start_instance "$n"
    to_wait+=("$n")
  done
  for n in "${to_wait[@]}"; do
    wait_instance "$n"
  done
  local want_cluster=0 want_zk=0
  for n in "${names[@]}"; do
    case "$(kind_of "$n")" in
      cluster) want_cluster=1 ;;
      zk-ensemble) want_zk=1 ;;
    esac
  done
  if ((want_cluster)); then ensure_cluster; fi
  if ((want_zk)); then ensure_zk_ensemble; fi
  # MariaDB that was already running: make sure the user/grants exist (idempotent, cheap)
  for n in "${names[@]}"; do
    if [[ "$n" == mariadb ]] && ! mysql_tcp_ok; then
      mariadb_provision >/dev/null || die "mariadb: provisioning the lockkit user failed"
    fi
  done
  log "all requested services are up"
}

cmd_down() {
  local names=("$@") n pid pids=() stopping=() deadline
  ((${#names[@]})) || names=("${ALL_INSTANCES[@]}")
  validate_names "${names[@]}"
  [[ -d "$SERVICES_DIR" ]] || { log "nothing to stop ($SERVICES_DIR does not exist)"; return 0; }
  lock_services
  for n in "${names[@]}"; do
    if pid="$(owned_pid "$n")"; then
      log "$n ... stopping (pid $pid)"
      # PostgreSQL's TERM waits for every client to leave; INT is its fast shutdown.
      if [[ "$(kind_of "$n")" == postgres ]]; then
        kill -INT "$pid" 2>/dev/null || true
      else
        kill -TERM "$pid" 2>/dev/null || true
      fi
      kill -CONT "$pid" 2>/dev/null || true   # a SIGSTOPped server (fault tests) must see the TERM
      pids+=("$pid")
      stopping+=("$n")
    else
      rm -f "$(pidfile_of "$n")"
    fi
  done
  deadline=$((SECONDS + 10))
  local i alive
  while :; do
    alive=0
    for i in "${!pids[@]}"; do
      if pid_alive "${pids[$i]}"; then alive=1; fi
    done
    ((alive)) || break
    if ((SECONDS >= deadline)); then
      for i in "${!pids[@]}"; do
        if pid_alive "${pids[$i]}"; then
          warn "${stopping[$i]} (pid ${pids[$i]}) did not stop after TERM, sending KILL"
          kill -KILL "${pids[$i]}" 2>/dev/null || true
        fi
      done
      sleep 0.5
      break
    fi
    sleep 0.2
  done
  for n in "${stopping[@]}"; do
    rm -f "$(pidfile_of "$n")"
    log "$n ... down"
  done
  # Only when the whole cluster is down: forget its topology so the next `up` re-creates it.
  local all_cluster=1
  for n in "${CLUSTER_NODES[@]}"; do
    if owned_pid "$n" >/dev/null; then all_cluster=0; fi
  done
  local requested_cluster=0
  for n in "${names[@]}"; do
    [[ "$(kind_of "$n")" == cluster ]] && requested_cluster=1
  done
  if ((all_cluster && requested_cluster)); then
    for n in "${CLUSTER_NODES[@]}"; do rm -f "$(dir_of "$n")/nodes.conf"; done
  fi
  if [[ " ${names[*]} " == *" mariadb "* ]]; then rm -f "$(mariadb_socket)"; fi
  return 0
}

cmd_restart() {
  (($#)) || { usage; exit 2; }
  validate_names "$@"
  cmd_down "$@"
  exec 9>&-
  cmd_up "$@"
}

cmd_status() {
  local n pid state rc=0 port
  for n in "${ALL_INSTANCES[@]}"; do
    port="$(port_of "$n")"
    if pid="$(owned_pid "$n")"; then
      if answering "$n"; then
        state=up
        case "$(kind_of "$n")" in
          zk-*) state="up ($(zk_mode "$port"))" ;;
          cluster) state="up (cluster_state:$(cluster_field "$port" cluster_state || true))" ;;
        esac
      else
        state="running, NOT answering"; rc=1
      fi
    else
      pid=-; state=down; rc=1
    fi
    printf '%-14s %-16s %-8s %s\n' "$n" "$HOST:$port" "$pid" "$state"
  done
  return "$rc"
}

cmd_env() {
  local n addrs
  printf 'export LOCKKIT_TEST_SERVICES_DIR=%q\n' "$SERVICES_DIR"
  # The script that owns these servers (the lab pauses, kills and restarts them through it,
  # also when it runs from another checkout or an installed binary).
  printf 'export LOCKKIT_SERVICES_SCRIPT=%q\n' "$SCRIPT_DIR/services.sh"
  # One URL per URL variable of the instance table, its instances' addresses in order.
  local var form
  for var in "${URL_VARS[@]}"; do
    addrs="" form=""
    for n in "${ALL_INSTANCES[@]}"; do
      [[ "${URL_VAR_OF[$n]}" == "$var" ]] || continue
      addrs+="${addrs:+,}$HOST:$(port_of "$n")"
      form=${URL_FORM_OF[$n]}
    done
    echo "export $var=${form//\{hosts\}/$addrs}"
  done
  printf 'export LOCKKIT_TEST_PYTHON=%q\n' "$PY_VENV/bin/python"
  echo "export LOCKKIT_TEST_ZK_CONTAINER_SWEEP_MS=$ZK_CONTAINER_SWEEP_MS"
}

# pause | resume | kill: one signal to each named instance started by this script
cmd_signal() {
  local action=$1 sig n pid
  shift
  (($#)) || { usage; exit 2; }
  validate_names "$@"
  case "$action" in
    pause) sig=STOP ;;
    resume) sig=CONT ;;
    kill) sig=KILL ;;
  esac
  for n in "$@"; do
    pid="$(owned_pid "$n")" || die "$n is not running"
    if [[ "$(kind_of "$n")" == postgres ]]; then
      # The whole server: PostgreSQL runs a process per connection (each its own session),
      # so a frozen or killed server is the postmaster and every child, as after a power
      # loss. The postmaster is stopped first (it forks no more children) and continued
      # last.
      local children
      children="$(pgrep -P "$pid" | tr '\n' ' ' || true)"
      if [[ "$sig" == CONT ]]; then
        # shellcheck disable=SC2086  # a word list of pids
        [[ -z "$children" ]] || kill -CONT $children 2>/dev/null || true
        kill -CONT "$pid" || die "$n: kill -CONT $pid failed"
      else
        kill "-$sig" "$pid" || die "$n: kill -$sig $pid failed"
        children="$(pgrep -P "$pid" | tr '\n' ' ' || true)"
        # shellcheck disable=SC2086
        [[ -z "$children" ]] || kill "-$sig" $children 2>/dev/null || true
      fi
      if [[ "$sig" == KILL ]]; then
        local c waited=0
        for c in $children; do
          while pid_alive "$c" && ((waited++ < 50)); do sleep 0.1; done
        done
      fi
    else
      kill "-$sig" "$pid" || die "$n: kill -$sig $pid failed"
    fi
    if [[ "$action" == kill ]]; then
      local waited=0
      while pid_alive "$pid" && ((waited++ < 50)); do sleep 0.1; done
      if pid_alive "$pid"; then die "$n (pid $pid) survived SIGKILL"; fi
      rm -f "$(pidfile_of "$n")"
      if [[ "$n" == mariadb ]]; then rm -f "$(mariadb_socket)"; fi
    fi
    log "$n ... $action (pid $pid)"
  done
}

cmd_pid() {
  (($# == 1)) || { usage; exit 2; }
  validate_names "$1"
  owned_pid "$1" || die "$1 is not running"
}

cmd_clean() {
  cmd_down
  exec 9>&-
  rm -rf "$SERVICES_DIR"
  log "removed $SERVICES_DIR"
}

main() {
  local cmd="${1:-}"
  (($#)) && shift
  case "$cmd" in
    up) cmd_up "$@" ;;
    down|stop) cmd_down "$@" ;;
    restart) cmd_restart "$@" ;;
    status) (($# == 0)) || { usage; exit 2; }; cmd_status ;;
    env) (($# == 0)) || { usage; exit 2; }; cmd_env ;;
    pid) cmd_pid "$@" ;;
    pause|resume|kill) cmd_signal "$cmd" "$@" ;;
    clean) (($# == 0)) || { usage; exit 2; }; cmd_clean ;;
    -h|--help|help) usage ;;
    *) usage; exit 2 ;;
  esac
}

main "$@"
