"""CSV that appends and never runs: one column order for every range (READ-4.6), and no
text cell a spreadsheet could take for a formula, whatever invisible or compatibility
characters it begins with (READ-4.7).

The code points are enumerated here with ``unicodedata``: every character whose
compatibility form (NFKC) begins with ``=``, ``+``, ``-``, ``@``, ``|`` or the minus sign, and
every character a reader sees nothing of (white space, Unicode's format characters, category
``Cf``, and its default-ignorable code points, listed below from the Unicode standard).
"""

import csv
import datetime as dt
import io
import subprocess
import sys
import unicodedata

import hae_factory as hf
from conftest import Client, db_rows, wait_for
from read_helpers import get, read_csv

DEFAULT_IGNORABLE = [(0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
                     (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
                     (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
                     (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
                     (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF)]
"""Default_Ignorable_Code_Point, from Unicode's DerivedCoreProperties.txt."""
STARTS = "=+-@|\u2212"


IGNORABLE = {code for low, high in DEFAULT_IGNORABLE for code in range(low, high + 1)}


def invisible(char: str) -> bool:
    return char.isspace() or unicodedata.category(char) == "Cf" or ord(char) in IGNORABLE


def runnable(text: str) -> bool:
    """This test's words: a tab or line break first, or, after everything invisible, a
    character whose compatibility form begins with one of STARTS."""
    if text[:1] in ("\t", "\r", "\n"):
        return True
    shown = [char for char in text if not invisible(char)]
    return bool(shown) and unicodedata.normalize("NFKC", shown[0])[:1] in STARTS


def _post(service, data_dir, points: list, units: str = "count") -> None:
    body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("step_count", points, units)]))
    assert Client(*service.address).ingest(body, headers={"automation-aggregation":
                                                          "Minutes"})[0] == 200
    wait_for(lambda: all(row["parse_status"] == "parsed" for row in db_rows(data_dir)),
             what="the delivery is folded")


def test_read_4_7_invisible_and_compatibility_characters_before_a_formula(start_service,
                                                                          data_dir):
    characters = [chr(code) for code in range(0x110000) if not 0xD800 <= code <= 0xDFFF]
    formulas = [char for char in characters  # a compatibility form has a decomposition
                if char in STARTS or unicodedata.decomposition(char)
                and unicodedata.normalize("NFKC", char)[:1] in STARTS]
    hidden = [char for char in characters if invisible(char)]
    assert {"\ufe66", "\u207c", "\uff1d", "\ufe62", "\uff0b", "\ufe63", "\uff0d", "\uff20",
            "\ufe6b"} <= set(formulas)
    assert {"\u200b", "\ufeff", "\u2060", "\u00ad", "\u180e"} <= set(hidden)
    texts = ([char + "SUM(1)" for char in formulas]
             + [char + "=1+1" for char in hidden]
             + [char + "\u200b\ufeff" + formulas[n % len(formulas)] + "A1"
                for n, char in enumerate(hidden[:200])]
             + ["\u200ba=1", "\ufeff1+1", "a\u200b=1", "\u2010" + "1", "\u2013" + "1",
                "\u200b", "\ufeff\u3164x"])  # no formula: a letter, a digit or a dash first
    base = dt.datetime(2024, 3, 1)
    points = [{"date": (base + dt.timedelta(minutes=n)).strftime("%Y-%m-%d %H:%M:00 -0800"),
               "qty": n, "source": text} for n, text in enumerate(texts)]
    service = start_service()
    _post(service, data_dir, points)
    rows = read_csv(get(service.address, "/api/points", metric="step_count", format="csv"))
    source = rows[0].index("source")
    got = {row[source].lstrip("'"): row[source] for row in rows[1:]}
    assert len(got) == len(texts)
    neutralised = [text for text in texts if got[text] == "'" + text]
    assert neutralised == [text for text in texts if runnable(text)]
    assert [got[text] for text in texts if not runnable(text)] == [
        text for text in texts if not runnable(text)]
    exported = subprocess.run(
        [sys.executable, "-m", "healthlog", "export", "--data", str(data_dir),
         "--metric", "step_count", "--format", "csv"], capture_output=True, timeout=60)
    assert exported.returncode == 0, exported.stderr
    assert list(csv.reader(io.StringIO(exported.stdout.decode(), newline=""))) == rows


def test_read_4_6_csv_columns_come_in_one_order_for_every_range(start_service, data_dir):
    """Two days of heart rate whose points spell their keys in other orders (and a key of
    the phone's own on the second): raw CSV and bucket CSV of each day have one header, in
    the order the read spec gives: the meaning's value fields (Avg, Min, Max), the times,
    source, the rest by name."""
    service = start_service()
    day1 = [{"source": "Watch", "Min": 60 + m, "Max": 80 + m,
             "date": "2024-03-08 10:%02d:00 -0800" % m, "Avg": 70 + m} for m in range(3)]
    day2 = [{"Avg": 71 + m, "source": "Watch", "Max": 81 + m,
             "date": "2024-03-09 10:%02d:00 -0800" % m, "Min": 61 + m, "context": "rest"}
            for m in range(3)]
    for points in (day1, day2):
        body = hf.dumps_hae(hf.envelope(metrics=[hf.metric("heart_rate", points,
                                                           "count/min")]))
        assert Client(*service.address).ingest(body, headers={"automation-aggregation":
                                                              "Minutes"})[0] == 200
    wait_for(lambda: [row["parse_status"] for row in db_rows(data_dir)] == ["parsed"] * 2,
             what="both deliveries are folded")
    first = ["utc_start", "utc_end", "units", "local_start", "local_date"]
    headers = {}
    for day in (dt.date(2024, 3, 8), dt.date(2024, 3, 9)):
        raw = read_csv(get(service.address, "/api/points", metric="heart_rate", format="csv",
                           from_=day.isoformat(), to=day.isoformat()))
        buckets = read_csv(get(service.address, "/api/points", metric="heart_rate",
                               bucket="hour", format="csv", from_=day.isoformat(),
                               to=day.isoformat()))
        assert len(raw) == 4 and len(buckets) == 2
        headers[day] = (raw[0], buckets[0])
    [(raw1, bucket1), (raw2, bucket2)] = headers.values()
    assert raw1 == first + ["Avg", "Min", "Max", "date", "source"]
    assert raw2 == raw1 + ["context"]  # the same order, a key of its own after the rest
    stats = ("count", "min", "max", "avg", "sum")
    assert bucket1 == bucket2 == ["start", "local", "date", "units", "count"] + [
        "%s_%s" % (name, stat) for name in ("Avg", "Min", "Max") for stat in stats]
    both = read_csv(get(service.address, "/api/points", metric="heart_rate", format="csv"))
    assert both[0] == raw2
