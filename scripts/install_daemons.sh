#!/usr/bin/env bash
# The programs the multi-node launcher tests start for real (tests/dist/test_launcher_daemons.py):
# sshd + ssh, pdsh, Open MPI's mpirun, and a Slurm cluster's daemons (munged, slurmctld, slurmd, srun).
# Installs the missing ones from the Debian archive (about 30 s on a fresh machine).
#
# Idempotent and quiet: when everything is there it only looks the programs up. It never fails the
# caller (scripts/setup.sh): without root, apt-get or the archive it prints one loud line, and those
# tests skip naming what is missing (or fail, with ZEROSPEED_REQUIRE_DAEMONS=1 as in CI).
# ZEROSPEED_NO_DAEMONS=1 skips the installation.
set -uo pipefail

PACKAGES=(openssh-server openssh-client pdsh openmpi-bin munge slurmctld slurmd slurm-client)
PROGRAMS=(/usr/sbin/sshd ssh pdsh mpirun /usr/sbin/munged /usr/sbin/slurmctld /usr/sbin/slurmd srun)
LOG="${TMPDIR:-/tmp}/zerospeed-install-daemons.log"

missing() {
  local p
  for p in "${PROGRAMS[@]}"; do command -v "$p" >/dev/null 2>&1 || printf '%s ' "$p"; done
}

warn() {
  echo "zerospeed: WARNING: $* -- the multi-node daemon tests will skip (see $LOG)" >&2
}

main() {
  [ "${ZEROSPEED_NO_DAEMONS:-0}" = 1 ] && return 0
  local need
  need="$(missing)"
  [ -z "$need" ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    warn "missing ${need}and cannot install ${PACKAGES[*]} (needs root and apt-get)"
    return 0
  fi
  echo "installing ${PACKAGES[*]} for the multi-node launcher tests (missing: ${need% }) ..."
  export DEBIAN_FRONTEND=noninteractive
  local install=(timeout 600 apt-get install -y -q --no-install-recommends "${PACKAGES[@]}")
  # Note [apt-get update only on failure]: the package lists are usually there; refreshing them
  # first would cost a download on every fresh machine even when the install would succeed.
  if ! "${install[@]}" >"$LOG" 2>&1; then
    timeout 300 apt-get update -q >>"$LOG" 2>&1
    "${install[@]}" >>"$LOG" 2>&1 || { warn "apt-get install ${PACKAGES[*]} failed"; return 0; }
  fi
  need="$(missing)"
  [ -n "$need" ] && warn "still missing ${need}after installing ${PACKAGES[*]}"
  return 0
}

main
