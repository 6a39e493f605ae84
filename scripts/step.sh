# step NAME TIMEOUT_S CMD...: run CMD under a timeout, log to $LOGS/NAME.log, print its tail and record the
# outcome in SUMMARY (sourced by the GPU scripts; they set LOGS, and STEP_TAIL / STEP_WIDTH if they like).
# The summary quotes the log's last line that matches STEP_RESULT (an extended regex; unset: any line), or the
# last line when none matches, so a traceback printed after pytest's result line does not hide the result.
declare -a SUMMARY
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  local result; result=$(grep -E "${STEP_RESULT:-}" "$LOGS/$name.log" | tail -n 1)
  [ -n "$result" ] || result=$(tail -n 1 "$LOGS/$name.log")
  local verdict=ok; [ $rc -ne 0 ] && verdict="FAILED rc=$rc"; [ $rc -eq 124 ] && verdict="TIMED OUT"
  SUMMARY+=("$(printf "%-${STEP_WIDTH:-22}s %-14s %4ds  %s" "$name" "$verdict" $((SECONDS - t0)) \
              "${result:0:90}")")
  echo "== $name: $verdict"; tail -n "${STEP_TAIL:-15}" "$LOGS/$name.log"
}
