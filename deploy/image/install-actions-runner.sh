#!/bin/sh
# Install a pinned GitHub Actions runner release at /opt/actions-runner, for a machine image
# (docs/operator/deployment.md, "The machine image"). Run it as root while building the image.
#   RUNNER_VERSION=2.x.y RUNNER_SHA256=<sha256 of its linux-x64 tarball> sh install-actions-runner.sh
# The release page lists each tarball's sha256; the install stops when the download differs.
set -eu
: "${RUNNER_VERSION:?set RUNNER_VERSION, e.g. 2.321.0}"
: "${RUNNER_SHA256:?set RUNNER_SHA256 to the tarball's sha256}"
RUNNER_DIR=${RUNNER_DIR:-/opt/actions-runner}
ARCH=${RUNNER_ARCH:-x64}
TARBALL=actions-runner-linux-${ARCH}-${RUNNER_VERSION}.tar.gz
URL=https://github.com/actions/runner/releases/download/v${RUNNER_VERSION}/${TARBALL}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -fsSL --retry 3 -o "$tmp/$TARBALL" "$URL"
echo "$RUNNER_SHA256  $tmp/$TARBALL" | sha256sum -c -
mkdir -p "$RUNNER_DIR"
tar -xzf "$tmp/$TARBALL" -C "$RUNNER_DIR"
"$RUNNER_DIR/bin/installdependencies.sh"          # the runner's libraries (ICU, …)
# Read-only for jobs: each runner job copies it into its own work folder and runs it there.
chown -R root:root "$RUNNER_DIR"
chmod -R a+rX,go-w "$RUNNER_DIR"
echo "actions runner $RUNNER_VERSION at $RUNNER_DIR"
