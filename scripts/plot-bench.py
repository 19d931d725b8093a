#!/usr/bin/env python3
"""Plot the benchmark harness's CSV as an SVG line chart (standard library only).

Usage:
    python3 scripts/plot-bench.py bench.csv docs/bench.svg

Reads a CSV with a header line and the columns
    variant,clients,requests,seconds,throughput,p50_us,p99_us,max_us,
    ratio_bare,ratio_hand,peak_rss_kb
(lines beginning with `#` are comments) and draws throughput (requests/s)
against the number of concurrent clients (log-spaced x axis), one line per
variant, in the order the variants first appear. A variant may lack some
client counts: its line joins the ones it has.
"""

import csv
import math
import sys
from xml.sax.saxutils import escape

# Distinct colors (Okabe-Ito, then Tableau) and dash patterns: with 12
# variants no two lines share both.
COLORS = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
    "#000000", "#8C564B", "#7F7F7F", "#BCBD22", "#9467BD", "#F0E442",
]
DASHES = ["", "8 4", "2 3", "10 3 2 3", "4 4", "12 3 2 3 2 3"]
MARKERS = ["circle", "square", "diamond", "triangle"]

PLOT_W, HEIGHT = 620, 560
LEFT, TOP, BOTTOM = 90, 60, 70


def read_rows(path):
    """The CSV's rows as dicts, comments and blank lines skipped."""
    with open(path, newline="", encoding="utf-8") as f:
        lines = [l for l in f if l.strip() and not l.lstrip().startswith("#")]
    return list(csv.DictReader(lines))


def series(rows):
    """{variant: [(clients, throughput), ...]} in first-appearance order."""
    out = {}
    for row in rows:
        try:
            clients = float(row["clients"])
            throughput = float(row["throughput"])
        except (KeyError, TypeError, ValueError):
            continue
        if clients <= 0 or not math.isfinite(throughput):
            continue
        out.setdefault(row["variant"].strip(), []).append((clients, throughput))
    for points in out.values():
        points.sort()
    return out


def nice_ticks(hi, count=6):
    """Round tick values from 0 to at least `hi`."""
    if hi <= 0:
        return [0, 1]
    raw = hi / (count - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    n = math.ceil(hi / step - 1e-9)
    return [i * step for i in range(n + 1)]


def fmt(v):
    """A tick label: 12000 -> 12k, 1500000 -> 1.5M."""
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            text = f"{v / div:.1f}".rstrip("0").rstrip(".")
            return text + suffix
    return f"{v:g}"


def marker(kind, x, y, color):
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"/>'
    if kind == "square":
        return f'<rect x="{x - 3.5:.1f}" y="{y - 3.5:.1f}" width="7" height="7" fill="{color}"/>'
    if kind == "diamond":
        pts = f"{x:.1f},{y - 4.5:.1f} {x + 4.5:.1f},{y:.1f} {x:.1f},{y + 4.5:.1f} {x - 4.5:.1f},{y:.1f}"
    else:
        pts = f"{x:.1f},{y - 4.5:.1f} {x + 4.5:.1f},{y + 3.5:.1f} {x - 4.5:.1f},{y + 3.5:.1f}"
    return f'<polygon points="{pts}" fill="{color}"/>'


def render(data, title):
    # The legend's column is as wide as the longest name (about 7 px a
    # character at 12 px).
    right = 90 + 7 * max((len(name) for name in data), default=10)
    plot_w = PLOT_W
    width = LEFT + plot_w + right
    # Taller when the legend needs it (20 px a variant).
    height = max(HEIGHT, TOP + 45 + 20 * len(data))
    plot_h = height - TOP - BOTTOM
    xs = sorted({c for pts in data.values() for c, _ in pts}) or [1.0]
    lo, hi = math.log10(xs[0]), math.log10(xs[-1])
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad
    ymax = max((t for pts in data.values() for _, t in pts), default=1.0)
    yticks = nice_ticks(ymax * 1.05)
    ytop = yticks[-1] or 1.0

    def px(c):
        return LEFT + (math.log10(c) - lo) / (hi - lo) * plot_w

    def py(t):
        return TOP + plot_h - t / ytop * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{LEFT + plot_w / 2:.1f}" y="30" text-anchor="middle" font-size="16" '
        f'font-weight="bold">{escape(title)}</text>',
    ]
    # Grid and ticks.
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<line x1="{LEFT - 5}" y1="{y:.1f}" x2="{LEFT}" y2="{y:.1f}" stroke="black"/>')
        out.append(f'<text x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    for c in xs:
        x = px(c)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + plot_h}" stroke="#e5e5e5"/>')
        out.append(f'<line x1="{x:.1f}" y1="{TOP + plot_h}" x2="{x:.1f}" y2="{TOP + plot_h + 5}" stroke="black"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 20}" text-anchor="middle">{fmt(c)}</text>')
    # Axes and their labels.
    out.append(
        f'<path d="M{LEFT},{TOP} V{TOP + plot_h} H{LEFT + plot_w}" fill="none" stroke="black"/>'
    )
    out.append(
        f'<text x="{LEFT + plot_w / 2:.1f}" y="{height - 20}" text-anchor="middle">'
        "concurrent clients (log scale)</text>"
    )
    out.append(
        f'<text transform="translate(22 {TOP + plot_h / 2:.1f}) rotate(-90)" '
        'text-anchor="middle">throughput (requests/s)</text>'
    )
    # One line per variant, and the legend.
    lx, ly = LEFT + plot_w + 20, TOP + 5
    out.append(f'<text x="{lx}" y="{ly}" font-weight="bold">variant</text>')
    for i, (name, pts) in enumerate(data.items()):
        color = COLORS[i % len(COLORS)]
        dash = DASHES[i % len(DASHES)]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        kind = MARKERS[i % len(MARKERS)]
        path = " ".join(f"{'M' if j == 0 else 'L'}{px(c):.1f},{py(t):.1f}" for j, (c, t) in enumerate(pts))
        out.append(f'<g><title>{escape(name)}</title>')
        out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="2"{dash_attr}/>')
        out.extend(marker(kind, px(c), py(t), color) for c, t in pts)
        out.append("</g>")
        y = ly + 20 + i * 20
        out.append(
            f'<line x1="{lx}" y1="{y - 4}" x2="{lx + 34}" y2="{y - 4}" stroke="{color}" '
            f'stroke-width="2"{dash_attr}/>'
        )
        out.append(marker(kind, lx + 17, y - 4, color))
        out.append(f'<text x="{lx + 42}" y="{y}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    data = series(read_rows(argv[1]))
    if not data:
        sys.stderr.write(f"{argv[1]}: no rows with clients and throughput\n")
        return 1
    svg = render(data, "Throughput by concurrent clients")
    with open(argv[2], "w", encoding="utf-8") as f:
        f.write(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
