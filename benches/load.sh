#!/usr/bin/env bash
# Loopback HTTP load through tongs and through nginx configured the same way, in one run.
#
# An origin nginx (one worker, several ports, each answering `200 ok` at once) stands in for the
# endpoints. wrk drives the same load directly at the origin (reference), through tongs, and through an
# nginx reverse proxy (least_conn, upstream keepalive). For each it reports req/s, p50/p99 latency, the
# proxy's own CPU time per request (utime+stime from /proc) and its peak RSS (VmHWM).
#
#   bash benches/load.sh                         # 10 s per target, 64 connections
#   DURATION=30 CONNECTIONS=256 bash benches/load.sh
#
# Environment: DURATION (seconds, default 10), CONNECTIONS (default 64), WARMUP (seconds, default 2),
# ORIGINS (origin ports, default 2), BUILD_TIMEOUT (seconds for cargo build, default 1800).
# Needs root only to install nginx and wrk when they are missing. Listens on 127.0.0.1 only.

set -euo pipefail

DURATION=${DURATION:-10}
DURATION=${DURATION%s}
CONNECTIONS=${CONNECTIONS:-64}
WARMUP=${WARMUP:-2}
WARMUP=${WARMUP%s}
ORIGINS=${ORIGINS:-2}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-1800}
THREADS=1

die() {
    echo "load.sh: $*" >&2
    exit 1
}

for var in DURATION CONNECTIONS WARMUP ORIGINS BUILD_TIMEOUT; do
    [[ ${!var} =~ ^[0-9]+$ ]] || die "$var must be a whole number, got '${!var}'"
done
((DURATION > 0 && CONNECTIONS > 0 && ORIGINS >= 2)) || die "need DURATION > 0, CONNECTIONS > 0, ORIGINS >= 2"

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tongs-load.XXXXXX")

# --- cleanup: every process this script started, even on failure -----------------------------------

PIDS=() # masters / main processes, stopped in reverse order

stop_pid() {
    local pid=$1 children i
    kill -0 "$pid" 2>/dev/null || return 0
    children=$(pgrep -P "$pid" || true)
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL "$pid" 2>/dev/null || true
    fi
    for child in $children; do
        kill -KILL "$child" 2>/dev/null || true
    done
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    local status=$? i
    trap - EXIT INT TERM
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        stop_pid "${PIDS[i]}"
    done
    if ((status != 0)) && [[ -d $WORK ]]; then
        for log in "$WORK"/*.log "$WORK"/*/error.log; do
            [[ -s $log ]] || continue
            echo "--- $log (last lines) ---" >&2
            tail -n 20 "$log" >&2
        done
    fi
    rm -rf "$WORK"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- tools -----------------------------------------------------------------------------------------

PATH=$PATH:/usr/sbin:/sbin
if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then
    ((EUID == 0)) || die "nginx and wrk are needed; run as root to install them, or install them yourself"
    echo "installing nginx and wrk from Debian packages..." >&2
    export DEBIAN_FRONTEND=noninteractive
    if ! timeout 600 apt-get install -y -q nginx wrk >"$WORK/apt.log" 2>&1; then
        timeout 600 apt-get update -q >>"$WORK/apt.log" 2>&1 || die "apt-get update failed (apt.log below)"
        timeout 600 apt-get install -y -q nginx wrk >>"$WORK/apt.log" 2>&1 ||
            die "apt-get install -y nginx wrk failed (apt.log below)"
    fi
    command -v nginx >/dev/null && command -v wrk >/dev/null ||
        die "nginx or wrk still not on PATH after installing them"
fi

echo "building tongs (cargo build --release)..." >&2
(cd "$ROOT" && timeout "$BUILD_TIMEOUT" cargo build --release --quiet) || die "cargo build --release failed"
TONGS=$ROOT/target/release/tongs
[[ -x $TONGS ]] || die "$TONGS was not built"

CLK_TCK=$(getconf CLK_TCK)
NPROC=$(nproc)

# --- helpers ---------------------------------------------------------------------------------------

USED_PORTS=" "
# Ports are picked below the kernel's ephemeral range: one inside it can be taken by an outgoing
# connection (wrk's, the proxies' upstream ones) between the check here and the server's bind, which
# failed runs with "Address already in use".
EPHEMERAL_LOW=32768
if [[ -r /proc/sys/net/ipv4/ip_local_port_range ]]; then
    read -r EPHEMERAL_LOW _ </proc/sys/net/ipv4/ip_local_port_range
fi
(( EPHEMERAL_LOW > 11000 )) || EPHEMERAL_LOW=32768
free_port() {
    local port i
    for ((i = 0; i < 200; i++)); do
        port=$((10000 + RANDOM % (EPHEMERAL_LOW - 10000)))
        [[ $USED_PORTS == *" $port "* ]] && continue
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            USED_PORTS+="$port "
            echo "$port"
            return
        fi
    done
    die "found no free port on 127.0.0.1"
}

# http_get PORT PATH: prints the response (status line, headers, body) of a GET over HTTP/1.1.
http_get() {
    timeout 5 bash -c '
        exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
        printf "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" "$2" >&3
        cat <&3' _ "$1" "$2" 2>/dev/null
}

# wait_ok PORT PATH PID WHAT: waits (at most 10 s) until GET PATH answers 200, while PID lives.
wait_ok() {
    local port=$1 path=$2 pid=$3 what=$4 i
    for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || die "$what exited during startup"
        if http_get "$port" "$path" | head -n 1 | grep -q ' 200 '; then
            return 0
        fi
        sleep 0.1
    done
    die "$what did not answer 200 on 127.0.0.1:$port$path within 10 s"
}

# process_group PID: the process and its direct children (nginx master and workers).
process_group() {
    echo "$1"
    pgrep -P "$1" || true
}

# cpu_ticks PID...: "utime stime" summed over the processes (all threads included).
cpu_ticks() {
    local user=0 sys=0 pid stat rest
    for pid in "$@"; do
        stat=$(cat "/proc/$pid/stat" 2>/dev/null) || continue
        rest=${stat##*) } # fields from 3 on; comm (field 2) may hold spaces
        read -r -a fields <<<"$rest"
        user=$((user + fields[11])) # utime: field 14
        sys=$((sys + fields[12]))   # stime: field 15
    done
    echo "$user $sys"
}

# peak_rss_kb PID...: VmHWM summed over the processes.
peak_rss_kb() {
    local total=0 pid kb
    for pid in "$@"; do
        kb=$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || true)
        total=$((total + ${kb:-0}))
    done
    echo "$total"
}

# start_nginx NAME: runs nginx in the foreground (daemon off) with $WORK/NAME as prefix and
# $WORK/NAME/nginx.conf as configuration; sets NGINX_STARTED to the master's pid.
start_nginx() {
    local name=$1 prefix=$WORK/$1
    nginx -t -q -p "$prefix" -e "$prefix/error.log" -c "$prefix/nginx.conf" 2>"$WORK/$name-check.log" ||
        die "nginx rejected the $name configuration: $(cat "$WORK/$name-check.log")"
    nginx -p "$prefix" -e "$prefix/error.log" -c "$prefix/nginx.conf" </dev/null >"$WORK/$name.log" 2>&1 &
    NGINX_STARTED=$!
    PIDS+=("$NGINX_STARTED")
}

# nginx_common NAME: makes the prefix directory and prints the top of its configuration.
nginx_common() {
    local prefix=$WORK/$1
    mkdir -p "$prefix/logs" "$prefix/tmp"
    cat <<EOF
daemon off;
pid $prefix/nginx.pid;
error_log $prefix/error.log warn;
events { worker_connections 8192; }
EOF
}

http_common() {
    local prefix=$WORK/$1
    cat <<EOF
    access_log off;
    client_body_temp_path $prefix/tmp/body;
    proxy_temp_path $prefix/tmp/proxy;
    fastcgi_temp_path $prefix/tmp/fastcgi;
    uwsgi_temp_path $prefix/tmp/uwsgi;
    scgi_temp_path $prefix/tmp/scgi;
    keepalive_requests 1000000;
EOF
}

# --- origin: instant endpoints --------------------------------------------------------------------

ORIGIN_PORTS=()
for ((i = 0; i < ORIGINS; i++)); do
    ORIGIN_PORTS+=("$(free_port)")
done
{
    nginx_common origin
    echo "worker_processes 1;"
    echo "http {"
    http_common origin
    for port in "${ORIGIN_PORTS[@]}"; do
        cat <<EOF
    server {
        listen 127.0.0.1:$port;
        location / { default_type text/plain; return 200 "ok\n"; }
    }
EOF
    done
    echo "}"
} >"$WORK/origin.conf"
mv "$WORK/origin.conf" "$WORK/origin/nginx.conf"
start_nginx origin
ORIGIN_PID=$NGINX_STARTED
for port in "${ORIGIN_PORTS[@]}"; do
    wait_ok "$port" / "$ORIGIN_PID" "origin nginx"
done

# --- proxy A: tongs --------------------------------------------------------------------------------

TONGS_PORT=$(free_port)
TONGS_ADMIN=$(free_port)
{
    echo "listen: 127.0.0.1:$TONGS_PORT"
    echo "admin: { listen: 127.0.0.1:$TONGS_ADMIN }"
    echo "discovery:"
    echo "  static:"
    for port in "${ORIGIN_PORTS[@]}"; do
        echo "    - url: http://127.0.0.1:$port"
    done
} >"$WORK/tongs.yaml"
RUST_LOG=warn "$TONGS" run --config "$WORK/tongs.yaml" </dev/null >"$WORK/tongs.log" 2>&1 &
TONGS_PID=$!
PIDS+=("$TONGS_PID")
wait_ok "$TONGS_ADMIN" /readyz "$TONGS_PID" "tongs"
wait_ok "$TONGS_PORT" / "$TONGS_PID" "tongs"

# --- proxy B: nginx, configured the same way -------------------------------------------------------

NGINX_WORKERS=$NPROC
NGINX_PORT=$(free_port)
{
    nginx_common proxy
    echo "worker_processes $NGINX_WORKERS;"
    echo "http {"
    http_common proxy
    echo "    upstream endpoints {"
    echo "        least_conn;"
    for port in "${ORIGIN_PORTS[@]}"; do
        echo "        server 127.0.0.1:$port;"
    done
    cat <<EOF
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        location / {
            proxy_pass http://endpoints;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
} >"$WORK/proxy.conf"
mv "$WORK/proxy.conf" "$WORK/proxy/nginx.conf"
start_nginx proxy
NGINX_PID=$NGINX_STARTED
wait_ok "$NGINX_PORT" / "$NGINX_PID" "nginx proxy"

# --- load ------------------------------------------------------------------------------------------

# run_wrk PORT SECONDS OUT: wrk with the chosen load; its output goes to OUT.
run_wrk() {
    timeout $(($2 + 30)) wrk -t"$THREADS" -c"$CONNECTIONS" -d"$2s" --latency "http://127.0.0.1:$1/" >"$3" 2>&1 ||
        die "wrk against 127.0.0.1:$1 failed: $(cat "$3")"
}

# wrk's latency figures in milliseconds ("1.23ms", "456.00us", "1.02s").
to_ms() {
    awk -v v="$1" 'BEGIN {
        if (v ~ /us$/) { sub(/us$/, "", v); printf "%.3f", v / 1000 }
        else if (v ~ /ms$/) { sub(/ms$/, "", v); printf "%.3f", v }
        else if (v ~ /m$/) { sub(/m$/, "", v); printf "%.3f", v * 60000 }
        else if (v ~ /s$/) { sub(/s$/, "", v); printf "%.3f", v * 1000 }
        else { printf "%s", v }
    }'
}

ROWS=()
SPLIT=()
WARNINGS=()
declare -A RPS CPU

# measure NAME PORT PID: warm up, then one measured run; appends a table row.
measure() {
    local name=$1 port=$2 pid=$3 out=$WORK/wrk-$1.txt procs before after requests rps p50 p99 cpu rss user sys
    echo "load: $name (${WARMUP}s warm-up, ${DURATION}s measured)..." >&2
    ((WARMUP > 0)) && run_wrk "$port" "$WARMUP" "$WORK/warmup-$name.txt"
    mapfile -t procs < <(process_group "$pid")
    before=$(cpu_ticks "${procs[@]}")
    run_wrk "$port" "$DURATION" "$out"
    after=$(cpu_ticks "${procs[@]}")
    kill -0 "$pid" 2>/dev/null || die "$name exited under load"
    requests=$(awk '/ requests in / { print $1 }' "$out")
    rps=$(awk '/^Requests\/sec:/ { print $2 }' "$out")
    p50=$(to_ms "$(awk '$1 == "50%" { print $2 }' "$out")")
    p99=$(to_ms "$(awk '$1 == "99%" { print $2 }' "$out")")
    [[ -n $requests && -n $rps && $requests -gt 0 ]] || die "could not read wrk's output for $name: $(cat "$out")"
    read -r user sys <<<"$(awk -v b="$before" -v a="$after" 'BEGIN { split(b, x, " "); split(a, y, " "); print y[1] - x[1], y[2] - x[2] }')"
    cpu=$(awk -v t=$((user + sys)) -v hz="$CLK_TCK" -v n="$requests" 'BEGIN { printf "%.1f", t / hz * 1e6 / n }')
    SPLIT+=("$name $(awk -v u="$user" -v s="$sys" -v hz="$CLK_TCK" -v n="$requests" 'BEGIN { printf "%.1f user + %.1f sys", u / hz * 1e6 / n, s / hz * 1e6 / n }')")
    rss=$(peak_rss_kb "${procs[@]}")
    RPS[$name]=$rps
    CPU[$name]=$cpu
    ROWS+=("| $name | $(printf '%.0f' "$rps") | $p50 ms | $p99 ms | $cpu | $(awk -v k="$rss" 'BEGIN { printf "%.1f MiB", k / 1024 }') |")
    if grep -qE 'Non-2xx|Socket errors' "$out"; then
        WARNINGS+=("$name: $(grep -E 'Non-2xx|Socket errors' "$out" | tr -s ' ' | paste -sd ';' -)")
    fi
}

measure "origin (direct)" "${ORIGIN_PORTS[0]}" "$ORIGIN_PID"
measure "tongs" "$TONGS_PORT" "$TONGS_PID"
measure "nginx" "$NGINX_PORT" "$NGINX_PID"

# --- report ----------------------------------------------------------------------------------------

echo
echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "machine: $NPROC CPUs, $(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo), kernel $(uname -r)"
echo "versions: $("$TONGS" --version), $(nginx -v 2>&1 | sed 's/^nginx version: //'), $(wrk -v 2>&1 | head -n 1 | awk '{ print $1, $2 }')"
echo "load: wrk -t$THREADS -c$CONNECTIONS -d${DURATION}s --latency (after a ${WARMUP}s warm-up), GET / -> 200 \"ok\\n\""
echo "origin: one nginx, worker_processes 1, $ORIGINS ports answering at once; the direct row hits one port"
echo "nginx proxy: worker_processes $NGINX_WORKERS, least_conn, upstream keepalive 64; tongs: default tokio multi-thread runtime (one worker per CPU)"
echo "everything (wrk, origin, proxy) shares the same $NPROC CPUs"
echo
echo "| proxy | req/s | p50 | p99 | CPU µs/req | peak RSS |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
printf '%s\n' "${ROWS[@]}"
echo
echo "CPU µs/req: the row's own process(es) utime+stime over the measured run / requests completed; the"
echo "origin row is the origin nginx itself. Peak RSS: VmHWM; for nginx summed over master + workers"
echo "(shared pages are counted once per process, so it overstates)."
echo "CPU µs/req split: $(printf '%s; ' "${SPLIT[@]}" | sed 's/; $//')"
awk -v tr="${RPS[tongs]}" -v nr="${RPS[nginx]}" -v tc="${CPU[tongs]}" -v nc="${CPU[nginx]}" 'BEGIN {
    printf "tongs/nginx: req/s %.2fx, CPU per request %.2fx\n", tr / nr, (nc > 0 ? tc / nc : 0)
}'
for warning in "${WARNINGS[@]}"; do
    echo "warning: $warning"
done
