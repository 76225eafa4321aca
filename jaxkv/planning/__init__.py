"""What a block costs: the cost model, the jitted fetch/recompute/split plan, the planner that
feeds it, and calibration on this machine."""
