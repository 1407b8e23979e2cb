#!/usr/bin/env bash
# Renders the docs' pictures from their text sources and checks the rendered pages as a reader
# sees them:
#   docs/img/src/*.dot      → docs/img/<name>.svg and .png      (Graphviz `dot`)
#   README.md, docs/architecture.md → docs/img/readme.png, docs/img/architecture-page.png
#                            (GitHub's Markdown CSS, screenshot by headless Chromium)
# Needs: apt-get install graphviz chromium fonts-dejavu-core; npm (for github-markdown-css);
# .venv (markdown-it-py). Run from the repository root: bash scripts/render_docs_images.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for src in docs/img/src/*.dot; do
    name=$(basename "$src" .dot)
    dot -Tsvg "$src" -o "docs/img/$name.svg"
    dot -Tpng -Gdpi=110 "$src" -o "docs/img/$name.png"
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent github-markdown-css@5.9.0 > /dev/null && tar xzf github-markdown-css-*.tgz)
render() {  # render MARKDOWN OUT.png HEIGHT
    .venv/bin/python - "$1" "$work/page.html" "$work/package/github-markdown-light.css" "$PWD" <<'PY'
import sys
from pathlib import Path
from markdown_it import MarkdownIt
source, out, css, root = sys.argv[1:]
md = MarkdownIt("commonmark").enable("table").enable("strikethrough")
body = md.render(Path(source).read_text())
base = Path(root, source).parent.as_uri() + "/"
Path(out).write_text(f"""<!doctype html><html><head><meta charset="utf-8"><base href="{base}">
<style>{Path(css).read_text()}
body {{ background: #fff; }} .markdown-body {{ max-width: 900px; margin: 24px auto; padding: 32px;
border: 1px solid #d0d7de; border-radius: 6px; }}</style></head>
<body><article class="markdown-body">{body}</article></body></html>""")
PY
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --allow-file-access-from-files \
        --window-size=1000,"$3" --screenshot="$2" "file://$work/page.html" 2> /dev/null
}
render README.md docs/img/readme.png 2600
render docs/architecture.md docs/img/architecture-page.png 2000
ls -l docs/img/*.png docs/img/*.svg | awk '{print $5, $9}'
