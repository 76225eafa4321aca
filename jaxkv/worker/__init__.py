"""The device side: the page pools, the runner that executes a StepPlan, tier transfers and
the disk journal, streaming, checkpoints, sampling, and the tiers themselves."""
