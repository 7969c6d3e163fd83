"""The page renders what the server sends: what a metric means lives in one table.

Every decision about what a metric means (its group, which field is its value, how a bucket
combines it, the sleep stages and their order, which cards the summary has, in which order,
with which titles and metrics, the groups of the metric list in their order) is made in
healthlog's meaning table (``MEANINGS``, ``SLEEP_STAGES``, ``SUMMARY_CARDS``, ``GROUPS``) and
served with the catalog and the summary. The page's script (``healthlog.APP_JS``) only draws
it: it MUST NOT name a metric, a sleep stage or a group.

The script is read as a script: its string literals, outside comments and regular
expressions, are compared with the table's metrics, stages and groups. A meaning's ``kind``
is the table's vocabulary the page draws by (a list of workouts, nights, ECG recordings), so
a kind compared with a ``kind`` (``kind === 'workouts'``) is no metric, though ``workouts``
and ``ecg`` are also metrics' names (and ``sleep`` and ``workouts`` groups'); anywhere else
such a literal names the metric or the group.

Nor does the script pick a metric's field by its name or count the server's days
(READ-13.4): no string literal is a field of the table (``Min``, ``Max``, ``Avg``, ``qty``,
``systolic``, …: the meaning's ``fields``, ``bounds`` and ``labels`` say which is which), no
property it reads is one unless the server's answers use that word for a field of their
own (each such word listed here with the answer that has it), and no number in its code is
one of the server's windows (the usual's 30 days, the sparkline's 14, the trends' 90 and
365, the view's 186, the coverage's 28, a list's page of 50, …) unless drawing needs it
where it stands (each such place listed here with its reason). Numbers under 7 are not
compared: they are everywhere in drawing (ticks, indexes, pixels); the rules that hold
them come with the answers (``usual.min_days``, ``trend_rule``).
"""

import re

import pytest

import healthlog

#: Characters after which a ``/`` starts a regular expression, not a division.
_BEFORE_REGEX = set("(,=:[!&|?{};+-*%<>~^")
_REGEX_KEYWORDS = {"return", "typeof", "case", "in", "of", "delete", "void", "throw", "new"}
#: A literal compared with a kind: ``kind === '…'``, ``x.kind !== '…'``.
_KIND_BEFORE = re.compile(r"\bkind\s*[!=]==?\s*$")


def string_literals(script: str) -> list:
    """(text, offset) of every string literal of a script ('…', "…" and `…`), outside
    comments and regular expression literals; escapes are kept as written."""
    return scan(script)[0]


def code_of(script: str) -> str:
    """The script with its comments, string literals and regular expressions blanked out
    (spaces, lines kept): what is left is code, its names and numbers."""
    return scan(script)[1]


def scan(script: str) -> tuple:
    """(string literals as :func:`string_literals` gives them, the code as :func:`code_of`
    gives it)."""
    out = []
    code = list(script)

    def blank(first: int, end: int) -> None:
        for k in range(first, end):
            if code[k] != "\n":
                code[k] = " "

    i, n = 0, len(script)
    last, word = "", ""  # the last significant character, and the last word if it was one
    while i < n:
        c = script[i]
        if script.startswith("//", i):
            end = script.find("\n", i)
            blank(i, n if end < 0 else end)
            i = n if end < 0 else end
            continue
        if script.startswith("/*", i):
            end = script.index("*/", i + 2) + 2
            blank(i, end)
            i = end
            continue
        if c in "'\"`":
            j = i + 1
            while script[j] != c:
                j += 2 if script[j] == "\\" else 1
            out.append((script[i + 1:j], i))
            blank(i + 1, j)
            i, last, word = j + 1, c, ""
            continue
        if c == "/" and (last == "" or last in _BEFORE_REGEX or word in _REGEX_KEYWORDS):
            j, in_class = i + 1, False
            while in_class or script[j] != "/":
                if script[j] == "\\":
                    j += 1
                elif script[j] == "[":
                    in_class = True
                elif script[j] == "]":
                    in_class = False
                j += 1
            j += 1
            while j < n and script[j].isalpha():  # flags
                j += 1
            blank(i, j)
            i, last, word = j, "/", ""
            continue
        if c.isspace():
            i += 1
            continue
        if c.isalnum() or c in "_$":
            j = i
            while j < n and (script[j].isalnum() or script[j] in "_$"):
                j += 1
            word, last, i = script[i:j], script[j - 1], j
            continue
        last, word, i = c, "", i + 1
    return out, "".join(code)


def kinds() -> set:
    return {meaning.kind for meaning in healthlog.MEANINGS.values()}


def stage_names() -> set:
    return set(healthlog.SLEEP_STAGE_NAMES) | set(healthlog.STAGE_ORDER)


def groups() -> set:
    return ({group for group, _ in healthlog.GROUPS}
            | {card.group for card in healthlog.SUMMARY_CARDS})


def named(script: str) -> list:
    """(literal, line) of every metric, sleep stage or group the script names, a kind
    compared with a kind aside."""
    metrics, stages, table_kinds = set(healthlog.MEANINGS) | groups(), stage_names(), kinds()
    found = []
    for text, offset in string_literals(script):
        if text in stages or (text in metrics and not (
                text in table_kinds and _KIND_BEFORE.search(script[max(0, offset - 40):offset]))):
            found.append((text, script.count("\n", 0, offset) + 1))
    return found


def test_the_scanner_reads_literals_not_comments_or_regular_expressions():
    script = ("// 'deep' in a comment\n/* \"rem\" */ const a = 'x\\'y', b = \"z\";\n"
              "const r = /'core'[/']/g; const d = 4 / 2 / 1; f(`t`); return /a\\/b/;\n"
              "if (view.kind === 'workouts') g('workouts'); h('asleep');")
    assert [t for t, _ in string_literals(script)] == ["x\\'y", "z", "t", "workouts",
                                                        "workouts", "asleep"]
    assert named(script) == [("workouts", 4), ("asleep", 4)]


def test_read_13_3_the_script_names_no_metric_and_no_sleep_stage():
    """The page's script takes every metric, stage and group from what the server sends:
    the summary's card order and titles, each card's metric and link, the sleep meaning's
    stages in their order with their labels, the catalog's groups in order with theirs."""
    found = named(healthlog.APP_JS)
    assert not found, "the script names what the meaning table should say: %s" % found


def test_the_script_is_read_whole():
    """The scanner reads the whole script (a literal or a regular expression it misread
    would hide the rest): it finds the literals that are there."""
    texts = [t for t, _ in string_literals(healthlog.APP_JS)]
    assert "use strict" in texts and "/api/summary" in texts
    assert len(texts) > 500


# -- READ-13.4: no field picked by its name, no window of the server's counted ------------

#: Words that name a field of a metric in the table and also a field of the server's own
#: answers, which the script reads there (``night.asleep``), with the answer that has it.
ANSWER_FIELDS = {
    "asleep": "a night's hours asleep (/api/points' nights, the sleep card); a stage's "
              "``asleep`` (is it sleep), in the sleep meaning's stages",
    "in_bed": "a night's hours in bed (/api/points' nights, the sleep card)",
    "kind": "a meaning's kind, a summary item's, a freshness notice's, a coverage row's",
    "labels": "a meaning's labels",
    "value": "a card's, a sparkline point's, a figure's value",
    "status": "a delivery's status, an HTTP error's",
    "energy": "a workout's energy (/api/workouts)",
    "distance": "a workout's distance (/api/workouts), the owner's distance unit",
    "classification": "an ECG recording's classification (/api/records, /api/ecg)",
    "qty": "an amount as /api/workouts and /api/records carry one: {qty, units, unit_label}",
}

#: Numbers of the server's windows that drawing needs where they stand: (number, a pattern
#: the line it stands on matches, why).
DRAWING_NUMBERS = (
    (7, r"% 7\b|\? 7 : 1|<= 7$|slice\(5, 7\)", "the calendar's week (a weekday, a week's "
                                               "date slots, the first Monday of a month); a "
                                               "date's month, its characters 5 to 7"),
    (14, r"(left|right) [+-] 14|max\(14, x\)|width - 14", "pixels: a date label kept 14 px "
                                                         "inside the plot"),
    (28, r"bottom: 28\b", "pixels: the room under a chart for its date labels"),
    (30, r"max\(30, |plotW / 30\)", "pixels: the narrowest value axis; a two-line date label"),
    (90, r"\? 90 : 130", "pixels: an ECG strip's height on a phone"),
    (50, r"i < 50;", "at most 50 ticks on an axis (a guard)"),
)


def table_fields() -> set:
    """Every field the meaning table names: its meanings' fields, bounds and labelled
    fields, and the fields of the events it makes for symptoms, medications and cycles."""
    out = set()
    for meaning in healthlog.MEANINGS.values():
        out |= set(meaning.fields) | set(meaning.bounds or ()) | set(dict(meaning.labels))
    for metric in ("symptoms/x", "medications/x", "cycle_tracking/x"):
        out |= set(healthlog.meaning_of(metric).fields)
    return out


def server_windows() -> set:
    """The server's windows of days and its counts (7 or more) that a script could copy."""
    h = healthlog
    return {n for n in (h.USUAL_DAYS, h.SPARK_DAYS, h.TREND_RECENT_DAYS, h.TREND_BASELINE_DAYS,
                        h.TREND_MIN_RECENT, h.TREND_MIN_BASELINE, h.WEEK_DAYS, h.DAY_MAX_DAYS,
                        h.COVERAGE_DAYS, h.COVERAGE_MAX_DAYS, h.USUAL_INTERVAL_DAYS,
                        h.USUAL_SPACING_DAYS, h.WORKOUTS_LIST_MAX, h.ROUTE_DRAW_MAX,
                        h.HEART_DRAW_MAX, *h.VIEW_RANGES.values(), *h.RECORDS_LIMIT,
                        *h.DELIVERIES_LIMIT) if n >= 7}


def picked_fields(script: str) -> list:
    """(name, line) of every field of the table the script picks by its name: a string
    literal (``'Min'``, ``f !== 'qty'``), or a property it reads (``b.fields.Max``) that
    no answer of the server's has (:data:`ANSWER_FIELDS`). A literal compared with a
    figure's ``shown`` (``'duration'``: the server's word for how a figure is written) is
    no field."""
    fields = table_fields()
    literals, code = scan(script)
    found = [(text, script.count("\n", 0, offset) + 1) for text, offset in literals
             if text in fields and not re.search(r"\bshown\s*[!=]==?\s*$",
                                                 script[max(0, offset - 40):offset])]
    for match in re.finditer(r"\.\s*([A-Za-z_$][\w$]*)", code):
        name = match.group(1)
        if name in fields and name not in ANSWER_FIELDS:
            found.append((name, code.count("\n", 0, match.start()) + 1))
    return found


def counted_windows(script: str) -> list:
    """(number, line) of every number in the script's code that is one of the server's
    windows, where drawing does not need it (:data:`DRAWING_NUMBERS`); and (text, line) of
    every string literal that writes a count of days, nights or weeks of its own."""
    windows = server_windows()
    literals, code = scan(script)
    lines = script.split("\n")
    found = []
    for match in re.finditer(r"(?<![\w.$])(\d+(?:\.\d+)?(?:e-?\d+)?)(?![\w.])", code):
        number = float(match.group(1))
        if number not in windows:
            continue
        line = code.count("\n", 0, match.start()) + 1
        if not any(number == allowed and re.search(pattern, lines[line - 1])
                   for allowed, pattern, _ in DRAWING_NUMBERS):
            found.append((match.group(1), line))
    for text, offset in literals:
        if re.search(r"\b\d+\s*(days?|nights?|weeks?)\b", text):
            found.append((text, script.count("\n", 0, offset) + 1))
    return found


def test_read_13_4_the_script_picks_no_field_by_its_name():
    """Which fields hold a point's lowest and highest (``bounds``), which is the value
    (``fields[0]``) and how a bucket combines it (``combine``) come from the meaning; the
    script names none of them."""
    found = picked_fields(healthlog.APP_JS)
    assert not found, "the script picks a field by its name: %s" % found


def test_read_13_4_the_script_counts_none_of_the_servers_windows():
    """The usual's days, the trends' windows, a list's page, a view's ranges: the answers
    say them (``usual.days``, ``trend_rule``, the plan); the script holds only the numbers
    drawing needs."""
    found = counted_windows(healthlog.APP_JS)
    assert not found, "the script counts what the server decides: %s" % found


@pytest.mark.parametrize("script", [
    "const band = fields.indexOf('Min') >= 0;", "row.hi = b.fields.Max.max;",
    "if (f !== 'qty') x();", "const v = stats['Avg'];", "p.systolic + 1"])
def test_a_script_picking_a_field_by_its_name_fails(script):
    assert picked_fields(script)


@pytest.mark.parametrize("script", [
    "text = (rule.days || 30) + ' days';", "addDays(day, -14);", "limit: 50,",
    "const x = 'the 90 days before';", "if (n > 186) bucket = 'week';"])
def test_a_script_counting_a_window_of_the_server_fails(script):
    assert counted_windows(script)


def test_what_the_script_may_say_passes():
    """Words of the server's answers, a figure's ``shown``, drawing's numbers where they
    stand: nothing found."""
    script = ("if (f.shown === 'duration') a(night.asleep, w.energy.qty, card.value);\n"
              "const w = (((n + 3) % 7) + 7) % 7; margin.left = Math.max(30, 12);\n"
              "// 'Min' in a comment, 30 days\nconst r = /Max/;")
    assert picked_fields(script) == [] and counted_windows(script) == []


def test_read_13_4_the_meaning_says_how_each_kind_is_drawn():
    drawn = {meaning.kind: meaning.as_json()["drawn"] for meaning in healthlog.MEANINGS.values()}
    assert drawn == {"total": "series", "average": "series", "sleep": "nights",
                     "workouts": "list", "ecg": "list", "events": "list"}
    assert healthlog.meaning_of("symptoms/x").as_json()["drawn"] == "list"
    assert healthlog.meaning_of("x").as_json()["drawn"] == "series"


# -- the table itself -----------------------------------------------------------------


def test_read_13_3_every_group_of_the_table_has_its_place_and_title():
    listed = [group for group, _ in healthlog.GROUPS]
    assert len(listed) == len(set(listed)) and listed[-1] == "other"
    assert all(title.strip() for _, title in healthlog.GROUPS)
    made = {healthlog.meaning_of(m).group for m in ("symptoms/x", "medications/x",
                                                     "cycle_tracking/x", "dietary_x", "x")}
    assert {m.group for m in healthlog.MEANINGS.values()} | made <= set(listed)
    assert healthlog.groups_json()[0] == {"group": "activity", "title": "Activity"}


def test_read_13_3_the_summary_cards_are_groups_of_the_meaning_table():
    groups = {meaning.group for meaning in healthlog.MEANINGS.values()}
    order = [card.group for card in healthlog.SUMMARY_CARDS]
    assert len(order) == len(set(order))
    for card in healthlog.SUMMARY_CARDS:
        assert card.group in groups, card
        assert card.title.strip() and card.render in healthlog.CARD_RENDERS, card
        for metric in card.metrics:  # a card shows metrics of its own group
            assert healthlog.meaning_of(metric).group == card.group, (card.group, metric)
    shown = [m for card in healthlog.SUMMARY_CARDS for m in card.metrics]
    assert len(shown) == len(set(shown))  # a metric on one card only


def test_read_13_3_the_sleep_meaning_holds_its_stages_deepest_first_awake_last():
    sleep = healthlog.meaning_of(healthlog.SLEEP_METRIC)
    order = [stage.stage for stage in sleep.stages]
    assert order == list(healthlog.STAGE_ORDER) == ["deep", "core", "rem", "asleep", "awake"]
    assert [s.stage for s in sleep.stages if not s.asleep] == ["awake"]
    assert [s.stage for s in sleep.stages if s.unspecified] == ["asleep"]
    assert set(healthlog.ASLEEP_STAGES) == {"deep", "core", "rem", "asleep"}
    # every stage HAE spells is one of the table's, or the night's time in bed (a field)
    assert set(healthlog.SLEEP_STAGE_NAMES) == set(order) | {"in_bed"}
    assert "in_bed" in sleep.fields
    served = sleep.as_json()["stages"]
    assert [s["stage"] for s in served] == order and all(s["label"] for s in served)


def test_read_13_3_the_heart_range_reads_the_fields_its_meaning_names():
    heart = healthlog.meaning_of("heart_rate")
    assert heart.fields[0] == "Avg" and heart.bounds == ("Min", "Max")
    assert set(heart.bounds) <= set(heart.fields)
    ranged = [m for m, meaning in healthlog.MEANINGS.items() if meaning.bounds]
    assert ranged == ["heart_rate"]


@pytest.mark.parametrize("text", ["'deep'", '"rem"', "'sleep_analysis'", "'step_count'",
                                  "'heart'", "'activity'", "'other'"])
def test_a_script_naming_a_metric_stage_or_group_fails(text):
    assert named("const x = %s;" % text)
