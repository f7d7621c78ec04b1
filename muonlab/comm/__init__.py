"""Moving matrices between ranks for Newton-Schulz: where they live (specs), the plan (planner,
records), the paths that run it (paths, engine, collectives) and what it costs (cost)."""
