#!/usr/bin/env bash
# Prints every HTML page of a folder to PDF with headless Chromium (Debian's `chromium`, no
# network), its default running header (date, title) and footer (file:// URL, "n/N") kept:
# issue 32's PDF corpus (docs/documents.md).
#   infra/print_pdfs.sh [SRC] [OUT] [JOBS]
#   SRC  default /usr/share/doc/python3.11/html (apt python3.11-doc); its _sources/ skipped
#   OUT  default pdf/: OUT/<path without .html>.pdf, the folder tree kept; a PDF already
#        there is not printed again (rerun after a stop to finish)
#   JOBS Chromium processes at once (default 2)
set -euo pipefail
SRC=${1:-/usr/share/doc/python3.11/html}
OUT=${2:-pdf}
JOBS=${3:-2}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
[ -x "$CHROMIUM" ] || { echo "needs $CHROMIUM (apt-get install chromium)" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export SRC OUT CHROMIUM TMP
one() { # one() PAGE: SRC/PAGE.html -> OUT/PAGE.pdf
  local page=$1 pdf="$OUT/${1%.html}.pdf"
  [ -s "$pdf" ] && return 0
  mkdir -p "$(dirname "$pdf")"
  timeout 120 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run \
    --user-data-dir="$(mktemp -d -p "$TMP")" --print-to-pdf="$pdf.part" "file://$SRC/$page" \
    2>/dev/null && mv "$pdf.part" "$pdf"
}
export -f one
(cd "$SRC" && find . -name '*.html' -not -path './_sources/*' | sed 's|^\./||' | sort) |
  xargs -P "$JOBS" -I{} bash -c 'one "$@" || echo "not printed: $1" >&2' _ {}
echo "$(find "$OUT" -name '*.pdf' | wc -l) PDFs in $OUT"
