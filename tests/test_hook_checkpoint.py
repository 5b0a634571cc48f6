"""A stateful comm hook saved with the checkpoint resumes exactly."""

from hook_checkpoint_cases import powersgd_resume


def test_powersgd_state_round_trips_through_a_checkpoint(pools):
    results = pools.run(2, powersgd_resume)
    for uninterrupted, resumed, iterations in results:
        assert resumed == uninterrupted, "resumed training differs from uninterrupted training"
        assert iterations == 8
    assert results[0][0] == results[1][0], "replicas diverged"
