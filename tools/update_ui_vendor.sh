#!/usr/bin/env bash
# Refresh the web UI's third-party libraries in api/ui/static/vendor/ from the npm registry.
#
# The UI works offline, so its Markdown renderer (marked), HTML sanitizer (DOMPurify) and code
# highlighter (highlight.js, the build of its common languages) ship inside the Python package.
# This script installs the pinned versions with npm into a temporary folder and copies their
# browser builds and licence files into the package; the results are committed, so installing
# the package never runs npm. Source-map comments are dropped, as the maps are not shipped.
#
# Usage: tools/update_ui_vendor.sh   (needs node and npm; bump the versions below first)
set -euo pipefail

MARKED_VERSION=18.2.1
DOMPURIFY_VERSION=3.4.18
HIGHLIGHT_VERSION=11.12.0

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENDOR="$ROOT/api/ui/static/vendor"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

cd "$WORK"
npm init -y >/dev/null
npm install --silent --no-audit --no-fund --ignore-scripts \
    "marked@$MARKED_VERSION" "dompurify@$DOMPURIFY_VERSION" \
    "@highlightjs/cdn-assets@$HIGHLIGHT_VERSION"

modules="$WORK/node_modules"
hljs="$modules/@highlightjs/cdn-assets"
rm -rf "$VENDOR"
mkdir -p "$VENDOR"

copy_script() {  # source destination: the file without its sourceMappingURL comment
    grep -v '^//# sourceMappingURL=' "$1" >"$VENDOR/$2"
}
copy_script "$modules/marked/lib/marked.umd.js" marked.min.js
copy_script "$modules/dompurify/dist/purify.min.js" purify.min.js
copy_script "$hljs/highlight.min.js" highlight.min.js
cp "$hljs/styles/github.min.css" highlight-light.min.css
cp "$hljs/styles/github-dark.min.css" highlight-dark.min.css
mv highlight-*.min.css "$VENDOR/"
cp "$modules/marked/LICENSE" "$VENDOR/LICENSE.marked"
cp "$modules/dompurify/LICENSE" "$VENDOR/LICENSE.dompurify"
cp "$hljs/LICENSE" "$VENDOR/LICENSE.highlightjs"

cat >"$VENDOR/VERSIONS" <<EOF
# Written by tools/update_ui_vendor.sh from the npm registry; do not edit by hand.
marked $MARKED_VERSION: marked.min.js (lib/marked.umd.js), LICENSE.marked
dompurify $DOMPURIFY_VERSION: purify.min.js (dist/purify.min.js), LICENSE.dompurify
@highlightjs/cdn-assets $HIGHLIGHT_VERSION: highlight.min.js (common languages),
  highlight-light.min.css (styles/github.min.css), highlight-dark.min.css
  (styles/github-dark.min.css), LICENSE.highlightjs
EOF
echo "updated $VENDOR"
ls -l "$VENDOR"
