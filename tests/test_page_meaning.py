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
    out = []
    i, n = 0, len(script)
    last, word = "", ""  # the last significant character, and the last word if it was one
    while i < n:
        c = script[i]
        if script.startswith("//", i):
            end = script.find("\n", i)
            i = n if end < 0 else end
            continue
        if script.startswith("/*", i):
            i = script.index("*/", i + 2) + 2
            continue
        if c in "'\"`":
            j = i + 1
            while script[j] != c:
                j += 2 if script[j] == "\\" else 1
            out.append((script[i + 1:j], i))
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
    return out


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
