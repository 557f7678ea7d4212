# Sourced by the profiling scripts. bounded SECONDS CMD...: CMD under `timeout -k 10 SECONDS` (0:
# no limit). GNU timeout runs its command in a process group of its own, which a caller's time
# limit (a signal to this script's group) would miss, leaving ncu or compute-sanitizer running past
# the script; so it runs in the background, and a SIGTERM or SIGINT to the script is passed on to
# it (timeout hands it to its command, then kills it 10 s later) before the script exits.
bounded() {
  local limit=$1 pid status
  shift
  timeout -k 10 "$limit" "$@" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null; exit 143' TERM INT
  wait "$pid"
  status=$?
  trap - TERM INT
  return $status
}
