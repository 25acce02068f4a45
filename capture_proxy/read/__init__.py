"""The trainer's read side: `open_store`, records, trajectories and exports."""
