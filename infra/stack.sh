#!/usr/bin/env bash
# The scale-out stack on loopback, natively (no Docker): PostgreSQL (Debian packages), an S3 server (moto's
# server mode), `prefect server` on Postgres with a work pool and `prefect worker`, `mlflow server` on Postgres
# with artifacts in S3 and basic auth, and a two-node Ray cluster with token authentication for
# `runtime.launcher: ray`. What infra/docker-compose.yml runs in containers, for one machine.
#
#   infra/stack.sh up                 start what is not running (idempotent); prints where things are
#   infra/stack.sh down               stop everything this script started (state is kept, S3 excepted)
#   infra/stack.sh status             each service: running or not, and its URL
#   infra/stack.sh env                the client settings as `export` lines: eval "$(infra/stack.sh env)"
#   infra/stack.sh stop|start SERVICE one service: postgres | s3 | mlflow | prefect | ray-head | ray-worker | worker
#   infra/stack.sh reset              down, then delete the state folder (data, secrets, logs)
#
# Settings (environment variables; the defaults keep clear of the usual ports):
#   RLHF_STACK_DIR   state folder (Postgres data, secrets, pids)  default infra/.state (git-ignored)
#   RLHF_STACK_HOST  the address every server binds to             default 127.0.0.1 (loopback only)
#   RLHF_PG_PORT 15432, RLHF_S3_PORT 19000, RLHF_PREFECT_PORT 14200, RLHF_MLFLOW_PORT 15000
#   RLHF_WORK_POOL   the process pool the worker serves            default rlhf-local (prefect.yaml's)
#   RLHF_ZOMBIE_AFTER_S  a flow run silent this long is marked Crashed  default 90 (heartbeats every 30 s)
#   RLHF_STACK_BIN   where prefect, mlflow, moto_server, ray live  default .venv/bin
# The Ray cluster, token authentication on (its nodes stay on loopback even when RLHF_STACK_HOST is not; Linux
# routes all of 127.0.0.0/8 there):
#   RLHF_RAY_HEAD_IP    the head's address    default the loopback address after RLHF_STACK_HOST (127.0.0.2), or
#                       127.0.0.2 when RLHF_STACK_HOST is not a loopback address
#   RLHF_RAY_WORKER_IP  the worker's address  default the one after RLHF_RAY_HEAD_IP (127.0.0.3)
#   RLHF_RAY_PORT 16379 (GCS, what RAY_ADDRESS names), RLHF_RAY_CLIENT_PORT 20001 (Ray Client, ray://),
#   RLHF_RAY_DASHBOARD_PORT 18265 (dashboard and Jobs API, on RLHF_STACK_HOST)
#   RLHF_RAY_HEAD_CPUS, RLHF_RAY_WORKER_CPUS  CPUs each node offers  default 1 (no GPUs: two nodes on one machine
#                       would each claim all of them)
#   RLHF_RAY_BUCKET     the bucket of the files of its stages (RLHF_RAY_STORAGE=s3://BUCKET/runs)  default rlhf-ray
# Logs: $RLHF_STACK_DIR/logs/<service>.log; Ray's own under $RLHF_STACK_DIR/ray (`status` says where). Secrets:
# generated once into $RLHF_STACK_DIR/secrets.env and ray-auth-token (mode 600); they reach servers through the
# environment or files of mode 600, never a command line or a log.
# Postgres refuses to run as root: as root the script runs it as the `postgres` system user.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${RLHF_STACK_DIR:-$ROOT/infra/.state}
BIN=${RLHF_STACK_BIN:-$ROOT/.venv/bin}
HOST=${RLHF_STACK_HOST:-127.0.0.1}
PG_PORT=${RLHF_PG_PORT:-15432}
S3_PORT=${RLHF_S3_PORT:-19000}
PREFECT_PORT=${RLHF_PREFECT_PORT:-14200}
MLFLOW_PORT=${RLHF_MLFLOW_PORT:-15000}
POOL=${RLHF_WORK_POOL:-rlhf-local}
ZOMBIE_AFTER_S=${RLHF_ZOMBIE_AFTER_S:-90}
HEARTBEAT_S=${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}
DVC_BUCKET=${RLHF_DVC_BUCKET:-rlhf-dvc}
MLFLOW_BUCKET=${RLHF_MLFLOW_BUCKET:-rlhf-mlflow}
RAY_BUCKET=${RLHF_RAY_BUCKET:-rlhf-ray}
RAY_PORT=${RLHF_RAY_PORT:-16379}
RAY_CLIENT_PORT=${RLHF_RAY_CLIENT_PORT:-20001}
RAY_DASHBOARD_PORT=${RLHF_RAY_DASHBOARD_PORT:-18265}
RAY_HEAD_CPUS=${RLHF_RAY_HEAD_CPUS:-1}
RAY_WORKER_CPUS=${RLHF_RAY_WORKER_CPUS:-1}
LOGS=$STATE/logs
RUN=$STATE/run
PGDATA=$STATE/postgres
PGSOCK=$STATE/pgsock
SERVICES=(postgres s3 mlflow prefect ray-head ray-worker worker)
STARTUP_S=${RLHF_STACK_STARTUP_S:-180}
RAY_TOKEN=$STATE/ray-auth-token

export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1 \
  RAY_USAGE_STATS_ENABLED=0

die() { echo "stack: error: $*" >&2; exit 1; }
say() { echo "stack: $*"; }

loopback_after() {  # IP N: the loopback address N above IP (127.a.b.c -> 127.a.b.c+N); nothing if IP is not one
  [[ $1 =~ ^127\.([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] || return 0
  local last=$((BASH_REMATCH[3] + $2))
  ((last < 255)) && echo "127.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}.$last"
  return 0
}
RAY_HEAD_IP=${RLHF_RAY_HEAD_IP:-$(loopback_after "$HOST" 1)}
RAY_HEAD_IP=${RAY_HEAD_IP:-127.0.0.2}
RAY_WORKER_IP=${RLHF_RAY_WORKER_IP:-$(loopback_after "$RAY_HEAD_IP" 1)}
RAY_ADDRESS_OF_HEAD=$RAY_HEAD_IP:$RAY_PORT
# Ray's temp dir holds its Unix sockets (session_<date>_<pid>/sockets/plasma_store.1: ~67 more bytes), whose paths
# may not exceed 107 bytes: a state folder too deep for that gets one under /tmp, named after it
RAY_TMP=$STATE/ray
if ((${#RAY_TMP} > 40)); then
  RAY_TMP=${TMPDIR:-/tmp}/rlhf-ray-$(id -u)-$(printf '%s' "$STATE" | cksum | cut -d' ' -f1)
fi

PORT_SETTINGS=(RLHF_PG_PORT RLHF_S3_PORT RLHF_PREFECT_PORT RLHF_MLFLOW_PORT RLHF_RAY_PORT RLHF_RAY_CLIENT_PORT
                RLHF_RAY_DASHBOARD_PORT)

check_settings() {
  local name value ports=("$PG_PORT" "$S3_PORT" "$PREFECT_PORT" "$MLFLOW_PORT" "$RAY_PORT" "$RAY_CLIENT_PORT"
                          "$RAY_DASHBOARD_PORT")
  for name in "${PORT_SETTINGS[@]}" RLHF_ZOMBIE_AFTER_S RLHF_RAY_HEAD_CPUS RLHF_RAY_WORKER_CPUS; do
    value=${!name:-}
    [[ -z $value || $value =~ ^[0-9]+$ ]] || die "$name=$value: expected a number (a TCP port, seconds or CPUs)"
  done
  for value in "${ports[@]}"; do
    ((value > 0 && value < 65536)) || die "port $value: expected 1-65535 (RLHF_*_PORT)"
  done
  [[ $(printf '%s\n' "${ports[@]}" | sort -u | wc -l) == "${#ports[@]}" ]] ||
    die "expected different ports:$(for i in "${!ports[@]}"; do printf ' %s=%s' "${PORT_SETTINGS[i]}" "${ports[i]}"; done)"
  ((ZOMBIE_AFTER_S > HEARTBEAT_S)) || die "RLHF_ZOMBIE_AFTER_S=$ZOMBIE_AFTER_S: expected more than the heartbeat period ($HEARTBEAT_S s)"
  ((RAY_HEAD_CPUS > 0 && RAY_WORKER_CPUS > 0)) || die "RLHF_RAY_HEAD_CPUS/RLHF_RAY_WORKER_CPUS: expected at least 1 CPU per node"
  for name in RAY_HEAD_IP RAY_WORKER_IP; do
    value=${!name}
    [[ -n $value ]] || die "RLHF_RAY_WORKER_IP: set it (RLHF_RAY_HEAD_IP=$RAY_HEAD_IP is not a loopback address, so no default follows it)"
    [[ $value =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "RLHF_${name}=$value: expected an IPv4 address"
    # Ray swaps 127.0.0.1 for this machine's interface address (it wants one other machines reach): the node
    # would then be off loopback, so the stack's nodes take other loopback addresses
    [[ $value != 127.0.0.1 ]] || die "RLHF_${name}=127.0.0.1: Ray replaces it with this machine's interface address; use another loopback address (127.0.0.2, 127.0.0.3, ...)"
  done
  [[ $RAY_HEAD_IP != "$RAY_WORKER_IP" ]] || die "RLHF_RAY_HEAD_IP and RLHF_RAY_WORKER_IP are both $RAY_HEAD_IP: Ray tells nodes apart by their address"
  [[ -x $BIN/prefect && -x $BIN/mlflow ]] || die "no prefect/mlflow in $BIN: run \`make setup\` (or set RLHF_STACK_BIN)"
}

secret() { "$BIN/python" -c 'import secrets; print(secrets.token_urlsafe(24))'; }

load_secrets() {
  mkdir -p "$STATE" "$LOGS" "$RUN"
  if [[ ! -f $STATE/secrets.env ]]; then
    (umask 077; {
      echo "RLHF_PG_PASSWORD=$(secret)"
      echo "RLHF_PREFECT_AUTH=admin:$(secret)"
      echo "RLHF_MLFLOW_ADMIN_PASSWORD=$(secret)"
      echo "RLHF_MLFLOW_USER=rlhf"
      echo "RLHF_MLFLOW_PASSWORD=$(secret)"
      echo "RLHF_S3_KEY_ID=rlhf$(secret | tr -dc 'A-Za-z0-9' | cut -c1-12)"
      echo "RLHF_S3_SECRET=$(secret)"
      echo "RLHF_FLASK_SECRET=$(secret)"
    } > "$STATE/secrets.env")
  fi
  # the Ray cluster's token, in the file every node and client names with RAY_AUTH_TOKEN_PATH (256 bits, as Ray's own
  # `ray get-auth-token --generate` makes, which only writes to ~/.ray/auth_token)
  if [[ ! -s $RAY_TOKEN ]]; then
    (umask 077; "$BIN/python" -c 'import secrets; print(secrets.token_hex(32))' > "$RAY_TOKEN")
  fi
  # shellcheck disable=SC1091
  source "$STATE/secrets.env"
}

# ---------------------------------------------------------------------------------------------------- helpers
pid_of() { [[ -f $RUN/$1.pid ]] && cat "$RUN/$1.pid" || true; }
alive() { local pid; pid=$(pid_of "$1"); [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }

# start NAME CMD...: in its own session (so `down` stops its whole process group), output to logs/NAME.log
# require_free_port PORT VARIABLE [ADDRESS]: before a service starts, nothing else may answer on its port (a health
# check would otherwise talk to the other program)
require_free_port() {
  local address=${3:-$HOST}
  if (exec 3<>"/dev/tcp/$address/$1") 2>/dev/null; then
    die "port $1 ($2) is already in use on $address by another program; choose another with $2"
  fi
}

start_bg() {
  local name=$1; shift
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/$name.pid"
}

wait_http() {  # NAME URL [auth]: until URL answers below 500
  local name=$1 url=$2 auth=${3:-} deadline=$((SECONDS + STARTUP_S)) code
  while ((SECONDS < deadline)); do
    alive "$name" || die "$name exited while starting; see $LOGS/$name.log:$(echo; tail -n 15 "$LOGS/$name.log")"
    code=$("$BIN/python" - "$url" "$auth" <<'EOF' 2>/dev/null || true
import base64, sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1])
if sys.argv[2]:
    req.add_header("Authorization", "Basic " + base64.b64encode(sys.argv[2].encode()).decode())
try:
    print(urllib.request.urlopen(req, timeout=3).status)
except urllib.error.HTTPError as err:
    print(err.code)
EOF
)
    [[ -n $code && $code -lt 500 ]] && return 0
    sleep 1
  done
  die "$name did not answer on $url within ${STARTUP_S} s; see $LOGS/$name.log"
}

session_of() { ps -eo pid=,sid= | awk -v sid="$1" '$2 == sid { print $1 }'; }  # the processes of session SID

stop_service() {
  local name=$1 pid i
  if [[ $name == postgres ]]; then
    if [[ -f $PGDATA/postmaster.pid ]]; then as_pg "$(pg_bin)/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null && say "postgres stopped"; fi
    return 0
  fi
  pid=$(pid_of "$name")
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    if [[ $name == ray-* ]]; then
      # `ray start --block` takes its node down in order on SIGTERM; its worker processes have process groups of
      # their own, so what outlives the grace is found by the session start_bg gave the node
      kill -TERM "$pid" 2>/dev/null || true
      for i in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      # shellcheck disable=SC2046
      kill -KILL $(session_of "$pid") 2>/dev/null || true
    else
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for i in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    say "$name stopped"
  fi
  rm -f "$RUN/$name.pid"
}

# ---------------------------------------------------------------------------------------------------- postgres
pg_bin() {
  local dir
  for dir in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r) ; do [[ -x $dir/pg_ctl ]] && { echo "$dir"; return; }; done
  command -v pg_ctl >/dev/null && { dirname "$(command -v pg_ctl)"; return; }
  die "PostgreSQL not found: install it (Debian: apt-get install postgresql; \`make test-server\` does)"
}

as_pg() {  # run a Postgres binary as the current user, or as `postgres` when we are root
  if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

psql_admin() { as_pg "$(pg_bin)/psql" -h "$PGSOCK" -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qtA "$@"; }

start_postgres() {
  local bin; bin=$(pg_bin)
  if [[ $(id -u) == 0 ]] && ! runuser -u postgres -- test -x "$STATE"; then
    die "RLHF_STACK_DIR=$STATE: the postgres user cannot reach it (as root, Postgres runs as postgres); pick a folder whose parents are world-searchable, e.g. one under /tmp with mode 755"
  fi
  if [[ ! -f $PGDATA/PG_VERSION ]]; then
    mkdir -p "$PGDATA"
    local pwfile; pwfile=$(mktemp)
    echo "$RLHF_PG_PASSWORD" > "$pwfile"
    if [[ $(id -u) == 0 ]]; then chown postgres "$PGDATA" "$pwfile"; fi
    chmod 700 "$PGDATA"; chmod 600 "$pwfile"
    as_pg "$bin/initdb" -D "$PGDATA" -U postgres --pwfile="$pwfile" --auth-local=peer --auth-host=scram-sha-256 \
      >>"$LOGS/postgres.log" 2>&1 || { rm -f "$pwfile"; die "initdb failed; see $LOGS/postgres.log"; }
    rm -f "$pwfile"
    if [[ $(id -u) == 0 ]]; then  # peer auth maps the OS user `postgres` to the role `postgres`
      :
    else  # the current user runs the server: let it in as the superuser over the socket
      { echo "self $(id -un) postgres"; } >> "$PGDATA/pg_ident.conf"
      sed -i "1i local all postgres peer map=self" "$PGDATA/pg_hba.conf"
    fi
  fi
  mkdir -p "$PGSOCK"; touch "$LOGS/postgres.log"
  if [[ $(id -u) == 0 ]]; then chown postgres "$PGSOCK" "$LOGS/postgres.log"; fi
  if as_pg "$bin/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
    say "postgres already running on $HOST:$PG_PORT"
  else
    require_free_port "$PG_PORT" RLHF_PG_PORT
    as_pg "$bin/pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w -t "$STARTUP_S" \
      -o "-p $PG_PORT -h $HOST -k $PGSOCK" start >/dev/null || die "postgres did not start; see $LOGS/postgres.log"
    say "postgres on $HOST:$PG_PORT (data $PGDATA)"
  fi
  local db
  for db in prefect mlflow mlflow_auth; do  # one role per database; all share the generated password
    local role=${db%_auth}
    [[ $(psql_admin -d postgres -c "SELECT 1 FROM pg_roles WHERE rolname='$role'") == 1 ]] || \
      psql_admin -d postgres >/dev/null <<<"CREATE ROLE $role LOGIN PASSWORD '$RLHF_PG_PASSWORD'"  # stdin: not in ps
    [[ $(psql_admin -d postgres -c "SELECT 1 FROM pg_database WHERE datname='$db'") == 1 ]] || \
      psql_admin -d postgres -c "CREATE DATABASE $db OWNER $role" >/dev/null
  done
}

pg_url() { echo "$1://$2:$RLHF_PG_PASSWORD@$HOST:$PG_PORT/$3"; }  # DRIVER ROLE DB: for environment variables only

# ---------------------------------------------------------------------------------------------------- S3 (moto)
start_s3() {
  if alive s3; then say "s3 already running on http://$HOST:$S3_PORT"; return; fi
  require_free_port "$S3_PORT" RLHF_S3_PORT
  start_bg s3 "$BIN/moto_server" -H "$HOST" -p "$S3_PORT"
  wait_http s3 "http://$HOST:$S3_PORT/moto-api/"
  AWS_ACCESS_KEY_ID=$RLHF_S3_KEY_ID AWS_SECRET_ACCESS_KEY=$RLHF_S3_SECRET "$BIN/python" - \
    "http://$HOST:$S3_PORT" "$DVC_BUCKET" "$MLFLOW_BUCKET" "$RAY_BUCKET" <<'EOF'
import sys, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
have = {b["Name"] for b in s3.list_buckets()["Buckets"]}
for bucket in sys.argv[2:]:
    if bucket not in have:
        s3.create_bucket(Bucket=bucket)
EOF
  say "s3 (moto, in memory) on http://$HOST:$S3_PORT, buckets $DVC_BUCKET $MLFLOW_BUCKET $RAY_BUCKET"
}

# ---------------------------------------------------------------------------------------------------- MLflow
start_mlflow() {
  if alive mlflow; then
    say "mlflow already running on http://$HOST:$MLFLOW_PORT"
  else
    require_free_port "$MLFLOW_PORT" RLHF_MLFLOW_PORT
    launch_mlflow
  fi
  wait_http mlflow "http://$HOST:$MLFLOW_PORT/health"
  ensure_mlflow_user
}

launch_mlflow() {
  # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: MLflow 3.17's job runner (7 worker processes, ~2 GiB of the server's
  # 2.5 GiB under load; bench/RESULTS.md) serves GenAI jobs this pipeline never submits
  (umask 077; cat > "$STATE/mlflow-auth.ini" <<EOF
[mlflow]
default_permission = READ
database_uri = $(pg_url postgresql+psycopg2 mlflow mlflow_auth)
admin_username = admin
admin_password = $RLHF_MLFLOW_ADMIN_PASSWORD
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
EOF
)
  start_bg mlflow env MLFLOW_AUTH_CONFIG_PATH="$STATE/mlflow-auth.ini" \
    MLFLOW_BACKEND_STORE_URI="$(pg_url postgresql+psycopg2 mlflow mlflow)" \
    MLFLOW_FLASK_SERVER_SECRET_KEY="$RLHF_FLASK_SECRET" \
    MLFLOW_S3_ENDPOINT_URL="http://$HOST:$S3_PORT" AWS_ACCESS_KEY_ID="$RLHF_S3_KEY_ID" \
    AWS_SECRET_ACCESS_KEY="$RLHF_S3_SECRET" AWS_DEFAULT_REGION=us-east-1 \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
    "$BIN/mlflow" server --app-name basic-auth --host "$HOST" --port "$MLFLOW_PORT" --workers 1 \
    --artifacts-destination "s3://$MLFLOW_BUCKET"
  say "mlflow on http://$HOST:$MLFLOW_PORT (Postgres backend, artifacts s3://$MLFLOW_BUCKET, basic auth)"
}

ensure_mlflow_user() {
  # the pipeline's own user (not the admin); creating it again is refused, which is fine
  RLHF_MLFLOW_ADMIN_PASSWORD=$RLHF_MLFLOW_ADMIN_PASSWORD RLHF_MLFLOW_USER=$RLHF_MLFLOW_USER \
    RLHF_MLFLOW_PASSWORD=$RLHF_MLFLOW_PASSWORD "$BIN/python" - "http://$HOST:$MLFLOW_PORT" <<'EOF' || die "could not create the MLflow user; see $LOGS/mlflow.log"
import os, sys, httpx
url = sys.argv[1]
admin = ("admin", os.environ["RLHF_MLFLOW_ADMIN_PASSWORD"])
user = {"username": os.environ["RLHF_MLFLOW_USER"], "password": os.environ["RLHF_MLFLOW_PASSWORD"]}
got = httpx.get(f"{url}/api/2.0/mlflow/users/get", params={"username": user["username"]}, auth=admin, timeout=30)
if got.status_code != 200:
    made = httpx.post(f"{url}/api/2.0/mlflow/users/create", json=user, auth=admin, timeout=30)
    if made.status_code != 200:
        sys.exit(f"users/create: HTTP {made.status_code}")
EOF
}

# ---------------------------------------------------------------------------------------------------- Prefect
prefect_env() {
  env PREFECT_HOME="$STATE/prefect-home" PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api" \
    PREFECT_API_AUTH_STRING="$RLHF_PREFECT_AUTH" "$@"
}

start_prefect() {
  if alive prefect; then
    say "prefect already running on http://$HOST:$PREFECT_PORT"
  else
    require_free_port "$PREFECT_PORT" RLHF_PREFECT_PORT
    mkdir -p "$STATE/prefect-home"
    # the UI's API address too: with --port alone the UI served here calls http://127.0.0.1:4200/api
    start_bg prefect env PREFECT_HOME="$STATE/prefect-home" \
      PREFECT_API_DATABASE_CONNECTION_URL="$(pg_url postgresql+asyncpg prefect prefect)" \
      PREFECT_SERVER_API_AUTH_STRING="$RLHF_PREFECT_AUTH" PREFECT_UI_API_URL="http://$HOST:$PREFECT_PORT/api" \
      "$BIN/prefect" server start --host "$HOST" --port "$PREFECT_PORT"
  fi
  wait_http prefect "http://$HOST:$PREFECT_PORT/api/health" "$RLHF_PREFECT_AUTH"
  # the work pool (a `process` pool: flow runs are subprocesses of the worker, on this machine)
  prefect_env "$BIN/prefect" --no-prompt work-pool create "$POOL" --type process \
    --base-job-template "$ROOT/infra/work-pools/process.json" --overwrite >>"$LOGS/prefect.log" 2>&1 \
    || die "could not create work pool $POOL; see $LOGS/prefect.log"
  # flow runs silent for RLHF_ZOMBIE_AFTER_S (a dead worker, a lost machine) are marked Crashed
  if ! prefect_env "$BIN/prefect" automation inspect "rlhf: crash zombie flow runs" >/dev/null 2>&1; then
    sed "s/within: .*/within: $ZOMBIE_AFTER_S/" "$ROOT/infra/automations/crash-zombie-flow-runs.yaml" \
      > "$STATE/crash-zombie-flow-runs.yaml"
    prefect_env "$BIN/prefect" --no-prompt automation create --from-file "$STATE/crash-zombie-flow-runs.yaml" \
      >>"$LOGS/prefect.log" 2>&1 || die "could not create the zombie automation; see $LOGS/prefect.log"
  fi
  say "prefect on http://$HOST:$PREFECT_PORT (Postgres backend, API auth), work pool $POOL"
}

# ---------------------------------------------------------------------------------------------------- Ray
# Whoever reaches a Ray port runs code on every node (GCS, raylets, dashboard and its Jobs API, Ray Client), and
# Ray 2.60 binds its GCS, raylets and workers to all interfaces whatever the node's address: every node and client
# must hold the token (RAY_AUTH_MODE=token), which they read from its file. These run in a subshell: the exports
# reach the one command started there, and a secret is never an argument.
ray_auth_env() {
  unset RAY_AUTH_TOKEN  # it would win over the file: a token the caller's shell holds is not this cluster's
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RAY_TOKEN"
}

s3_env() {  # the stack's S3 for the Ray ranks and drivers (pyarrow.fs reads AWS_ENDPOINT_URL, as boto3 does)
  export AWS_ACCESS_KEY_ID="$RLHF_S3_KEY_ID" AWS_SECRET_ACCESS_KEY="$RLHF_S3_SECRET" AWS_ENDPOINT_URL="http://$HOST:$S3_PORT"
}

ray_client_env() {  # what a driver on this machine needs: `rlhf stage` with runtime.launcher ray
  ray_auth_env; s3_env
  export RAY_ADDRESS="$RAY_ADDRESS_OF_HEAD" RAY_NODE_IP_ADDRESS="$RAY_HEAD_IP" RLHF_RAY_STORAGE="s3://$RAY_BUCKET/runs"
}

ray_node_env() {
  ray_auth_env; s3_env
  # bytecode written once (as the Makefile does): with PYTHONDONTWRITEBYTECODE each of a node's ~15 Python processes
  # compiles Ray at every start, and a dashboard agent not up within 15 s fails its raylet (measured on 2 busy cores)
  unset PYTHONDONTWRITEBYTECODE
  # RAY_ADDRESS for the nodes' workers: Ray Train's actors look the cluster up as "auto", which fails when another
  # cluster runs on the machine ("Found multiple active Ray instances"). No drain on SIGTERM: it is for Ray Serve,
  # which nothing here runs, and waits up to 30 s on a GCS already gone.
  export RAY_ADDRESS="$RAY_ADDRESS_OF_HEAD" RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
}

# Both nodes: GPUs none (two nodes on one machine would each claim them all); dashboard agents on ports of their
# own choosing (the fixed default, 52365, is bound on 127.0.0.1 by every node, so the second one's collides); Ray
# workers on ephemeral ports (Ray's default range, 10002-19999, holds the stack's own ports, which a worker could
# take while a service restarts)
RAY_NODE_FLAGS=(--block --num-gpus=0 --disable-usage-stats --dashboard-agent-listen-port=0 --min-worker-port=0
                --max-worker-port=0)

wait_ray_node() {  # NAME IP: until a client holding the token sees the node at IP alive in the cluster
  local name=$1 ip=$2
  ( ray_auth_env
    "$BIN/python" - "$RAY_ADDRESS_OF_HEAD" "$RAY_HEAD_IP" "$ip" "$(pid_of "$name")" "$STARTUP_S" \
      >>"$LOGS/$name.log" 2>&1 <<'EOF'
import os, sys, time
import ray

address, driver_ip, node_ip, pid, timeout_s = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
deadline, problem = time.monotonic() + timeout_s, "no answer"
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("stack: the node exited while starting")
    try:
        if not ray.is_initialized():
            ray.init(address=address, _node_ip_address=driver_ip, logging_level="ERROR", log_to_driver=False)
        if node_ip in {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}:
            sys.exit(0)
        problem = f"node {node_ip} is not among the cluster's live nodes"
    except Exception as err:  # not up yet: the GCS or the head's raylet
        problem = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        ray.shutdown()
    time.sleep(1)
sys.exit(f"stack: {problem} after {timeout_s:.0f} s")
EOF
  ) || die "$name did not join the Ray cluster at $RAY_ADDRESS_OF_HEAD; see $LOGS/$name.log and $RAY_TMP/session_latest/logs:$(echo; tail -n 15 "$LOGS/$name.log")"
}

start_ray_head() {
  if alive ray-head; then say "ray-head already running on $RAY_ADDRESS_OF_HEAD"; return; fi
  [[ -x $BIN/ray ]] || die "no ray in $BIN: install the server extra (pip install -e '.[server]'; \`make test-server\` does)"
  require_free_port "$RAY_PORT" RLHF_RAY_PORT "$RAY_HEAD_IP"
  require_free_port "$RAY_CLIENT_PORT" RLHF_RAY_CLIENT_PORT "$RAY_HEAD_IP"
  require_free_port "$RAY_CLIENT_PORT" RLHF_RAY_CLIENT_PORT 127.0.0.1  # Ray Client listens there too
  require_free_port "$RAY_DASHBOARD_PORT" RLHF_RAY_DASHBOARD_PORT
  mkdir -p "$RAY_TMP"
  ( ray_node_env
    start_bg ray-head "$BIN/ray" start --head --node-ip-address="$RAY_HEAD_IP" --port="$RAY_PORT" \
      --num-cpus="$RAY_HEAD_CPUS" --ray-client-server-port="$RAY_CLIENT_PORT" --include-dashboard=true \
      --dashboard-host="$HOST" --dashboard-port="$RAY_DASHBOARD_PORT" --temp-dir="$RAY_TMP" "${RAY_NODE_FLAGS[@]}" )
  wait_http ray-head "http://$HOST:$RAY_DASHBOARD_PORT/api/gcs_healthz"
  wait_ray_node ray-head "$RAY_HEAD_IP"
  chmod 700 "$RAY_TMP"  # `ray start` opens it to every local user (mode 777): its sockets and logs are this user's
  say "ray-head on $RAY_ADDRESS_OF_HEAD ($RAY_HEAD_CPUS CPU, token auth), dashboard http://$HOST:$RAY_DASHBOARD_PORT, Ray Client ray://$RAY_HEAD_IP:$RAY_CLIENT_PORT"
}

start_ray_worker() {
  if alive ray-worker; then say "ray-worker already running on $RAY_WORKER_IP"; return; fi
  alive ray-head || die "ray-worker joins ray-head, which is not running: infra/stack.sh start ray-head"
  ( ray_node_env
    start_bg ray-worker "$BIN/ray" start --address="$RAY_ADDRESS_OF_HEAD" --node-ip-address="$RAY_WORKER_IP" \
      --num-cpus="$RAY_WORKER_CPUS" --temp-dir="$RAY_TMP" "${RAY_NODE_FLAGS[@]}" )
  wait_ray_node ray-worker "$RAY_WORKER_IP"
  chmod 700 "$RAY_TMP"
  say "ray-worker on $RAY_WORKER_IP ($RAY_WORKER_CPUS CPU) in the cluster at $RAY_ADDRESS_OF_HEAD"
}

# ---------------------------------------------------------------------------------------------------- worker
start_worker() {
  if alive worker; then say "worker already running (pool $POOL)"; return; fi
  # the worker's environment is its flow runs': they track into this stack's MLflow, send heartbeats, and their
  # model stages on `runtime.launcher: ray` are drivers of this stack's Ray cluster (its token, its S3 bucket)
  ( export PREFECT_HOME="$STATE/prefect-home" PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api" \
      PREFECT_API_AUTH_STRING="$RLHF_PREFECT_AUTH" PREFECT_FLOWS_HEARTBEAT_FREQUENCY="$HEARTBEAT_S" \
      MLFLOW_TRACKING_URI="http://$HOST:$MLFLOW_PORT" MLFLOW_TRACKING_USERNAME="$RLHF_MLFLOW_USER" \
      MLFLOW_TRACKING_PASSWORD="$RLHF_MLFLOW_PASSWORD"
    ray_client_env
    start_bg worker "$BIN/prefect" worker start --pool "$POOL" --type process --name "$POOL-$(hostname)" )
  sleep 2
  alive worker || die "the worker exited; see $LOGS/worker.log"
  say "worker on pool $POOL (log $LOGS/worker.log)"
}

# ---------------------------------------------------------------------------------------------------- commands
cmd_env() {
  cat <<EOF
export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api
export PREFECT_API_AUTH_STRING='$RLHF_PREFECT_AUTH'
export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
export MLFLOW_TRACKING_USERNAME='$RLHF_MLFLOW_USER'
export MLFLOW_TRACKING_PASSWORD='$RLHF_MLFLOW_PASSWORD'
export AWS_ACCESS_KEY_ID='$RLHF_S3_KEY_ID'
export AWS_SECRET_ACCESS_KEY='$RLHF_S3_SECRET'
export RLHF_S3_ENDPOINT=http://$HOST:$S3_PORT
export RLHF_DVC_REMOTE=s3://$DVC_BUCKET
export AWS_ENDPOINT_URL=http://$HOST:$S3_PORT
export RAY_ADDRESS=$RAY_ADDRESS_OF_HEAD
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH='$RAY_TOKEN'
unset RAY_AUTH_TOKEN
export RLHF_RAY_STORAGE=s3://$RAY_BUCKET/runs
# a driver on this machine (\`rlhf stage\` with runtime.launcher ray) joins the cluster through the head's node
export RAY_NODE_IP_ADDRESS=$RAY_HEAD_IP
EOF
}

cmd_status() {
  local name state url
  for name in "${SERVICES[@]}"; do
    case $name in
      postgres) url="$HOST:$PG_PORT"; if [[ -f $PGDATA/PG_VERSION ]] && as_pg "$(pg_bin)/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then state=running; else state=stopped; fi ;;
      s3) url="http://$HOST:$S3_PORT" ;;
      mlflow) url="http://$HOST:$MLFLOW_PORT" ;;
      prefect) url="http://$HOST:$PREFECT_PORT" ;;
      ray-head) url="$RAY_ADDRESS_OF_HEAD, dashboard http://$HOST:$RAY_DASHBOARD_PORT" ;;
      ray-worker) url="$RAY_WORKER_IP, in the cluster at $RAY_ADDRESS_OF_HEAD" ;;
      worker) url="pool $POOL" ;;
    esac
    [[ $name == postgres ]] || { if alive "$name"; then state=running; else state=stopped; fi; }
    printf '%-10s %-8s %s\n' "$name" "$state" "$url"
  done
  echo "logs: $LOGS (Ray's: $RAY_TMP/session_latest/logs)"
}

start_one() {
  case $1 in
    postgres) start_postgres ;; s3) start_s3 ;; mlflow) start_mlflow ;; prefect) start_prefect ;;
    ray-head) start_ray_head ;; ray-worker) start_ray_worker ;; worker) start_worker ;;
    *) die "unknown service '$1': expected one of ${SERVICES[*]}" ;;
  esac
}

stop_all() {
  local name
  for name in worker ray-worker ray-head prefect mlflow s3 postgres; do stop_service "$name"; done
}

main() {
  local command=${1:-}
  case $command in
    up)
      check_settings; load_secrets
      start_postgres; start_s3; start_mlflow; start_prefect; start_ray_head; start_ray_worker; start_worker
      say "up; logs in $LOGS. Point the pipeline here with: eval \"\$(infra/stack.sh env)\"" ;;
    down) load_secrets; stop_all ;;
    status) load_secrets; cmd_status ;;
    env) check_settings; load_secrets; cmd_env ;;
    start) check_settings; load_secrets; start_one "${2:?start SERVICE}" ;;
    stop) load_secrets; [[ " ${SERVICES[*]} " == *" ${2:-?} "* ]] || die "unknown service '${2:-}': expected one of ${SERVICES[*]}"
          [[ $2 != ray-head ]] || stop_service ray-worker  # a node cannot outlive its head
          stop_service "$2" ;;
    reset) load_secrets; stop_all; rm -rf "$STATE" "$RAY_TMP"
           say "state folder $STATE deleted" ;;
    *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
       [[ -z $command || $command == help || $command == -h ]] || exit 2 ;;
  esac
}

main "$@"
