"""Figures for the HTML report, as inline PNG data URIs.

Everything is drawn in units of each check's own bound: log10(error / bound), so 0 is the bound,
negative is inside it and positive is a failure, whatever the tensor's scale or dtype. Exact checks
have bound 0; they are divided by a tiny epsilon instead, so an exact check that matched (error 0)
sits at the floor and one that missed by any amount sits at the ceiling.

matplotlib is imported here only (html.py imports this module lazily), through its object API: a
`Figure` drawn by the Agg canvas, no pyplot, so the process-wide backend is never switched.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.figure import Figure

# Where a tensor sits in the flow of a step; a stage not
# listed (replicas, or one added later) sorts first.
STAGE_ORDER = {
    "weights": 0,
    "forward": 1,
    "loss": 2,
    "backward": 3,
    "grads": 4,
    "optimizer": 5,
    "buffers": 6,
}
EXACT_EPS = 1e-300  # stands in for a bound of 0 (exact checks): any nonzero error is off the scale
CAP = 6.0  # colour range [-CAP, +CAP] decades around the bound
MAX_ANNOTATED_CELLS = 400  # beyond this the numbers in the cells are unreadable; colours only
PAGE_WIDTH_IN = 12.0  # the HTML page's content width at 96 dpi
CELL_IN = 0.42  # a heatmap cell's width: wide enough for its number
ROW_IN = 0.32  # a heatmap row's height
MAX_LEGEND = 12  # tensors named in the per-step plot's legend; the others share one grey entry
PNG_META = {"Software": None}  # no matplotlib version in the bytes: same report, same image
# beyond this many tensor columns (a sweep of models whose tensors share no names) the heatmap is
# drawn one column per stage: thousands of one-row columns say nothing a page can show
MAX_COLUMNS = 200


def log_ratio(error: float, bound: float) -> float:
    """log10(error / bound) clipped to [-CAP, CAP]; NaN
    errors (non-finite TP tensors) count as CAP."""
    if math.isnan(error) or math.isinf(error):
        return CAP
    if error <= 0:
        return -CAP
    return max(-CAP, min(CAP, math.log10(error / max(bound, EXACT_EPS))))


def column_stages(cases: list[dict]) -> dict[str, tuple[int, int, str]]:
    """Per checked tensor name: (latest stage's order, first seq at that stage, that stage). A name
    is placed by its latest stage (param:w is loaded at 'weights' and updated at 'optimizer')."""
    place: dict[str, tuple[int, int, str]] = {}
    for case in cases:
        for c in case.get("checks", []):
            here = (STAGE_ORDER.get(c["stage"], -1), c["seq"], c["stage"])
            now = place.get(c["name"], (-2, 0, ""))
            if here[0] > now[0] or (here[0] == now[0] and here[1] < now[1]):
                place[c["name"]] = here
    return place


def tensor_columns(cases: list[dict]) -> list[str]:
    """Checked tensor names in the order data flows: output, loss, input grads, param grads, params.
    A name is placed by its latest stage (param:w is loaded at 'weights' and
    updated at 'optimizer')."""
    place = column_stages(cases)
    return sorted(place, key=lambda n: place[n][:2])


def column_panels(cols: list[str], stages: list[str], per_panel: int) -> list[list[int]]:
    """The heatmap's columns cut into panels of at most `per_panel`, each stage's columns kept
    together where they fit (a stage wider than a panel is split): indices into `cols`."""
    per_panel = max(1, per_panel)
    groups: list[list[int]] = []
    for j in range(len(cols)):
        if groups and stages[groups[-1][-1]] == stages[j]:
            groups[-1].append(j)
        else:
            groups.append([j])
    panels: list[list[int]] = []
    for group in groups:
        if panels and len(panels[-1]) + len(group) <= per_panel:
            panels[-1].extend(group)
            continue
        size = -(-len(group) // -(-len(group) // per_panel))  # equal parts, none a stub
        for k in range(0, len(group), size):
            panels.append(group[k : k + size])
    return panels


def heatmap_matrix(cases: list[dict]) -> tuple[list[str], list[str], np.ndarray]:
    """Rows: cases, columns: tensors; cell: max over ranks, steps and stages of log_ratio (NaN when
    the case never checked that tensor, e.g. a hang)."""
    cols = tensor_columns(cases)
    index = {n: j for j, n in enumerate(cols)}
    m = np.full((len(cases), len(cols)), np.nan)
    for i, case in enumerate(cases):
        for c in case.get("checks", []):
            j = index[c["name"]]
            v = log_ratio(c["error"], c["bound"])
            m[i, j] = v if np.isnan(m[i, j]) else max(m[i, j], v)
    return [c["name"] for c in cases], cols, m


def by_stage(cases: list[dict]) -> list[dict]:
    """The cases with each check renamed to its stage (`stage:forward`, ...): drawn by
    `heatmap_png`, a cell is then the worst check of that stage, relative to its own bound."""
    return [
        {
            "name": case["name"],
            "checks": [
                {**c, "name": f"stage:{c['stage']}", "seq": STAGE_ORDER.get(c["stage"], 0)}
                for c in case.get("checks", [])
            ],
        }
        for case in cases
    ]


def bound_cmap() -> ListedColormap:
    """Greens below the bound (darker = further inside), reds above; a visible step at the bound;
    grey where a tensor was not checked."""
    below = colormaps["Greens_r"](np.linspace(0.05, 0.8, 128))
    above = colormaps["Reds"](np.linspace(0.3, 1.0, 128))
    return ListedColormap(np.vstack([below, above]), name="tpcheck_bound").with_extremes(
        bad="#d0d0d0"
    )


def failing_columns(cases: list[dict]) -> list[str]:
    """The tensors some case failed at (error beyond its bound), in the heatmap's order: the
    region the page shows first."""
    _, cols, m = heatmap_matrix(cases)
    with np.errstate(invalid="ignore"):
        beyond = np.nan_to_num(m, nan=-CAP) > 0
    return [c for j, c in enumerate(cols) if beyond[:, j].any()]


def heatmap_png(cases: list[dict], only: list[str] | None = None) -> str:
    """The case x tensor heatmap as a data URI (`only`: these tensors' columns alone): wider than
    the page, its columns are cut into panels stacked one under the other, by stage (forward,
    loss, backward, grads, optimizer)."""
    rows, cols, m = heatmap_matrix(cases)
    if only is not None:
        keep = [j for j, c in enumerate(cols) if c in set(only)]
        cols, m = [cols[j] for j in keep], m[:, keep]
    place = column_stages(cases)
    stages = [place[c][2] for c in cols]
    labels = 0.075 * max(map(len, rows)) + 0.2  # inches of row labels at fontsize 9
    per_panel = int((PAGE_WIDTH_IN - labels - 1.3) / CELL_IN)
    panels = column_panels(cols, stages, per_panel)
    width = labels + 1.3 + CELL_IN * max(map(len, panels))
    heights = [
        0.35 + 0.065 * max(len(cols[j]) for j in panel) + max(1.6, ROW_IN * len(rows))
        for panel in panels
    ]
    fig = Figure(figsize=(width, sum(heights) + 0.2), dpi=96, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    annotate = m.size <= MAX_ANNOTATED_CELLS or max(map(len, panels)) * len(rows) <= 200
    for ax, panel in zip(axes, panels):
        sub = m[:, panel]
        image = ax.imshow(
            np.ma.masked_invalid(sub),
            cmap=bound_cmap(),
            norm=Normalize(-CAP, CAP),
            aspect="auto",
            interpolation="nearest",
            extent=(-0.5, len(panel) - 0.5, len(rows) - 0.5, -0.5),
        )
        ax.set_xlim(-0.5, max(map(len, panels)) - 0.5)
        names = [cols[j] for j in panel]
        ax.set_xticks(range(len(panel)), names, rotation=40, ha="right", fontsize=9)
        ax.set_yticks(range(len(rows)), rows, fontsize=9)
        ax.set_xticks(np.arange(-0.5, len(panel)), minor=True)
        ax.set_yticks(np.arange(-0.5, len(rows)), minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        if len(panels) > 1:
            seen = list(dict.fromkeys(stages[j] or "other" for j in panel))
            ax.set_title(" · ".join(seen), fontsize=9, loc="left")
        if annotate:
            _annotate(ax, sub)
    bar = fig.colorbar(image, ax=list(axes), shrink=min(0.9, 4.0 / sum(heights) + 0.3), pad=0.01)
    bar.set_ticks(np.arange(-CAP, CAP + 1, 2))
    bar.set_label("log10(error / bound)   0 = the bound", fontsize=9)
    return _data_uri(fig)


def _annotate(ax, m: np.ndarray) -> None:
    for (i, j), v in np.ndenumerate(m):
        if np.isnan(v):
            text = "–"
        elif v >= CAP:
            text = f"≥{CAP:g}"
        elif v <= -CAP:
            text = f"≤−{CAP:g}"
        else:
            text = f"{v:+.1f}".replace("-", "−")
        dark = not np.isnan(v) and abs(v) > 0.55 * CAP
        ax.text(
            j,
            i,
            text,
            ha="center",
            va="center",
            fontsize=8,
            color="white" if dark else "black",
            fontweight="bold" if not np.isnan(v) and v > 0 else "normal",
        )


def step_curves(case: dict) -> dict[str, dict[int, float]]:
    """Per tensor, per step (>= 1): max over ranks and stages of error / bound (0 for exact
    matches); only the tensors whose figure moved from one step to another (a line pinned at one
    value, an exact match at the floor say, shows nothing a step adds)."""
    curves: dict[str, dict[int, float]] = {}
    for c in case.get("checks", []):
        if c["step"] < 1:
            continue
        ratio = 10.0 ** log_ratio(c["error"], c["bound"])
        per_step = curves.setdefault(c["name"], {})
        per_step[c["step"]] = max(per_step.get(c["step"], 0.0), ratio)
    moved = {n for n, per_step in curves.items() if len(set(per_step.values())) > 1}
    return {n: curves[n] for n in tensor_columns([case]) if n in moved}


def curve_series(case: dict) -> list[tuple[str, list[int], list[float], bool]]:
    """The per-step plot's lines: (legend label, steps, error / bound, labelled). The
    MAX_LEGEND tensors that came closest to (or past) their bound are labelled, each once; the rest
    are drawn thin and grey under one entry, so the legend stays short and every text is unique."""
    curves = step_curves(case)
    order = sorted(curves, key=lambda n: -max(curves[n].values()))
    top = set(order[:MAX_LEGEND]) if len(order) > MAX_LEGEND + 1 else set(order)
    series = []
    for name, per_step in curves.items():
        steps = sorted(per_step)
        series.append((name, steps, [per_step[s] for s in steps], name in top))
    return series


def curves_figure(case: dict) -> Figure:
    """error / bound against step, one line per tensor, log scale, the bound drawn at 1."""
    series = curve_series(case)
    fig = Figure(figsize=(11.0, 3.8), dpi=96, layout="constrained")
    ax = fig.add_subplot()
    styles = ["-", "--", ":", "-."]
    rest = [s for s in series if not s[3]]
    inside = all(v <= 1.0 for s in rest for v in s[2])
    rest_label = f"{len(rest)} other tensor(s)" + (", all inside the bound" if inside else "")
    for k, (_, steps, values, _) in enumerate(rest):
        ax.plot(
            steps,
            values,
            color="#b8b8b8",
            linewidth=0.8,
            zorder=1,
            label=rest_label if k == 0 else "_nolegend_",
        )
    labelled = [s for s in series if s[3]]
    for k, (name, steps, values, _) in enumerate(labelled):
        ax.plot(
            steps,
            values,
            styles[(k // 10) % 4],
            marker="o",
            markersize=3,
            linewidth=1.2,
            zorder=2,
            label=name,
        )
    ax.axhline(1.0, color="black", linewidth=1, label="bound")
    ax.set_yscale("log")
    ax.set_ylim(10**-CAP / 2, 10**CAP * 2)
    # a forward-only case: each step a fresh batch through the forward, no optimizer
    ax.set_xlabel(
        "step (forward only: a fresh batch)" if case.get("forward_only") else "optimizer step"
    )
    ax.set_ylabel("error / bound (max over ranks)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), ncols=1)
    return fig


def curves_png(case: dict) -> str:
    return _data_uri(curves_figure(case))


def _data_uri(fig: Figure) -> str:
    """The figure as a PNG data URI, its colours reduced to a 256-entry palette (a heatmap's cells
    and text need no more; a quarter of the bytes of 32-bit RGBA)."""
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata=PNG_META, bbox_inches="tight", pad_inches=0.08)
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    small = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(small, "png", optimize=True)
    return "data:image/png;base64," + base64.b64encode(small.getvalue()).decode("ascii")
