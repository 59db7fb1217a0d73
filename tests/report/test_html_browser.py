"""The HTML report in a real headless browser (Debian's chromium; CI installs it in .ci/run):
it renders to a non-blank page, shows the verdicts, and raises no errors."""

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="chromium is not installed (CI installs it: `apt-get install -y chromium`, see .ci/run)",
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_S = 90

# Injected into a copy of the page (the report itself has no script): collects script errors, failed
# resources, console.error calls and undecoded images into the DOM, where --dump-dom shows them.
PROBE = """<script>
(function(){var errs=[];function put(){var p=document.getElementById('probe')||document.createElement('pre');
p.id='probe';p.textContent='errors='+errs.length+(errs.length?': '+errs.join(' | '):'');
if(!p.parentNode)(document.body||document.documentElement).appendChild(p);}
window.addEventListener('error',function(e){
 errs.push('error: '+(e.message||(e.target&&e.target.outerHTML||'').slice(0,80)));},true);
var ce=console.error;console.error=function(){
 errs.push('console.error: '+[].join.call(arguments,' '));ce.apply(console,arguments);};
window.addEventListener('load',function(){var n=0;for(var i=0;i<document.images.length;i++){var im=document.images[i];
if(im.complete&&im.naturalWidth>0)n++;else errs.push('image not decoded: '+im.alt);}
put();document.getElementById('probe').setAttribute('data-images',document.images.length+'/'+n);});})();
</script>"""  # noqa: E501 - the script as the browser reads it


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    proc = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def with_probe(page: str, path: Path) -> str:
    path.write_text(page.replace("</head>", PROBE + "</head>", 1))
    return path.as_uri()


def dump_dom(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    return chromium(
        tmp_path,
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
        *args,
        "--dump-dom",
        url,
    )


def test_screenshot_is_a_rendered_page(seed_run, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "page.png"
    chromium(
        tmp_path, f"--screenshot={shot}", "--window-size=1280,2000", seed_run.html_path.as_uri()
    )
    pixels = imread(shot)[..., :3]  # [2000, 1280, 3] floats in [0, 1]
    assert pixels.shape[:2] == (2000, 1280)
    assert pixels.std() > 0.05  # not a blank page
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    red = ((r > 0.45) & (g < 0.2) & (b < 0.2)).mean()  # failing heatmap cells
    green = ((g > 0.5) & (g - r > 0.15) & (g - b > 0.15)).mean()  # cells inside the bound
    assert red > 0.005 and green > 0.005, (red, green)


def test_dom_has_the_verdicts_and_no_errors(seed_run, tmp_path):
    url = with_probe(seed_run.html_path.read_text(), tmp_path / "page.html")
    proc = dump_dom(tmp_path, url)
    dom = proc.stdout
    assert "3 of 3 case(s) as expected" in dom
    for case in seed_run.report["cases"]:
        assert case["name"] in dom and case["verdict"] in dom
    # the failing region of the heatmap, and every check's folded under it: both decoded
    assert '<pre id="probe" data-images="2/2">errors=0</pre>' in dom, dom[-1500:]
    assert "Uncaught" not in proc.stderr and ":CONSOLE" not in proc.stderr


def test_probe_catches_errors(tmp_path):
    """The probe is not blind: a broken image and a throwing script are reported."""
    page = (
        "<!DOCTYPE html><html><head><title>t</title></head><body><img alt=broken "
        "src='data:image/png;base64,AAAA'><script>undefinedFunction()</script></body></html>"
    )
    proc = dump_dom(tmp_path, with_probe(page, tmp_path / "bad.html"))
    assert 'data-images="1/0"' in proc.stdout
    assert "image not decoded: broken" in proc.stdout and "undefinedFunction" in proc.stdout
    assert "Uncaught ReferenceError" in proc.stderr  # and chromium's log shows it too


# Injected with PROBE: after load, at the window's width, every table, image and <pre> in a case's
# card (or on the page) must end inside that card, or sit in a wrapper that scrolls sideways (then
# the wrapper must); every table's first row must have as many headers as its widest row has cells.
LAYOUT = """<script>
window.addEventListener('load',function(){var bad=[],scrolled=0;
function scrolls(e){var o=getComputedStyle(e).overflowX;return o==='auto'||o==='scroll';}
var els=document.querySelectorAll('table,img,pre');
for(var i=0;i<els.length;i++){var el=els[i];if(el.id==='probe'||el.id==='layout')continue;
 var card=el.closest('section.case')||document.body,box=el;
 for(var a=el.parentElement;a&&a!==card;a=a.parentElement){if(scrolls(a)){box=a;break;}}
 if(box!==el&&el.scrollWidth>box.clientWidth)scrolled++;
 var wide=box===el&&!scrolls(el)?el.scrollWidth:box.offsetWidth;
 var right=box.getBoundingClientRect().right,limit=card.getBoundingClientRect().right;
 if(wide>card.clientWidth||right>limit+0.5)
  bad.push('too wide: '+el.tagName+' '+(el.id||el.className||el.alt||'')+' '+wide+'>'+card.clientWidth);}
var tables=document.querySelectorAll('table');
for(var t=0;t<tables.length;t++){var rows=tables[t].rows,most=0;
 for(var r=1;r<rows.length;r++)most=Math.max(most,rows[r].querySelectorAll('td').length);
 var heads=rows.length?rows[0].querySelectorAll('th'):[];var empty=0;
 for(var h=0;h<heads.length;h++)if(!heads[h].textContent.trim())empty++;
 if(heads.length!==most||empty)bad.push('headers: table '+t+' has '+heads.length+' th ('+empty+
  ' empty) for '+most+' columns');}
var p=document.createElement('pre');p.id='layout';p.setAttribute('data-scrolled',scrolled);
p.textContent='layout-problems='+bad.length+(bad.length?': '+bad.join(' | '):'');
document.body.appendChild(p);});
</script>"""  # noqa: E501 - the script as the browser reads it


def layout_of(tmp_path: Path, page: str, name: str) -> tuple[str, subprocess.CompletedProcess]:
    """The page at 1280 px with both probes: the layout line and the chromium run."""
    path = tmp_path / f"{name}.html"
    path.write_text(page.replace("</head>", PROBE + LAYOUT + "</head>", 1))
    proc = dump_dom(tmp_path, path.as_uri(), "--window-size=1280,2000")
    line = re.search(r'<pre id="layout"[^>]*>([^<]*)</pre>', proc.stdout)
    assert line, proc.stdout[-1500:]
    return line.group(1), proc


def _synthetic_pages() -> dict[str, str]:
    from tpcheck.report.html import render_html

    from report_helpers import hf_sweep_report, wide_report

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pages = {"wide": render_html(wide_report()), "hf": render_html(hf_sweep_report())}
    assert not caught, [str(w.message) for w in caught]  # no matplotlib warning either
    return pages


@pytest.mark.parametrize("name", ["seed", "wide", "hf"])
def test_nothing_is_wider_than_its_card_and_every_column_has_a_header(name, seed_run, tmp_path):
    page = seed_run.html_path.read_text() if name == "seed" else _synthetic_pages()[name]
    layout, proc = layout_of(tmp_path, page, name)
    assert layout == "layout-problems=0", layout
    assert "errors=0</pre>" in proc.stdout and "Uncaught" not in proc.stderr


def test_wide_tables_scroll_inside_their_card(tmp_path):
    """The probe is not blind: a wide table outside a wrapper is reported, one inside is not."""
    cells = "".join(f"<td>{'x' * 40}{i}</td>" for i in range(12))
    heads = "".join(f"<th>c{i}</th>" for i in range(12))
    table = f"<table><tr>{heads}</tr><tr>{cells}</tr></table>"
    page = (
        "<!DOCTYPE html><html><head><title>t</title><style>.wrap{overflow-x:auto}</style></head>"
        f"<body><section class=case>{table}</section></body></html>"
    )
    layout, _ = layout_of(tmp_path, page, "bare")
    assert layout.startswith("layout-problems=1: too wide: TABLE"), layout
    wrapped = page.replace(table, f"<div class=wrap>{table}</div>")
    layout, proc = layout_of(tmp_path, wrapped, "wrapped")
    assert layout == "layout-problems=0", layout
    assert 'data-scrolled="1"' in proc.stdout
    headless = wrapped.replace("<th>c11</th>", "")
    layout, _ = layout_of(tmp_path, headless, "headless")
    assert "headers: table 0 has 11 th (0 empty) for 12 columns" in layout, layout


# Injected: after load, where the diagnosis block and its first case's rows end, in CSS pixels from
# the top of the page (the window is 1280 x 800: visible without scrolling means within 800).
WHERE = """<script>
window.addEventListener('load',function(){var d=document.getElementById('diagnosis'),p=document.createElement('pre');
p.id='where';var dl=d&&d.querySelector('dl');
p.textContent=d?('top='+Math.round(d.getBoundingClientRect().top)+' rows_end='+Math.round(dl.getBoundingClientRect().bottom)):'none';
document.body.appendChild(p);});
</script>"""  # noqa: E501 - the script as the browser reads it


@pytest.fixture(scope="module")
def two_layer_run(tmp_path_factory):
    """A failing 2-layer model (the tiny LM: embedding, 2 layers, head), with its correct twin."""
    from report_helpers import run_with_reports

    args = ("run", "--block", "lm", "--preset", "tiny", "--world-size", "2", "--steps", "2")
    return run_with_reports(
        tmp_path_factory.mktemp("lm"), (*args, "--fault", "missing_backward_reduce")
    )


def test_the_diagnosis_is_under_the_summary_and_visible_without_scrolling(two_layer_run, tmp_path):
    """At 1280 x 800 the diagnosis (first divergence, signature, explanation) of the failing case
    ends inside the first screen; the heatmap, the plots and the case sections come after it."""
    page = two_layer_run.html_path.read_text()
    assert (
        page.index("id=diagnosis")
        < page.index("<h2>Error relative to bound")
        < page.index("section class=case")
    )
    path = tmp_path / "diag.html"
    path.write_text(page.replace("</head>", WHERE + "</head>", 1))
    proc = dump_dom(tmp_path, path.as_uri(), "--window-size=1280,800")
    where = re.search(r'<pre id="where">top=(\d+) rows_end=(\d+)</pre>', proc.stdout)
    assert where, proc.stdout[-1500:]
    top, rows_end = map(int, where.groups())
    assert 0 < top < rows_end <= 800, (top, rows_end)


def test_the_report_of_a_two_layer_case_is_small(two_layer_run):
    """The heatmap of every check is folded behind the failing region, the images in a 256-colour
    palette: the page of a 2-layer model and its twin stays under 1.5 MB."""
    assert two_layer_run.html_path.stat().st_size < 1.5e6
    assert "<details><summary>All checks: " in two_layer_run.html_path.read_text()
