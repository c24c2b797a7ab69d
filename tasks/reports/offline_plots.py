"""`dvc plots show` offline: the HTML template DVC fills, with Vega, Vega-Lite and Vega-Embed inlined.

DVC's own page loads the three libraries from a CDN (dvc_render's `VegaRenderer.SCRIPTS`), so without a network
its reward, KL and length charts vanish and only the PNGs show. `.dvc/config` points `plots.html_template` at
`.dvc/offline-plots.html`, which this module writes from the libraries vl-convert-python ships in its wheel
(BSD-3; no network). The template has no `{scripts}` placeholder, so DVC adds no CDN tag; each chart's inline
`vegaEmbed(...)` call finds the library already loaded in the page's head.

Regenerate after upgrading vl-convert-python (tests/test_dvc.py checks the committed file is current):

    python -m tasks.reports.offline_plots
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[2] / ".dvc" / "offline-plots.html"
VEGA_LITE = "5.21"  # DVC's plot templates are Vega-Lite v5 specs

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <!-- Vega @VEGA@, Vega-Lite @VEGA_LITE@, Vega-Embed @VEGA_EMBED@ (BSD-3-Clause, vega.github.io), inlined by
         tasks/reports/offline_plots.py from vl-convert-python @VL_CONVERT@ so the page needs no network -->
    <script type="text/javascript">
@BUNDLE@
    </script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def template_html() -> str:
    """The template's text: DVC's page with the libraries inlined instead of loaded from a CDN."""
    from importlib.metadata import version

    import vl_convert

    filled = {"@VEGA@": vl_convert.get_vega_version(), "@VEGA_LITE@": VEGA_LITE,
              "@VEGA_EMBED@": vl_convert.get_vega_embed_version(), "@VL_CONVERT@": version("vl-convert-python")}
    page = PAGE
    for token, value in filled.items():
        page = page.replace(token, value)
    return page.replace("@BUNDLE@", vl_convert.javascript_bundle(vl_version=VEGA_LITE))  # last: it is 0.9 MB

if __name__ == "__main__":
    TEMPLATE.write_text(template_html())
    print(f"wrote {TEMPLATE} ({TEMPLATE.stat().st_size / 1e6:.1f} MB)")
