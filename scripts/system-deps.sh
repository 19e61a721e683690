#!/usr/bin/env bash
# Installs (once) the Debian packages the test suite drives for real: Chromium for the dashboard's browser tests,
# buildah and debootstrap to build and run the container image. Nothing is downloaded outside Debian's mirror (no
# browser builds from test tools). Without root or apt-get it only says what is missing; the tests that need a
# missing tool then fail under CI=true and are skipped, with the reason, elsewhere.
set -euo pipefail
needed=(chromium:/usr/bin/chromium buildah:/usr/bin/buildah debootstrap:/usr/sbin/debootstrap)
missing=()
for entry in "${needed[@]}"; do
  [ -x "${entry#*:}" ] || missing+=("${entry%%:*}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo ">> missing Debian packages: ${missing[*]} (install them as root: apt-get install ${missing[*]})" >&2
  exit 0
fi
echo ">> installing Debian packages: ${missing[*]} (first run only)" >&2
# a loaded machine may hold dpkg's lock for a while: wait for it rather than fail
apt_opts=(-o DPkg::Lock::Timeout=600 -q)
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
{ apt-get "${apt_opts[@]}" update && apt-get "${apt_opts[@]}" install -y --no-install-recommends "${missing[@]}"; } \
  >"$log" 2>&1 || { cat "$log" >&2; echo ">> apt-get failed (above)" >&2; exit 1; }
