"""The scheduler side of a step, host only: admission, the step loop's scheduler, and the
StepPlan/StepResult types the runner shares."""
