"""Growing the batch as training goes: `AccumScheduler` (scheduler.py) and
its strategies, the noise-scale estimate it acts on (estimate.py), the
probe that measures it on held examples (probe.py), the learning rate
that follows the batch (rate_rules.py) and `SampleSchedule`
(sample_schedule.py)."""
