"""armillary plugin for GLM-4.7-Flash (``glm4_moe_lite``): MLA attention, sigmoid-routed MoE, MTP draft head."""
