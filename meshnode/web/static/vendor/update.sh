#!/usr/bin/env bash
# Re-vendor the web pages' third-party code from the npm registry, exactly the
# versions VENDORED.md names (change them there and here together). Run from the
# repository's root: bash meshnode/web/static/vendor/update.sh
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent marked@18.3.0 dompurify@3.5.0 uplot@1.6.32 >/dev/null)
for p in marked-18.3.0 dompurify-3.5.0 uplot-1.6.32; do mkdir "$tmp/$p" && tar xzf "$tmp/$p.tgz" -C "$tmp/$p"; done
cp "$tmp/marked-18.3.0/package/lib/marked.umd.js" marked.umd.js
cp "$tmp/marked-18.3.0/package/LICENSE" LICENSE.marked
cp "$tmp/dompurify-3.5.0/package/dist/purify.min.js" purify.min.js
cp "$tmp/dompurify-3.5.0/package/LICENSE" LICENSE.dompurify
cp "$tmp/uplot-1.6.32/package/dist/uPlot.iife.min.js" uPlot.iife.min.js
cp "$tmp/uplot-1.6.32/package/dist/uPlot.min.css" uPlot.min.css
cp "$tmp/uplot-1.6.32/package/LICENSE" LICENSE.uplot
sha256sum "$tmp"/*.tgz | sed "s#$tmp/##"
