"""Stop strings across token boundaries."""

import numpy as np
import pytest

from lanes.stops import StopMatcher


def feed_all(matcher, deltas):
    emitted, hits = [], []
    for delta in deltas:
        text, hit = matcher.feed(delta)
        emitted.append(text)
        hits.append(hit)
    return emitted, hits


def test_no_stops_passes_everything_through():
    matcher = StopMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""
    assert StopMatcher([""]).feed("abc") == ("abc", False)  # empty stops are ignored


def test_stop_split_across_deltas():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("hello </") == ("hello ", False)  # "</" may start the stop: held
    assert matcher.feed("en") == ("", False)
    assert matcher.feed("d> more") == ("", True)  # nothing after the stop leaks
    assert matcher.stopped
    assert matcher.feed("later") == ("", True)
    assert matcher.flush() == ""


def test_stop_one_character_per_delta():
    matcher = StopMatcher(["STOP"])
    emitted, hits = feed_all(matcher, list("text S") + list("TOP!"))
    assert "".join(emitted) == "text "
    assert hits == [False] * 8 + [True, True]  # hit on the "P", then stays stopped


def test_false_start_is_released():
    matcher = StopMatcher(["abc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.feed("x") == ("abx", False)
    assert matcher.feed("a") == ("", False)
    assert matcher.flush() == "a"  # at the end, held text is released
    assert matcher.flush() == ""


def test_self_overlapping_stop():
    # "aaab" contains "aab" at 1: only the first "a" is emitted.
    matcher = StopMatcher(["aab"])
    assert matcher.feed("aa") == ("", False)
    assert matcher.feed("a") == ("a", False)  # "aaa": the tail "aa" may still start "aab"
    assert matcher.feed("b") == ("", True)


def test_earliest_of_several_stops_wins():
    assert StopMatcher(["world", "lo w"]).feed("hello world") == ("hel", True)
    assert StopMatcher(["abc", "ab"]).feed("xabc") == ("x", True)
    assert StopMatcher(["\n"]).feed("\nabc") == ("", True)


def test_the_first_completed_stop_wins_however_the_text_is_split():
    # In " caabc", "b" ends at 5 and "abc" at 6: reading on, generation stops at "b".
    assert StopMatcher(["abc", "b"]).feed(" caabc") == (" caa", True)
    emitted, hits = feed_all(StopMatcher(["abc", "b"]), [" ca", "a", "bc"])
    assert ("".join(emitted), hits[-1]) == (" caa", True)
    # Equal ends: the longer stop (starting earlier) cuts.
    assert StopMatcher(["c", "abc"]).feed("xabc") == ("x", True)


def test_hold_back_covers_every_stop():
    # "ab" could start "abcd"; "b" alone could start "bz": the longest candidate tail is held.
    matcher = StopMatcher(["abcd", "bz"])
    assert matcher.feed("xxab") == ("xx", False)
    assert matcher.feed("z") == ("a", True)  # "abz" contains "bz": emit "a"


def test_unicode_stops():
    matcher = StopMatcher(["é!"])
    assert matcher.feed("caf") == ("caf", False)
    assert matcher.feed("é") == ("", False)
    assert matcher.feed("!") == ("", True)


@pytest.mark.parametrize("seed", range(5))
def test_random_streams_match_a_reference(seed):
    # Reference: cut the whole text before the first completed stop. Streaming must emit exactly
    # that, never a stop string, report the hit at the first delta that completes one,
    # and every emitted prefix must be a prefix of the reference.
    rng = np.random.default_rng(seed)
    alphabet = list("ab c")
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet, int(rng.integers(1, 4)))) for _ in range(int(rng.integers(0, 4)))]
        text = "".join(rng.choice(alphabet, int(rng.integers(0, 30))))
        cuts = sorted(set(rng.integers(0, len(text) + 1, int(rng.integers(0, 8)))) | {0, len(text)})
        deltas = [text[a:b] for a, b in zip(cuts, cuts[1:])]

        hits = [(i + len(s), i) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
        expected = text[: min(hits)[1]] if hits else text

        matcher = StopMatcher(stops)
        emitted, seen = "", ""
        for delta in deltas:
            piece, hit = matcher.feed(delta)
            seen += delta
            emitted += piece
            assert expected.startswith(emitted)
            assert hit == any(s in seen for s in stops)
        emitted += matcher.flush()
        assert emitted == expected, (stops, deltas)
        assert not any(s and s in emitted for s in stops)
