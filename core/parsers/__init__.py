"""Protocol-neutral tool-call and reasoning parser contracts."""
