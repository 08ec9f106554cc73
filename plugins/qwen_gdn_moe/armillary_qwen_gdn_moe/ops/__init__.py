"""Family kernels of the Qwen GDN models: naive references now, Triton implementations beside them."""
