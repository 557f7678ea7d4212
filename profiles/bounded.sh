# Sourced by the profiling scripts. bounded SECONDS CMD...: CMD under `timeout -k 10 SECONDS` (0:
# no limit). GNU timeout runs its command in a process group of its own, which a caller's time
# limit (a signal to this script's group) would miss, leaving ncu or compute-sanitizer running past
# the script; so it runs in the background, and a SIGTERM or SIGINT to the script is passed on to
# it (timeout hands it to its command, and kills it 10 s later), waited for, and the script exits.
bounded() {
  local limit=$1 pid="" status
  shift
  # set before the fork: a signal between the fork and `pid=$!` still finds it through $!
  trap 'p=${pid:-${!:-}}; [ -n "$p" ] && { kill -TERM "$p" 2>/dev/null; wait "$p"; }; exit 143' TERM INT
  timeout -k 10 "$limit" "$@" &
  pid=$!
  wait "$pid"
  status=$?
  trap - TERM INT
  return $status
}
