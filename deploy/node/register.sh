#!/bin/sh
# A GPU node's entrypoint for tongs over Tailscale: join the tailnet in userspace mode, then register
# this node's Tailscale address with tongs (POST /v1/nodes/register) until tongs answers 200, then run
# the model server. A SaladCloud container is unprivileged (no TUN device) and has no cluster
# networking, so tailscaled runs with --tun=userspace-networking and the registration reaches tongs
# through tailscaled's own SOCKS5 proxy, the name resolved by tailscaled (MagicDNS).
#
#   ENTRYPOINT ["/register.sh"]  CMD ["vllm", "serve", "...", "--port", "8000"]
#
# Needs in the image: tailscaled and tailscale, curl, and jq when POD_METADATA_YAML is used.
#
# Environment:
#   TONGS_REGISTER_URL        https://tongs.<tailnet>.ts.net/v1/nodes/register (the sidecar's
#                             MagicDNS name; deploy/components/tailscale publishes only this path)
#   TONGS_REGISTRATION_TOKEN  the fleet's registration token (tongs' registration.token_file)
#   TS_AUTHKEY                a Tailscale auth key for the nodes: reusable, ephemeral, pre-authorised,
#                             tagged for the nodes (deploy/README.md, "Tailscale")
#   MODEL_PORT                the port the model server listens on (registered as <Tailscale IP>:port)
#   The node's pod, from either of:
#     POD_NAMESPACE, POD_NAME, POD_UID   interLink: valueFrom.fieldRef metadata.namespace, .name, .uid
#     POD_METADATA_YAML                  SaladCloud: the Virtual Kubelet sets it to the pod's metadata
#                                        as JSON (it resolves no valueFrom, so the POD_* need not be set)
# Optional:
#   TS_SOCKS5_SERVER          where tailscaled's SOCKS5 proxy listens (localhost:1055)
#   TS_SOCKET                 tailscaled's LocalAPI socket (/tmp/tailscaled.sock)
#   TS_STATE_DIR              tailscaled's state (/tmp/tailscale; an ephemeral node needs no more)
#   REGISTER_MAX_DELAY        longest wait between attempts in seconds (30); waits double from 1
#   DRAIN_WAIT                seconds between telling tongs the node is going and stopping the model
#                             server, on SIGTERM (20): keep it under the pod's grace period
#   TONGS_DRAIN_URL           where to say so (TONGS_REGISTER_URL with /register replaced by /drain)
#   SKIP_TAILSCALE=1          test mode: no tailscaled, register TONGS_NODE_IP directly without a proxy
#
# Exit status (without a command to run): 0 once registered; 2 on a missing setting; 3 when tongs
# refuses the registration for good (400, 401, 403: a retry cannot help). 404 (tongs does not see the
# pod yet: its watch lags the pod's creation), 409 (the pod has another address for now), 5xx and
# network errors are retried. With a command, registration runs beside it, and the command runs as the
# script's child: on SIGTERM (the pod deleted, the node reclaimed) the script first tells tongs the node
# is going (POST /v1/nodes/drain, with DRAIN_WAIT as the seconds left: tongs sends it nothing new and
# moves its streams that can be continued to other nodes before then), waits DRAIN_WAIT seconds for the
# rest to finish, then passes SIGTERM on and exits with the command's status.
set -eu

say() { printf 'register.sh: %s\n' "$*" >&2; }
need() { eval "[ -n \"\${$1:-}\" ]" || { say "$1 is not set"; exit 2; }; }

need TONGS_REGISTER_URL
need TONGS_REGISTRATION_TOKEN
need MODEL_PORT
TS_SOCKS5_SERVER=${TS_SOCKS5_SERVER:-localhost:1055}
TS_SOCKET=${TS_SOCKET:-/tmp/tailscaled.sock}
TS_STATE_DIR=${TS_STATE_DIR:-/tmp/tailscale}
REGISTER_MAX_DELAY=${REGISTER_MAX_DELAY:-30}
DRAIN_WAIT=${DRAIN_WAIT:-20}
TONGS_DRAIN_URL=${TONGS_DRAIN_URL:-${TONGS_REGISTER_URL%/register}/drain}
case $DRAIN_WAIT in
  *[!0-9]*|'') say "DRAIN_WAIT must be a whole number of seconds: '$DRAIN_WAIT'"; exit 2 ;;
esac

# The pod: from the downward API, else from SaladCloud's POD_METADATA_YAML.
field() {
  [ -n "${POD_METADATA_YAML:-}" ] || { say "set POD_NAMESPACE, POD_NAME and POD_UID, or POD_METADATA_YAML"; exit 2; }
  printf '%s' "$POD_METADATA_YAML" | jq -er ".$1" || { say "POD_METADATA_YAML has no $1"; exit 2; }
}
namespace=${POD_NAMESPACE:-$(field namespace)}
pod=${POD_NAME:-$(field name)}
uid=${POD_UID:-$(field uid)}
# Kubernetes names and UIDs need no JSON escaping; anything else is refused rather than sent mangled.
for value in "$namespace" "$pod" "$uid" "$MODEL_PORT"; do
  case $value in
    *[!a-z0-9.-]*|'') say "unexpected pod field or port: '$value'"; exit 2 ;;
  esac
done

if [ "${SKIP_TAILSCALE:-}" = 1 ]; then
  need TONGS_NODE_IP
  ip=$TONGS_NODE_IP
  proxy=
else
  need TS_AUTHKEY
  mkdir -p "$TS_STATE_DIR"
  tailscaled --tun=userspace-networking --socks5-server="$TS_SOCKS5_SERVER" \
    --statedir="$TS_STATE_DIR" --socket="$TS_SOCKET" &
  # tailscaled takes a moment to open its LocalAPI socket, which `tailscale up` needs.
  tries=0
  until [ -S "$TS_SOCKET" ]; do
    tries=$((tries + 1))
    [ "$tries" -lt 60 ] || { say "tailscaled did not start"; exit 1; }
    sleep 1
  done
  tailscale --socket="$TS_SOCKET" up --authkey="$TS_AUTHKEY" --hostname="$pod"
  ip=$(tailscale --socket="$TS_SOCKET" ip -4 | head -n 1)
  [ -n "$ip" ] || { say "no Tailscale IPv4 address after tailscale up"; exit 1; }
  proxy=$TS_SOCKS5_SERVER
fi

body=$(printf '{"namespace":"%s","pod":"%s","uid":"%s","address":"%s:%s"}' \
  "$namespace" "$pod" "$uid" "$ip" "$MODEL_PORT")

register() {
  # The token goes in a header file, not on the command line, where ps would show it.
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  printf 'Authorization: Bearer %s\n' "$TONGS_REGISTRATION_TOKEN" > "$work/headers"
  delay=1
  while :; do
    # --socks5-hostname: tailscaled resolves the MagicDNS name; the node's own DNS cannot.
    status=$(curl -sS -o "$work/answer" -w '%{http_code}' --max-time 10 \
      ${proxy:+--socks5-hostname "$proxy"} -X POST -H "@$work/headers" \
      -H 'Content-Type: application/json' --data "$body" "$TONGS_REGISTER_URL") || status=000
    case $status in
      200)
        say "registered $namespace/$pod at $ip:$MODEL_PORT"
        return 0 ;;
      400|401|403)
        say "tongs refused the registration with $status: $(head -c 300 "$work/answer" 2>/dev/null)"
        case $status in
          401) say "check TONGS_REGISTRATION_TOKEN against tongs' registration token" ;;
          403) say "wrong-uid: this is not the pod's UID; not-allowed: tongs' allow list leaves out $ip" ;;
        esac
        return 3 ;;
      4??)
        case $status in
          404|409) ;;
          *) say "tongs answered $status: $(head -c 300 "$work/answer" 2>/dev/null)"; return 3 ;;
        esac ;;
    esac
    say "not registered yet ($status), again in ${delay}s"
    sleep "$delay"
    delay=$((delay * 2))
    [ "$delay" -le "$REGISTER_MAX_DELAY" ] || delay=$REGISTER_MAX_DELAY
  done
}

# Tells tongs the node is going, DRAIN_WAIT seconds from now: once, within 10 s, whatever it answers
# (the node goes either way). Called from the SIGTERM trap, which shellcheck does not follow.
# shellcheck disable=SC2317
going() {
  notice=$(printf '{"namespace":"%s","pod":"%s","uid":"%s","seconds":%s}' \
    "$namespace" "$pod" "$uid" "$DRAIN_WAIT")
  headers=$(mktemp)
  printf 'Authorization: Bearer %s\n' "$TONGS_REGISTRATION_TOKEN" > "$headers"
  status=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 \
    ${proxy:+--socks5-hostname "$proxy"} -X POST -H "@$headers" \
    -H 'Content-Type: application/json' --data "$notice" "$TONGS_DRAIN_URL") || status=000
  rm -f "$headers"
  say "told tongs $namespace/$pod goes in ${DRAIN_WAIT}s ($status)"
}

if [ "$#" -eq 0 ]; then
  register
  exit $?
fi
# The model server starts at once; tongs' heartbeats decide when it takes traffic.
( register ) &
"$@" &
server=$!
stopping=
# shellcheck disable=SC2317
stop() {
  [ -z "$stopping" ] || return 0
  stopping=1
  going
  sleep "$DRAIN_WAIT"
  kill -TERM "$server" 2>/dev/null || true
}
trap stop TERM INT
# A trapped signal ends `wait` early: wait again until the command itself has ended.
code=0
while :; do
  wait "$server" && code=0 || code=$?
  kill -0 "$server" 2>/dev/null || break
done
exit "$code"
