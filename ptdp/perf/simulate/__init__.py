"""Pricing a schedule: the one schedule player (ptdp.schedules.player) with
predicted costs, the lower bound the planner sorts by, and timelines."""
