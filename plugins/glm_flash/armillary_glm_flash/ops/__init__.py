"""The glm_flash plugin's own kernels: paged multi-head latent attention (MLA) and the router's float32 logits."""
