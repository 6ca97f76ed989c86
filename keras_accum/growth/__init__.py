"""Growing the batch as training goes: `AccumScheduler` (scheduler.py) and its
strategies (epochs.py, noise_growth.py), the noise-scale estimate (estimate.py)
and probe (probe.py), and the learning rate that follows the batch
(rate_rules.py, sample_schedule.py)."""
