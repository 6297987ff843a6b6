# shellcheck shell=bash
# What the benchmarks' scripts share (benches/mixed.sh, benches/overload.sh, benches/compare/run):
# sourced, not run. Each function takes the calling script's name first, for its messages.

# Debian puts nginx and HAProxy in /usr/sbin, which a user's PATH may lack.
export PATH=$PATH:/usr/sbin:/sbin

# install_missing NAME PROGRAM...: installs the Debian package of each PROGRAM that is not on PATH (each
# package has its program's name), as root or through sudo; exits when that cannot be done.
install_missing() {
  local name=$1 tool
  shift
  local need=()
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || need+=("$tool")
  done
  ((${#need[@]})) || return 0
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "$name: ${need[*]} missing, and installing needs root or sudo; install the Debian packages (apt-get install ${need[*]}) and rerun" >&2
      exit 1
    }
    sudo=(sudo)
  fi
  echo "$name: installing ${need[*]} from Debian's packages" >&2
  if ! { "${sudo[@]}" apt-get update -qq &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"; } >&2; then
    echo "$name: could not install the Debian packages ${need[*]}; install them and rerun" >&2
    exit 1
  fi
  for tool in "${need[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || {
      echo "$name: $tool is still not on PATH after installing the Debian package $tool" >&2
      exit 1
    }
  done
}

# need_cargo NAME: exits when cargo is missing.
need_cargo() {
  command -v cargo >/dev/null 2>&1 || { echo "$1: cargo is missing (install Rust with rustup)" >&2; exit 1; }
}

# raise_fd_limit: the soft open-file limit up to the hard one. Clients, proxy and fleet share the bench
# process: hundreds to thousands of sockets at once.
raise_fd_limit() {
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
}
