#!/usr/bin/env bash
# Regenerates the PDF reader's fixtures in tests/fixtures/pdf/ (tests/tasks/readers/test_pdf.py):
#   general.pdf, design.pdf  Debian's Python FAQ pages printed by headless Chromium with its
#                            DEFAULT header (date, title) and footer (file:// URL, "n/N") and
#                            an outline (--generate-pdf-document-outline);
#   bool.pdf                 c-api/bool.html the same way: one page (its header and footer
#                            repeat nowhere);
#   hyphens.pdf              a 2-page serif page at many widths: soft hyphens, hard hyphens and
#                            compounds broken at line ends (same header and footer);
#   pageend.pdf              narrow paragraphs of hyphenated compounds over 5 pages: pages
#                            that end in a hyphen (PDFium joins them to the next page's header);
#   labels.pdf               general.pdf's pages 1-4 with page labels i, ii, 1, A-7 and its
#                            outline through GoTo actions;
#   scanned.pdf              two pages as images only (no text layer);
#   encrypted.pdf            hyphens.pdf with a user password ("secret");
#   owner_only.pdf           hyphens.pdf with only an owner password (opens without one);
#   empty.pdf                a PDF with no pages.
# Every file goes through qpdf (flate level 9, object streams) to stay small, which changes
# neither the page contents nor the outline (labels.pdf is edited as said above). Needs /usr/bin/chromium, pdftoppm, qpdf, fix-qdf
# (apt-get install -y qpdf). The date and the temporary path in the headers change on each run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=tests/fixtures/pdf
DOCS=${DOCS:-/usr/share/doc/python3.11/html}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"

print() { # print URL PDF [chromium flags...]: headless Chromium, its default header and footer
  local url=$1 pdf=$2
  shift 2
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run \
    --user-data-dir="$(mktemp -d -p "$TMP")" --generate-pdf-document-outline \
    --print-to-pdf="$pdf" "$@" "$url" 2>/dev/null
}
pack() { qpdf --recompress-flate --compression-level=9 --object-streams=generate "$@"; }

for page in general design; do
  print "file://$DOCS/faq/$page.html" "$TMP/$page.pdf"
  pack "$TMP/$page.pdf" "$OUT/$page.pdf"
done
print "file://$DOCS/c-api/bool.html" "$TMP/bool.pdf"
pack "$TMP/bool.pdf" "$OUT/bool.pdf"

{
  echo '<!doctype html><html><head><meta charset="utf-8"><title>Hyphenation sample</title>'
  echo '<style>body{font-family:serif;font-size:16px} p{margin:2px}</style></head><body>'
  echo '<p>An example of hyphenation: a well-known, object-oriented language with built-in types.</p>'
  for w in $(seq 60 4 136); do
    echo "<p style=\"width:$((w / 10)).$((w % 10))em\">Every worked exam&shy;ple of hyphen&shy;ation"
    echo "shows a well-known object-oriented language with built-in types.</p>"
  done
  echo '</body></html>'
} >"$TMP/hyphens.html"
print "file://$TMP/hyphens.html" "$TMP/hyphens.pdf"
pack "$TMP/hyphens.pdf" "$OUT/hyphens.pdf"

# Narrow paragraphs of hyphenated compounds: nearly every line ends at a hyphen, so some page's
# last line does, and PDFium joins it (U+FFFE) to the next text it draws: the next page's header.
{
  echo '<!doctype html><html><head><meta charset="utf-8"><title>Page-end hyphens</title>'
  echo '<style>body{font-family:serif;font-size:16px} p{margin:0;width:7em}</style></head><body>'
  words=(well-known object-oriented built-in read-only run-time x-www-form-urlencoded non-blocking)
  for i in $(seq 0 69); do
    echo "<p>${words[i % 7]} ${words[(i + 1) % 7]} ${words[(i + 2) % 7]}</p>"
  done
  echo '</body></html>'
} >"$TMP/pageend.html"
print "file://$TMP/pageend.html" "$TMP/pageend.pdf"
pack "$TMP/pageend.pdf" "$OUT/pageend.pdf"

# Page labels: qpdf 11.3 has no --set-page-labels, so /PageLabels goes into the catalog of a
# QDF copy (plain text) and fix-qdf repairs the offsets. Its outline entries point at their
# pages through GoTo actions (/A) instead of Chromium's /Dest, as many other writers do.
qpdf --qdf --object-streams=disable "$OUT/general.pdf" --pages . 1-4 -- "$TMP/labels.qdf"
sed -i 's|^  /Type /Catalog$|  /Type /Catalog\n  /PageLabels << /Nums [ 0 << /S /r >> 2 << /S /D >> 3 << /S /D /P (A-) /St 7 >> ] >>|' \
  "$TMP/labels.qdf"
perl -0pi -e 's{/Dest \[([^\]]*)\]}{/A << /S /GoTo /D [$1] >>}g' "$TMP/labels.qdf"
grep -aq '/PageLabels' "$TMP/labels.qdf" || { echo "no catalog found in $TMP/labels.qdf" >&2; exit 1; }
grep -aq '/S /GoTo' "$TMP/labels.qdf" || { echo "no outline found in $TMP/labels.qdf" >&2; exit 1; }
fix-qdf "$TMP/labels.qdf" >"$TMP/labels.pdf"
pack "$TMP/labels.pdf" "$OUT/labels.pdf"

pdftoppm -r 40 -gray -png -f 1 -l 2 "$OUT/general.pdf" "$TMP/scan"
{
  echo '<!doctype html><html><head><style>@page{margin:0} img{width:100%;display:block;'
  echo 'break-after:page}</style></head><body>'
  for png in "$TMP"/scan-*.png; do echo "<img src=\"file://$png\">"; done
  echo '</body></html>'
} >"$TMP/scanned.html"
print "file://$TMP/scanned.html" "$TMP/scanned.pdf" --no-pdf-header-footer
pack "$TMP/scanned.pdf" "$OUT/scanned.pdf"

qpdf --encrypt secret owner 256 -- "$OUT/hyphens.pdf" "$OUT/encrypted.pdf"
qpdf --encrypt "" owner 256 -- "$OUT/hyphens.pdf" "$OUT/owner_only.pdf"
qpdf --empty "$OUT/empty.pdf"
ls -l "$OUT"
