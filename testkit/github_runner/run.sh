#!/bin/sh
# The stand-in for actions/runner's run.sh (which cannot be downloaded here): the same command
# line (./run.sh --jitconfig <encoded config>, or ACTIONS_RUNNER_INPUT_JITCONFIG), one job, exit.
# Self-contained: this folder is what a machine's image provides (e.g. /opt/actions-runner).
#
# The listener's exit codes become run.sh's as the real run.sh and run-helper.sh.template map
# them (actions/runner src/Misc/layoutroot): 0 and 1 (terminated) end with 0, 2 relaunches it,
# 7 (a runner version GitHub no longer accepts) ends with 7 only when
# ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE=1 (else the listener itself says 1, and run.sh
# 0: the deprecation is silent), anything else ends with 0. INT and TERM go to the listener, as
# run.sh's runWithManualTrap does with RUNNER_MANUALLY_TRAP_SIG set.
here=$(dirname "$0")
while :; do
    python3 "$here/runner.py" "$@" &
    pid=$!
    trap 'kill -TERM $pid 2>/dev/null' INT TERM
    wait $pid
    code=$?
    trap - INT TERM
    case $code in
        2) echo "Runner listener exit with retryable error, re-launch runner in 5 seconds."; sleep 5 ;;
        7)
            if [ "$ACTIONS_RUNNER_RETURN_VERSION_DEPRECATED_EXIT_CODE" = "1" ]; then
                echo "Runner listener exit with deprecated version exit code: 7."
                exit 7
            fi
            exit 0
            ;;
        *) echo "Exiting runner..."; exit 0 ;;
    esac
done
