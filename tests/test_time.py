"""Time parsing (healthlog.py section "Time"): every spelling of a timestamp HAE sends,
parsed to integer UTC microseconds (storage spec; HAE's spellings are summarised under §3
in tests/hae_factory.py's docstring).

Expected instants are computed independently with ``datetime`` arithmetic (or taken from
the factory's own DST model in tests/hae_factory.py), never with healthlog's helpers.
"""

from __future__ import annotations

import datetime as dt
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hae_factory as hf
import healthlog

US = 1_000_000
EPOCH = dt.datetime(1970, 1, 1)
FAST = settings(max_examples=150, deadline=None)


def utc_us(local: dt.datetime, offset_minutes: int = 0) -> int:
    """µs since the epoch of a naive local wall time written with ``offset_minutes``."""
    return (local - dt.timedelta(minutes=offset_minutes) - EPOCH) // dt.timedelta(microseconds=1)


def offset_text(minutes: int, colon: bool = False) -> str:
    sign = "-" if minutes < 0 else "+"
    hours, rest = divmod(abs(minutes), 60)
    return "%s%02d%s%02d" % (sign, hours, ":" if colon else "", rest)


def hae_24h(local: dt.datetime, offset_minutes: int) -> str:
    return local.strftime("%Y-%m-%d %H:%M:%S") + " " + offset_text(offset_minutes)


# ---------------------------------------------------------------------------
# HAE's own format and its fast path
# ---------------------------------------------------------------------------


def test_hae_format_is_parsed_to_utc_microseconds():
    assert healthlog.parse_time("2024-02-06 14:30:00 -0800") == utc_us(
        dt.datetime(2024, 2, 6, 14, 30), -480)
    assert healthlog.parse_time("2026-05-19 00:00:00 -0700") == utc_us(
        dt.datetime(2026, 5, 19), -420)
    assert healthlog.parse_time("2021-03-14 01:13:00 +0000") == utc_us(
        dt.datetime(2021, 3, 14, 1, 13))
    assert healthlog.parse_time("2025-11-27 09:46:11 +0100") == utc_us(
        dt.datetime(2025, 11, 27, 9, 46, 11), 60)
    # an odd offset with minutes (India, Nepal)
    assert healthlog.parse_time("2024-01-01 12:00:00 +0545") == utc_us(
        dt.datetime(2024, 1, 1, 12), 5 * 60 + 45)


def test_fast_path_serves_other_minutes_of_a_cached_hour(monkeypatch):
    """The cache (``_HOUR_BASE``, hour + offset -> base instant) answers without the slow
    parser (``_parse_time_text``); both are internals named here on purpose."""
    monkeypatch.setattr(healthlog, "_HOUR_BASE", {})
    first = "2024-03-08 10:00:00 -0800"
    assert healthlog.parse_time(first) == utc_us(dt.datetime(2024, 3, 8, 10), -480)
    # The second call of the same hour and offset must not need the slow parser at all.
    with mock.patch.object(healthlog, "_parse_time_text", side_effect=AssertionError("slow")):
        assert healthlog.parse_time("2024-03-08 10:37:59 -0800") == utc_us(
            dt.datetime(2024, 3, 8, 10, 37, 59), -480)
        assert healthlog.parse_time("2024-03-08 10:00:00 -0800") == utc_us(
            dt.datetime(2024, 3, 8, 10), -480)
        assert healthlog.parse_time("2024-03-08 10:59:01 -0800") == utc_us(
            dt.datetime(2024, 3, 8, 10, 59, 1), -480)


def test_fast_path_cache_does_not_leak_across_offsets_hours_or_dates(monkeypatch):
    monkeypatch.setattr(healthlog, "_HOUR_BASE", {})
    healthlog.parse_time("2024-03-08 10:00:00 -0800")
    assert healthlog.parse_time("2024-03-08 10:15:00 -0700") == utc_us(
        dt.datetime(2024, 3, 8, 10, 15), -420)
    assert healthlog.parse_time("2024-03-08 11:15:00 -0800") == utc_us(
        dt.datetime(2024, 3, 8, 11, 15), -480)
    assert healthlog.parse_time("2024-03-09 10:15:00 -0800") == utc_us(
        dt.datetime(2024, 3, 9, 10, 15), -480)
    # a colon offset of the same length has its own cache entry and its own value
    assert healthlog.parse_time("2024-03-08 10:15:00+01:00") == utc_us(
        dt.datetime(2024, 3, 8, 10, 15), 60)
    assert healthlog.parse_time("2024-03-08 10:16:00+01:00") == utc_us(
        dt.datetime(2024, 3, 8, 10, 16), 60)


@pytest.mark.parametrize("bad", [
    "2024-03-08 10:60:00 -0800",
    "2024-03-08 10:00:60 -0800",
    "2024-03-08 10:5x:00 -0800",
    "2024-03-08 10:-1:00 -0800",
    "2024-03-08 10: 1:00 -0800",
])
def test_fast_path_rejects_bad_minutes_and_seconds_of_a_cached_hour(monkeypatch, bad):
    monkeypatch.setattr(healthlog, "_HOUR_BASE", {})
    assert healthlog.parse_time("2024-03-08 10:00:00 -0800") is not None
    assert healthlog.parse_time(bad) is None


def test_fractional_seconds_and_one_digit_hour():
    base = dt.datetime(2024, 3, 8, 7, 5, 9)
    assert healthlog.parse_time("2024-03-08 07:05:09.5 +0100") == utc_us(base, 60) + 500_000
    assert healthlog.parse_time("2024-03-08 07:05:09.123456 +0100") == utc_us(base, 60) + 123_456
    # digits beyond microseconds are cut, never rounded into the next second
    assert healthlog.parse_time("2024-03-08 07:05:09.999999999 +0100") == utc_us(base, 60) + 999_999
    assert healthlog.parse_time("2024-03-08 7:05:09 +0100") == utc_us(base, 60)
    assert healthlog.parse_time("2024-03-08 7:05:09.25 +0100") == utc_us(base, 60) + 250_000


def test_surrounding_whitespace_is_ignored():
    assert healthlog.parse_time("  2024-03-08 07:05:09 +0100\n") == utc_us(
        dt.datetime(2024, 3, 8, 7, 5, 9), 60)


# ---------------------------------------------------------------------------
# 12-hour variants (locale leaking into HAE's format, hae_factory's §3)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, hour, minute, second", [
    ("2024-09-21 7:57:00 am +1000", 7, 57, 0),
    ("2024-09-21 7:57:00 AM +1000", 7, 57, 0),
    ("2024-09-21 7:57:00 pm +1000", 19, 57, 0),
    ("2024-09-21 7:57:00 PM +1000", 19, 57, 0),
    ("2024-09-21 12:00:00 am +1000", 0, 0, 0),     # midnight
    ("2024-09-21 12:30:00 pm +1000", 12, 30, 0),   # half past noon
    ("2024-09-21 12:30:00 am +1000", 0, 30, 0),
    ("2024-09-21 11:59:59 pm +1000", 23, 59, 59),
    ("2024-09-21 7:57:00\u202fam +1000", 7, 57, 0),   # ICU 72 narrow no-break space
    ("2024-09-21 7:57:00\u00a0PM +1000", 19, 57, 0),  # no-break space
    ("2024-09-21 7:57 pm +1000", 19, 57, 0),          # no seconds (medication dates)
    ("2024-09-21 07:57:00 am +1000", 7, 57, 0),
])
def test_twelve_hour_forms(text, hour, minute, second):
    assert healthlog.parse_time(text) == utc_us(dt.datetime(2024, 9, 21, hour, minute, second),
                                                600)


@pytest.mark.parametrize("bad", [
    "2024-09-21 13:00:00 pm +1000",
    "2024-09-21 0:30:00 am +1000",
    "2024-09-21 7:60:00 am +1000",
    "2024-09-21 7:57:60 am +1000",
    "2024-09-21 7:57:00 xm +1000",
    "2024-09-21 7:57:00 am +2400",
    "2024-09-21 7:57:00 am",
])
def test_twelve_hour_forms_out_of_range_are_rejected(bad):
    assert healthlog.parse_time(bad) is None


# ---------------------------------------------------------------------------
# Date-only, ISO-8601, epoch numbers
# ---------------------------------------------------------------------------


def test_date_only_is_utc_midnight():
    assert healthlog.parse_time("2023-01-31") == utc_us(dt.datetime(2023, 1, 31))
    assert healthlog.parse_time("2024-02-29") == utc_us(dt.datetime(2024, 2, 29))


@pytest.mark.parametrize("text, offset", [
    ("2025-12-07T13:32:10Z", 0),
    ("2025-12-07T13:32:10z", 0),
    ("2025-12-07T13:32:10+02:00", 120),
    ("2025-12-07T13:32:10+0200", 120),
    ("2025-12-07T13:32:10-05:30", -330),
])
def test_iso_8601_with_zulu_or_offset(text, offset):
    assert healthlog.parse_time(text) == utc_us(dt.datetime(2025, 12, 7, 13, 32, 10), offset)


def test_iso_8601_fractions_and_minutes_only():
    assert healthlog.parse_time("2025-12-07T13:32:10.25Z") == utc_us(
        dt.datetime(2025, 12, 7, 13, 32, 10)) + 250_000
    assert healthlog.parse_time("2025-12-07T13:32Z") == utc_us(dt.datetime(2025, 12, 7, 13, 32))


def test_epoch_seconds_int_and_float():
    assert healthlog.parse_time(1700000000) == 1700000000 * US
    assert healthlog.parse_time(1476833353.994098) == 1476833353994098
    assert healthlog.parse_time(1710231499.616905) == 1710231499616905
    assert healthlog.parse_time(0) == 0
    assert healthlog.parse_time(-1_000_000_000) == -1_000_000_000 * US  # 1938


def test_epoch_milliseconds_above_1e11():
    assert healthlog.parse_time(1700000000123) == 1700000000123000
    assert healthlog.parse_time(1700000000123.0) == 1700000000123000
    assert healthlog.parse_time(1700000000123.5) == 1700000000123500
    # just under the threshold it is still seconds (year ~5138, out of range)
    assert healthlog.parse_time(99_999_999_999) is None
    assert healthlog.parse_time(100_000_000_000) == 100_000_000_000_000  # 1973 in ms


@given(st.one_of(st.integers(-2_208_988_800_000, -100_000_000_000),
                 st.integers(100_000_000_000, 7_258_118_399_999)))
@settings(max_examples=200, deadline=None)
def test_epoch_milliseconds_are_exact_to_the_microsecond(ms):
    assert healthlog.parse_time(ms) == ms * 1000
    assert healthlog.parse_time(float(ms)) == ms * 1000


# ---------------------------------------------------------------------------
# Rejection
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    None, True, False, "", "   ", "garbage", "2024", "2024-03", "yesterday",
    "2024-03-08 10:00:00",            # no offset: the instant is unknown
    "2024-03-08T10:00:00",            # naive ISO
    "2026-02-30 10:00:00 +0000",      # no such date
    "2026-02-30",
    "2025-02-29T00:00:00Z",
    "2024-13-01 00:00:00 +0000",
    "2024-00-10 00:00:00 +0000",
    "2024-03-08 24:00:00 +0000",
    "2024-03-08 23:60:00 +0000",
    "2024-03-08 23:59:60 +0000",      # no leap seconds
    "2024-03-08 10:00:00 +2400",
    "2024-03-08 10:00:00 +0160",
    "2024-03-08 10:00:00 -2500",
    "2024-03-08T10:00:00+25:00",
    "2024-03-08 10:00:00 +01",
    "1899-12-31 23:59:59 +0000",
    "1900-01-01 00:00:00 +0100",      # 1899 in UTC
    "2200-01-01 00:00:00 +0000",
    "0001-01-01 00:00:00 +0000",
    "9999-12-31 23:59:59 +0000",
    "NaN", "inf",
    "２０２４-03-08 10:00:00 +0000",   # non-ASCII digits
    float("nan"), float("inf"), float("-inf"),
    7_258_118_400,                    # 2200-01-01 in seconds
    -2_208_988_801,                   # just before 1900 in seconds
    1e15 * 1000,                      # far future in ms
    [], {}, ["2024-03-08 10:00:00 +0000"], {"date": "2024-03-08 10:00:00 +0000"},
    b"2024-03-08 10:00:00 +0000",
])
def test_garbage_is_rejected_with_none(bad):
    assert healthlog.parse_time(bad) is None


def test_range_bounds_1900_to_2200():
    assert healthlog.parse_time("1900-01-01 00:00:00 +0000") == utc_us(dt.datetime(1900, 1, 1))
    assert healthlog.parse_time("1900-01-01 01:00:00 +0100") == utc_us(dt.datetime(1900, 1, 1))
    assert healthlog.parse_time("2199-12-31 23:59:59 +0000") == utc_us(
        dt.datetime(2199, 12, 31, 23, 59, 59))
    assert healthlog.parse_time(-2_208_988_800) == utc_us(dt.datetime(1900, 1, 1))


def test_huge_integer_epoch_is_rejected_not_raised():
    assert healthlog.parse_time(10 ** 400) is None


def test_huge_float_epoch_is_rejected_not_raised():
    assert healthlog.parse_time(1e306) is None
    assert healthlog.parse_time(-1e308) is None


# ---------------------------------------------------------------------------
# DST: the offset written in the string is the truth
# ---------------------------------------------------------------------------


def test_same_wall_time_on_both_sides_of_fall_back_maps_to_two_instants():
    first = dt.datetime(2024, 11, 3, 8, 30, tzinfo=dt.timezone.utc)   # 01:30 PDT
    second = dt.datetime(2024, 11, 3, 9, 30, tzinfo=dt.timezone.utc)  # 01:30 PST
    early, late = hf.hae_time(first, hf.PACIFIC), hf.hae_time(second, hf.PACIFIC)
    assert (early, late) == ("2024-11-03 01:30:00 -0700", "2024-11-03 01:30:00 -0800")
    assert healthlog.parse_time(early) == int(first.timestamp()) * US
    assert healthlog.parse_time(late) == int(second.timestamp()) * US
    assert healthlog.parse_time(late) - healthlog.parse_time(early) == 3600 * US


def test_spring_forward_gap_is_one_minute_in_utc():
    before = hf.hae_time(dt.datetime(2024, 3, 10, 1, 59), hf.PACIFIC)
    after = hf.hae_time(dt.datetime(2024, 3, 10, 3, 0), hf.PACIFIC)
    assert (before, after) == ("2024-03-10 01:59:00 -0800", "2024-03-10 03:00:00 -0700")
    assert healthlog.parse_time(after) - healthlog.parse_time(before) == 60 * US


@pytest.mark.parametrize("zone, day", [(hf.PACIFIC, hf.DST_SPRING), (hf.PACIFIC, hf.DST_FALL),
                                       (hf.BERLIN, dt.date(2024, 3, 31)),
                                       (hf.BERLIN, dt.date(2024, 10, 27))])
@pytest.mark.parametrize("style", sorted(hf.TIME_STYLES))
def test_every_minute_of_a_dst_day_parses_to_its_instant(zone, day, style):
    start = hf.local_midnight(zone, day)
    end = hf.local_midnight(zone, day + dt.timedelta(days=1))
    offsets = set()
    for t in range(start, end, 60):
        text = hf.hae_time(t, zone, style)
        offsets.add(text[-5:])
        assert healthlog.parse_time(text) == t * US, text
        assert healthlog.parse_time(text) == t * US, text  # again, through the cache
    assert len(offsets) == 2  # the day really crosses a DST change
    assert (end - start) in (23 * 3600, 25 * 3600)


# ---------------------------------------------------------------------------
# Properties: writing then parsing gives the exact UTC instant
# ---------------------------------------------------------------------------

local_times = st.datetimes(min_value=dt.datetime(1901, 1, 1),
                           max_value=dt.datetime(2198, 12, 31, 23, 59, 59))
offsets = st.integers(-(23 * 60 + 59), 23 * 60 + 59)


@given(local_times, offsets, st.integers(0, 59), st.integers(0, 59))
@FAST
def test_property_hae_24h_round_trip_first_and_repeated_calls(local, offset, minute, second):
    local = local.replace(microsecond=0)
    text = hae_24h(local, offset)
    healthlog._HOUR_BASE.clear()  # the first call really is a first call
    expected = utc_us(local, offset)
    assert healthlog.parse_time(text) == expected
    assert healthlog.parse_time(text) == expected
    other = local.replace(minute=minute, second=second)
    with mock.patch.object(healthlog, "_parse_time_text", side_effect=AssertionError("slow")):
        assert healthlog.parse_time(hae_24h(other, offset)) == utc_us(other, offset)


@given(local_times, offsets, st.sampled_from(["am", "AM", "a.m.", "Am"]),
       st.sampled_from([" ", "\u00a0", "\u202f", ""]), st.booleans(), st.booleans())
@FAST
def test_property_twelve_hour_round_trip(local, offset, marker, space, with_seconds, colon):
    local = local.replace(microsecond=0, second=local.second if with_seconds else 0)
    if local.hour >= 12:
        marker = marker.replace("a", "p").replace("A", "P")
    clock = "%d:%02d" % (local.hour % 12 or 12, local.minute)
    if with_seconds:
        clock += ":%02d" % local.second
    text = "%s %s%s%s %s" % (local.strftime("%Y-%m-%d"), clock, space, marker,
                             offset_text(offset, colon))
    assert healthlog.parse_time(text) == utc_us(local, offset), text


@given(local_times, offsets, st.sampled_from(["Z", "z", "colon", "plain"]), st.booleans())
@FAST
def test_property_iso_8601_round_trip(local, offset, zone_form, with_fraction):
    if not with_fraction:
        local = local.replace(microsecond=0)
    text = local.strftime("%Y-%m-%dT%H:%M:%S")
    if with_fraction:
        text += ".%06d" % local.microsecond
    if zone_form in ("Z", "z"):
        text += zone_form
        offset = 0
    else:
        text += offset_text(offset, colon=zone_form == "colon")
    assert healthlog.parse_time(text) == utc_us(local, offset), text


@given(st.dates(min_value=dt.date(1900, 1, 1), max_value=dt.date(2199, 12, 31)))
@FAST
def test_property_date_only_is_utc_midnight(day):
    assert healthlog.parse_time(day.isoformat()) == utc_us(dt.datetime.combine(day, dt.time()))


@given(st.integers(-2_208_988_800 * US, 7_258_118_400 * US - 1))
@FAST
def test_property_format_instant_round_trips(instant):
    text = healthlog.format_instant(instant)
    assert text.endswith("Z")
    assert healthlog.parse_time(text) == instant


def test_format_instant_spelling():
    assert healthlog.format_instant(0) == "1970-01-01T00:00:00Z"
    assert healthlog.format_instant(1_500_000) == "1970-01-01T00:00:01.5Z"
    assert healthlog.format_instant(1) == "1970-01-01T00:00:00.000001Z"
    assert healthlog.format_instant(-US) == "1969-12-31T23:59:59Z"


# ---------------------------------------------------------------------------
# local_day_and_second: the LOCAL date and time as written
# ---------------------------------------------------------------------------


def ordinal(y, m, d):
    return dt.date(y, m, d).toordinal()


@pytest.mark.parametrize("value, expected", [
    # 23:30 local on the 10th is already the 11th in UTC: the written date counts
    ("2024-03-10 23:30:00 -0700", (ordinal(2024, 3, 10), 23 * 3600 + 30 * 60)),
    ("2024-03-11 00:00:00 +1400", (ordinal(2024, 3, 11), 0)),
    ("2024-03-10 03:00:00 -0700", (ordinal(2024, 3, 10), 3 * 3600)),
    ("2024-03-10 7:05:09 -0700", (ordinal(2024, 3, 10), 7 * 3600 + 5 * 60 + 9)),
    ("2024-09-21 12:15:00 am +1000", (ordinal(2024, 9, 21), 15 * 60)),
    ("2024-09-21 12:15:00\u202fpm +1000", (ordinal(2024, 9, 21), 12 * 3600 + 15 * 60)),
    ("2024-09-21 7:57 pm +1000", (ordinal(2024, 9, 21), 19 * 3600 + 57 * 60)),
    ("2025-12-07T13:32:10+02:00", (ordinal(2025, 12, 7), 13 * 3600 + 32 * 60 + 10)),
    ("2025-12-07T13:32:10Z", (ordinal(2025, 12, 7), 13 * 3600 + 32 * 60 + 10)),
    ("2023-01-31", (ordinal(2023, 1, 31), 0)),
    (86400 + 61, (ordinal(1970, 1, 2), 61)),  # epoch numbers are UTC
])
def test_local_day_and_second_is_the_written_local_time(value, expected):
    assert healthlog.local_day_and_second(value) == expected


def test_local_day_and_second_marks_a_fraction_as_unaligned():
    day, second = healthlog.local_day_and_second("2024-03-10 10:00:00.5 -0700")
    assert day == ordinal(2024, 3, 10)
    assert second % 60 != 0 and 36000 < second < 36001
    # a fraction of zeros is aligned
    assert healthlog.local_day_and_second("2024-03-10 10:00:00.000 -0700") == (
        ordinal(2024, 3, 10), 36000)


@pytest.mark.parametrize("bad", [None, True, "garbage", "2026-02-30 10:00:00 +0000", "",
                                 float("nan")])
def test_local_day_and_second_rejects_what_is_not_a_time(bad):
    assert healthlog.local_day_and_second(bad) is None


@given(local_times, offsets)
@FAST
def test_property_local_day_and_second_ignores_the_offset(local, offset):
    local = local.replace(microsecond=0)
    expected = (local.date().toordinal(), local.hour * 3600 + local.minute * 60 + local.second)
    assert healthlog.local_day_and_second(hae_24h(local, offset)) == expected


def test_dst_day_local_midnights_are_midnight_whatever_the_offset():
    for day in (hf.DST_SPRING, hf.DST_FALL, hf.DST_SPRING + dt.timedelta(days=1)):
        text = hf.hae_time(day, hf.PACIFIC)
        assert healthlog.local_day_and_second(text) == (day.toordinal(), 0)
    assert hf.hae_time(hf.DST_SPRING, hf.PACIFIC).endswith("-0800")
    assert hf.hae_time(hf.DST_SPRING + dt.timedelta(days=1), hf.PACIFIC).endswith("-0700")

