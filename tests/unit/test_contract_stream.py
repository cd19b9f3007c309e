"""Stream rules of trainwire.contract: every rule, with examples and hypothesis properties."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwire.contract import MAX_COMPLETION_BYTES, ContractViolation, StreamChecker
from trainwire.v1 import episode_pb2


def make_stream(
    rewards: list[float], kind: str = "imitation", done: bool = True
) -> list[episode_pb2.Episode]:
    """A valid stream with the given rewards (running best, done on the last)."""
    out = []
    best = -math.inf
    for i, r in enumerate(rewards, start=1):
        best = max(best, r)
        ep = episode_pb2.Episode(episode=i, reward=r, best_reward=best, metrics={"loss": r / 2})
        ep.done = done and i == len(rewards)
        out.append(ep)
    return out


def run_checker(stream: list[episode_pb2.Episode], max_episodes: int, kind: str = "imitation"):
    checker = StreamChecker(kind, max_episodes, run_id="run-7")
    for ep in stream:
        checker.check(ep)
    checker.finish()
    return checker


def violation(stream, max_episodes=10, kind="imitation") -> ContractViolation:
    with pytest.raises(ContractViolation) as info:
        run_checker(stream, max_episodes, kind)
    return info.value


def test_valid_stream_passes_and_tracks_state():
    checker = run_checker(make_stream([0.1, 0.3, 0.2]), 10)
    assert checker.last_episode == 3
    assert checker.done
    assert checker.best_reward == 0.3


def test_first_episode_must_be_one():
    stream = make_stream([0.1, 0.2])
    stream[0].episode = 2
    err = violation(stream)
    assert err.rule == "sequence" and err.episode == 2
    assert "does not start the stream at 1" in str(err)
    assert "run run-7" in str(err) and "episode 2" in str(err)


@pytest.mark.parametrize(
    ("second", "words"),
    [(3, "skips 1 episode"), (1, "repeats"), (0, "goes backwards")],
)
def test_gaps_repeats_and_going_backwards(second, words):
    stream = make_stream([0.1, 0.2, 0.3])
    stream[1].episode = second
    err = violation(stream)
    assert err.rule == "sequence" and err.field == "episode"
    assert words in str(err)


def test_going_backwards_later_in_stream():
    stream = make_stream([0.1, 0.2, 0.3, 0.4])
    stream[3].episode = 2
    err = violation(stream)
    assert err.rule == "sequence" and "goes backwards from 3" in str(err)


def test_above_max_episodes():
    stream = make_stream([0.1, 0.2, 0.3], done=False)
    err = violation(stream, max_episodes=2)
    # episode 2 == max_episodes without done is itself a violation (nothing may follow it)
    assert err.rule == "done" and err.episode == 2


def test_episode_number_above_max_is_caught_even_with_done_set_late():
    checker = StreamChecker("imitation", 1)
    with pytest.raises(ContractViolation) as info:
        checker.check(episode_pb2.Episode(episode=2, reward=0, best_reward=0))
    assert info.value.rule == "sequence"
    checker = StreamChecker("imitation", 1)
    checker.check(episode_pb2.Episode(episode=1, reward=0, best_reward=0, done=True))
    assert checker.done


def test_max_episodes_rule_when_numbering_is_right():
    checker = StreamChecker("imitation", 2)
    checker.last_episode = 2  # a checker resumed at the limit (as the gateway does after replay)
    with pytest.raises(ContractViolation) as info:
        checker.check(episode_pb2.Episode(episode=3, reward=0, best_reward=0))
    assert info.value.rule == "max_episodes" and "above max_episodes 2" in str(info.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["reward", "best_reward", "metric"])
def test_non_finite_numbers(bad, field):
    stream = make_stream([0.1, 0.2, 0.3])
    if field == "metric":
        stream[1].metrics["kl"] = bad
        expected_field = "metrics[kl]"
    else:
        setattr(stream[1], field, bad)
        if field == "reward":
            stream[1].best_reward = 0.2
        expected_field = field
    err = violation(stream)
    assert err.rule == "finite" and err.episode == 2 and err.field == expected_field


def test_large_finite_metrics_that_overflow_a_sum_are_fine():
    stream = make_stream([0.1])
    stream[0].metrics.update({"a": 1e308, "b": 1e308})
    run_checker(stream, 10)


def test_first_best_reward_must_equal_reward():
    stream = make_stream([0.1, 0.2])
    stream[0].best_reward = 0.5
    err = violation(stream)
    assert err.rule == "best_reward" and err.episode == 1


def test_best_reward_must_be_running_max():
    stream = make_stream([0.5, 0.2, 0.1])
    stream[2].best_reward = 0.2
    err = violation(stream)
    assert err.rule == "best_reward" and err.episode == 3 and "0.5" in str(err)


def test_nothing_after_done():
    stream = make_stream([0.1, 0.2])
    stream.append(episode_pb2.Episode(episode=3, reward=0.1, best_reward=0.2))
    err = violation(stream)
    assert err.rule == "done" and err.episode == 3 and "after the done episode 2" in str(err)


def test_missing_done_at_end_of_stream():
    err = violation(make_stream([0.1, 0.2], done=False))
    assert err.rule == "done" and err.episode is None and "without done" in str(err)


def test_empty_stream_without_done():
    checker = StreamChecker("grpo", 5)
    with pytest.raises(ContractViolation, match="after episode 0 without done"):
        checker.finish()


def test_detail_kind_must_match_task():
    stream = make_stream([0.1, 0.2], kind="imitation")
    stream[0].grpo.sample_completions.append("hello")
    err = violation(stream, kind="imitation")
    assert err.rule == "detail_kind" and err.field == "detail.grpo"
    stream = make_stream([0.1, 0.2])
    stream[1].imitation.frame_count = 1
    err = violation(stream, kind="grpo")
    assert err.rule == "detail_kind" and err.episode == 2


def imitation_detail(frames: int, joints: int, n: int | None = None) -> episode_pb2.ImitationDetail:
    count = frames * joints if n is None else n
    return episode_pb2.ImitationDetail(
        frame_count=frames, joint_count=joints, angles=[0.25] * count
    )


def test_imitation_detail_within_limits_passes():
    stream = make_stream([0.1])
    stream[0].imitation.CopyFrom(imitation_detail(240, 32))
    run_checker(stream, 10)


@pytest.mark.parametrize(
    ("frames", "joints", "n", "words"),
    [
        (241, 1, None, "frame_count 241"),
        (0, 1, 0, "frame_count 0"),
        (10, 33, None, "joint_count 33"),
        (10, 11, 109, "109 angles for 10 frames x 11 joints"),
    ],
)
def test_imitation_detail_size(frames, joints, n, words):
    stream = make_stream([0.1])
    stream[0].imitation.CopyFrom(imitation_detail(frames, joints, n))
    err = violation(stream)
    assert err.rule == "detail_size" and words in str(err)


def test_imitation_angles_must_be_finite():
    stream = make_stream([0.1])
    stream[0].imitation.CopyFrom(imitation_detail(2, 2))
    stream[0].imitation.angles[3] = math.nan
    err = violation(stream)
    assert err.rule == "finite" and err.field == "detail.imitation.angles"


def test_grpo_detail_limits():
    ok = make_stream([0.1])
    ok[0].grpo.sample_completions.extend(["é" * (MAX_COMPLETION_BYTES // 2)] * 8)
    run_checker(ok, 10, kind="grpo")

    too_many = make_stream([0.1])
    too_many[0].grpo.sample_completions.extend(["x"] * 9)
    err = violation(too_many, kind="grpo")
    assert err.rule == "detail_size" and "9 completions" in str(err)

    too_long = make_stream([0.1])
    # 2049 two-byte characters: 4098 bytes, though only 2049 characters
    too_long[0].grpo.sample_completions.extend(["ok", "é" * 2049])
    err = violation(too_long, kind="grpo")
    assert err.rule == "detail_size" and err.field == "detail.grpo.sample_completions[1]"
    assert "4098 bytes" in str(err)


def test_checker_rejects_bad_construction():
    with pytest.raises(ValueError, match="unknown task kind"):
        StreamChecker("", 10)
    with pytest.raises(ValueError, match="max_episodes"):
        StreamChecker("grpo", 0)


def test_for_task_uses_kind_and_max_episodes():
    task = episode_pb2.TrainTask(grpo=episode_pb2.GrpoTask(model_path="m"))
    checker = StreamChecker.for_task(task, episode_pb2.TrainConfig(max_episodes=7), "r")
    assert (checker.kind, checker.max_episodes, checker.run_id) == ("grpo", 7, "r")


# -- properties --------------------------------------------------------------------------------

finite_rewards = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def valid_streams(draw):
    rewards = draw(st.lists(finite_rewards, min_size=1, max_size=40))
    kind = draw(st.sampled_from(["imitation", "grpo"]))
    max_episodes = draw(st.integers(min_value=len(rewards), max_value=len(rewards) + 5))
    stream = make_stream(rewards, kind)
    for ep in stream:
        if draw(st.booleans()):
            if kind == "imitation":
                frames = draw(st.integers(1, 240))
                joints = draw(st.integers(1, 32))
                ep.imitation.CopyFrom(imitation_detail(frames, joints))
            else:
                ep.grpo.sample_completions.extend(draw(st.lists(st.text(max_size=50), max_size=8)))
    return stream, kind, max_episodes


@settings(max_examples=150, deadline=None)
@given(valid_streams())
def test_valid_streams_always_pass(case):
    stream, kind, max_episodes = case
    run_checker(stream, max_episodes, kind)


MUTATIONS = [
    "renumber",
    "drop",
    "duplicate",
    "reward_nan",
    "best_inf",
    "metric_nan",
    "best_off",
    "done_early",
    "no_done",
    "wrong_detail",
    "oversize",
]


def mutate(stream, kind, index, mutation, shift):
    ep = stream[index]
    if mutation == "renumber":
        ep.episode += shift if shift != 0 else 1
    elif mutation == "drop":
        if len(stream) == 1:
            return None  # dropping the only episode leaves no done: handled by no_done
        del stream[index]
    elif mutation == "duplicate":
        copy = episode_pb2.Episode()
        copy.CopyFrom(ep)
        stream.insert(index + 1, copy)
    elif mutation == "reward_nan":
        ep.reward = math.nan
    elif mutation == "best_inf":
        ep.best_reward = math.inf
    elif mutation == "metric_nan":
        ep.metrics["loss"] = -math.inf
    elif mutation == "best_off":
        ep.best_reward = ep.best_reward + 1.0
    elif mutation == "done_early":
        if index == len(stream) - 1:
            return None
        ep.done = True
    elif mutation == "no_done":
        stream[-1].done = False
    elif mutation == "wrong_detail":
        if kind == "imitation":
            ep.grpo.sample_completions.append("x")
        else:
            ep.imitation.CopyFrom(imitation_detail(1, 1))
    elif mutation == "oversize":
        if kind == "imitation":
            ep.imitation.CopyFrom(imitation_detail(241, 1))
        else:
            ep.grpo.sample_completions.extend(["x"] * 9)
    return stream


@settings(max_examples=300, deadline=None)
@given(
    valid_streams(),
    st.data(),
    st.sampled_from(MUTATIONS),
    st.integers(-3, 3),
)
def test_any_single_mutation_is_caught(case, data, mutation, shift):
    stream, kind, max_episodes = case
    index = data.draw(st.integers(0, len(stream) - 1))
    mutated = mutate(stream, kind, index, mutation, shift)
    if mutated is None:
        return
    with pytest.raises(ContractViolation):
        run_checker(mutated, max_episodes, kind)


# -- the screen in front of the rules ----------------------------------------------------------
# ``check`` first clears well-formed episodes with a screen (serialized bytes for the doubles
# and the angles) and sends the rest through the rule-by-rule check. An episode that is not the
# stream's last reaches the screen, so these tests put their subject on episode 1 of two.


class ExactChecker(StreamChecker):
    """The rule-by-rule check alone: what the screened checker must agree with."""

    __slots__ = ()

    def check(self, episode: episode_pb2.Episode) -> None:
        self._check_exactly(episode)


def outcome(checker_type, stream, max_episodes=10, kind="imitation"):
    checker = checker_type(kind, max_episodes, run_id="run-7")
    try:
        for ep in stream:
            checker.check(ep)
        checker.finish()
    except ContractViolation as exc:
        return (exc.rule, exc.episode, exc.field, str(exc))
    return (checker.last_episode, checker.best_reward, checker.done)


def with_motion(angles: list[float], joints: int = 1) -> list[episode_pb2.Episode]:
    stream = make_stream([0.1, 0.2])
    stream[0].imitation.CopyFrom(
        episode_pb2.ImitationDetail(
            frame_count=len(angles) // joints, joint_count=joints, angles=angles
        )
    )
    return stream


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("position", [0, 240 * 32 // 2, 240 * 32 - 1])
def test_a_non_finite_angle_anywhere_in_the_largest_motion_is_caught(bad, position):
    angles = [0.25] * (240 * 32)
    angles[position] = bad
    err = violation(with_motion(angles, joints=32))
    assert (err.rule, err.episode, err.field) == ("finite", 1, "detail.imitation.angles")
    assert str(err).endswith(": an angle is not finite")


def test_huge_finite_angles_pass():
    # float32's largest values share their high byte with inf and NaN: the screen defers them.
    run_checker(with_motion([3.4e38, -3.4e38, 1.7e38, 0.5]), 10)


def test_a_motion_with_an_unknown_field_is_checked_angle_by_angle():
    good = with_motion([0.5, 0.25])
    raw = good[0].imitation.SerializeToString() + b"\x20\x01"  # field 4, unknown here
    good[0].imitation.ParseFromString(raw)
    run_checker(good, 10)
    bad = with_motion([0.5, math.nan])
    bad[0].imitation.ParseFromString(bad[0].imitation.SerializeToString() + b"\x20\x01")
    assert violation(bad).field == "detail.imitation.angles"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=240), st.sampled_from([1, 2, 3]))
def test_angles_pass_exactly_when_every_one_is_finite(angles, joints):
    stream = with_motion(angles[: len(angles) // joints * joints] or [0.0] * joints, joints)
    expected = all(map(math.isfinite, stream[0].imitation.angles))
    assert outcome(StreamChecker, stream) == outcome(ExactChecker, stream)
    assert (outcome(StreamChecker, stream)[0] != "finite") == expected


def test_doubles_whose_bytes_look_like_an_infinity_pass():
    # 0xF5 then 0x7F inside a finite double's mantissa: the screen defers it, the rules pass it.
    lookalike = struct.unpack("<d", b"\x00\x00\x00\x00\x00\xf5\x7f\x3f")[0]
    stream = make_stream([lookalike, lookalike])
    stream[0].metrics["odd"] = lookalike
    run_checker(stream, 10)


def test_huge_metrics_beside_a_motion_pass():
    stream = with_motion([0.5])
    stream[0].metrics.update({"a": 1e308, "b": 1e308})
    run_checker(stream, 10)


@pytest.mark.parametrize(
    ("text", "fits"),
    [("é" * 2048, True), ("é" * 2049, False), ("😀" * 1024, True), ("😀" * 1025, False)],
)
def test_completion_bytes_are_counted_beyond_the_screen(text, fits):
    stream = make_stream([0.1, 0.2])
    stream[0].grpo.sample_completions.extend(["short", text])
    if fits:
        run_checker(stream, 10, kind="grpo")
    else:
        err = violation(stream, kind="grpo")
        assert (err.rule, err.episode) == ("detail_size", 1)
        assert err.field == "detail.grpo.sample_completions[1]"


numbers = st.floats(width=64) | st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(numbers, st.dictionaries(st.text(max_size=8), numbers, max_size=4)),
        min_size=1,
        max_size=6,
    ),
    st.data(),
)
def test_screened_and_exact_checks_agree_on_any_numbers(episodes, data):
    stream = make_stream([0.0] * len(episodes))
    best = -math.inf
    for ep, (reward, metrics) in zip(stream, episodes, strict=True):
        best = max(best, reward) if data.draw(st.booleans()) else data.draw(numbers)
        ep.reward, ep.best_reward = reward, best
        ep.metrics.clear()
        ep.metrics.update(metrics)
    assert outcome(StreamChecker, stream) == outcome(ExactChecker, stream)


@settings(max_examples=300, deadline=None)
@given(valid_streams(), st.data(), st.sampled_from(MUTATIONS), st.integers(-3, 3))
def test_screened_and_exact_checks_agree_on_any_mutation(case, data, mutation, shift):
    stream, kind, max_episodes = case
    index = data.draw(st.integers(0, len(stream) - 1))
    mutated = mutate(stream, kind, index, mutation, shift) or stream
    assert outcome(StreamChecker, mutated, max_episodes, kind) == outcome(
        ExactChecker, mutated, max_episodes, kind
    )
