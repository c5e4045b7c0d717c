"""Wall-clock stage timestamps become durations before any backend sees them (`mrl.tracking.timeline`)."""
from mrl.tracking.prometheus import stage_timings
from mrl.tracking.timeline import StepTimeline, overlap_s


def test_overlap_of_two_intervals():
    assert overlap_s((0, 10), (5, 20)) == 5 and overlap_s((5, 20), (0, 10)) == 5
    assert overlap_s((0, 3), (3, 9)) == 0 and overlap_s((0, 3), (4, 9)) == 0 and overlap_s((2, 4), (0, 9)) == 2


def test_timestamps_are_replaced_by_durations():
    tl = StepTimeline()
    one = tl.durations({"time/train_started_at": 1000.0, "time/train_ended_at": 1003.0, "reward/mean": 0.5,
                        "time/rollout_generate_started_at": 998.0, "time/rollout_generate_ended_at": 1000.0})
    # the first step: nothing before it to measure a period or an overlap against
    assert one == {"time/train": 3.0, "reward/mean": 0.5}
    two = tl.durations({"time/train_started_at": 1004.0, "time/train_ended_at": 1008.5,
                        "time/rollout_generate_started_at": 1001.0, "time/rollout_generate_ended_at": 1004.0})
    # step 2 generated over [1001, 1004] while step 1 trained over [1000, 1003]: 2 s overlap
    assert two == {"time/train": 4.5, "time/step_period": 5.5, "time/rollout_overlap": 2.0}
    three = tl.durations({"time/train_started_at": 1010.0, "time/train_ended_at": 1011.0,
                          "time/rollout_generate_started_at": 1008.5, "time/rollout_generate_ended_at": 1010.0})
    assert three["time/rollout_overlap"] == 0.0 and three["time/step_period"] == 2.5


def test_colocated_steps_have_no_overlap_and_other_metrics_pass_through():
    tl = StepTimeline()
    assert tl.durations({"time/rollout": 1.0}) == {"time/rollout": 1.0}   # no timestamps: unchanged
    tl.durations({"time/train_started_at": 10.0, "time/train_ended_at": 11.0})
    assert tl.durations({"time/train_started_at": 12.0, "time/train_ended_at": 14.0, "time/x_at": 5.0}) == {
        "time/train": 2.0, "time/step_period": 3.0}


def test_derived_durations_are_not_stage_histograms():
    assert stage_timings({"time/train": 3.0, "time/step_period": 4.0, "time/rollout_overlap": 1.0,
                          "time/actor_update": 2.0}) == {"actor_update": 2.0}
