#!/bin/sh
# The stand-in for actions/runner's run.sh (which cannot be downloaded here): the same command
# line (./run.sh --jitconfig <encoded config>, or ACTIONS_RUNNER_INPUT_JITCONFIG), one job, exit.
# Self-contained: this folder is what a machine's image provides (e.g. /opt/actions-runner).
here=$(dirname "$0")
exec python3 "$here/runner.py" "$@"
