#!/usr/bin/env bash
# Refresh the uPlot charting library that `hpcrl dashboard` serves (hpcrl/dashboard/static/vendor/uplot/):
# the built IIFE bundle and its stylesheet, its MIT LICENSE, and VERSION (version, source, sha256).
# The dashboard never links a CDN: the browser only ever talks to the dashboard's own address.
#
#   bash scripts/vendor_uplot.sh            # the version pinned below
#   bash scripts/vendor_uplot.sh 1.6.33     # another version (then update UPLOT_VERSION here)
#
# Needs npm and the npm registry (`npm pack`). Without them, the same files are in the package's
# tarball (package/dist/uPlot.iife.min.js, package/dist/uPlot.min.css, package/LICENSE).
set -euo pipefail
UPLOT_VERSION=${1:-1.6.32}
cd "$(dirname "$0")/.."
dest=hpcrl/dashboard/static/vendor/uplot
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
command -v npm >/dev/null || { echo "vendor_uplot: npm not found (apt-get install npm)" >&2; exit 2; }
(cd "$tmp" && npm pack --silent "uplot@$UPLOT_VERSION" >/dev/null)
tar -xzf "$tmp/uplot-$UPLOT_VERSION.tgz" -C "$tmp"
got=$(node -e 'console.log(require(process.argv[1]).version)' "$tmp/package/package.json" 2>/dev/null \
  || sed -n 's/.*"version": *"\([^"]*\)".*/\1/p' "$tmp/package/package.json" | head -n 1)
[ "$got" = "$UPLOT_VERSION" ] || { echo "vendor_uplot: got version $got, wanted $UPLOT_VERSION" >&2; exit 1; }
mkdir -p "$dest"
cp "$tmp/package/dist/uPlot.iife.min.js" "$tmp/package/dist/uPlot.min.css" "$tmp/package/LICENSE" "$dest/"
{
  echo "uplot $UPLOT_VERSION"
  echo "source: npm pack uplot@$UPLOT_VERSION (package/dist, package/LICENSE)"
  echo "license: MIT"
  (cd "$dest" && sha256sum uPlot.iife.min.js uPlot.min.css LICENSE)
} >"$dest/VERSION"
echo "vendor_uplot: uPlot $UPLOT_VERSION -> $dest"
cat "$dest/VERSION"
