# step NAME TIMEOUT_S CMD...: run CMD under a timeout, log to $LOGS/NAME.log, print its tail and record the
# outcome in SUMMARY (sourced by the GPU scripts; they set LOGS, and STEP_TAIL / STEP_WIDTH if they like).
# The summary quotes the log's last line that matches STEP_RESULT (an extended regex; default: pytest's result
# line), or its last line when none matches, so a traceback printed at exit after pytest's result line (JAX
# re-raises a failed side-effecting call's error then, docs/errors.md) does not hide the result; such a traceback is
# marked in the summary.
declare -a SUMMARY
STEP_PYTEST_RESULT='^(=+ )?(no tests ran|[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?))'\
'(, [0-9]+ [a-z]+)* in [0-9.]+s'
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  local result mark=""; result=$(grep -E "${STEP_RESULT:-$STEP_PYTEST_RESULT}" "$LOGS/$name.log" | tail -n 1)
  [ -n "$result" ] || result=$(tail -n 1 "$LOGS/$name.log")
  grep -q '^Exception ignored' "$LOGS/$name.log" && mark=" [+ a traceback at exit]"
  local verdict=ok; [ $rc -ne 0 ] && verdict="FAILED rc=$rc"; [ $rc -eq 124 ] && verdict="TIMED OUT"
  SUMMARY+=("$(printf "%-${STEP_WIDTH:-22}s %-14s %4ds  %s" "$name" "$verdict" $((SECONDS - t0)) \
              "${result:0:$((90 - ${#mark}))}$mark")")
  echo "== $name: $verdict"; tail -n "${STEP_TAIL:-15}" "$LOGS/$name.log"
}

# pack_logs DIR NAME: the device tool brings back at most 8 files from $OUT, so on the GPU machine (OUT set) DIR's
# files go into one archive, DIR/NAME.tgz (the originals removed), once the script has read them; without OUT
# they stay as they are. The summary the script printed is unchanged.
pack_logs() {
  local dir=$1 name=$2
  [ -n "${OUT:-}" ] && [ -d "$dir" ] || return 0
  (cd "$dir" && find . -maxdepth 1 -type f ! -name '*.tgz' -printf '%f\n' | sort |
    tar czf "$name.tgz" --remove-files -T -) || echo "pack_logs: could not pack $dir" >&2
}
