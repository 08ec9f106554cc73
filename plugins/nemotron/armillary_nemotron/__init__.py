"""armillary plugin for Nemotron-H (Nemotron-3 Nano): Mamba-2 + attention + relu² MoE."""
