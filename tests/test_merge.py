"""The merge rule at the function level (healthlog.py section "Canonical form and merge
rule"; the storage spec's collision requirement; seeds STO-1, STO-2).

Positions are journal positions ``(received_at, delivery id)`` as the fold passes them.
Expected outcomes are written out by hand from the spec's wording; the hypothesis
properties use tests/hae_factory.py's independent ``same_value`` oracle.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import hae_factory as hf
import healthlog
from conftest import without_source
from healthlog import (all_keys, arbitrate, canonical, content_keys, dominates, incomparable,
                       is_empty, reduce_candidates, same_value)


pytestmark = pytest.mark.usefixtures("json_mode")  # every test with and without orjson
# Each property runs in both modes: its examples a mode below are half the examples a run
# tries (100 to 200 a mode; the rule's code is the same in both, only canonical bytes differ).

EARLY = ("2024-03-08T10:00:00.000000Z", 1)
LATE = ("2024-03-08T10:05:00.000000Z", 2)
SAME_INSTANT_LATER_ID = ("2024-03-08T10:00:00.000000Z", 3)
DATE = "2024-03-08 10:00:00 -0800"
PROPS = settings(max_examples=150, deadline=None)


def parsed(text: str):
    return json.loads(text)


# ---------------------------------------------------------------------------
# same_value
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("a, b", list(itertools.combinations(["0", "0.0", "-0", "0e0", "-0.0",
                                                              "0E+5", "-0e-3"], 2)))
def test_every_spelling_of_zero_is_one_value(a, b):
    assert same_value(parsed(a), parsed(b))
    assert same_value({"qty": parsed(a)}, {"qty": parsed(b)})


def test_sto_2_8_last_digit_jitter_is_the_same_value():
    a = parsed('{"date": "%s", "qty": 61.999999999999993, "source": "Watch"}' % DATE)
    b = parsed('{"qty": 61.99999999999999, "date": "%s"}' % DATE)
    assert same_value(a, b)
    neighbour = math.nextafter(61.99999999999999, math.inf)
    assert neighbour != 61.99999999999999
    assert same_value(61.99999999999999, neighbour)
    assert same_value({"qty": 7369.1420323996308}, {"qty": math.nextafter(7369.1420323996308, 0)})


@pytest.mark.parametrize("a, b, same", [
    (1e12, 1e12 + 1, True),          # |a - b| = 1e-12 · max: on the boundary
    (1e12, 1e12 - 1, True),
    (1e12, 1e12 + 2, False),         # just beyond it
    (10 ** 12, 10 ** 12 + 1, True),  # integers alike
    (10 ** 12, 10 ** 12 + 2, False),
    (-1e12, -1e12 - 1, True),
    (-1e12, -1e12 - 2, False),
    (1.0, 1.0 + 5e-13, True),
    (1.0, 1.0 + 2e-12, False),
    (72.5, 72.5 + 7e-11, True),    # 1e-12 is relative, not absolute
    (72.5, 72.5 + 8e-11, False),
    (0, 1e-300, False),              # zero is the same value only as zero
    (0.0, -5e-324, False),
    (1, -1, False),
])
def test_relative_tolerance_boundary_on_both_sides(a, b, same):
    assert same_value(a, b) is same
    assert same_value(b, a) is same


def test_source_is_ignored_at_every_nesting_level():
    a = {"date": DATE, "source": "Anton’s Apple Watch",
         "heartRateData": [{"Avg": 91, "source": "Connect"}],
         "metadata": {"device": {"source": "x", "model": "Watch7,1"}}}
    b = {"heartRateData": [{"Avg": 91}], "date": DATE,
         "metadata": {"device": {"model": "Watch7,1", "source": {"name": "other"}}}}
    assert same_value(a, b)
    assert same_value(b, a)
    assert same_value([{"source": 1}], [{}])
    b["metadata"]["device"]["model"] = "Watch6,1"
    assert not same_value(a, b)


@pytest.mark.parametrize("a, b", [
    (True, 1), (False, 0), (True, 1.0), (False, 0.0),
    ({"isIndoor": True}, {"isIndoor": 1}), ([False], [0]),
    (True, False), (None, 0), (None, False), (None, ""), ("", 0), ("1", 1), ("0", 0),
])
def test_bool_and_null_are_never_numbers(a, b):
    assert not same_value(a, b)
    assert not same_value(b, a)


@pytest.mark.parametrize("a, b", [
    ({"a": 1}, [1]), ({"a": 1}, {"a": 1, "b": None}), ({"a": 1}, {"b": 1}),
    ([1, 2], [1, 2, 3]), ([1, 2], [2, 1]), ({}, []), ([[1]], [1]), ({"a": {}}, {"a": []}),
    ({"a": [1]}, {"a": 1}), ("Core", "core"), ("Core", "Core "), ("Irvin’s", "Irvin's"),
    ("a&b", "a&amp;b"), ("é", "e\u0301"),
])
def test_different_structure_or_strings_are_not_the_same_value(a, b):
    assert not same_value(a, b)
    assert not same_value(b, a)


def test_same_value_answers_for_integers_beyond_float_range():
    assert same_value(10 ** 400, 10 ** 400)
    assert not same_value(10 ** 400, 10 ** 400 + 10 ** 390)


def test_strings_compare_exactly():
    assert same_value("Irvin’s Apple Watch", "Irvin’s Apple Watch")
    assert same_value({"value": "In Bed"}, {"value": "In Bed"})


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6),
    st.floats(min_value=-1e12, max_value=1e12, allow_nan=False).filter(
        lambda x: x == 0 or abs(x) >= 1e-300),
    st.sampled_from(["", "a", "b", "’", "&<>", "Core"]))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "qty", "source", "date"]), inner,
                        max_size=4)),
    max_leaves=12)


@given(json_values, json_values)
@PROPS
def test_property_same_value_agrees_with_the_factory_oracle(a, b):
    expected = hf.same_value(without_source(a), without_source(b))
    assert same_value(a, b) is expected
    assert same_value(b, a) is expected


@given(json_values, st.integers(0, 2 ** 32))
@PROPS
def test_property_a_resend_is_the_same_value(value, seed):
    resent = json.loads(hf.dumps_hae(value, random.Random(seed)))
    assert same_value(value, resent)
    assert same_value(value, copy.deepcopy(value))


# ---------------------------------------------------------------------------
# Emptiness, content keys, all keys
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["null", '""', "0", "0.0", "-0.0", "-0", "0e0", "{}", "{ }",
                                  "[]", "[ ]"])
def test_empty_values_judged_on_the_parsed_value(text):
    assert is_empty(parsed(text))


@pytest.mark.parametrize("value", [False, True, " ", "0", "false", [0], [None], {"a": None},
                                   {"source": "x"}, 1e-300, -1, 0.5])
def test_false_and_other_contentful_values_are_not_empty(value):
    assert not is_empty(value)


def test_content_keys_and_all_keys():
    point = {"date": DATE, "qty": 0, "Min": 0.0, "context": "", "meta": {}, "series": [],
             "isIndoor": False, "Avg": 74.6, "source": "Watch", "note": None}
    assert content_keys(point) == {"date", "isIndoor", "Avg"}
    assert all_keys(point) == set(point) - {"source"}
    for not_an_object in ("text", 5, None, [1, 2], [{"date": DATE}], True):
        assert content_keys(not_an_object) == frozenset()
        assert all_keys(not_an_object) == frozenset()


# ---------------------------------------------------------------------------
# dominates / incomparable
# ---------------------------------------------------------------------------


def test_sto_2_1_poor_point_does_not_erase_rich_fields():
    stored = {"date": DATE, "Avg": 74.6, "Min": 52, "Max": 116, "context": "Not Set",
              "source": "Watch"}
    arriving = {"Max": 116, "Min": 52, "Avg": 74.6, "date": DATE, "source": "Phone"}
    assert dominates(stored, arriving)
    assert not dominates(arriving, stored)
    for position in (EARLY, LATE):
        assert arbitrate(stored, EARLY, arriving, position) == (False, False, False)
    winner, clash = reduce_candidates([arriving, stored])
    assert winner is stored and "context" in winner and not clash


def test_sto_2_2_fields_without_content_add_no_completeness():
    stored = {"date": DATE, "qty": 0, "Min": 0.0, "Max": -0, "metadata": {}, "series": []}
    arriving = {"date": DATE, "qty": 7369.1420323996308}
    assert len(all_keys(stored)) > len(all_keys(arriving))  # a size count would pick stored
    assert dominates(arriving, stored)
    assert not dominates(stored, arriving)
    # dominance wins whatever the journal positions
    assert arbitrate(stored, LATE, arriving, EARLY) == (True, True, False)
    assert arbitrate(stored, EARLY, arriving, LATE) == (True, True, False)
    winner, clash = reduce_candidates([stored, arriving])
    assert winner is arriving and not clash


def test_sto_2_3_equal_content_keeps_the_empty_extra_keys():
    stored = {"date": DATE, "qty": 10, "Min": 0, "Max": 0}
    arriving = {"date": DATE, "qty": 11}
    assert content_keys(stored) == content_keys(arriving)
    assert dominates(stored, arriving)
    assert not dominates(arriving, stored)
    assert arbitrate(stored, EARLY, arriving, LATE) == (False, False, False)
    assert arbitrate(arriving, EARLY, stored, LATE) == (True, True, False)
    assert arbitrate(arriving, LATE, stored, EARLY) == (True, True, False)
    winner, _ = reduce_candidates([arriving, stored])
    assert winner is stored


def test_equal_content_and_more_empty_keys_dominates_whatever_the_shared_values():
    """The storage spec follows STO-2.3 over the seed requirement's wording: its own
    example of what to avoid is, under the storage spec, dominance."""
    padded = {"date": DATE, "qty": 0.001, "p1": None, "p2": None}
    real = {"date": DATE, "qty": 72.5}
    assert dominates(padded, real)
    assert arbitrate(real, LATE, padded, EARLY) == (True, True, False)


def test_equal_content_and_more_empty_keys_dominates():
    assert dominates({"date": DATE, "qty": 10, "Min": 0, "Max": 0}, {"date": DATE, "qty": 10})
    assert dominates({"date": DATE, "qty": 10, "Min": 0}, {"qty": 10.0, "date": DATE})
    # equal K is not dominance, with or without a source
    assert not dominates({"date": DATE, "qty": 10, "source": "a"}, {"date": DATE, "qty": 10})
    assert not dominates({"date": DATE, "qty": 10, "Min": 0}, {"date": DATE, "qty": 10,
                                                               "Max": None})


def test_superset_with_a_differing_shared_value_is_not_dominance():
    richer = {"date": DATE, "qty": 11, "context": "Not Set"}
    poorer = {"date": DATE, "qty": 10}
    assert content_keys(richer) > content_keys(poorer)
    assert not dominates(richer, poorer)
    assert not dominates(poorer, richer)
    assert not incomparable(richer, poorer)
    # neither dominates: the later journal position decides, and it is a collision
    assert arbitrate(poorer, EARLY, richer, LATE) == (True, True, False)
    assert arbitrate(richer, EARLY, poorer, LATE) == (True, True, False)
    assert arbitrate(richer, LATE, poorer, EARLY) == (False, False, False)


def test_superset_whose_shared_values_differ_only_by_jitter_dominates():
    richer = {"date": DATE, "qty": math.nextafter(61.99999999999999, 0), "context": "x"}
    poorer = {"date": DATE, "qty": 61.99999999999999}
    assert dominates(richer, poorer)


def test_false_is_content_and_source_is_not():
    assert dominates({"date": DATE, "qty": 1, "isIndoor": False}, {"date": DATE, "qty": 1})
    assert not dominates({"date": DATE, "qty": 1, "source": "Watch"}, {"date": DATE, "qty": 1})


def test_incomparable_needs_a_content_key_on_each_side():
    a = {"date": DATE, "qty": 1, "context": "x"}
    b = {"date": DATE, "qty": 1, "mealTime": "Before Meal"}
    assert incomparable(a, b) and incomparable(b, a)
    assert not incomparable(a, {"date": DATE, "qty": 1, "mealTime": ""})  # empty is no content
    assert not incomparable(a, "not an object")
    assert not incomparable(a, {"date": DATE, "qty": 1, "source": "Phone"})


# ---------------------------------------------------------------------------
# arbitrate: stored point vs arriving point
# ---------------------------------------------------------------------------


def test_sto_1_1_the_same_point_again_changes_nothing():
    point = {"date": DATE, "qty": 12.5, "source": "Watch"}
    for position in (EARLY, LATE, SAME_INSTANT_LATER_ID):
        assert arbitrate(point, EARLY, copy.deepcopy(point), position) == (False, False, False)
        assert arbitrate(point, LATE, point, position) == (False, False, False)


def test_sto_1_2_a_changed_source_is_no_change():
    stored = {"date": DATE, "qty": 12.5, "source": "Anton’s Apple Watch|iPhone (Anton)"}
    arriving = {"date": DATE, "qty": 12.5, "source": "Anton’s Apple Watch"}
    assert arbitrate(stored, EARLY, arriving, LATE) == (False, False, False)
    assert arbitrate(stored, EARLY, {"qty": 12.5, "date": DATE}, LATE) == (False, False, False)


def test_sto_2_8_reordered_keys_and_last_digit_are_no_collision():
    body = b'{"date": "%s", "qty": 61.999999999999993, "Min": 0.76856774374845116}' % (
        DATE.encode())
    stored = json.loads(body)
    arriving = json.loads(hf.resend(body, random.Random(5)))
    arriving["qty"] = math.nextafter(arriving["qty"], math.inf)
    assert arbitrate(stored, EARLY, arriving, LATE) == (False, False, False)


def test_sto_2_4_equal_key_sets_later_journal_position_wins():
    stored = {"date": DATE, "qty": 10}
    arriving = {"date": DATE, "qty": 12}
    # replayed in either order, the point of the later delivery (LATE) is what remains
    assert arbitrate(stored, EARLY, arriving, LATE)[0] is True       # 10 then 12 -> 12
    assert arbitrate(arriving, LATE, stored, EARLY)[0] is False      # 12 then 10 -> 12
    assert arbitrate(stored, EARLY, arriving, LATE) == (True, True, False)
    assert arbitrate(stored, LATE, arriving, EARLY) == (False, False, False)
    # the delivery id breaks a tie of received_at
    assert arbitrate(stored, EARLY, arriving, SAME_INSTANT_LATER_ID) == (True, True, False)
    assert arbitrate(stored, SAME_INSTANT_LATER_ID, arriving, EARLY) == (False, False, False)
    # the same position (a delivery folded again over its own point) is not later
    assert arbitrate(stored, LATE, arriving, LATE) == (False, False, False)


def test_sto_2_7_a_replacement_by_a_different_value_is_a_collision():
    replace, collision, _ = arbitrate({"date": DATE, "qty": 10}, EARLY,
                                      {"date": DATE, "qty": 12}, LATE)
    assert replace and collision
    replace, collision, _ = arbitrate({"date": DATE}, LATE, {"date": DATE, "qty": 12}, EARLY)
    assert replace and collision  # by dominance, still a change of value


def test_sto_2_5_incomparable_is_flagged_whoever_wins():
    stored = {"date": DATE, "qty": 1, "context": "Sedentary"}
    arriving = {"date": DATE, "qty": 1, "mealTime": "After Meal"}
    assert arbitrate(stored, EARLY, arriving, LATE) == (True, True, True)
    assert arbitrate(stored, LATE, arriving, EARLY) == (False, False, True)


@pytest.mark.parametrize("not_an_object", ["garbage", 42, 0, None, [1, 2],
                                           [{"date": DATE, "qty": 5}], True, ""])
def test_sto_2_6_content_that_is_not_an_object_loses_to_a_point_with_fields(not_an_object):
    point = {"date": DATE, "qty": 5}
    for stored_at, arriving_at in ((EARLY, LATE), (LATE, EARLY)):
        assert arbitrate(not_an_object, stored_at, point, arriving_at) == (True, True, False)
        assert arbitrate(point, stored_at, not_an_object, arriving_at) == (False, False, False)
    winner, clash = reduce_candidates([not_an_object, point])
    assert winner is point and not clash
    winner, clash = reduce_candidates([point, not_an_object])
    assert winner is point and not clash


# ---------------------------------------------------------------------------
# reduce_candidates: one delivery's candidates for one coordinate
# ---------------------------------------------------------------------------


def test_sto_2_4_equal_key_sets_in_one_delivery_are_decided_by_canonical_order():
    a = {"date": DATE, "qty": 10, "source": "Watch"}
    b = {"date": DATE, "qty": 9}
    for order in itertools.permutations([a, b]):
        winner, lost = reduce_candidates(list(order))
        assert winner is b  # "9" > "10" as canonical text: deterministic, not numeric
        assert lost == 1  # a different value, not dominated: dropped, and counted
    assert canonical(b) > canonical(a)


def test_sto_2_5_incomparable_candidates_one_deterministic_winner_counted():
    a = {"date": DATE, "qty": 1, "context": "Sedentary"}
    b = {"date": DATE, "qty": 1, "mealTime": "After Meal"}
    c = {"date": DATE, "qty": 1}
    results = set()
    for order in itertools.permutations([a, b, c]):
        winner, lost = reduce_candidates(list(order))
        results.add((id(winner), lost))
    assert results == {(id(max([a, b], key=canonical)), 1)}  # c is dominated: not counted


def test_winner_is_an_arrived_point_verbatim():
    text = ('[{"source": "Irvin’s Apple Watch", "qty": 61.999999999999993, "date": "%s",'
            ' "note": "a&b <c>"}, {"date": "%s", "qty": 61.99999999999998}]' % (DATE, DATE))
    candidates = json.loads(text)
    winner, _ = reduce_candidates(candidates)
    assert any(winner is c for c in candidates)
    assert winner is candidates[0]  # richer: "note" is content
    assert list(winner) == ["source", "qty", "date", "note"]
    assert winner["note"] == "a&b <c>" and winner["source"] == "Irvin’s Apple Watch"


def test_candidates_differing_only_in_source_give_a_stable_winner():
    a = {"date": DATE, "qty": 3, "source": "Watch"}
    b = {"date": DATE, "qty": 3, "source": "Phone"}
    assert reduce_candidates([a, b])[0] is reduce_candidates([b, a])[0]


def test_identical_twins_are_one_value():
    a = {"date": DATE, "qty": 3}
    winner, clash = reduce_candidates([a, dict(a)])
    assert winner == a and not clash


def test_a_single_candidate_wins_alone():
    point = {"date": DATE, "qty": 3}
    assert reduce_candidates([point]) == (point, 0)


CANDIDATE_KEYS = ("date", "qty", "Min", "Max", "context", "source")
CANDIDATE_VALUES = (None, "", 0, 0.0, {}, [], False, True, 1, 2, 2.0000000000000004, 10,
                    "a", "b", [1])
candidate_points = st.one_of(
    st.dictionaries(st.sampled_from(CANDIDATE_KEYS), st.sampled_from(CANDIDATE_VALUES),
                    max_size=6),
    st.sampled_from(["garbage", 7, None, [1]]))
candidate_lists = st.lists(candidate_points, min_size=1, max_size=6).map(
    lambda points: [copy.deepcopy(p) for p in points])  # distinct objects


@given(candidate_lists, st.data())
@settings(max_examples=150, deadline=None)
def test_property_reduce_candidates_is_independent_of_array_order(points, data):
    winner, clash = reduce_candidates(points)
    shuffled = data.draw(st.permutations(points))
    again, clash_again = reduce_candidates(shuffled)
    assert clash_again == clash
    assert json.dumps(again) == json.dumps(winner)
    if sum(json.dumps(p) == json.dumps(winner) for p in points) == 1:
        assert again is winner  # the very same arrived object


@given(candidate_lists)
@settings(max_examples=150, deadline=None)
def test_property_winner_is_an_input_and_never_dominated(points):
    winner, clash = reduce_candidates(points)
    assert any(winner is p for p in points)
    assert not any(dominates(p, winner) for p in points if p is not winner)
    for p in points:
        if any(dominates(q, p) for q in points if q is not p):
            assert winner is not p
    survivors = [p for p in points if not any(dominates(q, p) for q in points if q is not p)]
    assert clash == len({canonical(p) for p in survivors if not same_value(p, winner)})


def brute_force_reduce(points: list) -> tuple:
    """The merge rule's reduction written the obvious, quadratic way: the winner, and
    how many distinct values it dropped that were neither the same nor dominated."""
    survivors = [p for p in points if not any(dominates(q, p) for q in points if q is not p)]
    winner = max(survivors, key=lambda p: (canonical(p), json.dumps(p, ensure_ascii=False)))
    return winner, len({canonical(p) for p in survivors if not same_value(p, winner)})


def near_cell_edges():
    """Numbers on and beside the edges of the value index's cells, and their jitter."""
    values = []
    for k in (-3, 0, 7, 2302585093):
        edge = math.exp((k - 0.5) * 1e-9)
        values += [edge, math.nextafter(edge, 0), math.nextafter(edge, 10), edge * (1 + 5e-13)]
    return values


NUMBERS = near_cell_edges() + [1, 1.0, 1 + 4e-16, 10, 9.999999999999998, 0, -2, -2.0000000000000004]
rich_candidates = st.lists(
    st.dictionaries(st.sampled_from(("qty", "Min", "Max", "note", "source")),
                    st.one_of(st.sampled_from(NUMBERS), st.sampled_from(("", "a", None)),
                              st.lists(st.sampled_from(NUMBERS), max_size=2)),
                    max_size=4).map(lambda d: dict(d, date=DATE)),
    min_size=2, max_size=12)


@given(rich_candidates)
@settings(max_examples=200, deadline=None)
@example([{"date": DATE, "qty": 10, "Min": 1}, {"date": DATE, "qty": 9.999999999999998}])
def test_property_reduction_equals_the_quadratic_rule(points):
    winner, clash = reduce_candidates(points)
    expected, expected_clash = brute_force_reduce(points)
    assert json.dumps(winner) == json.dumps(expected) and clash == expected_clash


def test_a_long_reduction_checks_the_deadline_inside():
    # 2,000 pairwise incomparable rivals: the check runs many times inside one call,
    # and a check that raises ends the reduction there.
    points = [{"date": DATE, "qty": i + 1, "note%d" % i: "x"} for i in range(2000)]
    calls = []
    winner, lost = reduce_candidates(points, lambda: calls.append(1))
    assert lost == 1999 and len(calls) >= 2000

    class Expired(Exception):
        pass

    def expire_after_ten() -> None:
        calls.append(1)
        if len(calls) > 10:
            raise Expired()

    calls.clear()
    with pytest.raises(Expired):
        reduce_candidates(points, expire_after_ten)
    assert len(calls) == 11


def reference_empty(value) -> bool:
    """The storage spec's *empty* written out again: null, "", a number equal to 0, {}, []."""
    if isinstance(value, bool):
        return False
    return value is None or value == "" or value == {} or value == [] or (
        isinstance(value, (int, float)) and value == 0)


def reference_content(point) -> set:
    if not isinstance(point, dict):
        return set()
    return {k for k, v in point.items() if k != "source" and not reference_empty(v)}


def reference_keys(point) -> set:
    return {k for k in point if k != "source"} if isinstance(point, dict) else set()


def reference_dominates(a, b) -> bool:
    ca, cb = reference_content(a), reference_content(b)
    if ca > cb:
        return all(hf.same_value(without_source(a[k]), without_source(b[k])) for k in cb)
    return ca == cb and reference_keys(a) > reference_keys(b)


@given(candidate_points, candidate_points)
@settings(max_examples=150, deadline=None)
def test_property_dominance_and_incomparability_follow_the_design_text(a, b):
    assert dominates(a, b) is reference_dominates(a, b)
    ca, cb = reference_content(a), reference_content(b)
    assert incomparable(a, b) is bool(ca - cb and cb - ca)
    assert not (dominates(a, b) and dominates(b, a))  # never both ways


# ---------------------------------------------------------------------------
# Properties of the merge rule across deliveries
# ---------------------------------------------------------------------------

positions = st.tuples(st.sampled_from(["2024-03-08T10:00:00.000000Z",
                                       "2024-03-08T10:05:00.000000Z"]), st.integers(1, 9))


@given(candidate_lists, positions, positions)
@settings(max_examples=100, deadline=None)
def test_property_folding_the_same_candidates_twice_changes_nothing(points, first, second):
    winner, _ = reduce_candidates(points)
    winner_again, _ = reduce_candidates([copy.deepcopy(p) for p in points])
    assert arbitrate(winner, first, winner_again, second) == (False, False, False)
    for point in points:
        assert arbitrate(point, first, copy.deepcopy(point), second) == (False, False, False)


def impoverish(rich: dict, drop: list) -> dict:
    """``rich`` without some of its keys (at least one besides ``source``): dominated."""
    return {k: v for k, v in rich.items() if k not in drop}


rich_points = st.dictionaries(st.sampled_from(CANDIDATE_KEYS), st.sampled_from(CANDIDATE_VALUES),
                              min_size=1, max_size=6)


@given(rich_points, st.data(), positions, positions)
@settings(max_examples=150, deadline=None)
def test_property_a_dominated_point_never_replaces_a_richer_stored_one(rich, data, stored_at,
                                                                        arriving_at):
    keys = sorted(k for k in rich if k != "source")
    assume(keys)
    poor = impoverish(rich, data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True)))
    if "source" in rich and data.draw(st.booleans()):
        poor["source"] = "another device"
    assert dominates(rich, poor)  # fewer content keys with equal values, or fewer empty keys
    assert arbitrate(rich, stored_at, poor, arriving_at) == (False, False, False)
    replace, collision, clash = arbitrate(poor, stored_at, rich, arriving_at)
    assert replace and collision and not clash
    assert reduce_candidates([poor, rich])[0] is rich


def fold_in_journal_order(points: list) -> tuple:
    """One candidate per delivery, folded in journal order → (stored point, its index)."""
    stored, stored_at = points[0], ("t", 0)
    for index, point in enumerate(points[1:], start=1):
        replace, _, _ = arbitrate(stored, stored_at, point, ("t", index))
        if replace:
            stored, stored_at = point, ("t", index)
    return stored, stored_at[1]


VALUES_WITHOUT_BOOLEANS = tuple(v for v in CANDIDATE_VALUES if type(v) is not bool)


@given(st.lists(st.dictionaries(st.sampled_from(CANDIDATE_KEYS),
                                st.sampled_from(VALUES_WITHOUT_BOOLEANS), min_size=1, max_size=6),
                min_size=2, max_size=5))
@settings(max_examples=100, deadline=None)
def test_property_journal_order_fold_ends_with_a_non_dominated_winner(points):
    """The final stored point is never dominated by a point that arrived after it."""
    stored, index = fold_in_journal_order(points)
    assert not any(dominates(p, stored) for p in points[index + 1:])


@given(st.lists(rich_points, min_size=2, max_size=5))
@example([{"date": 0}, {"date": False}])
@settings(max_examples=100, deadline=None)
def test_property_journal_order_fold_ends_with_a_non_dominated_winner_with_booleans(points):
    stored, index = fold_in_journal_order(points)
    assert not any(dominates(p, stored) for p in points[index + 1:])


def test_arbitrate_never_takes_a_boolean_for_the_number_python_equates_it_with():
    # False is content and 0 is empty: the arriving point dominates and must replace
    assert arbitrate({"date": DATE, "isIndoor": 0}, EARLY,
                     {"date": DATE, "isIndoor": False}, LATE) == (True, True, False)
    # True is not the same value as 1: neither dominates, the later one wins
    assert arbitrate({"date": DATE, "qty": 1}, EARLY, {"date": DATE, "qty": True}, LATE) == (
        True, True, False)


def test_design_residual_three_way_pattern_depends_on_fold_order():
    """The reindex spec names this: A {qty:10, Min:5} (1), C {qty:11} (2), B {qty:10} (3)
    ends as B in journal order but as C when B is folded before C."""
    a, c, b = {"qty": 10, "Min": 5}, {"qty": 11}, {"qty": 10}
    at = {id(a): ("t", 1), id(c): ("t", 2), id(b): ("t", 3)}

    def fold(order):
        stored = order[0]
        for point in order[1:]:
            if arbitrate(stored, at[id(stored)], point, at[id(point)])[0]:
                stored = point
        return stored

    assert fold([a, c, b]) is b
    assert fold([a, b, c]) is c


# ---------------------------------------------------------------------------
# canonical
# ---------------------------------------------------------------------------


def test_canonical_sorts_keys_and_drops_source_at_every_level():
    point = {"source": "Watch", "qty": 1, "date": DATE,
             "heartRateData": [{"source": "Connect", "Max": 91, "Avg": 90}],
             "meta": {"z": 1, "a": {"source": "x", "b": 2}}}
    assert canonical(point) == (
        '{"date":"%s","heartRateData":[{"Avg":90,"Max":91}],"meta":{"a":{"b":2},"z":1},'
        '"qty":1}' % DATE)
    assert "source" not in canonical(point)
    assert point["source"] == "Watch"  # the point itself is not touched


def test_canonical_keeps_html_characters_and_non_ascii_verbatim():
    text = canonical({"name": "Irvin’s <Watch> & “Phone”", "value": "户外 步行"})
    assert text == '{"name":"Irvin’s <Watch> & “Phone”","value":"户外 步行"}'
    for escaped in ("\\u", "&amp;", "&lt;", "\\u003c"):
        assert escaped not in text


def test_canonical_numbers_are_shortest_round_trip():
    assert canonical(parsed("61.999999999999993")) == "61.99999999999999"
    assert canonical(parsed("0.76856774374845116")) == repr(0.76856774374845116)
    assert float(canonical(0.1 + 0.2)) == 0.1 + 0.2


@given(st.dictionaries(st.sampled_from(["a", "b", "c", "date", "qty", "source"]),
                       json_values, max_size=6), st.randoms(use_true_random=False))
@PROPS
def test_property_canonical_is_stable_across_key_order(point, rng):
    items = list(point.items())
    rng.shuffle(items)
    reordered = dict(items)
    assert canonical(reordered) == canonical(point)
    assert canonical(json.loads(json.dumps(point))) == canonical(point)


canonical_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e-3, max_value=1e-3, allow_nan=False),  # where the spellings differ
    st.text(), st.sampled_from(["source", "e-5", "0.00001", "\x7f", "\u2028", "😀"]))
canonical_values = st.recursive(
    canonical_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=4), st.sampled_from(["source", "date"])),
                        inner, max_size=4)),
    max_leaves=16)


def _json_module_canonical(value) -> bytes:
    """The canonical form written out with the json module alone (the spec's text)."""
    return json.dumps(without_source(value), sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"), allow_nan=False).encode()


@given(canonical_values)
@example([{"qty": 1e-05, "source": "x"}, {"qty": 1.5e-07}])  # 0.00001 and 1.5e-7 in orjson
@example([{"date": "d", "meta": {"source": "nested"}, "source": "top"}])
@example({"a": 1e+16, "b": 5e-324, "c": 1.7976931348623157e308, "é": "\x00\x1f\"\\"})
@example([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])
@PROPS
def test_storage_4_2_the_canonical_form_does_not_depend_on_orjson(value):
    assert healthlog.canonical_bytes(value) == _json_module_canonical(value)
    assert canonical(value) == _json_module_canonical(value).decode()


def test_storage_4_2_the_canonical_form_past_orjson_nesting_is_the_json_modules():
    deep = [{"qty": 1, "source": "x"}]
    for _ in range(300):  # orjson refuses more than 255 levels
        deep = [deep]
    assert healthlog.canonical_bytes(deep) == _json_module_canonical(deep)


@pytest.mark.json_agnostic  # about the orjson installed: the mode with it
def test_storage_4_2_an_orjson_that_spells_a_probe_differently_is_not_used(monkeypatch):
    orjson = pytest.importorskip("orjson")
    assert healthlog._orjson_canonical_ok()  # the installed one spells every probe alike

    class Respelling:
        """orjson, except that it writes 1e+16 as 1e16 (as some JSON writers do)."""
        OPT_SORT_KEYS = orjson.OPT_SORT_KEYS

        @staticmethod
        def dumps(value, option=0):
            return orjson.dumps(value, option=option).replace(b"1e+16", b"1e16")

    monkeypatch.setattr(healthlog, "_orjson", Respelling)
    assert not healthlog._orjson_canonical_ok()
