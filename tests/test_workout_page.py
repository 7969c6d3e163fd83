"""One workout's page in a real browser (openspec/specs/workouts/spec.md, WKT-9): Debian's
Chromium through Playwright, at 1280 and at 360 pixels, against a real Service holding the
bodies of tests/workout_corpus.py (posted through /api/ingest and folded), with the owner's
maximum heart rate set (``--max-heart-rate 190``).

What the page shows is read from it and compared with the corpus's own arithmetic: the
figures and their text, every route point inside the map's SVG by the test's own Web
Mercator, the start and finish marks where the route starts and ends, the scale bar's
length, the splits and zones tables. With ``--map-tiles`` (a tile server of the test's own
on 127.0.0.1), the Content-Security-Policy names that server and no other, and its tiles are
drawn under the route; without it, the page fetches nothing outside its own server.
"""

from __future__ import annotations

import http.server
import math
import urllib.parse

import pytest

import workout_corpus as wc
from dashboard_browser import OVERFLOW, Session, serving
from read_helpers import written
from conftest import LocalServer

# Its service and browser live for the module: nothing may be left running after it.
pytestmark = pytest.mark.module_lifetime

MAX_HR = 190.0
WORLD_M = 40075016.686  # the equator on Web Mercator's sphere (6,378,137 m)
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360f8cf00000301010018dd8db00000000049454e44ae426082")


@pytest.fixture(scope="module")
def corpus():
    return wc.WorkoutCorpus()


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus):
    with serving(tmp_path_factory.mktemp("workout-page") / "data", corpus.deliveries,
                 max_heart_rate=MAX_HR) as running:
        yield running


class Tiles(LocalServer):
    """A tile server of the test's own: a 1×1 PNG for every tile, the paths asked kept."""

    def __init__(self):
        asked = self.asked = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                asked.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.wfile.write(PNG)

            def log_message(self, *args):
                pass

        super().__init__(Handler, name="test-tiles")


@pytest.fixture(scope="module")
def tiles():
    server = Tiles()
    yield server
    server.close()


# -- the test's own reading -------------------------------------------------------------------


def clock(seconds: float) -> str:
    """"57:18", "1:02:05": seconds as the page writes a duration, a time or a pace."""
    whole = int(math.floor(seconds + 0.5))
    h, m, s = whole // 3600, whole % 3600 // 60, whole % 60
    return ("%d:%02d" % (h, m) if h else "%d" % m) + ":%02d" % s


def hours_minutes(seconds: float) -> str:
    """"45 min", "2 h 37 min": a workout time as the page writes one of a minute or more."""
    whole = int(math.floor(seconds / 60 + 0.5))
    return "%d min" % whole if whole < 60 else "%d h %02d min" % divmod(whole, 60)


def mercator(lat: float, lon: float) -> tuple:
    phi = math.radians(lat)
    return ((lon + 180) / 360, (1 - math.log(math.tan(phi) + 1 / math.cos(phi)) / math.pi) / 2)


def open_workout(s: Session, workout_id: str):
    page = s.page
    page.evaluate("h => { window.location.hash = h; }",
                  "#" + urllib.parse.urlencode({"view": "workout", "id": workout_id}))
    page.wait_for_selector('#workout-view[data-state="ready"][data-id="%s"]' % workout_id)
    return page


MAP = """() => {
  const svg = document.querySelector('#workout-map svg');
  const start = svg.querySelector('.route-start'), finish = svg.querySelector('.route-finish');
  const bar = svg.querySelector('.scale-bar');
  return {data: Object.assign({}, svg.dataset), box: svg.getAttribute('viewBox'),
    start: [+start.getAttribute('cx'), +start.getAttribute('cy')],
    finish: [+finish.getAttribute('x') + 5, +finish.getAttribute('y') + 5],
    bar: Object.assign({}, bar.dataset), barText: bar.textContent,
    lines: Array.from(svg.querySelectorAll('.route-line')).map(l =>
      l.getAttribute('points').split(' ').length),
    images: Array.from(svg.querySelectorAll('image')).map(i => i.getAttribute('href'))};
}"""
FIGURES = """() => Array.from(document.querySelectorAll('#workout-figures .figure')).map(f =>
  Object.assign({text: f.querySelector('dd').textContent}, f.dataset))"""
ROWS = """sel => Array.from(document.querySelectorAll(sel)).map(r =>
  Object.assign({cells: Array.from(r.children).map(c => c.textContent)}, r.dataset))"""


def check_run_page(page, run: dict, width: int) -> None:
    """The 10 km run's page against the corpus's own figures."""
    figures = {f["key"]: f for f in page.evaluate(FIGURES)}
    km = run["distance"]["qty"]
    assert figures["duration"]["text"] == clock(run["duration"])
    assert figures["distance"]["text"] == "%s km" % ("%.2f" % km).rstrip("0").rstrip(".")
    assert figures["pace"]["text"] == clock(run["duration"] / km) + " /km"
    assert float(figures["pace"]["value"]) == pytest.approx(run["duration"] / km)
    assert figures["active_energy"]["text"] == "{:,.0f} kJ".format(
        run["activeEnergyBurned"]["qty"])
    assert figures["max_heart_rate"]["text"] == "%d bpm" % run["heartRate"]["max"]["qty"]
    # every route point inside the map, by the test's own projection
    shown = page.evaluate(MAP)
    data = shown["data"]
    scale, x0, y0 = float(data["scale"]), float(data["x0"]), float(data["y0"])
    w, h = float(data["width"]), float(data["height"])
    assert shown["box"] == "0 0 %d %d" % (w, h)
    points = wc.positions(run)
    assert int(data["points"]) == len(points)
    for lat, lon, _, _ in points:
        mx, my = mercator(lat, lon)
        assert 0 <= (mx - x0) * scale <= w and 0 <= (my - y0) * scale <= h
    for mark, (lat, lon, _, _) in ((shown["start"], points[0]), (shown["finish"], points[-1])):
        mx, my = mercator(lat, lon)
        assert mark == [pytest.approx((mx - x0) * scale, abs=0.06),
                        pytest.approx((my - y0) * scale, abs=0.06)]
    # the route drawn as lines through the points drawn, each line sharing its first point
    assert sum(shown["lines"]) - (len(shown["lines"]) - 1) == int(data["drawn"])
    # the scale bar: its length in meters at the route's middle latitude, at most a quarter
    middle = (min(p[0] for p in points) + max(p[0] for p in points)) / 2
    per_px = WORLD_M * math.cos(math.radians(middle)) / scale
    meters, px = float(shown["bar"]["meters"]), float(shown["bar"]["px"])
    assert px == pytest.approx(meters / per_px) and px <= w / 4
    assert shown["barText"] in ("%d m" % meters, "%g km" % (meters / 1000))
    assert shown["images"] == []  # no tiles unless asked
    # splits: the corpus's arithmetic, and the page's text of it
    expected = wc.splits(points, 1000.0, wc.session_heart(run), wc.seconds(run["start"]))
    rows = page.evaluate(ROWS, "#workout-splits tr.split-row")
    assert len(rows) == len(expected) == 10
    for row, (meters, seconds, pace, bpm) in zip(rows, expected):
        assert float(row["seconds"]) == pytest.approx(seconds, abs=1e-5)
        assert float(row["meters"]) == pytest.approx(meters, rel=1e-9)
        assert row["cells"][1] == clock(seconds)
        assert row["cells"][2] == clock(pace) + " /km"
        assert row["cells"][3] == "%d bpm" % math.floor(bpm + 0.5)
    # zones from the owner's maximum
    end = wc.seconds(run["end"])
    zones = page.evaluate(ROWS, "#workout-zones tr.zone-row")
    want = wc.zone_seconds(wc.session_heart(run), end, MAX_HR)
    assert [float(z["seconds"]) for z in zones] == [pytest.approx(s) for s in want]
    assert [z["cells"][2] for z in zones] == [clock(s) for s in want]
    assert "190 bpm" in page.text_content("#zone-rule")
    assert page.get_attribute("#workout-gpx", "href") == "/api/workouts/%s.gpx" % run["id"]
    overflow = page.evaluate(OVERFLOW)
    assert overflow["scroll"] <= width and not overflow["out"], overflow


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1280, 360])
def test_wkt_9_1_the_run_page_at_1280_and_360_px(browser, store, corpus, width):
    s = Session(browser, store, width=width, height=900, phone=width < 400)
    try:
        run = corpus.workouts["run"]
        page = s.sign_in(view="workout", id=run["id"]).page
        check_run_page(page, run, width)
        gpx = page.request.get(store.base + page.get_attribute("#workout-gpx", "href"))
        assert gpx.status == 200 and gpx.body().count(b"<trkpt ") == len(run["route"])
        # the recovery-only heart rate is said, and nothing drawn as the session
        page = open_workout(s, corpus.workouts["bug"]["id"])
        assert "was not sent" in page.text_content("#workout-notes")
        assert page.get_attribute("#workout-heart svg", "data-session") == "0"
        # a pool swim: no route, no GPX button, its pace per 100 m
        swim = corpus.workouts["swim"]
        page = open_workout(s, swim["id"])
        assert page.is_hidden("#part-route") and page.is_hidden("#workout-gpx")
        pace = [f for f in page.evaluate(FIGURES) if f["key"] == "pace"][0]
        assert pace["text"] == clock(1800 / (swim["distance"]["qty"] * 10)) + " /100 m"
        overflow = page.evaluate(OVERFLOW)
        assert overflow["scroll"] <= width and not overflow["out"], overflow
    finally:
        s.close()


def test_wkt_9_2_the_list_opens_each_workout_and_shows_one_recorded_twice_once(browser, store,
                                                                             corpus):
    s = Session(browser, store, width=1280, height=900)
    try:
        page = s.sign_in(metric="workouts", range="custom", tz="local",
                         **{"from": "2025-06-01", "to": "2025-06-08"}).page
        items = page.evaluate(ROWS, "#records li.workout")
        sent = corpus.workouts
        in_range = {n: w for n, w in sent.items()
                    if "2025-06-01" <= w["start"][:10] <= "2025-06-08"}
        assert len(items) == len(in_range) - 1  # the run from another app is not listed
        run = [i for i in items if i.get("id") == sent["run"]["id"]][0]
        assert run["duplicates"] == "1" and "Also recorded: Morning Run" in "".join(
            run["cells"])
        day = [b for b in page.eval_on_selector_all(
            "#chart .bucket", "bs => bs.map(b => Object.assign({}, b.dataset))")
            if b["date"] == "2025-06-01"][0]
        minutes = sum(sent[n]["duration"] for n in ("run", "walk_over", "part_run")) / 60
        assert float(day["value"]) == pytest.approx(minutes) and day["count"] == "3"
        page.focus('#chart .bucket[data-date="2025-06-01"]')
        assert page.inner_text("#readout").endswith(
            ": %s of workouts (3 workouts)" % hours_minutes(minutes * 60))
        page.click('#records li.workout[data-id="%s"] a.rec-pick' % sent["ride"]["id"])
        page.wait_for_selector('#workout-view[data-state="ready"][data-id="%s"]'
                               % sent["ride"]["id"])
        assert page.text_content("#workout-title") == "Outdoor Cycling"
        # the page of the copy names the one counted
        page = open_workout(s, sent["again"]["id"])
        assert "counted once as Running" in page.text_content("#workout-notes")
        # the summary's card links each workout of the week
        page.evaluate("h => { window.location.hash = h; }", "#view=summary&date=2025-06-07")
        page.wait_for_selector('#summary[data-state="ready"][data-date="2025-06-07"]')
        card = page.evaluate(ROWS, ".workouts-card li.workout-item")
        assert sent["again"]["id"] not in {c["id"] for c in card}
        # the week's count and time: each sent workout of the 7 days, the run that another
        # app recorded too once (version 1's without a duration: its end minus its start)
        week = [w for n, w in sent.items() if n != "again"
                and "2025-06-01" <= w["start"][:10] <= "2025-06-07"]
        seconds = sum(w["duration"] if "duration" in w
                      else wc.seconds(w["end"]) - wc.seconds(w["start"]) for w in week)
        head = page.evaluate("""() => { const c = document.querySelector('.workouts-card');
          return Object.assign({value: c.querySelector('.card-value').textContent},
                               c.dataset); }""")
        assert (int(head["count"]), float(head["seconds"])) == (len(week),
                                                                pytest.approx(seconds))
        assert head["value"] == "%d workouts, %s" % (len(week), hours_minutes(seconds))
        assert sent["run"]["id"] in {c["id"] for c in card}
        assert page.get_attribute('.workouts-card li[data-id="%s"] a' % sent["run"]["id"],
                                  "href") == "#view=workout&id=" + sent["run"]["id"]
    finally:
        s.close()


def test_wkt_9_3_map_tiles_come_from_the_one_server_named_and_only_when_asked(
        browser, store, corpus, tiles, tmp_path):
    run = corpus.workouts["run"]
    s = Session(browser, store, width=1280, height=900)
    try:  # without --map-tiles: no image, the policy names no other server
        page = s.sign_in(view="workout", id=run["id"]).page
        assert page.evaluate(MAP)["images"] == []
        csp = page.request.get(store.base + "/").headers["content-security-policy"]
        assert "img-src 'self' data:;" in csp
    finally:
        s.close()
    assert tiles.asked == []
    template = tiles.origin + "/{z}/{x}/{y}.png"
    deliveries = [d for d in corpus.deliveries if d[0] == wc.WORKOUTS][:1]
    with serving(tmp_path / "data", deliveries, map_tiles=template) as tiled:
        s = Session(browser, tiled, width=1280, height=900)
        try:
            page = s.sign_in(view="workout", id=run["id"]).page
            shown = page.evaluate(MAP)
            assert shown["images"] and all(i.startswith(tiles.origin + "/") for i in
                                           shown["images"])
            z = {int(urllib.parse.urlsplit(i).path.split("/")[1]) for i in shown["images"]}
            assert len(z) == 1 and 10 <= z.pop() <= 19
            page.wait_for_function("n => performance.getEntriesByType('resource').filter(r =>"
                                   " r.name.includes('.png')).length >= n",
                                   arg=len(shown["images"]))
            assert len(tiles.asked) >= len(shown["images"])
            csp = page.request.get(tiled.base + "/").headers["content-security-policy"]
            sources = csp.split("img-src ", 1)[1].split(";", 1)[0].split()
            assert sources == ["'self'", "data:", tiles.origin]
            assert csp.count("127.0.0.1") == 1  # no other directive names it
            assert written(run["start"])  # the run's page, tiles under it, no CSP violation
        finally:
            s.close()
