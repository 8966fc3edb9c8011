#!/usr/bin/env bash
# Makes a Docker engine available for tests/container, as root on Debian:
# installs Debian's docker.io if there is no dockerd, and starts dockerd in
# the background if `docker info` cannot reach one (machines without
# systemd, like CI's). Does nothing when a daemon already answers.
# Idempotent; the container tests run it themselves when they find no
# daemon, and .ci/run (through tests/run) runs it before the tests.
set -euo pipefail

log=${NPUPROBE_DOCKERD_LOG:-/var/log/npuprobe-dockerd.log}

if docker info >/dev/null 2>&1; then
	exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "docker-setup.sh: no Docker daemon answers, and installing or starting one needs root" >&2
	exit 1
fi

if ! command -v dockerd >/dev/null 2>&1; then
	echo "docker-setup.sh: installing docker.io"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	# --no-install-recommends: the engine, containerd, runc and tini; not
	# the recommended extras (cgroupfs-mount, git, xz-utils).
	apt-get install -y -qq --no-install-recommends docker.io >/dev/null
fi

# A service manager may start it; without one (CI), start it ourselves,
# detached from this shell so that it outlives the script.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
	systemctl start docker || true
fi
if ! docker info >/dev/null 2>&1; then
	echo "docker-setup.sh: starting dockerd (log: $log)"
	setsid nohup dockerd >>"$log" 2>&1 </dev/null &
fi
for _ in $(seq 1 60); do
	if docker info >/dev/null 2>&1; then
		exit 0
	fi
	sleep 1
done
echo "docker-setup.sh: dockerd did not answer within 60 s; the end of $log:" >&2
tail -n 30 "$log" >&2 || true
exit 1
