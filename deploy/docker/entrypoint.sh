#!/bin/sh
# The image's entrypoint, behind dumb-init (PID 1: forwards SIGTERM, reaps children).
#
#   <image>                      -> qworker run
#   <image> --until-idle 300     -> qworker run --until-idle 300   (options go to `run`)
#   <image> produce -i ...       -> qworker produce -i ...         (any other subcommand)
#
# `exec` replaces this shell, so qworker receives the signals dumb-init forwards and
# its exit code (0, 1, 69, 70, 75: docs/operations.md) is the container's, unchanged;
# AWS Batch's evaluateOnExit and the Job's podFailurePolicy key on it.
# tests/deploy/test_image.py runs this script through dumb-init with a stand-in qworker.
set -eu
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    set -- run "$@"
fi
exec qworker "$@"
